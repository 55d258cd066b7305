"""The HTTP wire's bounds and refusals, from a review of gossipd/http/server.py against
docs/PROTOCOL.md "HTTP" (2026-12-06): a false 431 on a read of many small pipelined
requests, trailer fields neither bounded nor kept apart from the headers, and requests
answered after the wire had refused and closed.  Most drive HttpConnection (the real class)
with a fake asyncio transport, so that the parsing and the order of events are exact; one
runs on a real socket, one through a real daemon's door."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import time
import tracemalloc
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gossipd.http.exchange import Exchange, HttpLimits, Request
from gossipd.http.server import HttpConnection, serve
from gossipd.http.turnwrites import TurnWrites
from gossipd.tools.launcher import DaemonProcess


class FakeTransport(asyncio.Transport):
    """What HttpConnection uses of a transport; records what is written.  Like asyncio's
    socket transport, it calls the protocol's pause_writing when more than 64 KiB wait, and
    write() after close() still writes (the socket stays open until the buffer drains)."""

    HIGH = 64 * 1024

    def __init__(self, protocol: HttpConnection) -> None:
        super().__init__()
        self.protocol = protocol
        self.out = bytearray()
        self.buffered = 0  # bytes "not yet taken by the client"
        self.closing = False
        self.aborted = False
        self.paused = False
        self.eof = False

    def write(self, data: Any) -> None:
        if self.aborted:
            return
        self.out += data
        self.buffered += len(data)
        if self.buffered > self.HIGH and not self.paused:
            self.paused = True
            self.protocol.pause_writing()

    def drain(self) -> None:
        """The client reads everything: the buffer empties, the protocol resumes."""
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.protocol.resume_writing()

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.aborted = True
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Our side ends (a FIN after what is written): the connection is on its way out,
        closed when the client's side ends or the linger runs out."""
        self.eof = True
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Handler:
    """/big: 1 MiB answer (fills the client's buffer); anything else: a small answer."""

    def __init__(self) -> None:
        self.seen: list[Request] = []

    def __call__(self, request: Request, exchange: Exchange) -> None:
        self.seen.append(request)
        if request.path == "/big":
            exchange.respond(200, b"x" * (1 << 20), content_type=b"text/plain")
        else:
            exchange.respond(200, request.path.encode(), content_type=b"text/plain")


def _connection(**kw: Any) -> tuple[HttpConnection, FakeTransport, Handler]:
    handler = Handler()
    limits = HttpLimits(**{"body_bytes_max": 1 << 20, "connections_max": 64, **kw})
    conn = HttpConnection(handler, limits, TurnWrites())
    transport = FakeTransport(conn)
    conn.connection_made(transport)
    return conn, transport, handler


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# 1. A false 431: the head bytes of requests already complete in the same read are counted
#    against the partial request that ends the read.
def test_many_small_pipelined_requests_in_one_read_are_not_a_431() -> None:
    async def case() -> None:
        conn, transport, _ = _connection()
        pad = b"x-pad: " + b"a" * 1000 + b"\r\n"
        one = b"GET /h HTTP/1.1\r\nhost: x\r\n" + pad + b"\r\n"  # ~1 KiB head, no body
        data = one * 100 + one[:500]  # 100 whole requests and half of the 101st: one read
        conn.data_received(data)
        await _turns()
        conn.data_received(one[500:])
        await _turns()
        out = bytes(transport.out)
        assert b" 431 " not in out, out[-400:]
        assert out.count(b"HTTP/1.1 200 OK") == 101

    asyncio.run(case())


def test_many_small_pipelined_requests_on_a_real_socket_are_all_answered() -> None:
    async def case() -> None:
        handler = Handler()
        limits = HttpLimits(body_bytes_max=1 << 20, connections_max=64)
        server = await serve("127.0.0.1", 0, handler, limits)
        port = server.sockets[0].getsockname()[1]
        one = b"GET /h HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 1000 + b"\r\n\r\n"
        count = 400  # ~400 KiB in one write: a 256 KiB read ends inside a head
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(one * count)
        got = b""
        async with asyncio.timeout(10):
            while got.count(b"HTTP/1.1 ") < count:
                try:
                    piece = await reader.read(1 << 16)
                except ConnectionResetError:  # closed by the server with our bytes unread
                    break
                if not piece:
                    break
                got += piece
        writer.close()
        server.close()
        answered = got.count(b"HTTP/1.1 200 OK")
        assert b" 431 " not in got and answered == count, (answered, got[-200:])

    asyncio.run(case())


