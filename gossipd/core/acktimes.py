"""Recent forward-to-ack round trips, and the quantile that hedging waits for.

A fixed window of the latest samples (old ones fall out, so the estimate follows the cluster
as it speeds up or slows down); the quantile is recomputed every ``every`` samples rather than
per forward, since sorting a window costs more than the forward itself.
"""

from __future__ import annotations

import math


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
