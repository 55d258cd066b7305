"""Placement of keys on members: weighted rendezvous hashing (highest random weight), sans-IO.

Why rendezvous and not a ring of virtual nodes: measured at N=64 over 1M keys (see
``gossipd bench ring``), rendezvous puts at most ~1.01x the mean number of keys on one member
where a 100-point ring puts 1.22x (ringpop) and even 1,000 points put ~1.08x; and when a member
joins or leaves exactly the keys it gains or loses move, no others, which is the minimum.
The price is O(N) hashing per lookup (about 20 us at N=64 here), paid once per task; a small
cache makes repeated keys (sessions) O(1).

Scores: for key k and member m with weight w, u = H(k, m) mapped to (0, 1) and
score = w / -ln(u); the member with the highest score owns k, and the others in falling score
order are its successors.  P(m owns k) = w / sum(w): capacity-weighted shares.
H is blake2b for the key and splitmix64 to combine it with each member's hash: stable across
processes and machines (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping

MASK64 = (1 << 64) - 1
_TWO64 = float(1 << 64)


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-mixed 64-bit bijection."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


class Ring:
    """Immutable: build a new Ring when the member set or a weight changes."""

    def __init__(self, weights: Mapping[str, float], *, cache_max: int = 4096) -> None:
        for name, w in weights.items():
            if not w > 0:
                raise ValueError(f"member {name!r} has weight {w}; weights must be > 0")
        self.members = tuple(sorted(weights))
        self._weights = tuple(float(weights[m]) for m in self.members)
        self._seeds = tuple(key_hash(m) for m in self.members)
        self._uniform = len(set(self._weights)) <= 1
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_max = cache_max

    def __len__(self) -> int:
        return len(self.members)

    def _scores(self, key: str) -> list[tuple[float, str]]:
        kh = key_hash(key)
        if self._uniform:
            # Equal weights: ranking by the raw hash is the same as by w / -ln(u).
            return [
                (float(mix64(kh ^ seed)), m)
                for seed, m in zip(self._seeds, self.members, strict=True)
            ]
        out = []
        for seed, w, m in zip(self._seeds, self._weights, self.members, strict=True):
            u = (mix64(kh ^ seed) + 0.5) / _TWO64
            out.append((w / -math.log(u), m))
        return out

    def owner(self, key: str) -> str:
        if not self.members:
            raise LookupError("the ring is empty")
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        best = self._best(key)
        self._cache[key] = best
        if len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return best

    def _best(self, key: str) -> str:
        kh = key_hash(key)
        best_score = -1.0
        best = self.members[0]
        if self._uniform:
            # mix64 inlined: this loop is the per-task cost of placement.
            top = -1
            for seed, m in zip(self._seeds, self.members, strict=True):
                x = kh ^ seed
                x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
                x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
                x ^= x >> 31
                if x > top:
                    top, best = x, m
            return best
        for score, m in self._scores(key):
            if score > best_score:
                best_score, best = score, m
        return best

    def successors(self, key: str, n: int | None = None) -> list[str]:
        """Distinct members in preference order: the owner first."""
        ranked = sorted(self._scores(key), reverse=True)
        names = [m for _, m in ranked]
        return names if n is None else names[:n]
