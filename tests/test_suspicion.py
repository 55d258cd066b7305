"""Lifeguard's suspicion math and local health awareness, evaluated against hand-computed rows
and the exact formulas the docstrings state."""

from __future__ import annotations

import math

import pytest

from gossipd.core.awareness import Awareness
from gossipd.core.broadcast import retransmit_limit
from gossipd.core.suspicion import Suspicion, remaining_timeout_s, suspicion_min_s


@pytest.mark.parametrize(
    ("confirmations", "k", "min_s", "max_s", "expected"),
    [
        (0, 3, 2.0, 6.0, 6.0),
        (1, 3, 2.0, 6.0, 6.0 - 4.0 * math.log(2) / math.log(4)),  # 4.0
        (2, 3, 2.0, 6.0, 6.0 - 4.0 * math.log(3) / math.log(4)),
        (3, 3, 2.0, 6.0, 2.0),
        (9, 3, 2.0, 6.0, 2.0),
        (0, 0, 2.0, 6.0, 2.0),  # nobody to confirm: the minimum at once
    ],
)
def test_remaining_timeout_s_table(
    confirmations: int, k: int, min_s: float, max_s: float, expected: float
) -> None:
    assert remaining_timeout_s(confirmations, k, min_s, max_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mult", "n", "interval", "floor", "expected"),
    [
        (0.8, 64, 1.0, 1.6, 0.8 * math.log10(65)),  # 1.45 -> floor
        (0.8, 1000, 1.0, 1.6, 0.8 * math.log10(1001)),  # 2.4
        (1.0, 9, 1.0, 0.0, 1.0),
        (1.0, 99, 2.0, 0.0, 4.0),
    ],
)
def test_suspicion_min_s_is_the_documented_formula(
    mult: float, n: int, interval: float, floor: float, expected: float
) -> None:
    assert suspicion_min_s(mult, n, interval, floor) == pytest.approx(max(floor, expected))


def test_Suspicion_witness_deadline_shrinks_with_confirmations_and_is_idempotent() -> None:
    s = Suspicion(incarnation=1, started_at=10.0, by="a", k=3, min_s=2.0, max_s=6.0, witness=True)
    assert s.deadline() == pytest.approx(16.0)
    assert s.confirm("b") and not s.confirm("b")
    assert s.deadline() == pytest.approx(14.0)
    s.confirm("c")
    s.confirm("d")
    assert s.deadline() == pytest.approx(12.0)


def test_Suspicion_non_witness_always_waits_the_maximum() -> None:
    s = Suspicion(incarnation=1, started_at=0.0, by="a", k=3, min_s=2.0, max_s=6.0, witness=False)
    for who in "bcdefg":
        s.confirm(who)
    assert s.deadline() == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("mult", "n", "expected"),
    [(4, 1, 4), (4, 9, 4), (4, 10, 8), (4, 64, 8), (4, 1000, 16), (3, 2000, 12)],
)
def test_retransmit_limit_table(mult: int, n: int, expected: int) -> None:
    assert retransmit_limit(mult, n) == expected == mult * math.ceil(math.log10(n + 1))


def test_Awareness_is_bounded_and_scales_timeouts() -> None:
    a = Awareness(max_score=4)
    a.apply(-1)
    assert a.score == 0 and a.scale(0.5) == 0.5
    for _ in range(10):
        a.apply(+1)
    assert a.score == 3 and a.scale(0.5) == 2.0
