"""The leader duties every daemon with etcd runs (issue 15), wired to the daemon's parts:

    seeds     gossipd/leader/seeding.py   keep <prefix>/seeds pointing at live members
    reaping   gossipd/leader/reaping.py   have everyone forget members dead that long
    rollout   gossipd/leader/rollout.py   carry out `gossipd cluster drain` plans

and their member sides: the ``forget`` and ``drain`` directive handlers, and, for a daemon
without gossip.seeds, joining through the seeds in etcd.  (Token budgets are wired apart.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gossipd.leader.reaping import FORGET, Reaping
from gossipd.leader.rollout import DRAIN, Rollout
from gossipd.leader.seeding import SeedRegistry, join_through_etcd

if TYPE_CHECKING:
    from gossipd.admin import Admin
    from gossipd.config import Config
    from gossipd.membership.gossip import GossipService


class BuiltinDuties:
    def __init__(
        self,
        config: Config,
        *,
        node: str,
        leadership: Any,
        gossip: GossipService,
        admin: Admin,
        stop: Callable[[int], None],
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``wall``: the wall clock, for what other hosts compare (the seeds' times in etcd,
        drain orders); ``monotonic``: for its own intervals (the drain order's re-sends);
        the SWIM core's own time is ``gossip.now()``."""
        self._config = config
        self._leadership = leadership
        self._gossip = gossip
        self.seeds = SeedRegistry(gossip, node=node, status=admin.status, wall=wall)
        self.reaping = Reaping(gossip, dead_after_s=config.membership.dead_reap_after_s)
        self.rollout = Rollout(
            node=node, gossip=gossip, admin=admin, stop=stop, started_wall_s=wall(), wall=wall,
            monotonic=monotonic,
        )  # fmt: skip
        leadership.duties.register("seeds", self.seeds.duty)
        leadership.duties.register("reaping", self.reaping.duty)
        leadership.duties.register("rollout", self.rollout.duty)
        leadership.directives.subscribe(FORGET, self.reaping.on_forget)
        leadership.directives.subscribe(DRAIN, self.rollout.on_order)

    async def run_forever(self) -> None:
        """Join through the seeds in etcd whenever we know no live member: with no
        gossip.seeds, and also beside them when none of them answers (docs/OPERATIONS.md:
        both work together)."""
        client = self._leadership.election.client
        await join_through_etcd(
            client.get,
            self._leadership.prefix,
            self._gossip,
            configured=list(self._config.gossip.seeds),
        )

    def statistics(self) -> dict[str, Any]:
        orders = self.rollout.orders
        directives = self._leadership.directives  # (bodies that did not decode; handler bugs)
        refused = {
            "bad_body": self.reaping.refused + orders.get("bad:refused", 0) + directives.bad_body
        }
        if directives.handler_errors:
            refused["handler_error"] = directives.handler_errors
        done: dict[str, int] = {}
        for key, count in orders.items():
            action, _, outcome = key.partition(":")
            if outcome == "ok":
                done[action] = count
            elif action != "bad":
                refused[outcome] = refused.get(outcome, 0) + count
        return {
            "seed_writes": self.seeds.writes,
            "forgotten": self.reaping.forgotten_here,
            "refused": refused,
            "drain_orders": done,
        }
