"""Load gossip (issue 17): members' load records on their own budget, apart from SWIM's.

Every ``gossip.load_interval_s`` this daemon sends ``gossip.load_fanout`` random live
members one GossipOnly message that carries no membership updates, only load records: its
own newest sample and the newest it heard, newest first, within ``gossip.load_bytes_max``,
each record passed on at most ``gossip.load_transmits`` times (core/loadstate.py
``LoadRumors``).  Records received (on these messages or any gossip message's ``loads``)
go to the placer's ``LoadView``; the newer ones are passed on.  The owners' replies carry
load too (fanout/owner.py): this is for the members an entry point has not sent to lately.

When a round has nothing to send (no live peer, or every record passed on as often as it
may be) the loop sleeps until a record comes in, or ``QUIET_RECHECK_S`` has passed (our own
load is read then: it changes only while tasks come, and a new figure goes out at the next
round).  An idle cluster sends no load gossip and its daemons do not wake for it (issue 25:
20 wake-ups a second for nothing).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.core.gossip_messages import GossipOnly, LoadRecord, encode_gossip
from gossipd.core.loadstate import LoadRumors, LoadView
from gossipd.core.membership import LIVE_STATES
from gossipd.membership.gossip import GossipService, woken_within

QUIET_RECHECK_S = 1.0  # idle: how often our own load is read for a change


class LoadGossip:
    def __init__(
        self,
        gossip: GossipService,
        *,
        view: LoadView,
        on_load: Callable[[LoadRecord, float], bool],
        own: Callable[[], LoadRecord],
        rng: random.Random,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        g = gossip.config.gossip
        self._gossip = gossip
        self._view = view
        self._on_load = on_load
        self._own = own
        self._rng = rng
        self._clock = clock
        self.interval_s = g.load_interval_s
        self.fanout = g.load_fanout
        self.bytes_max = g.load_bytes_max
        self.rumors = LoadRumors(transmits=g.load_transmits, age_max_s=g.load_age_max_s)
        self._own_seq = -1
        self._peers: list[tuple[str, str]] = []
        self._peers_version: object = None
        self._wake = asyncio.Event()  # a record to pass on came in
        self.sent_messages = 0
        self.sent_bytes = 0
        self.received_records = 0

    def on_loads(self, records: list[LoadRecord]) -> None:
        """Records from any gossip message: the newer ones kept and passed on."""
        now = self._clock.monotonic()
        self.received_records += len(records)
        for record in records:
            if self._on_load(record, now):
                known = self._view.get(record.node)
                if known is not None:
                    self.rumors.add(record, known.sampled_at)
                    self._wake.set()

    def _live_peers(self) -> list[tuple[str, str]]:
        core = self._gossip.core
        assert core is not None
        table = core.table
        if table.version != self._peers_version:
            self._peers_version = table.version
            self._peers = [
                (name, m.addr)
                for name, m in table.members.items()
                if name != table.me and m.state in LIVE_STATES
            ]
        return self._peers

    def send_once(self) -> int:
        """One round: the messages sent (0: nothing to send, or nobody to send it to)."""
        now = self._clock.monotonic()
        own = self._own()
        if own.seq != self._own_seq:
            self._own_seq = own.seq
            self.rumors.add(own, now - own.age_ms / 1000.0)
        peers = self._live_peers()
        if not peers:
            return 0
        gossip = self._gossip
        sent = 0
        for name, addr in self._rng.sample(peers, min(self.fanout, len(peers))):
            records = self.rumors.take(now, self.bytes_max, exclude=name)
            if not records:
                continue
            data = encode_gossip(
                GossipOnly(
                    cluster=gossip.swim_config.cluster,
                    src=gossip.node,
                    src_addr=gossip.advertise,
                    loads=records,
                )
            )
            self.sent_messages += 1
            self.sent_bytes += len(data)
            gossip.send(addr, data)
            sent += 1
        return sent

    async def run_forever(self) -> None:
        if self.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            self._wake.clear()
            if not self.send_once():
                await woken_within(QUIET_RECHECK_S, self._wake)
