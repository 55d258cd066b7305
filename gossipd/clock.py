"""The shell's one source of time.

Every reading of "now" that the shell hands to a core, stamps on a record or compares with a
deadline comes from the ``Clock`` that daemon.py builds and passes to each part, never from
``time`` directly (tests/test_clock.py checks), so a run can be driven by another clock and
the two kinds of time stay apart:

- ``monotonic()``: intervals and deadlines (ack timeouts, queueing, idle sockets).  Never
  jumps.
- ``wall()``: timestamps other processes compare (journal deadlines, drain orders, the
  seeds' times in etcd, logs).  The SWIM core's time is the wall clock at start advanced by
  the monotonic clock (GossipService.now): its probe schedule is shared by all members
  (round = floor(now / probe_interval)), and a step of the host's clock must not move it.

Waiting itself is the event loop's business (``loop.call_later``, ``asyncio.sleep``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The process's clocks (time.monotonic, time.time), held as the builtins themselves: a
    reading costs no Python call (the ingress reads the clock several times per task)."""

    __slots__ = ("monotonic", "wall")

    def __init__(self) -> None:
        self.monotonic: Callable[[], float] = time.monotonic
        self.wall: Callable[[], float] = time.time


class ManualClock:
    """A clock that moves only when told to (tests): both readings advance together."""

    __slots__ = ("_monotonic", "_wall")

    def __init__(self, *, monotonic: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._monotonic = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._monotonic

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._monotonic += seconds
        self._wall += seconds


SYSTEM_CLOCK = SystemClock()
