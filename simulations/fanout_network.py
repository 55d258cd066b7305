"""The simulated network, mixed into the world (simulations/fanout_world.py): one-way latency
(lognormal), per-link FIFO order (one ZeroMQ connection over TCP), loss of daemon-to-daemon
messages during a loss fault, partitions (groups that do not hear each other) and what a
killed daemon sent just before it died."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gossipd.core.messages import Chunk, Result
from gossipd.core.peer_messages import TaskDone
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
            self.deliver(d.index, dst, PEER_MSG, msg, lossy=True, delay=delay)

    def to_producer(self, d: SimDaemon, msg: Chunk | Result) -> None:
        if type(msg) is Result:
            self.results_sent.add((d.index, d.epoch, msg.id))
        latency = self.latency()
        link = (d.index, -1)
        at = max(self.now + latency, self.link_last.get(link, 0.0) + 1e-7)
        self.link_last[link] = at
        self.push(at, TO_PRODUCER, d.index, (d.index, d.epoch, self.now, msg))

    def lost_in_kill(self, src: int, epoch: int, sent_at: float) -> bool:
        crashed = self.crashed_at.get((src, epoch))
        return crashed is not None and sent_at > crashed - self.run.kill_loss_s
