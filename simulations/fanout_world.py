"""The world of a whole-daemon run: every simulated daemon (fanout_daemon.py), the producers
(fanout_producers.py), the network (fanout_network.py), the faults and journals
(fanout_faults.py) and the invariant checks (fanout_checks.py), driven by one event heap in
virtual time and one ``random.Random`` seeded by the run, so a seed replays the same trace.

This module owns the state they share, the event loop (``push``, ``step``) and the wiring of
the cores' outboxes and events to the network and the producer (``flush_forwarder``,
``flush_swim``, ``answer``)."""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from gossipd.config import FanoutConfig, IngressConfig
from gossipd.core.gossip_messages import Meta
from gossipd.core.journeys import ForwarderSettings, Refuse, RunHere
from gossipd.core.messages import Result, Task, error_result
from gossipd.core.peer_messages import Forward, Withdraw
from gossipd.core.swim_config import SwimConfig
from simulations.fanout_checks import Checks
from simulations.fanout_daemon import SimDaemon
from simulations.fanout_faults import Faults
from simulations.fanout_network import Network
from simulations.fanout_producers import Producers, TaskState
from simulations.fanout_run import (
    ABORTED,
    ARRIVAL,
    CANCEL,
    EXPIRE,
    FAULT,
    FAULT_KINDS,
    FINISH,
    FW_TICK,
    KEY_OF_SRC,
    PEER_MSG,
    RESUBMIT,
    SWIM_MSG,
    SWIM_TICK,
    TO_PRODUCER,
    FanoutRun,
)


