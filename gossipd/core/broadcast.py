"""The transmit-limited broadcast queue (sans-IO).

Each update waiting to be gossiped is sent at most ``retransmit_mult * ceil(log10(N + 1))``
times (an item may ask for a multiple), least-sent first (newest first among equals), packed into each outgoing message within
a byte budget.  A newer update with the same key (node, family) replaces the queued one, so a
stale update is never sent after a fresh one.  Items marked urgent (membership changes) also
drive dedicated gossip messages; the rest (GPU metadata) only ride piggyback.
The queue is bounded: when full, the most-sent item goes first (counted).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Any


def retransmit_limit(mult: int, n: int) -> int:
    return mult * math.ceil(math.log10(max(n, 1) + 1))


class _Item:
    __slots__ = ("key", "limit_mult", "size", "transmits", "update", "urgent")

    def __init__(
        self, key: Hashable, update: Any, size: int, urgent: bool, limit_mult: int = 1
    ) -> None:
        self.key = key
        self.update = update
        self.size = size
        self.urgent = urgent
        self.limit_mult = limit_mult
        self.transmits = 0


class BroadcastQueue:
    def __init__(self, *, retransmit_mult: int, items_max: int) -> None:
        self._mult = retransmit_mult
        self._items_max = items_max
        self._by_key: dict[Hashable, _Item] = {}
        self._buckets: dict[int, dict[Hashable, _Item]] = {}
        self._urgent = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def urgent_pending(self) -> bool:
        return self._urgent > 0

    def push(
        self, key: Hashable, update: Any, size: int, *, urgent: bool, limit_mult: int = 1
    ) -> None:
        """Queue ``update`` under ``key``; ``limit_mult`` multiplies its transmit limit."""
        self._remove(key)
        if len(self._by_key) >= self._items_max:
            self._drop_most_sent()
        item = _Item(key, update, size, urgent, limit_mult)
        self._by_key[key] = item
        self._buckets.setdefault(0, {})[key] = item
        self._urgent += urgent

    def get(self, key: Hashable) -> Any | None:
        item = self._by_key.get(key)
        return None if item is None else item.update

    def _remove(self, key: Hashable) -> _Item | None:
        item = self._by_key.pop(key, None)
        if item is not None:
            bucket = self._buckets[item.transmits]
            del bucket[key]
            if not bucket:
                del self._buckets[item.transmits]
            self._urgent -= item.urgent
        return item

    def _drop_most_sent(self) -> None:
        top = max(self._buckets)
        key = next(iter(self._buckets[top]))
        self._remove(key)
        self.dropped += 1

    def select(
        self, budget_bytes: int, n_members: int, first: Iterable[Hashable] = ()
    ) -> list[Any]:
        """Updates for one message, within ``budget_bytes``; each counts as one transmission.
        Keys in ``first`` go before the rest (updates about the recipient, or about us)."""
        by_key = self._by_key
        if not by_key:
            return []  # the steady state: nothing queued (most messages carry nothing)
        # Called for every message sent: written for speed (no per-call set; _remove inlined).
        chosen: list[_Item] = []
        used = 0
        for key in first:
            item = by_key.get(key)
            if item is not None and used + item.size <= budget_bytes and item not in chosen:
                chosen.append(item)
                used += item.size
        firsts = len(chosen)
        buckets = self._buckets
        for transmits in sorted(buckets):
            for item in reversed(buckets[transmits].values()):
                if used + item.size > budget_bytes:
                    if budget_bytes - used < 64:
                        break
                    continue
                if firsts and item in chosen[:firsts]:
                    continue
                chosen.append(item)
                used += item.size
            if budget_bytes - used < 64:
                break
        limit = retransmit_limit(self._mult, n_members)
        for item in chosen:
            key, transmits = item.key, item.transmits
            bucket = buckets[transmits]
            del bucket[key]
            if not bucket:
                del buckets[transmits]
            del by_key[key]
            item.transmits = transmits = transmits + 1
            if transmits < limit * item.limit_mult:
                by_key[key] = item
                later = buckets.get(transmits)
                if later is None:
                    later = buckets[transmits] = {}
                later[key] = item
            else:
                self._urgent -= item.urgent
        return [item.update for item in chosen]
