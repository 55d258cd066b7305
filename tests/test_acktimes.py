"""The ack-time window that hedging waits on (gossipd/core/breaker.py, AckTimes)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.breaker import AckTimes

samples = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=600)


@given(samples, st.floats(0.5, 0.99))
def test_the_quantile_is_a_sample_of_the_window_with_q_of_it_at_or_below(
    values: list[float], q: float
) -> None:
    times = AckTimes(quantile=q, window=64, every=1, min_samples=1)
    for v in values:
        times.observe(v)
    window = values[-64:]
    got = times.quantile()
    assert got in window
    at_or_below = sum(v <= got for v in window)
    assert at_or_below >= math.ceil(q * len(window))
    assert sum(v < got for v in window) < math.ceil(q * len(window))


@given(samples)
def test_no_estimate_before_min_samples(values: list[float]) -> None:
    times = AckTimes(quantile=0.95, window=256, every=32, min_samples=32)
    for i, v in enumerate(values, start=1):
        times.observe(v)
        assert (times.quantile() is None) == (i < 32)


def test_the_estimate_follows_the_cluster_when_it_slows_down() -> None:
    times = AckTimes(quantile=0.95, window=100, every=10, min_samples=10)
    for _ in range(100):
        times.observe(0.001)
    assert times.quantile() == 0.001
    for _ in range(100):
        times.observe(0.050)
    assert times.quantile() == 0.050  # the fast samples have left the window


def test_bad_samples_and_settings_are_refused() -> None:
    times = AckTimes(quantile=0.9, window=4, every=1, min_samples=1)
    times.observe(float("nan"))
    times.observe(-1.0)
    assert len(times) == 0 and times.quantile() is None
    with pytest.raises(ValueError):
        AckTimes(quantile=1.0)
    with pytest.raises(ValueError):
        AckTimes(quantile=0.9, window=8, min_samples=9)
