"""Admission and de-duplication of tasks at the daemon that runs them (sans-IO).

Rules:
1. A task id runs at most once while it is pending (queued or running) or its result is still
   in the bounded cache of recent results.  A duplicate of a pending task is absorbed (its one
   result will be sent when it finishes); a duplicate of a finished task gets the cached result.
2. At most ``pending_max`` tasks are pending.  Beyond that a new task is refused as overloaded;
   refusals are not remembered, so a retry can succeed later.
2a. With a ``QueueWait`` (core/queueing.py), a new task whose expected queueing wait exceeds
   what its remaining deadline (or the queueing target) allows is refused as overloaded too,
   before the pending_max check; ``refusal`` then holds the decision (wait, bound, hint).
3. After ``begin_shutdown`` every new task is refused with shutting_down; pending ones finish.
4. The results cache holds at most ``results_max`` entries and forgets the oldest first.

Theory of operation: the asyncio shell calls ``offer`` for each decoded task, and ``finish``
once with the task's final result.  Everything here is O(1) per call.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass

from gossipd.core.messages import Result
from gossipd.core.queueing import QueueDecision, QueueWait
from gossipd.errors import LocalProtocolError


class Verdict(enum.Enum):
    ADMIT = "admit"
    DUPLICATE_PENDING = "duplicate_pending"
    DUPLICATE_DONE = "duplicate_done"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    pending: int
    cached_results: int
    admitted: int
    duplicates: int
    overloaded: int  # all refusals as overloaded: pending_max and expected wait
    overloaded_expected_wait: int  # ...of which by expected wait (rule 2a)
    refused_shutting_down: int


class Admission:
    def __init__(
        self, *, pending_max: int, results_max: int, queue: QueueWait | None = None
    ) -> None:
        if pending_max < 1 or results_max < 0:
            raise LocalProtocolError("pending_max must be >= 1 and results_max >= 0")
        self._pending_max = pending_max
        self.queue = queue
        # The expected-wait decision of the latest offer when it refused by it, else None.
        self.refusal: QueueDecision | None = None
        self._results_max = results_max
        self._pending: set[str] = set()
        self._done: OrderedDict[str, Result] = OrderedDict()
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
    def shutting_down(self) -> bool:
        return self._shutting_down

    def offer(
        self, task_id: str, now: float = 0.0, remaining_s: float = math.inf
    ) -> tuple[Verdict, Result | None]:
        """Decide what to do with a task id offered at ``now`` with ``remaining_s`` left of its
        deadline; the Result is set for DUPLICATE_DONE only."""
        self.refusal = None
        if task_id in self._pending:
            self._duplicates += 1
            return Verdict.DUPLICATE_PENDING, None
        cached = self._done.get(task_id)
        if cached is not None:
            self._duplicates += 1
            self._done.move_to_end(task_id)
            return Verdict.DUPLICATE_DONE, cached
        if self._shutting_down:
            self._refused_shutting_down += 1
            return Verdict.SHUTTING_DOWN, None
        queue = self.queue
        # A free worker means no wait: skip the queue's decision (the common case).
        if queue is not None and len(self._pending) >= queue.concurrency:
            decision = queue.decide(now, len(self._pending), remaining_s)
            if not decision.admit:
                self.refusal = decision
                self._overloaded += 1
                self._overloaded_expected_wait += 1
                return Verdict.OVERLOADED, None
        if len(self._pending) >= self._pending_max:
            self._overloaded += 1
            return Verdict.OVERLOADED, None
        self._pending.add(task_id)
        self._admitted += 1
        return Verdict.ADMIT, None

    def finish(self, task_id: str, result: Result, *, remember: bool = True) -> None:
        """Record the final result of an admitted task.  ``remember=False`` (for a task
        refused at shutdown) lets a resubmission run it again elsewhere or later."""
        try:
            self._pending.remove(task_id)
        except KeyError:
            raise LocalProtocolError(
                f"finish({task_id!r}) for a task that is not pending"
            ) from None
        if remember and self._results_max > 0:
            self._done[task_id] = result
            if len(self._done) > self._results_max:
                self._done.popitem(last=False)

    def begin_shutdown(self) -> None:
        self._shutting_down = True

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            pending=len(self._pending),
            cached_results=len(self._done),
            admitted=self._admitted,
            duplicates=self._duplicates,
            overloaded=self._overloaded,
            overloaded_expected_wait=self._overloaded_expected_wait,
            refused_shutting_down=self._refused_shutting_down,
        )
