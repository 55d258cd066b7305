"""Leader-directed reaping (gossipd/core/reaping.py) and the member table's forget (rule 9 of
gossipd/core/membership.py); the seed choice."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import FanoutConfig
from gossipd.core.gossip_messages import Alive, Dead, GpuState, Left, MemberRecord, Meta, Suspect
from gossipd.core.membership import MemberTable, State
from gossipd.core.placer import Placer
from gossipd.core.reaping import (
    FORGET_DECODE_MAX,
    FORGET_MAX,
    SEEDS_MAX,
    ForgetBody,
    Reaper,
    SeedCandidate,
    choose_seeds,
)
from gossipd.core.ring import LoadCounts
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

ADDR = "tcp://10.0.0.1:7946"


def table() -> MemberTable:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    for node in ("a", "b", "c", "d"):
        t.apply(Alive(node=node, incarnation=3, addr=ADDR), 0.0)
    t.apply(Suspect(node="b", incarnation=3, by="a"), 1.0)
    t.apply(Dead(node="c", incarnation=3, by="a"), 1.0)
    t.apply(Left(node="d", incarnation=3), 1.0)
    return t


@pytest.mark.parametrize(
    ("node", "incarnation", "dropped"),
    [
        ("a", 9, False),  # alive: never forgotten
        ("b", 3, True),  # suspect at the named incarnation
        ("c", 3, True),  # dead
        ("c", 5, True),  # dead below the named incarnation
        ("c", 2, False),  # dead at a higher incarnation than named: a newer life
        ("d", 3, True),  # left
        ("zz", 3, False),  # unknown
    ],
)
def test_MemberTable_forget_drops_only_down_members_at_or_below_the_incarnation(
    node: str, incarnation: int, dropped: bool
) -> None:
    t = table()
    live, checksum, version = t.live_count(), t.checksum(), t.live_version
    assert t.forget(node, incarnation, 2.0) is dropped
    assert (node in t.members) is (not dropped and node != "zz")
    assert (node not in t.dead and node not in t.left and node not in t.suspects) or not dropped
    if dropped:
        assert t.live_version > version
        # A forgotten suspect was live: the live count and checksum follow.
        assert t.live_count() == live - (node == "b")
        assert (t.checksum() == checksum) is (node != "b")
    else:
        assert t.live_version == version and t.checksum() == checksum


def test_MemberTable_forgotten_member_comes_back_normally_and_a_stale_record_is_forgotten_again() -> (
    None
):
    t = table()
    assert t.forget("c", 3, 2.0)
    # A stale push-pull still holding c dead does not bring it back (memberlist's rule) ...
    assert (
        t.merge_record(MemberRecord(node="c", addr=ADDR, incarnation=3, state="dead"), sender="a")
        == []
    )
    # ... one holding it alive does (rule 7), and the leader's repeated forget drops it again.
    for update in t.merge_record(
        MemberRecord(node="c", addr=ADDR, incarnation=3, state="alive"), sender="a"
    ):
        t.apply(update, 3.0)
    assert t.members["c"].state is State.ALIVE
    t.apply(Dead(node="c", incarnation=3, by="a"), 3.5)
    assert t.forget("c", 3, 4.0) and "c" not in t.members
    # Back with a higher incarnation (a restart that refuted): re-admitted like a new member.
    out = t.apply(Alive(node="c", incarnation=4, addr=ADDR), 5.0)
    assert out.changed and out.event is not None and out.event.kind == "joined"
    assert t.members["c"].state is State.ALIVE
    # The old forget list no longer touches it (alive, and a higher incarnation).
    assert not t.forget("c", 3, 6.0)


def dead_table(deaths: dict[str, tuple[int, float]]) -> MemberTable:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    for node, (inc, at) in deaths.items():
        t.apply(Alive(node=node, incarnation=inc, addr=ADDR), 0.0)
        t.apply(Dead(node=node, incarnation=inc, by="me"), at)
    return t


def test_Reaper_names_members_dead_that_long_repeats_them_then_stops() -> None:
    t = dead_table({"x": (2, 10.0), "y": (0, 15.0)})
    t.apply(Alive(node="z", incarnation=0, addr=ADDR), 0.0)
    r = Reaper(dead_after_s=60.0, repeat_s=10.0, repeat_every_s=2.0)
    assert r.tick(t.members.values(), 69.9) is None
    assert r.tick(t.members.values(), 70.0) == [("x", 2)]
    assert r.tick(t.members.values(), 71.0) is None  # nothing new, repeated at most every 2 s
    t.forget("x", 2, 71.0)
    assert r.tick(t.members.values(), 72.0) == [("x", 2)]  # the repeat
    assert r.tick(t.members.values(), 75.0) == [("x", 2), ("y", 0)]  # y is new: at once
    assert r.tick(t.members.values(), 80.5) == [("y", 0)]  # x named 10.5 s ago: dropped
    t.forget("y", 0, 80.5)
    assert r.tick(t.members.values(), 90.0) is None and r.forgotten == 2


def test_Reaper_names_a_member_again_at_its_new_incarnation() -> None:
    t = dead_table({"x": (2, 0.0)})
    r = Reaper(dead_after_s=1.0, repeat_s=100.0, repeat_every_s=100.0)
    assert r.tick(t.members.values(), 1.0) == [("x", 2)]
    t.apply(Alive(node="x", incarnation=3, addr=ADDR), 2.0)
    t.apply(Left(node="x", incarnation=3), 2.0)
    assert r.tick(t.members.values(), 2.5) is None  # too recent
    assert r.tick(t.members.values(), 3.0) == [("x", 3)]


def test_Reaper_list_is_bounded_and_more_due_wait_for_room_each_name_repeated_whole() -> None:
    """(Trimmed oldest first, a backlog evicted each batch after one send, re-added the
    trimmed names as new every tick, and counted them forgotten each time.)"""
    t = dead_table({f"n{i:04d}": (0, 0.0) for i in range(FORGET_MAX + 5)})
    r = Reaper(dead_after_s=0.0, repeat_s=10.0, repeat_every_s=2.0)
    first = r.tick(t.members.values(), 1.0)
    assert first is not None and len(first) == FORGET_MAX
    assert r.forgotten == FORGET_MAX
    for node, inc in first:  # the leader's own table applies its directive
        assert t.forget(node, inc, 1.0)
    for now in (3.0, 5.0, 7.0, 9.0, 11.0):  # the same names, repeated for repeat_s
        assert r.tick(t.members.values(), now) == first
    assert r.forgotten == FORGET_MAX
    rest = r.tick(t.members.values(), 11.5)  # past repeat_s: room, for the 5 that waited
    assert rest is not None and r.forgotten == FORGET_MAX + 5
    assert {n for n, _ in rest} == {f"n{i:04d}" for i in range(FORGET_MAX + 5)} - {
        n for n, _ in first
    }


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.sampled_from(["alive", "suspect", "dead", "left", "forget"]),
            st.integers(0, 4),
        ),
        max_size=40,
    )
)
def test_MemberTable_forget_never_drops_a_live_newer_life_and_keeps_indexes_consistent(
    steps: list[tuple[str, str, int]],
) -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    now = 0.0
    for node, what, inc in steps:
        now += 1.0
        before = t.members.get(node)
        state_before = None if before is None else (before.state, before.incarnation)
        if what == "forget":
            dropped = t.forget(node, inc, now)
            if state_before is not None and state_before[0] is State.ALIVE:
                assert not dropped
            if state_before is not None and state_before[1] > inc:
                assert not dropped
        elif what == "alive":
            t.apply(Alive(node=node, incarnation=inc, addr=ADDR), now)
        elif what == "suspect":
            t.apply(Suspect(node=node, incarnation=inc, by="me"), now)
        elif what == "dead":
            t.apply(Dead(node=node, incarnation=inc, by="me"), now)
        else:
            t.apply(Left(node=node, incarnation=inc), now)
        live = [m for m in t.members.values() if m.state in (State.ALIVE, State.SUSPECT)]
        assert t.live_count() == 1 + len(live)
        for state, names in (
            (State.SUSPECT, t.suspects),
            (State.DEAD, t.dead),
            (State.LEFT, t.left),
        ):
            assert names == {m.node for m in t.members.values() if m.state is state}


def test_ForgetBody_is_bounded_and_typed() -> None:
    ok = msgspec.convert({"members": [["a", 1]]}, ForgetBody)
    assert ok.members == [("a", 1)]
    for bad in (
        {"members": [["", 1]]},
        {"members": [["a", -1]]},
        {"members": [["a", 1]] * (FORGET_DECODE_MAX + 1)},
        {"members": [["a", 1]], "extra": 1},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, ForgetBody)


def cand(node: str, state: str = "alive", status: str = "serving") -> SeedCandidate:
    return SeedCandidate(node, f"tcp://{node}:7946", state, status)


@pytest.mark.parametrize(
    ("current", "live", "chosen"),
    [
        ([], [cand("c"), cand("a"), cand("b"), cand("d")], ["a", "b", "c"]),
        # alive and serving first, then alive (draining), then suspect
        ([], [cand("a", "suspect"), cand("b", status="draining"), cand("c")], ["c", "b", "a"]),
        # current seeds stay while they qualify: only the dead one is replaced
        (["d", "c", "x"], [cand("a"), cand("b"), cand("c"), cand("d")], ["d", "c", "a"]),
        # a current seed that is draining is replaced by a serving one
        (["c"], [cand("a"), cand("c", status="draining")], ["a", "c"]),
        ([], [], []),
    ],
)
def test_choose_seeds(current: list[str], live: list[SeedCandidate], chosen: list[str]) -> None:
    def seed(n: str) -> str:
        return f"{n}@tcp://{n}:7946"

    got = choose_seeds([seed(n) for n in current], live)
    assert got == [seed(n) for n in chosen] and len(got) <= SEEDS_MAX


def test_Reaper_names_10000_due_at_once_quickly_and_its_directive_fits_the_body_bound() -> None:
    """10,000 members due in one tick (etcd was off for dead_reap_after_s, or enabled on a
    large cluster): the list is cut in one sort (a min per name took 3.2 s here, on the
    leader's event loop, past its lease), and FORGET_MAX of the longest names and
    incarnations fit a directive's body (500 did not: 70,012 bytes)."""
    import time

    from gossipd.core.gossip_messages import DIRECTIVE_BODY_BYTES_MAX, INCARNATION_MAX

    t = dead_table({f"n{i:05d}": (0, 0.0) for i in range(10_000)})
    r = Reaper(dead_after_s=0.0, repeat_s=1e9, repeat_every_s=0.0)
    began = time.process_time()
    names = r.tick(t.members.values(), 1.0)
    took = time.process_time() - began
    assert names is not None and len(names) == FORGET_MAX
    assert took < 0.5, took  # (the quadratic cut: 3.2 s)
    longest = [("x" * 127 + str(i % 10), INCARNATION_MAX) for i in range(FORGET_MAX)]
    body = msgspec.msgpack.encode(ForgetBody(members=longest))
    assert len(body) <= DIRECTIVE_BODY_BYTES_MAX, len(body)


def test_a_member_forgotten_while_suspect_is_reported_dead_and_leaves_placement() -> None:
    """A stale push-pull brought a dead member back as suspect, and the leader's repeated
    forget dropped it from the table: without an event the placer, which follows events
    only, kept it a candidate (a forwarding target, and a ring unlike its peers')."""
    node = SwimNode(SwimConfig(), node="me", addr=ADDR, rng=random.Random(1), now=0.0)
    node.bootstrap(0.0, [("me", ADDR), ("x", "tcp://10.0.0.2:7946")])
    gpu = GpuState(rpc="tcp://10.0.0.2:5558", status="serving", model="tiny")
    node.apply(Meta(node="x", version=1, gpu=gpu, incarnation=0), 0.5)
    placer = Placer(FanoutConfig(), node="me", loads=LoadCounts(), local_ids=set())
    placer.rebuild(node.table.members.values())
    node.apply(Suspect(node="x", incarnation=0, by="b"), 1.0)

    def deliver() -> list[str]:
        events = node.take_events()
        for event in events:  # as membership/gossip.py's flush passes them on
            placer.member_event(event, node.table.members.get(event.node))
        return [f"{e.kind} {e.node}" for e in events]

    deliver()
    assert "x" in placer.candidates()  # a suspect stays a candidate
    assert node.forget("x", 0, 2.0)
    assert deliver() == ["dead x"]
    assert "x" not in node.table.members and "x" not in placer.candidates()
    # A member already dead was reported then: forgetting it says nothing more.
    node.apply(Alive(node="y", incarnation=0, addr=ADDR), 3.0)
    node.apply(Dead(node="y", incarnation=0, by="b"), 3.5)
    assert deliver() == ["joined y", "dead y"]
    assert node.forget("y", 0, 4.0) and deliver() == []
