"""SWIM dissemination at one member: what we gossip, piggybacked and in gossip rounds (sans-IO).

Owns: the transmit-limited broadcast queue (broadcast.py) of updates waiting to be told and
the gossip round schedule.  It sends through its SwimNode.

Rules:
1. One queued item per (node, family): a member's membership update (MEMBER) and its GPU
   metadata (META) queue apart, and a newer update replaces the queued one of its key.
   Leadership updates queue as one item for the term (TERM) and one per directive kind
   (DIRECTIVE): only the newest of each is worth telling (core/fencing.py).
2. Updates ride piggyback on every message we send, within piggyback_bytes_max; those about
   the recipient and about us go first.
3. Membership changes are urgent: while one is queued, every gossip interval we push what is
   queued to gossip_fanout random live members (a gossip round).  Metadata only rides along.
4. A gossip message with nothing to carry is not sent.
5. Terms and directives are urgent.  A directive larger than piggyback_bytes_max (up to
   64 KiB) rides only in gossip rounds, whose byte budget grows by its size while one is
   queued; piggyback on probes stays within piggyback_bytes_max.
6. With contained suspicions, a Dead gets twice the transmit limit: only a few members held
   the suspicion, so a member the Dead misses has no timer of its own to fall back on (it
   would learn only by probing the dead member itself, or by a checksum push-pull).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from gossipd.core.broadcast import BroadcastQueue
from gossipd.core.gossip_messages import (
    Dead,
    Directive,
    GossipOnly,
    Meta,
    Term,
    Update,
    encode_update,
)

if TYPE_CHECKING:
    from gossipd.core.swim import SwimNode

# Broadcast-queue families: one membership and one metadata item per node, one term, one
# directive per kind.
MEMBER, META, TERM, DIRECTIVE = 0, 1, 2, 3


def queue_key(update: Update) -> tuple[str, int]:
    if isinstance(update, Term):
        return ("", TERM)
    if isinstance(update, Directive):
        return (update.kind, DIRECTIVE)
    return (update.node, META if isinstance(update, Meta) else MEMBER)


class Dissemination:
    def __init__(self, swim: SwimNode, now: float) -> None:
        self._swim = swim
        self.broadcasts = self._new_queue()
        self.next_gossip_at = now
        self._large: dict[Hashable, int] = {}  # queued keys over the piggyback budget: size

    def _new_queue(self) -> BroadcastQueue:
        cfg = self._swim.config
        return BroadcastQueue(
            retransmit_mult=cfg.retransmit_mult, items_max=cfg.broadcast_queue_max
        )

    def forget(self) -> None:
        """Drop everything queued (a member bootstrapped as converged has nothing to tell)."""
        self.broadcasts = self._new_queue()

    def push(self, update: Update, *, urgent: bool) -> None:
        key = queue_key(update)
        size = len(encode_update(update))
        # Rule 6: with contained suspicions a death is told twice as often.
        twice = isinstance(update, Dead) and self._swim.config.contain_suspicions
        self.broadcasts.push(key, update, size, urgent=urgent, limit_mult=2 if twice else 1)
        if size > self._swim.config.piggyback_bytes_max:
            self._large[key] = size
        else:
            self._large.pop(key, None)

    def piggyback(
        self, first: Iterable[tuple[str, int]] | None = None, extra_bytes: int = 0
    ) -> list[Update]:
        """The updates to carry on one message, those keyed in ``first`` first."""
        swim = self._swim
        return self.broadcasts.select(
            swim.config.piggyback_bytes_max + extra_bytes, swim.table.live_count(), first or ()
        )

    def _large_bytes(self) -> int:
        """Rule 5: the budget a gossip round adds for a large queued directive."""
        if not self._large:
            return 0
        for key in [k for k in self._large if self.broadcasts.get(k) is None]:
            del self._large[key]
        return max(self._large.values(), default=0)

    def send_gossip_to(self, target: str) -> None:
        swim = self._swim
        updates = self.piggyback(
            first=[(target, MEMBER), (swim.node, MEMBER)], extra_bytes=self._large_bytes()
        )
        if updates:
            swim.send(swim.table.members[target].addr, GossipOnly(**swim.header(updates)))

    def tick(self, now: float) -> None:
        if self.broadcasts.urgent_pending and now >= self.next_gossip_at:
            self.next_gossip_at = now + self._swim.config.gossip_interval_s
            for target in self._swim.random_live_sample(self._swim.config.gossip_fanout):
                self.send_gossip_to(target)

    def next_deadline(self) -> float:
        """The next gossip round (inf while nothing urgent is queued, or nobody is there to
        hear it: a lone member does not wake to gossip to no one)."""
        if self.broadcasts.urgent_pending and self._swim.table.live_count() > 1:
            return self.next_gossip_at
        return math.inf
