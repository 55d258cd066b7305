"""The owner core (core/owner.py) without sockets: each refusal, when a task came in, the
verdict-to-reply mapping, and (hypothesis) the stale rule over any order of boots."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.admission import Verdict
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.lifecycle import ANY, Owned
from gossipd.core.messages import ErrorCode, Task
from gossipd.core.owner import MEMBER_OF_MAX, Admit, Owner, Refused
from gossipd.core.peer_messages import Forward


def _forward(req: int = 1, *, src: str = "a", boot: int = 0, **task: object) -> Forward:
    t = Task(v=1, id=f"t{req}", prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)
    if task:
        t = Task(**{"v": 1, "id": f"t{req}", "prompt": "p", "reply_to": "tcp://127.0.0.1:9",
                    "timeout_ms": 10_000, **task})  # type: ignore[arg-type]  # fmt: skip
    return Forward(req=req, src=src, task=t, remaining_ms=7_500, boot=boot)


def test_a_forward_is_admitted_as_received_when_its_entry_point_took_it() -> None:
    owner = Owner(node="o")
    decision = owner.forward(b"id-a", _forward(), 100.0)
    assert isinstance(decision, Admit) and decision.task.id == "t1"
    assert decision.received_at == 100.0 - 2.5  # 2.5 s of its 10 s spent before it came
    assert owner.member_of == {b"id-a": "a"}


def test_a_forward_that_claims_more_time_left_than_its_task_has_gets_no_more() -> None:
    """remaining_ms is the sender's word: one over timeout_ms (up to an hour) put the task's
    start in the future and its deadline that much later; it counts as all of timeout_ms."""
    owner = Owner(node="o")
    t = _forward().task
    generous = Forward(req=2, src="a", task=t, remaining_ms=3_600_000)
    decision = owner.forward(b"id-a", generous, 100.0)
    assert isinstance(decision, Admit) and decision.received_at == 100.0


def test_invalid_forwards_are_refused_with_the_code_and_counted() -> None:
    owner = Owner(node="o", task_bytes_max=64)
    refused = owner.forward(b"i", _forward(prompt="x" * 100_000), 0.0)
    assert isinstance(refused, Refused) and refused.why == "invalid"
    assert not refused.reply.accepted and refused.reply.code == ErrorCode.BAD_REQUEST.value
    assert "exceeds the limit of 64 bytes" in refused.hint
    assert refused.hint and refused.reply.message == refused.hint
    other_version = Forward(v=9, req=2, src="a", task=_forward().task, remaining_ms=1)
    refused = owner.forward(b"i", other_version, 0.0)
    assert isinstance(refused, Refused)
    assert refused.reply.code == ErrorCode.UNSUPPORTED_VERSION.value
    c = owner.counters
    assert (c.invalid_from_peers, c.refused_to_peers, c.accepted_from_peers) == (2, 2, 0)
    assert owner.member_of == {}  # nothing of a refused Forward is remembered


def test_if_free_is_refused_while_saturated_and_a_plain_forward_is_not() -> None:
    owner = Owner(node="o")
    asked = Forward(req=1, src="a", task=_forward().task, remaining_ms=1000, if_free=True)
    refused = owner.forward(b"i", asked, 0.0, saturated=True)
    assert isinstance(refused, Refused) and refused.why == "saturated"
    assert refused.reply.code == ErrorCode.SATURATED.value and owner.counters.refused_saturated == 1
    assert isinstance(owner.forward(b"i", asked, 0.0, saturated=False), Admit)
    assert isinstance(owner.forward(b"i", _forward(), 0.0, saturated=True), Admit)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5)), max_size=30))
def test_a_forward_from_an_earlier_process_of_its_sender_is_refused(
    sends: list[tuple[str, int]],
) -> None:
    """Stale iff its boot (non-zero) is below the latest boot heard from that sender."""
    owner = Owner(node="o")
    latest: dict[str, int] = {}
    for i, (src, boot) in enumerate(sends):
        decision = owner.forward(b"i", _forward(i + 1, src=src, boot=boot), 0.0)
        stale = boot != 0 and boot < latest.get(src, 0)
        assert isinstance(decision, Refused if stale else Admit), (src, boot, latest)
        if stale:
            assert decision.why == "stale" and decision.reply.code == ErrorCode.UNAVAILABLE.value  # type: ignore[union-attr]
        elif boot:
            latest[src] = max(latest.get(src, 0), boot)
        assert owner.latest_boot(src) == latest.get(src, 0)


def test_admission_verdicts_become_replies() -> None:
    owner = Owner(node="o")
    fwd = _forward()
    load = LoadRecord("o", 1, 0, 2, 0, 0, 0)
    for verdict in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE):
        answer = owner.admitted(fwd, verdict, 500, load)
        assert answer.accepted and answer.reply.accepted and answer.reply.code == ""
        assert answer.reply.retry_after_ms == 0 and answer.reply.load == load
        assert answer.done_now is (verdict is Verdict.DUPLICATE_DONE)
    for verdict in (Verdict.OVERLOADED, Verdict.SHUTTING_DOWN, Verdict.CONFLICT):
        answer = owner.admitted(fwd, verdict, 500)
        assert not answer.accepted and answer.reply.code == verdict.value
        assert answer.reply.retry_after_ms == 500 and not answer.done_now
    assert (owner.counters.accepted_from_peers, owner.counters.refused_to_peers) == (3, 3)


def test_connection_identities_are_bounded_and_the_one_idle_longest_goes_first() -> None:
    """(The oldest by first Forward went first: a long-lived forwarder's connection lost its
    name once 4,096 others had come and gone.)"""
    owner = Owner(node="o")
    named = 0  # forwards of others after which the long-lived connection still had its name
    for i in range(MEMBER_OF_MAX + 10):
        if i % 100 == 0:
            owner.forward("long-lived", _forward(src="steady"), 0.0)
        owner.forward(i, _forward(src=f"m{i}"), 0.0)
        named += owner.member_of.get("long-lived") == "steady"
    assert len(owner.member_of) == MEMBER_OF_MAX and 0 not in owner.member_of
    assert named == MEMBER_OF_MAX + 10


# -- after the task: TaskDones behind their Results, the load they carry, Withdraws --------


def _owned(task_id: str, route: str, *forwarders: object, replayed_src: str = "") -> Owned:
    owned = Owned(Task(v=1, id=task_id, prompt="p", reply_to=route), 0.0, not forwarders)
    for f in forwarders:
        owned.add_forwarder(f)  # type: ignore[arg-type]
    owned.replayed_src = replayed_src
    return owned


LOAD = LoadRecord(node="o", seq=1)


def test_a_taskdone_waits_for_its_route_and_carries_the_load_once_a_forwarder() -> None:
    owner = Owner(node="o")
    assert not owner.task_finished(_owned("p1", "tcp://r:1"))  # a producer's: nobody to tell
    assert owner.task_finished(_owned("t1", "tcp://r:1", b"a"))  # the route's first: ask
    assert not owner.task_finished(_owned("t2", "tcp://r:1", b"a", b"b"))  # waits with it
    assert owner.results_left("tcp://r:2", LOAD) == ([], [])  # another route: nothing
    reads: list[int] = []

    def load_of() -> LoadRecord:  # the shell's record: read only when a TaskDone carries it
        reads.append(1)
        return LOAD

    to_links, to_members = owner.results_left("tcp://r:1", None, load_of)
    assert [(i, d.id, d.load) for i, d in to_links] == [
        (b"a", "t1", LOAD),  # the first for a carries the load...
        (b"a", "t2", None),  # ...not the next in the same message
        (b"b", "t2", LOAD),
    ]
    assert reads == [1]  # read once
    assert to_members == [] and owner.results_left("tcp://r:1", LOAD) == ([], [])
    assert owner.task_finished(_owned("t3", "tcp://r:1", b"a", b"b"))
    assert [d.load for _, d in owner.results_left("tcp://r:1", None, load_of)[0]] == [None] * 2
    assert reads == [1]  # both have theirs in this message already: not read
    assert not owner.wants_load(b"a")  # a's message carries it already
    owner.flushed()
    assert owner.wants_load(b"a") and not owner.wants_load(b"a")


def test_a_task_rerun_from_the_journal_tells_its_forwarder_by_name() -> None:
    owner = Owner(node="o")
    assert owner.task_finished(_owned("t1", "tcp://r:1", ANY, replayed_src="m2"))
    to_links, to_members = owner.results_left("tcp://r:1", LOAD)
    assert to_links == [] and [(m, d.id, d.load) for m, d in to_members] == [("m2", "t1", LOAD)]


def test_a_withdraw_counts_a_copy_dropped_else_names_the_member_of_a_held_result() -> None:
    owner = Owner(node="o")
    owner.forward(b"id-a", _forward(src="a"), 0.0)
    assert owner.withdrawn(b"id-a", aborted=True) is None
    assert owner.counters.withdrawn_by_peers == 1
    assert owner.withdrawn(b"id-a", aborted=False) == "a"  # ended here: its Result may be held
    assert owner.withdrawn(b"unknown", aborted=False) == ""
    assert owner.counters.withdrawn_by_peers == 1


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["finish", "left", "flush"]),
            st.integers(0, 2),  # route
            st.lists(st.sampled_from([b"a", b"b", b"c"]), min_size=0, max_size=2, unique=True),
        ),
        max_size=40,
    )
)
def test_every_taskdone_leaves_once_after_its_route_left_with_one_load_a_message(
    steps: list[tuple[str, int, list[bytes]]],
) -> None:
    owner = Owner(node="o")
    waiting: dict[str, set[tuple[str, bytes]]] = {}  # route -> (task, forwarder) owed
    sent: list[tuple[str, bytes]] = []
    loaded: set[bytes] = set()  # identities whose current message has the load
    for n, (step, r, forwarders) in enumerate(steps):
        route = f"tcp://r:{r + 1}"
        if step == "finish":
            first = not waiting.get(route)
            asked = owner.task_finished(_owned(f"t{n}", route, *forwarders))
            assert asked == (bool(forwarders) and first)
            if forwarders:
                waiting.setdefault(route, set()).update((f"t{n}", f) for f in forwarders)
        elif step == "left":
            reads: list[int] = []
            to_links, to_members = owner.results_left(
                route, None, lambda reads=reads: reads.append(1) or LOAD
            )
            # The load is read once, and only where a TaskDone carries it.
            assert len(reads) == any(d.load is not None for _, d in to_links)
            assert to_members == []
            got = [(d.id, i) for i, d in to_links]
            assert sorted(got) == sorted(waiting.pop(route, set()))  # all owed, once each
            for identity, done in to_links:
                assert (done.load is not None) == (identity not in loaded)
                loaded.add(identity)  # type: ignore[arg-type]
            sent.extend(got)  # type: ignore[arg-type]
        else:
            owner.flushed()
            loaded.clear()
    assert len(sent) == len(set(sent))


def test_a_member_declared_dead_comes_back_with_a_lower_boot_and_its_old_process_stays_stale() -> (
    None
):
    """A host whose clock stepped back across a restart (an RTC behind at boot, a restored
    VM) had every Forward of its new process refused as stale for as long as this owner
    lived: boots were never forgotten.  A member's death starts its boot afresh; the dead
    process's own late Forwards stay stale."""
    owner = Owner(node="o")
    assert isinstance(owner.forward(b"i", _forward(1, boot=500), 0.0), Admit)
    assert isinstance(owner.forward(b"i", _forward(2, boot=100), 0.0), Refused)  # (alive)
    owner.member_dead("a")
    assert isinstance(owner.forward(b"i", _forward(3, boot=100), 0.0), Admit)  # the next one
    late = owner.forward(b"i", _forward(4, boot=500), 0.0)  # the dead one's, still in flight
    assert isinstance(late, Refused) and late.why == "stale"
    assert isinstance(owner.forward(b"i", _forward(5, boot=100), 0.0), Admit)
    assert owner.latest_boot("a") == 100
