"""The daemon's outgoing ZeroMQ sockets, in one pool keyed by (kind, address).

Three parts send to many addresses: gossip (PUSH to each member's gossip PULL), the reply
sender (PUSH to each producer's reply address) and the forwarder's peer links (DEALER to each
member's ROUTER).  Each kind has one user, which registers it with its bounds and a close
callback; the pool creates sockets with the kind's options (``KIND_OPTIONS``, plus the user's
config-derived ones), keeps them in least-recently-used order, evicts the least recently used
when a kind is at its bound, closes sockets unused for the kind's ``idle_s`` (a timer sweeps
every ``sweep_interval_s``), and calls the user's ``on_close(addr, reason)`` before it closes
any socket, so that readers and monitors on it go first.  Every close goes through that
callback, whoever asked for it.

CurveZMQ (``set_curve``, per kind, by the daemon when ``security.curve`` is on): each socket
of the kind connects as a CURVE client with the daemon's key pair and checks that the server
holds the key ``route(addr)`` names; an address with no known key gets a throwaway server
key, so its handshake fails and nothing is sent in clear (the kind's queue bound and the
user's timeouts apply as to a peer that does not answer).  For the reply kind, ``addr`` is a
route, "ENDPOINT PRODUCER_KEY" (``Task.route``): one socket per producer key and endpoint.

Users keep their own per-address state (queues, readers) beside the socket: ``open`` on the
first use, ``touch`` on each later one (that is what keeps a socket recent).
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.hostnames import with_address


class SocketKind(enum.Enum):
    GOSSIP = "gossip"  # PUSH to a member's gossip PULL (SWIM datagrams)
    REPLY = "reply"  # PUSH to a producer's reply_to PULL (Chunk, Result)
    PEER = "peer"  # DEALER to a member's fan-out ROUTER (Forward, Cancel, Withdraw, TaskDone)


REPLY_PIPE_MESSAGES_MAX = 256  # a reply connection's messages in ZeroMQ, beyond our queues

# Socket type and options per kind; a user adds the ones that come from its configuration.
KIND_OPTIONS: dict[SocketKind, tuple[int, tuple[tuple[int, int], ...]]] = {
    # Sends never block: a full queue (64) drops the datagram, as UDP would; SWIM is built for
    # loss.  Reconnect soon after a peer restarts, backing off to 2 s for one that is gone.
    # TCP_MAXRT and CONNECT_TIMEOUT (issue 24): a connection whose data goes unacknowledged
    # for 2 s (a cut cable, a host cut off) is dropped and made anew, and a connect gives up
    # after 1 s; else TCP's retransmission backoff (0.2 s doubling: the next try 10 s after
    # a 15 s cut) kept every datagram to a healed member waiting for up to ~10 s.
    SocketKind.GOSSIP: (
        zmq.PUSH,
        (
            (zmq.SNDHWM, 64),
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL, 100),
            (zmq.RECONNECT_IVL_MAX, 2000),
            (zmq.TCP_MAXRT, 2000),
            (zmq.CONNECT_TIMEOUT, 1000),
        ),
    ),
    # IMMEDIATE: queue only on a live connection, so that replies to an address that never
    # answers wait in the reply sender's bounded queue (and time out) instead of in ZeroMQ.
    # SNDHWM: what waits for a producer slow to read waits there too, counted in bytes
    # (ingress.reply_queue_bytes_max); ZeroMQ's pipe counts messages only, and at 10,000 a
    # reader that did not read held 270 MB of replies outside the bound (a review's run).
    # 256, not fewer: `bench ingress` (500 tasks outstanding) lost 7-9% of its tasks/s at
    # 64 (a turn's replies past it wait for the flusher), and gained 2-6% at 256.
    # + TCP_MAXRT, RECONNECT_IVL_MAX and IPV6 from the reply sender (replysender.ReplySender).
    SocketKind.REPLY: (
        zmq.PUSH,
        (
            (zmq.IMMEDIATE, 1),
            (zmq.SNDHWM, REPLY_PIPE_MESSAGES_MAX),
            (zmq.RECONNECT_IVL, 100),
            (zmq.LINGER, 0),
        ),
    ),
    # + MAXMSGSIZE and RECONNECT_IVL_MAX from FanoutConfig (peerlinks.py).
    SocketKind.PEER: (zmq.DEALER, ((zmq.LINGER, 0), (zmq.SNDHWM, 10_000))),
}


# For a CURVE kind: the endpoint to connect to for ``addr`` and the server's public key
# (z85; None: no known key).
Route = Callable[[str], tuple[str, bytes | None]]


@dataclass(frozen=True, slots=True)
class CurveClient:
    public: bytes  # this daemon's key pair, z85
    secret: bytes
    route: Route
    unknown_keys: list[int]  # [count]: connections opened to an address with no known key


def split_reply_route(route: str) -> tuple[str, bytes | None]:
    endpoint, _, key = route.partition(" ")
    return endpoint, key.encode() if key else None


class CloseReason(enum.Enum):
    EVICTED = "evicted"  # the kind was at its sockets_max; this one was the least recently used
    IDLE = "idle"  # unused for idle_s
    REQUESTED = "requested"  # the user (or the pool's own close) asked


OnClose = Callable[[str, CloseReason], None]


@dataclass(frozen=True, slots=True)
class KindStatistics:
    sockets_open: int
    opened: int
    evicted: int
    closed_idle: int


class _Entry:
    __slots__ = ("server_key", "sock", "used_at")

    def __init__(self, sock: zmq.Socket, used_at: float, server_key: bytes | None = None) -> None:
        self.sock = sock
        self.used_at = used_at  # the clock's monotonic() at the last open or touch
        self.server_key = server_key  # CURVE: the key it checks (None: none was known)


class _Kind:
    __slots__ = (
        "closed_idle",
        "evicted",
        "idle_s",
        "keep",
        "linger_ms",
        "on_close",
        "opened",
        "options",
        "socket_type",
        "sockets",
        "sockets_max",
    )

    def __init__(
        self,
        kind: SocketKind,
        on_close: OnClose,
        sockets_max: int | None,
        idle_s: float | None,
        linger_ms: int,
        options: Mapping[int, int],
        keep: Callable[[str], bool] | None,
    ) -> None:
        socket_type, fixed = KIND_OPTIONS[kind]
        self.socket_type = socket_type
        self.options = dict(fixed) | dict(options)
        self.on_close = on_close
        self.sockets_max = sockets_max
        self.idle_s = idle_s
        self.linger_ms = linger_ms
        self.keep = keep
        self.sockets: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.opened = 0
        self.evicted = 0
        self.closed_idle = 0


class SocketPool:
    """Outgoing sockets by (kind, address): bounded per kind (least recently used evicted),
    idle ones closed, the kind's user told before any of its sockets closes.

    Not thread-safe; every call on the event loop's thread (``start`` needs a running loop)."""

    def __init__(self, ctx: zmq.Context, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.ctx = ctx
        self._clock = clock
        self._kinds: dict[SocketKind, _Kind] = {}
        self._curve: dict[SocketKind, CurveClient] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    def register(
        self,
        kind: SocketKind,
        *,
        on_close: OnClose,
        sockets_max: int | None = None,
        idle_s: float | None = None,
        linger_ms: int = 0,
        options: Mapping[int, int] | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> None:
        """Become ``kind``'s one user.  ``sockets_max``: at most this many open (None: no
        bound); ``idle_s``: the sweep closes sockets unused this long (None: only on request,
        ``close_idle`` with an ``idle_s``); ``linger_ms``: how long ZeroMQ keeps trying to
        deliver what an evicted or idle-closed socket still holds; ``options``: socket options
        added to (or replacing) the kind's ``KIND_OPTIONS``; ``keep(addr)``: True vetoes an
        idle close (the user still has something queued for that address)."""
        if kind in self._kinds:
            raise LocalProtocolError(f"socket kind {kind.value} already has a user")
        self._kinds[kind] = _Kind(
            kind, on_close, sockets_max, idle_s, linger_ms, options or {}, keep
        )

    def set_curve(
        self, kind: SocketKind, *, public: bytes, secret: bytes, route: Route
    ) -> CurveClient:
        """Open ``kind``'s sockets from now on as CURVE clients (see the module's head)."""
        curve = self._curve[kind] = CurveClient(public, secret, route, [0])
        return curve

    # -- per socket ------------------------------------------------------------------------

    def open(self, kind: SocketKind, addr: str, *, address: str | None = None) -> zmq.Socket:
        """A new socket of ``kind`` connected to ``addr`` (which has none open), evicting the
        kind's least recently used one first when the kind is at its ``sockets_max``;
        ``address``: the IP its host name resolved to, connected in its place (libzmq would
        look the name up in its I/O thread, blocking every socket: hostnames.py)."""
        if self._closed:
            raise TransportClosed("the socket pool is closed")
        k = self._kinds[kind]
        if addr in k.sockets:
            raise LocalProtocolError(f"a {kind.value} socket to {addr} is already open")
        while k.sockets_max is not None and len(k.sockets) >= k.sockets_max:
            k.evicted += 1
            self._close(k, self._to_evict(k), CloseReason.EVICTED, k.linger_ms)
        sock = self.ctx.socket(k.socket_type)
        try:
            for option, value in k.options.items():
                sock.setsockopt(option, value)
            endpoint = addr.partition(" ")[0]  # a reply route names a key only under CURVE
            curve = self._curve.get(kind)
            server_key: bytes | None = None
            if curve is not None:
                endpoint, server_key = curve.route(addr)
                if server_key is None:
                    curve.unknown_keys[0] += 1
                sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
                # No known key: a throwaway one, whose secret nobody holds (never connects).
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_key or zmq.curve_keypair()[0])
            if address is not None:
                endpoint = with_address(endpoint, address)
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)  # not kept, not leaked: the caller is told
            raise
        k.sockets[addr] = _Entry(sock, self._clock.monotonic(), server_key)
        k.opened += 1
        return sock

    @staticmethod
    def _to_evict(k: _Kind) -> str:
        """The least recently used socket that ``keep`` does not hold (nothing queued for
        it), else the least recently used: many new addresses (anyone's reply_to) evict
        idle sockets before any that still has replies to deliver."""
        keep = k.keep
        if keep is not None:
            for addr in k.sockets:  # (oldest first; a full scan only when all are held)
                if not keep(addr):
                    return addr
        return next(iter(k.sockets))

    def touch(self, kind: SocketKind, addr: str) -> zmq.Socket | None:
        """A use of ``addr``'s socket: it becomes the most recently used.  The socket; None
        when none is open."""
        sockets = self._kinds[kind].sockets
        entry = sockets.get(addr)
        if entry is None:
            return None
        entry.used_at = self._clock.monotonic()
        sockets.move_to_end(addr)
        return entry.sock

    def get(self, kind: SocketKind, addr: str) -> zmq.Socket | None:
        """The open socket of ``kind`` to ``addr``, if any (not a use: nothing is touched)."""
        entry = self._kinds[kind].sockets.get(addr)
        return None if entry is None else entry.sock

    def close(self, kind: SocketKind, addr: str, *, linger_ms: int | None = None) -> bool:
        """Close ``addr``'s socket (the user's ``on_close`` first); False if none was open.
        ``linger_ms``: default the kind's."""
        k = self._kinds[kind]
        if addr not in k.sockets:
            return False
        self._close(k, addr, CloseReason.REQUESTED, k.linger_ms if linger_ms is None else linger_ms)
        return True

    def close_rekeyed(self, kind: SocketKind, *, unknown_only: bool = False) -> int:
        """CURVE: close ``kind``'s sockets whose server key is no longer the one ``route``
        gives (a member's key replaced, or found for an address that had none), so that the
        next use reconnects with the right one; ``unknown_only``: look only at the sockets
        opened with no known key (cheap enough to run every second).  How many closed."""
        curve = self._curve.get(kind)
        k = self._kinds.get(kind)
        if curve is None or k is None:
            return 0
        stale = [
            addr
            for addr, entry in k.sockets.items()
            if (entry.server_key is None or not unknown_only)
            and curve.route(addr)[1] != entry.server_key
        ]
        for addr in stale:
            if addr in k.sockets:
                self._close(k, addr, CloseReason.REQUESTED, k.linger_ms)
        return len(stale)

    def close_kind(self, kind: SocketKind, *, linger_ms: int | None = None) -> None:
        """Close every socket of ``kind``."""
        k = self._kinds.get(kind)
        if k is None:
            return
        for addr in list(k.sockets):
            if addr in k.sockets:  # an on_close may have closed another
                self._close(
                    k, addr, CloseReason.REQUESTED, k.linger_ms if linger_ms is None else linger_ms
                )

    def close_idle(
        self,
        now: float,
        kind: SocketKind | None = None,
        *,
        idle_s: float | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> int:
        """Close the sockets unused since ``now - idle_s`` (``now`` on the clock's
        clock) unless ``keep(addr)``; how many.  ``kind`` None: every kind with an ``idle_s``.
        ``idle_s`` / ``keep`` default to the kind's registered ones."""
        kinds = [self._kinds[kind]] if kind is not None else list(self._kinds.values())
        closed = 0
        for k in kinds:
            limit_s = idle_s if idle_s is not None else k.idle_s
            if limit_s is None:
                continue
            veto = keep if keep is not None else k.keep
            cutoff = now - limit_s
            idle = []
            # Least recently used first, so the scan ends at the first recent socket.
            for addr, entry in k.sockets.items():
                if entry.used_at > cutoff:
                    break
                if veto is None or not veto(addr):
                    idle.append(addr)
            for addr in idle:
                if addr in k.sockets:
                    k.closed_idle += 1
                    closed += 1
                    self._close(k, addr, CloseReason.IDLE, k.linger_ms)
        return closed

    def _close(self, k: _Kind, addr: str, reason: CloseReason, linger_ms: int) -> None:
        sock = k.sockets.pop(addr).sock
        try:
            k.on_close(addr, reason)
        finally:
            sock.close(linger=linger_ms)

    # -- the pool --------------------------------------------------------------------------

    def sweep_interval_s(self) -> float:
        """How often the sweep runs: a quarter of the shortest ``idle_s``, within 0.5..10 s."""
        idle = [k.idle_s for k in self._kinds.values() if k.idle_s is not None]
        return max(0.5, min(min(idle, default=40.0) / 4, 10.0))

    def start(self) -> None:
        """Sweep idle sockets on a loop timer (call inside the running loop)."""
        if self._sweeper is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.sweep_interval_s(), self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.close_idle(self._clock.monotonic())
        self.start()

    def stop(self) -> None:
        """Stop sweeping (sockets stay open until ``close``)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def close_all(self, *, linger_ms: int = 0) -> None:
        """Close every socket still open (each user's ``on_close`` first); later opens raise
        TransportClosed.  Call before terminating the context."""
        self.stop()
        self._closed = True
        for kind in list(self._kinds):
            self.close_kind(kind, linger_ms=linger_ms)

    def __len__(self) -> int:
        return sum(len(k.sockets) for k in self._kinds.values())

    def statistics(self, kind: SocketKind) -> KindStatistics:
        k = self._kinds.get(kind)
        if k is None:
            return KindStatistics(0, 0, 0, 0)
        return KindStatistics(
            sockets_open=len(k.sockets),
            opened=k.opened,
            evicted=k.evicted,
            closed_idle=k.closed_idle,
        )
