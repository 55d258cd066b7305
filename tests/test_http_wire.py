"""The HTTP door's wire alone (gossipd/http/server.py on a real loopback socket, a small
handler instead of the door): upgrades, `Expect: 100-continue`, clients that do not read,
bodies in tiny chunks.  Each case came from an audit of the door (a second response after an
upgrade, a 100 Continue inside another response's chunks, a silent client keeping its place
for ever, a chunked body taking 28 times its bytes)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from typing import Any

from gossipd.clock import ManualClock
from gossipd.http.exchange import DateField, Exchange, HttpLimits, Request
from gossipd.http.keys import ApiKeys
from gossipd.http.openai_api import BadRequest, decode_call
from gossipd.http.server import serve

BIG = 8 * 1024 * 1024  # an answer no socket buffer takes whole


class Handler:
    """/big: an answer of BIG bytes; /slow: the same 0.1 s later; /stream: a stream left
    open until ``end_streams``; anything else: one answer naming the path and the body's
    length."""

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.streams: list[Exchange] = []

    def __call__(self, request: Request, exchange: Exchange) -> None:
        self.seen.append(request)
        if request.path == "/big":
            exchange.respond(200, b"x" * BIG, content_type=b"text/plain")
        elif request.path == "/slow":
            asyncio.get_running_loop().call_later(
                0.1, lambda: exchange.respond(200, b"x" * BIG, content_type=b"text/plain")
            )
        elif request.path == "/stream":
            exchange.start_stream()
            exchange.write(b"data: one\n\n")
            self.streams.append(exchange)
        else:
            answer = b"%s %d" % (request.path.encode(), len(request.body))
            exchange.respond(200, answer, content_type=b"text/plain")

    def end_streams(self) -> None:
        for exchange in self.streams:
            exchange.write(b"data: two\n\n")
            exchange.end_stream()


def _on_a_loop(case: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """An async test run on a fresh event loop (no async plugin here)."""

    def test() -> None:
        asyncio.run(case())

    test.__name__ = case.__name__
    return test


@asynccontextmanager
async def _server(limits: HttpLimits) -> AsyncIterator[tuple[int, Handler]]:
    handler = Handler()
    server = await serve("127.0.0.1", 0, handler, limits)
    try:
        yield server.sockets[0].getsockname()[1], handler
    finally:
        server.close()


async def _exchange(port: int, data: bytes, *, until: Callable[[bytes], bool]) -> bytes:
    """Send ``data``, read until ``until(what was read)`` or the connection ends (5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        async with asyncio.timeout(5):
            while not until(got):
                piece = await reader.read(65536)
                if not piece:
                    break
                got += piece
    finally:
        writer.close()
    return got


def _limits(**kw: Any) -> HttpLimits:
    return HttpLimits(**{"body_bytes_max": 1 << 20, "connections_max": 64, **kw})


@_on_a_loop
async def test_an_upgrade_without_a_body_is_ignored_and_what_follows_is_answered() -> None:
    async with _server(_limits()) as (port, handler):
        got = await _exchange(
            port,
            b"GET /a HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
            b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n",
            until=lambda got: got.count(b"HTTP/1.1 ") >= 2 and got.endswith(b"/b 0"),
        )
    # two answers, in order, each its own request's; no third
    assert got.count(b"HTTP/1.1 ") == 2, got
    assert got.index(b"/a 0") < got.index(b"/b 0")
    assert [r.path for r in handler.seen] == ["/a", "/b"]
    # thousands in one read: each answered, none lost (a call per upgrade overflowed)
    n = 4000
    async with _server(_limits()) as (port, handler):
        got = await _exchange(
            port,
            b"GET /u HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: h2c\r\n\r\n" * n,
            until=lambda got: got.count(b"/u 0") >= n,
        )
    assert got.count(b"HTTP/1.1 200 ") == n and len(handler.seen) == n


@_on_a_loop
async def test_an_upgrade_with_a_body_is_refused_alone_and_never_answered_empty() -> None:
    async with _server(_limits()) as (port, handler):
        got = await _exchange(
            port,
            b"POST /a HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\nhello",
            until=lambda got: False,  # to the connection's end
        )
        # no 100 Continue for a body that will not be read; one answer
        assert got.count(b"HTTP/1.1 ") == 1, got
        assert got.startswith(b"HTTP/1.1 400 ") and b"without 'Connection: Upgrade'" in got
        connect = await _exchange(
            port,
            b"CONNECT example.test:443 HTTP/1.1\r\nhost: example.test:443\r\n\r\n"
            b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n",
            until=lambda got: False,
        )
        assert connect.count(b"HTTP/1.1 ") == 1 and connect.startswith(b"HTTP/1.1 400 "), connect
    assert handler.seen == []  # neither handed over (the first with an empty body)


@_on_a_loop
async def test_100_continue_never_lands_inside_another_answer_nor_goes_to_http10() -> None:
    async with _server(_limits()) as (port, handler):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /p HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
        )
        got = b""
        async with asyncio.timeout(5):
            while b"data: one" not in got:
                got += await reader.read(65536)
            await asyncio.sleep(0.05)  # what the pipelined head might have sent
            writer.write(b"abc")
            handler.end_streams()
            while not got.endswith(b"/p 3"):
                got += await reader.read(65536)
        writer.close()
        assert b"100 Continue" not in got, got
        assert got.count(b"HTTP/1.1 200 ") == 2
        http10 = await _exchange(
            port,
            b"POST /q HTTP/1.0\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\nab",
            until=lambda got: got.endswith(b"/q 2"),
        )
        assert http10.startswith(b"HTTP/1.1 200 ") and b"100 Continue" not in http10
        lone = await _exchange(
            port,
            b"POST /r HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n",
            until=lambda got: b"\r\n\r\n" in got,
        )
        assert lone == b"HTTP/1.1 100 Continue\r\n\r\n"  # the usual case still told at once


