"""A run queue for worker coroutines that wakes as few of them as the work needs.

asyncio.Queue wakes one waiting worker per item, so a burst of 256 quick tasks costs 256 task
wake-ups even when one worker could run them all back to back.  Here at most one worker is
woken-but-not-yet-running at a time; a worker that takes an item and sees more wakes the next.
A worker that runs its item to completion without suspending (a fast engine) keeps draining;
a worker that suspends inside its item lets the next woken worker run, so concurrency ramps
up one loop turn per worker exactly when items do suspend.

Ordering: items are taken in FIFO order.  Concurrency: one event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class RunQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._woken = 0
        self.wakeups = 0

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        if self._woken == 0:
            self._wake_one()

    def get_nowait(self) -> T:
        """Take the oldest item; raises IndexError when empty."""
        return self._items.popleft()

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._woken += 1
                self.wakeups += 1
                return

    async def get(self) -> T:
        while not self._items:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # woken, then cancelled: pass it on
                    self._woken -= 1
                    if self._items:
                        self._wake_one()
                raise
            self._woken -= 1
        item = self._items.popleft()
        if self._items and self._woken == 0:
            self._wake_one()
        return item
