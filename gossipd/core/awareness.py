"""Lifeguard's local health awareness (sans-IO).

A member that misses its own deadlines (paused, starved, its network slow) is more likely to
be the problem than the members it fails to reach.  Its score rises on evidence of that
(a probe failed and the peers asked to help did not even nack; we were suspected; our own
timers ran late) and falls with each probe that succeeds.  Timeouts and the probe interval are
multiplied by ``score + 1``: an unhealthy member slows down instead of accusing others.
"""

from __future__ import annotations


class Awareness:
    __slots__ = ("max_score", "score")

    def __init__(self, max_score: int) -> None:
        self.max_score = max_score
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.max_score - 1, max(0, self.score + delta))

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)
