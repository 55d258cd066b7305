"""Races in the leader's election and duties, against a real etcd (the reviewer's findings of
the leader code): a drain and an undrain handled in one loop turn; the operator's
``gossipd cluster drain --cancel`` landing while the rollout duty is between its read and its
write; the leader's key deleted by hand.  Where a race needs an interleaving, the test forces
it (a wrapped read), and etcd is real."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from gossipd.config import EtcdConfig
from gossipd.core import rollout as core_rollout
from gossipd.core.election import Phase
from gossipd.leader import build_leadership
from gossipd.leader import rollout as leader_rollout
from gossipd.leader.client import EtcdClient
from gossipd.leader.duties import Fenced, LeaderContext
from gossipd.leader.rollout import Rollout, plan_key, progress_key
from gossipd.tools.cluster import run_drain
from tests.etcd_cluster import EtcdCluster
from tests.helpers import wait_until_async
from tests.test_leader_duties import _config, _Gossip, _run, _stop

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
            await _stop(tasks, lead)

    asyncio.run(main())


# -- the rollout duty and `gossipd cluster drain --cancel` ------------------------------------
# The duty reads the plan and its progress, decides, then stores the new progress and gossips
# the order.  A cancel (the CLI deletes both keys) landing after the read must get neither:
# the duty's put, or its check before an order, is one transaction that requires both keys
# still as read (PROTOCOL.md, "Keys in etcd the duties use").

PREFIX = "/gossipd/default"


class _Table:
    incarnation = 1


class _Core:
    table = _Table()


class _Member:
    def __init__(self, node: str) -> None:
        self.node = node
        self.incarnation = 3
        self.gpu = type("Gpu", (), {"status": "serving", "inflight": 0})()


class _RolloutGossip:
    """A leader seeing m1, m2, m3 live and serving."""

    core = _Core()

    def live_members(self) -> list[Any]:
        return [_Member("m1"), _Member("m2"), _Member("m3")]

    def load(self) -> int:
        return 0


class _Admin:
    drained = False

    def status(self) -> str:
        return "serving"


@pytest.mark.parametrize(
    "case",
    [
        # The plan was just handed: the duty's first read sees no progress, and the cancel
        # lands before its write: it must not store a progress or order m1 to drain.
        "fresh plan, cancel after the read",
        # m2 in hand: the duty's read sees it; the cancel lands before it (re)publishes.
        "member in hand, cancel after the read",
        # The reviewer's interleaving: the plan read before the cancel, the progress after
        # it (absent): the duty would start the dropped plan over with m1, already upgraded.
        "member in hand, cancel between the plan's read and the progress's",
    ],
)
def test_a_cancelled_plan_gets_no_progress_and_no_order_after_the_cancel(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    async def main() -> None:
        cfg = EtcdConfig(endpoints=etcd.endpoints, ttl_s=2.0, request_timeout_s=1.0)
        client = EtcdClient(cfg)
        await client.connect()
        # Our campaign key, as the election puts it: the fence of the duty's writes.
        lease = await client.lease(10)
        leader_key = f"{PREFIX}/election/{lease.id:016x}".encode()
        await client.put(leader_key, b"leader", lease=lease)
        got = await client.get(leader_key)
        assert got is not None
        token = got.create_revision

        plan = core_rollout.Plan(id="p1", mode="rolling", created_wall_s=time.time())
        await client.put(plan_key(PREFIX), msgspec.json.encode(plan))
        if not case.startswith("fresh"):
            progress = core_rollout.Progress(
                plan="p1",
                order=["m1", "m2", "m3", "leader"],
                index=1,
                phase=core_rollout.Phase.DRAIN,
                phase_since_s=time.time(),
                steps=["m1: restarted and serving again"],
                leader="leader",
            )
            await client.put(progress_key(PREFIX), msgspec.json.encode(progress))

        cancelled_at: list[float] = []
        cancelling: list[bool] = []  # (the CLI's own read goes through the same function)
        real_read = leader_rollout.read_stored

        async def read_then_cancel(client: Any, prefix: str) -> Any:
            stored = await real_read(client, prefix)
            if not cancelling and stored.plan is not None:
                cancelling.append(True)
                # the operator's `gossipd cluster drain --cancel`, landing just now
                await run_drain(cfg, "default", nodes=[], rolling=False, follow=False,
                                cancel=True, step_timeout_s=300.0, timeout_s=0.0,
                                say=lambda _: None)  # fmt: skip
                cancelled_at.append(time.monotonic())
                if "between" in case:
                    stored = leader_rollout.Stored(
                        plan=stored.plan,
                        progress=None,
                        plan_revision=stored.plan_revision,
                        progress_revision=0,
                    )
            return stored

        monkeypatch.setattr(leader_rollout, "read_stored", read_then_cancel)
        published: list[tuple[float, object]] = []

        def publish(kind: str, body: object) -> bool:
            published.append((time.monotonic(), body))
            return True

        ctx = LeaderContext(
            token=token,
            node="leader",
            client=client,
            prefix=PREFIX,
            leader_key=leader_key,
            request_timeout_s=1.0,
            _publish=publish,
            _members=lambda: [],
        )
        ro = Rollout(node="leader", gossip=_RolloutGossip(), admin=_Admin(),  # type: ignore[arg-type]
                     stop=lambda status: None, started_wall_s=time.time(), wall=time.time)  # fmt: skip
        duty = asyncio.ensure_future(ro.duty(ctx))
        try:
            await wait_until_async(lambda: cancelled_at, 5, "the cancel")
            # The duty reads again (every ROLLOUT_TICK_S while a plan runs, else every
            # IDLE_TICK_S): give it two of its idle turns.
            await asyncio.sleep(2 * leader_rollout.IDLE_TICK_S + 0.2)
            assert not duty.done(), "the duty goes on (a cancel does not depose the leader)"
        finally:
            duty.cancel()
            await asyncio.gather(duty, return_exceptions=True)
        after = [body for t, body in published if t >= cancelled_at[0]]
        stored = await client.get(progress_key(PREFIX))
        # What the duty's transactions tell apart: a key moved (read again) from deposed.
        gone = {plan_key(PREFIX): 0, progress_key(PREFIX): 0}
        assert await ctx.fenced_check(gone) is Fenced.OK
        assert await ctx.fenced_check({plan_key(PREFIX): token}) is Fenced.CHANGED
        await client.revoke_lease(lease.id)
        assert await ctx.fenced_check(gone) is Fenced.DEPOSED
        assert ctx.fenced_writes["changed"] >= 2 and ctx.fenced_writes["refused"] == 1
        await client.close()
        assert after == [], f"orders published after the cancel: {after}"
        assert stored is None, f"progress stored after the cancel: {stored.value!r}"

    asyncio.run(main())


# -- the leader's key deleted by hand -----------------------------------------------------------


def test_the_leaders_key_deleted_by_hand_steps_it_down_before_the_next_leads(
    etcd: EtcdCluster,
) -> None:
    """``etcdctl del`` of the leader's campaign key (its lease alive: say, while cleaning the
    stray keys the daemon warns of): the next candidate, which watches that key, leads at
    once; the old leader steps down as the deletion reaches it, not at its next look up to
    a TTL later (PROTOCOL.md, Leadership 2): the two lead together for a moment at most
    (usually not at all; on a loaded host CI saw the successor first), and the old leader
    campaigns again with a new key.  With an 8 s TTL, the look a TTL later overlapped them
    for 0-8 s."""

    async def main() -> None:
        config = _config(etcd.endpoints, ttl_s=8.0)
        a = build_leadership(config, node="a", gossip=_Gossip("a"))
        b = build_leadership(config, node="b", gossip=_Gossip("b"))
        assert a is not None and b is not None
        story: list[tuple[str, str]] = []
        at: dict[str, float] = {}
        deposed, elected = a.election._on_deposed, b.election._on_elected

        def a_deposed(reason: str) -> None:
            story.append(("a", f"deposed {reason}"))
            at.setdefault("a deposed", time.monotonic())
            deposed(reason)

        def b_elected(token: int) -> None:
            story.append(("b", "elected"))
            at.setdefault("b elected", time.monotonic())
            elected(token)

        a.election._on_deposed, b.election._on_elected = a_deposed, b_elected
        tasks = await _run([a])
        try:
            await wait_until_async(lambda: a.is_leader, 10, "a to lead")
            tasks += await _run([b])
            await wait_until_async(
                lambda: b.election.core.phase is Phase.CANDIDATE, 5, "b a candidate"
            )
            await asyncio.sleep(0.2)  # b watches a's key; a is in its TTL-long wait
            old_key, old_token = a.election.key, a.token
            await a.election.client.delete(old_key)  # by hand: a's lease still lives
            await wait_until_async(lambda: ("b", "elected") in story, 2.0, "b to lead")
            await wait_until_async(lambda: "a deposed" in at, 1.0, "a to step down")
            assert ("a", "deposed key_gone") in story, story
            assert abs(at["a deposed"] - at["b elected"]) < 1.0, (story, at)
            assert not a.is_leader and b.token > old_token
            await wait_until_async(
                lambda: a.election.core.phase is Phase.CANDIDATE and a.election.key != old_key,
                5,
                "a a candidate again, with a new key",
            )
            assert not a.is_leader and b.is_leader
        finally:
            await _stop(tasks, a, b)

    asyncio.run(main())
