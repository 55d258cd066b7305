"""Reaping, the leader's side and every member's (core/reaping.py has the rules).

The duty: every ``REAP_TICK_S`` the leader looks at its member table and gossips a fenced
``forget`` directive naming the members dead or left for ``membership.dead_reap_after_s``
(and, for ``repeat_s``, those it named before).  Every member, the leader too, drops them
from its table (core/membership.py rule 9).  Without etcd nothing of this runs: members
forget the dead on their own after gossip.swim.dead_reap_s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.core.reaping import ForgetBody, Reaper

if TYPE_CHECKING:
    from gossipd.membership.gossip import GossipService

log = logging.getLogger("gossipd.leader.reaping")

FORGET = "forget"  # the directive's kind
REAP_TICK_S = 0.5
REPEAT_MIN_S = 10.0  # core/reaping.py rule 2
REPEAT_EVERY_S = 2.0


class Reaping:
    def __init__(self, gossip: GossipService, *, dead_after_s: float) -> None:
        self._gossip = gossip  # (its now(): the SWIM core's time, as member.state_since)
        self.dead_after_s = dead_after_s
        self.forgotten_here = 0  # members dropped from our table by forget directives
        self.refused = 0  # forget directives whose body did not decode

    async def duty(self, ctx: Any) -> None:
        """Runs while we lead (cancelled when we step down)."""
        # A forgotten name is repeated for a while: longer than a suspicion lasts, so that a
        # stale push-pull's resurrection (suspect, then dead) is forgotten again.
        core = self._gossip.core
        suspicion_max_s = core.table.suspicion_max_s if core is not None else 3.0
        reaper = Reaper(
            dead_after_s=self.dead_after_s,
            repeat_s=max(REPEAT_MIN_S, 3 * suspicion_max_s),
            repeat_every_s=REPEAT_EVERY_S,
        )
        while True:
            core = self._gossip.core
            if core is not None:
                table = core.table
                down = [table.members[n] for n in (*table.dead, *table.left)]
                names = reaper.tick(down, self._gossip.now())
                if names:
                    named = [n for n, _ in names]
                    log.info("forget", extra={"members": named, "token": ctx.token})
                    ctx.publish(FORGET, {"members": [list(n) for n in names]})
            await asyncio.sleep(REAP_TICK_S)

    def on_forget(self, directive: Any, body: object) -> None:
        """A forget directive admitted here (every member, the leader included)."""
        try:
            forget = msgspec.convert(body, ForgetBody)
        except msgspec.ValidationError as exc:
            self.refused += 1
            log.warning("forget directive refused: bad body", extra={"error": str(exc)})
            return
        core = self._gossip.core
        if core is None:
            return
        now = self._gossip.now()
        gone = [node for node, inc in forget.members if core.forget(node, inc, now)]
        if gone:
            self.forgotten_here += len(gone)
            log.info("forgotten", extra={"members": gone})

    def statistics(self) -> dict[str, int]:
        return {"forgotten": self.forgotten_here, "refused": self.refused}
