"""A per-peer circuit breaker (sans-IO).

Closed: calls go through; ``failures_max`` failures in a row open it.  Open: calls are refused
for ``open_s`` (the peer gets time to recover, we stop paying its timeouts).  Half-open: one
trial call; success closes it, failure opens it again.
"""

from __future__ import annotations

import enum
import math


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_CLOSED = BreakerState.CLOSED  # (a module global: an enum member read via its class is slow)


class Breaker:
    __slots__ = ("failures", "failures_max", "open_s", "opened_at", "state", "trial_out", "trials")

    def __init__(self, *, failures_max: int = 3, open_s: float = 2.0) -> None:
        self.failures_max = failures_max
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.trial_out = False
        self.trials = 0  # trials given: names the one out (end_trial)

    def allow(self, now: float) -> bool:
        if self.state is _CLOSED:  # (the usual state, asked once a forward: tested first)
            return True
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self.trial_out = False
        if self.state is BreakerState.HALF_OPEN and not self.trial_out:
            self.trial_out = True
            self.trials += 1
            return True
        return False

    def end_trial(self, trial: int) -> None:
        """The half-open trial's call ended without a verdict (it lost a hedge race, was
        refused for a reason that says nothing of the peer's health, or was withdrawn): the
        next call may be the trial.  Without this the breaker stayed half-open with its trial
        out for ever, and refused every call to the peer."""
        if self.state is BreakerState.HALF_OPEN and trial == self.trials:
            self.trial_out = False

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failures_max:
            self.state = BreakerState.OPEN
            self.opened_at = now
            self.failures = 0


# -- ack times: the quantile hedging waits for -------------------------------------------
# Recent forward-to-ack round trips, and the quantile that hedging waits for.
#
# A fixed window of the latest samples (old ones fall out, so the estimate follows the cluster
# as it speeds up or slows down); the quantile is recomputed every ``every`` samples rather than
# per forward, since sorting a window costs more than the forward itself.


class AckTimes:
    def __init__(
        self, *, quantile: float, window: int = 256, every: int = 32, min_samples: int = 32
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if window < 1 or every < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1, every >= 1 and 1 <= min_samples <= window")
        self._q = quantile
        self._window = window
        self._every = every
        self._min = min_samples
        self._samples: list[float] = []
        self._next = 0  # where the next sample goes once the window is full
        self._since = 0  # samples since the quantile was computed
        self._value: float | None = None

    def observe(self, seconds: float) -> None:
        if not seconds >= 0.0:  # also refuses NaN
            return
        if len(self._samples) < self._window:
            self._samples.append(seconds)
        else:
            self._samples[self._next] = seconds
            self._next = (self._next + 1) % self._window
        self._since += 1
        if len(self._samples) >= self._min and (self._value is None or self._since >= self._every):
            self._since = 0
            ordered = sorted(self._samples)
            # Nearest rank: the smallest sample with at least q of the window at or below it.
            rank = max(1, math.ceil(self._q * len(ordered)))
            self._value = ordered[rank - 1]

    def quantile(self) -> float | None:
        """The q-quantile of the window as last computed; None before ``min_samples``."""
        return self._value

    def __len__(self) -> int:
        return len(self._samples)
