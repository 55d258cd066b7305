"""The forwarder's connections to its peers: one DEALER socket per peer's ROUTER
(``fanout.rpc_bind``); what comes back (acks, TaskDone) is read in each socket's fd callback.

What is queued for one peer within one loop turn leaves as one message (a PeerBatch when
there are several), so a burst of forwards costs one send and one wake-up of the peer.  When
the last turn sent one message at most (light load), a turn's first message leaves at once:
a lone forward does not wait for the rest of the turn.
Nothing is decided here: who gets what, retries and hedging are the core Forwarder's
(core/forwarder.py, over the placer's order); the Dispatcher (fanout/forwarding.py) sends
what it returns through these links.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from gossipd.config import FanoutConfig
from gossipd.core.messages import Cancel, Drain
from gossipd.core.peer_messages import Confirm, Forward, TaskDone, Withdraw
from gossipd.errors import RemoteProtocolError
from gossipd.fanout.owner import PEER_READ_MAX, peer_frames, peer_items
from gossipd.sockets import CloseReason, SocketKind, SocketPool
from gossipd.zmqloop import NOBLOCK, SocketReader, TurnBatching, kick

Outgoing = Forward | Cancel | Withdraw | TaskDone | Drain | Confirm


class _Peer:
    __slots__ = ("addr", "outbox", "reader", "sock")

    def __init__(self, addr: str, sock: zmq.Socket) -> None:
        self.addr = addr
        self.sock = sock
        self.outbox: list[Outgoing] = []
        self.reader: SocketReader | None = None


_PEER = SocketKind.PEER  # read per send: a global (see core/admission.py on enums)


@dataclass(slots=True)
class PeerLinkCounters:
    sends_dropped: int = 0  # messages a peer's full queue refused (left to the ack timeout)
    bad_messages: int = 0  # undecodable frames from peers
    links_closed: int = 0  # connections to non-members closed after peer_idle_close_s


class PeerLinks:
    def __init__(
        self,
        config: FanoutConfig,
        *,
        sockets: SocketPool,
        on_reply: Callable[[list[object]], None],
    ) -> None:
        self._config = config
        self._pool = sockets
        sockets.register(
            SocketKind.PEER,
            on_close=self._on_socket_closed,
            options={
                zmq.MAXMSGSIZE: config.message_bytes_max,
                zmq.RECONNECT_IVL_MAX: int(config.peer_reconnect_max_s * 1000),
            },
        )
        self.counters = PeerLinkCounters()
        self._on_reply = on_reply  # the decoded items a peer sent back, in order, per read
        self._peers: dict[str, _Peer] = {}
        self._turn = TurnBatching(self._flush)

    def stop(self) -> None:
        """Stop reading what peers send back (before the sockets close)."""
        for peer in self._peers.values():
            if peer.reader is not None:
                peer.reader.close()

    def close(self) -> None:
        self.stop()
        self._pool.close_kind(SocketKind.PEER)

    def send(self, addr: str, msg: Outgoing) -> None:
        """Queue for the peer at ``addr``; what is queued in this loop turn leaves as one
        message per peer when the turn ends, except a lone message under light load
        (TurnBatching)."""
        peer = self._peer(addr)
        if self._turn.send_now():
            self._send(peer, [msg])
        else:
            peer.outbox.append(msg)

    def _flush(self) -> None:
        """Send what each peer has queued since the turn's first message."""
        for peer in self._peers.values():
            if peer.outbox:
                items, peer.outbox = peer.outbox, []
                self._send(peer, items)

    def _send(self, peer: _Peer, items: list[Outgoing]) -> None:
        """A send that cannot go (the peer's queue is full) is left to the ack timeout, which
        tries the next member."""
        for frame, count in peer_frames(items, self._config.message_bytes_max):
            try:
                peer.sock.send(frame, NOBLOCK)
            except zmq.Again:
                self.counters.sends_dropped += count
        kick(peer.sock)
        self._pool.touch(_PEER, peer.addr)

    def close_idle(self, members: set[str], now: float) -> int:
        """Close the connections to addresses outside ``members`` (the live members' rpc
        addresses) that have sent nothing for ``fanout.peer_idle_close_s``; how many."""
        closed = self._pool.close_idle(
            now,
            SocketKind.PEER,
            idle_s=self._config.peer_idle_close_s,
            keep=lambda addr: addr in members or bool(self._peers[addr].outbox),
        )
        self.counters.links_closed += closed
        return closed

    def _on_socket_closed(self, addr: str, reason: CloseReason) -> None:
        """The pool closes ``addr``'s socket: stop reading it first."""
        peer = self._peers.pop(addr)
        if peer.reader is not None:
            peer.reader.close()

    def __len__(self) -> int:
        return len(self._peers)

    def _peer(self, addr: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is None:
            sock = self._pool.open(SocketKind.PEER, addr)
            peer = _Peer(addr, sock)
            self._peers[addr] = peer
            peer.reader = SocketReader(sock, sock.recv, PEER_READ_MAX, self._on_frames)
        return peer

    def _on_frames(self, frames: list[bytes]) -> None:
        """One read's frames: their items go to the handler together (one flush of the
        forwarder's outputs for the batch, not one per ack)."""
        replies: list[object] = []
        for frame in frames:
            try:
                replies.extend(peer_items(frame, self._config.message_bytes_max))
            except RemoteProtocolError:
                self.counters.bad_messages += 1
        if replies:
            self._on_reply(replies)
