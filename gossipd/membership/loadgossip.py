"""Load gossip (issue 17): members' load records on their own budget, apart from SWIM's.

Every ``gossip.load_interval_s`` this daemon sends ``gossip.load_fanout`` random live
members one GossipOnly message that carries no membership updates, only load records: its
own newest sample and the newest it heard, newest first, within ``gossip.load_bytes_max``,
each record passed on at most ``gossip.load_transmits`` times (core/loadstate.py
``LoadRumors``).  Records received (on these messages or any gossip message's ``loads``)
go to the placer's ``LoadView``; the newer ones are passed on.  The owners' replies carry
load too (fanout/owner.py): this is for the members an entry point has not sent to lately.

Rounds run every ``gossip.load_interval_s`` while records wait to be passed on; when none
does (every record passed on as often as it may be, or no live peer to send to) the loop
sleeps until ``poke`` (our own load changed: the daemon pokes when a task is admitted or
ends), a record to pass on comes in, a member joins, or ``QUIET_RECHECK_S`` has passed (our
engine's figures can change with no task event).  An idle cluster sends no load gossip and
its daemons do not wake for it (issue 25: 20 wake-ups a second for nothing); a daemon that
gets busy says so at the next round, 50 ms later at most, as before.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.core.gossip_messages import GossipOnly, LoadRecord, encode_gossip
from gossipd.core.loadstate import LoadRumors, LoadView
from gossipd.core.membership import LIVE_STATES, MemberEvent
from gossipd.membership.gossip import GossipService, woken_within

QUIET_RECHECK_S = 1.0  # quiet: how often our own load is read for a change


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
        self._wake = asyncio.Event()  # something may be worth a round: see poke
        gossip.listeners.append(self._member_event)
        gossip.load_listeners.append(self.on_loads)  # records any gossip message carries
        self.sent_messages = 0
        self.sent_bytes = 0
        self.received_records = 0

    def poke(self, *_event: object) -> None:
        """Our load may have changed (a task admitted or ended: a listener of either, its
        arguments ignored): the next round reads it."""
        if not self._wake.is_set():
            self._wake.set()

    def _member_event(self, event: MemberEvent) -> None:
        if event.kind in ("joined", "alive"):  # someone new to tell
            self._wake.set()

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

    def send_once(self) -> bool:
        """One round; True while records wait to be passed on (the next round is due),
        False when there is nothing more to send, or nobody to send it to."""
        now = self._clock.monotonic()
        own = self._own()
        if own.seq != self._own_seq:
            self._own_seq = own.seq
            self.rumors.add(own, now - own.age_ms / 1000.0)
        peers = self._live_peers()
        if not peers:
            return False
        gossip = self._gossip
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
        return bool(self.rumors)

    async def run_forever(self) -> None:
        if self.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            self._wake.clear()
            if not self.send_once():
                await woken_within(QUIET_RECHECK_S, self._wake)
