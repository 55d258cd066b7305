"""core/tokenbudgets.py: identities, budgets from capacity, shares, buckets (rules 1-6)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import BudgetsConfig
from gossipd.core.gossip_messages import GpuState
from gossipd.core.tokenbudgets import (
    DEFAULT_IDENTITY,
    OVERFLOW_IDENTITY,
    Budgets,
    TokenBuckets,
    compute_budgets,
    decode_budgets,
    local_share,
    producer_identity,
    retry_after_ms,
    task_cost_tokens,
)
from gossipd.ingress.budgets import BudgetGate, entries_capacity, serving_capacity

KEY = "rq>Bb0WlSw4^KqR9@5[x!}hzo-G0b(yGC}KmX2(#"


@pytest.mark.parametrize(
    ("producer_key", "key", "separator", "identity"),
    [
        (KEY, "team-a:session-1", ":", "curve:" + KEY),  # the authenticated key wins
        ("", "team-a:session-1", ":", "prefix:team-a"),
        ("", "team-a:s:1", ":", "prefix:team-a"),  # the first separator
        ("", ":session-1", ":", DEFAULT_IDENTITY),  # empty prefix
        ("", "session-1", ":", DEFAULT_IDENTITY),  # no separator
        ("", "team-a/x", "/", "prefix:team-a"),
        ("", "team-a:x", "", DEFAULT_IDENTITY),  # prefixes off
        ("", "", ":", DEFAULT_IDENTITY),
    ],
)
def test_producer_identity(producer_key: str, key: str, separator: str, identity: str) -> None:
    assert producer_identity(producer_key, key, separator) == identity


@pytest.mark.parametrize(
    ("chars", "max_tokens", "chars_per_token", "cost"),
    [(0, 16, 4.0, 16), (1, 16, 4.0, 17), (4, 16, 4.0, 17), (5, 1, 4.0, 3), (400, 100, 4.0, 200)],
)
def test_task_cost_tokens(chars: int, max_tokens: int, chars_per_token: float, cost: int) -> None:
    assert task_cost_tokens(chars, max_tokens, chars_per_token) == cost


def test_compute_budgets_table() -> None:
    budgets = compute_budgets(
        [1.0, 2.0, 1.0],
        tokens_per_s_per_capacity=1000.0,
        default_share=0.25,
        shares={"prefix:a": 0.5, "prefix:b": 0.1},
        tokens_per_s={"prefix:b": 77.0, "curve:" + KEY: 5.0},
        burst_s=2.0,
    )
    assert budgets.capacity_total == 4.0
    assert budgets.cluster_tokens_per_s == 4000.0
    assert budgets.default_tokens_per_s == 1000.0
    # An absolute rate overrides a share for the same producer.
    assert budgets.producers == {"prefix:a": 2000.0, "prefix:b": 77.0, "curve:" + KEY: 5.0}
    assert budgets.rate("prefix:a") == 2000.0
    assert budgets.rate("prefix:zzz") == 1000.0
    assert budgets.burst_s == 2.0


@pytest.mark.parametrize(
    ("total", "weight", "share"),
    [(4.0, 1.0, 0.25), (4.0, 2.0, 0.5), (0.0, 1.0, 1.0), (1.0, 3.0, 1.0)],
)
def test_local_share(total: float, weight: float, share: float) -> None:
    budgets = Budgets(capacity_total=total, cluster_tokens_per_s=0, default_tokens_per_s=0)
    assert local_share(budgets, weight) == share


@given(st.lists(st.floats(min_value=0.01, max_value=1000.0), min_size=1, max_size=50))
def test_local_shares_add_up_to_the_budget(weights: list[float]) -> None:
    budgets = compute_budgets(
        weights,
        tokens_per_s_per_capacity=100.0,
        default_share=0.3,
        shares={},
        tokens_per_s={},
        burst_s=1.0,
    )
    total = sum(local_share(budgets, w) * budgets.default_tokens_per_s for w in weights)
    assert math.isclose(total, budgets.default_tokens_per_s, rel_tol=1e-9)


@pytest.mark.parametrize(
    ("level", "rate", "cap", "hint"),
    [
        (-100.0, 1000.0, 10_000, 100),
        (-0.001, 1000.0, 10_000, 1),
        (-1e9, 1.0, 10_000, 10_000),
        (-5.0, 0.0, 7_000, 7_000),
        (-1.5, 1000.0, 10_000, 2),
        # ingress.retry_after_max_ms = 0: still at least 1 (0 reads as "admitted")
        (-5.0, 0.0, 0, 1),
        (-5.0, 1000.0, 0, 1),
        # a tiny rate: the wait overflows an integer before the cut (it raised OverflowError)
        (-100.0, 1e-306, 10_000, 10_000),
    ],
)
def test_retry_after_ms(level: float, rate: float, cap: int, hint: int) -> None:
    assert retry_after_ms(level, rate, cap) == hint


@given(
    level=st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    rate=st.floats(min_value=0.0, allow_nan=False),
    cap=st.integers(min_value=0, max_value=3_600_000),
)
def test_a_refusals_hint_is_always_between_1_and_the_cap(
    level: float, rate: float, cap: int
) -> None:
    assert 1 <= retry_after_ms(level, rate, cap) <= max(1, cap)


def test_a_producer_of_0_tokens_per_s_is_refused_whatever_the_longest_hint() -> None:
    buckets = TokenBuckets(producers_max=10, retry_after_max_ms=0)
    buckets.set_rates({"prefix:blocked": 0.0}, 10.0, 1.0)
    assert [buckets.charge("prefix:blocked", 600, 0.0) for _ in range(3)] == [1, 1, 1]
    assert buckets.statistics().admitted == 0


def test_decode_budgets_round_trip_and_refusal() -> None:
    budgets = compute_budgets(
        [1.0],
        tokens_per_s_per_capacity=10.0,
        default_share=1.0,
        shares={"prefix:a": 0.5},
        tokens_per_s={},
        burst_s=1.0,
    )
    body = msgspec.msgpack.decode(msgspec.msgpack.encode(budgets))
    assert decode_budgets(body) == budgets
    with pytest.raises(ValueError, match="invalid budgets directive"):
        decode_budgets({"capacity_total": -1, "cluster_tokens_per_s": 0, "default_tokens_per_s": 0})
    with pytest.raises(ValueError, match="invalid budgets directive"):
        decode_budgets("nonsense")


def test_TokenBuckets_refuses_past_the_burst_and_hints_when_to_retry() -> None:
    buckets = TokenBuckets(producers_max=10, retry_after_max_ms=10_000)
    buckets.set_rates({"prefix:a": 100.0}, 10.0, 1.0)
    assert buckets.charge("prefix:a", 60, 0.0) == 0  # 100 -> 40
    assert buckets.charge("prefix:a", 60, 0.0) == 0  # 40 -> -20: a debt
    hint = buckets.charge("prefix:a", 60, 0.0)
    assert hint == 200  # 20 tokens at 100/s
    assert buckets.charge("prefix:a", 60, 0.199) > 0
    assert buckets.charge("prefix:a", 60, 0.2) == 0
    # Another producer is untouched by a's debt; the default rate applies to it.
    assert buckets.charge("prefix:b", 10, 0.2) == 0
    assert buckets.level("prefix:b", 0.2) == 0.0
    assert buckets.level("prefix:none", 0.2) is None
    stats = buckets.statistics()
    assert (stats.admitted, stats.refused, stats.admitted_tokens) == (4, 2, 190)


def test_TokenBuckets_zero_rate_refuses_with_the_longest_hint() -> None:
    buckets = TokenBuckets(producers_max=10, retry_after_max_ms=5000)
    buckets.set_rates({"prefix:blocked": 0.0}, 10.0, 1.0)
    assert buckets.charge("prefix:blocked", 1, 0.0) == 5000


def test_TokenBuckets_rejects_an_empty_table() -> None:
    with pytest.raises(ValueError, match="producers_max"):
        TokenBuckets(producers_max=0, retry_after_max_ms=1)


def test_TokenBuckets_full_table_sweeps_refilled_buckets_then_overflows() -> None:
    buckets = TokenBuckets(producers_max=2, retry_after_max_ms=10_000)
    buckets.set_rates({}, 10.0, 1.0)  # burst 10
    assert buckets.charge("prefix:a", 5, 0.0) == 0
    assert buckets.charge("prefix:b", 5, 0.0) == 0
    # Full and no bucket refilled: c is charged to the shared overflow bucket.
    assert buckets.charge("prefix:c", 10, 0.1) == 0
    assert buckets.level(OVERFLOW_IDENTITY, 0.1) == 0.0
    assert buckets.charge("prefix:d", 2, 0.2) == 0  # overflow at 0 + 1 token: admitted, -1
    assert buckets.charge("prefix:e", 1, 0.2) > 0  # the overflow's debt: cycling gains nothing
    assert buckets.statistics().overflowed == 3
    # At 0.5 s a and b have refilled: swept, and new identities get buckets of their own.
    assert buckets.charge("prefix:f", 1, 0.5) == 0
    stats = buckets.statistics()
    assert (stats.producers, stats.swept) == (1, 2)


_charges = st.lists(
    st.tuples(
        st.sampled_from(["prefix:a", "prefix:b", "prefix:c", "curve:" + KEY, "default"]),
        st.integers(min_value=1, max_value=500),
        st.floats(min_value=0.0, max_value=0.5),
    ),
    max_size=200,
)


@settings(max_examples=200)
@given(
    _charges, st.floats(min_value=1.0, max_value=2000.0), st.floats(min_value=0.1, max_value=3.0)
)
def test_TokenBuckets_admit_at_most_burst_plus_rate_times_time(
    charges: list[tuple[str, int, float]], rate: float, burst_s: float
) -> None:
    """Rule 5: over the run an identity is admitted at most burst + rate x t + one task."""
    buckets = TokenBuckets(producers_max=100, retry_after_max_ms=60_000)
    buckets.set_rates({"prefix:a": rate / 2}, rate, burst_s)
    now = 0.0
    admitted: dict[str, int] = {}
    for identity, cost, dt in charges:
        now += dt
        if buckets.charge(identity, cost, now) == 0:
            admitted[identity] = admitted.get(identity, 0) + cost
    for identity, tokens in admitted.items():
        r = buckets.rate(identity)
        assert tokens <= r * burst_s + r * now + 500 + 1e-6


@settings(max_examples=200)
@given(_charges, st.integers(min_value=1, max_value=3))
def test_TokenBuckets_table_stays_bounded(charges: list[tuple[str, int, float]], cap: int) -> None:
    """Rule 6: never more than producers_max buckets, and every charge is answered."""
    buckets = TokenBuckets(producers_max=cap, retry_after_max_ms=60_000)
    buckets.set_rates({}, 100.0, 1.0)
    now = 0.0
    for identity, cost, dt in charges:
        now += dt
        hint = buckets.charge(identity, cost, now)
        assert 0 <= hint <= 60_000
        assert buckets.statistics().producers <= cap


@settings(max_examples=200)
@given(_charges, st.floats(min_value=1.0, max_value=2000.0))
def test_TokenBuckets_retry_after_the_hint_is_admitted(
    charges: list[tuple[str, int, float]], rate: float
) -> None:
    """Rule 5: a producer that waits the hint (and sends nothing meanwhile) is admitted."""
    buckets = TokenBuckets(producers_max=100, retry_after_max_ms=3_600_000)
    buckets.set_rates({}, rate, 1.0)
    now = 0.0
    for identity, cost, dt in charges:
        now += dt
        hint = buckets.charge(identity, cost, now)
        if hint:
            assert buckets.charge(identity, cost, now + hint / 1000.0) == 0
            now += hint / 1000.0


def test_a_structured_outputs_form_is_charged_as_prompt() -> None:
    """The engine compiles a task's form (the largest grammar the wire takes: about 2 s of
    its CPU, bench/README): its characters count as the prompt's, so a producer's budget
    bounds how much compiling it may ask."""
    from gossipd.config import BudgetsConfig
    from gossipd.core.messages import Task
    from gossipd.core.sampling import SamplingParams, StructuredOutput
    from gossipd.ingress.budgets import BudgetGate

    config = BudgetsConfig(enabled=True, tokens_per_s_per_capacity=1000, default_share=1.0)
    plain = Task(v=1, id="a", prompt="p" * 40, reply_to="tcp://h:1",
                 params=SamplingParams(max_tokens=10))  # fmt: skip
    forms = [
        StructuredOutput(grammar="root ::= " + '"x" ' * 1000),
        StructuredOutput(json='{"enum": [' + ",".join(['"a"'] * 1000) + "]}"),
        StructuredOutput(regex="(" + "|".join(["ab"] * 1360) + ")"),  # (4081 of 4096)
        StructuredOutput(choice=["x" * 250] * 16),
    ]
    for form in forms:
        gate = BudgetGate(config, capacity_weight=1.0, retry_after_max_ms=60_000)
        held = msgspec.structs.replace(plain, params=SamplingParams(max_tokens=10, structured=form))
        assert gate.check(plain, 0.0) == 0 and gate.check(held, 0.0) == 0  # (into debt)
        # 1000 tokens a second: 20 for the plain task, more than the rest for the form's.
        assert gate.check(plain, 0.0) > 0, form
        fresh = BudgetGate(config, capacity_weight=1.0, retry_after_max_ms=60_000)
        assert all(fresh.check(plain, 0.0) == 0 for _ in range(40))


def test_a_members_capacity_weight_0_counts_as_1_in_budgets_as_in_placement() -> None:
    """PROTOCOL.md: a capacity_weight of 0 is a member that does not say, read as 1.0; the
    budgets summed the raw 0, so such a member took no part of the cluster's budget and
    every entry point's share moved."""
    from gossipd.core.gossip_messages import GpuState
    from gossipd.ingress.budgets import serving_capacity

    gpus = [GpuState(capacity_weight=0.0), GpuState(capacity_weight=2.0), None,
            GpuState(capacity_weight=3.0, status="draining")]  # fmt: skip
    assert serving_capacity(gpus) == [1.0, 2.0]


