"""The simulated network, mixed into the world (simulations/fanout_world.py): one-way latency
(lognormal), per-link FIFO order (one ZeroMQ connection over TCP), loss of daemon-to-daemon
messages during a loss fault, partitions (groups that do not hear each other) and what a
killed daemon sent just before it died.

What travels is the wire's bytes, as on ZeroMQ: a fan-out message is encoded by the
production codec (``encode_peer``) when sent and decoded by it (``decode_peer``, with the
daemon's size limit) when it arrives; a reply to the producer likewise (``encode`` /
``decode_reply``), and a producer's task (fanout_producers.py). A frame the codec cannot
read back is an invariant violation (``undecodable``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from gossipd.core.codec import decode_intake, decode_reply
from gossipd.core.messages import Cancel, Chunk, Result, Task, encode
from gossipd.core.peer_messages import PeerBatch, PeerMessage, TaskDone, decode_peer, encode_peer
from gossipd.errors import RemoteProtocolError
from simulations.fanout_run import PEER_MSG, TO_PRODUCER

if TYPE_CHECKING:
    from simulations.fanout_daemon import SimDaemon


class Network:
    """Delivery between daemons and to the producer; the state it reads (``group``, ``loss``,
    ``link_last``, ``crashed_at``) is the world's, set by the faults (fanout_faults.py)."""

    def deliver(
        self, src: int, dst: int, kind: int, payload: object, *, lossy: bool, delay: float = 0.0
    ) -> None:
        if self.group[src] != self.group[dst]:
            return
        if lossy and self.loss and self.rng.random() < self.loss:
            return
        latency = self.latency()
        at = self.now + delay + latency
        link = (src, dst)
        last = self.link_last.get(link, 0.0)
        if at <= last:
            at = last + 1e-7  # one connection keeps its order (ZeroMQ over TCP)
        self.link_last[link] = at
        self.push(at, kind, dst, (src, self.daemons[src].epoch, self.now + delay, payload))

    def latency(self) -> float:
        """One message's one-way latency: lognormal around run.latency_s."""
        return self.run.latency_s * math.exp(0.5 * self.rng.gauss(0.0, 1.0))

    def send_peer(self, d: SimDaemon, member: str, msg: object, delay: float = 0.0) -> None:
        if type(msg) is TaskDone and (d.index, d.epoch, msg.id) not in self.results_sent:
            self.violation("taskdone_before_result", msg.id, d.name)
        dst = self.by_name.get(member)
        if dst is not None:
            frame = encode_peer(msg)  # type: ignore[arg-type]
            self.deliver(d.index, dst, PEER_MSG, frame, lossy=True, delay=delay)

    def peer_items(self, frame: bytes, at: str) -> tuple[PeerMessage, ...]:
        """The fan-out messages in a frame that arrived at ``at``, decoded by the daemon's
        codec (``decode_peer``: size, schema, version); none (and a violation) when it cannot
        read its own frame.  The owner endpoint's further checks (each batched item's
        version, CURVE's sender against the message's source) are not simulated."""
        try:
            msg = decode_peer(frame, bytes_max=self.fanout_config.message_bytes_max)
        except RemoteProtocolError as exc:
            self.violation("undecodable", exc.hint[:80], at)
            return ()
        return tuple(msg.items) if type(msg) is PeerBatch else (msg,)

    def intake_of(self, frame: bytes, key: str, at: str) -> Task | Cancel | None:
        """A producer's frame as the ingress decodes it (``decode_intake``, the ingress's
        size limit), stamped with its connection's ``key`` as the ingress stamps a CURVE
        key; None, and a violation, for anything but a readable Task or Cancel."""
        try:
            msg = decode_intake(frame, bytes_max=self.ingress_bytes_max)
        except RemoteProtocolError as exc:
            self.violation("undecodable", exc.hint[:80], at)
            return None
        if type(msg) is not Task and type(msg) is not Cancel:
            self.violation("undecodable", f"a {type(msg).__name__}, not a Task", at)
            return None
        return msgspec.structs.replace(msg, producer_key=key)

    def to_producer(self, d: SimDaemon, msg: Chunk | Result) -> None:
        if type(msg) is Result:
            self.results_sent.add((d.index, d.epoch, msg.id))
        latency = self.latency()
        link = (d.index, -1)
        at = max(self.now + latency, self.link_last.get(link, 0.0) + 1e-7)
        self.link_last[link] = at
        self.push(at, TO_PRODUCER, d.index, (d.index, d.epoch, self.now, encode(msg)))

    def reply_of(self, frame: bytes) -> Chunk | Result | None:
        """A reply frame as the producer decodes it (None, and a violation, if it cannot)."""
        try:
            return decode_reply(frame)
        except RemoteProtocolError as exc:
            self.violation("undecodable", exc.hint[:80], "producer")
            return None

    def lost_in_kill(self, src: int, epoch: int, sent_at: float) -> bool:
        crashed = self.crashed_at.get((src, epoch))
        return crashed is not None and sent_at > crashed - self.run.kill_loss_s
