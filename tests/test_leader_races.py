"""Races in the leader's election and duties, against a real etcd: a drain and an undrain
handled in one loop turn."""

from __future__ import annotations

import asyncio

from gossipd.core.election import Phase
from gossipd.leader import build_leadership
from tests.etcd_cluster import EtcdCluster
from tests.helpers import wait_until_async
from tests.test_leader_duties import _config, _Gossip, _run

# -- a drain and an undrain in one loop turn -------------------------------------------------


def test_a_drain_then_an_undrain_in_one_loop_turn_leave_a_candidate(etcd: EtcdCluster) -> None:
    """The ingress reads every waiting frame in one callback: two admin messages (or the
    leader's drain order and an operator's undrain) can be handled in one turn.  The undrained
    daemon campaigns again (PROTOCOL.md, Leadership 3); drain, undrain, drain leaves it
    resigned."""

    async def main() -> None:
        lead = build_leadership(_config(etcd.endpoints), node="a", gossip=_Gossip("a"))
        assert lead is not None
        tasks = await _run([lead])
        try:
            token = await wait_until_async(lambda: lead.is_leader and lead.token, 10, "a leader")
            lead.on_drain(True)
            lead.on_drain(False)
            assert not lead.is_leader, "a drained leader steps down at once"
            await wait_until_async(
                lambda: lead.is_leader and lead.token > token, 6, "the undrained one to lead"
            )
            assert not lead.election.resigned

            lead.on_drain(True)
            lead.on_drain(False)
            lead.on_drain(True)
            assert not lead.is_leader and lead.election.resigned
            await wait_until_async(lambda: not lead._tasks, 5, "the lease's revoke")
            assert lead.election.core.phase is Phase.RESIGNED and not lead.is_leader
            left = await lead.election.client.get_prefix(lead.election.election_prefix)
            assert len(left) == 0, "no campaign key of ours left"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await lead.close()

    asyncio.run(main())
