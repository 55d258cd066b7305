"""Best-effort datagrams between nodes: the ``Transport`` protocol and ``ZmqTransport``.

``Transport`` is the seam between the membership shell and the network: ``ZmqTransport``
here runs it over ZeroMQ on the asyncio loop; ``simulations.netsim.SimTransport`` runs it
over the simulator's virtual-time network; ``tests/test_transport_contract.py`` holds both
to the same contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol

import zmq

from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.hostnames import HostNames
from gossipd.looppull import LoopPullServer
from gossipd.sockets import CloseReason, SocketKind, SocketPool
from gossipd.zmqloop import NOBLOCK, SocketReader

OnFrame = Callable[[bytes], None]


class Transport(Protocol):
    """Best-effort datagrams between nodes, as UDP gives them: all SWIM gossip needs.

    One transport is one node's: it receives at the address ``bind`` returns and sends to any
    address.  No method blocks or waits; all are called on one thread (the event loop's, or
    the simulator's).  Implementations: ``ZmqTransport`` below, ``SimTransport`` in
    ``simulations/netsim.py``; ``tests/test_transport_contract.py`` holds both to this."""

    def bind(self, addr: str, on_frame: OnFrame) -> str:
        """Receive at ``addr`` from now on; return the address senders should use (the ZeroMQ
        endpoint with its port resolved; in the simulator, the transport's own address, for
        any ``addr``).  ``on_frame(frame)`` runs once per arriving frame, one at a time, in
        arrival order, on the receiver's loop (ZmqTransport: in the socket's fd callback;
        SimTransport: when the simulation reaches the delivery time), and must not block.
        Raises TransportClosed after ``close``."""
        ...

    def send(self, addr: str, frame: bytes) -> bool:
        """Hand ``frame`` to the network for ``addr``, at once.  False: dropped here (the
        queue for ``addr`` is full), counted by the caller if it cares.  True: accepted, not
        delivered: it arrives at most once and maybe never (loss, nobody bound at ``addr``,
        a partition, a receiver that closed).  Frames from one transport to one address
        arrive in the order sent, with gaps where some were lost.  Raises TransportClosed
        after ``close``."""
        ...

    def close(self) -> None:
        """Stop receiving (no ``on_frame`` call once it returns) and release what the
        transport holds; frames already accepted may still arrive or be lost.  Later ``send``
        and ``bind`` raise TransportClosed; closing again does nothing."""
        ...


class ZmqTransport:
    """``Transport`` over ZeroMQ: a bound PULL read in its fd callback (SocketReader), and one
    PUSH per destination from the socket pool (``kind``, by default gossip's: SNDHWM 64, so a
    send to a slow or absent peer drops at once instead of queueing without bound).

    ``receiver`` (gossip's default, ``gossip.receiver = "loop"``): the bound side is a
    ``LoopPullServer`` (looppull.py), PULL on the event loop, instead of libzmq's PULL.  The wire is
    the same (libzmq's PUSH sockets send to it), but libzmq's PULL queues up to RCVHWM frames
    per connection whatever their size (10,000 x ``message_bytes_max``, while the loop is
    busy), where the loop server holds only the frames not complete yet, within its read
    budget in bytes (16 x ``message_bytes_max`` over all connections), and hands each
    complete frame over as it reads it; a sender's TCP waits meanwhile.

    ZeroMQ only: with ``on_disconnect``, a socket monitor on each outgoing socket calls
    ``on_disconnect(addr)`` when the connection to ``addr`` drops (a killed peer's TCP reset):
    a hint that the peer may be gone, nothing more."""

    def __init__(
        self,
        pool: SocketPool,
        *,
        kind: SocketKind = SocketKind.GOSSIP,
        sockets_max: int | None = None,
        idle_s: float | None = None,
        message_bytes_max: int | None = None,
        recv_batch_max: int = 256,
        on_disconnect: Callable[[str], None] | None = None,
        options: Mapping[int, int] | None = None,
        serve_curve: Callable[[zmq.Socket], None] | None = None,
        accept: Callable[[str, bytes], bool] | None = None,
        names: HostNames | None = None,
        receiver: LoopPullServer | None = None,
    ) -> None:
        """``names``: where an address's host name is looked up before its socket connects
        (hostnames.py; libzmq would look it up in the I/O thread every socket shares, and a
        stalled resolver froze the daemon); a send to a name not known yet is dropped.
        ``sockets_max`` / ``idle_s``: the pool's bounds for ``kind``; ``options``: socket
        options over the kind's; ``message_bytes_max``: larger frames are refused on receipt
        (ZeroMQ drops the connection that sent one).  CURVE (gossipd/security.py):
        ``serve_curve(sock)`` makes the bound PULL a CURVE server before it binds, and then
        a frame reaches ``on_frame`` only if ``accept(sender, frame)``, ``sender`` being the
        frame's User-Id ("NODE KEY": the node its sender's key belongs to, and that key).
        ``receiver``: above; it brings its own bound and CURVE (``serve_curve`` is for the
        libzmq PULL only), and ``accept`` applies to its frames as to the PULL's."""
        self._pool = pool
        self._receiver = receiver
        self._bound = False
        self.malformed = 0  # messages of several frames to the loop receiver (not datagrams)
        self._kind = kind
        self._message_bytes_max = message_bytes_max
        self._recv_batch_max = recv_batch_max
        self._on_disconnect = on_disconnect
        self._serve_curve = serve_curve
        self._accept = accept
        self._names = names
        self._lookups: set[asyncio.Task[str]] = set()
        self._on_frame: OnFrame | None = None
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        # Per destination with a monitor: the monitored socket, the monitor, its reader.
        self._monitors: dict[str, tuple[zmq.Socket, zmq.Socket, SocketReader]] = {}
        self._closed = False
        self.sent = 0
        self.dropped = 0  # sends refused by a full queue or a refused address (False)
        self.unresolved = 0  # of those, to a host name being looked up or that failed
        pool.register(
            kind,
            on_close=self._on_socket_closed,
            sockets_max=sockets_max,
            idle_s=idle_s,
            options=options,
        )

    def bind(self, addr: str, on_frame: OnFrame) -> str:
        if self._closed:
            raise TransportClosed("bind on a closed transport")
        if self._bound:
            raise LocalProtocolError("this transport is already bound")
        if self._receiver is not None:
            bound = self._receiver.bind(addr)
            self._bound, self._on_frame = True, on_frame
            self._receiver.receive(self._on_received, self._on_malformed)
            return bound
        sock = self._pool.ctx.socket(zmq.PULL)
        if self._message_bytes_max is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, self._message_bytes_max)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        if self._serve_curve is not None:
            self._serve_curve(sock)
        try:
            sock.bind(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock, self._on_frame, self._bound = sock, on_frame, True
        if self._serve_curve is not None:
            self._reader = SocketReader(
                sock, partial(sock.recv, copy=False), self._recv_batch_max, self._on_curve_frames
            )
        else:
            self._reader = SocketReader(sock, sock.recv, self._recv_batch_max, self._on_frames)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _on_frames(self, frames: list[bytes]) -> None:
        on_frame = self._on_frame
        assert on_frame is not None
        for frame in frames:
            on_frame(frame)

    def _on_curve_frames(self, frames: list[zmq.Frame]) -> None:
        on_frame, accept = self._on_frame, self._accept
        assert on_frame is not None
        for frame in frames:
            data = frame.bytes
            if accept is None or accept(frame.get(b"User-Id"), data):
                on_frame(data)

    def _on_received(self, frames: list[bytes], sender: str) -> None:
        """The loop receiver's frames; ``sender`` is "NODE KEY" under CURVE, "" without."""
        on_frame, accept = self._on_frame, self._accept
        assert on_frame is not None
        for frame in frames:
            if accept is None or accept(sender, frame):
                on_frame(frame)

    def _on_malformed(self) -> None:
        self.malformed += 1

    @property
    def receive_refused(self) -> dict[str, int]:
        """Connections the loop receiver ended, by reason ("busy": its bounds; "refused": a
        key ZAP refused, counted there too; the rest: ZMTP broken); empty without one."""
        return {} if self._receiver is None else dict(self._receiver.refused)

    def send(self, addr: str, frame: bytes) -> bool:
        if self._closed:
            raise TransportClosed("send on a closed transport")
        sock = self._pool.touch(self._kind, addr)
        if sock is None:
            address = None
            if self._names is not None:
                ready, address = self._names.address_for(addr, self._lookups)
                if not ready:
                    self.dropped += 1
                    self.unresolved += 1
                    return False
            try:
                sock = self._open(addr, address)
            except zmq.ZMQError:  # an address ZeroMQ refuses (gossip checks them: a backstop)
                self.dropped += 1
                return False
        try:
            sock.send(frame, NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def _open(self, addr: str, address: str | None) -> zmq.Socket:
        sock = self._pool.open(self._kind, addr, address=address)
        if self._on_disconnect is not None:
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            reader = SocketReader(
                monitor, monitor.recv_multipart, 16, lambda msgs: self._on_monitor(addr, msgs)
            )
            self._monitors[addr] = (sock, monitor, reader)
        return sock

    def _on_monitor(self, addr: str, messages: list[list[bytes]]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        assert self._on_disconnect is not None
        for message in messages:
            if parse_monitor_message(message)["event"] == zmq.EVENT_DISCONNECTED:
                self._on_disconnect(addr)

    def _on_socket_closed(self, addr: str, reason: CloseReason) -> None:
        """The pool closes ``addr``'s socket (evicted, idle, or ours closing): its monitor goes
        first."""
        watched = self._monitors.pop(addr, None)
        if watched is not None:
            sock, monitor, reader = watched
            reader.close()
            sock.disable_monitor()
            monitor.close(linger=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lookup in self._lookups:
            lookup.cancel()
        if self._reader is not None:
            self._reader.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._receiver is not None:
            self._receiver.close()
        self._pool.close_kind(self._kind)
