"""Reaping: which members the leader tells everyone to forget, and the seeds it keeps in etcd
(sans-IO).

Rules:
1. A member the leader has held dead or left for ``dead_reap_after_s`` (by its own table's
   ``state_since``) is due: the leader gossips a ``forget`` directive naming it with the
   incarnation it died at; every member (the leader too) drops it from its table
   (core/membership.py rule 9).
2. Each forgotten member stays in the directive's list for ``repeat_s`` after it was first
   named (at most ``FORGET_MAX`` names; more due wait for room): a member that missed one
   directive, or had the forgotten member brought back by a stale push-pull meanwhile,
   forgets it with the next one.  The directive is sent again every ``repeat_every_s`` while
   its list is not empty; never when it is.
3. A member named again at a higher incarnation (it came back, and died again) is due again
   at that incarnation.

Seeds (``choose_seeds``): up to ``SEEDS_MAX`` live members, alive (not suspect) and serving
first; the seeds already published stay while they qualify, so that the etcd value changes
only when a seed does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from gossipd.core.gossip_messages import INCARNATION_MAX
from gossipd.core.membership import Member, State

# Names a forget directive carries: at the longest name (128 bytes) and incarnation a pair
# encodes to 140 bytes, 400 of them 56,012: under the 64 KiB body bound, which 500 passed
# (70,012).  A receiver takes up to FORGET_DECODE_MAX (what earlier versions sent).
FORGET_MAX = 400
FORGET_DECODE_MAX = 500
SEEDS_MAX = 3

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Incarnation = Annotated[int, msgspec.Meta(ge=0, le=INCARNATION_MAX)]


class ForgetBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of a ``forget`` directive (docs/PROTOCOL.md): [node, incarnation] pairs."""

    members: Annotated[list[tuple[_Name, _Incarnation]], msgspec.Meta(max_length=FORGET_DECODE_MAX)]


class Reaper:
    def __init__(self, *, dead_after_s: float, repeat_s: float, repeat_every_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.repeat_s = repeat_s
        self.repeat_every_s = repeat_every_s
        self._named: dict[str, tuple[int, float]] = {}  # node -> (incarnation, first named)
        self._sent_at = float("-inf")
        self.forgotten = 0  # members named for the first time (at an incarnation)

    def tick(self, members: Iterable[Member], now: float) -> list[tuple[str, int]] | None:
        """The (node, incarnation) list to send in a forget directive now, or None."""
        for node, (_, at) in list(self._named.items()):
            if now - at > self.repeat_s:
                del self._named[node]
        new = False
        for m in members:
            if m.state not in (State.DEAD, State.LEFT):
                continue
            if now - m.state_since < self.dead_after_s:
                continue
            named = self._named.get(m.node)
            if named is None and len(self._named) >= FORGET_MAX:
                # Full: it waits for room (a name leaves repeat_s after it was first named),
                # so that each name is repeated its whole period; one taking the place of a
                # name sent once would be sent once itself, and the next tick's the same.
                continue
            if named is None or named[0] < m.incarnation:
                self._named[m.node] = (m.incarnation, now)
                self.forgotten += 1
                new = True
        if not self._named:
            return None
        if not new and now - self._sent_at < self.repeat_every_s:
            return None
        self._sent_at = now
        return sorted((node, inc) for node, (inc, _) in self._named.items())


@dataclass(frozen=True, slots=True)
class SeedCandidate:
    node: str
    addr: str  # its gossip address
    state: str  # alive or suspect
    status: str  # its gossiped status; "" while unknown


def choose_seeds(current: Sequence[str], live: Iterable[SeedCandidate]) -> list[str]:
    """Seeds as "NODE@ADDR" (rule above): keep the current ones that still qualify, fill up
    with the others by preference (alive and serving, then alive, then suspect), by name."""
    by_seed = {f"{c.node}@{c.addr}": c for c in live}

    def rank(seed: str) -> tuple[int, str]:
        c = by_seed[seed]
        return (
            0 if c.state == "alive" and c.status == "serving" else 1 if c.state == "alive" else 2,
            seed,
        )

    kept = [s for s in current if s in by_seed and rank(s)[0] == 0][:SEEDS_MAX]
    rest = sorted((s for s in by_seed if s not in kept), key=rank)
    return kept + rest[: SEEDS_MAX - len(kept)]
