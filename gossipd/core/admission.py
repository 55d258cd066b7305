"""Admission and de-duplication of tasks at the daemon that runs them (sans-IO).

Rules:
1. A task id runs at most once while it is pending (queued or running) or its result is still
   in the bounded cache of recent results.  A duplicate of a pending task is absorbed (its one
   result will be sent when it finishes); a duplicate of a finished task gets the cached result
   (unless rule 5 says it had it).
2. At most ``pending_max`` tasks are pending.  Beyond that a new task is refused as overloaded;
   refusals are not remembered, so a retry can succeed later.
2a. With a ``QueueWait`` (core/queueing.py), a new task whose expected queueing wait exceeds
   what its remaining deadline (or the queueing target) allows is refused as overloaded too,
   before the pending_max check; ``refusal`` then holds the decision (wait, bound, hint).
2b. At most ``pending_bytes_max`` bytes of pending tasks (``budgets.task_bytes``: the prompt
   and a fixed part).  Beyond that a new task is refused as overloaded (``refused_bytes`` is
   set), unless nothing is pending: a lone task always fits, so the bound is the budget plus
   one task.
3. After ``begin_shutdown`` every new task is refused with shutting_down; pending ones finish.
1a. A task id belongs to the producer key that submitted it (``producer``: its CURVE key,
   "" without CURVE) while it is pending or cached.  The same id offered with another key is
   refused as ``CONFLICT`` (``id_in_use``): never absorbed into the other producer's task and
   never answered with its cached Result.  Without keys every producer is "" (as before).
4. The results cache holds at most ``results_max`` entries and ``results_bytes_max`` bytes
   (``budgets.result_bytes``) and forgets the oldest first; a result larger than the whole
   budget is not kept.  Every result forgotten for room is counted, by the bound that forced
   it (``evicted_count`` / ``evicted_bytes``).
5. A duplicate of a finished task is not answered again (``DUPLICATE_DONE`` with no Result)
   when it is an earlier send that arrives late: its ``attempt`` is lower than that of a send
   whose Result was handed to the reply sender here (``answered``), and it entered the
   cluster (``received_at``: its receipt at its entry daemon) before that.  The producer sent
   the id again later and was answered, and it sends again, with a higher attempt, if that
   answer was lost.  Such a copy is a forwarder migrating the first send after its owner
   died; answering it would only give the producer a second final Result.  A send that
   entered after the answer (a producer that restarted and sends its ids again from attempt
   0) gets the cached Result.  Only attempts above 0 are remembered (one at 0 suppresses
   nothing), at ``ANSWERED_ENTRY_BYTES`` each on the cache's budget.

Theory of operation: the asyncio shell calls ``offer`` for each decoded task, and ``finish``
once with the task's final result.  Everything here is O(1) per call.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass

from gossipd.core.budgets import result_bytes
from gossipd.core.messages import ErrorCode, Result
from gossipd.core.queueing import QueueDecision, QueueWait
from gossipd.errors import LocalProtocolError


class Verdict(enum.Enum):
    ADMIT = "admit"
    DUPLICATE_PENDING = "duplicate_pending"
    DUPLICATE_DONE = "duplicate_done"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    CONFLICT = "id_in_use"  # rule 1a: the id is another producer's


# Enum members read per task are module globals: on Python 3.11 reading one through its
# class costs ~80 ns (EnumType defines __getattr__, which puts every attribute read of an
# enum class on the slow path), a global ~10 ns.
_ADMIT = Verdict.ADMIT

# What rule 5 adds to the results cache for an id answered at an attempt above 0: a dict
# slot (the id's string is the cache's own), a 2-tuple, a float and a small int, rounded up.
ANSWERED_ENTRY_BYTES = 128


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    pending: int
    pending_bytes: int
    cached_results: int
    cached_results_bytes: int
    results_evicted_count: int  # forgotten for room: results_max
    results_evicted_bytes: int  # ...results_bytes_max (or larger than all of it)
    admitted: int
    duplicates: int
    overloaded: int  # all refusals as overloaded: pending_max and expected wait
    overloaded_expected_wait: int  # ...of which by expected wait (rule 2a)
    overloaded_pending_bytes: int  # ...of which by pending_bytes_max (rule 2b)
    refused_shutting_down: int
    refused_id_in_use: int  # rule 1a
    answered_later: int = 0  # rule 5: earlier sends of an id answered at a later attempt


class Admission:
    def __init__(
        self,
        *,
        pending_max: int,
        results_max: int,
        queue: QueueWait | None = None,
        pending_bytes_max: int = 1 << 62,
        results_bytes_max: int = 1 << 62,
    ) -> None:
        if pending_max < 1 or results_max < 0 or pending_bytes_max < 1 or results_bytes_max < 0:
            raise LocalProtocolError(
                "pending_max and pending_bytes_max must be >= 1, results_max and "
                "results_bytes_max >= 0"
            )
        self._pending_max = pending_max
        self.pending_bytes_max = pending_bytes_max
        self.results_bytes_max = results_bytes_max
        # The latest offer was refused by pending_bytes_max (rule 2b).
        self.refused_bytes = False
        self.queue = queue
        # Below this many pending tasks a worker is free, so there is no wait to decide on
        # (the queue's concurrency is fixed once built): read once here, not per offer.
        self._wait_from = math.inf if queue is None else queue.concurrency
        # The expected-wait decision of the latest offer when it refused by it, else None.
        self.refusal: QueueDecision | None = None
        self._results_max = results_max
        # task id -> (its bytes (budgets.task_bytes), its producer key or "" (rule 1a)).  The
        # key rides in the entry rather than in a dict of its own: one insert and one pop
        # fewer on a 100,000-entry table per task (0.2 us a task with keys, measured here).
        self._pending: dict[str, tuple[int, str]] = {}
        self._pending_bytes = 0
        # task id -> (its final Result, that Result's bytes, its producer key or "").
        self._done: OrderedDict[str, tuple[Result, int, str]] = OrderedDict()
        self._refused_id_in_use = 0
        # Rule 5: task id -> (the highest attempt above 0 whose Result was handed to the
        # reply sender, when: the clock of ``offer``'s ``received_at``), for ids in ``_done``
        # only (most ids never get past attempt 0: no entry, no cost).
        self._answered: dict[str, tuple[int, float]] = {}
        self._answered_later = 0
        self._done_bytes = 0
        self._evicted_count = 0
        self._evicted_bytes = 0
        self._overloaded_pending_bytes = 0
        self._shutting_down = False
        self._admitted = 0
        self._duplicates = 0
        self._overloaded = 0
        self._overloaded_expected_wait = 0
        self._refused_shutting_down = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def offer(
        self,
        task_id: str,
        now: float = 0.0,
        remaining_s: float = math.inf,
        size_bytes: int = 0,
        producer: str = "",
        attempt: int = 0,
        received_at: float = math.inf,
    ) -> tuple[Verdict, Result | None]:
        """Decide what to do with a task id offered at ``now`` with ``remaining_s`` left of its
        deadline and ``size_bytes`` of memory (``budgets.task_bytes``), from ``producer`` (its
        key, rule 1a), sent for the ``attempt``-th time and received at its entry daemon at
        ``received_at`` (rule 5); the Result is set for DUPLICATE_DONE only, and then only if
        it is to be sent (rule 5)."""
        self.refusal = None
        self.refused_bytes = False
        pending = self._pending.get(task_id)
        if pending is not None:
            if pending[1] != producer:
                self._refused_id_in_use += 1
                return Verdict.CONFLICT, None
            self._duplicates += 1
            return Verdict.DUPLICATE_PENDING, None
        cached = self._done.get(task_id)
        if cached is not None:
            if cached[2] != producer:
                self._refused_id_in_use += 1
                return Verdict.CONFLICT, None
            self._duplicates += 1
            self._done.move_to_end(task_id)
            answered = self._answered.get(task_id) if self._answered else None
            if answered is not None and attempt < answered[0] and received_at < answered[1]:
                self._answered_later += 1
                return Verdict.DUPLICATE_DONE, None
            return Verdict.DUPLICATE_DONE, cached[0]
        if self._shutting_down:
            self._refused_shutting_down += 1
            return Verdict.SHUTTING_DOWN, None
        # A free worker means no wait: skip the queue's decision (the common case).
        if len(self._pending) >= self._wait_from:
            assert self.queue is not None
            decision = self.queue.decide(now, len(self._pending), remaining_s)
            if not decision.admit:
                self.refusal = decision
                self._overloaded += 1
                self._overloaded_expected_wait += 1
                return Verdict.OVERLOADED, None
        if len(self._pending) >= self._pending_max:
            self._overloaded += 1
            return Verdict.OVERLOADED, None
        if self._pending_bytes and self._pending_bytes + size_bytes > self.pending_bytes_max:
            self.refused_bytes = True
            self._overloaded += 1
            self._overloaded_pending_bytes += 1
            return Verdict.OVERLOADED, None
        self._pending[task_id] = (size_bytes, producer)
        self._pending_bytes += size_bytes
        self._admitted += 1
        return _ADMIT, None

    def held_by_other(self, task_id: str, producer: str) -> bool:
        """Rule 1a without offering: ``task_id`` is pending or cached here for another key
        (an entry daemon asks before it forwards a task elsewhere)."""
        pending = self._pending.get(task_id)
        if pending is not None:
            return pending[1] != producer
        cached = self._done.get(task_id)
        return cached is not None and cached[2] != producer

    def holds(self, task_id: str, producer: str) -> bool:
        """``task_id`` of ``producer`` is pending or cached here (a restarted member asks
        before it runs its journal's tasks again: core/replaycheck.py)."""
        entry = self._pending.get(task_id) or self._done.get(task_id)
        return entry is not None and entry[-1] == producer

    def knows(self, task_id: str) -> bool:
        """``task_id`` is pending or cached here, for any producer key."""
        return task_id in self._pending or task_id in self._done

    def answered(self, task_id: str, attempt: int, now: float) -> None:
        """Rule 5: the Result of ``task_id``'s send number ``attempt`` was handed to the
        reply sender at ``now`` (the shell calls it where it does so, for attempts above 0;
        a Result the reply sender drops later counts too: the producer's next send has a
        higher attempt).  Nothing when the Result is not cached."""
        if attempt <= 0 or task_id not in self._done:
            return
        answered = self._answered
        before = answered.get(task_id)
        if before is None:
            self._done_bytes += ANSWERED_ENTRY_BYTES
        elif before[0] >= attempt:
            return
        answered[task_id] = (attempt, now)
        self._fit_bytes()

    def count_conflict(self) -> None:
        """An id_in_use refused before ``offer`` (``held_by_other``, or an id forwarded from
        here for another key): counted with the ones ``offer`` refuses."""
        self._refused_id_in_use += 1

    def finish(self, task_id: str, result: Result, *, remember: bool = True) -> None:
        """Record the final result of an admitted task.  ``remember=False`` (for a task
        refused at shutdown) lets a resubmission run it again elsewhere or later."""
        try:
            pending_bytes, producer = self._pending.pop(task_id)
        except KeyError:
            raise LocalProtocolError(
                f"finish({task_id!r}) for a task that is not pending"
            ) from None
        self._pending_bytes -= pending_bytes
        if not remember or self._results_max == 0:
            return
        size = result_bytes(result)
        if size > self.results_bytes_max:
            self._evicted_bytes += 1  # it would push out everything else and still not fit
            return
        if task_id in self._done:  # never, while offer() answers DUPLICATE_DONE first
            self._forget(task_id, self._done.pop(task_id)[1])
        self._done[task_id] = (result, size, producer)
        self._done_bytes += size
        while len(self._done) > self._results_max:
            self._evict_oldest()
            self._evicted_count += 1
        self._fit_bytes()

    def _fit_bytes(self) -> None:
        """Rule 4's byte bound: the oldest Results go until the cache fits it."""
        while self._done_bytes > self.results_bytes_max:
            self._evict_oldest()
            self._evicted_bytes += 1

    def _evict_oldest(self) -> None:
        task_id, (_, size, _) = self._done.popitem(last=False)
        self._forget(task_id, size)

    def _forget(self, task_id: str, size: int) -> None:
        """A cached Result of ``size`` bytes has left the cache: its bytes, and rule 5's."""
        self._done_bytes -= size
        answered = self._answered
        if answered and answered.pop(task_id, None) is not None:
            self._done_bytes -= ANSWERED_ENTRY_BYTES

    def begin_shutdown(self) -> None:
        self._shutting_down = True

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            pending=len(self._pending),
            pending_bytes=self._pending_bytes,
            cached_results=len(self._done),
            cached_results_bytes=self._done_bytes,
            results_evicted_count=self._evicted_count,
            results_evicted_bytes=self._evicted_bytes,
            admitted=self._admitted,
            duplicates=self._duplicates,
            overloaded=self._overloaded,
            overloaded_expected_wait=self._overloaded_expected_wait,
            overloaded_pending_bytes=self._overloaded_pending_bytes,
            refused_shutting_down=self._refused_shutting_down,
            refused_id_in_use=self._refused_id_in_use,
            answered_later=self._answered_later,
        )


