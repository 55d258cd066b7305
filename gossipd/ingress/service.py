"""The ZeroMQ door: producers' messages from the PULL socket to the intake.

    PULL socket -> decode_intake -> Intake.take (budgets, routing, admission:
    ingress/intake.py) -> Runner (workers, engine, answers: ingress/runner.py)

The PULL is ``ingress.receiver``'s: the loop's own (looppull.py: each frame handed over as it
is read, what is held bounded in bytes) or libzmq's, read by a SocketReader in its fd
callback.

This module is the socket and its wire format: binding, CURVE (the producer's key from each
frame's User-Id), batched reads, Tasks frames, Cancels and admin requests.  Bad input never
raises out of here: each refusal is counted by reason, logged (rate-limited) and, when the
message's reply_to can be read, answered with an error Result.  It builds the intake and
the runner (``intake``, ``runner``) and reports the three together (``statistics``).

Concurrency: the socket is read in the loop's fd callback (no receive task).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec
import zmq

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import IngressConfig
from gossipd.core.codec import decode_intake
from gossipd.core.messages import (
    Cancel,
    Drain,
    ErrorCode,
    StatusQuery,
    Task,
    Tasks,
    encode,
    error_result,
    reply_route,
)
from gossipd.engines.base import (
    Engine,
)
from gossipd.errors import RemoteProtocolError
from gossipd.ingress.budgets import BudgetGate
from gossipd.ingress.intake import Intake, admission_for
from gossipd.ingress.links import IngressLinks
from gossipd.ingress.runner import Runner
from gossipd.looppull import LoopPullServer
from gossipd.ops.histogram import LatencyHistogram
from gossipd.ops.logs import RateLimiter, note_handler_failure
from gossipd.replysender import ReplySender
from gossipd.zmqloop import NOBLOCK, SocketReader

log = logging.getLogger("gossipd.ingress.service")

# Under CURVE: the message property naming the producer (its key; gossipd/security.py), as
# bytes (a str is encoded on every call), and the frame size up to which a frame is copied
# out to bytes rather than decoded from its buffer.
USER_ID = b"User-Id"
COPY_BYTES_MAX = 64 * 1024


@dataclass(frozen=True, slots=True)
class IngressCurve:
    """CURVE on the ingress: ``serve`` makes the socket a CURVE server (before it binds);
    ``producer_allowed`` says whether a producer key is still authorised."""

    serve: Callable[[zmq.Socket], None]
    producer_allowed: Callable[[str, int], bool]  # (key, messages): each counted if revoked


@dataclass(frozen=True, slots=True)
class IngressStatistics:
    received: int
    refused: dict[str, int]
    unanswerable: int
    results: dict[str, int]
    queued: int
    running: int
    cancels: dict[str, int]  # by outcome: here, forwarded, refused, unknown
    service_s: float  # smoothed service time of finished tasks; 0 before the first
    expected_wait_s: float  # the expected queueing wait of a task arriving now
    not_handed_on: int  # engine.deaths_per_task_max reached: answered, not handed on
    latency: LatencyHistogram = field(repr=False)
    # Producers' connections the loop's PULL closed, by reason (ingress.receiver "loop")
    connections_closed: dict[str, int] = field(default_factory=dict)


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
        engine_deaths_max: int = 2,
        curve: IngressCurve | None = None,
        budget_gate: BudgetGate | None = None,
        links: IngressLinks | None = None,
        receiver: LoopPullServer | None = None,
    ) -> None:
        """``receiver``: the loop's PULL to bind (ingress.receiver "loop"; it brings its own
        CURVE, and ``curve.serve`` is for libzmq's PULL); None: libzmq's."""
        self._config = config
        self._receiver = receiver
        self._clock = clock
        self._ctx = ctx
        self._replies = replies
        self._node = node
        links = links if links is not None else IngressLinks()
        # One budget of refusal warnings for the door and the intake (as before the split).
        self._refused_log = RateLimiter(refused_lines_per_s)
        book, queue_wait = admission_for(config)
        # What admission takes runs here: workers, the engine, deadlines, answers.
        self.runner = Runner(
            engine=engine,
            replies=replies,
            node=node,
            book=book,
            queue_wait=queue_wait,
            links=links,
            retry_after_ms=config.retry_after_ms,
            clock=clock,
            engine_deaths_max=engine_deaths_max,
        )
        # One intake for every door: budgets, ids, routing, admission (ingress/intake.py).
        self.intake = Intake(
            config,
            book=book,
            runner=self.runner,
            replies=replies,
            node=node,
            refused_log=self._refused_log,
            links=links,
            clock=clock,
            model=model,
            budget_gate=budget_gate,
        )
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._received = 0
        self._refused = self.intake.refused  # one count by reason, the intake's and ours
        self._unanswerable = 0
        self.bound_endpoint = ""
        # Under CURVE (gossipd/security.py): makes the socket a CURVE server before it binds,
        # and says whether a producer key is still authorised.
        self.serve_curve = curve.serve if curve is not None else None
        self.producer_allowed = curve.producer_allowed if curve is not None else None

    # -- socket side ---------------------------------------------------------------------

    def bind(self) -> str:
        if self._receiver is not None:
            self.bound_endpoint = self._receiver.bind(self._config.bind)
            return self.bound_endpoint
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
        ``recv_batch_max`` at a time, so that results flow while input floods in; or the
        loop's PULL, a read of each connection a turn."""
        if self._receiver is not None:
            self._receiver.receive(self._on_loop_frames, self._on_loop_malformed)
            return
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
        """Take no more tasks from the socket (what is queued there stays for drain_socket;
        the loop's PULL queues nothing: what arrives stays unread)."""
        if self._receiver is not None:
            self._receiver.pause_reading()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def close_intake(self) -> None:
        """Stop being offered tasks: unbind the ingress endpoint, which drops the producers'
        connections (a producer that sends only on completed connections, ZMQ_IMMEDIATE like
        the Client, then sends us nothing more).  What had arrived stays readable: the reader
        goes on with it, and ``drain_socket`` reads the rest.  The loop's PULL sends each
        producer its FIN (libzmq takes it for a drop) and reads on what they sent before."""
        if self._receiver is not None:
            self._receiver.stop_accepting()
            return
        if self._sock is None or not self.bound_endpoint:
            return
        try:
            self._sock.unbind(self.bound_endpoint)
        except zmq.ZMQError as exc:  # closing anyway: say so, nothing to undo
            log.warning(
                "could not unbind the ingress endpoint",
                extra={"endpoint": self.bound_endpoint, "error": exc.strerror},
            )

    def _on_frames(self, frames: list[bytes], producer_key: str = "") -> None:
        now = self._clock.monotonic()
        handle = self.handle_frame
        for frame in frames:
            try:  # (free until it catches)
                handle(frame, now, producer_key)
            except Exception:  # one frame's bug: the frames read with it go on
                note_handler_failure("Ingress.handle_frame", log, "handling a task frame")

    async def intake_closed(self, timeout_s: float) -> bool:
        """After ``close_intake``: the loop's PULL reads on until every producer has ended
        its connection after our FIN (all it sent before read and handled), at most
        ``timeout_s``; -> whether they all did.  libzmq's: True at once (its unbind dropped
        them, and ``drain_socket`` reads what it had read)."""
        if self._receiver is None:
            return True
        return await self._receiver.ended(timeout_s)

    def _on_loop_frames(self, frames: list[bytes], sender: str) -> None:
        """The loop's PULL: the frames of one read of one producer's connection; ``sender``
        is its key under CURVE (what ZAP said it is), "" without."""
        allowed = self.producer_allowed
        if allowed is not None and not allowed(sender, len(frames)):  # (revoked since)
            self._refused["unauthorised"] += len(frames)
            return
        self._on_frames(frames, sender)

    def _on_loop_malformed(self) -> None:
        """A message of several frames: no task is (and libzmq's PULL would have read each
        frame as a message); nothing in it can be answered."""
        self._refused["multipart"] += 1

    @property
    def connections_closed(self) -> dict[str, int]:
        """Producers' connections the loop's PULL closed, by reason; empty under libzmq's."""
        return {} if self._receiver is None else dict(self._receiver.refused)

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
                if allowed is not None and not allowed(producer_key, 1):
                    self._refused["unauthorised"] += 1
                    continue
                admitted.add(producer_key)
            # A small frame is copied out (``Frame.bytes``) and decoded from bytes: making
            # its ``buffer`` (a memoryview) and decoding from it cost more than the copy
            # saves (0.5 us more per 200-byte task, measured here).  A large one is decoded
            # from its buffer, without a copy.
            try:
                data = frame.bytes if len(frame) <= COPY_BYTES_MAX else frame.buffer
                handle(data, now, producer_key)
            except Exception:  # one frame's bug: the frames read with it go on
                note_handler_failure("Ingress.handle_frame", log, "handling a task frame")

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
        if self._receiver is not None:
            self._receiver.close()
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
                self.intake.handle_cancel(task.id, producer_key)
            elif type(task) is Tasks:
                self._handle_tasks(task, len(frame), now, producer_key, in_tasks)
            elif (admin := self.intake.links.admin) is not None:
                admin(task, now, producer_key)  # type: ignore[arg-type]
            else:
                self._refuse_admin(task, producer_key)  # type: ignore[arg-type]
            return
        assert isinstance(task, Task)
        if task.producer_key != producer_key:  # the daemon's field: ours, never the producer's
            # In place: the Task was decoded just now and nothing else holds it (replace()
            # would copy it and validate it again: 0.9 us a task, measured here).
            msgspec.structs.force_setattr(task, "producer_key", producer_key)
        self.intake.take(task, now)

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
                    "suppressed_since_last": self._refused_log.take_suppressed(),
                },
            )

    def statistics(self) -> IngressStatistics:
        runner, intake = self.runner, self.intake
        return IngressStatistics(
            received=self._received,
            refused=dict(self._refused),
            unanswerable=self._unanswerable,
            results=dict(runner.results),
            queued=runner.queued,
            running=runner.running,
            cancels=dict(intake.cancels),
            service_s=runner.queue_wait.service_s or 0.0,
            expected_wait_s=runner.queue_wait.expected_wait_s(intake.admission.pending),
            not_handed_on=runner.not_handed_on,
            latency=runner.latency,
            connections_closed=self.connections_closed,
        )
