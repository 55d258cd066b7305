"""The per-peer circuit breaker: its transitions as a table of scripts, and its invariants over
any sequence of calls (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.breaker import Breaker, BreakerState

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

# A script step: (call, now, what allow() returns or None, state after, opened_at after or None).
Step = tuple[str, float, bool | None, BreakerState, float | None]

SCRIPTS: list[tuple[str, int, list[Step]]] = [
    (
        "closed allows and stays closed",
        3,
        [("allow", 0.0, True, CLOSED, None), ("allow", 100.0, True, CLOSED, None)],
    ),
    (
        "failures_max failures in a row open it, at the last one's time",
        3,
        [
            ("failure", 1.0, None, CLOSED, None),
            ("failure", 2.0, None, CLOSED, None),
            ("allow", 2.5, True, CLOSED, None),
            ("failure", 3.0, None, OPEN, 3.0),
        ],
    ),
    (
        "a success resets the count of failures",
        3,
        [
            ("failure", 1.0, None, CLOSED, None),
            ("failure", 2.0, None, CLOSED, None),
            ("success", 2.5, None, CLOSED, None),
            ("failure", 3.0, None, CLOSED, None),
            ("failure", 4.0, None, CLOSED, None),
            ("failure", 5.0, None, OPEN, 5.0),
        ],
    ),
    (
        "open refuses until open_s has passed, then half-open allows one trial",
        1,
        [
            ("failure", 10.0, None, OPEN, 10.0),
            ("allow", 10.0, False, OPEN, 10.0),
            ("allow", 11.999, False, OPEN, 10.0),
            ("allow", 12.0, True, HALF, 10.0),
            ("allow", 12.0, False, HALF, 10.0),
            ("allow", 50.0, False, HALF, 10.0),
        ],
    ),
    (
        "trial success closes it",
        1,
        [
            ("failure", 0.0, None, OPEN, 0.0),
            ("allow", 2.0, True, HALF, None),
            ("success", 2.1, None, CLOSED, None),
            ("allow", 2.2, True, CLOSED, None),
            ("allow", 2.3, True, CLOSED, None),
        ],
    ),
    (
        "trial failure re-opens it with a new opened_at",
        3,
        [
            ("failure", 0.0, None, CLOSED, None),
            ("failure", 0.0, None, CLOSED, None),
            ("failure", 0.0, None, OPEN, 0.0),
            ("allow", 2.0, True, HALF, 0.0),
            ("failure", 2.5, None, OPEN, 2.5),  # one failure is enough in half-open
            ("allow", 4.4, False, OPEN, 2.5),
            ("allow", 4.5, True, HALF, 2.5),
        ],
    ),
    (
        "after a trial success the count of failures starts from zero",
        2,
        [
            ("failure", 0.0, None, CLOSED, None),
            ("failure", 0.0, None, OPEN, 0.0),
            ("allow", 2.0, True, HALF, None),
            ("success", 2.0, None, CLOSED, None),
            ("failure", 3.0, None, CLOSED, None),
            ("failure", 4.0, None, OPEN, 4.0),
        ],
    ),
    (
        "the count restarts at opening: one late failure while open does not extend it",
        2,
        [
            ("failure", 0.0, None, CLOSED, None),
            ("failure", 0.0, None, OPEN, 0.0),
            ("failure", 1.0, None, OPEN, 0.0),  # the answer to a call made before it opened
            ("allow", 2.0, True, HALF, 0.0),
        ],
    ),
]


@pytest.mark.parametrize(("failures_max", "script"), [(f, s) for _, f, s in SCRIPTS],
                         ids=[name for name, _, _ in SCRIPTS])  # fmt: skip
def test_breaker_transitions(failures_max: int, script: list[Step]) -> None:
    breaker = Breaker(failures_max=failures_max, open_s=2.0)
    for i, (call, now, returns, state, opened_at) in enumerate(script):
        if call == "allow":
            assert breaker.allow(now) is returns, f"step {i}"
        elif call == "failure":
            breaker.failure(now)
        else:
            breaker.success()
        assert breaker.state is state, f"step {i}: {call}({now})"
        if opened_at is not None:
            assert breaker.opened_at == opened_at, f"step {i}"


_calls = st.lists(
    st.tuples(
        st.sampled_from(["allow", "success", "failure", "end_trial", "end_stale"]),
        st.floats(min_value=0.0, max_value=3.0, allow_nan=False),  # time passing before it
    ),
    max_size=60,
)


@given(
    calls=_calls,
    failures_max=st.integers(min_value=1, max_value=5),
    open_s=st.floats(min_value=0.0, max_value=2.0, allow_nan=False),
)
def test_breaker_invariants_over_any_sequence(
    calls: list[tuple[str, float]], failures_max: int, open_s: float
) -> None:
    breaker = Breaker(failures_max=failures_max, open_s=open_s)
    now = 0.0
    trials = 0  # allow() answers True in half-open since the last outcome
    in_a_row = 0  # failures since the last success (exact while closed: closed starts there)
    for call, dt in calls:
        now += dt
        was = breaker.state
        if call == "allow":
            open_and_young = was is OPEN and now - breaker.opened_at < open_s
            allowed = breaker.allow(now)
            if open_and_young:
                assert not allowed and breaker.state is OPEN
            if was is CLOSED:
                assert allowed and breaker.state is CLOSED
            if allowed and breaker.state is HALF:
                trials += 1
            assert trials <= 1
        elif call == "success":
            breaker.success()
            trials, in_a_row = 0, 0
            assert breaker.state is CLOSED
        elif call == "end_trial":  # the trial out ended without a verdict: another may go
            breaker.end_trial(breaker.trials)
            if was is HALF:
                trials = 0
                assert not breaker.trial_out
            assert breaker.state is was
        elif call == "end_stale":  # an earlier trial's end changes nothing
            out = breaker.trial_out
            breaker.end_trial(breaker.trials - 1)
            assert breaker.state is was and breaker.trial_out is out
        else:
            breaker.failure(now)
            trials = 0
            in_a_row += 1
            if was is HALF or (was is CLOSED and in_a_row >= failures_max):
                assert breaker.state is OPEN and breaker.opened_at == now
            elif was is CLOSED:
                assert breaker.state is CLOSED
        assert breaker.state in (CLOSED, OPEN, HALF)