ID_IN_USE_MESSAGE = (
    "this task id is in use by another producer's task (pending or recently answered): "
    "choose another id"
)


@dataclass(frozen=True, slots=True)
class Refused:
    """A refusal as its producer hears it: the code, a reason a person can act on, the
    retry hint, and the label it is counted under (the code, or a finer one)."""

    code: ErrorCode
    message: str
    retry_after_ms: int
    reason: str


def refused(
    verdict: Verdict,
    admission: Admission,
    *,
    pending_max: int,
    pending_bytes_max: int,
    retry_after_ms: int,
) -> Refused:
    """What ``offer``'s refusal (overloaded, conflict, shutting_down) says to the producer,
    read right after it (``admission.refusal`` and ``refused_bytes`` say why it was
    overloaded).  One mapping for every door and the simulator."""
    if verdict is Verdict.OVERLOADED:
        refusal = admission.refusal
        if refusal is not None:  # by expected wait
            return Refused(
                ErrorCode.OVERLOADED,
                f"{admission.pending} tasks pending: expected wait "
                f"{refusal.expected_wait_s:.3f} s, more than the {refusal.bound_s:.3f} s "
                "this task may wait",
                refusal.retry_after_ms,
                "overloaded_expected_wait",
            )
        if admission.refused_bytes:
            return Refused(
                ErrorCode.OVERLOADED,
                f"{admission.pending_bytes} bytes of tasks pending here: this task does not "
                f"fit the byte budget (ingress.pending_bytes_max = {pending_bytes_max})",
                retry_after_ms,
                "overloaded_pending_bytes",
            )
        return Refused(
            ErrorCode.OVERLOADED,
            f"{admission.pending} tasks pending, the limit is {pending_max}",
            retry_after_ms,
            ErrorCode.OVERLOADED.value,
        )
    if verdict is Verdict.CONFLICT:
        return Refused(ErrorCode.ID_IN_USE, ID_IN_USE_MESSAGE, 0, ErrorCode.ID_IN_USE.value)
    if verdict is Verdict.SHUTTING_DOWN:
        return Refused(
            ErrorCode.SHUTTING_DOWN,
            "this daemon is shutting down",
            retry_after_ms,
            ErrorCode.SHUTTING_DOWN.value,
        )
    raise LocalProtocolError(f"{verdict} is not a refusal")
