"""Fan-out's request/reply channel between daemons: the ``PeerClient`` / ``PeerServer``
protocols and their ZeroMQ implementations (DEALER per peer, one ROUTER).

The seam between fan-out and the network, as ``datagrams.Transport`` is gossip's: the
forwarder's links (fanout/peerlinks.py) send through a ``PeerClient``, the owner
(fanout/owner.py) serves through a ``PeerServer``; ``simulations.peerchannel`` has both over netsim's
virtual-time network, and ``tests/test_peerchannel_contract.py`` holds the two pairs to the
same contract.  Frames are opaque bytes here: batching, encoding and counting are the
callers'.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol

import zmq

from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.hostnames import HostNames
from gossipd.ops.logs import handler_name, note_handler_failure
from gossipd.sockets import CloseReason, SocketKind, SocketPool
from gossipd.zmqloop import NOBLOCK, SocketReader, kick

log = logging.getLogger("gossipd.peerchannel")

# A client's frames back from one peer: (the peer's address, one read's frames, in order).
OnReplies = Callable[[str, list[bytes]], None]
# A server's frame: (the sending connection's identity, the frame, who its sender
# authenticated as: CURVE's User-Id, "NODE KEY"; "" where the channel does not authenticate).
OnRequest = Callable[[bytes, bytes, str], None]

_PEER = SocketKind.PEER  # read per send: a global (see core/admission.py on enums)
_DROPPED_ERRNOS = (errno.EAGAIN, errno.EHOSTUNREACH)  # a full queue; a connection gone


# Messages a ROUTER queues for one connection before it refuses more (libzmq's default,
# set here because the owner's byte bound on relayed replies counts on it).
ROUTER_SNDHWM = 1000


class PeerClient(Protocol):
    """One node's connections to its peers' servers, one per address: frames go to a peer,
    and what that peer sends back on the connection comes back through ``on_replies``.

    Delivery: at most once, in order per connection (frames to one address arrive in the
    order sent, with gaps where some were lost); nothing is retried here, so loss is left to
    the caller's timeouts.  No method blocks or waits; all run on one thread (the event
    loop's, or the simulator's).  Implementations: ``ZmqPeerClient`` below, ``SimPeerClient``
    in ``simulations/peerchannel.py``; ``tests/test_peerchannel_contract.py`` holds both to this."""

    dropped: int  # frames ``send`` refused (it returned False)

    # Connections closed because the peer broke ZMTP (a bad handshake, box, nonce or size):
    # the loop channel counts them; libzmq closes such connections without telling us (0).
    @property
    def protocol_errors(self) -> int: ...

    def start(self, on_replies: OnReplies) -> None:
        """Hand what peers send back to ``on_replies(addr, frames)`` from now on (call once,
        before the first ``send``): one call per read, one or more frames in the order that
        peer sent them on this connection, one call at a time, on the loop, never blocking."""
        ...

    def send(self, addr: str, frame: bytes) -> bool:
        """Hand ``frame`` to the connection to ``addr`` (made on first use), at once.  False:
        dropped here (that connection's queue is full), counted in ``dropped``.  True:
        accepted, not delivered: it reaches the server at ``addr`` at most once, maybe never
        (loss, a partition, nobody bound there: ZeroMQ holds it in the connection's bounded
        queue until a server binds or the connection closes; the simulator loses it), and it
        never holds up frames to other addresses.  Raises TransportClosed after ``close``."""
        ...

    def close_idle(self, now: float, idle_s: float, keep: Callable[[str], bool]) -> int:
        """Close the connections not used by ``send`` since ``now - idle_s`` (``now`` on the
        implementation's clock) unless ``keep(addr)``; how many.  What they still held is
        lost; a later send to that address makes a new connection (a new identity at the
        server)."""
        ...

    def close_rekeyed(self, *, unknown_only: bool = False) -> int:
        """CURVE: close the connections whose member's key is no longer the one they were
        made with (replaced, or found for an address that had none), so that the next send
        reconnects with the right one; ``unknown_only``: look only at those made with no
        known key (cheap enough to run every second).  How many closed; 0 where nothing is
        keyed (no CURVE, the simulator)."""
        ...

    def stop(self) -> None:
        """No ``on_replies`` call once this returns (sends still go); what arrives is lost."""
        ...

    def close(self) -> None:
        """Stop, then close every connection (what they hold is lost).  Later sends raise
        TransportClosed; closing again does nothing."""
        ...

    def __len__(self) -> int:
        """Connections open."""
        ...


class PeerServer(Protocol):
    """One node's server: frames from many clients' connections, each with its identity, and
    replies to an identity on the connection it names.

    Delivery as ``PeerClient``'s: at most once, in order per connection, nothing retried.
    A reply to an identity whose connection is gone (closed, reconnected under a new one, or
    never known) is dropped and reported (``send`` returns False, ``dropped`` counts it)
    once the server knows the connection is gone (ZeroMQ learns of a close a moment after
    it happens; a reply sent in that moment is lost unreported), never queued or blocked on.  No method blocks or waits; all run on one
    thread.  Implementations: ``ZmqPeerServer`` below, ``SimPeerServer`` in
    ``simulations/peerchannel.py``."""

    dropped: int  # replies ``send`` refused (it returned False)

    @property
    def protocol_errors(self) -> int: ...  # as PeerClient's

    @property
    def busy(self) -> int: ...  # connections closed for the server's bounds (loop channel)

    def bind(self, addr: str) -> str:
        """Accept connections at ``addr``; the address clients should use (the ZeroMQ
        endpoint with its port resolved; the simulator's own address for any ``addr``).
        Frames wait for ``start``.  Raises TransportClosed after ``close``,
        LocalProtocolError when bound already."""
        ...

    def start(self, on_request: OnRequest, on_malformed: Callable[[], None]) -> None:
        """Hand each frame to ``on_request(identity, frame, sender)`` from now on, one at a
        time, in arrival order, on the loop (ZeroMQ: in the socket's fd callback).  A message
        that is not one frame (ZeroMQ: a peer sent several parts) is dropped with a call of
        ``on_malformed()``.  ``identity`` stays the same for every frame of one connection
        and differs between connections."""
        ...

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send ``frame`` back on ``identity``'s connection; it leaves no later than the next
        ``flush``.  False: dropped and counted (the connection is gone, or its queue is
        full).  True: accepted; it arrives at most once.  Raises TransportClosed after
        ``close``."""
        ...

    def flush(self) -> None:
        """Call once after a run of sends (ZeroMQ: a send on the one socket can take the
        readiness signal its reader waits on, so the reader looks again, once a run rather
        than once a reply)."""
        ...

    def stop(self) -> None:
        """No ``on_request`` call once this returns; frames that come wait or are lost."""
        ...

    def close(self) -> None:
        """Stop, and stop accepting connections; replies not yet gone are lost.  Later
        ``send`` and ``bind`` raise TransportClosed; closing again does nothing."""
        ...


class ZmqPeerClient:
    """``PeerClient`` over ZeroMQ: one pooled DEALER per address (the socket pool's PEER kind:
    SNDHWM 10 000, LINGER 0, plus ``options``), each read in its fd callback."""

    protocol_errors = 0  # libzmq does not say

    def __init__(
        self,
        pool: SocketPool,
        *,
        options: Mapping[int, int] | None = None,
        recv_batch_max: int = 256,
        names: HostNames | None = None,
    ) -> None:
        """``names``: where a member address's host name is looked up before its DEALER
        connects (hostnames.py: never in libzmq's I/O thread); a send to a name not known
        yet is refused (False), as a full queue's is."""
        self._pool = pool
        self._names = names
        self._lookups: set[asyncio.Task[str]] = set()
        self._recv_batch_max = recv_batch_max
        self._on_replies: OnReplies | None = None
        self._readers: dict[str, SocketReader] = {}
        self._closed = False
        self.dropped = 0
        pool.register(_PEER, on_close=self._on_socket_closed, options=options)

    def start(self, on_replies: OnReplies) -> None:
        self._on_replies = on_replies

    def send(self, addr: str, frame: bytes) -> bool:
        sock = self._pool.touch(_PEER, addr)
        if sock is None:
            address = None
            if self._names is not None:
                ready, address = self._names.address_for(addr, self._lookups)
                if not ready:
                    self.dropped += 1
                    return False
            sock = self._open(addr, address)  # raises once closed: no check on the hot path
        try:
            sock.send(frame, NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            kick(sock)
            return False
        # The send may have taken the signal that a reply waits: the reader looks again.
        kick(sock)
        return True

    def _open(self, addr: str, address: str | None) -> zmq.Socket:
        if self._closed:
            raise TransportClosed("send on a closed peer client")
        if self._on_replies is None:
            raise LocalProtocolError("start() the peer client before sending")
        sock = self._pool.open(_PEER, addr, address=address)
        self._readers[addr] = SocketReader(
            sock, sock.recv, self._recv_batch_max, partial(self._on_replies, addr)
        )
        return sock

    def close_idle(self, now: float, idle_s: float, keep: Callable[[str], bool]) -> int:
        return self._pool.close_idle(now, _PEER, idle_s=idle_s, keep=keep)

    def close_rekeyed(self, *, unknown_only: bool = False) -> int:
        return self._pool.close_rekeyed(_PEER, unknown_only=unknown_only)

    def _on_socket_closed(self, addr: str, reason: CloseReason) -> None:
        """The pool closes ``addr``'s socket (idle, rekeyed, or ours closing): its reader
        goes first."""
        reader = self._readers.pop(addr, None)
        if reader is not None:
            reader.close()

    def stop(self) -> None:
        for lookup in self._lookups:
            lookup.cancel()
        for reader in self._readers.values():
            reader.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._pool.close_kind(_PEER)

    def __len__(self) -> int:
        return len(self._readers)


class ZmqPeerServer:
    """``PeerServer`` over ZeroMQ: one bound ROUTER, read in its fd callback.

    ROUTER_MANDATORY: a reply to an identity with no connection (or a full one) fails at
    once (EHOSTUNREACH, EAGAIN) instead of vanishing, so that ``send`` can report it.  Under
    CurveZMQ (``serve_curve(sock)`` makes the ROUTER a CURVE server before it binds), each
    message is read as zmq.Frame (copy=False) for its User-Id property: "NODE KEY", the node
    its sender's key belongs to and the key (gossipd/security.py's ZAP handler), the
    ``sender`` of ``on_request``."""

    protocol_errors = 0  # libzmq does not say
    busy = 0  # (nor this)

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        message_bytes_max: int,
        recv_batch_max: int = 256,
        serve_curve: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        """``message_bytes_max``: larger messages are refused on receipt (ZeroMQ drops the
        connection that sent one)."""
        self._ctx = ctx
        self._message_bytes_max = message_bytes_max
        self._recv_batch_max = recv_batch_max
        self._serve_curve = serve_curve
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._on_request: OnRequest | None = None
        self._on_malformed: Callable[[], None] | None = None
        self._closed = False
        self.dropped = 0

    def bind(self, addr: str) -> str:
        if self._closed:
            raise TransportClosed("bind on a closed peer server")
        if self._sock is not None:
            raise LocalProtocolError("this peer server is already bound")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self._message_bytes_max)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
        if self._serve_curve is not None:
            self._serve_curve(sock)
        try:
            sock.bind(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, on_request: OnRequest, on_malformed: Callable[[], None]) -> None:
        """Read in the fd callback (``SocketReader``): a request is handled in the callback
        that sees it arrive, which takes about 20 us off a hop."""
        sock = self._sock
        if sock is None:
            raise LocalProtocolError("bind() the peer server first")
        self._on_request, self._on_malformed = on_request, on_malformed
        if self._serve_curve is not None:
            recv = partial(sock.recv_multipart, copy=False)
            self._reader = SocketReader(sock, recv, self._recv_batch_max, self._on_curve_messages)
        else:
            self._reader = SocketReader(
                sock, sock.recv_multipart, self._recv_batch_max, self._on_messages
            )

    def _on_messages(self, messages: list[list[bytes]]) -> None:
        on_request = self._on_request
        assert on_request is not None
        for parts in messages:
            if len(parts) != 2:  # a ROUTER gives [identity, frame]; a peer sent more
                self._malformed()
                continue
            try:
                on_request(parts[0], parts[1], "")
            except Exception:  # one frame's bug: the frames read with it go on
                note_handler_failure(handler_name(on_request), log, "handling a peer's frame")

    def _on_curve_messages(self, messages: list[list[zmq.Frame]]) -> None:
        on_request = self._on_request
        assert on_request is not None
        for parts in messages:
            if len(parts) != 2:
                self._malformed()
                continue
            try:
                on_request(parts[0].bytes, parts[1].bytes, parts[1].get(b"User-Id"))
            except Exception:  # one frame's bug: the frames read with it go on
                note_handler_failure(handler_name(on_request), log, "handling a peer's frame")

    def _malformed(self) -> None:
        assert self._on_malformed is not None
        self._on_malformed()

    def send(self, identity: bytes, frame: bytes) -> bool:
        sock = self._sock
        if sock is None:
            raise TransportClosed("send on a closed (or unbound) peer server")
        try:
            sock.send_multipart([identity, frame], NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in _DROPPED_ERRNOS:
                raise
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        if self._sock is not None:
            kick(self._sock)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
