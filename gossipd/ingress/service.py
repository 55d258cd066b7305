"""Ingress: take tasks from producers, admit them, run them on the engine, answer.

    PULL socket -> SocketReader (fd callback) -> decode_intake -> budget gate -> router
    (another member's task: the dispatcher forwards it) -> TaskBook.offer (admission)
    -> run queue -> worker: TaskBook.start -> engine.generate -> Chunk* to reply_to
    -> TaskBook.finish -> Result to reply_to (ReplySender)

Bad input never raises out of here: each refusal is counted by reason, logged (rate-limited)
and, when the message's reply_to can be read, answered with an error Result.

Concurrency: the socket is read in the loop's fd callback (no receive task);
``concurrency_max`` worker coroutines and the deadline sweeper run in the daemon's TaskGroup.
The run queue is unbounded as a container but bounded by admission (pending_max).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from functools import partial

import msgspec
import zmq

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import IngressConfig
from gossipd.core.admission import Admission, Verdict
from gossipd.core.deadlines import DeadlineWheel
from gossipd.core.lifecycle import Abort, Owned, Phase, Stop, TaskBook
from gossipd.core.messages import (
    Cancel,
    Chunk,
    Drain,
    ErrorCode,
    Result,
    StatusQuery,
    Task,
    Tasks,
    Timings,
    decode_intake,
    encode,
    error_result,
    reply_route,
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
from gossipd.ingress.budgets import BudgetGate
from gossipd.ingress.runqueue import RunQueue
from gossipd.ops.histogram import LatencyHistogram
from gossipd.ops.logs import RateLimiter
from gossipd.zmqloop import NOBLOCK, ReplySender, SocketReader

log = logging.getLogger("gossipd.ingress.service")

# How often running tasks are checked against their deadlines (see core/deadlines.py).
DEADLINE_RESOLUTION_S = 0.01
# Under CURVE: the message property naming the producer (its key; gossipd/security.py), as
# bytes (a str is encoded on every call), and the frame size up to which a frame is copied
# out to bytes rather than decoded from its buffer.
USER_ID = b"User-Id"
COPY_BYTES_MAX = 64 * 1024
ID_IN_USE_MESSAGE = (
    "this task id is in use by another producer's task (pending or recently answered): "
    "choose another id"
)

# Enum members read per task as globals (Python 3.11: ~80 ns through the class, see
# core/admission.py).
_ADMIT, _DUPLICATE_PENDING = Verdict.ADMIT, Verdict.DUPLICATE_PENDING
_WITHDRAWN = Stop.WITHDRAWN


@dataclass(frozen=True, slots=True)
class IngressCurve:
    """CURVE on the ingress: ``serve`` makes the socket a CURVE server (before it binds);
    ``producer_allowed`` says whether a producer key is still authorised."""

    serve: Callable[[zmq.Socket], None]
    producer_allowed: Callable[[str], bool]


@dataclass(slots=True)
class IngressLinks:
    """What the ingress calls in parts built after it, which need the ingress themselves (a
    cycle a constructor cannot close): the composition root (daemon.py) connects each once,
    before the first message is read.  Unconnected, every task runs here and an admin
    request is refused.

    - ``router(task, now)``: True if another member owns the task (the dispatcher forwards it);
    - ``rescue(task, received_at)``: gives a task whose engine died to another member (True
      if one took it);
    - ``cancel_elsewhere(task_id, producer_key)``: passes a Cancel on to the member running a
      forwarded task: "forwarded", "refused" (another key's task) or None (not known);
    - ``forwarded_for_other(task)``: True if a task with its id that another key submitted
      is being forwarded from here, or ran elsewhere and is not reported done;
    - ``hold(owned, result, size)``: True when a forwarded task's final Result is held back
      (its forwarder is not alive in our view, fanout/holding.py); it is sent later by
      ``end_held``, or never when the forwarder migrated the task;
    - ``answered_cached(task_id)``: a resubmission was answered from the results cache;
    - ``admin(request, now, producer_key)``: answers an operator's StatusQuery or Drain
      (gossipd/admin.py), with CURVE over a connection to the asking producer's key.
    """

    router: Callable[[Task, float], bool] | None = None
    rescue: Callable[[Task, float], Awaitable[bool]] | None = None
    cancel_elsewhere: Callable[[str, str], str | None] | None = None
    forwarded_for_other: Callable[[Task], bool] | None = None
    admin: Callable[[StatusQuery | Drain, float, str], None] | None = None
    hold: Callable[[Owned, Result, int], bool] | None = None
    answered_cached: Callable[[str], None] | None = None


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
        clock: Clock = SYSTEM_CLOCK,
        model: str = "",
        curve: IngressCurve | None = None,
        budget_gate: BudgetGate | None = None,
        links: IngressLinks | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
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
            pending_bytes_max=config.pending_bytes_max,
            results_bytes_max=config.results_cache_bytes_max,
        )
        # Every admitted task from admission to its answer and TaskDones: core/lifecycle.py.
        self.book = TaskBook(self.admission)
        self._retry_after_ms = config.retry_after_ms  # the hint of the latest refusal
        # Unbounded as a container; admission bounds it (pending_max).
        self._queue: RunQueue[Owned] = RunQueue()
        self._deadlines = DeadlineWheel(DEADLINE_RESOLUTION_S)
        # Set when a running task's deadline is on the wheel: expire_forever sleeps on it
        # while none is (an idle daemon does not wake 100 times a second for nothing).
        self._deadlines_armed = asyncio.Event()
        self._workers: dict[str, asyncio.Task[None]] = {}  # running task id -> its worker
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
        self.model = model  # the model this daemon's engine serves
        # Listeners, called synchronously in order, for admitted and finished tasks (journal,
        # fan-out bookkeeping, tracing): subscribers append themselves.
        self.on_admitted: list[Callable[[Task], None]] = []
        # ...answered from here: the Result has just been handed to the reply sender; the
        # entry says who else to tell (Owned.notify: the forwarders' TaskDones).
        self.on_finished: list[Callable[[Owned, Result], None]] = []
        # ...and for admitted tasks that leave without a result from here (handed off,
        # withdrawn); and for tasks routed here that admission refused (or answered from the
        # results cache).
        self.on_released: list[Callable[[Task], None]] = []
        self.on_refused: list[Callable[[Task], None]] = []
        # The parts built after the ingress that it calls (fan-out, admin): see IngressLinks.
        self.links = links if links is not None else IngressLinks()
        # Under CURVE (gossipd/security.py): makes the socket a CURVE server before it binds,
        # and says whether a producer key is still authorised.
        self.serve_curve = curve.serve if curve is not None else None
        self.producer_allowed = curve.producer_allowed if curve is not None else None
        # With budgets.enabled: each producer's task is charged against its token budget
        # before it is routed (ingress/budgets.py); past it: over_budget.
        self.budget_gate = budget_gate

    # -- socket side ---------------------------------------------------------------------

    def bind(self) -> str:
        sock = self._ctx.socket(zmq.PULL)
        # Hard ceiling against memory exhaustion: ZeroMQ drops a peer that sends more.
        # Up to it we read the message and refuse it with a clear error (message_bytes_max).
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self._config.message_bytes_max)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        if self.serve_curve is not None:
            self.serve_curve(sock)
        sock.bind(self._config.bind)
        self._sock = sock
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound_endpoint

    def start_receiving(self) -> None:
        """Read tasks in the socket's fd callback (``SocketReader``), a batch of at most
        ``recv_batch_max`` at a time, so that results flow while input floods in."""
        assert self._sock is not None, "bind() first"
        sock = self._sock
        batch_bytes_max = self._config.recv_batch_bytes_max
        if self.serve_curve is not None:
            self._reader = SocketReader(
                sock,
                partial(sock.recv, copy=False),
                self._config.recv_batch_max,
                self._on_curve_frames,
                batch_bytes_max=batch_bytes_max,
            )
            return
        self._reader = SocketReader(
            sock,
            sock.recv,
            self._config.recv_batch_max,
            self._on_frames,
            batch_bytes_max=batch_bytes_max,
        )

    def stop_receiving(self) -> None:
        """Take no more tasks from the socket (what is queued there stays for drain_socket)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def close_intake(self) -> None:
        """Stop being offered tasks: unbind the ingress endpoint, which drops the producers'
        connections (a producer that sends only on completed connections, ZMQ_IMMEDIATE like
        the Client, then sends us nothing more).  What had arrived stays readable: the reader
        goes on with it, and ``drain_socket`` reads the rest."""
        if self._sock is None or not self.bound_endpoint:
            return
        try:
            self._sock.unbind(self.bound_endpoint)
        except zmq.ZMQError as exc:  # closing anyway: say so, nothing to undo
            log.warning(
                "could not unbind the ingress endpoint",
                extra={"endpoint": self.bound_endpoint, "error": exc.strerror},
            )

    def _on_frames(self, frames: list[bytes]) -> None:
        now = self._clock.monotonic()
        for frame in frames:
            self.handle_frame(frame, now)

    def _on_curve_frames(self, frames: list[zmq.Frame]) -> None:
        """With CURVE: each frame's User-Id is its producer's key (the ZAP handler set it); a
        key revoked since its connection opened is refused here."""
        now = self._clock.monotonic()
        allowed = self.producer_allowed
        handle = self.handle_frame
        admitted: set[str] = set()  # keys found authorised in this batch: asked once each
        for frame in frames:
            producer_key = frame.get(USER_ID)
            if producer_key not in admitted:
                if allowed is not None and not allowed(producer_key):
                    self._refused["unauthorised"] += 1
                    continue
                admitted.add(producer_key)
            # A small frame is copied out (``Frame.bytes``) and decoded from bytes: making
            # its ``buffer`` (a memoryview) and decoding from it cost more than the copy
            # saves (0.5 us more per 200-byte task, measured here).  A large one is decoded
            # from its buffer, without a copy.
            handle(frame.bytes if len(frame) <= COPY_BYTES_MAX else frame.buffer, now, producer_key)

    def drain_socket(self, now: float) -> int:
        """Read what is already queued on the socket (at shutdown, to answer it)."""
        if self._sock is None:
            return 0
        count = 0
        try:
            while True:
                if self.serve_curve is None:
                    self.handle_frame(self._sock.recv(NOBLOCK), now)
                else:
                    self._on_curve_frames([self._sock.recv(NOBLOCK, copy=False)])
                count += 1
        except zmq.Again:
            return count

    def close(self) -> None:
        self.stop_receiving()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # -- decisions -----------------------------------------------------------------------

    def handle_frame(
        self,
        frame: bytes | memoryview | msgspec.Raw,
        now: float,
        producer_key: str = "",
        *,
        in_tasks: bool = False,
    ) -> None:
        """One producer message; ``producer_key``: the key it came with under CURVE;
        ``in_tasks``: an item of a Tasks frame."""
        self._received += 1
        try:
            task = decode_intake(frame, bytes_max=self._config.message_bytes_max)  # type: ignore[arg-type]
        except RemoteProtocolError as exc:
            self._refuse(exc, len(frame), producer_key)
            return
        if type(task) is not Task:
            if type(task) is Cancel:
                self.handle_cancel(task.id, producer_key)
            elif type(task) is Tasks:
                self._handle_tasks(task, len(frame), now, producer_key, in_tasks)
            elif (admin := self.links.admin) is not None:
                admin(task, now, producer_key)  # type: ignore[arg-type]
            else:
                self._refuse_admin(task, producer_key)  # type: ignore[arg-type]
            return
        assert isinstance(task, Task)
        if task.producer_key != producer_key:  # the daemon's field: ours, never the producer's
            # In place: the Task was decoded just now and nothing else holds it (replace()
            # would copy it and validate it again: 0.9 us a task, measured here).
            msgspec.structs.force_setattr(task, "producer_key", producer_key)
        gate = self.budget_gate
        if gate is not None and (retry_after_ms := gate.check(task, now)):
            self._refused[ErrorCode.OVER_BUDGET.value] += 1
            self._send_error(task, ErrorCode.OVER_BUDGET, gate.refusal(task), retry_after_ms)
            return
        router = self.links.router
        if router is not None and self._id_held_by_other(task):
            self._refused[ErrorCode.ID_IN_USE.value] += 1
            self.admission.count_conflict()
            self._send_error(task, ErrorCode.ID_IN_USE, ID_IN_USE_MESSAGE)
            return
        if router is not None and router(task, now):
            return  # another member owns it: the dispatcher forwards it
        verdict = self.admit(task, now, answer=True, now=now)
        if verdict is not _ADMIT and verdict is not _DUPLICATE_PENDING:
            for listener in self.on_refused:  # routed here, but nothing of it runs here
                listener(task)

    def _id_held_by_other(self, task: Task) -> bool:
        """The task's id is another producer key's here: pending or cached, or forwarded
        from here and not reported done (docs/PROTOCOL.md "An id is its producer's")."""
        if self.admission.held_by_other(task.id, task.producer_key):
            return True
        forwarded = self.links.forwarded_for_other
        return forwarded is not None and forwarded(task)

    def _handle_tasks(
        self, batch: Tasks, size: int, now: float, producer_key: str, in_tasks: bool
    ) -> None:
        """A Tasks frame: each item as if it had come as a frame of its own (counted as one
        message each); Tasks inside Tasks are refused."""
        if in_tasks:
            hint = "an item of a Tasks frame is itself a Tasks frame: send one level only"
            self._refuse(RemoteProtocolError(hint, code=ErrorCode.BAD_REQUEST), size, producer_key)
            return
        self._received -= 1  # its items are the messages
        for item in batch.items:
            self.handle_frame(item, now, producer_key, in_tasks=True)

    def admit(
        self,
        task: Task,
        received_at: float,
        *,
        answer: bool,
        now: float | None = None,
        forwarder: Hashable | None = None,
    ) -> Verdict:
        """Run ``task`` here if admission allows.  ``answer=False`` (a forwarded task): a
        refusal is the forwarder's to handle, not sent to the producer, with the hint
        ``retry_after_ms`` (read it right after this call).  ``forwarder``: the peer that
        forwarded it (told TaskDone when it ends).  ``now``: the clock's monotonic()."""
        now = self._clock.monotonic() if now is None else now
        verdict, entry = self.book.offer(task, received_at, now, forwarder=forwarder)
        self._retry_after_ms = self._config.retry_after_ms
        if verdict is _ADMIT:
            for listener in self.on_admitted:
                listener(task)
            assert isinstance(entry, Owned)
            self._queue.put_nowait(entry)
        elif verdict is Verdict.DUPLICATE_DONE:
            assert isinstance(entry, Result)
            self._replies.send(task.route, encode(entry), task.batch_replies)
            if self.links.answered_cached is not None:
                self.links.answered_cached(task.id)  # a Result held for it is now sent
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
            elif self.admission.refused_bytes:
                self._refused["overloaded_pending_bytes"] += 1
                why = (
                    f"{self.admission.pending_bytes} bytes of tasks pending here: this task "
                    f"does not fit the byte budget (ingress.pending_bytes_max = "
                    f"{self._config.pending_bytes_max})"
                )
            else:
                self._refused[ErrorCode.OVERLOADED.value] += 1
                why = f"{self.admission.pending} tasks pending, the limit is {self._config.pending_max}"
            if answer:
                self._send_error(
                    task, ErrorCode.OVERLOADED, why, retry_after_ms=self._retry_after_ms
                )
        elif verdict is Verdict.CONFLICT:
            self._refused[ErrorCode.ID_IN_USE.value] += 1
            if answer:
                self._send_error(
                    task,
                    ErrorCode.ID_IN_USE,
                    ID_IN_USE_MESSAGE,
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
                retry_after_ms=self._config.retry_after_ms,
            ),
            remember=False,
        )

    def handle_cancel(self, task_id: str, producer_key: str = "") -> None:
        """A producer's Cancel (``producer_key``: the key it came with, "" without CURVE; on
        the rpc channel, the key the entry daemon read): abort the task here, or pass it on
        to where it runs.  Only the key that submitted the task may cancel it; a Cancel from
        another is ignored and counted (outcome ``refused``), as docs/PROTOCOL.md says."""
        outcome = self.cancel(task_id, producer_key)
        cancel_elsewhere = self.links.cancel_elsewhere
        if outcome is None and cancel_elsewhere is not None:
            outcome = cancel_elsewhere(task_id, producer_key)
        if outcome is None:
            outcome = "unknown"  # finished already, or never seen here
        self._cancels[outcome] += 1
        if outcome == "refused" and self._refused_log.allow():
            log.warning(
                "refused a Cancel from a producer that did not submit the task",
                extra={
                    "task_id": task_id[:128],
                    "key": producer_key,
                    "suppressed_since_last": self._refused_log.suppressed,
                },
            )
            self._refused_log.suppressed = 0

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
        """Cancel the worker running ``task_id`` (none: it is being handed off, and the
        hand-off's end looks at its stop reason)."""
        worker = self._workers.get(task_id)
        if worker is not None:
            worker.cancel()

    def _withdrawn(self, task_id: str) -> None:
        owned = self.book.get(task_id)
        assert owned is not None
        self._results["withdrawn"] += 1
        self.release(owned.task, error_result(task_id, ErrorCode.CANCELLED, "withdrawn"))

    def _refuse_admin(self, msg: StatusQuery | Drain, producer_key: str = "") -> None:
        self._refused["bad_admin"] += 1
        self._replies.send(
            reply_route(msg.reply_to, producer_key),
            encode(
                error_result(
                    msg.id,
                    ErrorCode.BAD_REQUEST,
                    "this daemon serves no admin requests",
                    node=self._node,
                )
            ),
        )

    def send_error(
        self, task: Task, code: ErrorCode, message: str, retry_after_ms: int = 0
    ) -> None:
        self._send_error(task, code, message, retry_after_ms)

    def _refuse(self, exc: RemoteProtocolError, size: int, producer_key: str = "") -> None:
        reason = exc.reason  # the code, or a finer label (oversized)
        self._refused[reason] += 1
        answered = bool(exc.reply_to)
        if answered:
            self._replies.send(
                reply_route(exc.reply_to, producer_key),
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
        self._replies.send(task.route, encode(result), task.batch_replies)

    # -- workers -------------------------------------------------------------------------

    async def work_forever(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while True:
            try:
                owned = await self._queue.get()
            except asyncio.CancelledError:
                # A cancel aimed at a task that finished before the cancel landed arrives here.
                if self.admission.shutting_down or not me.cancelling():
                    raise
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
        engine_died = False
        token = self._deadlines.add(job, deadline)
        armed = self._deadlines_armed
        if not armed.is_set():
            armed.set()
        try:
            if job.stop is not None:  # cancelled or expired while it was queued
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
                    self._replies.send(task.route, encode(chunk), task.batch_replies)
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
            why = job.stop  # our deadline sweeper, a Cancel or a Withdraw; None: a shutdown
            if why is not None:
                worker = self._workers[task.id]
                if worker.cancelling():
                    worker.uncancel()
                if why is Stop.WITHDRAWN:
                    self._withdrawn(task.id)
                    return
                result = (
                    self._deadline_result(task, len(parts))
                    if why is Stop.EXPIRED
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
        rescue = self.links.rescue
        if engine_died and rescue is not None and await rescue(task, job.received_at):
            self._results["handed_off_engine_dead"] += 1
            self.release(task, result)
            return
        if job.stop is _WITHDRAWN:  # withdrawn as it finished: the copy elsewhere answers
            self._withdrawn(task.id)
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
        self._results["ok" if result.ok else result.error.code] += 1  # type: ignore[union-attr]
        owned = self.book.finish(task.id, result, remember=remember)
        data = encode(result)
        hold = self.links.hold
        if (
            hold is not None
            and remember
            and owned.forwarders
            and not owned.from_producer
            and hold(owned, result, len(data))
        ):
            return  # held: end_held sends it (or not) and tells the listeners
        self._replies.send(task.route, data, task.batch_replies)
        for listener in self.on_finished:
            listener(owned, result)

    def end_held(self, owned: Owned, result: Result, *, send: bool) -> None:
        """A Result ``links.hold`` held: send it now (``send``), or not (its forwarder had
        the task run elsewhere, or a resubmission was answered from the cache); either way
        the task ends here for the listeners (journal, TaskDones to ``owned.forwarders``)."""
        if send:
            task = owned.task
            self._replies.send(task.route, encode(result), task.batch_replies)
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
        owned.phase = Phase.QUEUED
        self._queue.put_nowait(owned)
        return True

    def release(self, task: Task, result: Result) -> None:
        """A taken task leaves without a reply from here (withdrawn, handed off)."""
        self.book.release(task.id, result)
        for listener in self.on_released:
            listener(task)

    # -- shutdown ------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self.admission.begin_shutdown()

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
        ok = self._results.get("ok", 0)
        not_answered = self._results.get("withdrawn", 0) + self._results.get(
            "handed_off_engine_dead", 0
        )
        return ok, sum(self._results.values()) - ok - not_answered

    def statistics(self) -> IngressStatistics:
        return IngressStatistics(
            received=self._received,
            refused=dict(self._refused),
            unanswerable=self._unanswerable,
            results=dict(self._results),
            queued=len(self._queue),
            running=len(self._workers),
            cancels=dict(self._cancels),
            service_s=self.queue_wait.service_s or 0.0,
            expected_wait_s=self.queue_wait.expected_wait_s(self.admission.pending),
            latency=self.latency,
        )
