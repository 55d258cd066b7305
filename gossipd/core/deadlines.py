"""Deadlines in buckets of ``resolution_s`` (a hashed timer wheel), sans-IO.

Arming a per-task asyncio timeout costs about 11 us under uvloop (a timer handle and a
context manager per task), a fifth of the whole per-task budget at 20,000 tasks/s.  Here
arming and disarming are one dict operation each, and one periodic sweep expires everything
due.  A deadline fires no earlier than it is due and at most one resolution (plus the sweep
delay) late.

Rules: ``add`` then ``remove`` of the same item leaves nothing behind; ``expire(now)`` returns
each item added with a deadline <= now exactly once, unless it was removed first.
"""

from __future__ import annotations

import math
from collections.abc import Hashable


class DeadlineWheel:
    def __init__(self, resolution_s: float = 0.01) -> None:
        if resolution_s <= 0:
            raise ValueError("resolution_s must be > 0")
        self._resolution_s = resolution_s
        self._buckets: dict[int, dict[Hashable, float]] = {}
        self._swept_to: int | None = None  # every bucket < this has been expired

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def add(self, item: Hashable, deadline: float) -> int:
        """Arm a deadline; returns the token that ``remove`` needs."""
        # The bucket whose end is the first bucket boundary >= deadline (once per task).
        index = math.ceil(deadline / self._resolution_s)
        if self._swept_to is not None and index < self._swept_to:
            index = self._swept_to  # already swept past: the next sweep looks at it
        self._buckets.setdefault(index, {})[item] = deadline
        return index

    def remove(self, item: Hashable, token: int) -> None:
        bucket = self._buckets.get(token)
        if bucket is not None:
            bucket.pop(item, None)
            if not bucket:
                del self._buckets[token]

    def expire(self, now: float) -> list[Hashable]:
        """Remove and return every item whose deadline is <= now."""
        due: list[Hashable] = []
        last_full = math.floor(now / self._resolution_s)  # buckets <= this end at or before now
        if self._buckets:
            start = min(self._buckets) if self._swept_to is None else self._swept_to
            if last_full - start > len(self._buckets):  # a long gap: walk the buckets instead
                indices = sorted(i for i in self._buckets if i <= last_full)
            else:
                indices = range(start, last_full + 1)
            for index in indices:
                bucket = self._buckets.pop(index, None)
                if bucket:
                    due.extend(bucket)
        self._swept_to = (
            last_full + 1 if self._swept_to is None else max(self._swept_to, last_full + 1)
        )
        # The bucket that contains `now` may hold items already due.
        current = self._buckets.get(self._swept_to)
        if current:
            for item, deadline in list(current.items()):
                if deadline <= now:
                    due.append(item)
                    del current[item]
            if not current:
                del self._buckets[self._swept_to]
        return due
