"""The owner core (core/owner.py) without sockets: each refusal, when a task came in, the
verdict-to-reply mapping, and (hypothesis) the stale rule over any order of boots."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.admission import Verdict
from gossipd.core.gossip_messages import LoadRecord
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


def test_connection_identities_are_bounded() -> None:
    owner = Owner(node="o")
    for i in range(MEMBER_OF_MAX + 10):
        owner.forward(i, _forward(src=f"m{i}"), 0.0)
    assert len(owner.member_of) == MEMBER_OF_MAX and 0 not in owner.member_of
