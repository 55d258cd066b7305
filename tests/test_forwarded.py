"""The forwarder's ledger of accepted forwards: acks and TaskDones in any order (as the
forwarder hands them to it), duplicates, withdrawn copies and the size bound leave it
consistent with the load counts."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.forwarded import ForwardedLedger
from gossipd.core.messages import PROTOCOL_VERSION, Task
from gossipd.core.ring import LoadCounts

MEMBERS = ["a", "b", "c"]
# Tasks 0.. forwarded to these members in turn (the owners the property tests draw).
OWNERS = st.lists(st.sampled_from(MEMBERS), min_size=1, max_size=12)


def _task(n: int) -> Task:
    return Task(v=PROTOCOL_VERSION, id=f"t{n}", prompt="p", reply_to="tcp://127.0.0.1:5555")


def _replay(events: list[tuple[str, int, str]]) -> tuple[ForwardedLedger, LoadCounts]:
    """A fresh ledger after ``events``: ("accept" or "done", task number, member), handed to
    it as the forwarder does (core/forwarder.py): a TaskDone that comes before the accept of
    its Forward stands for that accept (``finished``), and the accept that follows finds its
    Forward ended (not handed on)."""
    outstanding = LoadCounts()
    ledger = ForwardedLedger(outstanding, entries_max=100)
    accepted: set[tuple[int, str]] = set()
    done_first: set[tuple[int, str]] = set()
    for kind, n, member in events:
        if kind == "accept":
            if (n, member) not in done_first:
                ledger.accepted(_task(n), member, 0.0)
            accepted.add((n, member))
        elif (n, member) in accepted or (n, member) in done_first:
            ledger.done(f"t{n}", member)
        else:
            ledger.finished(f"t{n}", member)
            done_first.add((n, member))
    return ledger, outstanding


def _accepts_and_dones(owners: list[str]) -> list[tuple[str, int, str]]:
    """Task n's accept by ``owners[n]``, then each task's TaskDone from its owner."""
    return [(kind, n, m) for kind in ("accept", "done") for n, m in enumerate(owners)]


@given(owners=OWNERS, data=st.data())
def test_accept_and_TaskDone_in_either_order_leave_nothing_behind(
    owners: list[str], data: st.DataObject
) -> None:
    """Each task's accept and its owner's TaskDone (sometimes delivered twice) arrive in any
    interleaving: at the end nothing is ledgered and every member's count is back to 0."""
    events = _accepts_and_dones(owners)
    events += data.draw(st.lists(st.sampled_from(events[len(owners) :]), max_size=4))
    events = data.draw(st.permutations(events))
    ledger, outstanding = _replay(events)
    assert len(ledger) == 0
    assert all(count == 0 for count in outstanding.values())


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["accept", "done", "finished", "forget"]),
            st.integers(0, 5),
            st.sampled_from(MEMBERS),
        ),
        max_size=60,
    ),
    entries_max=st.integers(1, 4),
)
def test_ledger_keeps_counts_and_rules_under_any_sequence(
    ops: list[tuple[str, int, str]], entries_max: int
) -> None:
    outstanding = LoadCounts()
    ledger = ForwardedLedger(outstanding, entries_max=entries_max)
    for kind, n, member in ops:
        task_id = f"t{n}"
        before = ledger.get(task_id)
        if kind == "accept":
            ledger.accepted(_task(n), member, 0.0)
            after = ledger.get(task_id)
            assert after is not None and after.owner == member
            assert ledger.finished_by(member, [task_id]) == [], "running again"
        elif kind == "done":
            ledger.done(task_id, member)
            after = ledger.get(task_id)
            if before is not None and before.owner == member:
                assert after is None
                assert ledger.finished_by(member, [task_id]) == [task_id]
            else:
                assert after is before, "another copy's TaskDone leaves the entry"
        elif kind == "finished":
            ledger.finished(task_id, member)
            assert ledger.get(task_id) is None, "accepted and done in one: not ledgered"
            assert ledger.finished_by(member, [task_id]) == [task_id]
        else:
            assert ledger.forget(task_id) is before
            assert ledger.get(task_id) is None
        assert len(ledger) <= entries_max
        held = Counter(f.owner for m in MEMBERS for f in ledger.owned_by(m))
        assert {m: c for m, c in outstanding.items() if c} == dict(held)
        assert outstanding.total == sum(outstanding.values())  # kept without a pass
        assert all(c >= 0 for c in outstanding.values())


