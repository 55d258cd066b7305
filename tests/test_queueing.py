"""The expected-wait overload decision (gossipd/core/queueing.py): its formulas on hand-computed
rows, and its promises as properties (never admits beyond the bound, always admits an empty
queue, hints within bounds, monotone in queue length)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.admission import Admission, Verdict
from gossipd.core.messages import Result
from gossipd.core.queueing import (
    QueueWait,
    expected_wait_s,
    retry_after_ms,
    retry_slot,
    wait_bound_s,
)
from gossipd.errors import LocalProtocolError

RETRY_MIN_MS, RETRY_MAX_MS = 200, 10_000


def make(
    concurrency: int = 4, ratio: float = 0.5, target_s: float = 0.0, smoothing: float = 0.1
) -> QueueWait:
    return QueueWait(
        concurrency=concurrency,
        deadline_ratio=ratio,
        target_s=target_s,
        retry_after_min_ms=RETRY_MIN_MS,
        retry_after_max_ms=RETRY_MAX_MS,
        smoothing=smoothing,
    )


@pytest.mark.parametrize(
    ("pending", "concurrency", "service_s", "wait_s"),
    [
        (0, 4, 1.0, 0.0),  # idle
        (3, 4, 1.0, 0.0),  # a worker is free
        (4, 4, 1.0, 0.25),  # all busy: the first of 4 finishes in s/4 on average
        (11, 4, 1.0, 2.0),  # 7 queued: 8 finish before it starts
        (1, 1, 0.5, 0.5),
        (10, 1, 0.5, 5.0),
    ],
)
def test_expected_wait_s_table(
    pending: int, concurrency: int, service_s: float, wait_s: float
) -> None:
    assert expected_wait_s(pending, concurrency, service_s) == pytest.approx(wait_s)


@pytest.mark.parametrize(
    ("remaining_s", "ratio", "target_s", "bound_s"),
    [
        (10.0, 0.5, 0.0, 5.0),  # only the deadline
        (10.0, 0.5, 2.0, 2.0),  # the target is tighter
        (2.0, 0.5, 3.0, 1.0),  # the deadline is tighter
        (-1.0, 0.5, 0.0, 0.0),  # past its deadline: may not wait at all
        (math.inf, 0.5, 0.0, math.inf),  # no deadline known
    ],
)
def test_wait_bound_s_table(
    remaining_s: float, ratio: float, target_s: float, bound_s: float
) -> None:
    assert wait_bound_s(remaining_s, ratio, target_s) == bound_s


@pytest.mark.parametrize(
    ("now", "wait_s", "bound_s", "next_slot", "slot"),
    [
        (10.0, 3.0, 1.0, -math.inf, 12.0),  # drained enough in 2 s
        (10.0, 1.05, 1.0, -math.inf, 10.2),  # in 50 ms, but not sooner than the least hint
        (10.0, 100.0, 1.0, -math.inf, 20.0),  # at most the largest hint
        (10.0, 3.0, 1.0, 13.5, 13.5),  # after the slot of the previous refused task
        (10.0, 3.0, 1.0, 25.0, 20.0),  # ...but still at most the largest hint
    ],
)
def test_retry_slot_table(
    now: float, wait_s: float, bound_s: float, next_slot: float, slot: float
) -> None:
    got = retry_slot(now, wait_s, bound_s, next_slot, RETRY_MIN_MS, RETRY_MAX_MS)
    assert got == pytest.approx(slot)


@pytest.mark.parametrize(
    ("now", "slot", "hint_ms"), [(10.0, 12.0, 2000), (10.0, 10.2, 200), (1.0, 1.5001, 501)]
)
def test_retry_after_ms_table(now: float, slot: float, hint_ms: int) -> None:
    assert retry_after_ms(now, slot) == hint_ms


def test_QueueWait_observe_is_an_ewma_from_the_first_observation() -> None:
    q = make(smoothing=0.5)
    assert q.service_s is None
    q.observe(1.0)
    assert q.service_s == 1.0
    q.observe(3.0)
    assert q.service_s == 2.0
    q.observe(0.0)
    assert q.service_s == 1.0
    with pytest.raises(LocalProtocolError):
        q.observe(-1.0)


def test_QueueWait_admits_everything_before_the_first_observation() -> None:
    q = make(concurrency=1)
    decision = q.decide(0.0, pending=1_000_000, remaining_s=0.001)
    assert decision.admit and decision.expected_wait_s == 0.0


def test_QueueWait_refuses_past_the_bound_with_the_drain_time_as_hint() -> None:
    q = make(concurrency=2, ratio=0.5)
    q.observe(1.0)
    # 2 running + 5 queued: 6 finish first, 3 s; 4 s remaining allows 2 s of wait.
    decision = q.decide(100.0, pending=7, remaining_s=4.0)
    assert not decision.admit
    assert decision.expected_wait_s == pytest.approx(3.0) and decision.bound_s == 2.0
    assert decision.retry_after_ms == 1000
    assert q.decide(100.0, pending=5, remaining_s=4.0).admit  # 2 s: just fits
    assert q.statistics().refused == 1


def test_QueueWait_spreads_the_retries_of_tasks_refused_together_one_service_slot_apart() -> None:
    q = make(concurrency=2, ratio=0.5)
    q.observe(1.0)  # room for one more every 0.5 s
    hints = [q.decide(100.0, pending=7, remaining_s=4.0).retry_after_ms for _ in range(4)]
    assert hints == [1000, 1500, 2000, 2500]
    # Later, with the queue as long: the next slot is still 0.5 s after the last one given.
    assert q.decide(101.0, pending=7, remaining_s=4.0).retry_after_ms == 2000
    # Slots in the past count for nothing.
    assert q.decide(200.0, pending=7, remaining_s=4.0).retry_after_ms == 1000


def test_QueueWait_rejects_invalid_settings() -> None:
    for kwargs in (
        {"concurrency": 0},
        {"ratio": 0.0},
        {"ratio": 1.5},
        {"smoothing": 0.0},
        {"target_s": -1.0},
    ):
        with pytest.raises(LocalProtocolError):
            make(**kwargs)  # type: ignore[arg-type]


concurrencies = st.integers(1, 512)
services = st.floats(0.0, 100.0)
remainings = st.floats(-10.0, 3600.0)
pendings = st.integers(0, 100_000)
ratios = st.floats(0.01, 1.0)
targets = st.one_of(st.just(0.0), st.floats(0.001, 100.0))


@given(
    concurrencies,
    st.lists(services, min_size=1, max_size=20),
    pendings,
    remainings,
    ratios,
    targets,
    st.floats(0.0, 1e6),
)
def test_QueueWait_never_admits_an_expected_wait_beyond_the_bound(
    concurrency: int,
    observed: list[float],
    pending: int,
    remaining_s: float,
    ratio: float,
    target_s: float,
    now: float,
) -> None:
    q = make(concurrency=concurrency, ratio=ratio, target_s=target_s)
    for s in observed:
        q.observe(s)
    decision = q.decide(now, pending, remaining_s)
    bound = max(0.0, remaining_s) * ratio
    if target_s > 0:
        bound = min(bound, target_s)
    assert decision.admit == (q.expected_wait_s(pending) <= bound)
    if decision.admit:
        assert decision.expected_wait_s <= bound
    else:
        assert RETRY_MIN_MS <= decision.retry_after_ms <= RETRY_MAX_MS


@given(concurrencies, services, st.integers(0, 511), remainings, ratios, targets)
def test_QueueWait_always_admits_while_a_worker_is_free(
    concurrency: int,
    service_s: float,
    pending: int,
    remaining_s: float,
    ratio: float,
    target_s: float,
) -> None:
    q = make(concurrency=concurrency, ratio=ratio, target_s=target_s)
    q.observe(service_s)
    assert q.decide(0.0, 0, remaining_s).admit, "an empty queue admits"
    assert q.decide(0.0, min(pending, concurrency - 1), remaining_s).admit


@given(concurrencies, services, pendings, pendings, remainings, ratios, targets)
def test_QueueWait_is_monotone_in_queue_length(
    concurrency: int,
    service_s: float,
    a: int,
    b: int,
    remaining_s: float,
    ratio: float,
    target_s: float,
) -> None:
    shorter, longer = sorted((a, b))
    decisions = []
    for pending in (shorter, longer):
        q = make(concurrency=concurrency, ratio=ratio, target_s=target_s)
        q.observe(service_s)
        decisions.append(q.decide(0.0, pending, remaining_s))
    d_short, d_long = decisions
    assert d_short.expected_wait_s <= d_long.expected_wait_s
    if not d_short.admit:
        assert not d_long.admit, "refused with fewer ahead, so refused with more"
        assert d_short.retry_after_ms <= d_long.retry_after_ms


def test_Admission_refuses_by_expected_wait_after_dedup_and_before_pending_max() -> None:
    q = make(concurrency=1, ratio=0.5)
    adm = Admission(pending_max=100, results_max=10, queue=q)
    assert adm.offer("a", 0.0, 1.0) == (Verdict.ADMIT, None)  # cold start
    adm.finish("a", Result(id="a", ok=True, text="a"))
    q.observe(1.0)
    assert adm.offer("b", 0.0, 1.0)[0] is Verdict.ADMIT  # the worker is free
    verdict, _ = adm.offer("c", 0.0, 1.0)  # 1 s of wait, 0.5 s allowed
    assert verdict is Verdict.OVERLOADED and adm.refusal is not None
    assert adm.refusal.retry_after_ms == 500  # 0.5 s over the bound: drained in 0.5 s
    assert adm.offer("b", 0.0, 1.0)[0] is Verdict.DUPLICATE_PENDING and adm.refusal is None
    assert adm.offer("a", 0.0, 1.0)[0] is Verdict.DUPLICATE_DONE
    assert adm.offer("d", 0.0, 10.0)[0] is Verdict.ADMIT  # a longer deadline fits
    stats = adm.statistics()
    assert stats.overloaded == stats.overloaded_expected_wait == 1
