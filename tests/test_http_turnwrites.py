"""Answers of one loop turn written at its end under load, at once when it is light
(gossipd/http/turnwrites.py).  The transport here only records what the connection hands it
and when: when a write leaves within a turn is what is tested, which a socket cannot show.
Over real sockets the door's tests (test_http_door.py, test_openai_client.py) run through
the same path."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.http.exchange import Exchange, HttpLimits, Request
from gossipd.http.server import HttpConnection
from gossipd.http.turnwrites import TurnWrites

Log = list[tuple[str, int, bytes]]


class RecordingTransport:
    def __init__(self, log: Log, name: int) -> None:
        self.log = log
        self.name = name
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        # (recorded, not raised: a raise inside a loop callback would only be logged)
        self.log.append(("late write" if self.closed else "write", self.name, data))

    def get_write_buffer_size(self) -> int:
        return 7  # what the kernel has not taken yet

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", self.name, b""))

    def abort(self) -> None:
        self.aborted = self.closed = True
        self.log.append(("abort", self.name, b""))

    def can_write_eof(self) -> bool:
        return False  # (as TLS's: a refusal closes; its linger is test_http_wire_refusals's)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _request(path: str, keep_alive: bool = True) -> bytes:
    close = b"" if keep_alive else b"connection: close\r\n"
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path.encode(), close)


def _answer(request: Request, exchange: Exchange) -> None:
    """/s/N: a stream of N pieces; /a: abort; anything else: one answer naming its path."""
    if request.path.startswith("/s/"):
        exchange.start_stream()
        for i in range(int(request.path[3:])):
            exchange.write(b"piece%d" % i)
        exchange.end_stream()
    elif request.path == "/a":
        exchange.abort()
    else:
        exchange.respond(200, request.path.encode(), content_type=b"text/plain")


def _connections(n: int, writes: TurnWrites, log: Log) -> list[HttpConnection]:
    conns = []
    for i in range(n):
        conn = HttpConnection(_answer, HttpLimits(body_bytes_max=1024, connections_max=100), writes)
        conn.connection_made(RecordingTransport(log, i))  # type: ignore[arg-type]
        conns.append(conn)
    return conns


def _writes_of(log: Log, name: int) -> bytes:
    return b"".join(data for kind, who, data in log if kind == "write" and who == name)


def test_a_lone_answer_leaves_at_once_and_a_busy_turns_answers_at_its_end() -> None:
    async def main() -> None:
        log: Log = []
        writes = TurnWrites()
        a, b, c = _connections(3, writes, log)
        # a quiet start: the turn's first answer is written inside data_received
        a.data_received(_request("/one"))
        assert _writes_of(log, 0).endswith(b"/one")
        b.data_received(_request("/two"))  # the same turn: held
        assert _writes_of(log, 1) == b""
        await asyncio.sleep(0)  # the turn ends
        assert _writes_of(log, 1).endswith(b"/two")
        assert writes._holding == [] and b._held is None  # nothing kept past the turn
        # the last turn wrote two: this turn's first answer waits for its end too
        c.data_received(_request("/three"))
        assert _writes_of(log, 2) == b""
        await asyncio.sleep(0)
        assert _writes_of(log, 2).endswith(b"/three")
        # the last turn wrote one: light load again, at once
        log.clear()
        a.data_received(_request("/four"))
        assert _writes_of(log, 0).endswith(b"/four")

    asyncio.run(main())


def test_a_closing_connection_writes_what_it_holds_first_and_an_abort_drops_it() -> None:
    async def main() -> None:
        log: Log = []
        a, b, c = _connections(3, TurnWrites(), log)
        a.data_received(_request("/first"))  # at once; the turn is now busy
        b.data_received(_request("/last", keep_alive=False))
        assert log[-2:] == [("write", 1, log[-2][2]), ("close", 1, b"")]
        assert log[-2][2].endswith(b"/last")
        c.data_received(_request("/s/2"))  # held: head, pieces, end
        c.data_received(_request("/a"))  # the next request gives up on the client at once
        assert c._held is None
        await asyncio.sleep(0)
        assert _writes_of(log, 2) == b""  # what was held is dropped, as a transport's buffer
        assert log[-1] == ("abort", 2, b"")
        assert not [e for e in log if e[0] == "late write"]

    asyncio.run(main())


def test_a_bad_request_behind_a_held_answer_gets_its_error_after_it() -> None:
    async def main() -> None:
        log: Log = []
        a, b = _connections(2, TurnWrites(), log)
        a.data_received(_request("/first"))  # at once; the turn is now busy
        b.data_received(_request("/held"))
        b.data_received(b"NOT HTTP\r\n\r\n")  # answered 400 and closed, in order
        got = _writes_of(log, 1)
        assert got.index(b"/held") < got.index(b"HTTP/1.1 400")
        assert log[-1] == ("close", 1, b"")
        await asyncio.sleep(0)
        assert not [e for e in log if e[0] == "late write"]

    asyncio.run(main())


def test_a_stream_piece_reports_the_bytes_held_and_buffered() -> None:
    async def main() -> None:
        log: Log = []
        (a,) = _connections(1, TurnWrites(), log)
        seen: list[int] = []

        def stream(request: Request, exchange: Exchange) -> None:
            exchange.start_stream()
            seen.append(exchange.write(b"x" * 10))  # held behind the head: 10 + framing + 7
            exchange.end_stream()

        a._handler = stream
        a.data_received(_request("/warm"))  # the head leaves at once (a quiet turn)
        assert seen == [len(b"a\r\n" + b"x" * 10 + b"\r\n") + 7]

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["/p", "/q", "/s/0", "/s/3"]))),
        min_size=1,
        max_size=6,
    )
)
def test_every_connection_gets_its_answers_whole_and_in_order(turns: list[Any]) -> None:
    """Turns of requests to 4 connections (one callback a turn): after the last turn, each
    connection's bytes are its answers in the order asked, whatever was held or not."""

    async def main() -> None:
        log: Log = []
        conns = _connections(4, TurnWrites(), log)
        asked: dict[int, list[str]] = {i: [] for i in range(4)}

        def one_turn(requests: list[tuple[int, str]]) -> None:
            for i, path in requests:
                conns[i].data_received(_request(path))
                asked[i].append(path)

        for requests in turns:
            asyncio.get_running_loop().call_soon(one_turn, requests)
            for _ in range(3):  # the turn, its end, and pipelined requests taken after it
                await asyncio.sleep(0)
        for _ in range(40):
            await asyncio.sleep(0)
        for i in range(4):
            got = _writes_of(log, i)
            expected = b""
            for path in asked[i]:
                other = HttpConnection(
                    _answer, HttpLimits(body_bytes_max=1024, connections_max=100)
                )
                alone: Log = []
                other.connection_made(RecordingTransport(alone, 0))  # type: ignore[arg-type]
                other.data_received(_request(path))
                await asyncio.sleep(0)
                expected += _writes_of(alone, 0)
            assert got == expected

    asyncio.run(main())