# 2. Trailers: a chunked body's trailer section is neither bounded (431) nor kept apart
#    from the request's headers.
def _chunked_head(extra: bytes = b"") -> bytes:
    return (
        b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n" + extra + b"\r\n"
        b"2\r\n{}\r\n0\r\n"
    )


def test_an_endless_trailer_is_refused_at_the_header_bound() -> None:
    async def case() -> None:
        conn, transport, _ = _connection()
        conn.data_received(_chunked_head() + b"x-t: ")
        piece = b"a" * 65536
        tracemalloc.start()
        try:
            for _ in range(64):  # 4 MiB of one trailer field, never ended
                if transport.closing:
                    break
                conn.data_received(piece)
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        await _turns()
        assert transport.closing and b" 431 " in bytes(transport.out), (
            f"no 431 and the connection open after 4 MiB of trailer; {held} bytes held"
        )

    asyncio.run(case())


def test_trailer_fields_are_not_taken_as_the_requests_headers() -> None:
    async def case() -> None:
        conn, transport, handler = _connection()
        conn.data_received(
            _chunked_head()
            + b"authorization: Bearer sk-from-the-trailer-0123456789\r\n"
            + b"x-request-id: from-trailer\r\n\r\n"
        )
        await _turns()
        assert handler.seen, bytes(transport.out)
        headers = handler.seen[0].headers
        # RFC 9110 6.5.1: trailer fields are not merged into the header section
        assert "authorization" not in headers and "x-request-id" not in headers, headers

    asyncio.run(case())