@given(
    copies=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(MEMBERS)), min_size=1, max_size=8),
    data=st.data(),
)
def test_several_copies_of_an_id_accepted_and_done_in_any_order_leave_nothing_behind(
    copies: list[tuple[int, str]], data: st.DataObject
) -> None:
    """Copies of one id (a producer resubmitted it through this member, a migration) each
    accepted by a member that then reports it done, in any interleaving: nothing stays
    ledgered.  Before the fix, a TaskDone that came while another member's copy was
    ledgered was dropped, and its own accept after it stayed ledgered for ever."""
    copies = list(dict.fromkeys(copies))  # one copy per (id, member)
    events = [("accept", n, m) for n, m in copies] + [("done", n, m) for n, m in copies]
    events = data.draw(st.permutations(events))
    ledger, outstanding = _replay(events)
    assert len(ledger) == 0, ledger.entries
    assert all(count == 0 for count in outstanding.values())


def test_a_copy_done_while_another_is_ledgered_is_not_ledgered_by_its_late_accept() -> None:
    """The simulator's case: a accepted the first copy; b ran the second, and b's TaskDone
    came before b's accept: it stood for that accept, which then found its Forward ended."""
    ledger, _ = _replay([("accept", 0, "a"), ("done", 0, "b"), ("accept", 0, "b")])
    assert ledger.get("t0") is None and len(ledger) == 0
    assert ledger.finished_by("b", ["t0"]) == ["t0"]


def test_a_TaskDone_of_a_copy_not_ledgered_is_not_remembered() -> None:
    """A hedge's loser (withdrawn: its Forward ended) reports done: nothing of it is kept,
    so a later copy of the id that the same member accepts (a resubmission through us) is
    ledgered and can migrate."""
    ledger = ForwardedLedger(LoadCounts(), entries_max=100)
    ledger.accepted(_task(0), "a", 0.0)
    ledger.done("t0", "b")  # the loser
    ledger.done("t0", "a")
    assert len(ledger) == 0
    ledger.accepted(_task(0), "b", 1.0)  # a later copy, run by b
    entry = ledger.get("t0")
    assert entry is not None and entry.owner == "b"


def test_a_TaskDone_that_stands_for_its_accept_forgets_an_earlier_copys_entry() -> None:
    """As an accept would: the copy ledgered under a was superseded by the one b ran."""
    outstanding = LoadCounts()
    ledger = ForwardedLedger(outstanding, entries_max=100)
    ledger.accepted(_task(0), "a", 0.0)
    ledger.finished("t0", "b")
    assert len(ledger) == 0 and outstanding.total == 0 and outstanding["a"] == 0
    assert ledger.finished_by("b", ["t0"]) == ["t0"] and ledger.finished_by("a", ["t0"]) == []


@given(owners=OWNERS, data=st.data())
def test_a_task_is_finished_by_the_member_whose_TaskDone_ended_it_whatever_the_order(
    owners: list[str], data: st.DataObject
) -> None:
    """After each task's accept and its owner's TaskDone, in any interleaving, the ledger
    says each task was finished by its owner and by no other member (what a restarted
    member's ReplayQuery hears)."""
    events = _accepts_and_dones(owners)
    ledger, _ = _replay(data.draw(st.permutations(events)))
    for n, owner in enumerate(owners):
        assert ledger.finished_by(owner, [f"t{n}"]) == [f"t{n}"]
        for other in set(MEMBERS) - {owner}:
            assert ledger.finished_by(other, [f"t{n}"]) == []
    assert ledger.finished_by(owners[0], ["never-sent"]) == []


def test_only_the_ledgered_copys_TaskDone_finishes_a_task_and_a_new_copy_is_unfinished() -> None:
    ledger = ForwardedLedger(LoadCounts(), entries_max=100)
    ledger.accepted(_task(1), "a", 0.0)
    ledger.done("t1", "b")  # b's copy was withdrawn (its Forward ended)
    assert ledger.finished_by("b", ["t1"]) == [] and ledger.finished_by("a", ["t1"]) == []
    ledger.done("t1", "a")
    assert ledger.finished_by("a", ["t1"]) == ["t1"]
    ledger.accepted(_task(1), "a", 0.0)  # the same id again (a resubmission): running again
    assert ledger.finished_by("a", ["t1"]) == []


def test_finished_tasks_are_remembered_up_to_a_bound_oldest_first_out(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("gossipd.core.forwarded.FINISHED_MAX", 3)
    events = [(kind, n, "a") for n in range(5) for kind in ("accept", "done")]
    ledger, _ = _replay(events)
    ids = [f"t{n}" for n in range(5)]
    assert ledger.finished_by("a", ids) == ["t2", "t3", "t4"]
