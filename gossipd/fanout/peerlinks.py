"""The forwarder's links to its peers, over a ``PeerClient`` (gossipd/peerchannel.py; in the
daemon ``zmq_peer_client``: one DEALER per peer's ROUTER at ``fanout.rpc_bind``, what comes
back, acks and TaskDones, read in each socket's fd callback).

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
from gossipd.core.peer_messages import (
    Confirm,
    Forward,
    ModelQuery,
    Moved,
    ReplayQuery,
    TaskDone,
    Withdraw,
)
from gossipd.errors import RemoteProtocolError, TransportClosed
from gossipd.fanout.owner import PEER_READ_MAX, peer_frames, peer_items
from gossipd.hostnames import HostNames
from gossipd.peerchannel import PeerClient, ZmqPeerClient
from gossipd.replysender import TurnBatching
from gossipd.sockets import SocketPool

Outgoing = (
    Forward | Cancel | Withdraw | TaskDone | Drain | Confirm | ModelQuery | ReplayQuery | Moved
)


def zmq_peer_client(
    config: FanoutConfig, sockets: SocketPool, names: HostNames | None = None
) -> ZmqPeerClient:
    """The daemon's channel to its peers: DEALERs from ``sockets`` with fan-out's limits;
    ``names``: where members' host names are looked up (hostnames.py)."""
    return ZmqPeerClient(
        sockets,
        names=names,
        options={
            zmq.MAXMSGSIZE: config.message_bytes_max,
            zmq.RECONNECT_IVL_MAX: int(config.peer_reconnect_max_s * 1000),
        },
        recv_batch_max=PEER_READ_MAX,
    )


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
        channel: PeerClient,
        on_reply: Callable[[list[object], str], None],
    ) -> None:
        self._config = config
        self._channel = channel
        self.counters = PeerLinkCounters()
        # The decoded items a peer sent back, in order, per read, with the peer's address.
        self._on_reply = on_reply
        # What waits for the end of this turn, per peer address (a new dict per busy turn).
        self._outbox: dict[str, list[Outgoing]] = {}
        self._turn = TurnBatching(self._flush)
        channel.start(self._on_frames)

    @property
    def channel_protocol_errors(self) -> int:
        return self._channel.protocol_errors

    def stop(self) -> None:
        """Stop reading what peers send back (before the connections close)."""
        self._channel.stop()

    def close(self) -> None:
        self._channel.close()

    def send(self, addr: str, msg: Outgoing) -> None:
        """Queue for the peer at ``addr``; what is queued in this loop turn leaves as one
        message per peer when the turn ends, except a lone message under light load
        (TurnBatching)."""
        if self._turn.send_now():
            self._send(addr, [msg])
            return
        queued = self._outbox.get(addr)
        if queued is None:
            self._outbox[addr] = [msg]
        else:
            queued.append(msg)

    def send_alone(self, addr: str, msg: Outgoing) -> None:
        """Send ``msg`` now, in a message of its own (never batched with others)."""
        self._send(addr, [msg])

    def _flush(self) -> None:
        """Send what each peer has queued since the turn's first message."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, {}
        for addr, items in out.items():
            self._send(addr, items)

    def _send(self, addr: str, items: list[Outgoing]) -> None:
        """A send that cannot go (the peer's queue is full, or its address is one no socket
        connects to) is left to the ack timeout, which tries the next member."""
        send = self._channel.send
        for frame, count in peer_frames(items, self._config.message_bytes_max):
            try:
                sent = send(addr, frame)
            except TransportClosed:  # stopping: what is left goes nowhere, as a dropped send
                sent = False
            except (ValueError, zmq.ZMQError):  # the address (gossip checks it: a backstop)
                sent = False
            if not sent:
                self.counters.sends_dropped += count

    def close_idle(self, members: set[str], now: float) -> int:
        """Close the connections to addresses outside ``members`` (the live members' rpc
        addresses) that have sent nothing for ``fanout.peer_idle_close_s``; how many."""
        outbox = self._outbox
        closed = self._channel.close_idle(
            now,
            self._config.peer_idle_close_s,
            keep=lambda addr: addr in members or addr in outbox,
        )
        self.counters.links_closed += closed
        return closed

    def __len__(self) -> int:
        return len(self._channel)

    def _on_frames(self, addr: str, frames: list[bytes]) -> None:
        """One read's frames: their items go to the handler together (one flush of the
        forwarder's outputs for the batch, not one per ack)."""
        replies: list[object] = []
        for frame in frames:
            try:
                replies.extend(peer_items(frame, self._config.message_bytes_max))
            except RemoteProtocolError:
                self.counters.bad_messages += 1
        if replies:
            self._on_reply(replies, addr)
