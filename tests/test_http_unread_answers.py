"""Whole (not streamed) HTTP answers that clients do not read are bounded in bytes over every
connection (http.answers_unsent_bytes_max, docs/PROTOCOL.md "HTTP").  Before the bound, 20
connections that each asked a 52 MB answer (`echo` of an 800 KB prompt, `n` 64) and never
read it held 566 MiB of the daemon's memory for up to twice `http.idle_timeout_s`, and
`http.connections_max` (4,096) of them could hold hundreds of GiB.  Most tests drive
HttpConnection (the real class) with a fake transport that pauses writing past 64 KiB; one
runs through a real daemon's door on real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

from gossipd.http.exchange import Exchange, HttpLimits, Request
from gossipd.http.server import HttpConnection
from gossipd.http.turnwrites import TurnWrites
from simulations.cluster import Cluster
from tests.helpers import running, scrape, wait_until
from tests.test_http_door import _read_response
from tests.test_http_wire_refusals import FakeTransport

MIB = 1 << 20


def _answer(request: Request, exchange: Exchange) -> None:
    """/big: 1 MiB; anything else: its path."""
    body = b"x" * MIB if request.path == "/big" else request.path.encode()
    exchange.respond(200, body, content_type=b"text/plain")


def _client(limits: HttpLimits) -> tuple[HttpConnection, FakeTransport]:
    conn = HttpConnection(_answer, limits, TurnWrites())
    transport = FakeTransport(conn)
    conn.connection_made(transport)
    return conn, transport


def _get(conn: HttpConnection, path: bytes) -> None:
    conn.data_received(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path)


def test_an_unread_answer_past_the_bound_over_every_connection_is_given_up() -> None:
    async def case() -> None:
        limits = HttpLimits(body_bytes_max=MIB, connections_max=64)
        limits.answers_unsent_bytes_max = MIB + MIB // 2
        counters = limits.counters
        a, ta = _client(limits)
        _get(a, b"/big")  # not read: held, and alone, so kept
        assert ta.paused and counters.answers_unsent == ta.buffered > MIB
        b, tb = _client(limits)
        _get(b, b"/big")  # would take the unread answers to 2 MiB: given up
        assert tb.aborted and counters.answers_dropped == 1
        assert counters.answers_unsent == ta.buffered  # b's bytes are not counted
        c, tc = _client(limits)
        _get(c, b"/small")  # a small answer leaves at once, paused or not
        assert not tc.aborted and tc.out.endswith(b"/small") and not tc.paused
        assert counters.answers_unsent == ta.buffered
        ta.drain()  # a's client reads: nothing waits any more
        assert counters.answers_unsent == 0
        _get(b := _client(limits)[0], b"/big")  # there is room again
        assert not b.transport.aborted  # type: ignore[union-attr]
        assert counters.answers_dropped == 1 and counters.answers_unsent > MIB

    asyncio.run(case())


def test_a_lone_answer_larger_than_the_bound_goes_and_a_lost_client_gives_its_bytes_back() -> None:
    async def case() -> None:
        limits = HttpLimits(body_bytes_max=MIB, connections_max=64)
        limits.answers_unsent_bytes_max = 65536
        counters = limits.counters
        a, ta = _client(limits)
        _get(a, b"/big")  # 16 times the bound, but nothing else waits
        assert not ta.aborted and counters.answers_unsent == ta.buffered
        _get(a, b"/big")  # a second one on the same connection waits its turn (paused)
        await asyncio.sleep(0)
        assert counters.answers_unsent == ta.buffered and counters.answers_dropped == 0
        a.connection_lost(None)  # its client gone: its bytes are no longer held
        assert counters.answers_unsent == 0
        b, tb = _client(limits)
        _get(b, b"/big")
        assert not tb.aborted and counters.answers_unsent == tb.buffered
        b.abort()  # closed by the daemon: the same
        assert counters.answers_unsent == 0

    asyncio.run(case())


def test_a_client_that_reads_a_large_answer_slowly_gets_it_whole() -> None:
    """A client reading slower than the answer (a 52 MB answer over 10 Mbit/s takes 42 s)
    leaves the transport's buffer above its low-water mark for http.idle_timeout_s: the
    connection was aborted as idle, or at the end of its close's linger, and the answer cut.
    Now it stays while the client takes bytes; one that takes none is dropped as before."""

    async def case() -> None:
        limits = HttpLimits(body_bytes_max=MIB, connections_max=64, idle_timeout_s=0.3)
        slow, ts = _client(limits)  # keep-alive: its idle deadline
        _get(slow, b"/big")
        closing, tc = _client(limits)  # Connection: close: its linger
        closing.data_received(b"GET /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        silent, tq = _client(limits)
        _get(silent, b"/big")
        assert ts.paused and tc.paused and tq.paused and tc.closing
        for _ in range(12):  # 1.2 s, 4 idle timeouts: 64 KiB taken every 0.1 s
            await asyncio.sleep(0.1)
            ts.buffered -= 65536
            tc.buffered -= 65536
        assert tq.aborted  # took nothing: dropped
        assert not ts.aborted and not tc.aborted
        ts.drain()
        tc.drain()
        assert ts.out.count(b"x" * 1024) == tc.out.count(b"x" * 1024) == 1024
        _get(slow, b"/small")  # still served
        assert ts.out.endswith(b"/small")

    asyncio.run(case())


def test_clients_that_do_not_read_big_answers_hold_at_most_the_bound() -> None:
    """A real daemon, echo engine: three connections ask an `echo` of a 700 KB prompt with
    `n` 8 (a 5.6 MB answer, more than the kernel's socket buffers take) and read nothing.
    With the bound at its least (64 KiB) the first is kept, the others given up; the first
    then reads its whole answer."""
    cluster = Cluster(
        1,
        extra_overrides=['http.bind="127.0.0.1:0"', "http.answers_unsent_bytes_max=65536"],
    )
    with running(cluster):
        url = cluster.daemons[0].http_url
        port = int(url.rsplit(":", 1)[1])
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps(
            {"model": model, "prompt": "ab " * 240_000, "echo": True, "n": 8, "max_tokens": 1}
        ).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        socks = []
        try:
            for _ in range(3):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                sock.sendall(request)
                socks.append(sock)

            def metric(name: str) -> float:
                return scrape(port).get(name, 0.0)

            dropped = "gossipd_http_answers_dropped_total"
            wait_until(lambda: metric(dropped) == 2, 60, "two answers given up")
            assert metric("gossipd_http_answers_unsent_bytes") > 65536
            kept = _read_response(socks[0].makefile("rb"))  # (cut short: no JSON)
            assert len(json.loads(kept)["choices"]) == 8
            wait_until(lambda: metric("gossipd_http_answers_unsent_bytes") == 0, 10, "nothing held")
            for sock in socks[1:]:  # closed by the daemon, their answers cut short
                sock.settimeout(10)
                while sock.recv(1 << 20):
                    pass
        finally:
            for sock in socks:
                sock.close()
