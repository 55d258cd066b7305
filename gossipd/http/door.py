"""The OpenAI-compatible HTTP door: requests to tasks through the one intake, answers back to
the client that holds the connection (docs/PROTOCOL.md "HTTP").

    HTTP request (gossipd/http/server.py) -> route, API key -> openai_api.decode_call ->
    Task (reply_to: this door's reply address) -> Intake.take (budgets, ids, routing,
    admission: the same path as a ZeroMQ producer's task) ... Chunks and the Result come back
    to the reply address -> SSE events or one JSON answer

Answers come back the way a producer's do: to the task's reply address.  That address is this
door's own ZeroMQ PULL socket, so an owner on another member streams to it exactly as it
streams to a producer (under CURVE the task's producer key is this daemon's own, the key the
PULL socket serves with); a task run here is handed over in-process (ReplySender.
deliver_locally), with no socket between.  Migration, deadlines and dedup are the intake's
and the forwarder's, as for any task.  A client that goes away cancels its task wherever it
runs (a Cancel through the intake, as a producer's).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import zmq

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import HttpConfig
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Chunk,
    ErrorCode,
    ErrorInfo,
    Result,
    Task,
    decode_replies,
    reply_route,
)
from gossipd.errors import RemoteProtocolError
from gossipd.http.chat import ChatTemplate
from gossipd.http.keys import ApiKeys
from gossipd.http.openai_api import (
    BadRequest,
    Call,
    StreamWriter,
    decode_call,
    error_body,
    error_of,
    placement_key,
    whole_answer,
)
from gossipd.http.server import WANTED_HEADERS, Exchange, HttpLimits, Request
from gossipd.ingress.intake import Intake
from gossipd.zmqloop import SocketReader

log = logging.getLogger("gossipd.http.door")

MEMBER_HEADER = "x-gossipd-member"  # the member that ran the task
SWEEP_INTERVAL_S = 0.5
MODELS_TTL_S = 1.0  # how stale the door's list of the cluster's models may be
# Past its deadline a request waits this much longer for the owner's deadline_exceeded
# before the door answers 504 itself (a Result lost with a dead owner and no migration).
DEADLINE_GRACE_S = 2.0
_OK_JSON = b"application/json"


@dataclass(slots=True)
class _Pending:
    """A request whose task is out: where and how its answer goes."""

    exchange: Exchange
    call: Call
    response_id: str
    created: int
    deadline: float
    request_id: str
    writer: StreamWriter | None = None
    next_seq: int = 0


@dataclass(frozen=True, slots=True)
class DoorLinks:
    """What the door reads from the rest of the daemon (built before it)."""

    # The models members serve, with our own (GET /v1/models).
    cluster_models: Callable[[], set[str]]
    # "" when a request can be served, else why not (readiness, 503).
    not_ready: Callable[[], str]
    # Prometheus text for GET /metrics; None: not served here.
    metrics: Callable[[], bytes] | None = None


class HttpDoor:
    def __init__(
        self,
        config: HttpConfig,
        *,
        intake: Intake,
        node: str,
        model: str,
        max_model_len: int | None,
        chat: ChatTemplate,
        links: DoorLinks,
        keys: ApiKeys | None = None,
        producer_key: str = "",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._config = config
        self._intake = intake
        self._node = node
        self.model = model
        self._max_model_len = max_model_len
        self._chat = chat
        self._links = links
        self.keys = keys
        # Under CURVE: this daemon's public key, which the reply socket serves with; owners
        # check it before they send our tasks' answers.
        self._producer_key = producer_key
        self._clock = clock
        self._session_header = config.session_header.lower()
        self.limits = HttpLimits(
            body_bytes_max=config.body_bytes_max,
            connections_max=config.connections_max,
            wanted_headers=WANTED_HEADERS | {self._session_header.encode()},
        )
        self._timeout_ms = int(config.request_timeout_s * 1000)
        self._id_prefix = f"http-{secrets.token_hex(6)}-"
        self._next_id = 0
        self._pending: dict[str, _Pending] = {}
        self._models_cache: set[str] = set()
        self._models_until = float("-inf")
        self.reply_to = ""
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self.server: asyncio.Server | None = None
        self.port = 0
        # Counted, exported as gossipd_http_* (ops/metrics_subsystems.py).
        self.responses: Counter[int] = Counter()  # by status
        self.unauthorized = 0
        self.disconnect_cancels = 0  # clients gone before their answer: task cancelled
        self.slow_client_cancels = 0  # streams past stream_buffer_bytes_max: cancelled
        self.deadline_answers = 0  # answered 504 by the door's own sweep
        self.replies_unknown = 0  # answers for no pending request (its client had gone)
        self.replies_invalid = 0  # undecodable frames on the reply socket

    # -- the reply address ---------------------------------------------------------------

    def bind_replies(
        self, ctx: zmq.Context, endpoint: str, serve_curve: Callable[[zmq.Socket], None] | None
    ) -> str:
        """Bind the reply PULL socket at ``endpoint``; answers from owners arrive there."""
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if serve_curve is not None:
            serve_curve(sock)
        sock.bind(endpoint)
        self._sock = sock
        self.reply_to = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.reply_to

    @property
    def route(self) -> str:
        """The route of this door's tasks (what ReplySender.deliver_locally is given)."""
        return reply_route(self.reply_to, self._producer_key)

    def start_receiving(self) -> None:
        assert self._sock is not None, "bind_replies() first"
        self._reader = SocketReader(self._sock, self._sock.recv, 256, self._on_frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.deliver(frame)

    def deliver(self, frame: bytes) -> None:
        """One reply frame for one of our tasks: a Chunk, a Result or a Replies pack."""
        try:
            messages = decode_replies(frame)
        except RemoteProtocolError as exc:
            self.replies_invalid += 1
            log.warning("undecodable answer on the HTTP reply socket", extra={"error": str(exc)})
            return
        for message in messages:
            self._on_reply(message)

    # -- requests ------------------------------------------------------------------------

    def handle(self, request: Request, exchange: Exchange) -> None:
        path = request.path.partition("?")[0]
        method = request.method
        if path == "/health":
            self._json(exchange, 200, b'{"status":"ok"}')
            return
        if path == "/v1/health/ready":
            why = self._links.not_ready()
            if why:
                self._error(exchange, 503, why, "server_error", code="unavailable")
            else:
                self._json(exchange, 200, b'{"status":"ready"}')
            return
        if self.keys is not None:
            identity = self.keys.name_of(request.headers.get("authorization", ""))
            if identity is None:
                self.unauthorized += 1
                self._error(
                    exchange,
                    401,
                    "send a valid API key as 'Authorization: Bearer KEY' (http.keys_dir)",
                    "authentication_error",
                    code="invalid_api_key",
                    headers=[("www-authenticate", 'Bearer realm="gossipd"')],
                )
                return
        else:
            identity = ""
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                self._error(exchange, 405, f"{path} takes POST", "invalid_request_error")
                return
            self._take(request, exchange, path == "/v1/chat/completions", identity)
        elif path == "/v1/models" and method == "GET":
            self._json(exchange, 200, self._models())
        elif path == "/metrics" and method == "GET" and self._links.metrics is not None:
            exchange.respond(200, self._links.metrics(), content_type=b"text/plain; version=0.0.4")
            self.responses[200] += 1
        else:
            self._error(exchange, 404, f"no route {method} {path[:200]}", "not_found_error")

    def _take(self, request: Request, exchange: Exchange, chat: bool, identity: str) -> None:
        try:
            call = decode_call(request.body, chat=chat)
            if call.model not in self._models_now():
                raise BadRequest(
                    f"the model {call.model!r} is not served in this cluster (GET /v1/models)",
                    param="model",
                    status=404,
                    code="model_not_found",
                )
            prompt = self._chat.render(call.messages) if call.messages is not None else call.prompt
        except BadRequest as exc:
            err_type = "not_found_error" if exc.status == 404 else "invalid_request_error"
            self._error(exchange, exc.status, exc.message, err_type, param=exc.param, code=exc.code)
            return
        except Exception as exc:  # the chat template raised (jinja2's errors): the request's
            self._error(
                exchange,
                400,
                f"messages: the chat template failed: {exc}",
                "invalid_request_error",
                param="messages",
            )
            return
        self._next_id += 1
        task_id = f"{self._id_prefix}{self._next_id}"
        session = request.headers.get(self._session_header) or call.user
        now = self._clock.monotonic()
        task = Task(
            v=PROTOCOL_VERSION,
            id=task_id,
            key=placement_key(session) if session else "",
            prompt=prompt,
            params=call.params,
            reply_to=self.reply_to,
            timeout_ms=self._timeout_ms,
            stream=call.stream,
            model=call.model,
            producer_key=self._producer_key,
            # An owner's answers to this door that leave in one turn go as one frame.
            batch_replies=True,
        )
        kind = "chatcmpl-" if chat else "cmpl-"
        pending = _Pending(
            exchange=exchange,
            call=call,
            response_id=kind + task_id[5:],
            created=int(self._clock.wall()),
            deadline=now + self._config.request_timeout_s + DEADLINE_GRACE_S,
            request_id=request.headers.get("x-request-id", "")[:256],
        )
        # Before take: a refusal, or a task run at once here, answers within the call.
        self._pending[task_id] = pending
        exchange.on_close = partial(self._client_gone, task_id)
        self._intake.take(task, now, f"http:{identity}" if identity else None)

    def _client_gone(self, task_id: str) -> None:
        """The client closed its connection before its answer: cancel the task."""
        if self._pending.pop(task_id, None) is None:
            return
        self.disconnect_cancels += 1
        self._intake.handle_cancel(task_id, self._producer_key)

    # -- answers -------------------------------------------------------------------------

    def _on_reply(self, message: Chunk | Result) -> None:
        pending = self._pending.get(message.id)
        if pending is None:
            self.replies_unknown += 1
            return
        if type(message) is Chunk:
            if message.seq < pending.next_seq:
                return  # a copy (a resubmission or a migration sent it again)
            pending.next_seq = message.seq + 1
            writer = self._stream(pending, message.node)
            waiting = pending.exchange.write(writer.delta(message.delta))
            if waiting > self._config.stream_buffer_bytes_max:
                # The client reads slower than the task writes: give up on it.
                self._pending.pop(message.id, None)
                self.slow_client_cancels += 1
                pending.exchange.abort()
                self._intake.handle_cancel(message.id, self._producer_key)
            return
        assert isinstance(message, Result)
        del self._pending[message.id]
        exchange = pending.exchange
        if pending.writer is not None or (pending.call.stream and message.ok):
            writer = self._stream(pending, message.node)
            if message.ok:
                exchange.write(writer.finish(message.usage))
            else:
                assert message.error is not None
                exchange.write(writer.error(message.error))
            exchange.end_stream()
            self.responses[200] += 1
            return
        if message.ok:
            body = whole_answer(
                pending.call, pending.response_id, pending.created, message.text, message.usage
            )
            exchange.respond(200, body, headers=self._answer_headers(pending, message.node))
            self.responses[200] += 1
            return
        assert message.error is not None
        status, body, headers = error_of(message.error)
        headers += self._answer_headers(pending, message.node)
        exchange.respond(status, body, headers=headers)
        self.responses[status] += 1

    def _stream(self, pending: _Pending, node: str) -> StreamWriter:
        writer = pending.writer
        if writer is None:
            writer = pending.writer = StreamWriter(
                pending.call, pending.response_id, pending.created
            )
            pending.exchange.start_stream(headers=self._answer_headers(pending, node))
        return writer

    def _answer_headers(self, pending: _Pending, node: str) -> list[tuple[str, str]]:
        headers = [(MEMBER_HEADER, node or self._node)]
        if pending.request_id:
            headers.append(("x-request-id", pending.request_id))
        return headers

    def sweep(self, now: float) -> int:
        """Answer 504 to requests past their deadline and its grace (their answer was lost:
        an owner that died with no member left to migrate to); returns how many."""
        late = [tid for tid, p in self._pending.items() if p.deadline <= now]
        for task_id in late:
            pending = self._pending.pop(task_id)
            self.deadline_answers += 1
            error = ErrorInfo(
                code=ErrorCode.DEADLINE_EXCEEDED,
                message=f"no answer within http.request_timeout_s "
                f"({self._config.request_timeout_s:g} s)",
            )
            if pending.writer is not None:
                pending.exchange.write(StreamWriter.error(error))
                pending.exchange.end_stream()
            else:
                status, body, headers = error_of(error)
                pending.exchange.respond(status, body, headers=headers)
            self._intake.handle_cancel(task_id, self._producer_key)
        return len(late)

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            if self._pending:
                self.sweep(self._clock.monotonic())

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- small answers -------------------------------------------------------------------

    def _models_now(self) -> set[str]:
        """The cluster's models, read again at most every MODELS_TTL_S (a member table walk
        per request would cost as much as the rest of the door)."""
        now = self._clock.monotonic()
        if now >= self._models_until:
            self._models_cache = self._links.cluster_models()
            self._models_until = now + MODELS_TTL_S
        return self._models_cache

    def _models(self) -> bytes:
        created = int(self._clock.wall())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "gossipd",
                "root": name,
                "parent": None,
                # Known for the model this daemon serves; members do not gossip theirs.
                "max_model_len": self._max_model_len if name == self.model else None,
            }
            for name in sorted(self._links.cluster_models())
        ]
        return msgspec.json.encode({"object": "list", "data": data})

    def _json(self, exchange: Exchange, status: int, body: bytes) -> None:
        exchange.respond(status, body, content_type=_OK_JSON)
        self.responses[status] += 1

    def _error(
        self,
        exchange: Exchange,
        status: int,
        message: str,
        err_type: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        exchange.respond(
            status, error_body(message, err_type, param=param, code=code), headers=headers
        )
        self.responses[status] += 1

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.server is not None:
            self.server.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
