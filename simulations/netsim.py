"""A deterministic virtual-time network for running many SWIM cores in one process, and
``SimNetwork``: the same network model behind ``SimTransport``s (``gossipd.datagrams.Transport``
in virtual time, for anything written against that protocol).

Events (message deliveries and timer ticks) sit in one heap ordered by (time, random
tie-break, sequence): events due at the same instant run in an order drawn from the seeded
RNG, so one seed gives one trace and another seed another.  Nothing here reads a clock.

The network model: per-message latency drawn from a lognormal (median ``latency_s``, shape
``latency_sigma``), independent loss with probability ``loss``, partitions (groups that cannot
reach each other), crashed nodes (their messages vanish), paused nodes (SIGSTOP: everything
for them waits until they resume; there their due timers run before the messages that
waited, where asyncio's loop reads its sockets first), and CPU-starved nodes (each message
delivered to them ``starve_s`` late on average, drawn per message, so they may be
reordered; their timers are not delayed).

Messages travel as objects (``wire=False``, the default): a member's core encodes each message
it sends only to count its bytes, and the receiver gets the sender's (frozen) message object
instead of decoding those bytes: what decoding them would give, at a fraction of the cost.
A push-pull that fits in one page is not even encoded: its records are objects, most of them
the shared base's, and the core counts its encoded size from the base's encoded records
(``SwimNode.send_page``); a page of a longer exchange comes encoded and is decoded once.
The size limit a receiver enforces on the bytes (``message_bytes_max``) is enforced on the
counted size.  ``wire=True`` sends bytes and decodes them, as a daemon does; one seed gives
the same trace either way (tests/test_swim.py).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gossipd.core.gossip_messages import GossipMessage, PushPull, decode_gossip, encode_gossip
from gossipd.core.membership import MemberEvent, shared_base
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig
from gossipd.datagrams import OnFrame
from gossipd.errors import LocalProtocolError, TransportClosed

TICK, DELIVER = 0, 1


@dataclass
class NetworkModel:
    latency_s: float = 0.0005
    latency_sigma: float = 0.5
    loss: float = 0.0

    def delay_s(self, rng: random.Random, starve_s: float = 0.0) -> float | None:
        """One message's fate: None when it is lost, else its delay.  Draws from ``rng`` in a
        fixed order (loss, latency, the receiver's starvation), so a seed gives one trace.
        (``Simulation._flush`` has a copy inlined: change both.)"""
        if self.loss and rng.random() < self.loss:
            return None
        delay = self.latency_s * math.exp(self.latency_sigma * rng.gauss(0.0, 1.0))
        if starve_s:
            delay += rng.expovariate(1.0 / starve_s)
        return delay


class SimSwimNode(SwimNode):
    """A SWIM core whose sent messages stay objects (with their encoded size) for the
    simulated network to hand over, instead of bytes for the receiver to decode."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.sent_messages: list[tuple[str, GossipMessage, int]] = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def send(self, addr: str, msg: GossipMessage) -> None:
        size = len(encode_gossip(msg))
        self.count_sent(msg, size)
        self.sent_messages.append((addr, msg, size))

    def send_page(self, addr: str, msg: PushPull, size_bytes: int) -> None:
        """A push-pull of a shared table in one page (core/antientropy.py): the object, with
        the size its encoding has (tests/test_swim_shared.py), neither encoded nor decoded."""
        self.count_sent(msg, size_bytes)
        self.sent_messages.append((addr, msg, size_bytes))

    def send_encoded(self, addr: str, name: str, data: bytes) -> None:
        """A page of a push-pull of several pages, already encoded: decoded here once, as its
        receiver would (the rare case: a table larger than a page)."""
        msg = decode_gossip(data, bytes_max=len(data))
        self.count_sent_as(name, len(data))
        self.sent_messages.append((addr, msg, len(data)))

    def take_sent(self) -> list[tuple[str, GossipMessage, int]]:
        out, self.sent_messages = self.sent_messages, []
        return out

    def deliver(self, now: float, msg: GossipMessage, size_bytes: int) -> None:
        """``receive`` of the message's bytes: the size limit, then the message."""
        if size_bytes > self.config.message_bytes_max:
            self.stats.refused += 1
            return
        self.receive_message(now, msg, size_bytes)


@dataclass
class SimMember:
    index: int
    name: str
    addr: str
    core: SwimNode
    up: bool = True
    paused_until: float = 0.0
    starve_s: float = 0.0
    group: int = 0
    tick_at: float = math.inf


@dataclass
class Trace:
    """Everything observable about a run: member events (with the observer) and costs."""

    events: list[tuple[str, MemberEvent]] = field(default_factory=list)
    delivered: int = 0
    lost: int = 0


class Simulation:
    def __init__(
        self,
        n: int,
        *,
        seed: int,
        config: SwimConfig | None = None,
        network: NetworkModel | None = None,
        keep_events: Callable[[MemberEvent], bool] | None = None,
        join: bool = False,
        wire: bool = False,
    ) -> None:
        """``join=False``: members start knowing each other (converged); ``join=True``: each
        starts alone and joins through member 0 as its seed, as real daemons do.  ``wire``:
        messages travel as bytes and are decoded (slower; the same trace)."""
        self.seed = seed
        self.wire = wire
        self.rng = random.Random(seed)
        self.config = config or SwimConfig.sim()
        self.net = network or NetworkModel()
        self.now = 0.0
        # (at, tie-break, seq, kind, member, message: bytes with wire else object, its size)
        self._heap: list[tuple[float, float, int, int, int, object, int]] = []
        self._seq = 0
        self.trace = Trace()
        self._keep = keep_events or (lambda e: True)
        self.partitioned = False
        names = [f"n{i:04d}" for i in range(n)]
        addrs = [f"tcp://10.0.{i // 250}.{i % 250 + 1}:7946" for i in range(n)]
        self.by_addr = {a: i for i, a in enumerate(addrs)}
        self.by_name = {nm: i for i, nm in enumerate(names)}
        self.members: list[SimMember] = []
        # Converged start: every member's table shares one copy-on-write table of all N
        # (membership.shared_base): O(N) time and memory in all, not N tables of N entries.
        base = None if join else shared_base(list(zip(names, addrs, strict=True)), 0.0)
        for i in range(n):
            seeds = (addrs[0],) if join and i else ()
            core = self._new_core(names[i], addrs[i], seeds=seeds)
            if base is not None:
                core.bootstrap_shared(0.0, base)
            member = SimMember(i, names[i], addrs[i], core)
            self.members.append(member)
            self._schedule(member)

    def _new_core(
        self, name: str, addr: str, seeds: tuple[str, ...], incarnation: int = 0
    ) -> SwimNode:
        node_rng = random.Random(self.rng.getrandbits(64))
        # wire: the daemon's own core (bytes encoded and decoded); else messages as objects.
        core = SwimNode if self.wire else SimSwimNode
        return core(
            self.config,
            node=name,
            addr=addr,
            rng=node_rng,
            now=self.now,
            seeds=seeds,
            incarnation=incarnation,
        )

    # -- the event loop ----------------------------------------------------------------------

    def _push(
        self, at: float, kind: int, index: int, msg: object = None, size_bytes: int = 0
    ) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self.rng.random(), self._seq, kind, index, msg, size_bytes))

    def _schedule(self, member: SimMember) -> None:
        if not member.up:
            return
        at = max(member.core.next_deadline(), self.now)
        if at != member.tick_at:
            member.tick_at = at
            self._push(at, TICK, member.index)

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        members = self.members
        pop = heapq.heappop
        wire = self.wire
        while heap and heap[0][0] <= t_end:
            at, _, _, kind, index, msg, size = pop(heap)
            member = members[index]
            if not member.up:
                continue
            if kind == TICK and at != member.tick_at:
                continue  # superseded by a later schedule
            if member.paused_until > at:
                # Paused: the event waits; timers run before messages when it resumes.
                later = member.paused_until + (0.0 if kind == TICK else 1e-6)
                if kind == TICK:
                    member.tick_at = later
                self._push(later, kind, index, msg, size)
                continue
            self.now = at
            core = member.core
            if kind == TICK:
                member.tick_at = math.inf
                core.tick(at)
            elif wire:
                core.receive(at, msg)  # type: ignore[arg-type]
            else:
                core.deliver(at, msg, size)  # type: ignore[attr-defined]
            self._flush(member)
        self.now = t_end

    def _flush(self, member: SimMember) -> None:
        core = member.core
        if self.wire:
            sent = [(addr, data, len(data)) for addr, data in core.take_outbox()]
        else:
            sent = core.take_sent()  # type: ignore[attr-defined]
        rng, now, heap = self.rng, self.now, self._heap
        if sent:
            # _push and NetworkModel.delay_s inlined (the same draws in the same order).
            by_addr, members, trace = self.by_addr, self.members, self.trace
            net, push, draw, gauss, exp = self.net, heapq.heappush, rng.random, rng.gauss, math.exp
            loss, latency_s, sigma = net.loss, net.latency_s, net.latency_sigma
            for addr, msg, size in sent:
                dst = by_addr.get(addr)
                if dst is None:
                    continue
                target = members[dst]
                if self.partitioned and target.group != member.group:
                    trace.lost += 1
                    continue
                if loss and draw() < loss:
                    trace.lost += 1
                    continue
                delay = latency_s * exp(sigma * gauss(0.0, 1.0))
                if target.starve_s:
                    delay += rng.expovariate(1.0 / target.starve_s)
                trace.delivered += 1
                self._seq += 1
                push(heap, (now + delay, draw(), self._seq, DELIVER, dst, msg, size))
        events = core.take_events()
        if events:
            keep, name, kept = self._keep, member.name, self.trace.events
            for event in events:
                if keep(event):
                    kept.append((name, event))
        # _schedule inlined.
        if member.up:
            at = core.next_deadline()
            if at < now:
                at = now
            if at != member.tick_at:
                member.tick_at = at
                self._seq += 1
                heapq.heappush(heap, (at, rng.random(), self._seq, TICK, member.index, None, 0))

    # -- faults ------------------------------------------------------------------------------

    def crash(self, index: int) -> None:
        member = self.members[index]
        member.up = False
        member.tick_at = math.inf

    def restart(self, index: int, seeds: int = 3) -> None:
        """A new process with the same name and address joins through a few live seeds."""
        member = self.members[index]
        live = [m.addr for m in self.members if m.up and m.index != index]
        chosen = tuple(self.rng.sample(live, min(seeds, len(live))))
        member.core = self._new_core(member.name, member.addr, seeds=chosen)
        member.up = True
        member.paused_until = 0.0
        member.tick_at = math.inf
        self._schedule(member)

    def pause(self, index: int, duration_s: float) -> None:
        member = self.members[index]
        member.paused_until = max(member.paused_until, self.now + duration_s)

    def starve(self, index: int, mean_delay_s: float) -> None:
        self.members[index].starve_s = mean_delay_s

    def partition(self, groups: list[list[int]]) -> None:
        for g, indices in enumerate(groups):
            for i in indices:
                self.members[i].group = g
        self.partitioned = True

    def heal(self) -> None:
        self.partitioned = False

    # -- observations ----------------------------------------------------------------------------

    def live(self) -> list[SimMember]:
        return [m for m in self.members if m.up]

    def checksums(self) -> set[int]:
        return {m.core.table.checksum() for m in self.members if m.up}

    def cost(self) -> tuple[int, int]:
        """(messages, bytes) sent so far by all live members."""
        msgs = sum(sum(m.core.stats.sent.values()) for m in self.members if m.up)
        return msgs, sum(m.core.stats.sent_bytes for m in self.members if m.up)


