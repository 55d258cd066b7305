"""HTTP/1.1 on the daemon's own event loop: httptools' parser (the C parser uvicorn uses)
under an asyncio Protocol, nothing else in between.

Why not a framework: CPU per request is what decides at the door (issue 26), and every layer
between the parser and the intake costs microseconds a request (scripts/http_stack.py, the
same answer from each stack: 8.4 us of CPU a request here, uvicorn with a bare ASGI app
19.8, aiohttp 36.1; docs/results/http-stack-vm.json, bench/README.md "The HTTP door's
stack").  This module is only the
wire: requests in (method, path, a few headers, a bounded body), one response or one chunked
stream out, keep-alive, and the client's going away.  What a request means is the door's
(gossipd/http/door.py).

Requests on one connection are answered in order: a pipelined request waits until the one
before it has ended its response.  Bad input never raises out of here: a parse error, a
header block or body over its bound is answered 400/431/413 and the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools

log = logging.getLogger("gossipd.http.server")

HEADER_BYTES_MAX = 64 * 1024  # all of one request's header names and values
PIPELINED_MAX = 16  # requests waiting behind the one being answered; past it, reading pauses
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
# The headers a door reads; others are skipped as they are parsed (no dict entry each).
WANTED_HEADERS = frozenset(
    {b"authorization", b"content-type", b"x-request-id", b"connection", b"expect"}
)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names, only the wanted ones
    body: bytes
    keep_alive: bool


@dataclass(slots=True)
class HttpCounters:
    connections: int = 0  # opened
    connections_refused: int = 0  # over connections_max: closed at once
    requests: int = 0
    bad_requests: int = 0  # unparseable, or over a bound: answered and closed
    open_now: int = 0


@dataclass(slots=True)
class HttpLimits:
    body_bytes_max: int
    connections_max: int
    wanted_headers: frozenset[bytes] = WANTED_HEADERS
    counters: HttpCounters = field(default_factory=HttpCounters)


class Exchange:
    """One request's response: ``respond`` once, or ``start_stream``, ``write``s and
    ``end_stream``.  ``on_close`` (set by the handler) is called if the client goes away
    before the response has ended."""

    __slots__ = ("_conn", "done", "keep_alive", "on_close", "streaming")

    def __init__(self, conn: HttpConnection, keep_alive: bool) -> None:
        self._conn = conn
        self.keep_alive = keep_alive
        self.done = False
        self.streaming = False
        self.on_close: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        return self._conn.transport is None

    def respond(
        self,
        status: int,
        body: bytes,
        *,
        content_type: bytes = b"application/json",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        if self.done:
            return
        self.done = True
        transport = self._conn.transport
        if transport is None:
            return
        head = [
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
            % (status, _REASONS.get(status, "Error").encode(), content_type, len(body))
        ]
        if headers:
            head.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        head.append(body)
        transport.write(b"".join(head))
        self._conn.ended(self)

    def start_stream(
        self,
        status: int = 200,
        *,
        content_type: bytes = b"text/event-stream",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        """The head of a chunked response; ``write`` sends its pieces."""
        transport = self._conn.transport
        self.streaming = True
        if transport is None:
            return
        head = [
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n"
            % (status, _REASONS.get(status, "Error").encode(), content_type)
        ]
        if headers:
            head.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        transport.write(b"".join(head))

    def write(self, data: bytes) -> int:
        """One chunk of the stream; returns the bytes now waiting for the client (the
        caller bounds them)."""
        transport = self._conn.transport
        if transport is None or self.done or not data:
            return 0
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return transport.get_write_buffer_size()  # type: ignore[no-any-return]

    def end_stream(self) -> None:
        if self.done:
            return
        self.done = True
        transport = self._conn.transport
        if transport is None:
            return
        transport.write(b"0\r\n\r\n")
        self._conn.ended(self)

    def abort(self) -> None:
        """Give up on the client (a stream it does not read): close the connection."""
        self.done = True
        transport = self._conn.transport
        if transport is not None:
            transport.abort()


Handler = Callable[[Request, Exchange], None]


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, hand each request to ``handler``, in order."""

    def __init__(self, handler: Handler, limits: HttpLimits) -> None:
        self._handler = handler
        self._limits = limits
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._header_name = b""
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._waiting: deque[Request] = deque()
        self._current: Exchange | None = None
        self._paused = False
        self._broken = False  # answered an error and closing: ignore the rest

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        counters = self._limits.counters
        counters.connections += 1
        if counters.open_now >= self._limits.connections_max:
            counters.connections_refused += 1
            transport.abort()  # type: ignore[attr-defined]
            return
        counters.open_now += 1
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.transport = None
        self._limits.counters.open_now -= 1
        self._waiting.clear()
        current, self._current = self._current, None
        if current is not None and not current.done and current.on_close is not None:
            current.on_close()

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            # A callback's exception comes wrapped (HttpParserCallbackError): ours says why.
            cause = exc.__context__
            if isinstance(cause, _TooLarge):
                self._fail(cause.status, str(cause))
            else:
                self._fail(400, f"malformed HTTP request: {exc}")

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        name = name.lower()
        if name in self._limits.wanted_headers:
            self._headers[name.decode("latin-1")] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limits.body_bytes_max:
            raise _TooLarge(
                413,
                f"the request body is over {self._limits.body_bytes_max} bytes "
                "(http.body_bytes_max)",
            )
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        request = Request(
            method=parser.get_method().decode("latin-1"),
            path=self._url.decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=parser.should_keep_alive(),
        )
        self._limits.counters.requests += 1
        if self._current is None:
            self._dispatch(request)
            return
        self._waiting.append(request)
        if len(self._waiting) >= PIPELINED_MAX and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()

    # -- internals -------------------------------------------------------------------------

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > HEADER_BYTES_MAX:
            raise _TooLarge(431, f"the request's header block is over {HEADER_BYTES_MAX} bytes")

    def _dispatch(self, request: Request) -> None:
        exchange = Exchange(self, request.keep_alive)
        self._current = exchange
        try:
            self._handler(request, exchange)
        except Exception:  # a handler bug answers 500, the daemon keeps serving
            log.exception("the HTTP handler raised", extra={"path": request.path[:200]})
            if not exchange.done and not exchange.streaming:
                exchange.respond(
                    500,
                    b'{"error": {"message": "internal error", '
                    b'"type": "internal_error", "param": null, "code": null}}',
                )

    def ended(self, exchange: Exchange) -> None:
        """``exchange``'s response is out: close, or take the next pipelined request."""
        if exchange is not self._current:
            return
        self._current = None
        if not exchange.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if self._waiting:
            self._dispatch(self._waiting.popleft())
        if self._paused and len(self._waiting) < PIPELINED_MAX // 2 and self.transport:
            self._paused = False
            self.transport.resume_reading()

    def _fail(self, status: int, message: str) -> None:
        self._broken = True
        self._limits.counters.bad_requests += 1
        transport = self.transport
        if transport is None:
            return
        body = (
            b'{"error": {"message": %s, "type": "invalid_request_error", "param": null, '
            b'"code": null}}' % _json_str(message)
        )
        if self._current is not None and not self._current.done:
            # A response is under way on this connection: it cannot be interleaved.
            transport.close()
            return
        transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s"
            % (status, _REASONS.get(status, "Error").encode(), len(body), body)
        )
        transport.close()


class _TooLarge(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_str(text: str) -> bytes:
    import json

    return json.dumps(text).encode()


async def serve(
    host: str,
    port: int,
    handler: Handler,
    limits: HttpLimits,
    *,
    ssl: object | None = None,
) -> asyncio.Server:
    """Listen on ``host:port`` (port 0: any free one) on the running loop."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: HttpConnection(handler, limits),
        host,
        port,
        ssl=ssl,  # type: ignore[arg-type]
        reuse_address=True,
        backlog=1024,
    )
