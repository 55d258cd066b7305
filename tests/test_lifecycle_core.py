"""The owner's task lifecycle (core/lifecycle.py): table tests per rule and a property over
any sequence of inputs."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.admission import Admission, Verdict
from gossipd.core.lifecycle import ANY, Abort, Owned, Phase, Stop, TaskBook
from gossipd.core.messages import Result, Task


def _task(i: int = 0) -> Task:
    return Task(v=1, id=f"t{i}", prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)


def _book(pending_max: int = 100) -> TaskBook:
    return TaskBook(Admission(pending_max=pending_max, results_max=100))


def _ok(i: int = 0) -> Result:
    return Result(id=f"t{i}", ok=True, text="x", node="me")


def test_TaskBook_forwarded_task_ends_with_TaskDone_to_each_forwarder() -> None:
    book = _book()
    verdict, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    assert verdict is Verdict.ADMIT and isinstance(owned, Owned) and not owned.from_producer
    verdict, same = book.offer(_task(), 0.0, 0.1, forwarder=b"B")  # a migration's copy
    assert verdict is Verdict.DUPLICATE_PENDING and same is owned
    assert book.start(owned) and owned.phase is Phase.RUNNING
    ended = book.finish("t0", _ok())
    assert ended is owned and ended.notify() == [b"A", b"B"] and ended.notify_member() == ""
    assert len(book) == 0
    verdict, cached = book.offer(_task(), 0.0, 1.0, forwarder=b"C")
    assert verdict is Verdict.DUPLICATE_DONE and cached == _ok()


def test_TaskBook_withdraw_by_the_last_forwarder_drops_it_quietly() -> None:
    book = _book()
    _, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    book.offer(_task(), 0.0, 0.0, forwarder=b"B")
    assert book.withdraw("t0", b"A") is Abort.NOTHING, "B still counts on it"
    assert book.withdraw("t0", b"X") is Abort.NOTHING, "X never sent it"
    assert book.withdraw("t0", b"B") is Abort.MARKED
    assert not book.start(owned), "a withdrawn task never runs"
    assert book.stop_reason("t0") is Stop.WITHDRAWN
    book.release("t0", _ok())
    assert book.admission.pending == 0
    verdict, _ = book.offer(_task(), 0.0, 1.0, forwarder=b"C")
    assert verdict is Verdict.ADMIT, "not remembered: it may run again"


def test_TaskBook_a_resend_on_the_same_connection_is_one_copy_that_one_withdraw_drops() -> None:
    """The producer's resend through the same entry, placed on the same owner, came on the
    same connection: listed twice, the entry's one Withdraw (after a cut, migrating it)
    left the task running to answer beside the migrated copy, and Held Results (one
    forwarder only) never held its Result."""
    book = _book()
    _, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"E")
    resend = msgspec.structs.replace(_task(), attempt=1)
    verdict, same = book.offer(resend, 0.0, 0.1, forwarder=b"E")
    assert verdict is Verdict.DUPLICATE_PENDING and same is owned
    assert owned.forwarders == [b"E"] and owned.notify() == [b"E"]  # type: ignore[union-attr]
    assert book.start(owned)  # type: ignore[arg-type]
    assert book.withdraw("t0", b"E") is Abort.ABORT


def test_TaskBook_withdraw_of_a_running_task_aborts_it() -> None:
    book = _book()
    _, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    book.start(owned)  # type: ignore[arg-type]
    assert book.withdraw("t0", b"A") is Abort.ABORT
    assert book.withdraw("t0", b"A") is Abort.NOTHING, "once"


def test_TaskBook_a_producers_own_copy_is_never_withdrawn() -> None:
    book = _book()
    _, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    book.offer(_task(), 0.0, 0.0)  # the producer resent it straight to us
    assert book.withdraw("t0", b"A") is Abort.NOTHING
    assert book.start(owned)  # type: ignore[arg-type]


def test_TaskBook_replayed_task_is_withdrawn_by_any_forwarder_and_done_by_name() -> None:
    book = _book()
    book.offer(_task(), 0.0, 0.0)
    book.expect_withdraw("t0", "d07")
    assert book.finish("t0", _ok()).notify_member() == "d07"
    book2 = _book()
    book2.offer(_task(), 0.0, 0.0)
    book2.expect_withdraw("t0", "d07")
    assert book2.withdraw("t0", b"new-connection") is Abort.MARKED
    assert book2.get("t0").replayed_src == ""  # type: ignore[union-attr]


def test_TaskBook_cancel_and_expiry_keep_the_first_reason_and_withdrawal_wins() -> None:
    book = _book()
    book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    assert book.cancel("t0") is Abort.MARKED
    assert book.expire("t0") is Abort.NOTHING
    assert book.stop_reason("t0") is Stop.CANCELLED
    # Queued: no worker will take a withdrawn entry, so the shell releases it now.
    assert book.withdraw("t0", b"A") is Abort.MARKED
    assert book.stop_reason("t0") is Stop.WITHDRAWN, "nobody waits for its answer now"
    owned = book.get("t0")
    assert owned is not None and not book.start(owned)
    assert book.cancel("unknown") is Abort.NOTHING
    # Running: its worker is aborted by the Cancel; the Withdraw changes only the reason
    # its end reads.
    _, running = book.offer(_task(1), 0.0, 0.0, forwarder=b"A")
    assert isinstance(running, Owned) and book.start(running)
    assert book.cancel("t1") is Abort.ABORT
    assert book.withdraw("t1", b"A") is Abort.NOTHING, "its worker is aborted already"
    assert book.stop_reason("t1") is Stop.WITHDRAWN


def test_TaskBook_a_copy_that_comes_while_a_withdrawn_task_is_aborted_restarts_it() -> None:
    """Rule 3b: withdrawn while it ran, then forwarded here again (or resubmitted) before its
    aborted worker ended: that worker's end must not drop it silently (the new holder would
    wait for an answer that never comes): it runs again for the new holder."""
    book = _book()
    _, owned = book.offer(_task(), 0.0, 0.0, forwarder=b"A")
    assert isinstance(owned, Owned) and book.start(owned)
    assert book.withdraw("t0", b"A") is Abort.ABORT
    verdict, same = book.offer(_task(), 0.0, 0.1, forwarder=b"B")
    assert verdict is Verdict.DUPLICATE_PENDING and same is owned
    assert book.stop_reason("t0") is Stop.RESTART and owned.notify() == [b"B"]
    assert not book.restart("t9")
    assert book.restart("t0"), "its worker ended: it goes back to the queue"
    assert book.stop_reason("t0") is None and not book.restart("t0")
    owned.phase = Phase.QUEUED  # (the runner queues it again)
    assert book.start(owned)
    assert book.finish("t0", _ok()).notify() == [b"B"]


def test_TaskBook_a_restarting_task_can_still_be_cancelled_expired_or_withdrawn() -> None:
    book = _book()
    for i, stop in enumerate(("cancel", "expire", "withdraw")):
        _, owned = book.offer(_task(i), 0.0, 0.0, forwarder=b"A")
        assert isinstance(owned, Owned) and book.start(owned)
        book.withdraw(f"t{i}", b"A")
        book.offer(_task(i), 0.0, 0.1)  # its producer's retry, straight to us
        assert book.stop_reason(f"t{i}") is Stop.RESTART
        if stop == "cancel":
            # Its worker is being aborted already: its end answers cancelled.
            assert book.cancel(f"t{i}") is Abort.MARKED
            assert book.stop_reason(f"t{i}") is Stop.CANCELLED
        elif stop == "expire":
            assert book.expire(f"t{i}") is Abort.MARKED
            assert book.stop_reason(f"t{i}") is Stop.EXPIRED
        else:  # a producer's copy is never withdrawn; a forwarder's is
            book.offer(_task(i), 0.0, 0.2, forwarder=b"C")
            assert book.withdraw(f"t{i}", b"C") is Abort.NOTHING
            assert book.stop_reason(f"t{i}") is Stop.RESTART


def test_TaskBook_refusals_create_nothing() -> None:
    book = _book(pending_max=1)
    book.offer(_task(1), 0.0, 0.0)
    verdict, nothing = book.offer(_task(2), 0.0, 0.0, forwarder=ANY)
    assert verdict is Verdict.OVERLOADED and nothing is None and book.get("t2") is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["offer", "offer_fwd", "start", "cancel", "expire", "withdraw", "end"]),
            st.integers(0, 3),
            st.sampled_from([b"A", b"B"]),
        ),
        max_size=50,
    )
)
def test_TaskBook_any_sequence_keeps_admission_and_entries_in_step(ops: list) -> None:  # type: ignore[type-arg]
    """Whatever happens: the book's entries are exactly admission's pending ids; a task
    withdrawn before it ran never starts, and never stays (the shell releases it on MARKED);
    an ended task is never aborted; every entry that ends notifies only forwarders that sent
    it and did not withdraw it; an entry dropped without an answer has nobody waiting for one
    (rule 3b)."""
    book = _book(pending_max=3)
    sent: dict[str, set[bytes]] = {}
    for op, i, who in ops:
        tid = f"t{i}"
        owned = book.get(tid)
        if op == "offer":
            book.offer(_task(i), 0.0, 0.0)
        elif op == "offer_fwd":
            verdict, _ = book.offer(_task(i), 0.0, 0.0, forwarder=who)
            if verdict is Verdict.ADMIT:
                sent[tid] = {who}
            elif verdict is Verdict.DUPLICATE_PENDING:
                sent.setdefault(tid, set()).add(who)
        elif op == "start" and owned is not None:
            if book.start(owned):
                assert owned.stop is not Stop.WITHDRAWN
        elif op == "cancel":
            book.cancel(tid)
        elif op == "expire":
            book.expire(tid)
        elif op == "withdraw":
            before = owned.phase if owned else None
            abort = book.withdraw(tid, who)
            if abort is Abort.ABORT:
                assert before is Phase.RUNNING
            if owned is not None and who not in owned.forwarders:
                sent.get(tid, set()).discard(who)
            if abort is Abort.MARKED:  # as the runner does: released now
                book.release(tid, _ok(i))
                sent.pop(tid, None)
        elif op == "end" and owned is not None:
            if owned.stop is Stop.WITHDRAWN:
                assert not owned.forwarders and not owned.from_producer, "someone waits"
                book.release(tid, _ok(i))
            elif owned.phase is Phase.RUNNING and book.restart(tid):  # its aborted worker
                owned.phase = Phase.QUEUED  # ended: queued again, as the runner does
            else:
                ended = book.finish(tid, _ok(i))
                assert set(ended.notify()) <= sent.get(tid, set())
            sent.pop(tid, None)
        assert book.admission.pending == len(book)
        # No entry is left that nothing will ever take: a queued withdrawn one never starts.
        assert not [o for o in book if o.phase is Phase.QUEUED and o.stop is Stop.WITHDRAWN]


def test_TaskBook_cancel_only_from_the_key_that_submitted_the_task() -> None:
    """Rule 4: another key's Cancel is refused and stops nothing."""
    book = _book()
    task = Task(v=1, id="t0", prompt="p", reply_to="tcp://127.0.0.1:9", producer_key="A" * 40)
    book.offer(task, 0.0, 0.0)
    assert book.cancel("t0", "B" * 40) is Abort.REFUSED
    assert book.cancel("t0") is Abort.REFUSED
    assert book.stop_reason("t0") is None
    assert book.cancel("t0", "A" * 40) is Abort.MARKED
    assert book.stop_reason("t0") is Stop.CANCELLED


def test_TaskBook_held_names_what_runs_or_ran_here_for_that_key_and_is_not_being_withdrawn() -> (
    None
):
    book = _book()
    _, running = book.offer(_task(0), 0.0, 0.0, forwarder=b"A")
    book.start(running)  # type: ignore[arg-type]
    book.offer(_task(1), 0.0, 0.0)
    book.finish("t1", _ok(1))  # answered: cached
    _, withdrawn = book.offer(_task(2), 0.0, 0.0, forwarder=b"A")
    book.start(withdrawn)  # type: ignore[arg-type]
    assert book.withdraw("t2", b"A") is Abort.ABORT  # being aborted: ends unanswered
    asked = [("t0", ""), ("t1", ""), ("t2", ""), ("t3", ""), ("t1", "K" * 40)]
    assert book.held(asked) == ["t0", "t1"]
    assert [book.admission.knows(f"t{i}") for i in range(4)] == [True, True, True, False]
