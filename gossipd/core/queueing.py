"""Expected queueing wait of a new task, and the overload decision made from it (sans-IO).

Rules:
1. Service time is the time a worker holds a task that runs to its end (start to final
   result); its estimate is an exponentially weighted moving average of those observed,
   ``s <- s + smoothing * (observed - s)``, starting at the first observation.
2. With ``pending`` tasks already queued or running and ``concurrency`` workers, a new task
   starts after ``ahead = max(0, pending - concurrency + 1)`` of them finish; workers finish
   ``concurrency / s`` tasks a second, so its expected wait is ``ahead * s / concurrency``.
3. A new task may wait at most ``bound = deadline_ratio * remaining_s`` (what is left of its
   deadline), and at most ``target_s`` when that is set (> 0).
4. It is refused (``overloaded``) when its expected wait exceeds the bound; until a first
   service time is observed (cold start) every task is admitted.
5. The retry-after hint gives each refused task its own slot: the earliest time the queue
   will have drained enough for it (the wait falls by one second a second when nothing
   arrives: ``now + expected_wait - bound``), but not before the slot given to the previous
   refused task plus one service slot (``s / concurrency``, the time the workers take to
   make room for one more), nor before ``now + retry_after_min_ms``; at most
   ``now + retry_after_max_ms``.  So refused tasks that all retry come back spread out at the
   rate the workers free room, instead of together, and a task told to come back past its
   deadline (its producer gives up at once) tells its producer that the load is being shed.

Theory of operation: the ingress calls ``observe`` with each finished task's service time and
``decide`` for each new task with the current pending count, its remaining deadline and the
time (slots are absolute times; nothing here reads a clock).  The
estimate assumes that the concurrency the engine is given is the concurrency it runs at (true
of the echo engine; for vLLM a batch's per-task time is measured at the load it runs under).
The expected wait grows with ``pending``, so refusals are monotone in queue length.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from gossipd.errors import LocalProtocolError


def expected_wait_s(pending: int, concurrency: int, service_s: float) -> float:
    """Rule 2: the expected wait of a task arriving behind ``pending`` others."""
    return max(0, pending - concurrency + 1) * service_s / concurrency


def wait_bound_s(remaining_s: float, deadline_ratio: float, target_s: float) -> float:
    """Rule 3: the longest wait a task with ``remaining_s`` left of its deadline may face."""
    bound = max(0.0, remaining_s) * deadline_ratio
    return min(bound, target_s) if target_s > 0 else bound


def retry_slot(
    now: float, wait_s: float, bound_s: float, next_slot: float, min_ms: int, max_ms: int
) -> float:
    """Rule 5: when (absolute time) a task refused at ``now`` may come back."""
    slot = max(now + wait_s - bound_s, now + min_ms / 1000.0, next_slot)
    return min(slot, now + max_ms / 1000.0)


def retry_after_ms(now: float, slot: float) -> int:
    """The hint for a retry at ``slot``, in whole milliseconds (rounded up)."""
    return max(0, math.ceil(round((slot - now) * 1000.0, 6)))


@dataclass(frozen=True, slots=True)
class QueueDecision:
    admit: bool
    expected_wait_s: float  # 0 at cold start
    bound_s: float
    retry_after_ms: int  # meaningful when not admitted


# Admitted without a wait to compute (shared: decide() allocates nothing on its fast path).
_ADMITTED = QueueDecision(True, 0.0, 0.0, 0)


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    service_s: float | None  # the current estimate; None before the first observation
    observed: int  # service times observed
    refused: int  # decisions that refused


class QueueWait:
    def __init__(
        self,
        *,
        concurrency: int,
        deadline_ratio: float,
        target_s: float,
        retry_after_min_ms: int,
        retry_after_max_ms: int,
        smoothing: float,
    ) -> None:
        if concurrency < 1:
            raise LocalProtocolError(f"concurrency must be >= 1, found {concurrency}")
        if not 0.0 < deadline_ratio <= 1.0:
            raise LocalProtocolError(f"deadline_ratio must be in (0, 1], found {deadline_ratio}")
        if not 0.0 < smoothing <= 1.0:
            raise LocalProtocolError(f"smoothing must be in (0, 1], found {smoothing}")
        if target_s < 0 or not 0 <= retry_after_min_ms <= retry_after_max_ms:
            raise LocalProtocolError(
                "target_s must be >= 0 and 0 <= retry_after_min_ms <= retry_after_max_ms"
            )
        self._concurrency = concurrency
        self._deadline_ratio = deadline_ratio
        self._target_s = target_s
        self._retry_min_ms = retry_after_min_ms
        self._retry_max_ms = retry_after_max_ms
        self._smoothing = smoothing
        self._service_s: float | None = None
        self._next_slot = -math.inf  # the earliest retry slot for the next refused task
        self._observed = 0
        self._refused = 0

    @property
    def concurrency(self) -> int:
        return self._concurrency

    @property
    def service_s(self) -> float | None:
        return self._service_s

    def observe(self, service_s: float) -> None:
        """Rule 1: a task ran to its end in ``service_s`` seconds."""
        if not service_s >= 0:  # also NaN
            raise LocalProtocolError(f"service_s must be >= 0, found {service_s}")
        self._observed += 1
        if self._service_s is None:
            self._service_s = service_s
        else:
            self._service_s += self._smoothing * (service_s - self._service_s)

    def expected_wait_s(self, pending: int) -> float:
        """The expected wait of a task arriving now (0 before the first observation)."""
        if self._service_s is None:
            return 0.0
        return expected_wait_s(pending, self._concurrency, self._service_s)

    def decide(self, now: float, pending: int, remaining_s: float) -> QueueDecision:
        """Rules 3-5 for a task arriving at ``now`` behind ``pending`` others with
        ``remaining_s`` left of its deadline."""
        service_s = self._service_s
        if service_s is None or pending < self._concurrency:
            return _ADMITTED  # cold start, or a worker is free: no wait (the common case)
        wait = expected_wait_s(pending, self._concurrency, service_s)
        bound = wait_bound_s(remaining_s, self._deadline_ratio, self._target_s)
        if wait <= bound:
            return QueueDecision(True, wait, bound, 0)
        self._refused += 1
        slot = retry_slot(now, wait, bound, self._next_slot, self._retry_min_ms, self._retry_max_ms)
        self._next_slot = slot + service_s / self._concurrency
        return QueueDecision(False, wait, bound, retry_after_ms(now, slot))

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(
            service_s=self._service_s, observed=self._observed, refused=self._refused
        )


# -- deadlines: a hashed timer wheel -----------------------------------------------------
# Deadlines in buckets of ``resolution_s`` (a hashed timer wheel), sans-IO.
#
# Arming a per-task asyncio timeout costs about 11 us under uvloop (a timer handle and a
# context manager per task), a fifth of the whole per-task budget at 20,000 tasks/s.  Here
# arming and disarming are one dict operation each, and one periodic sweep expires everything
# due.  A deadline fires no earlier than it is due and at most one resolution (plus the sweep
# delay) late.
#
# Rules: ``add`` then ``remove`` of the same item leaves nothing behind; ``expire(now)`` returns
# each item added with a deadline <= now exactly once, unless it was removed first.


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
            indices: Iterable[int]
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
