"""The runner: admitted tasks from the run queue to the engine and back to their producers.

    run queue -> worker: TaskBook.start -> engine.generate -> Chunk* to reply_to
    -> TaskBook.finish -> Result to reply_to (ReplySender) -> on_finished listeners

Deadlines (a wheel swept while any running task has one), cancels and withdrawals (the
worker running the task is cancelled), the engine's death (the task goes to another member
through ``links.rescue``), held Results (``links.hold``: fanout/holding.py) and the end of a
shutdown (queued tasks handed off or answered shutting_down).  Every door's tasks come here
through the intake (ingress/intake.py), which admits them; this module decides nothing
about admission.

Concurrency: ``concurrency_max`` worker coroutines and the deadline sweeper run in the
daemon's TaskGroup.  The run queue is unbounded as a container but bounded by admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from msgspec import UNSET

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.core.admission import Admission
from gossipd.core.lifecycle import Abort, Owned, Phase, Stop, TaskBook
from gossipd.core.messages import (
    Chunk,
    ErrorCode,
    Result,
    Task,
    Timings,
    TokenUsage,
    encode,
    error_result,
)
from gossipd.core.queueing import DeadlineWheel, QueueWait
from gossipd.core.sampling import LOGPROB_ENTRIES_MAX, TokenLogprob
from gossipd.engines.base import (
    Engine,
    EngineDead,
    EngineError,
    EngineNotRunning,
    GenerateRequest,
    InvalidRequest,
)
from gossipd.ingress.links import IngressLinks
from gossipd.ops.histogram import LatencyHistogram
from gossipd.replysender import ReplySender

log = logging.getLogger("gossipd.ingress.runner")

# How often running tasks are checked against their deadlines (core/queueing.py, DeadlineWheel).
DEADLINE_RESOLUTION_S = 0.01

_WITHDRAWN = Stop.WITHDRAWN


def _bounded(entries: list[TokenLogprob]) -> list[TokenLogprob]:
    """``entries`` (a prompt's log probabilities) when a Chunk or Result may carry them
    (sampling.LOGPROB_ENTRIES_MAX, the top ones counted); else InvalidRequest.  (Engines
    refuse such a prompt before they score it: engines.base.check_prompt_logprobs.)"""
    total = len(entries) + sum(len(entry.top) for entry in entries)
    if total > LOGPROB_ENTRIES_MAX:
        raise InvalidRequest(
            f"prompt_logprobs: the prompt's {len(entries)} tokens with their most likely ones "
            f"make {total} entries, more than {LOGPROB_ENTRIES_MAX}; ask fewer "
            "(prompt tokens x (prompt_logprobs + 1) at most that) or send a shorter prompt"
        )
    return entries


class _DiedUnderItTooOften(Exception):
    """A task at engine.deaths_per_task_max before it starts: answered, not run."""


def _nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Runner:
    """Runs what admission took: workers, the engine, deadlines, the answers."""

    def __init__(
        self,
        *,
        engine: Engine,
        replies: ReplySender,
        node: str,
        book: TaskBook,
        queue_wait: QueueWait,
        links: IngressLinks,
        retry_after_ms: int,
        clock: Clock = SYSTEM_CLOCK,
        engine_deaths_max: int = 2,
    ) -> None:
        self._engine = engine
        # A task running in this many dying engines is not handed on (engine.deaths_per_task_max).
        self._engine_deaths_max = engine_deaths_max
        self._replies = replies
        self._node = node
        self._clock = clock
        self.book = book
        self.admission: Admission = book.admission
        self.queue_wait = queue_wait  # fed the service time of every task run to its end
        self._links = links
        self._retry_after_ms = retry_after_ms  # the hint with shutting_down answers
        # Unbounded as a container; admission bounds it (pending_max).
        self._queue: RunQueue[Owned] = RunQueue()
        self._deadlines = DeadlineWheel(DEADLINE_RESOLUTION_S)
        # Set when a running task's deadline is on the wheel: expire_forever sleeps on it
        # while none is (an idle daemon does not wake 100 times a second for nothing).
        self._deadlines_armed = asyncio.Event()
        self._workers: dict[str, asyncio.Task[None]] = {}  # running task id -> its worker
        # Workers cancelled to abort their task whose cancel has not landed yet: one that
        # lands after the task finished is theirs to drop; any other cancel (the task group's,
        # a shutdown's) ends the worker.
        self._aborting: set[asyncio.Task[None]] = set()
        # Tasks whose worker is offering them to another member (their engine died): not
        # aborted (the hand-off looks at their stop reason: fanout/forwarding.py hand_off).
        self._rescuing: set[str] = set()
        self.results: Counter[str] = Counter()
        # Tasks run again: withdrawn while running, then wanted again (lifecycle rule 3b).
        self.restarts = 0
        # Dead engines' tasks answered here, not handed on (engine.deaths_per_task_max).
        self.not_handed_on = 0
        self.latency = LatencyHistogram()
        # Listeners, called synchronously in order: a task a worker gives to the engine
        # (the journal's RUNNING record)...
        self.on_started: list[Callable[[Owned], None]] = []
        # ...a task whose Result is held (off the engine, not finished: the journal's
        # RUNNING -1)...
        self.on_held: list[Callable[[Owned], None]] = []
        # ...(journal, fan-out bookkeeping, tracing) a task answered from here (the Result has just been handed to the reply sender;
        # the entry says who else to tell: Owned.notify, the forwarders' TaskDones)...
        self.on_finished: list[Callable[[Owned, Result], None]] = []
        # ...and an admitted task that leaves without a result from here (handed off,
        # withdrawn).
        self.on_released: list[Callable[[Task], None]] = []

    def enqueue(self, owned: Owned) -> None:
        """An admitted task: a worker runs it when one is free."""
        self._queue.put_nowait(owned)

    def when_replies_sent(self, reply_to: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every reply sent to ``reply_to`` so far has left this
        daemon's reply queues (``ReplySender.when_sent``): a task's TaskDone follows its
        Result, never precedes it."""
        self._replies.when_sent(reply_to, callback)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._workers)

    # -- cancels and withdrawals -------------------------------------------------------------

    def cancel(self, task_id: str, producer_key: str = "") -> str | None:
        """Cancel an admitted task that has not finished, for the key that submitted it: a
        running one is aborted in the engine (its worker is cancelled), a queued one is
        answered when a worker takes it.  Either way its producer gets one Result with
        ``cancelled``.  Returns "here" (the task is here), "refused" (another key's task),
        None (not here)."""
        if self.book.get(task_id) is None:
            return None
        abort = self.book.cancel(task_id, producer_key)
        if abort is Abort.REFUSED:
            return "refused"
        if abort is Abort.ABORT:
            self._abort(task_id)
        return "here"

    def withdraw(self, task_id: str, forwarder: Hashable) -> bool:
        """``forwarder`` has the task run elsewhere: when no one else waits for its answer
        from here, drop it without answering (a running one is aborted in the engine; chunks
        already streamed stay sent).  True when it was dropped."""
        abort = self.book.withdraw(task_id, forwarder)
        if abort is Abort.ABORT:
            self._abort(task_id)  # its worker releases it
        elif abort is Abort.MARKED:
            self._withdrawn(task_id)
        return abort is not Abort.NOTHING

    def _abort(self, task_id: str) -> None:
        """Cancel the worker running ``task_id`` (none, or one handing it to another member
        after its engine died: the hand-off's end looks at its stop reason)."""
        worker = self._workers.get(task_id)
        if worker is not None and task_id not in self._rescuing:
            self._aborting.add(worker)
            worker.cancel()

    def _withdrawn(self, task_id: str) -> None:
        owned = self.book.get(task_id)
        assert owned is not None
        self.results["withdrawn"] += 1
        self.release(owned.task, error_result(task_id, ErrorCode.CANCELLED, "withdrawn"))

    def answer_shutting_down(self, task: Task) -> None:
        """A taken task could not be handed off: answer it and forget it."""
        if self.book.stop_reason(task.id) is Stop.WITHDRAWN:
            self._withdrawn(task.id)  # nobody waits for an answer from here
            return
        self._finish_shutting_down(task, "started")

    def _finish_shutting_down(self, task: Task, what: str) -> None:
        """Answer shutting_down and forget the task (a resubmission runs it elsewhere)."""
        self._finish(
            task,
            error_result(
                task.id,
                ErrorCode.SHUTTING_DOWN,
                f"the daemon shut down before this task {what}",
                node=self._node,
                retry_after_ms=self._retry_after_ms,
            ),
            remember=False,
        )

    # -- workers -------------------------------------------------------------------------

    async def work_forever(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while True:
            try:
                owned = await self._queue.get()
            except asyncio.CancelledError:
                # A cancel aimed at a task that finished before the cancel landed arrives here:
                # dropped.  Any other is the worker's own end (a shutdown, or the daemon's task
                # group ending because a sibling failed: a worker that swallowed that cancel
                # kept the process up, serving nothing, until SIGKILL).
                if me not in self._aborting or self.admission.shutting_down:
                    raise
                self._aborting.discard(me)
                me.uncancel()
                continue
            if self.book.start(owned):  # else withdrawn while it was queued
                task_id = owned.task.id
                self._workers[task_id] = me
                try:
                    await self._run_job(owned)
                finally:
                    del self._workers[task_id]
            # Not held while waiting for the next: each idle worker (concurrency_max of them)
            # would keep its last task's prompt alive (256 x 900 KB prompts: issue 24).
            del owned

    async def expire_forever(self) -> None:
        """Cancel the engine work of tasks past their deadline (they answer deadline_exceeded)."""
        clock = self._clock.monotonic
        armed = self._deadlines_armed
        while True:
            if not len(self._deadlines):
                armed.clear()
                await armed.wait()
            await asyncio.sleep(DEADLINE_RESOLUTION_S)
            for owned in self._deadlines.expire(clock()):
                assert isinstance(owned, Owned)
                if self.book.expire(owned.task.id) is Abort.ABORT:
                    self._abort(owned.task.id)

    async def _run_job(self, job: Owned) -> None:
        task = job.task
        clock = self._clock.monotonic
        started = clock()
        deadline = job.received_at + task.timeout_ms / 1000.0
        parts: list[str] = []
        first_token_at = 0.0
        seq = 0
        engine_died = died_under_it = False
        token = self._deadlines.add(job, deadline)
        armed = self._deadlines_armed
        if not armed.is_set():
            armed.set()
        try:
            if job.stop is not None:  # cancelled or expired while it was queued
                raise asyncio.CancelledError
            if started >= deadline:
                raise TimeoutError
            if job.engine_deaths >= self._engine_deaths_max:
                # Replayed from the journal (this daemon died under it too: Journal.runs),
                # or handed here at this member's bound.
                raise _DiedUnderItTooOften
            for listener in self.on_started:
                listener(job)
            params = task.params
            logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
            prompt_logprobs: list[TokenLogprob] | None = (
                None if params.prompt_logprobs is None else []
            )
            request = GenerateRequest(
                request_id=task.id,
                prompt=task.prompt,
                params=params,
                model_defaults=task.model_defaults,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                prompt_token_ids=params.prompt_token_ids,
            )
            usage = request.usage
            sent_logprobs = 0  # (of ``logprobs``, those a Chunk carried)
            async for delta in self._engine.generate(request):
                if not first_token_at:
                    first_token_at = clock()
                    if prompt_logprobs is not None:  # (complete before the first delta)
                        _bounded(prompt_logprobs)
                parts.append(delta)
                if task.stream:
                    if prompt_logprobs is not None and not seq:  # (on the first, once)
                        chunk = Chunk(id=task.id, seq=seq, delta=delta, node=self._node,
                                      logprobs=UNSET if logprobs is None else logprobs[:],
                                      prompt_logprobs=prompt_logprobs)  # fmt: skip
                        sent_logprobs = 0 if logprobs is None else len(logprobs)
                    elif logprobs is None:
                        chunk = Chunk(id=task.id, seq=seq, delta=delta, node=self._node)
                    else:
                        chunk = Chunk(id=task.id, seq=seq, delta=delta, node=self._node,
                                      logprobs=logprobs[sent_logprobs:])  # fmt: skip
                        sent_logprobs = len(logprobs)
                    self._replies.send_message(task.route, chunk, task.batch_replies)
                    seq += 1
            end = clock()
            result = Result(
                id=task.id,
                ok=True,
                text="".join(parts),
                node=self._node,
                attempts=task.attempt + 1,
                chunks=seq,
                usage=TokenUsage(
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    finish_reason=usage.finish_reason or "stop",
                ),
                timings=Timings(
                    queued_ms=(started - job.received_at) * 1e3,
                    first_token_ms=(first_token_at - job.received_at) * 1e3
                    if first_token_at
                    else 0.0,
                    total_ms=(end - job.received_at) * 1e3,
                ),
                logprobs=UNSET if logprobs is None else logprobs,
                prompt_logprobs=UNSET if prompt_logprobs is None else _bounded(prompt_logprobs),
            )
            self.latency.observe(end - job.received_at)
            self.queue_wait.observe(end - started)
        except TimeoutError:
            result = self._deadline_result(task, len(parts))
        except _DiedUnderItTooOften:
            self.not_handed_on += 1
            result = self._not_run_again(task, job.engine_deaths)
        except InvalidRequest as exc:
            result = error_result(task.id, ErrorCode.BAD_REQUEST, str(exc), node=self._node)
        except EngineDead as exc:
            engine_died = True
            # (one that was dead before the task came to it did not die under it)
            died_under_it = type(exc) is not EngineNotRunning
            result = error_result(task.id, ErrorCode.ENGINE_ERROR, str(exc), node=self._node)
        except EngineError as exc:
            result = error_result(task.id, ErrorCode.ENGINE_ERROR, str(exc), node=self._node)
        except asyncio.CancelledError:
            why = job.stop  # our deadline sweeper, a Cancel or a Withdraw; None: a shutdown
            if why is not None:
                worker = self._workers[task.id]
                self._aborting.discard(worker)  # our cancel landed here
                if worker.cancelling():
                    worker.uncancel()
                # A shutdown's cancel that landed with ours is delivered once: still counted
                # here, and this worker must end with it rather than wait for work for ever.
                shutdown_too = worker.cancelling() > 0
                if why is Stop.WITHDRAWN:
                    self._withdrawn(task.id)
                elif self.book.restart(task.id):  # withdrawn, then wanted again
                    if shutdown_too:
                        self._finish_shutting_down(task, "finished")
                    else:  # run it again
                        self.restarts += 1
                        log.info("a withdrawn task came again while it was being aborted: "
                                 "it runs again", extra={"task_id": task.id})  # fmt: skip
                        job.phase = Phase.QUEUED
                        self._queue.put_nowait(job)
                else:
                    self._finish(task, self._stopped_result(task, why, len(parts)))
                if shutdown_too:
                    raise
                return
            # Shutdown grace ran out: answer, forget (so a resubmission runs it elsewhere).
            self._finish_shutting_down(task, "finished")
            raise
        except Exception as exc:  # an engine bug must not take the daemon down with it
            log.exception("engine raised an unexpected error", extra={"task_id": task.id})
            result = error_result(
                task.id, ErrorCode.ENGINE_ERROR, f"{type(exc).__name__}: {exc}", node=self._node
            )
        finally:
            self._deadlines.remove(job, token)
        # Not the task's fault: another member runs it (its producer sees one result, from
        # there).  Chunks already streamed from here may be sent again from seq 0.
        rescue = self._links.rescue
        if engine_died and rescue is not None and died_under_it:
            job.engine_deaths += 1  # (the hand-off tells the taker: Forward.engine_deaths)
            if job.engine_deaths >= self._engine_deaths_max:
                rescue = None  # answered here: no other member's engine is risked on it
                if job.stop is Stop.CANCELLED or job.stop is Stop.EXPIRED:
                    result = self._stopped_result(task, job.stop, len(parts))
                else:
                    self.not_handed_on += 1
                    result = self._not_handed_on(task, job.engine_deaths)
        if engine_died and rescue is not None:
            # A Cancel or Withdraw meanwhile does not cancel this worker (an abort landing
            # in the hand-off's await ended the worker, its task never answered nor freed):
            # the hand-off passes it on to the member that took the task.
            self._rescuing.add(task.id)
            try:
                rescued = await rescue(task, job.received_at)
            finally:
                self._rescuing.discard(task.id)
            if rescued:
                self.results["handed_off_engine_dead"] += 1
                self.release(task, result)
                return
            if job.stop is Stop.CANCELLED or job.stop is Stop.EXPIRED:
                result = self._stopped_result(task, job.stop, len(parts))
        if job.stop is _WITHDRAWN:  # withdrawn as it finished: the copy elsewhere answers
            self._withdrawn(task.id)
            return
        self._finish(task, result)

    def _not_handed_on(self, task: Task, deaths: int) -> Result:
        """The answer of a task whose engine died under it once too often: it may be what
        kills them, so no other member's engine is risked on it."""
        log.error(
            "an engine died under this task again: answered engine_error, not handed to "
            "another member (engine.deaths_per_task_max)",
            extra={"task_id": task.id, "engine_deaths": deaths},
        )
        return error_result(
            task.id,
            ErrorCode.ENGINE_ERROR,
            f"the engine died while running this task, the {_nth(deaths)} engine to die under "
            f"it (engine.deaths_per_task_max {self._engine_deaths_max}): it is not handed to "
            "another member, in case it is what kills them; sent again, it runs again",
            node=self._node,
        )

    def _not_run_again(self, task: Task, deaths: int) -> Result:
        """The answer of a task whose count of engines and daemons that died under it is at
        the bound before it starts: one read from the journal (this daemon went down with it
        on the engine), or handed here already at this member's bound."""
        log.error(
            "engines or daemons died under this task engine.deaths_per_task_max times: "
            "answered engine_error, not run again",
            extra={"task_id": task.id, "engine_deaths": deaths},
        )
        return error_result(
            task.id,
            ErrorCode.ENGINE_ERROR,
            f"{deaths} engines or daemons went down while running this task "
            f"(engine.deaths_per_task_max {self._engine_deaths_max}): it is not run again, in "
            "case it is what kills them",
            node=self._node,
        )

    def _stopped_result(self, task: Task, why: Stop, chunks: int) -> Result:
        """The answer of a task stopped by its deadline or its producer's Cancel."""
        if why is Stop.EXPIRED:
            return self._deadline_result(task, chunks)
        return error_result(
            task.id,
            ErrorCode.CANCELLED,
            f"cancelled by the producer ({chunks} chunks done)",
            node=self._node,
        )

    def _deadline_result(self, task: Task, tokens: int) -> Result:
        return error_result(
            task.id,
            ErrorCode.DEADLINE_EXCEEDED,
            f"deadline of {task.timeout_ms} ms passed ({tokens} tokens done)",
            node=self._node,
        )

    def _finish(self, task: Task, result: Result, *, remember: bool = True) -> None:
        self.results["ok" if result.ok else result.error.code] += 1  # type: ignore[union-attr]
        owned = self.book.finish(task.id, result, remember=remember)
        hold = self._links.hold
        if hold is not None and remember and owned.forwarders and not owned.from_producer:
            data = encode(result)
            if hold(owned, result, len(data)):
                for held in self.on_held:
                    held(owned)
                return  # held: end_held sends it (or not) and tells the listeners
            self._replies.send(task.route, data, task.batch_replies)
        else:
            self._replies.send_message(task.route, result, task.batch_replies)
        if task.attempt:
            self.book.answered(task, self._clock.monotonic())
        for listener in self.on_finished:
            listener(owned, result)

    def end_held(self, owned: Owned, result: Result, *, send: bool) -> None:
        """A Result ``links.hold`` held: send it now (``send``), or not (its forwarder had
        the task run elsewhere, or a resubmission was answered from the cache); either way
        the task ends here for the listeners (journal, TaskDones to ``owned.forwarders``)."""
        if send:
            task = owned.task
            self._replies.send(task.route, encode(result), task.batch_replies)
            self.book.answered(task, self._clock.monotonic())
        for listener in self.on_finished:
            listener(owned, result)

    def take_queued(self) -> list[tuple[Task, float]]:
        """Remove admitted-but-unstarted tasks (to hand them to other members at drain).
        They stay pending in admission until ``release`` is called for each."""
        out = []
        while len(self._queue):
            owned = self._queue.get_nowait()
            if self.book.get(owned.task.id) is owned and owned.phase is Phase.QUEUED:
                owned.phase = Phase.RUNNING  # taken: no worker starts it now
                out.append((owned.task, owned.received_at))
        return out

    def requeue(self, task: Task) -> bool:
        """Put back a task ``take_queued`` took (no member would take it): it runs here."""
        owned = self.book.get(task.id)
        if owned is None or owned.phase is not Phase.RUNNING or task.id in self._workers:
            return False
        if self.settle_stopped(task):
            return False
        owned.phase = Phase.QUEUED
        self._queue.put_nowait(owned)
        return True

    def settle_stopped(self, task: Task) -> bool:
        """A task ``take_queued`` took that was stopped while it waited to be handed off:
        withdrawn (nobody waits for its answer: it leaves, as no worker would take it back),
        cancelled or past its deadline (answered so now, rather than run elsewhere).  False:
        not stopped, hand it off (or requeue it)."""
        if self.book.restart(task.id):
            return False  # withdrawn, then wanted again, while it waited: as if never stopped
        why = self.book.stop_reason(task.id)
        if why is None:
            return False
        if why is _WITHDRAWN:
            self._withdrawn(task.id)
        else:
            self._finish(task, self._stopped_result(task, why, 0))
        return True

    def release(self, task: Task, result: Result) -> None:
        """A taken task leaves without a reply from here (withdrawn, handed off)."""
        self.book.release(task.id, result)
        for listener in self.on_released:
            listener(task)

    # -- shutdown ------------------------------------------------------------------------

    def refuse_queued(self) -> int:
        """Answer every admitted-but-unstarted task with shutting_down."""
        count = 0
        while len(self._queue):
            owned = self._queue.get_nowait()
            if self.book.get(owned.task.id) is owned:  # not withdrawn meanwhile
                self.answer_shutting_down(owned.task)
                count += 1
        return count

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running; False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.admission.pending and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return not self.admission.pending

    def served(self) -> tuple[int, int]:
        """Tasks answered from here: (ok, with an error)."""
        ok = self.results.get("ok", 0)
        not_answered = self.results.get("withdrawn", 0) + self.results.get(
            "handed_off_engine_dead", 0
        )
        return ok, sum(self.results.values()) - ok - not_answered


WORKER_STOP_S = 5.0  # how long stopping workers may take before they are cancelled again


async def stop_workers(workers: list[asyncio.Task[None]]) -> None:
    """Cancel the runner's workers and wait for them (a running task answers shutting_down
    as it is cancelled).  A cancel reaches a task once, however often it was asked: one that
    a worker took for its own task's abort (Runner._run_job) would leave it waiting for work for
    ever, and the shutdown with it.  So whatever is still there after WORKER_STOP_S is
    cancelled again, and said so."""
    pending: set[asyncio.Task[None]] = set(workers)
    while pending:
        for worker in pending:
            worker.cancel()
        _, pending = await asyncio.wait(pending, timeout=WORKER_STOP_S)
        if pending:
            log.error("runner workers did not stop when cancelled: cancelling them again",
                      extra={"workers": len(pending)})  # fmt: skip


# -- the run queue: wakes as few workers as the work needs -------------------------------
# A run queue for worker coroutines that wakes as few of them as the work needs.
#
# asyncio.Queue wakes one waiting worker per item, so a burst of 256 quick tasks costs 256 task
# wake-ups even when one worker could run them all back to back.  Here at most one worker is
# woken-but-not-yet-running at a time; a worker that takes an item and sees more wakes the next.
# A worker that runs its item to completion without suspending (a fast engine) keeps draining;
# a worker that suspends inside its item lets the next woken worker run, so concurrency ramps
# up one loop turn per worker exactly when items do suspend.
#
# Ordering: items are taken in FIFO order.  Concurrency: one event loop only.

T = TypeVar("T")


class RunQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._woken = 0
        self.wakeups = 0

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        if self._woken == 0:
            self._wake_one()

    def get_nowait(self) -> T:
        """Take the oldest item; raises IndexError when empty."""
        return self._items.popleft()

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._woken += 1
                self.wakeups += 1
                return

    async def get(self) -> T:
        while not self._items:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # woken, then cancelled: pass it on
                    self._woken -= 1
                    if self._items:
                        self._wake_one()
                raise
            self._woken -= 1
        item = self._items.popleft()
        if self._items and self._woken == 0:
            self._wake_one()
        return item
