"""The intake: one path from any door to a decision on a producer's task.

    a door (ZeroMQ: ingress/service.py; an HTTP door would call the same) -> ``take``
    -> token budget gate -> id of another producer? -> router (another member's task: the
    dispatcher forwards it) -> ``admit`` (TaskBook.offer: admission, dedup) -> the runner's
    queue (ingress/runner.py)

A door decodes its own wire format, says whose the task is (``Task.producer_key``: the key
it authenticated, never the producer's word) and hands the Task here; everything after that
is the same for every door.  Each refusal is counted by reason and answered on the task's
route with the code and a reason a person can act on (the verdict-to-error mapping is
here, once).  Cancels go the same way: ``cancel`` here, or passed on to where the task runs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import IngressConfig
from gossipd.core.admission import Admission, Verdict, refused
from gossipd.core.lifecycle import Owned, TaskBook
from gossipd.core.messages import ErrorCode, Result, Task, encode, error_result
from gossipd.core.queueing import QueueWait
from gossipd.ingress.budgets import BudgetGate
from gossipd.ingress.links import IngressLinks
from gossipd.ingress.runner import Runner
from gossipd.ops.logs import RateLimiter
from gossipd.replysender import ReplySender

log = logging.getLogger("gossipd.ingress.intake")

# Enum members read per task as globals (Python 3.11: ~80 ns through the class, see
# core/admission.py).
_ADMIT, _DUPLICATE_PENDING = Verdict.ADMIT, Verdict.DUPLICATE_PENDING


def admission_for(config: IngressConfig) -> tuple[TaskBook, QueueWait]:
    """The task book over admission as ``config`` bounds it, and the expected-wait model
    admission refuses by (core/queueing.py; the runner feeds it service times)."""
    queue_wait = QueueWait(
        concurrency=config.concurrency_max,
        deadline_ratio=config.queue_wait_deadline_ratio,
        target_s=config.queue_wait_target_s,
        retry_after_min_ms=config.retry_after_ms,
        retry_after_max_ms=config.retry_after_max_ms,
        smoothing=config.service_time_smoothing,
    )
    admission = Admission(
        pending_max=config.pending_max,
        results_max=config.results_cache_max,
        queue=queue_wait if config.queue_wait_admission else None,
        pending_bytes_max=config.pending_bytes_max,
        results_bytes_max=config.results_cache_bytes_max,
    )
    return TaskBook(admission), queue_wait


class Intake:
    """Admission, budgets and routing for every door; the runner runs what it admits."""

    def __init__(
        self,
        config: IngressConfig,
        *,
        book: TaskBook,
        runner: Runner,
        replies: ReplySender,
        node: str,
        refused_log: RateLimiter,
        links: IngressLinks,
        clock: Clock = SYSTEM_CLOCK,
        model: str = "",
        budget_gate: BudgetGate | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._replies = replies
        self._node = node
        # Every admitted task from admission to its answer and TaskDones: core/lifecycle.py.
        self.book = book
        self.admission = book.admission
        self.runner = runner
        self._retry_after_ms = config.retry_after_ms  # the hint of the latest refusal
        self.refused: Counter[str] = Counter()  # by reason (the doors count theirs here too)
        self.cancels: Counter[str] = Counter()  # by outcome: here, forwarded, refused, unknown
        # Warnings of refusals, rate-limited with the door's (one budget of lines a second).
        self._refused_log = refused_log
        self.model = model  # the model this daemon's engine serves
        # Listeners, called synchronously in order: a task admitted here (journal, prefix
        # record, tracing); a task routed here that admission refused or answered from the
        # results cache (nothing of it runs here).
        self.on_admitted: list[Callable[[Task], None]] = []
        self.on_refused: list[Callable[[Task], None]] = []
        # The parts built after the intake that it calls (fan-out, admin): see IngressLinks.
        self.links = links
        # With budgets.enabled: each producer's task is charged against its token budget
        # before it is routed (ingress/budgets.py); past it: over_budget.
        self.budget_gate = budget_gate

    def take(
        self, task: Task, now: float, identity: str | None = None, *, charged: bool = False
    ) -> None:
        """A producer's task from a door, its ``producer_key`` set by the door.
        ``identity``: whose token budget it is charged to when the door knows better than
        the task (the HTTP door: "http:NAME" of its API key, "" without keys: by the task's
        key as if without CURVE); None: from the task (tokenbudgets' rule 1).  ``charged``:
        its budget was charged already (``charge_together``)."""
        router = self.links.router
        if self._id_held_by_other(task):  # (before the budget, with fan-out or without: a
            self.admission.count_conflict()  # refused task takes nothing)
            self._refuse(task, Verdict.CONFLICT, answer=True)
            return
        # A resend of a task pending or answered here goes straight to admission, which
        # answers it (its copy's Result, cached or to come), wherever its key would place
        # it now: placed, it would run again elsewhere, uncharged (charged when it came).
        if not self.admission.holds(task.id, task.producer_key):
            gate = self.budget_gate
            if (
                gate is not None
                and not charged
                and not self._forwarded_here(task)
                and (retry_after_ms := gate.check(task, now, identity))
            ):
                self.refused[ErrorCode.OVER_BUDGET.value] += 1
                message = gate.refusal(task, identity)
                self.send_error(task, ErrorCode.OVER_BUDGET, message, retry_after_ms)
                return
            if router is not None and router(task, now):
                return  # another member owns it: the dispatcher forwards it
            if router is None and task.model and self.model and task.model != self.model:
                # A daemon alone (no fan-out, whose placement checks it): as a cluster would.
                self.refused[ErrorCode.UNAVAILABLE.value] += 1
                message = (f"no live member serves model {task.model!r} (this daemon, alone, "
                           f"serves {self.model!r})")  # fmt: skip
                self.send_error(task, ErrorCode.UNAVAILABLE, message, self._config.retry_after_ms)
                return
        verdict = self.admit(task, now, answer=True, now=now)
        if verdict is not _ADMIT and verdict is not _DUPLICATE_PENDING:
            for listener in self.on_refused:  # routed here, but nothing of it runs here
                listener(task)

    def charge_together(self, tasks: list[Task], now: float, identity: str | None) -> bool:
        """The tasks of one request (the HTTP door's choices) charged to their budget as
        one, all or none, before any is taken (``take(..., charged=True)``): taken one by one,
        a request larger than the bucket's burst would have its first tasks admitted and a
        later one refused on every retry.  False: refused, the first task answered
        over_budget (its Retry-After for the whole cost)."""
        gate = self.budget_gate
        if gate is None:
            return True
        retry_after_ms = gate.check_together(tasks, now, identity)
        if not retry_after_ms:
            return True
        self.refused[ErrorCode.OVER_BUDGET.value] += 1
        message = gate.refusal(tasks[0], identity, together=tasks)
        self.send_error(tasks[0], ErrorCode.OVER_BUDGET, message, retry_after_ms)
        return False

    def _forwarded_here(self, task: Task) -> bool:
        """A resend of a task forwarded from here to the same route (on its way, or run by
        a live member and not reported done), which the router absorbs: charged once, when
        it first came."""
        forwarded_here = self.links.forwarded_here
        return forwarded_here is not None and forwarded_here(task)

    def _id_held_by_other(self, task: Task) -> bool:
        """The task's id is another producer key's here: pending or cached, or forwarded
        from here and not reported done (docs/PROTOCOL.md "An id is its producer's")."""
        if self.admission.held_by_other(task.id, task.producer_key):
            return True
        forwarded = self.links.forwarded_for_other
        return forwarded is not None and forwarded(task)

    def admit(
        self,
        task: Task,
        received_at: float,
        *,
        answer: bool,
        now: float | None = None,
        forwarder: Hashable | None = None,
        enqueue: bool = True,
    ) -> Verdict:
        """Run ``task`` here if admission allows.  ``answer=False`` (a forwarded task): a
        refusal is the forwarder's to handle, not sent to the producer, with the hint
        ``retry_after_ms`` (read it right after this call).  ``forwarder``: the peer that
        forwarded it (told TaskDone when it ends).  ``now``: the clock's monotonic().
        ``enqueue=False``: admitted but held from the workers until the caller hands its
        entry to ``runner.enqueue`` (a restart's replay while members are asked)."""
        now = self._clock.monotonic() if now is None else now
        verdict, entry = self.book.offer(task, received_at, now, forwarder=forwarder)
        self._retry_after_ms = self._config.retry_after_ms
        if verdict is _ADMIT:
            for listener in self.on_admitted:
                listener(task)
            assert isinstance(entry, Owned)
            if enqueue:
                self.runner.enqueue(entry)
        elif verdict is Verdict.DUPLICATE_DONE:
            if entry is None:
                return verdict  # an earlier send, its id answered at a later one: not again
            assert isinstance(entry, Result)
            self._replies.send(task.route, encode(entry), task.batch_replies)
            self.book.answered(task, now)
            if self.links.answered_cached is not None:
                self.links.answered_cached(task.id)  # a Result held for it is now sent
        elif verdict is not _DUPLICATE_PENDING:  # (its one result goes out when it finishes)
            self._refuse(task, verdict, answer)
        return verdict

    def _refuse(self, task: Task, verdict: Verdict, answer: bool) -> None:
        """Admission said no: counted by reason; answered to the producer with ``answer``."""
        config = self._config
        no = refused(
            verdict,
            self.admission,
            pending_max=config.pending_max,
            pending_bytes_max=config.pending_bytes_max,
            retry_after_ms=config.retry_after_ms,
        )
        self.refused[no.reason] += 1
        if verdict is Verdict.OVERLOADED:
            self._retry_after_ms = no.retry_after_ms  # read by a forwarder's owner
        if answer:
            self.send_error(task, no.code, no.message, no.retry_after_ms)

    @property
    def retry_after_ms(self) -> int:
        """The retry-after hint for the latest ``admit`` call's refusal: computed for a refusal
        by expected wait, else ``ingress.retry_after_ms``."""
        return self._retry_after_ms

    def handle_cancel(self, task_id: str, producer_key: str = "") -> None:
        """A producer's Cancel (``producer_key``: the key it came with, "" without CURVE; on
        the rpc channel, the key the entry daemon read): abort the task here, or pass it on
        to where it runs.  Only the key that submitted the task may cancel it; a Cancel from
        another is ignored and counted (outcome ``refused``), as docs/PROTOCOL.md says."""
        outcome = self.runner.cancel(task_id, producer_key)
        cancel_elsewhere = self.links.cancel_elsewhere
        if outcome is None and cancel_elsewhere is not None:
            outcome = cancel_elsewhere(task_id, producer_key)
        cancel_waiting = self.links.cancel_waiting
        if outcome is None and cancel_waiting is not None:
            outcome = cancel_waiting(task_id, producer_key)
        if outcome is None:
            outcome = "unknown"  # finished already, or never seen here
        self.cancels[outcome] += 1
        if outcome == "refused" and self._refused_log.allow():
            log.warning(
                "refused a Cancel from a producer that did not submit the task",
                extra={
                    "task_id": task_id[:128],
                    "key": producer_key,
                    "suppressed_since_last": self._refused_log.take_suppressed(),
                },
            )

    def send_error(
        self, task: Task, code: ErrorCode, message: str, retry_after_ms: int = 0
    ) -> None:
        """Answer ``task`` with an error Result on its route."""
        result = error_result(
            task.id, code, message, node=self._node, retry_after_ms=retry_after_ms
        )
        self._replies.send(task.route, encode(result), task.batch_replies)

    def begin_shutdown(self) -> None:
        """Every new task is refused with shutting_down from now on; pending ones finish."""
        self.admission.begin_shutdown()
