"""Admission rules (see gossipd/core/admission.py), as a hypothesis state machine and a table."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gossipd.core.admission import ANSWERED_ENTRY_BYTES, Admission, Verdict, refused
from gossipd.core.budgets import result_bytes
from gossipd.core.messages import ErrorCode, Result, error_result
from gossipd.errors import LocalProtocolError

IDS = st.sampled_from([f"t{i}" for i in range(12)])
PRODUCERS = st.sampled_from(["", "A" * 40, "B" * 40])  # "" : no CURVE key
ATTEMPTS = st.integers(0, 3)
AGES = st.integers(0, 3)  # how many steps before now a send entered the cluster


def ok(task_id: str) -> Result:
    return Result(id=task_id, ok=True, text=task_id)


class AdmissionMachine(RuleBasedStateMachine):
    """Model: pending set, LRU of results, run counts per id, the producer of each id held,
    the highest attempt above 0 whose cached Result was sent and when (rule 5); time moves
    one step a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.pending_max, self.results_max = 4, 5
        self.adm = Admission(pending_max=self.pending_max, results_max=self.results_max)
        self.pending: set[str] = set()
        self.done: list[str] = []  # LRU order, oldest first
        self.runs: dict[str, int] = {}
        self.producer: dict[str, str] = {}  # of each pending or cached id (rule 1a)
        self.answered: dict[str, tuple[int, int]] = {}  # of cached ids (rule 5)
        self.now = 0
        self.shutting_down = False

    @rule(task_id=IDS, producer=PRODUCERS, attempt=ATTEMPTS, age=AGES)
    def offer(self, task_id: str, producer: str, attempt: int, age: int) -> None:
        self.now += 1
        received_at = self.now - age
        held = task_id in self.pending or task_id in self.done
        # What an entry daemon asks before forwarding: the same answer as offer's CONFLICT.
        assert self.adm.held_by_other(task_id, producer) == (
            held and self.producer[task_id] != producer
        )
        verdict, cached = self.adm.offer(
            task_id, producer=producer, attempt=attempt, received_at=received_at
        )
        if held and self.producer[task_id] != producer:
            assert verdict is Verdict.CONFLICT and cached is None
        elif task_id in self.pending:
            assert verdict is Verdict.DUPLICATE_PENDING
        elif task_id in self.done:
            assert verdict is Verdict.DUPLICATE_DONE
            later = self.answered.get(task_id, (0, 0))
            if attempt < later[0] and received_at < later[1]:  # rule 5: an earlier send, late
                assert cached is None
            else:
                assert cached is not None and cached.id == task_id
            self.done.remove(task_id)
            self.done.append(task_id)
        elif self.shutting_down:
            assert verdict is Verdict.SHUTTING_DOWN
        elif len(self.pending) >= self.pending_max:
            assert verdict is Verdict.OVERLOADED
        else:
            assert verdict is Verdict.ADMIT
            self.pending.add(task_id)
            self.producer[task_id] = producer
            self.runs[task_id] = self.runs.get(task_id, 0) + 1

    @precondition(lambda self: self.done)
    @rule(data=st.data(), attempt=ATTEMPTS, age=AGES)
    def send_again(self, data: st.DataObject, attempt: int, age: int) -> None:
        """A cached id's own producer sends it again (rule 5's case), as ``offer`` checks."""
        task_id = data.draw(st.sampled_from(self.done))
        self.offer(task_id, self.producer[task_id], attempt, age)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), remember=st.booleans())
    def finish(self, data: st.DataObject, remember: bool) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.pending)))
        result = ok(task_id) if remember else error_result(task_id, ErrorCode.SHUTTING_DOWN, "x")
        self.adm.finish(task_id, result, remember=remember)
        self.pending.remove(task_id)
        if remember:
            self.done.append(task_id)
            if len(self.done) > self.results_max:
                gone = self.done.pop(0)
                self.producer.pop(gone)
                self.answered.pop(gone, None)
        else:
            self.producer.pop(task_id)

    @rule(data=st.data(), attempt=ATTEMPTS)
    def answered_at(self, data: st.DataObject, attempt: int) -> None:
        """The shell handed a task's Result to its producer for send ``attempt`` (mostly a
        cached one's: ``answered`` ignores the others)."""
        task_id = data.draw(st.sampled_from(self.done) if self.done else IDS)
        self.now += 1
        self.adm.answered(task_id, attempt, self.now)
        if task_id in self.done and attempt > self.answered.get(task_id, (0, 0))[0]:
            self.answered[task_id] = (attempt, self.now)

    @rule()
    def shut_down(self) -> None:
        self.adm.begin_shutdown()
        self.shutting_down = True

    @invariant()
    def bounded(self) -> None:
        stats = self.adm.statistics()
        assert stats.pending == len(self.pending) <= self.pending_max
        assert stats.cached_results == len(self.done) <= self.results_max

    @invariant()
    def producers_are_remembered_only_for_held_ids(self) -> None:
        assert set(self.producer) == self.pending | set(self.done)
        # The key rides in each held entry: exactly the held ids, each with its producer.
        held = {t: p for t, (_, p) in self.adm._pending.items()}
        held.update({t: p for t, (_, _, p) in self.adm._done.items()})
        assert held == self.producer

    @invariant()
    def the_cache_counts_its_bytes_with_rule_5s(self) -> None:
        assert set(self.answered) <= set(self.done)
        assert self.adm.statistics().cached_results_bytes == sum(
            result_bytes(ok(t)) for t in self.done
        ) + ANSWERED_ENTRY_BYTES * len(self.answered)

    @invariant()
    def an_id_runs_again_only_after_it_was_forgotten(self) -> None:
        for task_id in self.pending:
            assert task_id not in self.done


