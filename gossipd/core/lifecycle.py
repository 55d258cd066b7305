"""The owner's side of a task, sans-IO: one state machine from admission to the last TaskDone.

Each task this daemon runs is an ``Owned`` entry, in one phase:

    (offer) --ADMIT--> QUEUED --start--> RUNNING --finish--> ENDED
                         |                  |
                         +--cancel/expire---+--> stopping: the worker answers the reason
                         +--withdraw (last forwarder)--> ENDED without an answer

Rules:
1. Admission (dedup, bounds, expected wait, shutdown: ``Admission``) decides whether a task
   is taken; a duplicate of a pending task is absorbed (its forwarder is added to those told
   when it ends), a duplicate of an ended one gets the cached Result.
2. Whoever handed us the task is remembered: the producer (no forwarder), or each forwarder
   that sent it, or ``ANY`` for a task re-run from the journal after a restart (its forwarder's
   connection is a new one, so a Withdraw from any forwarder counts) with that forwarder's
   name, so that its TaskDone can go to it by name.
3. A Withdraw removes its sender from the task's forwarders; when none is left and the task
   came from no producer directly, it is dropped without an answer (queued: never runs;
   running: aborted).  A Withdraw from a member that did not send the task is ignored.
   3b. A copy of a withdrawn task that arrives while its aborted worker has not yet ended
   (a forwarder's migration back here, a producer's retry through another entry) is not
   left to that worker's silent end: the task is ``RESTART``ed, run again from the queue
   when the worker ends (or finished with the Result the worker had got first), and
   answered to whoever holds it now.  Its engine request id is free again only then.
4. A producer's Cancel (only from the key that submitted the task: ``Task.producer_key``,
   "" for all without CURVE; from another key it is ``REFUSED`` and changes nothing) and the
   deadline stop a task (queued or running) with an answer:
   ``cancelled`` or ``deadline_exceeded``; a stop that comes later than another keeps the
   first reason, and a withdrawal wins over both (nobody waits for that answer).
5. When a task ends, its Result goes to the producer first, then a TaskDone to each forwarder
   (``Owned.notify``), so a forwarder never forgets a task whose Result has not left.

Theory of operation: the ingress shell calls ``offer`` for each task (from a producer or a
peer), ``start`` when a worker takes it, ``stop_reason`` when its worker was cancelled,
``finish`` with its final Result, ``release`` when it leaves without one (withdrawn,
handed off) and ``restart`` when an aborted worker ends (rule 3b: run it again if so);
``cancel``, ``withdraw`` and ``expire`` say whether a running task's worker must be aborted.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Iterator

from gossipd.core.admission import Admission, Verdict
from gossipd.core.budgets import task_bytes
from gossipd.core.messages import Result, Task

# In a task's forwarders: any forwarder may withdraw it (a task re-run from the journal).
ANY: Hashable = b""


class Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    ENDED = "ended"


class Stop(enum.Enum):
    """Why a task was stopped before it finished by itself."""

    CANCELLED = "cancelled"  # its producer's Cancel: answered cancelled
    EXPIRED = "expired"  # its deadline passed: answered deadline_exceeded
    WITHDRAWN = "withdrawn"  # its forwarders had it run elsewhere: no answer from here
    # Withdrawn while running, then wanted again (rule 3b): when its aborted worker ends,
    # it goes back to the queue and runs for its new holders.
    RESTART = "restart"


class Abort(enum.Enum):
    """What the shell must do after cancel / withdraw / expire."""

    NOTHING = "nothing"  # unknown, ended, or stopped already
    # Queued: the worker that takes it answers (or drops) it at once; or running and being
    # aborted already (RESTART): its worker's end answers it.
    MARKED = "marked"
    ABORT = "abort"  # running: abort its engine request (cancel its worker)
    REFUSED = "refused"  # a Cancel from a key other than the task's producer's (rule 4)


class Owned:
    """One task this daemon holds.  Hashed by identity (a key in the deadline wheel).  A
    plain slots class, not a dataclass: one is made per task on the hot path."""

    __slots__ = (
        "engine_deaths",
        "forwarders",
        "from_producer",
        "phase",
        "received_at",
        "replayed_src",
        "stop",
        "task",
    )

    def __init__(self, task: Task, received_at: float, from_producer: bool) -> None:
        self.task = task
        self.received_at = received_at  # at the entry point: the deadline counts from it
        self.from_producer = from_producer  # a producer sent it to us (not a peer's Forward)
        self.forwarders: list[Hashable] = _NONE  # who sent it (shared empty list until one)
        self.replayed_src = ""  # for ANY: the member that forwarded it before our restart
        self.phase = _QUEUED
        self.stop: Stop | None = None
        # Engines that died while running it, here and before (Forward.engine_deaths).
        self.engine_deaths = 0

    def add_forwarder(self, forwarder: Hashable) -> None:
        if self.forwarders is _NONE:
            self.forwarders = [forwarder]
        elif forwarder not in self.forwarders:
            # (a resend on the same connection is the same forwarder's one copy: listed
            # twice, its one Withdraw left it listed, and its Result was never held)
            self.forwarders.append(forwarder)

    def notify(self) -> list[Hashable]:
        """Rule 5: the forwarders (connection identities) to send a TaskDone when it ends."""
        return [f for f in self.forwarders if f != ANY]

    def notify_member(self) -> str:
        """...and the member to send one by name (a task re-run from the journal)."""
        return self.replayed_src if ANY in self.forwarders else ""

    def __repr__(self) -> str:
        return (
            f"Owned({self.task.id!r}, {self.phase.value}, stop={self.stop}, from={self.forwarders})"
        )


_NONE: list[Hashable] = []  # never appended to: add_forwarder replaces it
# Enum members read per task are module globals: on Python 3.11 reading one through its
# class costs ~80 ns (EnumType defines __getattr__, which puts every attribute read of an
# enum class on the slow path), a global ~10 ns.
_ADMIT = Verdict.ADMIT
_QUEUED, _RUNNING, _ENDED = Phase.QUEUED, Phase.RUNNING, Phase.ENDED
_WITHDRAWN, _RESTART = Stop.WITHDRAWN, Stop.RESTART


class TaskBook:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self._owned: dict[str, Owned] = {}  # admitted and not ended, by task id

    def __len__(self) -> int:
        return len(self._owned)

    def __iter__(self) -> Iterator[Owned]:
        """The tasks held (admitted, not ended), oldest first."""
        return iter(self._owned.values())

    def get(self, task_id: str) -> Owned | None:
        return self._owned.get(task_id)

    # -- inputs ----------------------------------------------------------------------------

    def offer(
        self,
        task: Task,
        received_at: float,
        now: float,
        *,
        forwarder: Hashable | None = None,
    ) -> tuple[Verdict, Owned | Result | None]:
        """Rule 1.  ``forwarder``: the peer that forwarded it (None: a producer, or a local
        retry).  Returns the verdict and the new entry (ADMIT), the pending entry
        (DUPLICATE_PENDING) or the cached Result (DUPLICATE_DONE; None when it is not to be
        sent again: admission's rule 5)."""
        task_id = task.id
        verdict, cached = self.admission.offer(
            task_id,
            now,
            received_at + task.timeout_ms / 1000.0 - now,
            task_bytes(task),
            task.producer_key,
            task.attempt,
            received_at,
        )
        if verdict is _ADMIT:
            if forwarder is None:
                owned = self._owned[task_id] = Owned(task, received_at, True)
            else:
                owned = self._owned[task_id] = Owned(task, received_at, False)
                owned.forwarders = [forwarder]
            return verdict, owned
        if verdict is Verdict.DUPLICATE_PENDING:
            pending = self._owned.get(task.id)
            if pending is not None:
                if forwarder is None:
                    pending.from_producer = True
                else:
                    pending.add_forwarder(forwarder)
                if pending.stop is _WITHDRAWN:  # rule 3b: wanted again
                    pending.stop = _RESTART if pending.phase is _RUNNING else None
            return verdict, pending
        return verdict, cached

    def held(self, tasks: Iterable[tuple[str, str]]) -> list[str]:
        """The ids of ``tasks`` ((id, producer key) pairs) pending or answered here, for
        that key, and not being withdrawn (that copy ends unanswered): what a restarted
        member must not run again (a ReplayQuery's answer)."""
        holds, owned = self.admission.holds, self._owned
        return [
            task_id
            for task_id, producer in tasks
            if holds(task_id, producer)
            and getattr(owned.get(task_id), "stop", None) is not Stop.WITHDRAWN
        ]

    def expect_withdraw(self, task_id: str, src: str) -> None:
        """Rule 2: ``task_id``, re-run from the journal, came from member ``src``."""
        owned = self._owned.get(task_id)
        if owned is not None:
            owned.from_producer = False
            owned.add_forwarder(ANY)
            owned.replayed_src = src

    def start(self, owned: Owned) -> bool:
        """A worker takes the queued entry; False when it is no longer ours to run (withdrawn
        and released, or a stale entry of an id admitted again since)."""
        if self._owned.get(owned.task.id) is not owned or owned.phase is not _QUEUED:
            return False
        if owned.stop is _WITHDRAWN:
            return False
        owned.phase = _RUNNING
        return True

    def restart(self, task_id: str) -> bool:
        """Rule 3b: the aborted worker of a ``RESTART`` entry has ended (or a hand-off that
        took it looks at it): it is not stopped any more, and runs (the shell queues it
        again).  False: no RESTART entry of that id."""
        owned = self._owned.get(task_id)
        if owned is None or owned.stop is not _RESTART:
            return False
        owned.stop = None
        return True

    def cancel(self, task_id: str, producer_key: str = "") -> Abort:
        """Rule 4: a Cancel from ``producer_key`` (the key it came with; "" without CURVE)."""
        owned = self._owned.get(task_id)
        if owned is not None and owned.task.producer_key != producer_key:
            return Abort.REFUSED
        return self._stop(task_id, Stop.CANCELLED)

    def expire(self, task_id: str) -> Abort:
        return self._stop(task_id, Stop.EXPIRED)

    def withdraw(self, task_id: str, forwarder: Hashable) -> Abort:
        """Rule 3."""
        owned = self._owned.get(task_id)
        if owned is None or owned.stop is Stop.WITHDRAWN:
            return Abort.NOTHING
        if forwarder in owned.forwarders:
            owned.forwarders.remove(forwarder)
        elif ANY in owned.forwarders:
            owned.forwarders.remove(ANY)
            owned.replayed_src = ""
        else:
            return Abort.NOTHING
        if owned.forwarders or owned.from_producer:
            return Abort.NOTHING  # someone else still waits for its answer
        stopping = owned.stop is not None  # cancelled, expired, or aborted to restart
        owned.stop = Stop.WITHDRAWN
        if owned.phase is Phase.RUNNING:
            # A stopping task's worker is aborted already: its end reads WITHDRAWN.
            return Abort.NOTHING if stopping else Abort.ABORT
        # Queued (stopping or not): no worker will take it (start() refuses a withdrawn
        # entry), so the shell releases it now.
        return Abort.MARKED

    def stop_reason(self, task_id: str) -> Stop | None:
        """Why the task's worker was stopped (None: not by us; a shutdown)."""
        owned = self._owned.get(task_id)
        return None if owned is None else owned.stop

    def finish(self, task_id: str, result: Result, *, remember: bool = True) -> Owned:
        """Rule 5: the task's final Result; the entry (its ``notify()`` and
        ``notify_member()`` say who gets a TaskDone after the Result).  ``remember=False``: a
        resubmission may run it again (refused at shutdown)."""
        owned = self._owned.pop(task_id)
        owned.phase = _ENDED
        self.admission.finish(task_id, result, remember=remember)
        return owned

    def answered(self, task: Task, now: float) -> None:
        """``task``'s final Result has just been handed to the reply sender, at ``now``
        (admission's rule 5: an earlier send of its id that arrives late is not answered
        again)."""
        if task.attempt:
            self.admission.answered(task.id, task.attempt, now)

    def release(self, task_id: str, result: Result) -> Owned:
        """The task leaves without an answer from here (withdrawn, or handed to another
        member); a resubmission may run it again."""
        owned = self._owned.pop(task_id)
        owned.phase = Phase.ENDED
        self.admission.finish(task_id, result, remember=False)
        return owned

    # -- internals -------------------------------------------------------------------------

    def _stop(self, task_id: str, why: Stop) -> Abort:
        """Rule 4."""
        owned = self._owned.get(task_id)
        if owned is None:
            return Abort.NOTHING
        if owned.stop is _RESTART:
            # Its worker is being aborted already: its end answers ``why`` instead.
            owned.stop = why
            return Abort.MARKED
        if owned.stop is not None:
            return Abort.NOTHING
        owned.stop = why
        return Abort.ABORT if owned.phase is Phase.RUNNING else Abort.MARKED
