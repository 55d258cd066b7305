"""The latency histogram the hot path counts into: fixed buckets, one bisect per
observation; the collectors export it as a Prometheus histogram at scrape time."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class LatencyHistogram:
    """Fixed buckets, cumulative at export; ``observe`` is one bisect."""

    __slots__ = ("buckets_s", "count", "counts", "sum_s")

    def __init__(self, buckets_s: Iterable[float] = LATENCY_BUCKETS_S) -> None:
        self.buckets_s = tuple(buckets_s)
        self.counts = [0] * (len(self.buckets_s) + 1)
        self.count = 0
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.count += 1
        self.sum_s += value_s

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets_s), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
