"""The rolling drain's step logic (gossipd/core/rollout.py): its phases by table, and by
hypothesis over random membership views, including a leader change at any moment (the new
leader resumes from the stored JSON)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core import rollout
from gossipd.core.rollout import Order, Phase, Plan, Progress, Seen, advance, describe


def seen(node: str, inc: int = 0, status: str = "serving", inflight: int = 0) -> Seen:
    return Seen(node=node, incarnation=inc, status=status, inflight=inflight)


def view(*members: Seen) -> dict[str, Seen]:
    return {m.node: m for m in members}


ROLLING = Plan(id="p1", mode="rolling", step_timeout_s=30.0)


def test_rolling_plan_orders_every_live_member_by_name_with_the_leader_last() -> None:
    p, order = advance(ROLLING, None, view(seen("c"), seen("a"), seen("b")), "b", 100.0)
    assert p.order == ["a", "c", "b"] and p.node == "a" and p.phase is Phase.DRAIN
    assert order == Order(plan="p1", node="a", action="drain", issued_wall_s=100.0)
    assert describe(p) == "[1/3] a: drain (leader b)"


def test_a_member_goes_drain_restart_return_then_the_next() -> None:
    live = view(seen("a", 1), seen("b"))
    p, order = advance(ROLLING, None, live, "b", 0.0)
    assert order is not None and order.action == "drain"
    # Draining but still busy: keep ordering drain.
    p, order = advance(ROLLING, p, view(seen("a", 1, "draining", 3), seen("b")), "b", 1.0)
    assert p.phase is Phase.DRAIN and order is not None and order.action == "drain"
    # Idle: restart (rolling); its incarnation is remembered.
    p, order = advance(ROLLING, p, view(seen("a", 1, "draining", 0), seen("b")), "b", 2.0)
    assert p.phase is Phase.LEAVE and p.incarnation == 1
    assert order is not None and order.action == "restart"
    # Gone: wait for its return, ordering nothing.
    p, order = advance(ROLLING, p, view(seen("b")), "b", 3.0)
    assert p.phase is Phase.RETURN and order is None
    # Back at the same incarnation (not yet refuted), or not serving yet: still waiting.
    p, order = advance(ROLLING, p, view(seen("a", 1), seen("b")), "b", 4.0)
    assert p.phase is Phase.RETURN
    p, order = advance(ROLLING, p, view(seen("a", 2, ""), seen("b")), "b", 4.5)
    assert p.phase is Phase.RETURN
    # Back serving at a higher incarnation: the next member (the leader itself).
    p, order = advance(ROLLING, p, view(seen("a", 2), seen("b")), "b", 5.0)
    assert (p.index, p.node, p.phase) == (1, "b", Phase.DRAIN)
    assert order == Order(plan="p1", node="b", action="drain", issued_wall_s=5.0)
    assert p.steps == ["a: restarted and serving again"]


def test_a_drain_plan_orders_leave_and_does_not_wait_for_a_return() -> None:
    plan = Plan(id="d", mode="drain", nodes=["b", "a"])
    p, order = advance(plan, None, view(seen("a"), seen("b", 4, "draining")), "a", 0.0)
    assert p.order == ["b", "a"] and p.phase is Phase.LEAVE
    assert order is not None and (order.node, order.action) == ("b", "leave")
    p, order = advance(plan, p, view(seen("a")), "a", 1.0)
    assert (p.node, p.phase) == ("a", Phase.DRAIN) and p.steps == ["b: drained and left"]
    # A member that came back already (higher incarnation) also ends its LEAVE.
    p2 = msgspec.structs.replace(p, phase=Phase.LEAVE, incarnation=0)
    p2, _ = advance(plan, p2, view(seen("a", 1)), "a", 2.0)
    assert p2.status == "done" and p2.message == "2 members done"
    assert describe(p2) == "done: 2 members done"


def test_a_member_not_live_at_its_turn_is_skipped_and_an_empty_plan_is_done() -> None:
    plan = Plan(id="d", mode="drain", nodes=["gone", "a"])
    p, order = advance(plan, None, view(seen("a")), "a", 0.0)
    assert p.steps == ["gone: not live when its turn came; skipped"]
    assert order is not None and order.node == "a"
    p, order = advance(ROLLING, None, {}, "x", 0.0)
    assert p.status == "done" and order is None


def test_timeouts_drain_goes_on_leave_and_return_fail() -> None:
    plan = Plan(id="t", mode="rolling", nodes=["a"], step_timeout_s=10.0)
    busy = view(seen("a", 0, "draining", 5))
    p, _ = advance(plan, None, busy, "x", 0.0)
    p, order = advance(plan, p, busy, "x", 10.5)
    assert p.phase is Phase.LEAVE and order is not None and order.action == "restart"
    assert p.steps == ["a: still 5 in flight after 10 s"]
    p, order = advance(plan, p, busy, "x", 21.0)
    assert p.status == "failed" and order is None and "did not leave" in p.message
    assert describe(p).startswith("FAILED: ")
    # Final: nothing changes any more.
    assert advance(plan, p, {}, "x", 99.0) == (p, None)
    p = Progress(plan="t", order=["a"], phase=Phase.RETURN, phase_since_s=0.0)
    p, _ = advance(plan, p, {}, "x", 5.0)
    assert p.status == "running"
    p, _ = advance(plan, p, {}, "x", 10.5)
    assert p.status == "failed" and "did not come back serving" in p.message


def test_progress_of_another_plan_starts_over() -> None:
    old = Progress(plan="old", order=["z"], index=0, phase=Phase.RETURN)
    p, order = advance(ROLLING, old, view(seen("a")), "a", 0.0)
    assert p.plan == "p1" and p.order == ["a"] and order is not None


@pytest.mark.parametrize(
    "bad",
    [
        {"id": "x", "mode": "drain"},  # drain names members
        {"id": "x", "mode": "rolling", "nodes": ["a", "a"]},
        {"id": "", "mode": "rolling"},
        {"id": "x", "mode": "sideways"},
        {"id": "x", "mode": "rolling", "step_timeout_s": 0},
        {"id": "x", "mode": "rolling", "surprise": 1},
    ],
)
def test_Plan_refuses_what_it_cannot_run(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        rollout.plan_decoder.decode(msgspec.json.encode(bad))


# -- hypothesis: a cluster whose members drain, restart and come back at random --------------

NODES = ["a", "b", "c", "d"]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Plan, list[tuple[dict[str, Seen], bool]]]:
    mode = draw(st.sampled_from(["drain", "rolling"]))
    nodes = draw(st.permutations(NODES)) if mode == "drain" else []
    plan = Plan(id="h", mode=mode, nodes=nodes[: draw(st.integers(1, 4))], step_timeout_s=5.0)
    steps = []
    for _ in range(draw(st.integers(1, 60))):
        live = {}
        for n in NODES:
            if draw(st.booleans()) or n == "a":
                live[n] = seen(
                    n,
                    draw(st.integers(0, 3)),
                    draw(st.sampled_from(["serving", "draining", ""])),
                    draw(st.integers(0, 2)),
                )
        steps.append((live, draw(st.booleans())))  # True: the leader changes before this look
    return plan, steps


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_advance_invariants_and_resume_after_a_leader_change(
    world: tuple[Plan, list[tuple[dict[str, Seen], bool]]],
) -> None:
    plan, steps = world
    progress: Progress | None = None
    stored = b""
    drained_idle: set[str] = set()
    now = 0.0
    for live, leader_changes in steps:
        now += 1.0
        if leader_changes and stored:  # the new leader knows only what etcd holds
            progress = rollout.progress_decoder.decode(stored)
        before = progress
        for n, m in live.items():
            if m.status == "draining" and m.inflight == 0:
                drained_idle.add(n)
        new, order = advance(plan, progress, live, "a", now)
        # The same inputs give the same answer, from memory or from the stored JSON.
        if progress is not None:
            again = rollout.progress_decoder.decode(msgspec.json.encode(progress))
            assert advance(plan, again, live, "a", now) == (new, order)
        if before is not None and before.plan == plan.id:
            assert new.order == before.order
            assert new.index >= before.index
            if before.status != "running":
                assert (new, order) == (before, None)
        assert new.index <= len(new.order)
        if order is not None:
            assert new.status == "running" and order.node == new.node
            assert order.node in live  # only a live member is told anything
            if order.action == "drain":
                assert new.phase is Phase.DRAIN
            else:
                assert new.phase is Phase.LEAVE
                assert order.action == ("leave" if plan.mode == "drain" else "restart")
                # leave/restart only once it was idle, or its drain timed out
                assert order.node in drained_idle or any("in flight" in s for s in new.steps)
        if new.status == "done":
            assert new.index == len(new.order)
        progress = new
        stored = msgspec.json.encode(new)


@pytest.mark.parametrize("index", [-1, -4, 4])
def test_a_stored_progress_whose_index_is_out_of_range_does_not_decode(index: int) -> None:
    """(-1 took the last member, the leader, first; -4 raised IndexError in advance every
    tick; past len(order) is no member.)  An unreadable progress starts the plan over."""
    stored = msgspec.json.encode(
        {"plan": "p", "order": ["a", "b", "c"], "index": index, "phase": "drain"}
    )
    with pytest.raises(msgspec.ValidationError):
        rollout.progress_decoder.decode(stored)
    done = rollout.progress_decoder.decode(
        msgspec.json.encode({"plan": "p", "order": ["a", "b", "c"], "index": 3})
    )
    assert done.node is None


def test_a_stored_progress_with_a_field_of_a_later_version_is_read() -> None:
    """A rolling upgrade mixes versions: a newer leader's progress with a field this version
    lacks is read (it was refused, and the plan started over: done members drained again)."""
    stored = msgspec.json.encode(
        {"plan": "p", "order": ["a", "b", "c"], "index": 2, "phase": "drain", "later": 1}
    )
    progress = rollout.progress_decoder.decode(stored)
    assert progress.index == 2 and progress.node == "c"


def test_the_leaders_drain_order_is_sent_again_on_time_after_the_wall_clock_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order is sent again every REPUBLISH_S (a member may have missed the one gossip
    carried); timed by the wall clock, a step back of X s held the re-sends off for X s,
    and a member that missed the order waited out the plan's step_timeout_s."""
    import asyncio
    import time
    from types import SimpleNamespace

    from gossipd.leader import rollout as duty
    from gossipd.leader.duties import Fenced

    monkeypatch.setattr(duty, "ROLLOUT_TICK_S", 0.02)
    monkeypatch.setattr(duty, "REPUBLISH_S", 0.2)
    plan = Plan(id="p1", mode="drain", nodes=["b"], step_timeout_s=3600.0)
    stored: dict[str, Progress | None] = {"progress": None}

    async def read_stored(client: object, prefix: str) -> duty.Stored:
        return duty.Stored(plan, stored["progress"], 1, 1)

    monkeypatch.setattr(duty, "read_stored", read_stored)
    published: list[float] = []

    async def put(key: str, value: bytes, unchanged: object) -> Fenced:
        stored["progress"] = msgspec.json.decode(value, type=Progress)
        return Fenced.OK

    async def check(unchanged: object) -> Fenced:
        return Fenced.OK

    ctx = SimpleNamespace(
        client=None, prefix="/gossipd/t/", fenced_put_if=put, fenced_check=check,
        publish=lambda kind, body: published.append(time.monotonic()),
    )  # fmt: skip
    member_b = SimpleNamespace(node="b", incarnation=1, gpu=None)
    gossip = SimpleNamespace(
        core=SimpleNamespace(table=SimpleNamespace(incarnation=1)),
        live_members=lambda: [member_b], load=lambda: 0,
    )  # fmt: skip
    walls = iter([1_000_000.0])  # the first reading; every later one an hour earlier

    def wall() -> float:
        return next(walls, 1_000_000.0 - 3600.0)

    runner = duty.Rollout(
        node="a", gossip=gossip, admin=SimpleNamespace(status=lambda: "serving"),  # type: ignore[arg-type]
        stop=lambda status: None, started_wall_s=0.0, wall=wall,
    )  # fmt: skip

    async def main() -> None:
        task = asyncio.ensure_future(runner.duty(ctx))
        await asyncio.sleep(1.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(published) >= 4, published  # the first, then about every 0.2 s