@_on_a_loop
async def test_clients_that_do_not_read_lose_their_connections_and_their_places() -> None:
    limits = _limits(connections_max=3, idle_timeout_s=0.5)
    async with _server(limits) as (port, _):
        silent = []
        for requests in (
            # a keep-alive answer too large to be taken: idle with unsent bytes
            b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n",
            # the same, closing: a close that never finishes
            b"GET /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            # a request read while the answer before it was being made, which then filled
            # the socket: it waits behind an answer its client never takes
            b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\nGET /h HTTP/1.1\r\nhost: x\r\n\r\n",
        ):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(requests)  # and never read
            silent.append(sock)
        async with asyncio.timeout(10):
            while limits.counters.open_now < 3:
                await asyncio.sleep(0.02)
            while limits.counters.open_now > 0:  # dropped, though the clients never read
                await asyncio.sleep(0.05)
        got = await _exchange(
            port, b"GET /h HTTP/1.1\r\nhost: x\r\n\r\n", until=lambda got: got.endswith(b"/h 0")
        )
        assert got.startswith(b"HTTP/1.1 200 ")
        assert limits.counters.connections_refused == 0
        for sock in silent:
            sock.close()


@_on_a_loop
async def test_a_body_in_tiny_chunks_is_whole_and_costs_about_its_bytes() -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB
    chunked = b"".join(b"2\r\n%s\r\n" % payload[i : i + 2] for i in range(0, len(payload), 2))
    half = len(chunked) // 2
    first, rest = chunked[:half], chunked[half:] + b"0\r\n\r\n"
    held_by_server = [tracemalloc.Filter(True, "*gossipd/http/server.py")]
    async with _server(_limits()) as (port, handler):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        tracemalloc.start()
        try:
            writer.write(first)
            await writer.drain()
            held, before = 0, -1
            async with asyncio.timeout(10):
                # until the server has taken the half: holding some, no longer growing
                while held < len(payload) // 4 or held != before:
                    await asyncio.sleep(0.1)
                    snapshot = tracemalloc.take_snapshot().filter_traces(held_by_server)
                    before, held = held, sum(s.size for s in snapshot.statistics("filename"))
        finally:
            tracemalloc.stop()
        writer.write(rest)
        got = b""
        async with asyncio.timeout(5):
            while not got.endswith(b"/c %d" % len(payload)):
                got += await reader.read(65536)
        writer.close()
    assert handler.seen[0].body == payload
    # about half the body's bytes (a bytearray's slack), not a list of 2-byte pieces
    assert held < len(payload), held


