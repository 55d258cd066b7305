"""Retry pauses that grow while etcd keeps failing: exponential, capped, with jitter.

A fixed 0.1 s pause sent every daemon's campaign and keepalive to an etcd that was down or
overloaded 20 times a second (about 20,000 requests a second from 1,000 GPUs, all in step);
doubling to ``cap_s`` with a random part spreads them, and one answer starts over at
``base_s`` so that a daemon leads again quickly once etcd is back.
"""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()
        self.failures = 0  # in a row

    def next_s(self) -> float:
        """The pause after one more failure: between half and all of min(cap, base x 2^n)."""
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0