@pytest.mark.parametrize("leader", [False, True])
def test_a_drained_entry_points_part_keeps_the_parts_adding_up_to_the_budget(
    leader: bool,
) -> None:
    """Two equal members, d1 drained: both still take producers' tasks (d1 routes them to
    d0), so both enforce a part of every budget.  W counted the serving members only, so
    each enforced 1/1 and together 2x the budget (a review's figures: 500 + 500 tok/s for
    a budget of 500).  Now W counts every live entry point, while the budget is still the
    serving capacity's: each enforces half."""
    config = BudgetsConfig(enabled=True, tokens_per_s_per_capacity=1000.0, default_share=0.5)
    serving = GpuState(capacity_weight=1.0, status="serving")
    drained = GpuState(capacity_weight=1.0, status="draining")
    views = {"d0": [serving, drained], "d1": [drained, serving]}  # (itself first)
    gates = {}
    for name, view in views.items():
        gate = BudgetGate(config, capacity_weight=1.0, retry_after_max_ms=10_000)
        gate.entries = lambda view=view: entries_capacity(view)  # type: ignore[misc]
        gates[name] = gate
    table = gates["d0"].compute(serving_capacity(views["d0"]))
    for name, gate in gates.items():
        gate.apply(
            table if leader else gate.compute(serving_capacity(views[name])),
            source="leader" if leader else "local",
        )
    budget = table.default_tokens_per_s  # 500: one serving member's capacity, half of it
    assert budget == 500.0
    enforced = [gate.buckets.rate("default") for gate in gates.values()]
    assert enforced == [250.0, 250.0] and sum(enforced) == budget