@_on_a_loop
async def test_an_http10_client_that_asks_keep_alive_is_told_it_and_kept() -> None:
    async with _server(_limits()) as (port, handler):
        got = await _exchange(
            port,
            b"GET /a HTTP/1.0\r\nconnection: keep-alive\r\n\r\n"
            b"GET /b HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
            until=lambda got: got.endswith(b"/b 0"),
        )
    assert got.count(b"connection: keep-alive\r\n") == 2, got
    assert [r.path for r in handler.seen] == ["/a", "/b"]


def test_include_usage_must_be_a_boolean() -> None:
    for value in ("false", 0, 1, "true"):
        body = b'{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":%s}}'
        try:
            decode_call(body % repr(value).replace("'", '"').encode(), chat=False)
        except BadRequest as exc:
            assert exc.param == "stream_options.include_usage"
        else:
            raise AssertionError(f"include_usage={value!r} was taken")
    call = decode_call(
        b'{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":null}}',
        chat=False,
    )
    assert call.include_usage is False


def test_a_bad_sampling_field_is_named_as_openai_names_it() -> None:
    for body, param in (
        (b'{"model":"m","prompt":"p","top_k":-2}', "top_k"),
        (b'{"model":"m","prompt":"p","stop":["%s"]}' % (b"x" * 65), "stop"),
        (b'{"model":"m","prompt":"p","stop":["a",""]}', "stop"),
    ):
        try:
            decode_call(body, chat=False)
        except BadRequest as exc:
            assert exc.param == param, (body, exc.param, exc.message)
        else:
            raise AssertionError(f"{body!r} was taken")


def test_a_non_ascii_key_matches_the_bytes_a_client_sends(tmp_path: Any) -> None:
    keys_by_name = {"alice": "sk-clé-0123456789abcdef", "bob": "sk-0123456789abcdef-voilà"}
    for name, key in keys_by_name.items():
        (tmp_path / f"{name}.key").write_text(key + "\r\n", encoding="utf-8")
    keys = ApiKeys(str(tmp_path))
    for name, key in keys_by_name.items():
        on_the_wire = ("Bearer " + key).encode("utf-8").decode("latin-1")  # as the door reads
        assert keys.name_of(on_the_wire) == name
        assert keys.name_of(on_the_wire + " ") == name  # blanks around it trimmed
    assert keys.name_of("Bearer sk-cle-0123456789abcdef") is None


@_on_a_loop
async def test_host_is_required_of_http11_once_and_absolute_targets_are_served() -> None:
    async with _server(_limits()) as (port, handler):
        # RFC 9112 3.2: an HTTP/1.1 request without Host, or with two, is a 400
        for head in (
            b"GET /a HTTP/1.1\r\n",
            b"GET /a HTTP/1.1\r\nhost: x\r\nHost: y\r\n",
            b"GET /a HTTP/1.1\r\nhost: a, b\r\n",  # not a host[:port]
        ):
            got = await _exchange(port, head + b"\r\n", until=lambda got: False)
            assert got.startswith(b"HTTP/1.1 400 ") and b"Host" in got, got
        assert handler.seen == []
        # trailing blanks are not the value's (RFC 9110 5.5); an IPv6 zone, an IPvFuture
        for host in (b"x \t", b"[fe80::1%25eth0]:8", b"[v7.a_b~c]"):
            got = await _exchange(
                port,
                b"GET /h HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % host,
                until=lambda got: False,
            )
            assert got.startswith(b"HTTP/1.1 200 "), (host, got)
        handler.seen.clear()
        # HTTP/1.0 has no Host rule
        old = await _exchange(port, b"GET /b HTTP/1.0\r\n\r\n", until=lambda got: False)
        assert old.startswith(b"HTTP/1.1 200 ") and old.endswith(b"/b 0"), old
        # RFC 9112 3.2.2: an absolute-form target is served by its path and query
        got = await _exchange(
            port,
            b"GET http://x:1/v1/models?q=1 HTTP/1.1\r\nhost: x:1\r\nconnection: close\r\n\r\n",
            until=lambda got: False,
        )
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"/v1/models?q=1 0"), got
    assert [r.path for r in handler.seen] == ["/b", "/v1/models?q=1"]


