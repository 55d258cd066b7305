"""One TCP connection of the loop peer channel (looppeer.py): the asyncio protocol that
feeds a ``ZmtpConnection`` (zmtp.py) what the socket reads, writes what it has to say, ends
a handshake that takes longer than 5 s, and closes the connection when the peer breaks the
protocol, telling its owner (the server or client) by callbacks.  Also the ``tcp://``
endpoint parsing both sides share."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable
from typing import cast

from gossipd.busypoll import ignore_read
from gossipd.ops import tcpdefaults
from gossipd.ops.logs import RateLimiter
from gossipd.zmtp import ZmtpConnection, ZmtpError

log = logging.getLogger("gossipd.looppeer")

HANDSHAKE_TIMEOUT_S = 5.0  # a connection still shaking hands after this is closed
WRITE_BYTES_MAX = 64 * 1024 * 1024  # a connection's unsent bytes before sends are refused
PONG_UNSENT_MAX = 64 * 1024  # a PING is not answered while more than this waits unsent
# A server's connection holding part of a frame and sending no byte more for this long is
# closed ("stalled"): its bytes would hold the read budget for ever (a slowloris).
PARTIAL_FRAME_IDLE_S = 30.0


def parse_endpoint(addr: str) -> tuple[str, int]:
    """``tcp://host:port`` (host ``*`` for every address, ``[v6]`` bracketed) -> (host, port)."""
    if not addr.startswith("tcp://"):
        raise ValueError(f"{addr!r}: the peer channel speaks tcp:// only")
    host, sep, port = addr[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{addr!r}: expected tcp://HOST:PORT")
    host = host.strip("[]")
    return ("0.0.0.0" if host == "*" else host), int(port)


def format_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ReadBudget:
    """The bytes of frames not complete yet that all of a server's connections hold
    together: each may hold up to a frame's bound, and without this, connections times
    that bound (4 MiB) was memory anyone who could connect could take.  Past it, the
    connection that holds the most of it is closed (of ``links()``; the one whose read went
    over on a tie, or without ``links``): a client that parks frames one byte short of
    their end loses its own connections, not the others'."""

    __slots__ = ("bytes_max", "held", "links", "over")

    def __init__(
        self, bytes_max: int, links: Callable[[], Iterable[PeerLink]] | None = None
    ) -> None:
        self.bytes_max = bytes_max
        self.links = links
        self.held = 0
        self.over = 0  # connections closed for going over it

    def holder_to_close(self, reader: PeerLink) -> PeerLink:
        """The connection that holds the most (``reader``, whose read went over, on a tie)."""
        links = self.links
        if links is None:
            return reader
        most = max(links(), key=lambda link: link.held_bytes, default=reader)
        return reader if reader.held_bytes >= most.held_bytes else most


class PeerLink(asyncio.Protocol):
    """One TCP connection and its ZMTP state; the owner's callbacks see its messages."""

    def __init__(
        self,
        zmtp: ZmtpConnection,
        on_messages: Callable[[PeerLink, list[list[bytes]]], None],
        on_ready: Callable[[PeerLink], None],
        on_lost: Callable[[PeerLink, str], None],
        budget: ReadBudget | None = None,
        on_made: Callable[[PeerLink], bool] | None = None,
        fail_log: RateLimiter | None = None,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        """``on_made``: asked once the peer's address is known (``peer``); False refuses
        the connection ("busy").  ``fail_log``: the bound on "closed a peer connection"
        lines, shared by the owner's connections (anyone who can connect can fail one).
        ``on_read``: told of every read (busy-polling: gossipd/busypoll.py)."""
        self._on_read = on_read or ignore_read
        self.zmtp = zmtp
        self._fail_log = fail_log
        self._on_made = on_made
        self._budget = budget
        self._held = 0  # of the budget: this connection's bytes of unfinished frames
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.identity = b""  # a server's name for this connection
        self._on_messages = on_messages
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._timer: asyncio.TimerHandle | None = None
        self._eof_sent = False  # shut_write(): nothing more may be written
        self._stall: asyncio.TimerHandle | None = None  # a server's partial frame's clock
        self.closed = False

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # a stream's (uvloop's is no subclass)
        if self.closed:  # closed while it connected (or refused at accept): nothing goes
            transport.abort()
            return
        self.transport = transport
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._on_made is not None and not self._on_made(self):
            # Too many from its host shaking hands: closed quietly and counted "busy", as a
            # refusal at accept is (one host's flood must not flood the log).
            transport.abort()
            self._lost("busy")
            return
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tcpdefaults.keep_alive(sock)  # a peer gone, or cut off, is not held for ever
        transport.write(self.zmtp.data_to_send())
        self._timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._handshake_late
        )

    def _handshake_late(self) -> None:
        if not self.zmtp.ready:
            self.fail("handshake_timeout", "no handshake within 5 s")

    def data_received(self, data: bytes) -> None:
        self._on_read()
        if self.closed:
            return
        zmtp = self.zmtp
        was_ready = zmtp.ready
        try:
            messages = zmtp.receive(data)
        except ZmtpError as exc:
            self.fail(exc.reason, str(exc))
            return
        except Exception as exc:  # ours (an authorize that failed): this connection only
            log.exception("a peer connection's bytes could not be handled")
            self.fail("internal", f"{type(exc).__name__}: {exc}")
            return
        if not was_ready:
            out = zmtp.data_to_send()
            if out and self.transport is not None:
                self.transport.write(out)
            if zmtp.ready:
                if self._timer is not None:
                    self._timer.cancel()
                self._on_ready(self)
        elif zmtp.has_data_to_send:  # a PONG to a PING
            assert self.transport is not None
            pong = zmtp.data_to_send()
            # Not to a peer that reads nothing: PINGs sent one a segment would have our
            # unsent bytes grow without bound (replies have their own bound: looppeer.py);
            # nor after our FIN (shut_write), where a write raises.
            if not self._eof_sent and self.transport.get_write_buffer_size() <= PONG_UNSENT_MAX:
                self.transport.write(pong)
        if messages:
            self._on_messages(self, messages)
        budget = self._budget
        # (a connection still shaking hands holds at most 4 KiB, and 256 such at once: not
        # counted, so that strangers cannot spend the members' budget)
        if budget is not None and not self.closed and zmtp.ready:
            held = zmtp.buffered
            budget.held += held - self._held
            self._held = held
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            if held:  # (bytes came: the frame's clock starts again)
                self._stall = asyncio.get_running_loop().call_later(
                    PARTIAL_FRAME_IDLE_S, self._stalled
                )
            if budget.held > budget.bytes_max:
                budget.over += 1
                holder = budget.holder_to_close(self)
                holder.fail("busy", f"peer connections hold over {budget.bytes_max} bytes of "
                            f"frames not complete yet; this one {holder.held_bytes}")  # fmt: skip

    def _stalled(self) -> None:
        self._stall = None
        self.fail("stalled", f"{self._held} bytes of a frame and no byte more for "
                  f"{PARTIAL_FRAME_IDLE_S:g} s")  # fmt: skip

    @property
    def held_bytes(self) -> int:
        """Of the read budget: this connection's bytes of frames not complete yet."""
        return self._held

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def pause(self) -> None:
        """Read nothing more until ``resume``: the peer's bytes wait in the kernel's buffers
        and then in its own (TCP's flow control)."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def shut_write(self) -> None:
        """Send our FIN and read on: the peer (libzmq) takes the end of the stream for a
        dropped connection and sends nothing more, and what it sent before still arrives."""
        transport = self.transport
        if transport is None or self.closed or self._eof_sent or not transport.can_write_eof():
            return
        self._eof_sent = True
        transport.write_eof()

    def unsent(self) -> int:
        return 0 if self.transport is None else self.transport.get_write_buffer_size()

    def fail(self, reason: str, message: str) -> None:
        """The peer broke the protocol (or was refused): say what it is owed, then close."""
        if self.transport is not None and not self.closed:
            out = self.zmtp.data_to_send()  # an ERROR for a refused client
            if out and not self._eof_sent:
                self.transport.write(out)
            limit = self._fail_log
            if limit is None or limit.allow():
                suppressed = 0 if limit is None else limit.take_suppressed()
                log.warning(
                    "closed a peer connection", extra={"peer": self.peer, "reason": reason,
                                                       "detail": message,
                                                       "suppressed_since_last": suppressed}
                )  # fmt: skip
            self.transport.close()
        self._lost(reason)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._lost("closed")

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost("lost")

    def _lost(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._stall is not None:
            self._stall.cancel()
        if self._budget is not None:
            self._budget.held -= self._held
            self._held = 0
        self._on_lost(self, reason)
