"""A deterministic virtual-time network for running many SWIM cores in one process.

Events (message deliveries and timer ticks) sit in one heap ordered by (time, random
tie-break, sequence): events due at the same instant run in an order drawn from the seeded
RNG, so one seed gives one trace and another seed another.  Nothing here reads a clock.

The network model: per-message latency drawn from a lognormal (median ``latency_s``, shape
``latency_sigma``), independent loss with probability ``loss``, partitions (groups that cannot
reach each other), crashed nodes (their messages vanish), paused nodes (SIGSTOP: everything
for them waits until they resume; timers first, as in an event loop), and CPU-starved nodes
(every event for them runs ``starve_s`` late on average).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gossipd.core.membership import MemberEvent
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

TICK, DELIVER = 0, 1


@dataclass
class NetworkModel:
    latency_s: float = 0.0005
    latency_sigma: float = 0.5
    loss: float = 0.0


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
    ) -> None:
        """``join=False``: members start knowing each other (converged); ``join=True``: each
        starts alone and joins through member 0 as its seed, as real daemons do."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = config or SwimConfig.sim()
        self.net = network or NetworkModel()
        self.now = 0.0
        self._heap: list[tuple[float, float, int, int, int, bytes]] = []
        self._seq = 0
        self.trace = Trace()
        self._keep = keep_events or (lambda e: True)
        self.partitioned = False
        names = [f"n{i:04d}" for i in range(n)]
        addrs = [f"tcp://10.0.{i // 250}.{i % 250 + 1}:7946" for i in range(n)]
        self.by_addr = {a: i for i, a in enumerate(addrs)}
        self.by_name = {nm: i for i, nm in enumerate(names)}
        self.members: list[SimMember] = []
        pairs = list(zip(names, addrs, strict=True))
        for i in range(n):
            seeds = (addrs[0],) if join and i else ()
            core = self._new_core(names[i], addrs[i], seeds=seeds)
            if not join:
                core.bootstrap(0.0, pairs)
            member = SimMember(i, names[i], addrs[i], core)
            self.members.append(member)
            self._schedule(member)

    def _new_core(
        self, name: str, addr: str, seeds: tuple[str, ...], incarnation: int = 0
    ) -> SwimNode:
        node_rng = random.Random(self.rng.getrandbits(64))
        return SwimNode(
            self.config,
            node=name,
            addr=addr,
            rng=node_rng,
            now=self.now,
            seeds=seeds,
            incarnation=incarnation,
        )

    # -- the event loop ----------------------------------------------------------------------

    def _push(self, at: float, kind: int, index: int, data: bytes = b"") -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self.rng.random(), self._seq, kind, index, data))

    def _schedule(self, member: SimMember) -> None:
        if not member.up:
            return
        at = max(member.core.next_deadline(), self.now)
        if at != member.tick_at:
            member.tick_at = at
            self._push(at, TICK, member.index)

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            at, _, _, kind, index, data = heapq.heappop(heap)
            member = self.members[index]
            if not member.up:
                continue
            if kind == TICK and at != member.tick_at:
                continue  # superseded by a later schedule
            if member.paused_until > at:
                # Paused: the event waits; timers run before messages when it resumes.
                later = member.paused_until + (0.0 if kind == TICK else 1e-6)
                if kind == TICK:
                    member.tick_at = later
                self._push(later, kind, index, data)
                continue
            self.now = at
            core = member.core
            if kind == TICK:
                member.tick_at = math.inf
                core.tick(at)
            else:
                core.receive(at, data)
            self._flush(member)
        self.now = t_end

    def _flush(self, member: SimMember) -> None:
        core = member.core
        for addr, data in core.take_outbox():
            dst = self.by_addr.get(addr)
            if dst is None:
                continue
            target = self.members[dst]
            if self.partitioned and target.group != member.group:
                self.trace.lost += 1
                continue
            if self.net.loss and self.rng.random() < self.net.loss:
                self.trace.lost += 1
                continue
            delay = self.net.latency_s * math.exp(self.net.latency_sigma * self.rng.gauss(0.0, 1.0))
            if target.starve_s:
                delay += self.rng.expovariate(1.0 / target.starve_s)
            self.trace.delivered += 1
            self._push(self.now + delay, DELIVER, dst, data)
        for event in core.take_events():
            if self._keep(event):
                self.trace.events.append((member.name, event))
        self._schedule(member)

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
