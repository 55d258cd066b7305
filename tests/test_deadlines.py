"""The deadline wheel fires each deadline once, never early, at most one resolution late."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.queueing import DeadlineWheel

RES = 0.01


@given(
    deadlines=st.lists(st.floats(0, 10, allow_nan=False), max_size=40),
    removed=st.sets(st.integers(0, 39)),
    sweeps=st.lists(st.floats(0, 12, allow_nan=False), min_size=1, max_size=30),
)
def test_DeadlineWheel_fires_each_once_never_early_and_not_removed(
    deadlines: list[float], removed: set[int], sweeps: list[float]
) -> None:
    wheel = DeadlineWheel(RES)
    tokens = {i: wheel.add(i, d) for i, d in enumerate(deadlines)}
    for i in removed & tokens.keys():
        wheel.remove(i, tokens[i])
    fired: dict[int, float] = {}
    for now in [*sorted(sweeps), 20.0]:
        for item in wheel.expire(now):
            assert item not in fired, "fired twice"
            fired[item] = now
            assert deadlines[item] <= now, "fired early"
    live = set(range(len(deadlines))) - removed
    assert set(fired) == live
    assert len(wheel) == 0


def test_DeadlineWheel_late_add_after_sweep_still_fires() -> None:
    wheel = DeadlineWheel(RES)
    wheel.expire(5.0)
    wheel.add("past", 1.0)
    assert wheel.expire(5.0) == ["past"]


@pytest.mark.parametrize(
    ("deadline", "now", "fires"),
    [(1.0, 0.999, False), (1.0, 1.0, True), (1.005, 1.0, False), (1.005, 1.006, True)],
)
def test_DeadlineWheel_table(deadline: float, now: float, fires: bool) -> None:
    wheel = DeadlineWheel(RES)
    wheel.add("x", deadline)
    assert (wheel.expire(now) == ["x"]) is fires


def test_DeadlineWheel_rejects_zero_resolution() -> None:
    with pytest.raises(ValueError):
        DeadlineWheel(0)