@_on_a_loop
async def test_a_transfer_coding_other_than_chunked_alone_is_a_501() -> None:
    zipped = b"5\r\n\x1f\x8b\x08\x00\x00\r\n0\r\n\r\n"
    async with _server(_limits()) as (port, handler):
        for codings in (
            b"transfer-encoding: gzip, chunked\r\n",
            # several lines are one list (RFC 9110 5.3): the same request
            b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
        ):
            got = await _exchange(
                port,
                b"POST /z HTTP/1.1\r\nhost: x\r\n" + codings + b"\r\n" + zipped,
                until=lambda got: False,
            )
            assert got.startswith(b"HTTP/1.1 501 ") and b"gzip" in got, got
            assert got.count(b"HTTP/1.1 ") == 1
        assert handler.seen == []  # the gzip bytes were never taken as a body
        # chunked alone, in any case and with blanks, is read as before
        got = await _exchange(
            port,
            b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding:  Chunked \r\n\r\n"
            b"2\r\nab\r\n0\r\n\r\n",
            until=lambda got: got.endswith(b"/c 2"),
        )
        assert got.startswith(b"HTTP/1.1 200 "), got


@_on_a_loop
async def test_an_http10_request_with_transfer_encoding_closes_its_connection() -> None:
    # RFC 9112 6.1: faulty framing; what follows on that connection is not read
    async with _server(_limits()) as (port, handler):
        got = await _exchange(
            port,
            b"POST /c HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\nab\r\n0\r\n\r\nGET /after HTTP/1.0\r\n\r\n",
            until=lambda got: False,  # to the connection's end
        )
    assert got.count(b"HTTP/1.1 ") == 1 and got.endswith(b"/c 2"), got
    assert b"connection: keep-alive" not in got
    assert [r.path for r in handler.seen] == ["/c"]


def _dates(answers: bytes) -> list[float]:
    """The Date field of each answer in ``answers``, as seconds since the epoch."""
    out = []
    for head in re.findall(rb"HTTP/1\.1 \d{3} [^\r]*\r\n(.*?)\r\n\r\n", answers, re.DOTALL):
        lines = head.split(b"\r\n")
        dates = [v for k, _, v in (ln.partition(b": ") for ln in lines) if k.lower() == b"date"]
        assert len(dates) == 1, head  # one, on every answer
        out.append(parsedate_to_datetime(dates[0].decode()).timestamp())
    return out


@_on_a_loop
async def test_every_answer_carries_the_date_as_rfc_9110_asks_of_an_origin_server() -> None:
    before = time.time()
    async with _server(_limits()) as (port, _handler):
        whole = await _exchange(
            port,
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /stream HTTP/1.1\r\nhost: x\r\n\r\n",
            until=lambda got: b"data: one" in got,
        )
        refused = await _exchange(port, b"GET /a HTTP/1.1\r\n\r\n", until=lambda got: False)
    after = time.time()
    assert refused.startswith(b"HTTP/1.1 400 "), refused  # (the wire's own refusal: no Host)
    dates = _dates(whole) + _dates(refused)
    assert len(dates) == 3
    # IMF-fixdate has whole seconds
    assert all(int(before) <= d <= after for d in dates), (before, dates, after)


@_on_a_loop
async def test_the_date_is_read_on_the_clock_the_wire_is_given() -> None:
    clock = ManualClock(wall=784111777.0)  # RFC 9110 5.6.7's example
    async with _server(_limits(date=DateField(clock.wall))) as (port, _handler):
        first = await _exchange(port, b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n", until=_ends)
        clock.advance(0.5)  # the same second: the same field
        same = await _exchange(port, b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n", until=_ends)
        clock.advance(86400.0)
        refused = await _exchange(port, b"GET /a HTTP/1.1\r\n\r\n", until=lambda got: False)
    assert b"\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\n" in first, first
    assert b"\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\n" in same, same
    assert b"\r\ndate: Mon, 07 Nov 1994 08:49:37 GMT\r\n" in refused, refused


def _ends(got: bytes) -> bool:
    return got.endswith(b"/a 0")


def test_the_date_field_is_formed_once_a_second() -> None:
    clock = ManualClock(wall=784111777.0)
    date = DateField(clock.wall)
    first = date.line()
    clock.advance(0.999)
    assert date.line() is first  # the same second: the bytes formed then, not formed again
    clock.advance(0.001)
    assert date.line() == b"date: Sun, 06 Nov 1994 08:49:38 GMT\r\n"