TestAdmissionMachine = AdmissionMachine.TestCase


def test_Admission_finish_of_unknown_id_is_a_local_error() -> None:
    adm = Admission(pending_max=1, results_max=1)
    with pytest.raises(LocalProtocolError):
        adm.finish("nope", ok("nope"))


def test_Admission_refusals_are_not_remembered() -> None:
    adm = Admission(pending_max=1, results_max=10)
    assert adm.offer("a")[0] is Verdict.ADMIT
    assert adm.offer("b")[0] is Verdict.OVERLOADED
    adm.finish("a", ok("a"))
    assert adm.offer("b")[0] is Verdict.ADMIT
    assert adm.statistics().overloaded == 1


def test_Admission_zero_cache_forgets_every_result() -> None:
    adm = Admission(pending_max=2, results_max=0)
    adm.offer("a")
    adm.finish("a", ok("a"))
    assert adm.offer("a")[0] is Verdict.ADMIT


def test_Admission_rejects_bad_bounds() -> None:
    with pytest.raises(LocalProtocolError):
        Admission(pending_max=0, results_max=1)


def test_Admission_an_id_belongs_to_its_producer_key_while_pending_or_cached() -> None:
    """Rule 1a: another key's offer of the id is refused, never absorbed nor answered from
    the cache; the id is free again once its result is forgotten."""
    adm = Admission(pending_max=10, results_max=1)
    assert adm.offer("a", producer="A" * 40)[0] is Verdict.ADMIT
    assert adm.offer("a", producer="B" * 40) == (Verdict.CONFLICT, None)
    assert adm.offer("a")[0] is Verdict.CONFLICT  # no key is another producer too
    assert adm.offer("a", producer="A" * 40)[0] is Verdict.DUPLICATE_PENDING
    adm.finish("a", ok("a"))
    assert adm.offer("a", producer="B" * 40) == (Verdict.CONFLICT, None)
    assert adm.offer("a", producer="A" * 40)[0] is Verdict.DUPLICATE_DONE
    adm.offer("b", producer="A" * 40)
    adm.finish("b", ok("b"))  # evicts a (results_max 1)
    assert adm.offer("a", producer="B" * 40)[0] is Verdict.ADMIT
    adm.finish("a", ok("a"), remember=False)
    assert adm.offer("a")[0] is Verdict.ADMIT  # forgotten: anyone's again
    stats = adm.statistics()
    assert stats.refused_id_in_use == 3 and stats.duplicates == 2


