"""The membership shell: runs one SwimNode on the asyncio loop over ZeroMQ.

Datagrams go through a ``Transport`` (datagrams.py): a ZmqTransport, which binds a PULL
socket (by default spoken by the loop itself, ``gossip.receiver``) and sends to each peer through a PUSH socket from the daemon's socket pool, connected
to the peer's gossip address.  Sends never block: when a peer's queue is full the message is
dropped and counted, as UDP would drop it; SWIM is built for loss.  A dropped connection to a
peer (its socket monitor) makes the core probe that member at once; the core also asks for
port checks (a dropped connection, a late ack), which run here as one TCP connect each
(portcheck.py): a refused connect is evidence of a crash (core/refusal.py).

Time: the core gets ``now()``: the wall clock's reading at start, advanced by the monotonic
clock.  Wall-clock seconds, because probe targets follow a schedule shared by all members
(round = floor(now / probe_interval)); advanced by the monotonic clock, because a step of the
host's clock must not stop failure detection (NTP setting it back ten minutes would leave
every timer ten minutes away) nor fire every timer at once (set forward).  The hosts' clocks
agree at start within NTP's error, and the monotonic clock runs at NTP's corrected rate, so
members keep to one schedule; a step after start only shifts that member's rounds.

Member events are logged as JSON lines ("member" with event, member, incarnation, by, at) so
that tests and the cluster harness can measure from the logs; every ``at`` here is
membership's time, ``now()`` (the wall clock where the host's clock was not stepped).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import Config, split_seed
from gossipd.core.addresses import AMBIGUOUS, AddressIndex
from gossipd.core.gossip_messages import Directive, GpuState, LoadRecord, Term
from gossipd.core.membership import LIVE_STATES, Member, MemberEvent, State
from gossipd.core.refusal import PortCheck
from gossipd.core.swim import SwimNode
from gossipd.datagrams import ZmqTransport
from gossipd.engines.base import Engine
from gossipd.hostnames import HostNames
from gossipd.looppull import LoopPullServer, loop_binds
from gossipd.membership.gpu import GpuProbe
from gossipd.membership.portcheck import connection_refused
from gossipd.security import DOMAIN_PEERS, Security, node_of
from gossipd.sockets import SocketPool

log = logging.getLogger("gossipd.membership.gossip")

PEER_SOCKETS_MAX = 4096
PEER_IDLE_S = 120.0
PORT_CHECK_TIMEOUT_S = 1.0  # a connect that takes longer decides nothing


@dataclass(frozen=True, slots=True)
class MemberView:
    node: str
    state: str
    incarnation: int
    addr: str
    gpu: GpuState | None


class GossipService:
    def __init__(
        self,
        config: Config,
        *,
        node: str,
        sockets: SocketPool,
        engine: Engine,
        ingress_endpoint: str,
        rng: random.Random,
        version: str = "",
        security: Security | None = None,
        clock: Clock = SYSTEM_CLOCK,
        rpc_endpoint: str = "",
        model: str = "",
        load: Callable[[], int] = lambda: 0,
        prefixes: Callable[[], list[int]] = list,
        names: HostNames | None = None,
    ) -> None:
        """``rpc_endpoint``: where peers forward tasks; ``model``: the model we serve;
        ``load``: our in-flight task count; ``prefixes``: a summary of the prefixes we hold;
        ``names``: where members' host names are looked up (hostnames.py)."""
        g = config.gossip
        self._clock = clock
        # now()'s origin: the wall clock at start, then the monotonic clock's progress.
        self._wall_at_start = clock.wall() - clock.monotonic()
        self.config = config
        self.node = node
        self.swim_config = g.swim_config(cluster=config.node.cluster)
        self._engine = engine
        self._ingress = ingress_endpoint
        self._version = version
        self._rng = rng  # the member's protocol RNG (derived from node.seed)
        # Seeds may name their node ("NODE@ADDR"): the key to expect at that address.
        self._seeds = [split_seed(seed) for seed in config.gossip.seeds]
        self._addresses = AddressIndex()  # node_at's: who claims which address
        self._security = security if security is not None and security.curve else None
        receiver = None
        # The PULL on the loop (bounded in bytes: datagrams.py); an address it does not
        # bind (an ipc:// path, an interface's name) stays libzmq's.
        if g.receiver == "loop" and loop_binds(g.bind):
            receiver = LoopPullServer(
                message_bytes_max=self.swim_config.message_bytes_max,
                curve=None if self._security is None else self._security.loop_peer_curve(),
                refused_lines_per_s=config.log.refused_lines_per_s,
            )
        self.transport = ZmqTransport(
            sockets,
            sockets_max=PEER_SOCKETS_MAX,
            idle_s=PEER_IDLE_S,
            message_bytes_max=self.swim_config.message_bytes_max,
            on_disconnect=self._on_disconnect,
            serve_curve=None
            if self._security is None
            else (lambda sock: security.serve(sock, DOMAIN_PEERS)),  # type: ignore[union-attr]
            accept=None if self._security is None else self._accept,
            names=names,
            receiver=receiver,
        )
        self.core: SwimNode | None = None
        self.advertise = ""
        self.status = "serving"
        self.dropped_sends = 0
        self.sends_unkeyed = 0  # (in dropped_sends too) to an address no member's key is for
        self.disconnect_hints = 0
        self.port_checks = 0
        self._checks: set[asyncio.Task[None]] = set()
        self._gpu_probe = GpuProbe(
            config.node.gpu_index, static_memory_total_mb=config.gpu.memory_total_mb
        )
        self._last_published: GpuState | None = None
        self._last_published_at = 0.0
        self._wake = asyncio.Event()
        self.listeners: list[Callable[[MemberEvent], None]] = []
        # Terms that raised ours and directives our fence admitted (gossipd/leader/).
        self.leadership_listeners: list[Callable[[Term | Directive], None]] = []
        self.rpc_endpoint = rpc_endpoint
        self.model = model
        self.load = load
        self.prefixes = prefixes
        self.last_gpu_state: GpuState | None = None  # our latest sample (placement reads it)
        # Take the load records a gossip message carried (membership/loadgossip.py).
        self.load_listeners: list[Callable[[list[LoadRecord]], None]] = []

    def now(self) -> float:
        """The SWIM core's time (module docstring): wall-clock seconds without the host
        clock's steps since start.  Member.state_since and every core deadline are in it."""
        return self._wall_at_start + self._clock.monotonic()

    def bind(self) -> str:
        bound = self.transport.bind(self.config.gossip.bind, self._on_frame)
        self.advertise = self.config.gossip.advertise or bound
        self.core = SwimNode(
            self.swim_config,
            node=self.node,
            addr=self.advertise,
            rng=self._rng,
            now=self.now(),
            seeds=[addr for _, addr in self._seeds],
            on_loads=self._on_loads,
        )
        return self.advertise

    def _on_loads(self, records: list[LoadRecord]) -> None:
        for listener in self.load_listeners:
            listener(records)

    def _accept(self, sender: str, frame: bytes) -> bool:
        """CURVE: a datagram from the member whose key is ``sender``'s ("NODE KEY") must say
        it is from that node (its ``src``); undecodable ones go on to the core, which counts
        them."""
        assert self._security is not None
        try:
            src = _src_decoder.decode(frame).src
        except (msgspec.DecodeError, RecursionError):
            src = node_of(sender)
        return self._security.peer_allowed(sender, src, "gossip")

    def member(self, name: str) -> Member | None:
        """``name``'s entry in our member table, if we know it."""
        core = self.core
        return None if core is None else core.table.members.get(name)

    def alive(self, name: str) -> bool:
        """Is ``name`` alive in our view (not suspect, dead, left or unknown)?"""
        member = self.member(name)
        return member is not None and member.state is State.ALIVE

    def node_at(self, addr: str) -> str | None:
        """The member serving ``addr`` (its gossip or rpc address; None where two claim it:
        core/addresses.py), or the seed named there."""
        if self.core is not None:
            table = self.core.table
            node = self._addresses.lookup(table.members, table.addresses_version, addr)
            if node is not None:
                return node if node != AMBIGUOUS else None
        return next((node for node, seed in self._seeds if seed == addr and node), None)

    def addresses_version(self) -> object:
        """Moves when the member at an address may have changed (node_at's answers)."""
        return None if self.core is None else self.core.table.addresses_version

    @property
    def addresses_ambiguous(self) -> int:
        """Addresses two members claim (no connection proves a key there)."""
        return self._addresses.ambiguous

    # -- the loop ----------------------------------------------------------------------------

    def _on_frame(self, frame: bytes) -> None:
        """A datagram (in the transport's fd callback): into the core now; what it answers
        leaves when run_forever wakes (once for a burst of datagrams)."""
        if self.core is not None:
            self.core.receive(self.now(), frame)
            self._wake.set()

    async def run_forever(self) -> None:
        assert self.core is not None, "bind() first"
        core = self.core
        self._publish_meta(force=True)
        self._flush()
        while True:
            wait_s = max(0.0, core.next_deadline() - self.now())
            await woken_within(wait_s, self._wake)
            now = self.now()
            if now >= core.next_deadline():
                core.tick(now)
            self._flush()

    async def publish_meta_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.gossip.meta_sample_s)
            self._publish_meta(force=False)

    def _gpu_state(self) -> GpuState:
        reading = self._gpu_probe.read()
        stats = self._engine.stats()
        return GpuState(
            gpu_index=self.config.node.gpu_index,
            ingress=self._ingress,
            model=self.model,
            memory_free_mb=reading.memory_free_mb,
            memory_total_mb=reading.memory_total_mb,
            utilization_pct=reading.utilization_pct,
            running_requests=stats.running_requests,
            waiting_requests=stats.waiting_requests,
            kv_cache_usage_ratio=min(1.0, max(0.0, stats.kv_cache_usage_ratio)),
            capacity_weight=self.config.gpu.capacity_weight,
            status=self.status,  # type: ignore[arg-type]
            software_version=self._version,
            rpc=self.rpc_endpoint,
            inflight=self.load(),
            prefixes=self.prefixes(),
            queued_tokens=stats.queued_tokens,
        )

    def _publish_meta(self, *, force: bool) -> None:
        """Publish GPU state when it changed, at most every meta_publish_min_s (status changes
        go out at once: draining and unhealthy must not wait)."""
        assert self.core is not None
        gpu = self.last_gpu_state = self._gpu_state()
        now = self.now()
        last = self._last_published
        if not force and last == gpu:
            return
        status_changed = last is None or last.status != gpu.status
        if (
            not force
            and not status_changed
            and now - self._last_published_at < self.config.gossip.meta_publish_min_s
        ):
            return
        self.core.set_gpu(now, gpu)
        self._last_published, self._last_published_at = gpu, now
        self._wake.set()

    def set_status(self, status: str) -> None:
        self.status = status
        if self.core is not None:
            self._publish_meta(force=False)

    def announce(self) -> None:
        """Re-announce ourselves with a new incarnation (SIGUSR1; used to measure spreading)."""
        assert self.core is not None
        self.core.announce(self.now())
        log.info(
            "announced",
            extra={"incarnation": self.core.table.incarnation, "at": self.now()},
        )
        self._wake.set()

    async def leave(self, linger_s: float | None = None) -> None:
        """Tell the cluster we leave (not a failure), and give it a few gossip rounds."""
        assert self.core is not None
        self.core.leave(self.now())
        self._flush()
        await asyncio.sleep(
            linger_s if linger_s is not None else 3 * self.swim_config.gossip_interval_s
        )

    def publish_term(self, term: Term) -> None:
        """We lead: gossip our term (urgent), news or not."""
        assert self.core is not None
        self.core.publish_term(self.now(), term)
        self._flush()
        self._wake.set()  # the gossip round it starts is due now

    def publish_directive(self, directive: Directive) -> bool:
        """We lead: apply and gossip a directive (False: our own fence refused it)."""
        assert self.core is not None
        admitted = self.core.publish_directive(self.now(), directive)
        self._flush()
        self._wake.set()
        return admitted

    def _flush(self) -> None:
        assert self.core is not None
        for check in self.core.take_port_checks():
            task = asyncio.get_running_loop().create_task(self._check_port(check))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        for addr, data in self.core.take_outbox():
            self._send(addr, data)
        for item in self.core.take_leadership():
            for on_leadership in self.leadership_listeners:
                on_leadership(item)
        for event in self.core.take_events():
            extra: dict[str, object] = {
                "event": event.kind,
                "member": event.node,
                "incarnation": event.incarnation,
                "by": event.by,
                "at": event.at,
            }
            member = self.core.table.members.get(event.node)
            if event.kind == "meta" and member is not None and member.gpu is not None:
                gpu = member.gpu
                extra.update(
                    model=gpu.model,
                    status=gpu.status,
                    running=gpu.running_requests,
                    waiting=gpu.waiting_requests,
                    kv_cache=round(gpu.kv_cache_usage_ratio, 3),
                )
            log.info("member", extra=extra)
            for listener in self.listeners:
                listener(event)

    def _send(self, addr: str, data: bytes) -> None:
        security = self._security
        if security is not None and security.peer_server_key(addr) is None:
            # Under CURVE a connection there could not prove a key, so nothing would arrive;
            # a socket made for it would hold what is sent until it idles out, 64 messages
            # of up to a push-pull page each, for each of 4,096 addresses (a member can name
            # any address as a PushPull's src_addr, to be answered there).
            self.dropped_sends += 1
            self.sends_unkeyed += 1
            return
        if not self.transport.send(addr, data):
            self.dropped_sends += 1

    send = _send  # load gossip (membership/loadgossip.py) sends on the same transport

    def _on_disconnect(self, addr: str) -> None:
        """The connection to ``addr`` dropped (a killed peer's TCP reset): the core probes
        that member at once and asks for a check of its port.  A hint only: the probe or a
        refused connect decides."""
        if self.core is None:
            return
        # The member there now: a live one before a dead one kept under an old name (a
        # daemon renamed and restarted on the same port), which would take the hint.
        there = [m for m in self.core.table.members.values() if m.addr == addr]
        live = [m for m in there if m.state in LIVE_STATES]
        node = (live or there)[0].node if there else None
        if node is not None:
            self.disconnect_hints += 1
            self.core.connection_lost(self.now(), node)
            self._wake.set()

    async def _check_port(self, check: PortCheck) -> None:
        """Connect to the member's gossip port; tell the core whether it was refused."""
        self.port_checks += 1
        refused = await connection_refused(check.addr, PORT_CHECK_TIMEOUT_S)
        if self.core is None:
            return
        verdict = self.core.port_checked(self.now(), check, refused=refused)
        if refused:
            log.info(
                "member port refused",
                extra={
                    "member": check.node,
                    "addr": check.addr,
                    "incarnation": check.incarnation,
                    "verdict": verdict,
                    "at": self.now(),
                },
            )
        self._wake.set()

    def close(self) -> None:
        for task in list(self._checks):
            task.cancel()
        self.transport.close()

    def set_seeds(self, seeds: list[str]) -> None:
        """Seeds learnt after start-up ("NODE@ADDR" or "ADDR", from etcd): while we know no
        live member, we push-pull with them at once (core/antientropy.py)."""
        assert self.core is not None
        self._seeds = [split_seed(seed) for seed in seeds]
        self.core.antientropy.set_seeds([addr for _, addr in self._seeds], self.now())
        self._wake.set()

    # -- queries -----------------------------------------------------------------------------

    def live_members(self) -> list[MemberView]:
        assert self.core is not None
        return [
            MemberView(m.node, m.state.value, m.incarnation, m.addr, m.gpu)
            for m in self.core.table.members.values()
            if m.state in LIVE_STATES
        ]


class _Src(msgspec.Struct):
    src: str = ""


_src_decoder = msgspec.msgpack.Decoder(_Src)


async def woken_within(timeout_s: float, wake: asyncio.Event) -> None:
    """Return when ``wake`` is set (clearing it) or ``timeout_s`` has passed."""
    if not wake.is_set():
        try:
            async with asyncio.timeout(timeout_s):
                await wake.wait()
        except TimeoutError:
            pass
    wake.clear()
