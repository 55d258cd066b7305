"""A per-peer circuit breaker (sans-IO).

Closed: calls go through; ``failures_max`` failures in a row open it.  Open: calls are refused
for ``open_s`` (the peer gets time to recover, we stop paying its timeouts).  Half-open: one
trial call; success closes it, failure opens it again.
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    __slots__ = ("failures", "failures_max", "open_s", "opened_at", "state", "trial_out")

    def __init__(self, *, failures_max: int = 3, open_s: float = 2.0) -> None:
        self.failures_max = failures_max
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.trial_out = False

    def allow(self, now: float) -> bool:
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self.trial_out = False
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN and not self.trial_out:
            self.trial_out = True
            return True
        return False

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failures_max:
            self.state = BreakerState.OPEN
            self.opened_at = now
            self.failures = 0