def test_Admission_held_by_other_sees_another_keys_id_and_its_refusal_is_counted() -> None:
    """An entry daemon's check before it forwards: the id pending or cached for another key;
    the refusal it answers counts with offer's own (statistics().refused_id_in_use)."""
    adm = Admission(pending_max=10, results_max=10)
    adm.offer("a", producer="A" * 40)
    assert adm.held_by_other("a", "B" * 40) and not adm.held_by_other("a", "A" * 40)
    adm.finish("a", ok("a"))
    assert adm.held_by_other("a", "B" * 40) and not adm.held_by_other("b", "B" * 40)
    adm.count_conflict()
    assert adm.statistics().refused_id_in_use == 1


def test_Admission_a_result_too_large_to_cache_frees_its_id() -> None:
    adm = Admission(pending_max=10, results_max=10, results_bytes_max=1)
    adm.offer("a", producer="A" * 40)
    adm.finish("a", ok("a"))
    assert adm.offer("a", producer="B" * 40)[0] is Verdict.ADMIT


def test_Admission_rule_5s_bytes_count_on_the_cache_budget_and_evict_the_oldest() -> None:
    """What ``answered`` remembers is charged to results_bytes_max: past it the oldest
    Result goes (counted by bytes), with what rule 5 remembered of it."""
    size = result_bytes(ok("t1"))
    adm = Admission(pending_max=4, results_max=10, results_bytes_max=2 * size + 100)
    for task_id in ("t1", "t2"):
        adm.offer(task_id)
        adm.finish(task_id, ok(task_id))
    adm.answered("t1", 2, now=5.0)  # 2 results + 128 bytes: over by 28, t1 is the oldest
    stats = adm.statistics()
    assert stats.cached_results == 1 and stats.results_evicted_bytes == 1
    assert stats.cached_results_bytes == size <= adm.results_bytes_max
    assert adm.offer("t1", attempt=1, received_at=0.0)[0] is Verdict.ADMIT, "t1 forgotten"
    adm.answered("t2", 3, now=6.0)  # t2 alone + 128 bytes: fits
    assert adm.statistics().cached_results_bytes == size + ANSWERED_ENTRY_BYTES
    assert adm.offer("t2", attempt=1, received_at=5.5) == (Verdict.DUPLICATE_DONE, None)
    assert adm.offer("t2", attempt=1, received_at=6.5)[1] == ok("t2"), "entered after"
    assert adm.offer("t2", attempt=3, received_at=5.5)[1] == ok("t2"), "not an earlier send"
    assert adm.statistics().answered_later == 1


def test_each_refusal_is_answered_with_its_code_reason_and_hint() -> None:
    """core/admission.refused: one mapping from verdict to what the producer hears (the
    intake's and the simulator's)."""
    kw = {"pending_max": 1, "pending_bytes_max": 10_000, "retry_after_ms": 300}
    adm = Admission(pending_max=1, results_max=10)
    assert adm.offer("a")[0] is Verdict.ADMIT
    assert adm.offer("b")[0] is Verdict.OVERLOADED
    no = refused(Verdict.OVERLOADED, adm, **kw)
    assert (no.code, no.reason, no.retry_after_ms) == (ErrorCode.OVERLOADED, "overloaded", 300)
    assert "1 tasks pending, the limit is 1" in no.message
    by_bytes = Admission(pending_max=10, results_max=10, pending_bytes_max=100)
    assert by_bytes.offer("small", size_bytes=60)[0] is Verdict.ADMIT
    assert by_bytes.offer("big", size_bytes=60)[0] is Verdict.OVERLOADED
    no = refused(Verdict.OVERLOADED, by_bytes, **kw)
    assert no.reason == "overloaded_pending_bytes" and "pending_bytes_max = 10000" in no.message
    no = refused(Verdict.CONFLICT, adm, **kw)
    assert (no.code, no.retry_after_ms) == (
        ErrorCode.ID_IN_USE,
        0,
    ) and "choose another id" in no.message
    adm.begin_shutdown()
    no = refused(Verdict.SHUTTING_DOWN, adm, **kw)
    assert (no.code, no.retry_after_ms) == (ErrorCode.SHUTTING_DOWN, 300)
    with pytest.raises(LocalProtocolError):
        refused(Verdict.ADMIT, adm, **kw)
