"""A restarted daemon's question before it runs its journal again (core/replaycheck.py):
when it asks, whom, in what pieces, which answers count, and when it stops waiting."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.peer_messages import ReplayQuery
from gossipd.core.replaycheck import (
    ANSWER_WAIT_S,
    JOIN_WAIT_S,
    MEMBERS_MAX,
    ReplayCheck,
    replay_known,
)

TASKS = [("t1", ""), ("t2", "K" * 40), ("t3", "")]


def test_it_waits_for_a_first_member_up_to_the_join_wait_then_asks_whoever_is_live() -> None:
    check = ReplayCheck(TASKS, started=10.0, expect_members=True)
    assert check.queries([], 10.0) == [] and not check.done(10.0)
    assert check.next_deadline() == 10.0 + JOIN_WAIT_S
    assert check.queries([], 10.0 + JOIN_WAIT_S) == []  # the wait is over: nobody to ask
    assert check.done(10.0 + JOIN_WAIT_S)
    assert check.outcome().run == ["t1", "t2", "t3"] and check.outcome().asked == 0


def test_a_daemon_without_other_seeds_does_not_wait() -> None:
    check = ReplayCheck(TASKS, started=5.0, expect_members=False)
    assert check.queries([], 5.0) == [] and check.done(5.0)
    assert check.outcome().run == ["t1", "t2", "t3"]


def test_nothing_to_check_is_done_at_once_and_asks_nobody() -> None:
    check = ReplayCheck([], started=0.0, expect_members=True)
    assert check.done(0.0) and check.queries(["a"], 0.0) == []


def test_every_member_gets_every_piece_once_and_what_they_hold_is_not_run() -> None:
    check = ReplayCheck(TASKS, started=0.0, expect_members=True, ids_per_query=2)
    sent = check.queries(["a", "b"], 0.1)
    assert sent == [
        ("a", [("t1", ""), ("t2", "K" * 40)]),
        ("a", [("t3", "")]),
        ("b", [("t1", ""), ("t2", "K" * 40)]),
        ("b", [("t3", "")]),
    ]
    # A member learnt of meanwhile (a seed's later push-pull page) is asked too; a and b
    # are not asked again.
    assert [m for m, _ in check.queries(["a", "b", "c"], 0.2)] == ["c", "c"]
    check.on_known("a", ["t2"])
    check.on_known("a", [])
    check.on_known("c", [])
    check.on_known("c", [])
    assert not check.done(0.2)  # b owes two answers
    check.on_known("b", ["t2", "t3"])
    check.on_known("b", [])
    assert check.done(0.2)
    assert check.queries(["a", "b", "c", "d"], 0.3) == []  # done: nobody else is asked
    outcome = check.outcome()
    assert outcome.run == ["t1"]
    assert outcome.known == {"t2": "a", "t3": "b"}
    assert (outcome.asked, outcome.answered) == (3, 3)


def test_a_member_the_shell_cannot_reach_is_not_waited_for() -> None:
    check = ReplayCheck(TASKS, started=0.0, expect_members=True)
    check.queries(["a", "b"], 0.0)
    check.unreachable("b")
    check.unreachable("b")  # (once is enough)
    check.on_known("a", ["t1"])
    assert check.done(0.0)
    outcome = check.outcome()
    assert outcome.run == ["t2", "t3"] and (outcome.asked, outcome.answered) == (2, 1)


def test_a_silent_member_is_waited_for_until_the_answer_wait_then_counts_as_holding_nothing() -> (
    None
):
    check = ReplayCheck(TASKS, started=0.0, expect_members=True)
    check.queries(["a", "b"], 1.0)
    check.on_known("a", ["t1"])
    assert not check.done(1.0 + ANSWER_WAIT_S - 0.01)
    assert check.next_deadline() == 1.0 + ANSWER_WAIT_S
    assert check.done(1.0 + ANSWER_WAIT_S)
    outcome = check.outcome()
    assert outcome.run == ["t2", "t3"] and (outcome.asked, outcome.answered) == (2, 1)


def test_answers_not_on_the_members_own_connection_or_not_asked_for_are_refused() -> None:
    check = ReplayCheck(TASKS, started=0.0, expect_members=True)
    check.queries(["a"], 0.0)
    check.on_known("a", ["t1"], its_own=False)  # another member speaking for a
    check.on_known("z", ["t2"])  # never asked
    assert check.refused == 2 and not check.done(0.0)
    check.on_known("a", ["t3", "not-asked"])
    check.on_known("a", ["t1"])  # a second answer to one question
    assert check.refused == 3
    assert check.outcome().known == {"t3": "a"}


def test_at_most_members_max_members_are_asked() -> None:
    members = [f"m{i}" for i in range(MEMBERS_MAX + 10)]
    check = ReplayCheck(TASKS, started=0.0, expect_members=True)
    sent = check.queries(members, 0.0)
    assert [m for m, _ in sent] == members[:MEMBERS_MAX]


ids = st.lists(st.sampled_from([f"t{i}" for i in range(12)]), unique=True, max_size=12)


@given(
    tasks=ids,
    members=st.lists(st.sampled_from("abcde"), unique=True, max_size=5),
    piece=st.integers(1, 5),
    answers=st.lists(st.tuples(st.sampled_from("abcdez"), ids, st.booleans()), max_size=30),
    late=st.booleans(),
)
def test_property_a_task_is_left_out_only_when_a_member_asked_says_it_holds_it(
    tasks: list[str],
    members: list[str],
    piece: int,
    answers: list[tuple[str, list[str], bool]],
    late: bool,
) -> None:
    check = ReplayCheck(
        [(t, "") for t in tasks], started=0.0, expect_members=True, ids_per_query=piece
    )
    sent = check.queries(members, 0.5)
    if tasks:
        pieces = -(-len(tasks) // piece)
        assert len(sent) == len(members) * pieces
        for member in members:
            assert [t for m, p in sent if m == member for t, _ in p] == tasks
    taken: dict[str, str] = {}
    owed = dict.fromkeys(members, -(-len(tasks) // piece) if tasks else 0)
    for member, held, its_own in answers:
        check.on_known(member, held, its_own)
        if its_own and owed.get(member, 0) > 0:
            owed[member] -= 1
            for t in held:
                if t in tasks:
                    taken.setdefault(t, member)
    outcome = check.outcome()
    assert outcome.known == taken
    assert outcome.run == [t for t in tasks if t not in taken]
    assert check.done(0.5) == (not tasks or (bool(members) and not any(owed.values())))
    if late:  # nobody answers any more: the waits end it
        if not members:
            assert check.queries([], JOIN_WAIT_S) == []
        assert check.done(JOIN_WAIT_S if not members else 0.5 + ANSWER_WAIT_S)
        assert check.outcome().run == [t for t in tasks if t not in taken]


def test_a_replay_query_hears_the_tasks_held_here_and_those_the_asker_finished() -> None:
    """A member names the tasks it holds for the same key, and, as the forwarder, those it
    had the asker's TaskDone for (answered before the asker's crash lost their DONE
    records): the asker runs none of them again.  Each id once; nothing it was not asked."""
    query = ReplayQuery(node="b", tasks=[("t1", "k"), ("t2", "k"), ("t3", "k")])
    asked_held: list[list[tuple[str, str]]] = []
    asked_finished: list[tuple[str, list[str]]] = []

    def held(tasks: list[tuple[str, str]]) -> list[str]:
        asked_held.append(tasks)
        return ["t1"]

    def finished_by(member: str, ids: list[str]) -> list[str]:
        asked_finished.append((member, ids))
        return ["t1", "t3"] if member == "b" else []

    answer = replay_known(query, "a", held, finished_by)
    assert answer.node == "a" and answer.known == ["t1", "t3"]
    assert asked_held == [query.tasks] and asked_finished == [("b", ["t1", "t2", "t3"])]
    nothing = replay_known(query, "a", lambda tasks: [], lambda member, ids: [])
    assert nothing.known == []
    only_held = replay_known(query, "a", lambda tasks: ["t2"], lambda member, ids: [])
    assert only_held.known == ["t2"]
