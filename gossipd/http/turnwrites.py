"""The HTTP door's answers of one loop turn written together at its end.

Each write to a client's socket wakes the client.  Under load, written at the turn's end, a
turn's answers reach the clients together: a client wakes once for several and sends its
next requests together, so the loop's turns carry more requests (5-9% more requests a
second at 16 and 64 connections here, p99 7-17% lower, the daemons' CPU a request the same:
bench/README, "Answers at the turn's end").  When the previous turn made one write at most
(light load), a turn's first write leaves at once, as ZeroMQ replies do
(``replysender.TurnBatching``): a lone answer does not wait for the rest of its turn.  Writes are
counted, not answers: a stream's head, each piece and its end are one each, so a lone
stream's pieces often wait for their turn's end (the loop's next pass: microseconds).

A connection's bytes stay in order: once a turn holds any answer, every later write of that
turn waits too (the turn's first one left at once only when nothing was waiting anywhere),
and a connection that closes writes what it holds first.
"""

from __future__ import annotations

import logging
from typing import Protocol

from gossipd.replysender import TurnBatching

log = logging.getLogger("gossipd.http")


class Writer(Protocol):
    """What TurnWrites needs of a connection (gossipd/http/server.py's HttpConnection)."""

    def write_now(self, data: bytes) -> None: ...
    def hold(self, data: bytes) -> bool: ...
    def write_held(self) -> None: ...


class TurnWrites:
    """One per HTTP server: its connections' writes of one loop turn."""

    __slots__ = ("_batching", "_holding")

    def __init__(self) -> None:
        self._holding: list[Writer] = []  # connections holding bytes for the turn's end
        self._batching = TurnBatching(self._end_turn)

    def write(self, conn: Writer, data: bytes) -> None:
        if self._batching.send_now():
            conn.write_now(data)
        elif conn.hold(data):  # its first held bytes of this turn
            self._holding.append(conn)

    def _end_turn(self) -> None:
        holding, self._holding = self._holding, []
        for conn in holding:
            try:
                conn.write_held()
            except Exception:  # one connection's failure leaves the others' answers going
                log.exception("writing a held HTTP answer failed")
