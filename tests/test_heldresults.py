"""core/heldresults.py: Results held while their forwarder is not alive, and the ledger's
answer to a Confirm (core/forwarded.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.forwarded import ForwardedLedger
from gossipd.core.heldresults import Decision, HeldResults, forwarder_view
from gossipd.core.membership import Member, State
from gossipd.core.messages import PROTOCOL_VERSION, Task
from gossipd.core.peer_messages import CONFIRM_IDS_MAX
from gossipd.core.ring import LoadCounts

ALIVE = {"f": True}


def _alive(member: str) -> bool:
    return ALIVE.get(member, False)


def test_held_until_the_forwarder_says_migrated_then_dropped() -> None:
    held = HeldResults(bytes_max=1000)
    assert held.hold("a", "f", 10, deadline=30.0, now=1.0)
    assert held.hold("b", "f", 10, deadline=30.0, now=1.0)
    assert held.bytes == 20 and len(held) == 2
    assert held.take_confirms() == []  # not alive yet: nothing asked
    held.member_alive("f", 5.0)
    assert held.take_confirms() == [("f", ["a", "b"])]
    held.on_reply("f", still_mine=["b"], migrated=["a"], unknown=[])
    assert held.take_decisions() == [("a", Decision.DROP), ("b", Decision.SEND)]
    assert held.bytes == 0 and len(held) == 0
    assert held.counters.dropped_migrated == 1 and held.counters.sent_confirmed == 1
    assert held.next_deadline() == float("inf")


def test_the_deadline_heap_stays_near_what_is_held_behind_an_early_deadline() -> None:
    """One Result held with an early deadline kept every ended one behind it in the heap
    (only the head's stale entries were popped): 200,001 entries for 1 held in the helper
    audit's run.  Now the heap is rebuilt from what is held when it passes 2x of it."""
    held = HeldResults(bytes_max=1 << 20)
    assert held.hold("early", "f-down", 10, deadline=30.0, now=0.0)
    for i in range(10_000):
        assert held.hold(f"t{i}", "f", 10, deadline=600.0, now=0.0)
        held.on_reply("f", still_mine=[f"t{i}"], migrated=[], unknown=[])
        assert held.take_decisions() == [(f"t{i}", Decision.SEND)]
        assert held.next_deadline() <= 30.0
    assert len(held) == 1
    assert len(held._deadlines) <= 2 * len(held) + 64
    held.tick(30.0, _alive)  # the early one still leaves at its deadline
    assert held.take_decisions() == [("early", Decision.SEND)]


def test_unknown_is_sent_and_a_reply_from_another_member_changes_nothing() -> None:
    held = HeldResults(bytes_max=1000)
    held.hold("a", "f", 10, deadline=30.0, now=0.0)
    held.on_reply("g", still_mine=[], migrated=["a"], unknown=[])  # not a's forwarder
    assert held.take_decisions() == [] and "a" in held
    held.on_reply("f", still_mine=[], migrated=[], unknown=["a", "zz"])
    assert held.take_decisions() == [("a", Decision.SEND)]
    assert held.counters.sent_unknown == 1


def test_sent_at_the_deadline_without_an_answer() -> None:
    held = HeldResults(bytes_max=1000, confirm_every_s=1.0)
    held.hold("a", "f", 10, deadline=3.0, now=0.0)
    assert held.next_deadline() == 1.0  # a look at who is alive
    held.tick(1.0, _alive)
    assert held.take_confirms() == [("f", ["a"])]  # alive: asked
    held.tick(1.5, _alive)
    assert held.take_confirms() == []  # asked within confirm_every_s
    held.tick(2.0, _alive)
    assert held.take_confirms() == [("f", ["a"])]  # no answer: asked again
    held.tick(3.0, _alive)
    assert held.take_decisions() == [("a", Decision.SEND)]
    assert held.counters.sent_deadline == 1
    held.on_reply("f", still_mine=[], migrated=["a"], unknown=[])  # too late: sent already
    assert held.take_decisions() == []


def test_not_held_past_the_budget_or_the_deadline() -> None:
    held = HeldResults(bytes_max=15)
    assert held.hold("a", "f", 10, deadline=9.0, now=0.0)
    assert not held.hold("b", "f", 10, deadline=9.0, now=0.0)  # no room
    assert not held.hold("c", "f", 1, deadline=9.0, now=9.0)  # its deadline has passed
    assert not held.hold("a", "f", 1, deadline=9.0, now=0.0)  # held already
    assert held.counters.not_held == 3 and held.bytes == 10


def test_a_withdraw_from_its_forwarder_drops_it() -> None:
    held = HeldResults(bytes_max=1000)
    held.hold("a", "f", 10, deadline=9.0, now=0.0)
    held.withdrawn("a", "g")  # not its forwarder
    assert held.take_decisions() == []
    held.withdrawn("a", "f")
    assert held.take_decisions() == [("a", Decision.DROP)]
    assert held.counters.dropped_migrated == 1


def test_a_forwarder_that_left_gets_its_held_results_sent() -> None:
    """Rule 7: a graceful leave migrates nothing; the Results held for it go out, others
    stay held."""
    held = HeldResults(bytes_max=1000)
    held.hold("a", "f", 10, deadline=9.0, now=0.0)
    held.hold("b", "g", 10, deadline=9.0, now=0.0)
    held.member_left("f")
    assert held.take_decisions() == [("a", Decision.SEND)]
    assert "b" in held and "a" not in held and held.counters.sent_left == 1


def test_a_resubmission_answered_from_the_cache_ends_the_hold() -> None:
    held = HeldResults(bytes_max=1000)
    held.hold("a", "f", 10, deadline=9.0, now=0.0)
    assert held.answered("a") and not held.answered("a")
    held.tick(9.0, _alive)
    assert held.take_decisions() == []
    assert held.counters.sent_resubmitted == 1


def test_confirms_come_in_pieces() -> None:
    held = HeldResults(bytes_max=1 << 30)
    for i in range(CONFIRM_IDS_MAX + 5):
        held.hold(f"t{i}", "f", 1, deadline=9.0, now=0.0)
    held.member_alive("f", 0.0)
    sizes = [len(ids) for _, ids in held.take_confirms()]
    assert sizes == [CONFIRM_IDS_MAX, 5]


def _task(task_id: str) -> Task:
    return Task(v=PROTOCOL_VERSION, id=task_id, prompt="p", reply_to="tcp://127.0.0.1:1")


def test_the_ledger_answers_a_confirm() -> None:
    ledger = ForwardedLedger(LoadCounts(), entries_max=100)
    ledger.accepted(_task("mine"), "o", 0.0)
    ledger.accepted(_task("moved"), "o2", 0.0)  # migrated off o, now with o2
    ledger.moved_off("moved", "o")
    ledger.moved_off("done", "o")  # migrated, and its new owner answered already
    assert ledger.confirm(["mine", "moved", "done", "never"], "o") == (
        ["mine"],
        ["moved", "done"],
        ["never"],
    )
    assert ledger.confirm(["moved"], "o2") == (["moved"], [], [])


# Operations on a HeldResults: (kind, task index, member index, time step).
_ops = st.lists(
    st.tuples(
        st.sampled_from(["hold", "alive", "reply", "answered", "tick", "withdraw", "left"]),
        st.integers(0, 7),
        st.integers(0, 2),
        st.floats(0.0, 2.0),
        st.sampled_from(["still", "migrated", "unknown"]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(5, 80))
def test_every_held_result_is_sent_or_dropped_once_by_its_deadline(ops, bytes_max) -> None:
    """Whatever order the inputs come in: each held Result ends exactly once, dropped only
    on its own forwarder's "migrated" or Withdraw, and none is left once every deadline has
    passed."""
    held = HeldResults(bytes_max=bytes_max, confirm_every_s=0.5)
    members = ["f", "g", "h"]
    alive = {m: False for m in members}
    now = 0.0
    holders: dict[str, str] = {}  # task id -> the forwarder it was held under
    deadlines: dict[str, float] = {}
    said_migrated: set[tuple[str, str]] = set()
    ended: dict[str, str] = {}  # task id -> "send" / "drop" / "answered"
    for kind, t, m, step, verdict in ops:
        now += step
        task_id, member = f"t{t}", members[m]
        if kind == "hold":
            if task_id not in ended and task_id not in holders:
                deadline = now + 1.0 + t
                if held.hold(task_id, member, 10, deadline, now):
                    holders[task_id], deadlines[task_id] = member, deadline
        elif kind == "alive":
            alive[member] = not alive[member]
            if alive[member]:
                held.member_alive(member, now)
        elif kind == "reply":
            lists = {"still": [], "migrated": [], "unknown": []}
            lists[verdict].append(task_id)
            if verdict == "migrated":
                said_migrated.add((task_id, member))
            held.on_reply(member, lists["still"], lists["migrated"], lists["unknown"])
        elif kind == "withdraw":
            said_migrated.add((task_id, member))
            held.withdrawn(task_id, member)
        elif kind == "left":
            held.member_left(member)
            assert all(h != member for t, h in holders.items() if t in held), "left: all sent"
        elif kind == "answered":
            if held.answered(task_id):
                assert task_id not in ended
                ended[task_id] = "answered"
        else:
            held.tick(now, alive.__getitem__)
        for task_id2, decision in held.take_decisions():
            assert task_id2 in holders and task_id2 not in ended  # never twice
            if decision is Decision.DROP:
                assert (task_id2, holders[task_id2]) in said_migrated
            ended[task_id2] = decision.value
        held.take_confirms()
        assert held.bytes == 10 * len(held) <= bytes_max
    # Past every deadline: nothing is left held (ticks due no later than the last one).
    last = max(now, *deadlines.values()) if deadlines else now
    while held.next_deadline() != float("inf"):
        now = max(now, held.next_deadline())
        held.tick(now, alive.__getitem__)
        for task_id2, _decision in held.take_decisions():
            assert task_id2 not in ended
            ended[task_id2] = "send"
        assert now <= last
    assert set(ended) == set(holders)
    assert held.bytes == 0


def test_at_shutdown_everything_held_is_sent() -> None:
    held = HeldResults(bytes_max=1000)
    held.hold("a", "f", 10, deadline=9.0, now=0.0)
    held.hold("b", "g", 10, deadline=9.0, now=0.0)
    assert sorted(held.end_all()) == ["a", "b"]
    assert held.bytes == 0 and held.counters.sent_shutdown == 2
    assert held.next_deadline() == float("inf")


def test_the_ledger_remembers_the_latest_migrations(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("gossipd.core.forwarded.MOVED_MAX", 2)
    ledger = ForwardedLedger(LoadCounts(), entries_max=100)
    for task_id in ("a", "b", "c"):
        ledger.moved_off(task_id, "o")
    assert ledger.confirm(["a", "b", "c"], "o") == ([], ["b", "c"], ["a"])


def test_a_task_moved_twice_is_migrated_for_every_member_it_left() -> None:
    """The simulator's seed 6 (partition): moved off o, then off o2, then done at o3; o, cut
    off while its Result waited for the Confirm, asks after the heal and must hear
    "migrated" (it heard "unknown" when only the last member moved off was remembered, and
    answered a second time)."""
    ledger = ForwardedLedger(LoadCounts(), entries_max=100)
    ledger.moved_off("t", "o")
    ledger.moved_off("t", "o2")
    ledger.moved_off("t", "o2")  # remembered once
    assert ledger.confirm(["t"], "o") == ([], ["t"], [])
    assert ledger.confirm(["t"], "o2") == ([], ["t"], [])
    assert ledger.confirm(["t"], "o3") == ([], [], ["t"])


def _offer(
    held: HeldResults,
    task_id: str,
    view: str,
    *,
    received_at: float,
    now: float,
    deadline: float = 30.0,
) -> bool:
    return held.offer(
        task_id, "f", 10, received_at=received_at, deadline=deadline, now=now, view=view
    )


def test_rule_0_suspect_holds_only_while_the_forwarder_is_or_was_down() -> None:
    held = HeldResults(bytes_max=1000)
    assert not _offer(held, "a", "alive", received_at=1.0, now=2.0)  # alive all along
    assert _offer(held, "b", "down", received_at=1.0, now=2.0)
    assert held.take_confirms() == []  # down: asked once it is alive
    held.member_event("suspect", "f", 3.0)
    held.member_event("alive", "f", 3.5)  # refuted: b is asked now
    assert held.take_confirms() == [("f", ["b"])]
    assert _offer(held, "c", "alive", received_at=2.5, now=4.0)  # down since c came
    # d came after f was back, with 0.4 s left: sent at most 0.4 s before it came, when f
    # was alive again: nothing says f moved it.
    assert not _offer(held, "d", "alive", received_at=3.9, now=4.0, deadline=4.3)
    # d2 came after f was back too, but with 26 s left: its Forward may have waited in a
    # connection stalled by the cut that made f suspect (TCP delivers it after the heal,
    # long after f's ack timeout sent the task elsewhere): held and asked.
    assert _offer(held, "d2", "alive", received_at=4.0, now=4.0)
    assert held.take_confirms() == [("f", ["c", "d2"])]
    held.on_reply("f", still_mine=["c"], migrated=["d2"], unknown=[])
    assert held.take_decisions() == [("d2", Decision.DROP), ("c", Decision.SEND)]
    held.member_event("refuted", "me", 5.0)  # we were suspected: anyone may have migrated
    assert _offer(held, "e", "alive", received_at=4.5, now=5.5, deadline=6.0)
    assert held.take_confirms() == [("f", ["e"])]  # asked at once, alive
    assert not _offer(held, "g", "gone", received_at=4.5, now=5.5)  # left or unknown


def test_rule_0_always_holds_every_forwarded_result_and_asks_at_once() -> None:
    held = HeldResults(bytes_max=1000, always=True)
    assert _offer(held, "a", "alive", received_at=1.0, now=1.1)
    assert _offer(held, "b", "alive", received_at=1.0, now=1.1)
    assert _offer(held, "c", "down", received_at=1.0, now=1.1)  # held, asked later
    assert not _offer(held, "d", "gone", received_at=1.0, now=1.1)
    assert held.take_confirms() == [("f", ["a", "b"])]  # one Confirm for the turn
    held.on_reply("f", still_mine=["a"], migrated=["b"], unknown=[])
    assert held.take_decisions() == [("b", Decision.DROP), ("a", Decision.SEND)]
    held.member_event("left", "f", 2.0)  # rule 7: a forwarder that left migrated nothing
    assert held.take_decisions() == [("c", Decision.SEND)]
    assert len(held) == 0 and held.bytes == 0


def test_the_forwarder_view_comes_from_its_table_entry() -> None:
    """One derivation for the daemon's ResultHolder and the simulator: unknown or left ->
    "gone" (never held), alive -> "alive" (asked at once), suspect or dead -> "down"."""

    def entry(state: State) -> Member:
        return Member(node="f", addr="a", incarnation=1, state=state, state_since=0.0)

    assert forwarder_view(None) == "gone"
    assert forwarder_view(entry(State.LEFT)) == "gone"
    assert forwarder_view(entry(State.ALIVE)) == "alive"
    assert forwarder_view(entry(State.SUSPECT)) == "down"
    assert forwarder_view(entry(State.DEAD)) == "down"


def test_members_down_longer_ago_than_any_task_can_look_back_are_forgotten() -> None:
    """Rule 0 remembers when each member was last suspect or dead: one entry for every name
    ever seen down, for good.  Past twice the longest timeout no offer looks that far back,
    so those are dropped as the map grows; a recent one still holds a Result."""
    from gossipd.core.heldresults import LOOK_BACK_S

    held = HeldResults(bytes_max=1 << 20)
    for i in range(1000):
        held.member_event("dead", f"old-{i}", float(i))
    now = LOOK_BACK_S + 2000.0
    for i in range(1000):
        held.member_event("suspect", f"new-{i}", now + i / 1000)
    assert len(held._last_down) < 1100  # (the old 1,000 gone)
    assert all(name.startswith("new-") for name in held._last_down)
    # A Result from a member down a moment ago is still held (rule 0 sees it).
    assert held.offer("t", "new-5", 10, received_at=now + 1, deadline=now + 31, now=now + 2,
                      view="alive")  # fmt: skip
