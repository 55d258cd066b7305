"""The whole daemon in virtual time: membership, fan-out, owners, engines, journals and
producers, all in one process and deterministic for a seed.

Each simulated daemon runs the real protocol cores: ``SwimNode`` (membership), ``Forwarder``
(fan-out, the forwarder's side) and ``Admission`` (dedup and bounds).  Around them this module
plays what the asyncio shell and the world do: the owner's handling of Forward / Withdraw /
TaskDone (as ``gossipd/fanout/owner.py`` does), an engine with a few slots and random service times, a journal
whose records survive a crash once fsynced, a network (latency, per-link FIFO order, loss,
partitions), and producers that resubmit as docs/PROTOCOL.md says (same id after a silence,
after ``retry_after_ms`` for a busy refusal) and deduplicate final Results by id.

Faults: crash (SIGKILL; the node restarts later and replays its journal), stall (SIGSTOP for
a while), partition (a few members cut off), loss (a share of daemon-to-daemon messages lost).

Invariants, checked as the run goes (and the liveness one at the end):
- lost: every task a producer sent ends with a final Result it accepted;
- duplicate_results_accepted: a second final Result for an id that the producer would accept
  (arriving after it stopped remembering the id: ``producer_memory_s`` after its first);
  second Results it drops by id are counted apart (``duplicate_results_dropped``), with the
  faults under way when the second copy started;
- two_runs: a task starts on a second owner while an earlier copy of the same producer send
  runs, and the forwarder withdrew neither copy (a hedge or a migration must withdraw one; a
  crash of the first owner excuses it).  Two copies of different producer sends (the producer
  resent during a stall or a partition) are counted apart, not a violation;
- answer_after_withdraw: an owner answers for a task that was withdrawn before it ran;
- chunk_gap: a final Result arrives while the producer misses some of its chunks;
- loads: each forwarder's load counts equal its pending forwards plus its ledger.
A violation prints the seed; ``trace_for`` replays the seed recording the events of one task,
the shortest trace that shows it.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gossipd.config import FanoutConfig
from gossipd.core.admission import Admission, Verdict
from gossipd.core.forwarder import Forwarder, ForwarderSettings, Refuse, Route
from gossipd.core.lifecycle import Abort, Owned, TaskBook
from gossipd.core.membership import LIVE_STATES
from gossipd.core.messages import Chunk, ErrorCode, Result, Task, error_result
from gossipd.core.peer_messages import Forward, ForwardReply, TaskDone, Withdraw
from gossipd.core.placement import Candidate, bound, place
from gossipd.core.queueing import QueueWait
from gossipd.core.ring import Ring
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

PRODUCER = "producer"
FAULT_KINDS = ("crash", "stall", "partition", "loss")
RETRYABLE = (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN, ErrorCode.UNAVAILABLE)

# Event kinds (the heap holds (at, tie-break, seq, kind, node, payload)).
SWIM_TICK, SWIM_MSG, PEER_MSG, FW_TICK, FINISH, TO_PRODUCER, ARRIVAL, RESUBMIT, FAULT = range(9)


@dataclass
class FanoutRun:
    nodes: int = 16
    tasks: int = 20_000
    seed: int = 1
    faults: tuple[str, ...] = FAULT_KINDS
    fault_events: int = 0  # 0: about one of each kind per 10 simulated seconds
    load: float = 0.7  # offered load, a share of the cluster's engine capacity
    slots: int = 4  # engine requests each daemon runs at once
    service_s: float = 0.05  # mean engine time of a task
    keys: int = 0  # distinct task keys (0: tasks / 20)
    stream_every: int = 10  # every n-th task streams chunks
    latency_s: float = 0.0003  # median one-way latency
    loss: float = 0.05  # share of daemon-to-daemon messages lost during a loss fault
    timeout_ms: int = 30_000
    resubmit_s: float = 2.0  # a producer resends an id after this long without a Result
    producer_memory_s: float = 60.0
    restart_after_s: float = 3.0
    stall_s: float = 4.0
    fsync_s: float = 0.005  # journal records survive a crash once this old
    kill_loss_s: float = 0.001  # what a killed daemon sent this recently never leaves
    taskdone_delay_s: float = 0.0  # the owner's TaskDone leaves this long after its Result
    hedge: bool = False
    # Admission refuses (overloaded) a task whose expected queueing wait does not fit half its
    # remaining deadline, or queue_wait_target_s (core/queueing.py).
    queue_wait_admission: bool = True
    queue_wait_target_s: float = 0.0
    crash_at_s: float = -1.0  # scenario "degrade": crash crash_share of members at once then
    crash_share: float = 0.2
    check_every: int = 1000  # events between full consistency checks
    trace_task: str = ""  # record this task's events (replay of a violation)
    progress: Callable[[str], None] | None = None
    forwarder_class: type[Forwarder] = Forwarder
    # The owner check (issue 17): an owner with this many tasks waiting for a slot takes its
    # engine as saturated and refuses Forwards asking if_free ("saturated"); 0: never.
    saturated_waiting: int = 0


class SimPlacement:
    """The placer's rules over a simulated daemon's membership view (all members serve)."""

    def __init__(self, daemon: SimDaemon, config: FanoutConfig) -> None:
        self._d = daemon
        self._c = config.load_bound_c
        self._floor = config.load_floor
        self._key: tuple[int, int, int] | None = None
        self._live: list[str] = []
        self._ring: Ring | None = None

    def _view(self) -> tuple[list[str], Ring]:
        table = self._d.swim.table
        if self._key != table.version or self._ring is None:
            live = [n for n, m in table.members.items() if m.state in LIVE_STATES]
            live.append(self._d.name)
            self._live = sorted(live)
            self._ring = Ring(dict.fromkeys(self._live, 1.0))
            self._key = table.version
        return self._live, self._ring

    def owner_for(self, task: Task) -> str | None:
        live, ring = self._view()
        owner = ring.owner(task.key or task.id)
        loads = self._d.forwarder.loads
        total = sum(loads.values()) + len(self._d.forwarder.local_ids)
        load = self._load(owner)
        if load < bound(total, 1.0, float(len(live)), self._c, self._floor):
            return owner
        order = self.order(task)
        return order[0] if order else None

    def _load(self, member: str) -> int:
        fw = self._d.forwarder
        return len(fw.local_ids) if member == self._d.name else fw.loads.get(member, 0)

    def order(self, task: Task, exclude: frozenset[str] = frozenset()) -> list[str]:
        live, ring = self._view()
        cands = {n: Candidate(n, load=self._load(n)) for n in live if n not in exclude}
        return place(task.key or task.id, cands, ring=ring, c=self._c, floor=self._floor)

    def addr(self, member: str) -> str | None:
        if member == self._d.name:
            return member
        m = self._d.swim.table.members.get(member)
        return member if m is not None and m.state in LIVE_STATES else None


class SimDaemon:
    """One daemon process: its cores and the owner-side shell around them."""

    def __init__(self, world: World, index: int, epoch: int, seeds: list[str]) -> None:
        self.world = world
        self.index = index
        self.name = f"d{index:04d}"
        self.epoch = epoch
        run = world.run
        rng = random.Random(world.rng.getrandbits(64))
        self.swim = SwimNode(
            world.swim_config,
            node=self.name,
            addr=world.swim_addrs[index],
            rng=rng,
            now=world.now,
            seeds=seeds,
        )
        self.placement = SimPlacement(self, world.fanout_config)
        self.forwarder = run.forwarder_class(
            world.forwarder_settings,
            node=self.name,
            placement=self.placement,
            admit_local=self.admit_local,
            rng=random.Random(world.rng.getrandbits(64)),
        )
        queue = None
        if run.queue_wait_admission:
            queue = QueueWait(
                concurrency=run.slots,
                deadline_ratio=0.5,
                target_s=run.queue_wait_target_s,
                retry_after_min_ms=200,
                retry_after_max_ms=10_000,
                smoothing=0.1,
            )
        self.admission = Admission(pending_max=10_000, results_max=100_000, queue=queue)
        # The owner's tasks, admission to TaskDone (core/lifecycle.py, as the ingress uses it).
        self.book = TaskBook(self.admission)
        self.started_at: dict[str, float] = {}
        self.queue: deque[str] = deque()
        self.running = 0
        self.withdrawn_before_run: set[str] = set()
        self.swim_tick_at = math.inf
        self.fw_tick_at = math.inf

    # -- producer intake and local admission ------------------------------------------------

    def on_task(self, task: Task) -> None:
        now = self.world.now
        if self.forwarder.route(task, now) is Route.LOCAL:
            verdict = self.admit(task, now, forwarder="")
            if verdict not in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING):
                self.forwarder.local_finished(task.id)  # nothing of ours runs here
            if verdict in (Verdict.OVERLOADED, Verdict.SHUTTING_DOWN):
                busy = error_result(
                    task.id, ErrorCode(verdict.value), "busy", retry_after_ms=self.retry_after_ms()
                )
                self.world.answer(self, task, busy)

    def admit_local(self, task: Task, received_at: float) -> Verdict:
        return self.admit(task, received_at, forwarder="")

    def admit(self, task: Task, received_at: float, *, forwarder: str) -> Verdict:
        verdict, entry = self.book.offer(
            task, received_at, self.world.now, forwarder=forwarder or None
        )
        if verdict is Verdict.ADMIT:
            self.withdrawn_before_run.discard(task.id)
            self.world.journal_accept(self, task, forwarder)
            self.queue.append(task.id)
            self.world.trace(task.id, self.name, f"admitted (from {forwarder or 'intake'})")
            self.start_jobs()
        elif verdict is Verdict.DUPLICATE_DONE:
            assert isinstance(entry, Result)
            self.world.answer(self, task, entry)
        return verdict

    # -- the owner's side (rpc.py) ----------------------------------------------------------

    def on_peer(self, src: str, msg: object) -> None:
        now = self.world.now
        if isinstance(msg, Forward):
            waiting_max = self.world.run.saturated_waiting
            if msg.if_free and waiting_max and len(self.queue) >= waiting_max:
                self.world.refused_saturated += 1
                self.world.trace(msg.task.id, self.name, f"refuses it: saturated (from {src})")
                refusal = ForwardReply(
                    req=msg.req, node=self.name, accepted=False, code=ErrorCode.SATURATED.value
                )
                self.world.send_peer(self, src, refusal)
                return
            received_at = now - (msg.task.timeout_ms - msg.remaining_ms) / 1000.0
            verdict = self.admit(msg.task, received_at, forwarder=src)
            accepted = verdict in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE)
            if verdict is Verdict.DUPLICATE_DONE:
                self.world.send_peer(self, src, TaskDone(id=msg.task.id, node=self.name))
            reply = ForwardReply(
                req=msg.req,
                node=self.name,
                accepted=accepted,
                code="" if accepted else verdict.value,
                retry_after_ms=0 if accepted else self.retry_after_ms(),
            )
            self.world.send_peer(self, src, reply)
        elif isinstance(msg, Withdraw):
            self.withdraw(src, msg.id)
        elif isinstance(msg, (ForwardReply, TaskDone)):
            if isinstance(msg, TaskDone):
                self.world.trace(msg.id, self.name, f"gets TaskDone from {src}")
            self.forwarder.on_reply(msg, now)
            self.world.flush_forwarder(self)

    def retry_after_ms(self) -> int:
        refusal = self.admission.refusal
        return refusal.retry_after_ms if refusal is not None else 200

    def withdraw(self, src: str, task_id: str) -> None:
        abort = self.book.withdraw(task_id, src)
        if abort is Abort.NOTHING:
            return
        if abort is Abort.MARKED:  # queued: it never runs
            self.withdrawn_before_run.add(task_id)
        else:  # running: the engine request is aborted
            self.started_at.pop(task_id, None)
            self.running -= 1
            self.world.stopped_running(self, task_id)
        self.book.release(task_id, error_result(task_id, ErrorCode.CANCELLED, "withdrawn"))
        self.world.journal_done(self, task_id)
        self.world.trace(task_id, self.name, f"withdrawn by {src}")
        self.start_jobs()

    # -- the engine ---------------------------------------------------------------------------

    def start_jobs(self) -> None:
        world = self.world
        while self.running < world.run.slots and self.queue:
            task_id = self.queue.popleft()
            owned = self.book.get(task_id)
            if owned is None or not self.book.start(owned):
                continue
            self.started_at[task_id] = world.now
            self.running += 1
            world.started_running(self, owned.task)
            service = world.rng.expovariate(1.0 / world.run.service_s)
            world.push(world.now + service, FINISH, self.index, (self.epoch, owned))

    def finish(self, owned: Owned) -> None:
        task_id = owned.task.id
        if self.book.get(task_id) is not owned:
            return  # withdrawn while it ran (and maybe admitted again since: another run)
        world = self.world
        self.running -= 1
        world.stopped_running(self, task_id)
        if self.admission.queue is not None:
            self.admission.queue.observe(world.now - self.started_at.pop(task_id))
        task = owned.task
        chunks = 3 if task.stream else 0
        for seq in range(chunks):
            world.to_producer(self, Chunk(id=task.id, seq=seq, delta=f"{seq},", node=self.name))
        result = Result(
            id=task.id, ok=True, text="0,1,2," if chunks else "ok", node=self.name, chunks=chunks
        )
        ended = self.book.finish(task_id, result)
        notify = (*ended.notify(), ended.notify_member())
        world.answer(self, task, result)
        world.journal_done(self, task_id)
        # TaskDone after the Result (rule 5 of core/lifecycle.py).
        for dst in notify:
            if dst:
                done = TaskDone(id=task_id, node=self.name)
                world.send_peer(self, str(dst), done, delay=world.run.taskdone_delay_s)
        self.forwarder.local_finished(task_id)
        self.start_jobs()


@dataclass
class TaskState:
    task: Task
    first_sent: float
    entry: int = 0
    final: Result | None = None
    final_at: float = 0.0
    chunks_next: int = 0
    last_sent: float = 0.0
    answered: int = 0


@dataclass
class World:
    run: FanoutRun
    rng: random.Random = field(init=False)
    now: float = 0.0

    def __post_init__(self) -> None:
        run = self.run
        self.rng = random.Random(run.seed)
        self.swim_config = SwimConfig.sim()
        self.fanout_config = FanoutConfig(hedge=run.hedge)
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
        self.crashed_at: dict[tuple[int, int], float] = {}
        self.loss = 0.0
        self.link_last: dict[tuple[int, int], float] = {}
        self.journals: list[dict[str, tuple[Task, str, float]]] = [{} for _ in names]
        self.journal_done_at: list[dict[str, float]] = [{} for _ in names]
        for i in range(run.nodes):
            d = SimDaemon(self, i, 0, [])
            self.daemons.append(d)
        pairs = list(zip(names, self.swim_addrs, strict=True))
        for d in self.daemons:
            d.swim.bootstrap(0.0, pairs)
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
        self.violations: list[dict[str, object]] = []
        self.duplicates_dropped = 0
        self.duplicates_accepted = 0
        self.duplicates_by_fault: dict[str, int] = {}
        self.active_faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.faults_log: list[tuple[float, str]] = []
        self.fault_spans: list[tuple[str, tuple[float, float]]] = []
        self.served_at: list[float] = []
        self.latencies: list[float] = []  # first send to ok (what the producer waits)
        self.attempt_latencies: list[float] = []  # the send that was served to its ok
        self.errors: dict[str, int] = {}
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
        for event in fw.take_events():
            if isinstance(event, Refuse):
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
        at = fw.next_deadline()
        if at < d.fw_tick_at:
            d.fw_tick_at = at
            self.push(at, FW_TICK, d.index, d.epoch)

    def flush_swim(self, d: SimDaemon) -> None:
        for addr, data in d.swim.take_outbox():
            dst = self.by_addr.get(addr)
            if dst is not None:
                self.deliver(d.index, dst, SWIM_MSG, data, lossy=True)
        for event in d.swim.take_events():
            if event.kind == "dead":
                if self.run.trace_task:
                    self.trace_lines.append(
                        f"{self.now:12.6f}  {d.name:>9}  declares {event.node} dead"
                    )
                d.forwarder.member_dead(event.node, self.now)
                self.flush_forwarder(d)
        self.schedule(d)

    def deliver(
        self, src: int, dst: int, kind: int, payload: object, *, lossy: bool, delay: float = 0.0
    ) -> None:
        if self.group[src] != self.group[dst]:
            return
        if lossy and self.loss and self.rng.random() < self.loss:
            return
        latency = self.latency()
        at = self.now + delay + latency
        link = (src, dst)
        last = self.link_last.get(link, 0.0)
        if at <= last:
            at = last + 1e-7  # one connection keeps its order (ZeroMQ over TCP)
        self.link_last[link] = at
        self.push(at, kind, dst, (src, self.daemons[src].epoch, self.now + delay, payload))

    def latency(self) -> float:
        """One message's one-way latency: lognormal around run.latency_s."""
        return self.run.latency_s * math.exp(0.5 * self.rng.gauss(0.0, 1.0))

    def send_peer(self, d: SimDaemon, member: str, msg: object, delay: float = 0.0) -> None:
        dst = self.by_name.get(member)
        if dst is not None:
            self.deliver(d.index, dst, PEER_MSG, msg, lossy=True, delay=delay)

    def to_producer(self, d: SimDaemon, msg: Chunk | Result) -> None:
        latency = self.latency()
        link = (d.index, -1)
        at = max(self.now + latency, self.link_last.get(link, 0.0) + 1e-7)
        self.link_last[link] = at
        self.push(at, TO_PRODUCER, d.index, (d.index, d.epoch, self.now, msg))

    def answer(self, d: SimDaemon, task: Task, result: Result) -> None:
        if result.ok and task.id in d.withdrawn_before_run:
            self.violation("answer_after_withdraw", task.id, d.name)
        self.trace(task.id, d.name, f"answers {'ok' if result.ok else result.error.code}")  # type: ignore[union-attr]
        self.to_producer(d, result)

    def lost_in_kill(self, src: int, epoch: int, sent_at: float) -> bool:
        crashed = self.crashed_at.get((src, epoch))
        return crashed is not None and sent_at > crashed - self.run.kill_loss_s

    def step(self) -> bool:
        if not self.heap:
            return False
        at, _, _, kind, node, payload = heapq.heappop(self.heap)
        if node >= 0 and kind not in (ARRIVAL, RESUBMIT, FAULT):
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
                    elif kind not in (SWIM_TICK, FW_TICK, FINISH):
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
                d.on_task(payload[3])  # type: ignore[index]
            else:
                d.on_peer(self.daemons[payload[0]].name, payload[3])  # type: ignore[index]
            self.flush_forwarder(d)
        elif kind == FW_TICK:
            assert d is not None
            if payload != d.epoch or at != d.fw_tick_at:
                return True
            d.fw_tick_at = math.inf
            d.forwarder.tick(at)
            self.flush_forwarder(d)
        elif kind == FINISH:
            assert d is not None
            epoch, owned = payload  # type: ignore[misc]
            if epoch == d.epoch:
                d.finish(owned)
        elif kind == TO_PRODUCER:
            self.producer_receives(payload[3])  # type: ignore[index]
        elif kind == ARRIVAL:
            self.arrival()
        elif kind == RESUBMIT:
            self.resubmit_if_silent(payload)  # type: ignore[arg-type]
        elif kind == FAULT:
            self.fault(payload)  # type: ignore[arg-type]
        if self.events % self.run.check_every == 0:
            self.check_loads()
        return True

    # -- producers ---------------------------------------------------------------------------

    def arrival(self) -> None:
        run = self.run
        i = self.sent
        self.sent += 1
        key = f"k{self.rng.randrange(self.keys)}"
        task = Task(
            v=1,
            id=f"t{i:07d}",
            key=key,
            prompt="p",
            reply_to="tcp://producer:1",
            timeout_ms=run.timeout_ms,
            stream=run.stream_every > 0 and i % run.stream_every == 0,
        )
        self.tasks[task.id] = TaskState(task, self.now)
        self.send_task(task)
        if self.sent < run.tasks:
            self.push(self.now + self.rng.expovariate(self.rate), ARRIVAL, -1)

    def send_task(self, task: Task) -> None:
        """PUSH deals round robin over the daemons it is connected to (not the dead ones)."""
        n = self.run.nodes
        for _ in range(n):
            entry = self.next_entry
            self.next_entry = (entry + 1) % n
            if self.up[entry]:
                break
        self.tasks[task.id].entry = entry
        self.tasks[task.id].last_sent = self.now
        self.trace(task.id, PRODUCER, f"sends attempt {task.attempt} to d{entry:04d}")
        latency = self.latency()
        self.push(self.now + latency, PEER_MSG, entry, (-1, 0, self.now, task))
        self.push(self.now + self.run.resubmit_s, RESUBMIT, -1, (task.id, task.attempt))

    def resubmit_if_silent(self, payload: tuple[str, int | None]) -> None:
        """Resend a task still without a final Result: after a silence of resubmit_s since
        attempt ``attempt`` (None: now, after a busy refusal's retry_after_ms)."""
        task_id, attempt = payload
        state = self.tasks[task_id]
        if state.final is None and attempt in (None, state.task.attempt):
            self.resend(state)

    def resend(self, state: TaskState) -> None:
        if (self.now - state.first_sent) * 1000 >= self.run.timeout_ms:
            return  # the producer gives up: counted as lost at the end
        state.task = _with_attempt(state.task, state.task.attempt + 1)
        self.send_task(state.task)

    def producer_receives(self, msg: Chunk | Result) -> None:
        state = self.tasks.get(msg.id)
        if state is None:
            return
        if isinstance(msg, Chunk):
            if msg.seq == state.chunks_next and state.final is None:
                state.chunks_next += 1
            return
        self.trace(msg.id, PRODUCER, f"gets {'ok' if msg.ok else msg.error.code} from {msg.node}")  # type: ignore[union-attr]
        if state.final is not None:
            if self.now - state.final_at > self.run.producer_memory_s:
                self.duplicates_accepted += 1
            else:
                self.duplicates_dropped += 1
            for kind in self.faults_during(state.first_sent, self.now):
                self.duplicates_by_fault[kind] = self.duplicates_by_fault.get(kind, 0) + 1
            return
        if not msg.ok and msg.error is not None and msg.error.code in RETRYABLE:
            self.errors[msg.error.code] = self.errors.get(msg.error.code, 0) + 1
            delay = max(0.05, msg.error.retry_after_ms / 1000.0)
            self.push(self.now + delay, RESUBMIT, -1, (msg.id, None))
            return
        if msg.ok and msg.chunks and state.chunks_next < msg.chunks:
            self.violation("chunk_gap", msg.id, msg.node)
        state.final = msg
        state.final_at = self.now
        if msg.ok:
            self.served_at.append(self.now)
            self.latencies.append(self.now - state.first_sent)
            self.attempt_latencies.append(self.now - state.last_sent)
        else:
            code = msg.error.code if msg.error is not None else "?"
            self.errors[code] = self.errors.get(code, 0) + 1

    # -- owners and journals -------------------------------------------------------------------

    def started_running(self, d: SimDaemon, task: Task) -> None:
        task_id = task.id
        others = self.running_on.setdefault(task_id, [])
        for node, epoch, attempt in others:
            if node == d.index:
                continue
            if attempt == task.attempt:  # fan-out made two copies: one must be withdrawn
                self.two_runs.append((task_id, node, epoch, d.index, self.now))
            else:  # the producer resent it while the first copy ran (a stall, a partition)
                self.resubmitted_two_runs += 1
        others.append((d.index, d.epoch, task.attempt))
        self.trace(task_id, d.name, "starts running")

    def stopped_running(self, d: SimDaemon, task_id: str) -> None:
        runs = self.running_on.get(task_id)
        if runs:
            runs[:] = [r for r in runs if r[0] != d.index]
            if not runs:
                del self.running_on[task_id]

    def journal_accept(self, d: SimDaemon, task: Task, forwarder: str) -> None:
        self.journals[d.index][task.id] = (task, forwarder, self.now)
        self.journal_done_at[d.index].pop(task.id, None)

    def journal_done(self, d: SimDaemon, task_id: str) -> None:
        self.journal_done_at[d.index][task_id] = self.now

    # -- faults ----------------------------------------------------------------------------------

    def schedule_faults(self, duration_s: float) -> None:
        run = self.run
        if run.crash_at_s >= 0:
            self.push(run.crash_at_s, FAULT, -1, ("mass_crash", 0))
        kinds = [k for k in run.faults if k in FAULT_KINDS]
        if not kinds:
            return
        count = run.fault_events or max(len(kinds), int(duration_s / 10.0) * len(kinds))
        for i in range(count):
            kind = kinds[i % len(kinds)]
            at = self.rng.uniform(0.1, 0.8) * duration_s
            self.push(at, FAULT, -1, (kind, self.rng.randrange(run.nodes)))

    def fault(self, payload: tuple[str, int]) -> None:
        kind, index = payload
        run = self.run
        if kind == "mass_crash":
            victims = self.rng.sample(range(run.nodes), int(run.nodes * run.crash_share))
            for v in victims:
                self.crash(v)
            self.fault_spans.append(("crash", (self.now, math.inf)))
            self.faults_log.append((self.now, f"crash {len(victims)} members"))
            return
        if kind == "crash" and self.up[index] and sum(self.up) > 2:
            self.crash(index)
            self.push(self.now + run.restart_after_s, FAULT, -1, ("restart", index))
            self.fault_spans.append(("crash", (self.now, self.now + run.restart_after_s + 10)))
        elif kind == "restart":
            self.restart(index)
        elif kind == "stall" and self.up[index]:
            self.paused_until[index] = max(self.paused_until[index], self.now + run.stall_s)
            self.fault_spans.append(("stall", (self.now, self.now + run.stall_s)))
            self.active_faults["stall"] += 1
            self.push(self.now + run.stall_s, FAULT, -1, ("end_stall", index))
        elif kind == "end_stall":
            self.active_faults["stall"] -= 1
        elif kind == "partition" and run.nodes >= 4:
            cut = self.rng.sample(range(run.nodes), max(1, run.nodes // 8))
            for i in cut:
                self.group[i] = 1
            self.active_faults["partition"] += 1
            span = self.rng.uniform(1.0, 6.0)
            self.push(self.now + span, FAULT, -1, ("heal", 0))
            self.fault_spans.append(("partition", (self.now, self.now + span)))
        elif kind == "heal":
            self.group = [0] * run.nodes
            self.active_faults["partition"] -= 1
        elif kind == "loss":
            self.loss = run.loss
            self.active_faults["loss"] += 1
            span = self.rng.uniform(1.0, 5.0)
            self.push(self.now + span, FAULT, -1, ("end_loss", 0))
            self.fault_spans.append(("loss", (self.now, self.now + span)))
        elif kind == "end_loss":
            self.active_faults["loss"] -= 1
            if not self.active_faults["loss"]:
                self.loss = 0.0
        else:
            return
        self.faults_log.append((self.now, f"{kind} d{index:04d}"))

    def faults_during(self, start: float, end: float) -> list[str]:
        """The kinds of fault under way at some point between ``start`` and ``end``."""
        kinds = {k for k, (a, b) in self.fault_spans if a <= end and b >= start}
        return sorted(kinds) or ["none"]

    def crash(self, index: int) -> None:
        d = self.daemons[index]
        self.up[index] = False
        self.crashed_at[(index, d.epoch)] = self.now
        self.active_faults["crash"] += 1
        for task_id in list(d.started_at):
            self.stopped_running(d, task_id)

    def restart(self, index: int) -> None:
        old = self.daemons[index]
        live = [self.swim_addrs[i] for i in range(self.run.nodes) if self.up[i] and i != index]
        seeds = self.rng.sample(live, min(3, len(live)))
        d = SimDaemon(self, index, old.epoch + 1, seeds)
        self.daemons[index] = d
        self.up[index] = True
        self.paused_until[index] = 0.0
        self.active_faults["crash"] -= 1
        crashed = self.crashed_at[(index, old.epoch)]
        durable = crashed - self.run.fsync_s
        journal, done_at = self.journals[index], self.journal_done_at[index]
        # What reached the disk: accepts and dones fsynced before the crash.
        for task_id in list(journal):
            task, src, accepted_at = journal[task_id]
            done = done_at.get(task_id)
            if accepted_at > durable:
                del journal[task_id]
            elif done is not None and done <= durable:
                del journal[task_id]
                del done_at[task_id]
        done_at.clear()
        for task, src, _ in list(journal.values()):
            if d.admit(task, self.now, forwarder="") is Verdict.ADMIT and src:
                journal[task.id] = (task, src, self.now)  # still marked as forwarded by src
                d.book.expect_withdraw(task.id, src)
        self.schedule(d)

    # -- checks --------------------------------------------------------------------------------

    def violation(self, kind: str, task_id: str, node: str) -> None:
        self.violations.append(
            {"invariant": kind, "task": task_id, "node": node, "at": round(self.now, 6)}
        )

    def check_loads(self) -> None:
        for d in self.daemons:
            fw = d.forwarder
            if sum(fw.loads.values()) != fw.pending() + len(fw.ledger):
                self.violation("loads", "", d.name)

    def trace(self, task_id: str, who: str, what: str) -> None:
        if task_id == self.run.trace_task:
            self.trace_lines.append(f"{self.now:12.6f}  {who:>9}  {what}")


def _with_attempt(task: Task, attempt: int) -> Task:
    import msgspec

    return msgspec.structs.replace(task, attempt=attempt)


def run_fanout(run: FanoutRun) -> dict[str, object]:
    world = World(run)
    duration_s = run.tasks / world.rate
    world.push(0.0, ARRIVAL, -1)
    world.schedule_faults(duration_s)
    end = duration_s + run.timeout_ms / 1000.0 + 5.0
    last_report = 0.0
    while world.heap and world.heap[0][0] <= end:
        world.step()
        if run.progress is not None and world.now - last_report >= 5.0:
            last_report = world.now
            done = sum(1 for s in world.tasks.values() if s.final is not None)
            run.progress(
                f"t={world.now:6.1f}s  sent {world.sent:,}  answered {done:,}  events {world.events:,}"
            )
        if world.sent >= run.tasks and all_answered(world):
            break
    # Two runs at once: excused when the earlier copy was withdrawn or its daemon crashed.
    for task_id, first, epoch, second, _ in world.two_runs:
        names = (world.daemons[first].name, world.daemons[second].name)
        withdrawn = any((name, task_id) in world.withdraws_sent for name in names)
        if not withdrawn and (first, epoch) not in world.crashed_at:
            world.violation("two_runs", task_id, names[0])
    lost = [t for t, s in world.tasks.items() if s.final is None]
    latencies = sorted(world.latencies)
    return {
        "nodes": run.nodes,
        "tasks": run.tasks,
        "seed": run.seed,
        "faults": [f"{t:.2f}s {what}" for t, what in world.faults_log],
        "sent": world.sent,
        "ok": len(world.served_at),
        "errors": world.errors,
        "lost": len(lost),
        "lost_ids": lost[:10],
        "duplicate_results_accepted": world.duplicates_accepted,
        "duplicate_results_dropped": world.duplicates_dropped,
        "two_runs_withdrawn": len(world.two_runs),
        "two_runs_after_resubmission": world.resubmitted_two_runs,
        "duplicates_by_fault": world.duplicates_by_fault,
        "invariant_violations": len(world.violations),
        "violations": world.violations[:20],
        "refused_saturated": world.refused_saturated,
        "latency_p50_s": _pct(latencies, 0.5),
        "latency_p99_s": _pct(latencies, 0.99),
        "simulated_s": round(world.now, 3),
        "events": world.events,
        "trace_digest": world.digest.hexdigest(),
        "_world": world,
    }


def all_answered(world: World) -> bool:
    # Checked rarely: only once every task is sent.
    return world.events % 1000 == 0 and all(s.final is not None for s in world.tasks.values())


def _pct(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)


def trace_for(run: FanoutRun, task_id: str) -> list[str]:
    """Replay ``run`` (same seed) recording the events of one task."""
    from dataclasses import replace

    report = run_fanout(replace(run, trace_task=task_id, progress=None))
    world = report["_world"]
    assert isinstance(world, World)
    return world.trace_lines


def swarm(
    count: int,
    *,
    seed: int = 1,
    forwarder_class: type[Forwarder] = Forwarder,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Run ``count`` short simulations, each with its own seed and a random mix of faults
    (TigerBeetle's VOPR in miniature); report every seed that broke an invariant."""
    rng = random.Random(seed)
    failures: list[dict[str, object]] = []
    for i in range(count):
        s = rng.getrandbits(32)
        kinds = tuple(k for k in FAULT_KINDS if rng.random() < 0.6) or (rng.choice(FAULT_KINDS),)
        run = FanoutRun(
            nodes=rng.randint(4, 12),
            tasks=rng.choice([300, 600, 1200]),
            seed=s,
            faults=kinds,
            fault_events=rng.randint(1, 4),
            load=rng.uniform(0.3, 0.9),
            hedge=rng.random() < 0.3,
            forwarder_class=forwarder_class,
        )
        report = run_fanout(run)
        broken = (
            report["lost"] or report["duplicate_results_accepted"] or report["invariant_violations"]
        )
        if broken:
            failures.append(
                {
                    "seed": s,
                    "nodes": run.nodes,
                    "tasks": run.tasks,
                    "faults": list(kinds),
                    "fault_events": run.fault_events,
                    "load": run.load,
                    "hedge": run.hedge,
                    "lost": report["lost"],
                    "violations": report["violations"][:3],  # type: ignore[index]
                }
            )
        if progress is not None and (i + 1) % 20 == 0:
            progress(f"swarm: {i + 1}/{count} runs, {len(failures)} failing")
    return {"runs": count, "seed": seed, "failing": len(failures), "failures": failures}


def degradation(world: World, crash_at_s: float) -> dict[str, object]:
    """Served throughput (ok Results a second) in the 5 s before the mass crash and in each
    second after it, as a ratio to before; the time it took to get back to 0.78x; and the
    latency of the tasks served in each of those seconds (from the send that was admitted to
    its ok: a refused send is retried by its producer after retry_after_ms)."""
    served, latency = world.served_at, world.attempt_latencies
    window = 5.0
    before = sum(1 for t in served if crash_at_s - window <= t < crash_at_s) / window
    before_lat = sorted(
        x for t, x in zip(served, latency, strict=True) if crash_at_s - window <= t < crash_at_s
    )
    ratios, p99s = [], []
    for k in range(10):
        a = crash_at_s + k
        second = sorted(x for t, x in zip(served, latency, strict=True) if a <= t < a + 1.0)
        ratios.append(round(len(second) / before, 3) if before else 0.0)
        p99s.append(_pct(second, 0.99))
    back = next((k + 1 for k, r in enumerate(ratios) if r >= 0.78), None)
    return {
        "crash_at_s": round(crash_at_s, 3),
        "before_per_s": round(before, 1),
        "before_latency_p99_s": _pct(before_lat, 0.99),
        "after_ratio_per_s": ratios,
        "after_latency_p99_s": p99s,
        "back_to_0_78x_within_s": back,
        "overloaded_answers": world.errors.get("overloaded", 0),
    }