# -- Transports in virtual time ---------------------------------------------------------------


class Receiver(Protocol):
    """What is bound at an address of a ``SimNetwork``: a ``SimTransport``, or the fan-out
    peer channel's servers and connections (simulations/peerchannel.py)."""

    def _deliver(self, frame: object) -> None: ...


def node_of(addr: str) -> str:
    """The node an address belongs to, for partitions: ``sim://NODE`` or ``sim://NODE/...``."""
    return addr.removeprefix("sim://").partition("/")[0]


class SimNetwork:
    """Connected ``SimTransport``s over the network model, in virtual time.

    A send draws the frame's fate from the network's seeded RNG (loss, then a lognormal delay)
    and queues its delivery; ``run_until`` / ``run_until_idle`` deliver due frames in time
    order (ties in an order drawn from the RNG) to the receiving transport's ``on_frame``.
    Frames from one transport to one address never overtake each other: a frame is delivered
    no earlier than the one sent before it on that path.  ``partition`` makes groups of
    transports unable to reach each other (frames between them are lost) until ``heal``.
    At most ``inflight_max`` frames per path are in flight; a send beyond that returns False,
    as a full ZeroMQ queue does.  A frame is any object: bytes for a ``SimTransport``, the
    peer channel's (identity, frame, sender) for its server."""

    def __init__(
        self, *, seed: int, model: NetworkModel | None = None, inflight_max: int = 10_000
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.model = model or NetworkModel()
        self.inflight_max = inflight_max
        self.now = 0.0
        self._heap: list[tuple[float, float, int, str, str, object]] = []
        self._seq = 0
        self._bound: dict[str, Receiver] = {}
        self._last_at: dict[tuple[str, str], float] = {}  # per path: the latest delivery time
        self._inflight: dict[tuple[str, str], int] = {}
        self._group: dict[str, int] = {}  # transport name -> partition group
        self.sent = 0
        self.delivered = 0
        self.lost = 0  # by the model or a partition
        self.undeliverable = 0  # nobody bound at the address when the frame arrived
        self.dropped_full = 0  # refused at send: inflight_max on that path

    def new_transport(self, name: str) -> SimTransport:
        """A transport named ``name``; bound, it receives at ``sim://NAME``."""
        return SimTransport(self, name)

    def partition(self, groups: list[list[str]]) -> None:
        """Transports (by name) in different groups cannot reach each other; one in no group
        is in group 0."""
        self._group = {name: g for g, names in enumerate(groups) for name in names}

    def heal(self) -> None:
        self._group = {}

    def _send(self, src: str, addr: str, frame: object) -> bool:
        path = (src, addr)
        inflight = self._inflight.get(path, 0)
        if inflight >= self.inflight_max:
            self.dropped_full += 1
            return False
        self.sent += 1
        if self._group and self._group.get(src, 0) != self._group.get(node_of(addr), 0):
            self.lost += 1
            return True
        delay = self.model.delay_s(self.rng)
        if delay is None:
            self.lost += 1
            return True
        at = max(self.now + delay, math.nextafter(self._last_at.get(path, -math.inf), math.inf))
        self._last_at[path] = at
        self._inflight[path] = inflight + 1
        self._seq += 1
        heapq.heappush(self._heap, (at, self.rng.random(), self._seq, src, addr, frame))
        return True

    def run_until(self, t_end: float) -> None:
        """Deliver every frame due by ``t_end`` (and those their handlers send that are due by
        then); the clock ends at ``t_end``."""
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            at, _, _, src, addr, frame = heapq.heappop(heap)
            self.now = at
            path = (src, addr)
            self._inflight[path] -= 1
            target = self._bound.get(addr)
            if target is None:
                self.undeliverable += 1
                continue
            self.delivered += 1
            target._deliver(frame)
        self.now = max(self.now, t_end)

    def run_until_idle(self, limit_s: float = 3600.0) -> None:
        """Deliver until nothing is in flight (or ``limit_s`` of virtual time has passed)."""
        end = self.now + limit_s
        while self._heap and self._heap[0][0] <= end:
            self.run_until(self._heap[0][0])


class SimTransport:
    """``gossipd.datagrams.Transport`` on a ``SimNetwork``: frames are delivered when the
    simulation runs, to the handler of whichever transport is bound at the address then."""

    def __init__(self, network: SimNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self.addr = f"sim://{name}"
        self._on_frame: OnFrame | None = None
        self._closed = False

    def bind(self, addr: str, on_frame: OnFrame) -> str:
        """Receive at ``sim://NAME`` (``addr`` is ignored: a simulated node has one address)."""
        if self._closed:
            raise TransportClosed("bind on a closed transport")
        if self._on_frame is not None or self.addr in self.network._bound:
            raise LocalProtocolError(f"{self.addr} is already bound")
        self._on_frame = on_frame
        self.network._bound[self.addr] = self
        return self.addr

    def send(self, addr: str, frame: bytes) -> bool:
        if self._closed:
            raise TransportClosed("send on a closed transport")
        return self.network._send(self.name, addr, frame)

    def _deliver(self, frame: object) -> None:
        assert self._on_frame is not None and isinstance(frame, bytes)
        self._on_frame(frame)

    def close(self) -> None:
        """Stop receiving; frames already sent by this transport still travel."""
        if self._closed:
            return
        self._closed = True
        if self.network._bound.get(self.addr) is self:
            del self.network._bound[self.addr]
