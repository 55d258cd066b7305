"""Leadership in one daemon: the etcd election, the term in gossip, leader duties and the
member side of directives, composed (``build_leadership``; the daemon calls it once).

- Elected: publish our Term (leader, token) by gossip at once, and again every TTL; start the
  duties with a LeaderContext of the token.
- Stepped down (lease expired, lost, resigned): cancel the duties.
- A Term that raised ours (from gossip): logged as ``term_observed``; admitted directives go
  to their subscribers (``Directives``).
- Drained (gossipd drain) or shutting down: resign (step down at once, then revoke the
  lease: the next candidate leads within milliseconds); undrained: campaign again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import Config
from gossipd.core.fencing import Fence
from gossipd.core.gossip_messages import Directive, Term
from gossipd.errors import StartupError
from gossipd.leader.directives import Directives
from gossipd.leader.duties import LeaderContext, LeaderDuties
from gossipd.leader.election import EtcdElection

log = logging.getLogger("gossipd.leader")

RESTART_S = 1.0


class Leadership:
    def __init__(
        self, config: Config, *, node: str, gossip: Any, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._clock = clock
        if gossip is None or gossip.core is None:
            raise StartupError(
                "etcd.endpoints needs membership (gossip.bind): the leader's term and "
                "directives travel by gossip"
            )
        self.config = config
        self.node = node
        self._gossip = gossip
        self.fence: Fence = gossip.core.fence
        self.duties = LeaderDuties()
        self.directives = Directives()
        self.election = EtcdElection(
            config.etcd,
            node=node,
            cluster=config.node.cluster,
            on_elected=self._elected,
            on_deposed=self._deposed,
            clock=clock,
        )
        self.prefix = self.election.prefix
        self._seq = 0  # our directives' seq: only ever grows in this process
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False  # resign() or close() began: an undrain campaigns no more
        self.publish_refused = 0
        gossip.leadership_listeners.append(self._on_gossip)

    @property
    def is_leader(self) -> bool:
        return self.election.leading

    @property
    def term(self) -> Term | None:
        """The highest term this daemon has seen (ours while we lead)."""
        return self.fence.term

    @property
    def token(self) -> int:
        """Our token while we lead, else 0."""
        return self.election.token

    async def run_forever(self) -> None:
        """The election and the term's announcements; a failure of ours (a bug, not etcd's:
        those are retried inside) is logged and the election starts again: the data path
        never depends on it."""
        while True:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.election.run_forever(), name="election")
                    tg.create_task(self._announce_forever(), name="term-announce")
            except Exception:
                log.exception("leader election failed; starting it again in %s s", RESTART_S)
            self.duties.stop()
            # Its key goes now, not at its TTL: the next leader (or our next key) waits not.
            lease_id, self.election.abandoned_lease = self.election.abandoned_lease, 0
            await self.election.revoke(lease_id)
            await asyncio.sleep(RESTART_S)
            if not self.election.resigned:
                self.election.core.restart()

    async def _announce_forever(self) -> None:
        """The leader re-announces its term every TTL (joiners, members that missed it)."""
        while True:
            await asyncio.sleep(self.config.etcd.ttl_s)
            if self.is_leader:
                self._gossip.publish_term(Term(leader=self.node, token=self.token))

    def _elected(self, token: int) -> None:
        if token < self.fence.token:
            log.warning(
                "elected with token %d below the highest seen (%d): our directives will be "
                "refused; was etcd's data reset?",
                token,
                self.fence.token,
            )
        self._gossip.publish_term(Term(leader=self.node, token=token))
        self.duties.start(
            LeaderContext(
                token=token,
                node=self.node,
                client=self.election.client,
                prefix=self.prefix,
                leader_key=self.election.key,
                request_timeout_s=self.config.etcd.request_timeout_s,
                _publish=self._publish,
                _members=self._gossip.live_members,
            )
        )

    def _deposed(self, reason: str) -> None:
        self.duties.stop()

    def _publish(self, kind: str, body_obj: object) -> bool:
        if not self.is_leader:
            self.publish_refused += 1
            return False
        self._seq += 1
        directive = Directive(
            leader=self.node,
            token=self.token,
            seq=self._seq,
            kind=kind,
            body=msgspec.msgpack.encode(body_obj),
        )
        if not self._gossip.publish_directive(directive):
            self.publish_refused += 1
            return False
        return True

    def _on_gossip(self, item: Term | Directive) -> None:
        if isinstance(item, Term):
            log.info(
                "term_observed",
                extra={
                    "token": item.token,
                    "leader": item.leader,
                    "node": self.node,
                    "t_wall": self._clock.wall(),
                },
            )
        else:
            self.directives.deliver(item)

    # -- drain, shutdown --------------------------------------------------------------------

    def on_drain(self, drained: bool) -> None:
        """gossipd drain: resign (a drained daemon does not lead); undrain: campaign again.

        The step-down is done here, at once; only the lease's revoke waits (a task).  A drain
        and an undrain handled in one loop turn (the ingress reads every waiting frame in one
        callback) then leave a candidate: a resign scheduled for later ran after the undrain's
        rejoin, and the daemon never campaigned again."""
        if not drained and self._stopping:
            return  # an undrain while the daemon stops (resigned): it campaigns no more
        if drained:
            self.duties.stop()
            lease_id = self.election.resign_nowait()
            if lease_id:
                loop = asyncio.get_running_loop()
                task = loop.create_task(self.election.revoke(lease_id), name="revoke")
                self._tasks.append(task)
                task.add_done_callback(self._tasks.remove)
        else:
            self.election.rejoin()

    async def resign(self) -> None:
        """The daemon stops: step down, revoke the lease, and campaign no more."""
        self._stopping = True
        self.duties.stop()
        await self.election.resign()

    async def close(self) -> None:
        """Also where the daemon's parts failed and it skipped ``resign``: the lease is
        revoked if still held (its key went only at its TTL: a failover of seconds)."""
        self._stopping = True
        self.duties.stop()
        if not self.election.resigned:
            await self.election.resign()
        await self.election.close()

    def statistics(self) -> dict[str, Any]:
        fence = self.fence.statistics()
        return {
            "is_leader": self.is_leader,
            "term_token": self.fence.token,
            "elections": self.election.core.elections,
            "step_downs": dict(self.election.core.step_downs),
            "etcd_errors": self.election.errors,
            "etcd_failovers": self.election.client.failovers,
            "directives_refused": dict(fence.refused),
            "directives_admitted": fence.directives_admitted,
            "publish_refused": self.publish_refused,
        }
