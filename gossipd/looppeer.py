"""The peer channel on the event loop: ``LoopPeerClient`` / ``LoopPeerServer``, the
``PeerClient`` / ``PeerServer`` contract (gossipd/peerchannel.py) over asyncio TCP
connections that speak ZMTP 3.0 (gossipd/zmtp.py), NULL or CURVE as the daemon's security
says.  ``fanout.peer_transport = "loop"`` (the default) picks these; ``"zmq"`` the libzmq
DEALER/ROUTER pair.

The wire is libzmq's, so either side may be a libzmq socket (a daemon of an older release
still forwards to this one).  What differs is where the bytes move: here the loop's own
thread writes a frame to the socket in the call that sends it and reads replies in the
callback that sees them, with no I/O thread to wake on either side.

Bounds, as the ZeroMQ pair's: a client holds at most ``queue_max`` frames (and
``queue_bytes_max`` bytes) for a connection not yet up; a connection's unsent bytes past
``write_bytes_max`` make ``send`` refuse (counted in ``dropped``), which is what a full
SNDHWM does; a frame larger than ``message_bytes_max`` ends the connection that sent it, as
MAXMSGSIZE does.  A client reconnects after ``reconnect_s``, doubling to
``reconnect_max_s``; frames queued meanwhile wait for the new connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections import Counter, deque
from collections.abc import Callable

from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.ops import tcpdefaults
from gossipd.ops.logs import RateLimiter, handler_name, note_handler_failure
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG
from gossipd.peerchannel import OnReplies, OnRequest
from gossipd.peerlink import (
    WRITE_BYTES_MAX,
    PeerLink,
    ReadBudget,
    format_endpoint,
    parse_endpoint,
)
from gossipd.zmtp import CurveKeys, PeerCurve, ZmtpConnection

log = logging.getLogger("gossipd.looppeer")

# Connections a server lets shake hands at once; more are closed at accept (counted "busy")
# and their clients retry: an unauthenticated flood costs the loop this many handshakes.
HANDSHAKES_MAX = 256
# Of them, from one host (one IPv4 address, one IPv6 /64): a single stranger's flood leaves
# the rest to the members' new connections (a host runs a daemon per GPU, each needing one).
HANDSHAKES_PER_HOST_MAX = 32


# A server's connections hold at most this many frames' bound of unfinished frames together
# (16 x fanout.message_bytes_max: 64 MiB at its default); the connection that goes over is
# closed ("busy"), and its sender reconnects and sends again.
READ_FRAMES_MAX = 16


class LoopPeerServer:
    """``PeerServer`` on the loop: a listening socket; each connection gets an identity (5
    bytes, as libzmq's ROUTER makes them), and ``sender`` is "NODE KEY", its CURVE key and
    the node it belongs to ("" without CURVE).

    A ROUTER to DEALER clients by default; ``socket_type=b"PULL"``, ``peer_types=(b"PUSH",)``
    makes it the receiving end of PUSH sockets (gossip's datagrams: gossipd/datagrams.py),
    which never sends."""

    def __init__(
        self,
        *,
        message_bytes_max: int,
        curve: PeerCurve | None = None,
        write_bytes_max: int = WRITE_BYTES_MAX,
        read_bytes_max: int = 0,
        refused_lines_per_s: float = 5.0,
        socket_type: bytes = b"ROUTER",
        peer_types: tuple[bytes, ...] = (b"DEALER", b"ROUTER"),
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self._on_read = on_read  # told of every read (busy-polling: gossipd/busypoll.py)
        self._socket_type, self._peer_types = socket_type, peer_types
        self._message_bytes_max = message_bytes_max
        self._fail_log = RateLimiter(refused_lines_per_s)  # (log.refused_lines_per_s)
        self._curve = curve
        self._keys = None if curve is None else CurveKeys(curve.public, curve.secret)
        self._write_bytes_max = write_bytes_max
        # Partial frames held by all connections together: a few frames' worth.
        self.read_budget = ReadBudget(
            read_bytes_max or READ_FRAMES_MAX * message_bytes_max, lambda: self._links.values()
        )
        self._sock: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._links: dict[bytes, PeerLink] = {}
        # Accepted, handshake not done -> its host (None until its address is known), and
        # how many each host has shaking hands.
        self._shaking: dict[PeerLink, str | None] = {}
        self._shaking_hosts: Counter[str] = Counter()
        self._last_id = 0
        self.handler_errors = 0  # on_request calls that raised (logged; the rest go on)
        self._on_request: OnRequest | None = None
        self._on_malformed: Callable[[], None] | None = None
        self._stopped = False
        self._closed = False
        self.dropped = 0
        self.refused: Counter[str] = Counter()  # connections ended, by reason

    @property
    def protocol_errors(self) -> int:
        bounds = ("refused", "busy", "stalled")
        return sum(n for reason, n in self.refused.items() if reason not in bounds)

    @property
    def busy(self) -> int:
        """Connections closed at accept (too many shaking hands), for taking the frames not
        complete yet past the read budget, or for holding part of one with no byte more
        for 30 s ("stalled")."""
        return self.refused["busy"] + self.refused["stalled"]

    def bind(self, addr: str) -> str:
        if self._closed:
            raise TransportClosed("bind on a closed peer server")
        if self._sock is not None:
            raise LocalProtocolError("this peer server is already bound")
        host, port = parse_endpoint(addr)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return format_endpoint(host, sock.getsockname()[1])

    def start(self, on_request: OnRequest, on_malformed: Callable[[], None]) -> None:
        """Accept from the next loop turn on (connections wait in the listen backlog)."""
        if self._sock is None:
            raise LocalProtocolError("bind() the peer server first")
        self._on_request, self._on_malformed = on_request, on_malformed
        loop = asyncio.get_running_loop()
        # (create_server listens on the socket again, with its own backlog: 100 unless told)
        served = loop.create_server(self._new_link, sock=self._sock, backlog=LISTEN_BACKLOG)
        task = loop.create_task(served)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[asyncio.AbstractServer]) -> None:
        if self._closed and (task.cancelled() or task.exception() is not None):
            return  # closed before it served: its socket is closed already
        if task.cancelled() or task.exception() is not None:
            log.error("the peer server did not start", exc_info=task.exception())
            return
        self._server = task.result()
        if self._closed:
            self._server.close()

    def _new_link(self) -> PeerLink:
        curve = self._curve
        link: PeerLink

        def authorize(key: bytes) -> str | None:
            assert curve is not None
            return curve.authorize(key, link.peer.rpartition(":")[0])

        link = PeerLink(
            ZmtpConnection(
                as_server=True,
                socket_type=self._socket_type,
                peer_types=self._peer_types,
                frame_bytes_max=self._message_bytes_max,
                curve=self._keys,
                authorize=authorize if curve is not None else None,
            ),
            self._on_messages,
            self._on_ready,
            self._on_lost,
            self.read_budget,
            self._made,
            self._fail_log,
            self._on_read,
        )
        link.identity = self._new_identity()
        self._shaking[link] = None
        if self._closed:
            link.close()  # its connection_made aborts the connection
        elif len(self._shaking) > HANDSHAKES_MAX:
            link.close()
            self.refused["busy"] += 1
        return link

    def _new_identity(self) -> bytes:
        """5 bytes as libzmq's ROUTER makes them: 0 and a 32-bit counter, wrapping around
        past the identities of connections still open."""
        while True:
            self._last_id = self._last_id % 0xFFFFFFFF + 1
            identity = b"\x00" + self._last_id.to_bytes(4, "big")
            if identity not in self._links:
                return identity

    def _made(self, link: PeerLink) -> bool:
        """A connection's address is known: False when its host has too many shaking hands."""
        host = _host_of(link.peer)
        if self._shaking_hosts[host] >= HANDSHAKES_PER_HOST_MAX:
            return False
        self._shaking_hosts[host] += 1
        self._shaking[link] = host
        return True

    def _handshake_over(self, link: PeerLink) -> None:
        host = self._shaking.pop(link, None)
        if host is not None:
            left = self._shaking_hosts[host] - 1
            if left:
                self._shaking_hosts[host] = left
            else:
                del self._shaking_hosts[host]  # (bounded by the hosts shaking hands now)

    def _on_ready(self, link: PeerLink) -> None:
        self._handshake_over(link)
        self._links[link.identity] = link

    def _on_lost(self, link: PeerLink, reason: str) -> None:
        self._handshake_over(link)
        if self._links.get(link.identity) is link:
            del self._links[link.identity]
        if reason not in ("lost", "closed"):
            self.refused[reason] += 1

    def _single_frames(self, messages: list[list[bytes]]) -> list[bytes]:
        """The frames of the messages of one frame; each other message (of several frames:
        none of ours is) is told to ``on_malformed``."""
        frames = [parts[0] for parts in messages if len(parts) == 1]
        if len(frames) != len(messages):
            assert self._on_malformed is not None
            for _ in range(len(messages) - len(frames)):
                self._on_malformed()
        return frames

    def _on_messages(self, link: PeerLink, messages: list[list[bytes]]) -> None:
        if self._stopped:
            return
        on_request = self._on_request
        assert on_request is not None
        identity = link.identity
        user = link.zmtp.peer_user
        for frame in self._single_frames(messages):
            try:
                on_request(identity, frame, user)
            except Exception:  # one frame's failure leaves the connection and the rest
                self.handler_errors += 1
                note_handler_failure(handler_name(on_request), log, "handling a peer's frame")

    def send(self, identity: bytes, frame: bytes) -> bool:
        if self._closed:
            raise TransportClosed("send on a closed peer server")
        link = self._links.get(identity)
        if link is None or link.closed or link.unsent() > self._write_bytes_max:
            self.dropped += 1
            return False
        link.write(link.zmtp.encode(frame))
        return True

    def flush(self) -> None:
        """Nothing waits: ``send`` wrote already."""

    def stop(self) -> None:
        self._stopped = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        for link in [*self._links.values(), *self._shaking]:
            link.close()
        self._links.clear()


class _Conn:
    """A client's connection to one address: the link when up, the frames waiting for it."""

    __slots__ = (
        "addr",
        "connect_task",
        "connecting",
        "delay_s",
        "link",
        "queue",
        "queued_bytes",
        "retry",
        "server_key",
        "used_at",
    )  # fmt: skip

    def __init__(self, addr: str, now: float, delay_s: float) -> None:
        self.addr = addr
        self.link: PeerLink | None = None  # set once its handshake is done
        self.queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self.used_at = now
        self.retry: asyncio.TimerHandle | None = None
        self.delay_s = delay_s
        self.server_key: bytes | None = None
        self.connecting: PeerLink | None = None  # the link being made (or up)
        self.connect_task: asyncio.Task[object] | None = None


class LoopPeerClient:
    """``PeerClient`` on the loop: one connection per address, made on first use,
    reconnected when lost."""

    def __init__(
        self,
        *,
        message_bytes_max: int,
        curve: PeerCurve | None = None,
        reconnect_s: float = 0.1,
        reconnect_max_s: float = 1.0,
        queue_max: int = 10_000,
        queue_bytes_max: int = WRITE_BYTES_MAX,
        write_bytes_max: int = WRITE_BYTES_MAX,
        clock: Callable[[], float] = time.monotonic,
        refused_lines_per_s: float = 5.0,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self._message_bytes_max = message_bytes_max
        self._on_read = on_read  # told of every read (busy-polling: gossipd/busypoll.py)
        self._fail_log = RateLimiter(refused_lines_per_s, clock=clock)
        self._curve = curve
        self._reconnect_s = reconnect_s
        self._reconnect_max_s = reconnect_max_s
        self._queue_max = queue_max
        self._queue_bytes_max = queue_bytes_max
        self._write_bytes_max = write_bytes_max
        self._clock = clock
        self._conns: dict[str, _Conn] = {}
        self._on_replies: OnReplies | None = None
        self._stopped = False
        self._closed = False
        self.dropped = 0
        self.unknown_keys = 0  # connections wanted to an address with no known key
        self.failed: Counter[str] = Counter()  # connections ended by a protocol error, by reason
        self.handler_errors = 0  # on_replies calls that raised (logged; the rest go on)

    @property
    def protocol_errors(self) -> int:
        return sum(n for reason, n in self.failed.items() if reason != "refused")

    def start(self, on_replies: OnReplies) -> None:
        self._on_replies = on_replies

    def send(self, addr: str, frame: bytes) -> bool:
        conn = self._conns.get(addr)
        if conn is None:
            conn = self._open(addr)
        conn.used_at = self._clock()
        link = conn.link
        if link is not None:
            if link.unsent() > self._write_bytes_max:
                self.dropped += 1
                return False
            link.write(link.zmtp.encode(frame))
            return True
        if (
            len(conn.queue) >= self._queue_max
            or conn.queued_bytes + len(frame) > self._queue_bytes_max
        ):
            self.dropped += 1
            return False
        conn.queue.append(frame)
        conn.queued_bytes += len(frame)
        return True

    def _open(self, addr: str) -> _Conn:
        if self._closed:
            raise TransportClosed("send on a closed peer client")
        if self._on_replies is None:
            raise LocalProtocolError("start() the peer client before sending")
        parse_endpoint(addr)  # a bad address fails here, in the caller's send
        conn = self._conns[addr] = _Conn(addr, self._clock(), self._reconnect_s)
        self._connect(conn)
        return conn

    def _connect(self, conn: _Conn) -> None:
        conn.retry = None
        if self._closed or self._conns.get(conn.addr) is not conn:
            return
        keys = None
        if self._curve is not None:
            conn.server_key = self._curve.server_key(conn.addr)
            if conn.server_key is None:
                self.unknown_keys += 1  # no connection until close_rekeyed finds a key
                return
            keys = CurveKeys(self._curve.public, self._curve.secret, conn.server_key)
        link = PeerLink(
            ZmtpConnection(
                as_server=False,
                socket_type=b"DEALER",
                peer_types=(b"ROUTER",),
                frame_bytes_max=self._message_bytes_max,
                curve=keys,
            ),
            lambda link, messages: self._deliver(conn, messages),
            lambda link: self._on_ready(conn, link),
            lambda link, reason: self._on_lost(conn, link, reason),
            fail_log=self._fail_log,
            on_read=self._on_read,
        )
        conn.connecting = link
        host, port = parse_endpoint(conn.addr)
        loop = asyncio.get_running_loop()
        task = loop.create_task(_dial(link, host, port))
        task.add_done_callback(lambda t: self._connected(conn, link, t))
        conn.connect_task = task

    def _connected(self, conn: _Conn, link: PeerLink, task: asyncio.Task[object]) -> None:
        if conn.connect_task is task:
            conn.connect_task = None
        if task.cancelled() or task.exception() is not None:
            link.closed = True
            self._retry_later(conn, link)

    def _retry_later(self, conn: _Conn, link: PeerLink) -> None:
        if conn.connecting is not link or self._closed or self._conns.get(conn.addr) is not conn:
            return
        conn.connecting = None
        conn.link = None
        loop = asyncio.get_running_loop()
        conn.retry = loop.call_later(conn.delay_s, self._connect, conn)
        conn.delay_s = min(conn.delay_s * 2, self._reconnect_max_s)

    def _on_ready(self, conn: _Conn, link: PeerLink) -> None:
        if conn.connecting is not link or self._conns.get(conn.addr) is not conn:
            link.close()
            return
        conn.link = link
        conn.delay_s = self._reconnect_s
        if conn.queue:
            link.write(b"".join(link.zmtp.encode(f) for f in conn.queue))
            conn.queue.clear()
            conn.queued_bytes = 0

    def _on_lost(self, conn: _Conn, link: PeerLink, reason: str) -> None:
        if reason not in ("lost", "closed"):
            self.failed[reason] += 1
        self._retry_later(conn, link)

    def _deliver(self, conn: _Conn, messages: list[list[bytes]]) -> None:
        if self._stopped or self._conns.get(conn.addr) is not conn:
            return
        assert self._on_replies is not None
        frames = [parts[0] for parts in messages if len(parts) == 1]
        if frames:
            try:
                self._on_replies(conn.addr, frames)
            except Exception:  # logged; the connection and the next reads go on
                self.handler_errors += 1
                note_handler_failure(
                    handler_name(self._on_replies), log, "handling a peer's replies"
                )

    def close_idle(self, now: float, idle_s: float, keep: Callable[[str], bool]) -> int:
        idle = [a for a, c in self._conns.items() if c.used_at < now - idle_s and not keep(a)]
        for addr in idle:
            self._drop(addr)
        return len(idle)

    def close_rekeyed(self, *, unknown_only: bool = False) -> int:
        curve = self._curve
        if curve is None:
            return 0
        stale = [
            addr
            for addr, conn in self._conns.items()
            if (conn.server_key is None or not unknown_only)
            and curve.server_key(addr) != conn.server_key
        ]
        for addr in stale:
            self._drop(addr)
        return len(stale)

    def _drop(self, addr: str) -> None:
        conn = self._conns.pop(addr, None)
        if conn is None:
            return
        if conn.retry is not None:
            conn.retry.cancel()
        if conn.connect_task is not None:
            conn.connect_task.cancel()
        for link in (conn.link, conn.connecting):
            if link is not None:
                link.close()  # one still connecting aborts in its connection_made

    def stop(self) -> None:
        self._stopped = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        for addr in list(self._conns):
            self._drop(addr)

    def __len__(self) -> int:
        return len(self._conns)


async def _dial(link: PeerLink, host: str, port: int) -> None:
    """Connect ``link`` to ``host``: a connect not answered within CONNECT_TIMEOUT_S is given
    up (its caller tries again after its delay), not left to SYN retransmissions 1, 2, 4 ...
    s apart.  A host name is looked up first, for as long as its resolver takes (off the
    loop; bounded with the connect, a resolver slower than the bound would never connect),
    and each of its addresses tried in turn, as create_connection would."""
    loop = asyncio.get_running_loop()
    found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failure: BaseException | None = None
    for family, kind, proto, _, address in found:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, address), tcpdefaults.CONNECT_TIMEOUT_S)
        except OSError as exc:  # (TimeoutError is one: the bound)
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        await loop.create_connection(lambda: link, sock=sock)  # (its address whole: a scope)
        return
    raise failure if failure is not None else OSError(f"{host!r}: no address")


def _host_of(peer: str) -> str:
    """A connection's "ADDRESS:PORT" -> the host it counts against: its IPv4 address, or its
    IPv6 address's /64 (one host commonly holds a whole /64)."""
    address = peer.rpartition(":")[0]
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.split("%")[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:  # (an IPv4 client of a dual-stack socket)
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))
