"""A simulated daemon: its real protocol cores (``SwimNode``, ``Placer``, ``Forwarder``,
``Admission`` with ``TaskBook``) and, around them, what the asyncio shell does: producer intake, the owner's handling of Forward /
Withdraw / TaskDone (as ``gossipd/fanout/owner.py`` does) and an engine with a few slots and
random service times.  It talks to the world (simulations/fanout_world.py) for everything
outside the process: the network, the journal, the producer."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import TYPE_CHECKING

from gossipd.core.admission import Admission, Verdict, refused
from gossipd.core.gossip_messages import GpuState
from gossipd.core.heldresults import Decision, HeldResults, forwarder_view
from gossipd.core.journeys import Route
from gossipd.core.lifecycle import ANY, Abort, Owned, Phase, Stop
from gossipd.core.membership import State
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    ErrorCode,
    Result,
    Task,
    error_result,
)
from gossipd.core.owner import Refused
from gossipd.core.peer_messages import (
    Confirm,
    ConfirmReply,
    Forward,
    ForwardReply,
    ReplayKnown,
    ReplayQuery,
    TaskDone,
    Withdraw,
)
from gossipd.core.placer import LoadCounts, Placer
from gossipd.core.queueing import QueueWait
from gossipd.core.replaycheck import ReplayCheck, cancel_waiting, replay_known
from gossipd.core.swim import SwimNode
from simulations.fanout_run import ABORTED, EXPIRE, FINISH

if TYPE_CHECKING:
    from simulations.fanout_world import World

# A simulated daemon's admission bounds and retry hint (ingress.pending_max,
# pending_bytes_max, retry_after_ms): wide, so that refusals come from expected waits.
# Who withdraws a replayed forwarded task that another member holds (Daemon._REPLAY).
REPLAY = "(replay)"
PENDING_MAX = 10_000
PENDING_BYTES_MAX = 1 << 40
RETRY_AFTER_MS = 200


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
        # The daemon's own placement core (core/placer.py), fed as fanout/placement_feed.py
        # feeds it: member events with the member's entry (World.flush_swim); every member
        # gossips an rpc address (its name: the world routes peer messages by name).
        loads = LoadCounts()  # as the daemon's: the placer reads their sum, kept
        local_ids: set[str] = set()
        self.owner = run.owner_class(node=self.name)
        self.gpu = GpuState(rpc=self.name)
        self.placement = Placer(
            world.fanout_config,
            node=self.name,
            loads=loads,
            local_ids=local_ids,
        )
        self.forwarder = run.forwarder_class(
            world.forwarder_settings,
            node=self.name,
            placement=self.placement,
            rng=random.Random(world.rng.getrandbits(64)),
            loads=loads,
            local_ids=local_ids,
            # Forward.boot, as the daemon's wall clock in ms at start (fanout/assembly.py):
            # a restarted process's is higher, so an owner refuses its dead one's Forwards.
            boot=int(world.now * 1000) + 1,
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
        self.admission = Admission(
            pending_max=PENDING_MAX,
            results_max=100_000,
            queue=queue,
            pending_bytes_max=PENDING_BYTES_MAX,
        )
        # The owner's tasks, admission to TaskDone (core/lifecycle.py, as the ingress uses it).
        self.book = run.book_class(self.admission)
        self.started_at: dict[str, float] = {}
        self.queue: deque[str] = deque()
        self.running = 0
        self.withdrawn_before_run: set[str] = set()
        # Running tasks whose engine request is being aborted (FanoutRun.abort_s): their
        # slot and book entry are held until ABORTED, as a worker holds them until its end.
        self.aborting: set[str] = set()
        self.swim_tick_at = math.inf
        self.fw_tick_at = math.inf
        # Results held while their forwarder is not alive in our view (fanout/holding.py).
        self.held = HeldResults(bytes_max=1 << 30, always=world.run.confirm_results == "always")
        self.held_entries: dict[str, tuple[Owned, Result]] = {}
        # A restart's journaled tasks, waiting for the members' answers (ingress/replay.py).
        self.replay_check: ReplayCheck | None = None
        self.replay_tasks: list[tuple[Task, str, float]] = []
        self.replay_running: dict[str, tuple[Task, str]] = {}
        self.replay_cancelled: set[str] = set()  # waiting ones their producer cancelled

    # -- producer intake and local admission ------------------------------------------------

    def on_task(self, task: Task) -> None:
        now = self.world.now
        if self.forwarder.route(task, now) is Route.LOCAL:
            verdict = self.admit(task, now, forwarder="")
            if verdict not in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING):
                self.forwarder.local_finished(task.id)  # nothing of ours runs here
            if verdict not in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE):
                self.answer_refusal(task, verdict)

    def _answer_final(self, task: Task, result: Result) -> None:
        """A task's final Result to its producer, and to admission's rule 5 (as the daemon's
        runner and intake do where they hand one to the reply sender)."""
        self.world.answer(self, task, result)
        self.book.answered(task, self.world.now)

    def answer_refusal(self, task: Task, verdict: Verdict) -> None:
        """Answered as the daemon's intake answers a refused task (core/admission.refused)."""
        no = refused(
            verdict,
            self.admission,
            pending_max=PENDING_MAX,
            pending_bytes_max=PENDING_BYTES_MAX,
            retry_after_ms=RETRY_AFTER_MS,
        )
        answer = error_result(task.id, no.code, no.message, retry_after_ms=no.retry_after_ms)
        self.world.answer(self, task, answer)

    def on_cancel(self, task_id: str, producer_key: str) -> None:
        """A Cancel, from a producer or passed on by a peer, as the daemon's intake handles
        it (``Intake.handle_cancel``): the task book decides here (core/lifecycle.py rule 4:
        only the task's own key), else the forwarder passes it on to the member running it
        (core/forwarder.py rule 7).  Counted by outcome, as the intake counts it."""
        outcome = self.cancel_here(task_id, producer_key)
        if outcome is None:
            outcome = self.forwarder.cancel(task_id, producer_key)
        if outcome is None:
            outcome = self.cancel_waiting(task_id, producer_key)
        self.world.trace(task_id, self.name, f"cancel from {producer_key!r}: {outcome}")
        self.world.cancels[outcome or "unknown"] += 1

    def cancel_here(self, task_id: str, producer_key: str) -> str | None:
        """As the runner's ``cancel``: a running task is aborted in the engine and answered
        ``cancelled`` now, a queued one when a slot takes it."""
        owned = self.book.get(task_id)
        if owned is None:
            return None
        abort = self.book.cancel(task_id, producer_key)
        if abort is Abort.REFUSED:
            return "refused"
        if abort is Abort.ABORT:
            self._abort(owned)  # answered when its worker ends
        return "here"

    def _abort(self, owned: Owned) -> None:
        """Abort the engine request of running ``owned``: its worker ends (``aborted``)
        ``abort_s`` from now (ABORTED), as the runner's worker ends after its engine's
        abort, or at once without ``abort_s``."""
        world = self.world
        if world.run.abort_s <= 0:
            self.aborted(owned)
            return
        self.aborting.add(owned.task.id)
        world.push(world.now + world.run.abort_s, ABORTED, self.index, (self.epoch, owned))
        world.trace(owned.task.id, self.name, "aborting its engine request")

    def _free_slot(self, task_id: str) -> None:
        """A running task's engine slot is free (it finished, or its abort ended)."""
        self.running -= 1
        self.world.stopped_running(self, task_id)
        self.started_at.pop(task_id, None)

    def aborted(self, owned: Owned) -> None:
        """The aborted worker of ``owned`` ends, as ``Runner._run_job``'s end: run again
        (wanted again meanwhile: core/lifecycle.py rule 3b), dropped (withdrawn) or
        answered (cancelled, expired)."""
        task_id = owned.task.id
        self.aborting.discard(task_id)
        if self.book.get(task_id) is not owned:
            return
        world = self.world
        self._free_slot(task_id)
        if self.book.restart(task_id):
            owned.phase = Phase.QUEUED
            self.queue.append(task_id)
            world.restarted += 1
            world.trace(task_id, self.name, "runs it again (wanted again while aborted)")
        elif owned.stop is Stop.WITHDRAWN:
            self._release_withdrawn(task_id)
        else:
            self._answer_stopped(owned)
        self.start_jobs()

    def expire(self, owned: Owned, started: float) -> None:
        """Its deadline came while it ran (this run, started at ``started``): the task book
        says whether to abort it (core/lifecycle.py rule 4), as the runner's sweeper asks."""
        task_id = owned.task.id
        if self.book.get(task_id) is not owned or self.started_at.get(task_id) != started:
            return  # ended, or a run aborted since
        if self.book.expire(task_id) is Abort.ABORT:  # (else stopped already: its end answers)
            self._abort(owned)  # answered when its worker ends

    def _answer_stopped(self, owned: Owned, code: ErrorCode | None = None) -> None:
        """A task stopped by its producer's Cancel or its deadline (``owned.stop``, or
        ``code``) ends with ``cancelled`` or ``deadline_exceeded``, as a finished one ends."""
        task_id = owned.task.id
        if code is None:
            code = (
                ErrorCode.DEADLINE_EXCEEDED if owned.stop is Stop.EXPIRED else ErrorCode.CANCELLED
            )
        result = error_result(task_id, code, f"stopped here: {code.value}", node=self.name)
        ended = self.book.finish(task_id, result)
        if not self._hold(ended, result):
            self._answer_final(owned.task, result)
            self._ended(ended)
        self.forwarder.local_finished(task_id)

    def admit(
        self, task: Task, received_at: float, *, forwarder: str, enqueue: bool = True
    ) -> Verdict:
        """``enqueue=False``: held from the engine until ``replay_step`` queues it."""
        verdict, entry = self.book.offer(
            task, received_at, self.world.now, forwarder=forwarder or None
        )
        if verdict is Verdict.ADMIT:
            self.withdrawn_before_run.discard(task.id)
            self.world.journal_accept(self, task, forwarder, received_at)
            self.world.trace(task.id, self.name, f"admitted (from {forwarder or 'intake'})")
            if enqueue:
                self.queue.append(task.id)
                self.start_jobs()
        elif verdict is Verdict.DUPLICATE_DONE:
            if entry is None:  # admission's rule 5: an earlier send, answered at a later one
                self.world.trace(task.id, self.name, "not answered again (a later send was)")
                return verdict
            assert isinstance(entry, Result)
            self._answer_final(task, entry)
            if self.held.answered(task.id):  # the held copy ends: this answer was its
                owned, _ = self.held_entries.pop(task.id)
                self._ended(owned)
        return verdict

    # -- a restart's journal (ingress/replay.py) -----------------------------------------------

    def begin_replay(
        self,
        tasks: list[tuple[Task, str, float]],
        running: dict[str, tuple[Task, str]],
        *,
        expect_members: bool,
    ) -> None:
        """``tasks``: producers' own (task, "", received_at) read from the journal, to run
        after the answers; ``running``: forwarded ones admitted again (held from the
        engine), id -> (task, forwarder): dropped if a member holds them, else queued."""
        self.replay_tasks = tasks
        self.replay_running = running
        self.replay_cancelled = set()
        self.replay_check = ReplayCheck(
            [(task.id, task.producer_key) for task, _, _ in tasks]
            + [(task.id, task.producer_key) for task, _ in running.values()],
            started=self.world.now,
            expect_members=expect_members,
        )
        self.replay_step()

    def cancel_waiting(self, task_id: str, producer_key: str) -> str | None:
        """As JournalReplay.cancel, by the same rule (core/replaycheck.py): a producer's own
        journaled task waiting for the members' answers is cancelled once admitted, or the
        Cancel goes on to the member that holds it."""
        waiting = ((task.id, task.producer_key) for task, _, _ in self.replay_tasks)
        return cancel_waiting(waiting, self.replay_cancelled, task_id, producer_key)

    def replay_deadline(self) -> float:
        return self.replay_check.next_deadline() if self.replay_check is not None else math.inf

    def replay_step(self) -> None:
        """Ask the live members, then (every answer in, or the waits over) run again what
        none of them holds and drop the forwarded copies one holds, as JournalReplay does."""
        check, world = self.replay_check, self.world
        if check is None:
            return
        members = [m for m in self.swim.live_ring() if m != self.name]
        for member, tasks in check.queries(members, world.now):
            world.send_peer(self, member, ReplayQuery(node=self.name, tasks=tasks))
        if not check.done(world.now):
            world.schedule_forwarder(self)  # (its timer: replay_deadline)
            return
        self.replay_check = None
        known = check.outcome().known
        for task, _ in self.replay_running.values():
            # As Daemon._drop_replayed: withdrawn as by its forwarder (no TaskDone).
            if task.id in known and self.withdraw(REPLAY, task.id):
                world.trace(task.id, self.name, f"dropped: {known[task.id]} holds it")
                world.replays_known_elsewhere += 1
            elif self.book.get(task.id) is not None:  # (withdrawn meanwhile: released)
                self.queue.append(task.id)
        self.start_jobs()
        for task, src, received_at in self.replay_tasks:
            if self.admission.knows(task.id):
                continue  # sent again meanwhile: that copy has its own journal record
            cancelled = task.id in self.replay_cancelled
            if task.id in known:
                world.trace(task.id, self.name, f"not run again: {known[task.id]} holds it")
                world.replays_known_elsewhere += 1
                world.journal_replayed(self, task, None, src)
                if cancelled:  # as JournalReplay: the Cancel goes on to that member
                    cancel = Cancel(v=PROTOCOL_VERSION, id=task.id, producer_key=task.producer_key)
                    world.send_peer(self, known[task.id], cancel)
                continue
            self.replay_one(task, src, received_at)
            if cancelled:  # admitted, then cancelled as a queued task is
                world.trace(task.id, self.name, "cancelled while it asked")
                self.cancel_here(task.id, task.producer_key)
        self.replay_tasks, self.replay_running = [], {}
        self.replay_cancelled.clear()

    def replay_one(self, task: Task, src: str, received_at: float) -> None:
        """Run a journaled task again (forwarded by ``src``: held from the engine until the
        members' answers; or ""), by its deadline."""
        verdict = self.admit(task, received_at, forwarder="", enqueue=not src)
        self.world.journal_replayed(self, task, verdict, src)
        if verdict is Verdict.ADMIT:
            if src:
                self.book.expect_withdraw(task.id, src)
        elif verdict not in (Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE):
            self.answer_refusal(task, verdict)

    # -- the owner's side (rpc.py) ----------------------------------------------------------

    def on_peer(self, src: str, msg: object) -> None:
        now = self.world.now
        if isinstance(msg, Forward):
            # The owner's decisions are the daemon's own core (core/owner.py), as
            # fanout/owner.py drives it; admission is this simulated shell's.
            waiting_max = self.world.run.saturated_waiting
            saturated = bool(waiting_max) and len(self.queue) >= waiting_max
            decision = self.owner.forward(src, msg, now, saturated=saturated)
            if isinstance(decision, Refused):
                if decision.why == "saturated":
                    self.world.refused_saturated += 1
                self.world.trace(msg.task.id, self.name, f"refuses it: {decision.why} (from {src})")
                self.world.send_peer(self, src, decision.reply)
                return
            verdict = self.admit(decision.task, decision.received_at, forwarder=src)
            answer = self.owner.admitted(msg, verdict, self.retry_after_ms())
            if answer.done_now and self.owner.done_after(msg.task, (src,), ""):
                for dst, done in self.owner.results_left(msg.task.route, None)[0]:
                    self.world.send_peer(self, str(dst), done)  # its cached Result went
                # Its accept is not sent: the TaskDone stands for it, as the daemon's owner
                # does with an accept still held when the task's TaskDone leaves
                # (fanout/owner.py; the simulated owner holds none otherwise).
                return
            self.world.send_peer(self, src, answer.reply)
        elif isinstance(msg, Withdraw):
            member = self.owner.withdrawn(src, self.withdraw(src, msg.id))
            if member is not None and msg.id in self.held:  # ended here: its Result held
                self.held.withdrawn(msg.id, member)
                self.flush_held()
        elif isinstance(msg, Confirm):
            still, migrated, unknown = self.forwarder.ledger.confirm(msg.ids, msg.node)
            reply = ConfirmReply(
                node=self.name, still_mine=still, migrated=migrated, unknown=unknown
            )
            self.world.send_peer(self, src, reply)
        elif isinstance(msg, ConfirmReply):
            self.held.on_reply(msg.node, msg.still_mine, msg.migrated, msg.unknown)
            self.flush_held()
        elif isinstance(msg, ReplayQuery):
            answer = replay_known(msg, self.name, self.book.held, self.forwarder.ledger.finished_by)
            self.world.send_peer(self, src, answer)
        elif isinstance(msg, ReplayKnown):
            if self.replay_check is not None:
                self.replay_check.on_known(msg.node, msg.known, its_own=msg.node == src)
                self.replay_step()
        elif isinstance(msg, Cancel):
            # A producer's Cancel an entry passed on, with the key the entry read.
            self.on_cancel(msg.id, msg.producer_key)
        elif isinstance(msg, (ForwardReply, TaskDone)):
            if isinstance(msg, TaskDone):
                self.world.trace(msg.id, self.name, f"gets TaskDone from {src}")
            self.forwarder.on_reply(msg, now)
            self.world.flush_forwarder(self)

    def retry_after_ms(self) -> int:
        refusal = self.admission.refusal
        return refusal.retry_after_ms if refusal is not None else RETRY_AFTER_MS

    def withdraw(self, src: str, task_id: str) -> bool:
        """True: the task book dropped ``src``'s copy (queued or running here)."""
        abort = self.book.withdraw(task_id, src)
        if abort is Abort.NOTHING:
            return False
        self.world.trace(task_id, self.name, f"withdrawn by {src}")
        if abort is Abort.MARKED:  # queued: it never runs
            self.withdrawn_before_run.add(task_id)
            self._release_withdrawn(task_id)
            self.start_jobs()
        else:  # running: the engine request is aborted
            owned = self.book.get(task_id)
            assert owned is not None
            self._abort(owned)  # dropped when its worker ends, unless wanted again
        return True

    def _release_withdrawn(self, task_id: str) -> None:
        self.book.release(task_id, error_result(task_id, ErrorCode.CANCELLED, "withdrawn"))
        self.world.journal_done(self, task_id)

    # -- the engine ---------------------------------------------------------------------------

    def start_jobs(self) -> None:
        world = self.world
        while self.running < world.run.slots and self.queue:
            task_id = self.queue.popleft()
            owned = self.book.get(task_id)
            if owned is None or not self.book.start(owned):
                continue
            if owned.stop is not None:  # cancelled while it waited: answered, never run
                self._answer_stopped(owned)
                continue
            deadline = owned.received_at + owned.task.timeout_ms / 1000.0
            if world.now >= deadline:  # its deadline passed while it waited: never run
                self._answer_stopped(owned, ErrorCode.DEADLINE_EXCEEDED)
                continue
            self.started_at[task_id] = world.now
            self.running += 1
            world.started_running(self, owned.task)
            service = world.rng.expovariate(1.0 / world.run.service_s)
            # (its start time tells this run's end from an aborted earlier run's)
            run = (self.epoch, owned, world.now)
            if world.now + service < deadline:
                world.push(world.now + service, FINISH, self.index, run)
            else:  # the runner's deadline sweeper aborts it (Runner.expire_forever)
                world.push(deadline, EXPIRE, self.index, run)

    def finish(self, owned: Owned, started: float) -> None:
        task_id = owned.task.id
        if self.book.get(task_id) is not owned or task_id in self.aborting:
            return  # withdrawn while it ran (and maybe admitted again since: another run)
        if self.started_at.get(task_id) != started:
            return  # the end of a run aborted since (it runs again: rule 3b)
        world = self.world
        self._free_slot(task_id)
        if self.admission.queue is not None:
            self.admission.queue.observe(world.now - started)
        task = owned.task
        chunks = 3 if task.stream else 0
        for seq in range(chunks):
            world.to_producer(self, Chunk(id=task.id, seq=seq, delta=f"{seq},", node=self.name))
        result = Result(
            id=task.id, ok=True, text="0,1,2," if chunks else "ok", node=self.name, chunks=chunks
        )
        ended = self.book.finish(task_id, result)
        if not self._hold(ended, result):
            self._answer_final(task, result)
            self._ended(ended)
        self.forwarder.local_finished(task_id)
        self.start_jobs()

    def _ended(self, ended: Owned) -> None:
        """The task's Result has left (or will never): journal DONE, then TaskDones."""
        world = self.world
        task_id = ended.task.id
        world.journal_done(self, task_id)
        # TaskDone after the Result (rule 5 of core/lifecycle.py), as the daemon's owner
        # core says; the simulated Result has left at once.
        if self.owner.task_finished(ended):
            to_links, to_members = self.owner.results_left(ended.task.route, None)
            for dst, done in (*to_links, *to_members):
                world.send_peer(self, str(dst), done, delay=world.run.taskdone_delay_s)

    # -- held Results (fanout/holding.py) ------------------------------------------------------

    def member_alive(self, member: str) -> bool:
        m = self.swim.table.members.get(member)
        return m is not None and m.state is State.ALIVE

    def _hold(self, ended: Owned, result: Result) -> bool:
        if not self.world.run.hold_results or ended.from_producer or not ended.forwarders:
            return False
        names = [ended.replayed_src if f == ANY else str(f) for f in ended.forwarders]
        if len(names) != 1 or not names[0]:
            return False
        view = forwarder_view(self.swim.table.members.get(names[0]))
        if not self.held.offer(
            ended.task.id,
            names[0],
            100,
            received_at=ended.received_at,
            deadline=ended.received_at + ended.task.timeout_ms / 1000.0,
            now=self.world.now,
            view=view,
        ):
            return False
        self.world.trace(ended.task.id, self.name, f"holds its Result ({names[0]} {view})")
        self.held_entries[ended.task.id] = (ended, result)
        self.flush_held()
        return True

    def flush_held(self) -> None:
        world = self.world
        for task_id, decision in self.held.take_decisions():
            owned, result = self.held_entries.pop(task_id)
            world.trace(task_id, self.name, f"held Result: {decision.value}")
            if decision is Decision.SEND:
                self._answer_final(owned.task, result)
                self._ended(owned)
            else:
                world.journal_done(self, task_id)  # no TaskDone: ledgered elsewhere
        for member, ids in self.held.take_confirms():
            world.send_peer(self, member, Confirm(ids=ids, node=self.name))
        world.schedule_forwarder(self)
