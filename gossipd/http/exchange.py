"""What one HTTP request is, and how its response goes out: the request as the door reads it,
the wire's bounds and counters (a new connection counted against them: ``admit``), and the
Exchange a handler answers through (one response, or a chunked stream).  The connection that
parses and writes is gossipd/http/server.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING

import msgspec

from gossipd.clock import SYSTEM_CLOCK

if TYPE_CHECKING:
    from gossipd.http.server import HttpConnection

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, r.encode()) for code, r in REASONS.items()}
# The headers every door reads; the others are skipped as they are parsed (no dict entry).
# content-length and transfer-encoding: whether a request that asks for an upgrade has a body.
# host: an HTTP/1.1 request without one, or with two, is refused (RFC 9112 3.2).
WANTED_HEADERS = frozenset(
    {
        b"authorization",
        b"x-request-id",
        b"expect",
        b"content-length",
        b"transfer-encoding",
        b"host",
    }
)


class DateField:
    """The Date field of the answers (RFC 9110 6.6.1: an origin server with a clock sends one
    on its 2xx-4xx answers; on a 5xx it may, and does here), read on ``wall`` (the
    daemon's clock) and formed once a second, not per answer."""

    __slots__ = ("_line", "_second", "_wall")

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        """``date: <IMF-fixdate>\\r\\n`` for this second."""
        now = int(self._wall())
        if now != self._second:
            self._line = b"date: %s\r\n" % formatdate(now, usegmt=True).encode()
            self._second = now
        return self._line


def _plain_error(message: str, status: int) -> bytes:
    return message.encode("utf-8", "replace")


def _count_nothing(status: int) -> None:
    pass


class Request(msgspec.Struct):
    """One request as the door reads it (a Struct: one a request, built in C)."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names, only the wanted ones
    body: bytes
    keep_alive: bool
    http10: bool = False  # an HTTP/1.0 client: no chunked answers
    # Its key was refused when its head was read (HttpLimits.keeps_body): its body was
    # dropped, so it is answered 401 whatever the keys are by the time it is handled.
    key_refused: bool = False


@dataclass(slots=True)
class HttpCounters:
    connections: int = 0  # opened
    connections_refused: int = 0  # over connections_max: closed at once
    requests: int = 0
    bad_requests: int = 0  # unparseable, or over a bound: answered and closed
    handler_errors: int = 0  # the handler raised (a bug): answered 500, logged
    idle_closed: int = 0  # idle, or a request not read whole, for idle_timeout_s
    open_now: int = 0
    tls_failed: int = 0  # TLS handshakes that failed, timed out or were left
    read_bytes: int = 0  # request bodies read and not yet taken by the door, now
    streams_open: int = 0  # chunked answers begun and not yet ended, now
    bodies_dropped: int = 0  # bodies of requests whose key is refused: read, not kept
    answers_unsent: int = 0  # bytes of whole answers their clients do not take, now
    answers_dropped: int = 0  # whole answers given up past answers_unsent_bytes_max


@dataclass(slots=True)
class HttpLimits:
    body_bytes_max: int
    connections_max: int
    idle_timeout_s: float = 30.0
    wanted_headers: frozenset[bytes] = WANTED_HEADERS
    # The body of an error the wire itself answers, from its message and status (the door
    # gives OpenAI's shape).
    error_body: Callable[[str, int], bytes] = _plain_error
    # Told the status of each answer the wire gives itself to a request it read whole (a
    # handler's bug: 500), as the door counts its own answers.
    count_status: Callable[[int], None] = _count_nothing
    counters: HttpCounters = field(default_factory=HttpCounters)
    # Bodies read and not yet taken by the door, every connection together (read_bytes).
    read_bytes_max: int = 256 * 1024 * 1024
    # Whole answers waiting for clients that do not take them (their connection's writing
    # paused), every connection together (answers_unsent): past it the answer that went
    # over is given up and its connection closed, unless it is the only one waiting.
    answers_unsent_bytes_max: int = 256 * 1024 * 1024
    # Whether a request's body is worth keeping, from its headers: False when its key would
    # be refused (the door answers 401 anyway), so that clients without a key hold no
    # memory here.  None: every body is kept.
    keeps_body: Callable[[dict[str, str]], bool] | None = None
    # The answers' Date field, on the daemon's clock (the door passes its own).
    date: DateField = field(default_factory=lambda: DateField(SYSTEM_CLOCK.wall))
    # Each wanted name's text (what the parser keys its headers by): decoded once, not for
    # every header line of every request.
    wanted_names: dict[bytes, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # The wire's own rules read these, whatever else a door wants.
        self.wanted_headers = self.wanted_headers | WANTED_HEADERS
        self.wanted_names = {name: name.decode("latin-1") for name in self.wanted_headers}


def _latin1(text: str) -> bytes:
    """A header value as HTTP carries it: what latin-1 cannot say becomes \\u escapes."""
    return text.encode("latin-1", "backslashreplace")


class Exchange:
    """One request's response: ``respond`` once, or ``start_stream``, ``write``s and
    ``end_stream``.  ``on_close`` (set by the handler) is called if the client goes away
    before the response has ended."""

    __slots__ = (
        "_conn",
        "_open_stream",
        "done",
        "head_only",
        "http10",
        "keep_alive",
        "on_close",
        "streaming",
    )

    def __init__(self, conn: HttpConnection, request: Request) -> None:
        self._conn = conn
        self.keep_alive = request.keep_alive
        self.http10 = request.http10
        self.head_only = request.method == "HEAD"
        self.done = False
        self.streaming = False
        self._open_stream = False  # counted in streams_open
        self.on_close: Callable[[], None] | None = None

    def _head(self, status: int, fields: bytes, headers: list[tuple[str, str]] | None) -> bytes:
        line = STATUS_LINES.get(status) or b"HTTP/1.1 %d Error\r\n" % status
        if headers:
            text = ""
            for k, v in headers:
                text += f"{k}: {v}\r\n"
            extra = _latin1(text)
        else:
            extra = b""
        if not self.keep_alive:
            close = b"connection: close\r\n"
        else:  # an HTTP/1.0 client closes unless told the connection stays
            close = b"connection: keep-alive\r\n" if self.http10 else b""
        return b"%s%s%s%s%s\r\n" % (line, self._conn.date(), fields, extra, close)

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
        head = self._head(
            status,
            b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type, len(body)),
            headers,
        )
        self.done = True
        conn = self._conn
        conn.whole_unsent = True  # bounded while its client does not read it
        conn.send(head if self.head_only else head + body)
        conn.ended(self)

    def start_stream(
        self,
        status: int = 200,
        *,
        content_type: bytes = b"text/event-stream",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        """The head of a chunked response; ``write`` sends its pieces.  An HTTP/1.0 client
        gets the pieces unframed and the connection closed at the end."""
        if self.http10:
            self.keep_alive = False
        fields = b"content-type: %s\r\ncache-control: no-cache\r\n" % content_type
        if not self.http10:
            fields += b"transfer-encoding: chunked\r\n"
        head = self._head(status, fields, headers)
        self.streaming = True
        if not self._open_stream and not self.done:
            self._open_stream = True
            self._conn.counters.streams_open += 1
        self._conn.send(head)

    def write(self, data: bytes) -> int:
        """One chunk of the stream; returns the bytes now waiting for the client (the
        caller bounds them)."""
        conn = self._conn
        if conn.transport is None or self.done or not data:
            return 0
        conn.send(data if self.http10 else b"%x\r\n%s\r\n" % (len(data), data))
        return conn.unsent_bytes()

    def end_stream(self) -> None:
        if self.done:
            return
        self.done = True
        self.stream_closed()
        if not self.http10:
            self._conn.send(b"0\r\n\r\n")
        self._conn.ended(self)

    def abort(self) -> None:
        """Give up on the client (a stream it does not read): close the connection."""
        self.done = True
        self.stream_closed()
        self._conn.abort()

    def stream_closed(self) -> None:
        """Its stream is no longer open (ended, given up, or its connection lost): once."""
        if self._open_stream:
            self._open_stream = False
            self._conn.counters.streams_open -= 1


def admit(limits: HttpLimits, transport: asyncio.BaseTransport) -> bool:
    """Count a new connection; False (and closed at once, counted) past connections_max."""
    counters = limits.counters
    counters.connections += 1
    if counters.open_now >= limits.connections_max:
        counters.connections_refused += 1
        transport.abort()  # type: ignore[attr-defined]
        return False
    counters.open_now += 1
    return True
