"""Ingress: take tasks from producers, admit them, run them on the engine, answer.

    PULL socket -> decode_task -> Admission.offer -> run queue -> workers -> engine.generate
                -> Chunk*/Result to reply_to (ReplySender) -> Admission.finish

Bad input never raises out of here: each refusal is counted by reason, logged (rate-limited)
and, when the message's reply_to can be read, answered with an error Result.

Concurrency: one receive loop and ``concurrency_max`` worker coroutines, all in the daemon's
TaskGroup.  The run queue is unbounded as a container but bounded by admission (pending_max).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq

from gossipd.config import IngressConfig
from gossipd.core.admission import Admission, Verdict
from gossipd.core.deadlines import DeadlineWheel
from gossipd.core.messages import (
    Cancel,
    Chunk,
    ErrorCode,
    Result,
    Task,
    Timings,
    decode_intake,
    encode,
    error_result,
)
from gossipd.core.queueing import QueueWait
from gossipd.engines.base import (
    Engine,
    EngineDead,
    EngineError,
    GenerateRequest,
    InvalidRequest,
)
from gossipd.errors import RemoteProtocolError
from gossipd.logs import RateLimiter
from gossipd.metrics import LatencyHistogram
from gossipd.runqueue import RunQueue
from gossipd.transport import NOBLOCK, ReplySender, SocketReader

log = logging.getLogger("gossipd.ingress")

# How often running tasks are checked against their deadlines (see core/deadlines.py).
DEADLINE_RESOLUTION_S = 0.01


@dataclass(slots=True, eq=False)  # hashed by identity: a key in the deadline wheel
class _Job:
    task: Task
    received_at: float  # time.monotonic(): uvloop's loop.time() only has millisecond resolution
    worker: asyncio.Task[None] | None = None  # set while a worker runs it
    expired: bool = False
    cancelled: bool = False  # by its producer
    withdrawn: bool = False  # by its forwarder, which has it run elsewhere: no answer from here


@dataclass(frozen=True, slots=True)
class IngressStatistics:
    received: int
    refused: dict[str, int]
    unanswerable: int
    results: dict[str, int]
    queued: int
    running: int
    cancels: dict[str, int]  # by outcome: here, forwarded, unknown
    service_s: float  # smoothed service time of finished tasks; 0 before the first
    expected_wait_s: float  # the expected queueing wait of a task arriving now
    latency: LatencyHistogram = field(repr=False)


class Ingress:
    def __init__(
        self,
        config: IngressConfig,
        *,
        ctx: zmq.Context,
        engine: Engine,
        replies: ReplySender,
        node: str,
        refused_lines_per_s: float,
    ) -> None:
        self._config = config
        self._ctx = ctx
        self._engine = engine
        self._replies = replies
        self._node = node
        # Refusal by expected queueing wait (see core/queueing.py); fed the service time of
        # every task that runs to its end.
        self.queue_wait = QueueWait(
            concurrency=config.concurrency_max,
            deadline_ratio=config.queue_wait_deadline_ratio,
            target_s=config.queue_wait_target_s,
            retry_after_min_ms=config.retry_after_ms,
            retry_after_max_ms=config.retry_after_max_ms,
            smoothing=config.service_time_smoothing,
        )
        self.admission = Admission(
            pending_max=config.pending_max,
            results_max=config.results_cache_max,
            queue=self.queue_wait if config.queue_wait_admission else None,
        )
        self._retry_after_ms = config.retry_after_ms  # the hint of the latest refusal
        # Unbounded as a container; admission bounds it (pending_max).
        self._queue: RunQueue[_Job] = RunQueue()
        self._deadlines = DeadlineWheel(DEADLINE_RESOLUTION_S)
        self._running = 0  # jobs a worker holds (the job itself knows its worker)
        self._jobs: dict[str, _Job] = {}  # admitted and unfinished, by task id (for cancels)
        self._cancels: Counter[str] = Counter()
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._refused_log = RateLimiter(refused_lines_per_s)
        self._received = 0
        self._refused: Counter[str] = Counter()
        self._unanswerable = 0
        self._results: Counter[str] = Counter()
        self.latency = LatencyHistogram()
        self.bound_endpoint = ""
        self.model = ""  # the model this daemon's engine serves (set by the daemon)
        # Hooks, called synchronously in order: a router that may take a task elsewhere, and
        # listeners for admitted and finished tasks (journal, fan-out bookkeeping).
        self.router: Callable[[Task, float], bool] | None = None
        self.on_admitted: list[Callable[[Task], None]] = []
        self.on_finished: list[Callable[[Task, Result], None]] = []
        # ...and for admitted tasks that leave without a result from here (handed off).
        self.on_released: list[Callable[[Task], None]] = []
        # Set by the daemon: gives a task whose engine died to another member (True if taken).
        self.rescue: Callable[[Task, float], Awaitable[bool]] | None = None
        # Set by the daemon: passes a cancel on to the member running a forwarded task.
        self.cancel_elsewhere: Callable[[str], bool] | None = None

    # -- socket side ---------------------------------------------------------------------

    def bind(self) -> str:
        sock = self._ctx.socket(zmq.PULL)
        # Hard ceiling against memory exhaustion: ZeroMQ drops a peer that sends more.
        # Up to it we read the message and refuse it with a clear error (message_bytes_max).
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self._config.message_bytes_max)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._config.bind)
        self._sock = sock
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound_endpoint

    def start_receiving(self) -> None:
        """Read tasks in the socket's fd callback (``SocketReader``), a batch of at most
        ``recv_batch_max`` at a time, so that results flow while input floods in."""
        assert self._sock is not None, "bind() first"
        self._reader = SocketReader(
            self._sock, self._sock.recv, self._config.recv_batch_max, self._on_frames
        )

    def stop_receiving(self) -> None:
        """Take no more tasks from the socket (what is queued there stays for drain_socket)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _on_frames(self, frames: list[bytes]) -> None:
        now = time.monotonic()
        for frame in frames:
            self.handle_frame(frame, now)

    def drain_socket(self, now: float) -> int:
        """Read what is already queued on the socket (at shutdown, to answer it)."""
        if self._sock is None:
            return 0
        count = 0
        try:
            while True:
                self.handle_frame(self._sock.recv(NOBLOCK), now)
                count += 1
        except zmq.Again:
            return count

    def close(self) -> None:
        self.stop_receiving()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # -- decisions -----------------------------------------------------------------------

    def handle_frame(self, frame: bytes, now: float) -> None:
        self._received += 1
        try:
            task = decode_intake(frame, bytes_max=self._config.message_bytes_max)
        except RemoteProtocolError as exc:
            self._refuse(exc, len(frame))
            return
        if type(task) is Cancel:
            self.handle_cancel(task.id)
            return
        assert isinstance(task, Task)
        if self.router is not None and self.router(task, now):
            return  # another member owns it: the dispatcher forwards it
        self.admit(task, now, answer=True, now=now)

    def admit(
        self, task: Task, received_at: float, *, answer: bool, now: float | None = None
    ) -> Verdict:
        """Run ``task`` here if admission allows.  ``answer=False`` (a forwarded task): a
        refusal is the forwarder's to handle, not sent to the producer, with the hint
        ``retry_after_ms`` (read it right after this call).  ``now``: time.monotonic()."""
        now = time.monotonic() if now is None else now
        remaining_s = received_at + task.timeout_ms / 1000.0 - now
        verdict, cached = self.admission.offer(task.id, now, remaining_s)
        self._retry_after_ms = self._config.retry_after_ms
        if verdict is Verdict.ADMIT:
            for listener in self.on_admitted:
                listener(task)
            job = _Job(task, received_at)
            self._jobs[task.id] = job
            self._queue.put_nowait(job)
        elif verdict is Verdict.DUPLICATE_DONE:
            assert cached is not None
            self._replies.send(task.reply_to, encode(cached))
        elif verdict is Verdict.OVERLOADED:
            refusal = self.admission.refusal
            if refusal is not None:  # by expected wait
                self._refused["overloaded_expected_wait"] += 1
                self._retry_after_ms = refusal.retry_after_ms
                why = (
                    f"{self.admission.pending} tasks pending: expected wait "
                    f"{refusal.expected_wait_s:.3f} s, more than the {refusal.bound_s:.3f} s "
                    "this task may wait"
                )
            else:
                self._refused[ErrorCode.OVERLOADED.value] += 1
                why = f"{self.admission.pending} tasks pending, the limit is {self._config.pending_max}"
            if answer:
                self._send_error(
                    task, ErrorCode.OVERLOADED, why, retry_after_ms=self._retry_after_ms
                )
        elif verdict is Verdict.SHUTTING_DOWN:
            self._refused[ErrorCode.SHUTTING_DOWN.value] += 1
            if answer:
                self._send_error(
                    task,
                    ErrorCode.SHUTTING_DOWN,
                    "this daemon is shutting down",
                    retry_after_ms=self._config.retry_after_ms,
                )
        # DUPLICATE_PENDING: its one result goes out when it finishes.
        return verdict

    def when_replies_sent(self, reply_to: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every reply sent to ``reply_to`` so far has left this
        daemon's reply queues (``ReplySender.when_sent``): a task's TaskDone follows its
        Result, never precedes it."""
        self._replies.when_sent(reply_to, callback)

    @property
    def retry_after_ms(self) -> int:
        """The retry-after hint for the latest ``admit`` call's refusal: computed for a refusal
        by expected wait, else ``ingress.retry_after_ms``."""
        return self._retry_after_ms

    def answer_shutting_down(self, task: Task) -> None:
        """A taken task could not be handed off: answer it and forget it."""
        self._finish(
            task,
            error_result(
                task.id,
                ErrorCode.SHUTTING_DOWN,
                "the daemon shut down before this task started",
                node=self._node,
                retry_after_ms=self._config.retry_after_ms,
            ),
            remember=False,
        )

    def handle_cancel(self, task_id: str) -> None:
        """A producer's Cancel: abort the task here, or pass it on to where it runs."""
        if self.cancel(task_id):
            self._cancels["here"] += 1
        elif self.cancel_elsewhere is not None and self.cancel_elsewhere(task_id):
            self._cancels["forwarded"] += 1
        else:
            self._cancels["unknown"] += 1  # finished already, or never seen here

    def cancel(self, task_id: str) -> bool:
        """Cancel an admitted task that has not finished: a running one is aborted in the
        engine (its worker is cancelled), a queued one is answered when a worker takes it.
        Either way its producer gets one Result with ``cancelled``."""
        job = self._jobs.get(task_id)
        if job is None or job.cancelled:
            return job is not None
        job.cancelled = True
        if job.worker is not None:
            job.worker.cancel()
        return True

    def withdraw(self, task_id: str) -> bool:
        """Drop an admitted, unfinished task without answering its producer (its forwarder has
        another member run it): a running one is aborted in the engine.  Chunks already
        streamed from here stay sent."""
        job = self._jobs.get(task_id)
        if job is None:
            return False
        job.withdrawn = job.cancelled = True
        if job.worker is not None:
            job.worker.cancel()
        return True

    def send_error(
        self, task: Task, code: ErrorCode, message: str, retry_after_ms: int = 0
    ) -> None:
        self._send_error(task, code, message, retry_after_ms)

    def _refuse(self, exc: RemoteProtocolError, size: int) -> None:
        reason = exc.reason  # the code, or a finer label (oversized)
        self._refused[reason] += 1
        answered = bool(exc.reply_to)
        if answered:
            self._replies.send(
                exc.reply_to,
                encode(error_result(exc.task_id, ErrorCode(exc.code), exc.hint, node=self._node)),
            )
        else:
            self._unanswerable += 1
        if self._refused_log.allow():
            log.warning(
                "refused a message",
                extra={
                    "reason": reason,
                    "hint": exc.hint[:300],
                    "bytes": size,
                    "answered": answered,
                    "suppressed_since_last": self._refused_log.suppressed,
                },
            )
            self._refused_log.suppressed = 0

    def _send_error(
        self, task: Task, code: ErrorCode, message: str, retry_after_ms: int = 0
    ) -> None:
        result = error_result(
            task.id, code, message, node=self._node, retry_after_ms=retry_after_ms
        )
        self._replies.send(task.reply_to, encode(result))

    # -- workers -------------------------------------------------------------------------

    async def work_forever(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while True:
            try:
                job = await self._queue.get()
            except asyncio.CancelledError:
                # A cancel aimed at a job that finished before the cancel landed arrives here.
                if self.admission.shutting_down or not me.cancelling():
                    raise
                me.uncancel()
                continue
            self._running += 1
            job.worker = me
            try:
                await self._run_job(job)
            finally:
                job.worker = None
                self._running -= 1

    async def expire_forever(self) -> None:
        """Cancel the engine work of tasks past their deadline (they answer deadline_exceeded)."""
        clock = time.monotonic
        while True:
            await asyncio.sleep(DEADLINE_RESOLUTION_S)
            for job in self._deadlines.expire(clock()):
                assert isinstance(job, _Job)
                if job.worker is not None:
                    job.expired = True
                    job.worker.cancel()

    async def _run_job(self, job: _Job) -> None:
        task = job.task
        clock = time.monotonic
        started = clock()
        deadline = job.received_at + task.timeout_ms / 1000.0
        parts: list[str] = []
        first_token_at = 0.0
        seq = 0
        engine_died = False
        token = self._deadlines.add(job, deadline)
        try:
            if job.cancelled:
                raise asyncio.CancelledError
            if started >= deadline:
                raise TimeoutError
            request = GenerateRequest(request_id=task.id, prompt=task.prompt, params=task.params)
            async for delta in self._engine.generate(request):
                if not first_token_at:
                    first_token_at = clock()
                parts.append(delta)
                if task.stream:
                    chunk = Chunk(id=task.id, seq=seq, delta=delta, node=self._node)
                    self._replies.send(task.reply_to, encode(chunk))
                    seq += 1
            end = clock()
            result = Result(
                id=task.id,
                ok=True,
                text="".join(parts),
                node=self._node,
                attempts=task.attempt + 1,
                chunks=seq,
                timings=Timings(
                    queued_ms=(started - job.received_at) * 1e3,
                    first_token_ms=(first_token_at - job.received_at) * 1e3
                    if first_token_at
                    else 0.0,
                    total_ms=(end - job.received_at) * 1e3,
                ),
            )
            self.latency.observe(end - job.received_at)
            self.queue_wait.observe(end - started)
        except TimeoutError:
            result = self._deadline_result(task, len(parts))
        except InvalidRequest as exc:
            result = error_result(task.id, ErrorCode.BAD_REQUEST, str(exc), node=self._node)
        except EngineDead as exc:
            engine_died = True
            result = error_result(task.id, ErrorCode.ENGINE_ERROR, str(exc), node=self._node)
        except EngineError as exc:
            result = error_result(task.id, ErrorCode.ENGINE_ERROR, str(exc), node=self._node)
        except asyncio.CancelledError:
            if job.expired or job.cancelled:  # our deadline sweeper or a Cancel, not a shutdown
                if job.worker is not None and job.worker.cancelling():
                    job.worker.uncancel()
                if job.withdrawn:
                    self._results["withdrawn"] += 1
                    self.release(task, error_result(task.id, ErrorCode.CANCELLED, "withdrawn"))
                    return
                result = (
                    self._deadline_result(task, len(parts))
                    if job.expired
                    else error_result(
                        task.id,
                        ErrorCode.CANCELLED,
                        f"cancelled by the producer ({len(parts)} chunks done)",
                        node=self._node,
                    )
                )
                self._finish(task, result)
                return
            # Shutdown grace ran out: answer, forget (so a resubmission runs it elsewhere).
            self._finish(
                task,
                error_result(
                    task.id,
                    ErrorCode.SHUTTING_DOWN,
                    "the daemon shut down before this task finished",
                    node=self._node,
                    retry_after_ms=self._config.retry_after_ms,
                ),
                remember=False,
            )
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
        if engine_died and self.rescue is not None and await self.rescue(task, job.received_at):
            self._results["handed_off_engine_dead"] += 1
            self.release(task, result)
            return
        self._finish(task, result)

    def _deadline_result(self, task: Task, tokens: int) -> Result:
        return error_result(
            task.id,
            ErrorCode.DEADLINE_EXCEEDED,
            f"deadline of {task.timeout_ms} ms passed ({tokens} tokens done)",
            node=self._node,
        )

    def _finish(self, task: Task, result: Result, *, remember: bool = True) -> None:
        self._jobs.pop(task.id, None)
        self._results["ok" if result.ok else result.error.code] += 1  # type: ignore[union-attr]
        self.admission.finish(task.id, result, remember=remember)
        self._replies.send(task.reply_to, encode(result))
        for listener in self.on_finished:
            listener(task, result)

    def take_queued(self) -> list[tuple[Task, float]]:
        """Remove admitted-but-unstarted tasks (to hand them to other members at drain).
        They stay pending in admission until ``release`` is called for each."""
        out = []
        while len(self._queue):
            job = self._queue.get_nowait()
            self._jobs.pop(job.task.id, None)
            out.append((job.task, job.received_at))
        return out

    def release(self, task: Task, result: Result) -> None:
        """A taken task was handed off (or refused): forget it here without a reply."""
        self._jobs.pop(task.id, None)
        self.admission.finish(task.id, result, remember=False)
        for listener in self.on_released:
            listener(task)

    # -- shutdown ------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self.admission.begin_shutdown()

    def refuse_queued(self) -> int:
        """Answer every admitted-but-unstarted task with shutting_down."""
        count = 0
        while len(self._queue):
            self.answer_shutting_down(self._queue.get_nowait().task)
            count += 1
        return count

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running; False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.admission.pending and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return not self.admission.pending

    def statistics(self) -> IngressStatistics:
        return IngressStatistics(
            received=self._received,
            refused=dict(self._refused),
            unanswerable=self._unanswerable,
            results=dict(self._results),
            queued=len(self._queue),
            running=self._running,
            cancels=dict(self._cancels),
            service_s=self.queue_wait.service_s or 0.0,
            expected_wait_s=self.queue_wait.expected_wait_s(self.admission.pending),
            latency=self.latency,
        )
