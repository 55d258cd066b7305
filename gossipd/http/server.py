"""HTTP/1.1 on the daemon's own event loop: httptools' parser (the C parser uvicorn uses)
under an asyncio Protocol, nothing else in between.

Why not a framework: CPU per request is what decides at the door (issue 26), and every layer
between the parser and the intake costs microseconds a request (scripts/http_stack.py, the
same answer from each stack: 8.4 us of CPU a request here, uvicorn with a bare ASGI app
19.8, aiohttp 36.1; docs/results/http-stack-vm.json, bench/README.md "The HTTP door's
stack").  This module is only the wire: requests in (method, path, a few headers, a bounded
body), one response or one chunked stream out, keep-alive, and the client's going away.
What a request means, and what an error says, is the door's (gossipd/http/door.py); the
request and its response's writer are gossipd/http/exchange.py's.

Bounds a hostile client meets (each answered, counted and the connection closed):
- a request line and header block over HEADER_BYTES_MAX (431), a body over
  ``body_bytes_max`` (413), unparseable bytes (400);
- more than PIPELINED_MAX requests waiting behind the one being answered (429); reading
  pauses at half that, and while the client does not read its answers (the transport's
  write buffer is over its high-water mark) no request is read or answered;
- trailer fields after a chunked body: counted with the head against HEADER_BYTES_MAX (431),
  and not taken as the request's headers (RFC 9110 6.5.1);
- a refusal is the connection's last answer: nothing after the refused request is read,
  the requests before it are answered first, in order, then the refusal, then the close.
- a connection idle, or a request not read whole, for ``idle_timeout_s``: closed;
- request bodies read and not yet taken, over all connections: ``read_bytes_max`` (503);
- with TLS, a connection counts against ``connections_max`` from accept (tlsaccept.py).

Requests on one connection are answered in order: a request with nothing before it is
handled as it is read; a pipelined one waits until the one before it has ended its response
and is then taken on the next loop turn (never by recursion).  HTTP/1.0 clients are served whole answers only (no chunked streams).
Under load a turn's answers are written at its end (gossipd/http/turnwrites.py says why).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections import deque
from collections.abc import Callable

import httptools

from gossipd.busypoll import ignore_read
from gossipd.http.exchange import REASONS, Exchange, HttpCounters, HttpLimits, Request, admit
from gossipd.http.tlsaccept import TlsAccept
from gossipd.http.turnwrites import TurnWrites
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG

log = logging.getLogger("gossipd.http.server")

HEADER_BYTES_MAX = 64 * 1024  # a request line and header block
PIPELINED_MAX = 16  # requests waiting behind the one being answered; more: 429, closed
# After a refusal, what the client still sends (the rest of an upload) is read and dropped
# for this long, and this much, at most, before the connection closes: closed at once with
# bytes unread, the kernel answers with a reset, which can overtake the refusal.
REFUSED_LINGER_S = 5.0
REFUSED_LINGER_BYTES_MAX = 64 << 20
# The methods' texts, decoded once (a request's method is one of these nearly always).
_METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS")}
_ONCE_ONLY = frozenset({"host", "transfer-encoding"})  # a second line: refused, or joined
# RFC 3986's host (a name or address, or an IP literal in brackets) and an optional port.
_HOST = re.compile(
    r"(?:[A-Za-z0-9._~!$&'()*+,;=%-]*|\[[0-9A-Za-z:._~!$&'()*+,;=%-]+\])(?::[0-9]*)?"
)
Handler = Callable[[Request, Exchange], None]


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, hand each request to ``handler``, in order."""

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits,
        writes: TurnWrites | None = None,
        *,
        counted: bool = False,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self._handler = handler
        self._on_read = on_read or ignore_read  # every read (busy-polling: gossipd/busypoll.py)
        self._limits = limits
        self.date = limits.date.line  # the answers' Date field
        self._counted = counted  # TLS: counted at accept, before its handshake (tlsaccept.py)
        # the server's (one for all its connections); a connection alone gets its own
        self._writes = writes if writes is not None else TurnWrites()
        self._held: list[bytes] | None = None  # bytes for the turn's end (turnwrites.py)
        self._held_bytes = 0
        self._wanted = limits.wanted_names
        # The last Host this connection sent that passed its check (a client repeats it).
        self._host_taken: str | None = None
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._in_head = False  # between a request's first byte and its headers' end
        self._in_body = False  # between a request's headers' end and its end (trailers too)
        self._began_in_read = False  # a request began in the read being parsed
        self._read_heads = 0  # head bytes of requests begun in that read (their headers')
        self._head_bytes = 0
        self._tail = 0  # bytes of an open head's unfinished line (what httptools holds)
        self._head_raw = 0
        self._quiet_bytes = 0  # read in a body since its last body bytes (chunk trailers)
        self._read_body = 0  # body bytes in the read being parsed
        self._last_seen = False  # a request without keep-alive came: nothing after it is read
        # One piece as it came (the usual body); more pieces grow one bytearray: a chunked
        # body of 2-byte chunks kept as a list took 28 times its bytes.
        self._body: bytes | bytearray = b""
        self._body_bytes = 0
        self._keep_body = True  # False: its key is refused, its body read and dropped
        self._waiting_bytes = 0  # bodies of the requests waiting (in counters.read_bytes)
        self._upgrade_refused = False  # an Upgrade with a body, or a CONNECT: refused, alone
        self._waiting: deque[Request] = deque()
        self._current: Exchange | None = None
        self._reading_paused = False
        self._writing_paused = False  # the client does not read: take nothing more
        # A whole answer was sent (Exchange.respond sets it) and its client has not been
        # seen to take it: while its writing is paused, what the transport holds counts in
        # counters.answers_unsent.
        self.whole_unsent = False
        self._unsent_counted = 0  # this connection's part of counters.answers_unsent
        self._next_soon = False  # the next pipelined request is scheduled
        self._broken = False  # the wire refused a request: nothing after it is read
        # That refusal, when answers were due before it: sent once they are out.
        self._refusal: bytes | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_at: float | None = None  # when the connection is idle too long
        self._linger: asyncio.TimerHandle | None = None  # closing: aborted if still open then
        self._dropping = -1  # after a refusal: bytes read and dropped since (-1: none)
        # Unsent bytes when the transport last paused our writing, or at the last idle or
        # linger look: a client that took some since is slow, not gone.
        self._unsent_seen = 0

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._counted and not admit(self._limits, transport):
            return
        self.transport = transport  # type: ignore[assignment]
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_idle()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._release_unsent()
        if self.transport is None:
            return
        self.transport = None
        self._held = None
        counters = self._limits.counters
        counters.open_now -= 1
        counters.read_bytes -= len(self._body) + self._waiting_bytes
        self._body, self._waiting_bytes = b"", 0
        self._waiting.clear()
        current, self._current = self._current, None
        if current is not None:
            current.stream_closed()
            if not current.done and current.on_close is not None:
                current.on_close()

    def pause_writing(self) -> None:
        # The client does not read its answers: read and answer nothing more until it does.
        self._writing_paused = True
        self._unsent_seen = self.unsent_bytes()
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._release_unsent()  # taken, bar what is under the transport's low-water mark
        if self._idle_at is not None:
            self._arm_idle()  # it reads: its idle deadline starts again
        self._maybe_resume_reading()
        self._schedule_next()

    def data_received(self, data: bytes) -> None:
        self._on_read()
        if self._broken or self._last_seen:
            if self._dropping >= 0:
                self._dropping += len(data)
                if self._dropping > REFUSED_LINGER_BYTES_MAX:
                    self.abort()
            return  # (still read: a client that goes away is seen)
        view: bytes | memoryview = data
        self._read_body = 0  # body bytes of this read (on_body)
        self._began_in_read, self._read_heads = False, 0
        while True:
            try:
                self._parser.feed_data(view)
                break
            except httptools.HttpParserUpgrade as exc:
                # llhttp ends a request that asks for an upgrade (h2c: `curl --http2`) at its
                # head and stops.  The upgrade is ignored (RFC 9110 7.8): a request without a
                # body was answered as any other, and what follows it is the next request, for
                # a new parser (a loop, not a call: a read may hold thousands).  One with a
                # body cannot be read here, nor a CONNECT served: refused, alone.
                if self._upgrade_refused:
                    self._fail(
                        400,
                        "protocol upgrades and CONNECT are not served here: send the request "
                        "without 'Connection: Upgrade'",
                    )
                    return
                self._parser = httptools.HttpRequestParser(self)
                offset = exc.args[0] if exc.args else len(view)
                if offset >= len(view) or self._broken or self._last_seen:
                    return
                view = memoryview(view)[offset:]
            except httptools.HttpParserError as exc:
                # A callback's exception comes wrapped (HttpParserCallbackError): ours says why.
                cause = exc.__context__
                if isinstance(cause, _Refused):
                    self._fail(cause.status, str(cause))
                else:
                    self._fail(400, f"malformed HTTP request: {exc}")
                return
        if self._in_head:
            # httptools holds a line of the head until it ends: count what it holds, so that
            # one endless header is refused at the bound, not when it ends.  That line is the
            # read's last (after its last newline), and it follows every body byte and every
            # head the read ended (a large body without newlines, then the next head's first
            # bytes, is no 431; nor is a read of many small pipelined requests).  A head open
            # since an earlier read whose line this read does not end grows by all of it.
            newline = data.rfind(b"\n")
            if not self._began_in_read:  # (open before this read, then: it continues)
                self._tail = self._tail + len(data) if newline < 0 else len(data) - newline - 1
                # Every byte of this read is the head's: counted whole, so that blanks
                # around values and line ends (which no callback reports) count too.
                self._head_raw += len(data)
                if self._head_raw > HEADER_BYTES_MAX:
                    self._fail(431, f"the request's header block is over {HEADER_BYTES_MAX} bytes")
                    return
            else:
                self._tail = min(
                    len(data) - newline - 1, len(data) - self._read_body - self._read_heads
                )
            if self._tail > HEADER_BYTES_MAX:  # (its ended lines: on_url, on_header)
                self._fail(431, f"the request's header block is over {HEADER_BYTES_MAX} bytes")
        elif self._in_body:
            # Reads of a body that bring no body bytes: a chunked body's trailer section (or
            # its chunk lines), which httptools holds until a field ends.  Counted, as a
            # head is, so that an endless trailer field is refused at the bound.
            if self._read_body:
                self._quiet_bytes = 0
            else:
                self._quiet_bytes += len(data)
                if self._quiet_bytes > HEADER_BYTES_MAX:
                    self._fail(
                        431, f"the request's trailer fields are over {HEADER_BYTES_MAX} bytes"
                    )

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._in_head = True
        self._in_body = False
        self._began_in_read = True
        self._head_bytes = 0  # the request line and headers parsed so far
        self._head_raw = 0  # the head's bytes in reads that fell wholly inside it
        self._tail = 0
        self._body = b""
        self._body_bytes = 0
        self._keep_body = True
        self._arm_idle()  # the whole request must arrive within idle_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        # (_count_head inlined: four headers a request)
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > HEADER_BYTES_MAX:
            raise _Refused(431, f"the request's header block is over {HEADER_BYTES_MAX} bytes")
        if not self._in_head:
            # A trailer field (after a chunked body): counted above with the head, and not
            # merged into the request's headers (RFC 9110 6.5.1): a key, a request id or a
            # Transfer-Encoding sent there is not the request's.
            return
        key = self._wanted.get(name.lower())
        if key is not None:
            headers = self._headers
            if key in headers and key in _ONCE_ONLY:
                if key == "host":  # RFC 9112 3.2: which host was meant is not known
                    raise _Refused(400, "more than one Host header")
                # Transfer codings listed over several lines are one list (RFC 9110 5.3).
                value = headers[key].encode("latin-1") + b", " + value
            headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._began_in_read:  # (this head began in this read: all its bytes are here)
            self._read_heads += self._head_bytes
        self._in_head = False
        self._in_body = True
        self._quiet_bytes = 0
        headers = self._headers
        parser = self._parser
        host = headers.get("host")
        if host is None:
            if parser.get_http_version() == "1.1":
                raise _Refused(400, "an HTTP/1.1 request must carry a Host header (RFC 9112 3.2)")
        elif host != self._host_taken:
            if _HOST.fullmatch(host.strip(" \t")) is None:  # (llhttp keeps trailing blanks)
                raise _Refused(400, f"the Host header {host[:100]!r} is not a host[:port]")
            self._host_taken = host
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip(" \t").lower() != "chunked":
            # llhttp reads any list that ends in chunked as chunked: a body in gzip would be
            # taken as JSON (RFC 9112 6.1: a coding not understood is a 501).
            raise _Refused(
                501,
                f"Transfer-Encoding {coding[:100]!r} is not served: send the body whole "
                "(Content-Length) or in chunks alone ('Transfer-Encoding: chunked')",
            )
        if parser.should_upgrade() and (
            parser.get_method() == b"CONNECT"
            or headers.get("content-length", "0").strip() not in ("", "0")
            or "transfer-encoding" in headers
        ):
            self._upgrade_refused = True  # (data_received answers it, alone)
            return
        keeps_body = self._limits.keeps_body
        if keeps_body is not None and not keeps_body(headers):
            self._keep_body = False  # (answered 401 by the door: no 100 Continue either)
            self._limits.counters.bodies_dropped += 1
            return
        if headers.get("expect", "").lower() != "100-continue":
            return
        # A client that asks first is not told to send a body over the bound (a body sent
        # unasked is refused at the bound, the rest of it read and dropped: _close_refused).
        length = headers.get("content-length", "").strip(" \t")
        if length.isdigit() and int(length) > self._limits.body_bytes_max:
            raise _Refused(413, _too_large(self._limits.body_bytes_max))
        if (
            self.transport is not None
            # Not inside another response under way (it would break that one's framing), nor
            # to HTTP/1.0 (RFC 9110 15.2): the client then sends its body after a wait.
            and self._current is None
            and not self._waiting
            and parser.get_http_version() != "1.0"
        ):
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s without

    def on_body(self, body: bytes) -> None:
        n = len(body)
        self._read_body += n
        self._body_bytes += n
        limits = self._limits
        if self._body_bytes > limits.body_bytes_max:
            raise _Refused(413, _too_large(limits.body_bytes_max))
        if not self._keep_body:
            return  # read, so that the connection stays in step, and dropped
        counters = limits.counters
        counters.read_bytes += n
        if counters.read_bytes > limits.read_bytes_max:
            counters.read_bytes -= n  # (not held: _fail releases what _body holds)
            raise _Refused(
                503,
                f"the door holds {limits.read_bytes_max} bytes of request bodies not yet "
                "taken (http.read_bytes_max): retry shortly",
            )
        held = self._body
        if not held:
            self._body = body
        elif type(held) is bytearray:
            held += body
        else:
            self._body = bytearray(held) + body

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._last_seen or self._upgrade_refused:
            # pipelined after a request that closes the connection: not taken
            self._limits.counters.read_bytes -= len(self._body)
            self._body = b""
            return
        parser = self._parser
        body = self._body
        url = self._url
        if url[:1] != b"/" and url[:4].lower() == b"http":
            url = _origin_form(url)
        request = Request(
            method=_METHODS.get(method := parser.get_method()) or method.decode("latin-1"),
            path=url.decode("latin-1"),
            headers=self._headers,
            body=body if type(body) is bytes else bytes(body),
            keep_alive=parser.should_keep_alive(),
            http10=parser.get_http_version() == "1.0",
            key_refused=not self._keep_body,
        )
        if request.http10 and "transfer-encoding" in self._headers:
            # An HTTP/1.0 message with Transfer-Encoding is faulty framing: its connection
            # closes after it (RFC 9112 6.1).
            request.keep_alive = False
        self._body = b""
        self._limits.counters.requests += 1
        # Disarmed: its timer, if it fires meanwhile, does nothing (queued behind unread
        # answers, the request's turn comes in _next, which arms it again).
        self._idle_at = None
        if not request.keep_alive:
            self._last_seen = True  # the client's last request: what follows is ignored
        limits = self._limits
        if self._current is None and not self._waiting and not self._writing_paused:
            # Nothing before it (the usual case): answered now, inside this read.
            limits.counters.read_bytes -= len(request.body)  # taken by the door
            self._dispatch(request)
            return
        if len(self._waiting) >= PIPELINED_MAX:
            limits.counters.read_bytes -= len(request.body)
            raise _Refused(429, f"more than {PIPELINED_MAX} pipelined requests unanswered")
        self._waiting.append(request)
        self._waiting_bytes += len(request.body)
        # Reading pauses at half the count, or at one body's bound of bodies waiting: one
        # connection does not fill http.read_bytes_max by pipelining.
        if len(self._waiting) >= PIPELINED_MAX // 2 or self._waiting_bytes >= limits.body_bytes_max:
            self._pause_reading()
        self._schedule_next()

    # -- writing -----------------------------------------------------------------------------

    @property
    def counters(self) -> HttpCounters:
        return self._limits.counters

    def send(self, data: bytes) -> None:
        """Bytes for the client: now, or at the loop turn's end (turnwrites.py)."""
        if self.transport is not None:
            self._writes.write(self, data)

    def write_now(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            if self.whole_unsent:
                if self._writing_paused:  # (not paused: taken, bar the high-water mark)
                    self._count_unsent()
                else:
                    self.whole_unsent = False

    def hold(self, data: bytes) -> bool:
        """Keep ``data`` for the turn's end; True when it is the first held."""
        self._held_bytes += len(data)
        if self._held is None:
            self._held = [data]
            return True
        self._held.append(data)
        return False

    def write_held(self) -> None:
        held, self._held = self._held, None  # cleared first: a failed write holds nothing
        self._held_bytes = 0
        if held and self.transport is not None:
            self.transport.write(held[0] if len(held) == 1 else b"".join(held))
            if self.whole_unsent:
                if self._writing_paused:
                    self._count_unsent()
                else:
                    self.whole_unsent = False

    def unsent_bytes(self) -> int:
        """Bytes not yet taken by the client: held here or in the transport's buffer."""
        transport = self.transport
        buffered = transport.get_write_buffer_size() if transport is not None else 0
        return self._held_bytes + buffered

    def close(self) -> None:
        """Close after what is held and buffered has been written: within idle_timeout_s,
        else at once (a client that does not read would keep its connection, and its place
        under connections_max, for ever)."""
        if self.transport is not None:
            self.write_held()
            self.transport.close()
            if self._linger is None:
                self._linger = self._loop.call_later(self._limits.idle_timeout_s, self._linger_out)

    def _linger_out(self) -> None:
        """A closing connection's time is up: dropped, unless its client took some of what
        is left since the last look (a slow reader of a large answer gets it whole)."""
        self._linger = None
        if self.transport is not None and self._reading_since_seen():
            self._linger = self._loop.call_later(self._limits.idle_timeout_s, self._linger_out)
            return
        self.abort()

    def _reading_since_seen(self) -> bool:
        """The client took some of the unsent bytes since the last look (remembered)."""
        unsent = self.unsent_bytes()
        took = 0 < unsent < self._unsent_seen
        self._unsent_seen = unsent
        return took

    def abort(self) -> None:
        """Close at once, what is held or buffered dropped."""
        self._held = None
        self._held_bytes = 0
        self._release_unsent()
        if self.transport is not None:
            self.transport.abort()

    # -- internals -------------------------------------------------------------------------

    def _count_unsent(self) -> None:
        """After a write with a whole answer in it: while the client does not take it (the
        transport paused our writing), the bytes the transport holds count in answers_unsent;
        past answers_unsent_bytes_max, over every connection, this answer is given up and
        the connection closed, unless it alone waits (a lone answer always goes).  A client
        that reads is not counted: it takes the answer as fast as the kernel hands it over
        (a connection counts only from a pause, and resume_writing gives its count back)."""
        transport = self.transport
        if transport is None:
            return
        counters = self._limits.counters
        now = transport.get_write_buffer_size()
        counters.answers_unsent += now - self._unsent_counted
        self._unsent_counted = now
        if (
            counters.answers_unsent > self._limits.answers_unsent_bytes_max
            and counters.answers_unsent > now
        ):
            counters.answers_dropped += 1
            self.abort()

    def _release_unsent(self) -> None:
        self._limits.counters.answers_unsent -= self._unsent_counted
        self._unsent_counted = 0
        self.whole_unsent = False

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > HEADER_BYTES_MAX:
            raise _Refused(431, f"the request's header block is over {HEADER_BYTES_MAX} bytes")

    def _schedule_next(self) -> None:
        """Take the next waiting request on the next loop turn (never by recursion: an answer
        given synchronously would otherwise take the next inside the handler)."""
        if self._current is None and self._waiting and not self._next_soon:
            self._next_soon = True
            self._loop.call_soon(self._next)

    def _next(self) -> None:
        self._next_soon = False
        if self._current is not None or not self._waiting or self.transport is None:
            return
        if self._writing_paused:
            # resume_writing takes it; meanwhile its client has idle_timeout_s to read
            self._arm_idle()
            return
        request = self._waiting.popleft()
        self._waiting_bytes -= len(request.body)
        self._limits.counters.read_bytes -= len(request.body)  # taken by the door
        self._dispatch(request)
        self._maybe_resume_reading()

    def _dispatch(self, request: Request) -> None:
        exchange = Exchange(self, request)
        self._current = exchange
        try:
            self._handler(request, exchange)
        except Exception:  # a handler bug answers 500, the daemon keeps serving
            log.exception("the HTTP handler raised", extra={"path": request.path[:200]})
            self._limits.counters.handler_errors += 1
            if not exchange.done and not exchange.streaming:
                request_id = request.headers.get("x-request-id", "")[:256]
                exchange.respond(
                    500,
                    self._limits.error_body("internal error", 500),
                    headers=[("x-request-id", request_id)] if request_id else None,
                )
                self._limits.count_status(500)
            elif not exchange.done:
                exchange.abort()

    def ended(self, exchange: Exchange) -> None:
        """``exchange``'s response is out: close, or take the next pipelined request."""
        if exchange is not self._current:
            return
        self._current = None
        if not exchange.keep_alive:
            self.close()
            return
        if self._waiting:
            self._schedule_next()
        elif self._refusal is not None:
            self.send(self._refusal)  # its turn: every request before it is answered
            self._refusal = None
            self._close_refused()
        else:
            self._arm_idle()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if (
            self._reading_paused
            and self.transport is not None
            and not self._writing_paused
            and len(self._waiting) < PIPELINED_MAX // 2
            and self._waiting_bytes < self._limits.body_bytes_max
        ):
            self._reading_paused = False
            self.transport.resume_reading()
            if self._in_head or self._in_body:
                self._arm_idle()  # a request begun: its rest has idle_timeout_s from now

    # The idle deadline moves with every request (twice: at its start and after its answer)
    # but its timer does not: the one timer, when it fires, re-arms for the deadline as it
    # is then (a timer a request cost ~5 us at 10k requests a second).

    def _arm_idle(self) -> None:
        self._idle_at = at = self._loop.time() + self._limits.idle_timeout_s
        if self._idle is None:
            self._idle = self._loop.call_at(at, self._idle_out)

    def _stop_idle(self) -> None:
        self._idle_at = None
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_out(self) -> None:
        self._idle = None
        at = self._idle_at
        if at is None:
            return
        if self._loop.time() < at:
            self._idle = self._loop.call_at(at, self._idle_out)
            return
        # Idle, or a request begun and not read whole in time: also behind an answer under
        # way (a long stream), which it would otherwise wait out with its partial body held.
        # Not while reading is paused by us (requests or bodies waiting): the rest of that
        # request may be here, unread; its time starts again when reading resumes.
        if self.transport is not None and (
            self._current is None or ((self._in_head or self._in_body) and not self._reading_paused)
        ):
            if self._current is None and self._reading_since_seen():
                self._arm_idle()  # it reads, slowly, what it was sent: not idle
                return
            self._limits.counters.idle_closed += 1
            if self.unsent_bytes():
                self.abort()  # silent and not reading what it was sent: no wait for it
            else:
                self.close()

    def _fail(self, status: int, message: str) -> None:
        self._broken = True
        self._in_head = self._in_body = False  # the refused request is done with: its refusal
        self._limits.counters.read_bytes -= len(self._body)  # (its partial body, if held)
        self._body = b""
        self._limits.counters.bad_requests += 1
        if self.transport is None or self._last_seen:
            return  # (after the client's last request nothing is answered: bytes it sent after)
        body = self._limits.error_body(message, status)
        refusal = (
            b"HTTP/1.1 %d %s\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s"
            % (status, REASONS.get(status, "Error").encode(), self.date(), len(body), body)
        )
        if (self._current is not None and not self._current.done) or self._waiting:
            # Answers are due before it (one under way, requests waiting): HTTP/1.1 answers
            # in the order asked, so the refusal waits its turn (``ended``) and the requests
            # before it are served.  Nothing after it is read.
            self._refusal = refusal
            return
        self.send(refusal)
        self._close_refused()

    def _close_refused(self) -> None:
        """After a refusal: our side ends once it is written (a FIN), and what the client
        still sends is read and dropped (REFUSED_LINGER_S, REFUSED_LINGER_BYTES_MAX), until
        it closes too.  Closed at once, with the rest of an upload unread, the kernel
        answered it with a reset, which clients saw instead of the 413 (httpx writes the
        whole body before it reads)."""
        transport = self.transport
        if transport is None or not transport.can_write_eof():  # (TLS: closed as before)
            self.close()
            return
        self.write_held()
        transport.write_eof()
        self._dropping = 0
        self._stop_idle()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if self._linger is None:
            linger_s = min(REFUSED_LINGER_S, self._limits.idle_timeout_s)
            self._linger = self._loop.call_later(linger_s, self.abort)


def _too_large(bytes_max: int) -> str:
    return f"the request body is over {bytes_max} bytes (http.body_bytes_max)"


def _origin_form(url: bytes) -> bytes:
    """The path and query of an absolute-form target (``http://host/v1/models``), which a
    server must accept (RFC 9112 3.2.2); the target as it came when it is not one."""
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return url
    if parsed.schema is None or parsed.schema.lower() not in (b"http", b"https"):
        return url
    path = parsed.path or b"/"
    return path + b"?" + parsed.query if parsed.query else path


class _Refused(Exception):
    """A request over a bound, raised inside a parser callback to stop parsing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def serve(
    host: str,
    port: int,
    handler: Handler,
    limits: HttpLimits,
    *,
    tls: ssl.SSLContext | None = None,
    on_read: Callable[[], None] | None = None,
) -> asyncio.Server:
    """Listen on ``host:port`` (port 0: any free one) on the running loop; ``on_read``:
    told of every read of every connection (busy-polling: gossipd/busypoll.py)."""
    loop = asyncio.get_running_loop()
    writes = TurnWrites()  # one for all connections: a turn's answers leave together
    factory: Callable[[], asyncio.Protocol]
    if tls is None:
        factory = lambda: HttpConnection(handler, limits, writes, on_read=on_read)  # noqa: E731
    else:  # counted from accept, its handshake included (tlsaccept.py)
        factory = lambda: TlsAccept(  # noqa: E731
            lambda: HttpConnection(handler, limits, writes, counted=True, on_read=on_read),
            limits,
            tls,
        )
    return await loop.create_server(
        factory,
        host,
        port,
        reuse_address=True,
        backlog=LISTEN_BACKLOG,
    )