# 3. After the wire refuses a request and closes (400/413/429/431/501 "connection
#    closed"), a pipelined request still waiting was dispatched when the client read, and
#    its answer written after the error that said "connection: close".  Then (064f178)
#    the connection closed at once without a status, dropping the valid requests before
#    the refused one.  Now the requests before it are answered, in order, and the refusal
#    comes in its own place, last.
def _statuses(out: bytes) -> list[int]:
    """The statuses of the responses in ``out``, in order (bodies here hold no "HTTP/1.1 ")."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


def test_a_refusal_waits_for_the_answers_due_before_it_and_is_the_last() -> None:
    """A malformed request behind a waiting one (the client not reading /big's answer):
    nothing is sent out of turn; once the client reads, /h is answered, then the 400, and
    the connection closes.  Nothing sent after the malformed request is read.  With
    nothing waiting, the 400 is sent at once."""

    async def case() -> None:
        conn, transport, handler = _connection()
        conn.data_received(
            b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n"  # fills the client's buffer: paused
            b"GET /h HTTP/1.1\r\nhost: x\r\n\r\n"  # waits behind it
            b"NOT HTTP\r\n\r\n"  # malformed: the connection's last
        )
        await _turns()
        assert not transport.closing  # /h's answer is due first
        assert _statuses(bytes(transport.out)) == [200]  # /big's answer alone
        conn.data_received(b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")  # not read
        transport.drain()  # the client reads its answers; asyncio calls resume_writing
        await _turns()
        out = bytes(transport.out)
        assert transport.closing
        assert _statuses(out) == [200, 200, 400], out[-400:]
        assert out.index(b"\r\n\r\n/h") < out.index(b"HTTP/1.1 400 "), out[-400:]
        assert b"connection: close" in out[out.index(b"HTTP/1.1 400 ") :]
        assert [r.path for r in handler.seen] == ["/big", "/h"], [r.path for r in handler.seen]

        conn, transport, handler = _connection()
        conn.data_received(b"GET /h HTTP/1.1\r\nhost: x\r\n\r\nNOT HTTP\r\n\r\n")
        await _turns()
        out = bytes(transport.out)
        assert transport.closing and _statuses(out) == [200, 400], out

    asyncio.run(case())


def test_too_many_pipelined_requests_are_answered_then_a_429_closes_the_connection() -> None:
    """17 waiting behind an answer the client does not read: the 16 the bound holds are
    answered once the client reads, then a 429 for the 17th, which closes the connection."""

    async def case() -> None:
        conn, transport, handler = _connection()
        one = b"GET /h HTTP/1.1\r\nhost: x\r\n\r\n"
        conn.data_received(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n" + one * 17)
        await _turns()
        assert not transport.closing
        assert _statuses(bytes(transport.out)) == [200]
        transport.drain()
        await _turns(60)
        out = bytes(transport.out)
        assert transport.closing
        assert _statuses(out) == [200] * 17 + [429], _statuses(out)
        assert b"pipelined requests unanswered" in out[out.index(b"HTTP/1.1 429 ") :]
        assert len(handler.seen) == 17, [r.path for r in handler.seen]

    asyncio.run(case())


def test_a_refusal_behind_an_answer_under_way_follows_it() -> None:
    """A 413 (a body over the bound) parsed while the request before it is still being
    answered (its handler answers later): that answer first, then the 413."""

    async def case() -> None:
        handler_exchanges: list[Exchange] = []

        def later(request: Request, exchange: Exchange) -> None:
            handler_exchanges.append(exchange)  # answered below, after the refusal came

        limits = HttpLimits(body_bytes_max=100, connections_max=64)
        conn = HttpConnection(later, limits, TurnWrites())
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        conn.data_received(
            b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000
        )
        await _turns()
        assert not transport.closing and bytes(transport.out) == b""
        handler_exchanges[0].respond(200, b"slow", content_type=b"text/plain")
        await _turns()
        out = bytes(transport.out)
        assert transport.closing and _statuses(out) == [200, 413], out
        assert len(handler_exchanges) == 1

    asyncio.run(case())


def test_a_key_sent_only_in_a_trailer_is_not_taken(tmp_path: Path) -> None:
    """Through a real daemon's door with http.keys_dir: a chunked request whose only
    Authorization is a trailer field is a 401 (it was served 200)."""
    key = "sk-test-0123456789abcdef"
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "alice.key").write_text(key + "\n")
    d = DaemonProcess(
        overrides=['http.bind="127.0.0.1:0"', f'http.keys_dir="{keys}"'],
        log_dir=tmp_path,
        name="d",
    )
    d.start()
    try:
        port = int(d.http_url.rsplit(":", 1)[1])
        body = json.dumps({"model": "echo", "prompt": "hi", "max_tokens": 1}).encode()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        chunks = b"%x\r\n%s\r\n0\r\n" % (len(body), body)
        for trailer, status in (
            (b"", b"401"),
            (b"authorization: Bearer %s\r\n" % key.encode(), b"401"),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head + chunks + trailer + b"\r\n")
                got = b""
                while piece := sock.recv(65536):
                    got += piece
            assert got.startswith(b"HTTP/1.1 " + status + b" "), got[:300]
        # The same key in the header serves: the 401 above is the trailer's, not the key's.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                head.replace(
                    b"connection: close",
                    b"authorization: Bearer %s\r\nconnection: close" % key.encode(),
                )
                + chunks
                + b"\r\n"
            )
            got = b""
            while piece := sock.recv(65536):
                got += piece
        assert got.startswith(b"HTTP/1.1 200 "), got[:300]
    finally:
        d.stop(timeout_s=15)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=16),
    bodies=st.lists(st.just(0) | st.integers(0, 90_000), min_size=16, max_size=16),
    cuts=st.lists(st.integers(1, 400_000), max_size=12),
)
# Two whole heads of 30 KB and a read that ends inside the third: a 431 before the fix.
@example(sizes=[30_000, 30_000, 30_000], bodies=[0] * 16, cuts=[90_100])
def test_any_read_boundaries_give_every_pipelined_request_its_answer(
    sizes: list[int], bodies: list[int], cuts: list[int]
) -> None:
    """Requests with headers of any size up to about 40 KiB and bodies without newlines up
    to 90 KiB, pipelined and cut into reads anywhere: each is answered 200, in order, never
    a 431 (the bound counts a head's own held bytes, wherever the reads fall)."""
    wire = b"".join(
        b"POST /r%d HTTP/1.1\r\nhost: x\r\nx-pad: %s\r\ncontent-length: %d\r\n\r\n%s"
        % (i, b"p" * size, bodies[i], b"b" * bodies[i])
        for i, size in enumerate(sizes)
    )
    edges = sorted({0, len(wire), *(c % len(wire) for c in cuts)})

    async def case() -> None:
        conn, transport, handler = _connection(body_bytes_max=1 << 20)
        for start, end in itertools.pairwise(edges):
            conn.data_received(wire[start:end])
            transport.drain()  # the client reads: no request waits on a paused writer
            await _turns(2)
        await _turns()
        out = bytes(transport.out)
        assert b" 431 " not in out and b" 400 " not in out, out[-300:]
        assert [r.path for r in handler.seen] == [f"/r{i}" for i in range(len(sizes))]
        assert out.count(b"HTTP/1.1 200 OK") == len(sizes)

    asyncio.run(case())


def test_a_request_not_read_whole_behind_an_answer_under_way_is_closed_at_the_idle_timeout() -> (
    None
):
    """A request begun behind a long answer (a stream) and never read whole waited out that
    whole answer, its partial body held, then got a fresh idle period: PROTOCOL.md says a
    request not read whole within http.idle_timeout_s is closed."""

    async def case() -> None:
        exchanges: list[Exchange] = []
        limits = HttpLimits(body_bytes_max=1 << 20, connections_max=64, idle_timeout_s=0.2)
        conn = HttpConnection(lambda r, e: exchanges.append(e), limits, TurnWrites())
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        conn.data_received(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")  # under way
        conn.data_received(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nab")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while not transport.closing and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert transport.closing, "the partial request outlived http.idle_timeout_s"
        assert loop.time() < deadline and limits.counters.idle_closed == 1
        assert len(exchanges) == 1

        # An answer under way with nothing begun behind it is not idle: kept open.
        conn = HttpConnection(lambda r, e: exchanges.append(e), limits, TurnWrites())
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        conn.data_received(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.6)
        assert not transport.closing and limits.counters.idle_closed == 1

    asyncio.run(case())


# From a security review (2026-12-06): request bodies were bounded by a count alone
# (16 waiting per connection, 4096 connections: ~32 GiB of 1 MiB bodies), and a client
# without a key had its body read and held before the 401.


class _ReadingTransport(FakeTransport):
    """A FakeTransport that says whether reading is paused."""

    def __init__(self, protocol: HttpConnection) -> None:
        super().__init__(protocol)
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def _post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path,
        len(body),
        extra,
        body,
    )


def test_bodies_held_at_the_wire_are_bounded_in_bytes_over_every_connection() -> None:
    async def case() -> None:
        exchanges: list[Exchange] = []
        limits = HttpLimits(body_bytes_max=4096, connections_max=64, read_bytes_max=10_000)

        def connect() -> tuple[HttpConnection, _ReadingTransport]:
            conn = HttpConnection(lambda r, e: exchanges.append(e), limits, TurnWrites())
            transport = _ReadingTransport(conn)
            conn.connection_made(transport)
            return conn, transport

        a, ta = connect()
        # behind an answer under way: the first body is taken by the door, the next wait
        a.data_received(_post(b"/1", b"a" * 100) + _post(b"/2", b"b" * 3000))
        assert limits.counters.read_bytes == 3000 and ta.reading
        a.data_received(_post(b"/3", b"c" * 1500))  # one body's bound waiting: paused
        assert limits.counters.read_bytes == 4500 and not ta.reading
        b, _ = connect()
        b.data_received(_post(b"/4", b"d" * 4000)[:-1000])  # partly read: held too
        assert limits.counters.read_bytes == 7500
        _, tc = connect()
        tc.protocol.data_received(_post(b"/5", b"e" * 4000))  # would pass read_bytes_max: 503
        await _turns()
        out = bytes(tc.out)
        assert _statuses(out) == [503] and tc.closing, out
        assert b"http.read_bytes_max" in out and limits.counters.read_bytes == 7500
        b.connection_lost(None)  # a client gone: its partial body released
        assert limits.counters.read_bytes == 4500
        exchanges[0].respond(200, b"1", content_type=b"text/plain")  # /2 is taken, then /3
        await _turns()
        assert limits.counters.read_bytes == 1500 and ta.reading
        exchanges[1].respond(200, b"2", content_type=b"text/plain")
        await _turns()
        assert limits.counters.read_bytes == 0
        assert len(exchanges) == 3  # /1, /2, /3: /4 never whole, /5 refused

    asyncio.run(case())


def test_a_request_whose_key_is_refused_has_its_body_read_and_dropped() -> None:
    async def case() -> None:
        seen: list[Request] = []

        def handler(request: Request, exchange: Exchange) -> None:
            seen.append(request)
            exchange.respond(401 if not request.body else 200, b"", content_type=b"text/plain")

        limits = HttpLimits(
            body_bytes_max=1 << 20,
            connections_max=64,
            keeps_body=lambda headers: headers.get("authorization") == "Bearer good",
        )
        conn = HttpConnection(handler, limits, TurnWrites())
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        big = b"x" * 500_000
        conn.data_received(_post(b"/v1/completions", big, b"expect: 100-continue\r\n")[:300_000])
        await _turns()
        assert b"100 Continue" not in bytes(transport.out)  # no key: not asked for its body
        assert limits.counters.read_bytes == 0  # read and dropped as it comes
        conn.data_received(_post(b"/v1/completions", big, b"expect: 100-continue\r\n")[300_000:])
        conn.data_received(
            _post(b"/v1/completions", b"{}", b"authorization: Bearer good\r\n")
        )  # the connection is in step: the next request is read whole
        await _turns()
        assert [len(r.body) for r in seen] == [0, 2]
        assert _statuses(bytes(transport.out)) == [401, 200]
        assert limits.counters.bodies_dropped == 1 and not transport.closing

    asyncio.run(case())


def test_a_head_padded_with_blanks_is_refused_at_the_bound_as_it_arrives() -> None:
    """Blanks around values and line ends reach no callback: a 3.9 MiB head of padded
    lines (a few bytes of names and values) was answered 200.  The bytes of reads that
    fall wholly inside a head count whole: refused 431 before 64 KiB and two reads."""

    async def case() -> None:
        conn, transport, handler = _connection()
        line = b"a:" + b" " * 4000 + b"b   \r\n"
        head = b"GET /h HTTP/1.1\r\nhost: x\r\n" + line * 1000 + b"\r\n"  # ~4 MB
        fed = 0
        for at in range(0, len(head), 16384):
            conn.data_received(head[at : at + 16384])
            fed = at + 16384
            if transport.closing:
                break
        await _turns()
        out = bytes(transport.out)
        assert _statuses(out) == [431], out[:200]
        assert fed <= 64 * 1024 + 2 * 16384 and not handler.seen
        # An ordinary head of the same lines, under the bound, in as many reads: served.
        conn, transport, handler = _connection()
        small = b"GET /h HTTP/1.1\r\nhost: x\r\n" + (b"a:" + b" " * 40 + b"b\r\n") * 1000 + b"\r\n"
        for at in range(0, len(small), 1000):
            conn.data_received(small[at : at + 1000])
        await _turns()
        assert _statuses(bytes(transport.out)) == [200] and len(handler.seen) == 1

    asyncio.run(case())


def test_a_request_the_wire_stopped_reading_is_not_closed_as_idle() -> None:
    """Behind an answer longer than http.idle_timeout_s, a request the client sent whole
    but the wire left unread (reading paused: 8 requests waiting, or a body's bound of
    bodies) is no slow client: the connection was closed and every answer lost.  Real
    socket; the client sends the last request's first bytes, then the rest at once."""

    def get(path: bytes) -> bytes:
        return b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path

    def handler(request: Request, exchange: Exchange) -> None:
        if request.path == "/slow":  # longer than idle_timeout_s
            asyncio.get_running_loop().call_later(1.5, exchange.respond, 200, b"slow")
        else:
            exchange.respond(200, b"ok")

    def client(port: int, first: bytes, expected: int) -> int:
        last = get(b"/last")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(first + last[:10])
            time.sleep(0.1)
            sock.sendall(last[10:])
            got = b""
            while got.count(b"HTTP/1.1 200") < expected:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        return got.count(b"HTTP/1.1 200")

    async def case() -> None:
        limits = HttpLimits(body_bytes_max=65536, connections_max=8, idle_timeout_s=0.5)
        server = await serve("127.0.0.1", 0, handler, limits)
        port = server.sockets[0].getsockname()[1]
        by_count = get(b"/slow") + get(b"/a") * 8
        by_bytes = get(b"/slow") + b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 65536\r\n\r\n"
        by_bytes += b"y" * 65536
        assert await asyncio.to_thread(client, port, by_count, 10) == 10
        assert await asyncio.to_thread(client, port, by_bytes, 3) == 3
        assert limits.counters.idle_closed == 0
        server.close()

    asyncio.run(case())


def test_nothing_is_answered_after_the_clients_last_request() -> None:
    """Bytes after a request with Connection: close are not read as requests: malformed,
    they got a 400 written after the last answer, which had said the connection closes."""

    async def case() -> None:
        conn, transport, handler = _connection()
        conn.data_received(
            b"GET /a HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\nNOT HTTP\r\n\r\n"
        )
        await _turns()
        assert _statuses(bytes(transport.out)) == [200] and transport.closing
        assert [r.path for r in handler.seen] == ["/a"]

    asyncio.run(case())


_DUP_FAILS = r"""
import asyncio, os, resource, socket, ssl, sys
from gossipd.http.exchange import HttpLimits
from gossipd.http.server import serve

async def main(cert, key):
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    limits = HttpLimits(body_bytes_max=1 << 20, connections_max=4, idle_timeout_s=1.0)
    handler = lambda request, exchange: exchange.respond(200, b"ok")
    server = await serve("127.0.0.1", 0, handler, limits, tls=tls)
    port = server.sockets[0].getsockname()[1]
    before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.close(held.pop())  # one left: the accept takes it, the dup finds none
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        await asyncio.sleep(0.3)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await asyncio.sleep(0.3)
        client.close()
    await asyncio.sleep(0.3)
    print(limits.counters.open_now, limits.counters.tls_failed,
          len(os.listdir("/proc/self/fd")) - before)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_tls_connection_that_cannot_be_handed_over_gives_its_place_back(tmp_path: Path) -> None:
    """Out of descriptors, the accepted socket could not be duplicated for the TLS: the
    error left connection_made with the connection counted and its socket open, a place
    of http.connections_max and a descriptor lost for good each time.  In a child process
    (its descriptor limit is lowered to what it holds)."""
    import subprocess
    import sys

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _DUP_FAILS, str(cert), str(key)],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    open_now, failed, fds_kept = map(int, done.stdout.split())
    assert open_now == 0 and failed == 3 and fds_kept == 0, done.stdout


def test_open_streams_are_counted_until_they_end_are_given_up_or_lose_their_client() -> None:
    async def case() -> None:
        exchanges: list[Exchange] = []

        def handler(request: Request, exchange: Exchange) -> None:
            exchanges.append(exchange)
            exchange.start_stream()
            exchange.write(b"data: x\n\n")

        limits = HttpLimits(body_bytes_max=1 << 20, connections_max=64)
        counters = limits.counters
        conns = []
        for _ in range(3):
            conn = HttpConnection(handler, limits, TurnWrites())
            conn.connection_made(FakeTransport(conn))
            conn.data_received(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
            conns.append(conn)
        assert counters.streams_open == 3
        exchanges[0].end_stream()
        exchanges[0].end_stream()  # (once)
        assert counters.streams_open == 2
        exchanges[1].abort()
        conns[1].connection_lost(None)
        assert counters.streams_open == 1
        conns[2].connection_lost(None)  # its client gone mid-stream
        assert counters.streams_open == 0
        conns[0].data_received(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")  # the next on conn 0
        await _turns()
        assert counters.streams_open == 1

    asyncio.run(case())


def test_a_refusal_in_the_middle_of_an_upload_reaches_the_client_whole() -> None:
    """The 413 came after body_bytes_max, while the client still sent, and the connection
    closed at once with its bytes unread: the kernel answered with a reset, and a client
    that writes its whole body before it reads (httpx, the openai package) saw
    ECONNRESET, not the 413.  Now the rest is read and dropped until the client closes.
    And a Content-Length over the bound is refused at the head, before any 100 Continue."""
    limit = 1 << 20

    def upload(port: int, head: bytes, body_bytes: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            sent = 0
            piece = b"x" * 65536
            while sent < body_bytes:
                sock.sendall(piece)
                sent += len(piece)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        return got

    def ask_first(port: int, head: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            got = b""
            while chunk := sock.recv(65536):  # (refused at the head: closed after it)
                got += chunk
        return got

    async def case() -> None:
        handler = Handler()
        limits = HttpLimits(body_bytes_max=limit, connections_max=8)
        server = await serve("127.0.0.1", 0, handler, limits)
        port = server.sockets[0].getsockname()[1]
        size = 5 * limit
        # Chunked: no length to refuse at the head; refused at the bound, mid-upload.
        chunked = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % size
        )
        for _ in range(3):
            got = await asyncio.to_thread(upload, port, chunked, size)
            assert got.startswith(b"HTTP/1.1 413 "), got[:200]
            assert b"http.body_bytes_max" in got
        sized = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % size
        got = await asyncio.to_thread(upload, port, sized + b"\r\n", size)
        assert got.startswith(b"HTTP/1.1 413 "), got[:200]
        got = await asyncio.to_thread(ask_first, port, sized + b"expect: 100-continue\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 413 ") and b" 100 " not in got, got[:200]
        assert not handler.seen and limits.counters.read_bytes == 0
        server.close()

    asyncio.run(case())