@dataclass
class World(Producers, Faults, Network, Checks):
    """The run's state and event loop; the producers, network, faults and checks are mixed in
    (each its own module), so each reads and writes the state here by ``self``."""

    run: FanoutRun
    rng: random.Random = field(init=False)
    now: float = 0.0

    def __post_init__(self) -> None:
        run = self.run
        self.rng = random.Random(run.seed)
        self.swim_config = SwimConfig.sim()
        self.fanout_config = FanoutConfig(hedge=run.hedge)
        self.ingress_bytes_max = IngressConfig().message_bytes_max
        self.forwarder_settings = ForwarderSettings.of(self.fanout_config, retry_after_ms=200)
        self.heap: list[tuple[float, float, int, int, int, object]] = []
        self.seq = 0
        self.refused_saturated = 0  # Forwards refused by the owner check
        self.digest = hashlib.blake2b(digest_size=16)
        self.events = 0
        names = [f"d{i:04d}" for i in range(run.nodes)]
        self.by_name = {n: i for i, n in enumerate(names)}
        # Membership speaks to gossip endpoints (validated on decode), fan-out to node names.
        self.swim_addrs = [f"tcp://10.1.{i // 250}.{i % 250 + 1}:7946" for i in range(run.nodes)]
        self.by_addr = {a: i for i, a in enumerate(self.swim_addrs)}
        self.daemons: list[SimDaemon] = []
        self.up: list[bool] = [True] * run.nodes
        self.paused_until: list[float] = [0.0] * run.nodes
        self.group: list[int] = [0] * run.nodes
        # Partitions by their number (the members each cut off) and, per member, how many
        # cut it off now: it is back in group 0 when the last of them heals.
        self.partitions: list[list[int]] = []
        self.cuts: list[int] = [0] * run.nodes
        self.crashed_at: dict[tuple[int, int], float] = {}
        self.loss = 0.0
        self.link_last: dict[tuple[int, int], float] = {}
        # task id -> (task, forwarder, accepted at, received at: its deadline's base)
        self.journals: list[dict[str, tuple[Task, str, float, float]]] = [{} for _ in names]
        self.journal_done_at: list[dict[str, float]] = [{} for _ in names]
        for i in range(run.nodes):
            d = SimDaemon(self, i, 0, [])
            self.daemons.append(d)
        pairs = list(zip(names, self.swim_addrs, strict=True))
        for d in self.daemons:
            d.swim.bootstrap(0.0, pairs)
            # As converged: every member's GPU state (its rpc address) known to all.
            d.swim.table.publish_meta(d.gpu)
            for other in self.daemons:
                if other is not d:
                    meta = Meta(node=other.name, version=1, gpu=other.gpu, incarnation=0)
                    d.swim.table.apply(meta, 0.0)
            d.placement.rebuild(d.swim.table.members.values())
            self.schedule(d)
        # Producer state.
        self.tasks: dict[str, TaskState] = {}
        self.sent = 0
        self.rate = run.load * run.nodes * run.slots / run.service_s
        self.keys = run.keys or max(1, run.tasks // 20)
        self.next_entry = 0
        # Observations.
        self.running_on: dict[str, list[tuple[int, int, int]]] = {}  # id -> (node, epoch, attempt)
        self.resubmitted_two_runs = 0
        self.two_runs: list[tuple[str, int, int, int, float]] = []  # id, first, epoch, second, t
        self.withdraws_sent: set[tuple[str, str]] = set()  # (member, task id)
        self.results_sent: set[tuple[int, int, str]] = set()  # (daemon, epoch, task id)
        self.violations: list[dict[str, object]] = []
        self.duplicates_dropped = 0
        self.duplicates_accepted = 0
        self.duplicates_by_fault: dict[str, int] = {}
        self.duplicate_ids: list[str] = []  # the first few, for --trace
        self.active_faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.faults_log: list[tuple[float, str]] = []
        self.fault_spans: list[tuple[str, tuple[float, float]]] = []
        self.served_at: list[float] = []
        self.latencies: list[float] = []  # first send to ok (what the producer waits)
        self.attempt_latencies: list[float] = []  # the send that was served to its ok
        self.errors: dict[str, int] = {}
        self.cancels_sent = 0
        # Cancels by what the daemon that got one did (as the intake counts them): "here",
        # "forwarded" (passed on to the member running it), "refused" (another key's), "unknown".
        self.cancels: Counter[str] = Counter()
        self.restarted = 0  # copies that came while their withdrawn run was aborted
        self.replays_known_elsewhere = 0  # journaled tasks a restart left to a member
        self.trace_lines: list[str] = []

    # -- the event loop -------------------------------------------------------------------

    def push(self, at: float, kind: int, node: int, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.rng.random(), self.seq, kind, node, payload))

    def schedule(self, d: SimDaemon) -> None:
        at = max(d.swim.next_deadline(), self.now)
        if at < d.swim_tick_at:
            d.swim_tick_at = at
            self.push(at, SWIM_TICK, d.index, d.epoch)

    def flush_forwarder(self, d: SimDaemon) -> None:
        fw = d.forwarder
        for addr, msg in fw.take_outbox():
            if isinstance(msg, Withdraw):
                self.withdraws_sent.add((addr, msg.id))
                self.trace(msg.id, d.name, f"withdraws it from {addr}")
            elif isinstance(msg, Forward):
                self.trace(msg.task.id, d.name, f"forwards it to {addr} (attempt {msg.attempt})")
            self.send_peer(d, addr, msg)
        answered = False
        for event in fw.take_events():
            if isinstance(event, RunHere):  # as the daemon's Dispatcher answers it
                verdict = d.admit(event.task, event.received_at, forwarder="")
                fw.local_verdict(event.task.id, verdict, self.now)
                answered = True
            elif isinstance(event, Refuse):
                self.answer(
                    d,
                    event.task,
                    error_result(
                        event.task.id,
                        event.code,
                        event.message,
                        retry_after_ms=event.retry_after_ms,
                    ),
                )
        if answered:
            self.flush_forwarder(d)  # what the forwarder did next
            return
        self.schedule_forwarder(d)

    def schedule_forwarder(self, d: SimDaemon) -> None:
        """One timer for the forwarder's, the held Results' and a restart's replay
        deadlines (FW_TICK)."""
        at = max(
            min(d.forwarder.next_deadline(), d.held.next_deadline(), d.replay_deadline()),
            self.now,
        )
        if at < d.fw_tick_at:
            d.fw_tick_at = at
            self.push(at, FW_TICK, d.index, d.epoch)

    def flush_swim(self, d: SimDaemon) -> None:
        for addr, data in d.swim.take_outbox():
            dst = self.by_addr.get(addr)
            if dst is not None:
                self.deliver(d.index, dst, SWIM_MSG, data, lossy=True)
        events = d.swim.take_events()
        if events and d.replay_check is not None:
            d.replay_step()  # a first member: a restart asks it
        for event in events:
            d.placement.member_event(event, d.swim.table.members.get(event.node))
            d.held.member_event(event.kind, event.node, self.now)
            if event.kind in ("dead", "left"):  # (as fanout/owner.py's member_event)
                d.owner.member_dead(event.node)
            if len(d.held) or event.kind == "left":
                d.flush_held()
            if event.kind == "dead":
                if self.run.trace_task:
                    self.trace_lines.append(
                        f"{self.now:12.6f}  {d.name:>9}  declares {event.node} dead"
                    )
                d.forwarder.member_dead(event.node, self.now)
                self.flush_forwarder(d)
        self.schedule(d)

    def answer(self, d: SimDaemon, task: Task, result: Result) -> None:
        if result.ok and task.id in d.withdrawn_before_run:
            self.violation("answer_after_withdraw", task.id, d.name)
        self.trace(task.id, d.name, f"answers {'ok' if result.ok else result.error.code}")  # type: ignore[union-attr]
        self.to_producer(d, result)

    def step(self) -> bool:
        if not self.heap:
            return False
        at, _, _, kind, node, payload = heapq.heappop(self.heap)
        if node >= 0 and kind not in (ARRIVAL, RESUBMIT, FAULT, CANCEL):
            if kind in (SWIM_MSG, PEER_MSG, TO_PRODUCER):
                src, epoch, sent_at, _ = payload  # type: ignore[misc]
                if self.lost_in_kill(src, epoch, sent_at):
                    return True
            if kind != TO_PRODUCER:
                if not self.up[node]:
                    return True
                if self.paused_until[node] > at:
                    # Stalled: the event waits; timers run before messages when it resumes.
                    later = self.paused_until[node]
                    d = self.daemons[node]
                    if kind == SWIM_TICK and at == d.swim_tick_at:
                        d.swim_tick_at = later
                    elif kind == FW_TICK and at == d.fw_tick_at:
                        d.fw_tick_at = later
                    elif kind not in (SWIM_TICK, FW_TICK, FINISH, ABORTED, EXPIRE):
                        later += 1e-6 + at * 1e-9  # messages keep their order (one connection)
                    self.push(later, kind, node, payload)
                    return True
        self.now = at
        self.events += 1
        self.digest.update(f"{at:.9f}|{kind}|{node}".encode())
        d = self.daemons[node] if node >= 0 else None
        if kind == SWIM_TICK:
            assert d is not None
            if payload != d.epoch or at != d.swim_tick_at:
                return True
            d.swim_tick_at = math.inf
            d.swim.tick(at)
            self.flush_swim(d)
        elif kind == SWIM_MSG:
            assert d is not None
            d.swim.receive(at, payload[3])  # type: ignore[index]
            self.flush_swim(d)
        elif kind == PEER_MSG:
            assert d is not None
            if payload[0] < 0:  # type: ignore[index]
                # From a producer's connection: what it sends carries that connection's key.
                msg = self.intake_of(payload[3], KEY_OF_SRC[payload[0]], d.name)  # type: ignore[index]
                if type(msg) is Task:
                    d.on_task(msg)
                elif msg is not None:
                    d.on_cancel(msg.id, msg.producer_key)
            else:
                src = self.daemons[payload[0]].name  # type: ignore[index]
                for msg in self.peer_items(payload[3], d.name):  # type: ignore[index]
                    d.on_peer(src, msg)
            self.flush_forwarder(d)
        elif kind == FW_TICK:
            assert d is not None
            if payload != d.epoch or at != d.fw_tick_at:
                return True
            d.fw_tick_at = math.inf
            d.forwarder.tick(at)
            if len(d.held):
                d.held.tick(at, d.member_alive)
                d.flush_held()
            d.replay_step()
            self.flush_forwarder(d)
        elif kind == FINISH:
            assert d is not None
            epoch, owned, started = payload  # type: ignore[misc]
            if epoch == d.epoch:
                d.finish(owned, started)
        elif kind == ABORTED:
            assert d is not None
            epoch, owned = payload  # type: ignore[misc]
            if epoch == d.epoch:
                d.aborted(owned)
        elif kind == EXPIRE:
            assert d is not None
            epoch, owned, started = payload  # type: ignore[misc]
            if epoch == d.epoch:
                d.expire(owned, started)
        elif kind == TO_PRODUCER:
            reply = self.reply_of(payload[3])  # type: ignore[index]
            if reply is not None:
                self.producer_receives(reply)
        elif kind == ARRIVAL:
            self.arrival()
        elif kind == RESUBMIT:
            self.resubmit_if_silent(payload)  # type: ignore[arg-type]
        elif kind == FAULT:
            self.fault(payload)  # type: ignore[arg-type]
        elif kind == CANCEL:
            self.send_cancel(payload)  # type: ignore[arg-type]
        if self.events % self.run.check_every == 0:
            self.check_loads()
        return True
