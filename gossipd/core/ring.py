"""Placement of keys on members: weighted rendezvous hashing (highest random weight), and
the bounded loads that filter its order (``place``, ``bound``: at the end), sans-IO.

Why rendezvous and not a ring of virtual nodes: measured at N=64 over 1M keys (see
``gossipd bench ring``), rendezvous puts at most ~1.01x the mean number of keys on one member
where a 100-point ring puts 1.22x (ringpop) and even 1,000 points put ~1.08x; and when a member
joins or leaves exactly the keys it gains or loses move, no others, which is the minimum.
The price is O(N) hashing per new key, paid once per task: done in one pass over every
member, by compiled kernels (core/hrw.py) from ``KERNEL_MIN`` members on, else by NumPy passes
(``gossipd bench place``, a new key: 2.9 us at N=64 and 4.1 us at N=10,000 with the kernels;
~6 and ~14 us with NumPy alone; one member at a time cost 3 ms), with the same owners as the
scalar loop; a small cache makes repeated keys (sessions) O(1).  No exact rendezvous can avoid touching every
member for a new key; a hierarchical one (groups, then members) moves ~1.8x the
minimum when a member leaves (N=64 in 8 groups, simulated: its group's weight falls, so it loses
keys its other members held), which is why this stays flat.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gossipd.core import hrw

MASK64 = (1 << 64) - 1
_TWO64 = float(1 << 64)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
# From this many members on, scores are computed with NumPy in one pass (measured here: the
# scalar loop is faster below, the vector one above; see ``gossipd bench place``).
VECTOR_MIN = 16
# Up to this many of the best, ``top`` selects them one pass each; more: one sort.
TOP_SELECT_MAX = 32
# From this many members on, the compiled kernels (core/hrw.py) score them when Numba is
# installed: ~1.2 us at N=10,000 where the NumPy passes take ~11 (0.3 against 3.5 at 64).
# Below, the NumPy passes: a process with a small ring never imports Numba (~0.5 s, ~80 MB).
KERNEL_MIN = 64


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-mixed 64-bit bijection."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=65_536)
def _seed(member: str) -> int:
    """A member's hash, cached: rings are rebuilt on every membership change."""
    return key_hash(member)


class Ring:
    """Immutable: build a new Ring when the member set or a weight changes (not when a load
    does: loads are placement's, see placement below)."""

    def __init__(
        self,
        weights: Mapping[str, float],
        *,
        cache_max: int = 4096,
        kernels: bool | None = None,
    ) -> None:
        """``kernels``: score with the compiled kernels (core/hrw.py) if Numba is installed;
        None: from ``KERNEL_MIN`` members on.  The owners and orders are the same either way."""
        for name, w in weights.items():
            if not w > 0:
                raise ValueError(f"member {name!r} has weight {w}; weights must be > 0")
        self.members = tuple(sorted(weights))
        self.index = {m: i for i, m in enumerate(self.members)}
        self._weights = tuple(float(weights[m]) for m in self.members)
        self._seeds = tuple(_seed(m) for m in self.members)
        self._uniform = len(set(self._weights)) <= 1
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_max = cache_max
        self._vector = len(self.members) >= VECTOR_MIN
        self._seed_arr = np.array(self._seeds, dtype=np.uint64)
        self._weight_arr = np.array(self._weights, dtype=np.float64)
        # Members grouped by weight (few distinct weights in practice: GPU kinds), each group
        # a contiguous slice of ``_perm`` in name order: the best of a group is its highest
        # raw hash, so only one score per group needs a logarithm.
        by_weight: dict[float, list[int]] = {}
        for i, w in enumerate(self._weights):
            by_weight.setdefault(w, []).append(i)
        groups = sorted(by_weight.items())
        self._perm = np.array([i for _, idx in groups for i in idx], dtype=np.int64)
        self._group_weights = [w for w, _ in groups]
        starts, at = [], 0
        for _, idx in groups:
            starts.append(at)
            at += len(idx)
        self._group_starts = np.array(starts, dtype=np.int64)
        self._group_bounds = [*starts, at]
        self._seed_a = self._seed_arr ^ (self._seed_arr >> _S30)
        self._seed_perm_a = self._seed_a[self._perm]
        self._group_of = np.empty(len(self.members), dtype=np.int64)
        for g in range(len(groups)):
            self._group_of[self._perm[starts[g] : starts[g] + len(groups[g][1])]] = g
        self._buf = np.empty(len(self.members), dtype=np.uint64)
        self._tmp = np.empty(len(self.members), dtype=np.uint64)
        if kernels is None:
            kernels = len(self.members) >= KERNEL_MIN
        self._kernels = hrw.load() if kernels and self._vector else None
        if self._kernels is not None:
            # Chunk maxima (at most one per 8 members) and the selected indices and values.
            self._scratch = np.empty(len(self.members) // 8 + 1, dtype=np.uint64)
            self._top_index = np.empty(TOP_SELECT_MAX, dtype=np.int64)
            self._top_value = np.empty(TOP_SELECT_MAX, dtype=np.uint64)
            self._perm_list: list[int] = self._perm.tolist()  # indexed per selected member

    def __len__(self) -> int:
        return len(self.members)

    def score(self, key_h: int, i: int) -> float:
        """Member ``i``'s score for a key hash: the scalar definition (module docstring)."""
        x = mix64(key_h ^ self._seeds[i])
        if self._uniform:
            return float(x)
        return self._weights[i] / -math.log((x + 0.5) / _TWO64)

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
        best = self.members[self._best_vector(key_hash(key))] if self._vector else self._best(key)
        self._cache[key] = best
        if len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return best

    def _best(self, key: str) -> str:
        """The owner by the scalar definition (one member at a time)."""
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

    def _mixed(self, kh: int, seeds_a: np.ndarray) -> np.ndarray:
        """mix64(kh ^ seed) for every seed, in the ring's scratch buffer (vectorised).
        ``seeds_a`` holds a(seed) = seed ^ (seed >> 30): mix64's first step is linear over
        XOR, a(kh ^ seed) = a(kh) ^ a(seed), so it is done once per member, not per key."""
        n = len(seeds_a)
        x, t = self._buf[:n], self._tmp[:n]
        np.bitwise_xor(seeds_a, np.uint64(kh ^ (kh >> 30)), out=x)
        np.multiply(x, _C1, out=x)
        np.right_shift(x, _S27, out=t)
        np.bitwise_xor(x, t, out=x)
        np.multiply(x, _C2, out=x)
        np.right_shift(x, _S31, out=t)
        np.bitwise_xor(x, t, out=x)
        return x

    def _best_vector(self, kh: int) -> int:
        """The owner's index, the same member as ``_best`` (one pass over arrays)."""
        kernels = self._kernels
        if kernels is not None:
            return self._best_kernel(kernels["best"], kh)
        if self._uniform:
            return int(self._mixed(kh, self._seed_a).argmax())
        x = self._mixed(kh, self._seed_perm_a)
        bounds = self._group_bounds
        best_i, best_score = -1, -1.0
        for g, w in enumerate(self._group_weights):
            j = bounds[g] + int(x[bounds[g] : bounds[g + 1]].argmax())
            score = w / -math.log((int(x[j]) + 0.5) / _TWO64)
            i = int(self._perm[j])
            # Equal scores: the first member in name order, as the scalar loop keeps it.
            if score > best_score or (score == best_score and i < best_i):
                best_i, best_score = i, score
        return best_i

    def _best_kernel(self, best: Callable[..., int], kh: int) -> int:
        """``_best_vector`` with the compiled kernel: the best raw hash of each weight group,
        then one logarithm per group (the same comparisons as there)."""
        ka = np.uint64(kh ^ (kh >> 30))
        if self._uniform:
            return int(best(self._seed_a, ka, 0, len(self.members), self._scratch))
        bounds, seeds, perm = self._group_bounds, self._seeds, self._perm_list
        best_i, best_score = -1, -1.0
        for g, w in enumerate(self._group_weights):
            i = perm[best(self._seed_perm_a, ka, bounds[g], bounds[g + 1], self._scratch)]
            score = w / -math.log((mix64(kh ^ seeds[i]) + 0.5) / _TWO64)
            if score > best_score or (score == best_score and i < best_i):
                best_i, best_score = i, score
        return best_i

    def successors(self, key: str, n: int | None = None) -> list[str]:
        """Distinct members in preference order: the owner first."""
        if n is not None and self._vector and n < len(self.members):
            return [self.members[i] for i in self.top(key_hash(key), n)]
        ranked = sorted(self._scores(key), reverse=True)
        names = [m for _, m in ranked]
        return names if n is None else names[:n]

    def top(self, kh: int, n: int, among: np.ndarray | None = None) -> list[int]:
        """The indices of the ``n`` best members for key hash ``kh`` (of ``among``, an array
        of member indices, when given), best first, in ``successors``' order: a partial
        selection (the best ``n`` of each weight group by raw hash), not a sort of all."""
        size = len(self.members) if among is None else len(among)
        if size == 0 or n <= 0:
            return []
        if size < VECTOR_MIN:
            idx = range(size) if among is None else (int(i) for i in among)
            ranked = sorted(((self.score(kh, i), self.members[i]), i) for i in idx)
            return [i for _, i in reversed(ranked[-n:])]
        if n > TOP_SELECT_MAX:
            return self._sorted(kh, n, among)
        if among is None and self._kernels is not None:
            return self._top_kernel(self._kernels["top"], kh, n)
        if among is None:
            x = self._mixed(kh, self._seed_perm_a)
            perm, bounds = self._perm, self._group_bounds
        else:
            groups = self._group_of[among]
            order = np.argsort(groups, kind="stable")
            perm = among[order]
            x = self._mixed(kh, self._seed_a[perm])
            counts = np.bincount(groups, minlength=len(self._group_weights))
            bounds = [0, *np.cumsum(counts).tolist()]
        ranked = []
        members, uniform = self.members, self._uniform
        for g in range(len(bounds) - 1):
            lo, hi = bounds[g], bounds[g + 1]
            part = x[lo:hi]
            w = self._group_weights[g]
            for _ in range(min(n, hi - lo)):
                j = int(part.argmax())
                v = int(part[j])
                part[j] = 0  # the scratch buffer: taken, out of the next pass
                i = int(perm[lo + j])
                score = float(v) if uniform else w / -math.log((v + 0.5) / _TWO64)
                ranked.append(((score, members[i]), i))
        ranked.sort()
        return [i for _, i in reversed(ranked[-n:])]

    def _top_kernel(self, top: Callable[..., int], kh: int, n: int) -> list[int]:
        """``top`` over every member with the compiled kernel: the same ``n`` best of each
        weight group by raw hash (no pass per member selected), ranked the same way."""
        ka = np.uint64(kh ^ (kh >> 30))
        bounds, perm, members = self._group_bounds, self._perm_list, self.members
        index, value = self._top_index, self._top_value
        if self._uniform:  # one group, in name order (perm is the identity)
            got = top(self._seed_a, ka, 0, len(members), n, self._scratch, index, value)
            values = value[:got].tolist()
            if len({float(v) for v in values}) == got:
                return index[:got].tolist()  # the kernel's order is the ranking's
            # Two hashes equal as floats (~2^-50 a pair): ranked as below, by name then.
        ranked: list[tuple[float, str, int]] = []  # (score, name, index): names are distinct
        uniform, log, seeds_a, scratch = self._uniform, math.log, self._seed_perm_a, self._scratch
        for g, w in enumerate(self._group_weights):
            got = top(seeds_a, ka, bounds[g], bounds[g + 1], n, scratch, index, value)
            for j, v in zip(index[:got].tolist(), value[:got].tolist(), strict=True):
                i = perm[j]
                score = float(v) if uniform else w / -log((v + 0.5) / _TWO64)
                ranked.append((score, members[i], i))
        ranked.sort()
        return [entry[2] for entry in reversed(ranked[-n:])]

    def _sorted(self, kh: int, n: int, among: np.ndarray | None) -> list[int]:
        """``top`` for many: one vectorised sort of the scores."""
        idx = np.arange(len(self.members)) if among is None else among
        x = self._mixed(kh, self._seed_a[idx])
        if self._uniform:
            ranked = np.argsort(x, kind="stable")[::-1][:n]
        else:
            u = (x.astype(np.float64) + 0.5) / _TWO64
            ranked = np.argsort(self._weight_arr[idx] / -np.log(u), kind="stable")[::-1][:n]
        return idx[ranked].tolist()


# -- placement: the ring's preference order, filtered and bounded ----------------------
# Which member runs a task (sans-IO):
#
# 1. Candidates are live members that are serving (not draining, not unhealthy) and that serve
#    the task's model and capabilities.
# 2. Bounded loads (Mirrokni et al., as HAProxy and Vimeo use it): with total in-flight load L
#    over the candidates and c >= 1, a member may take the task only while its load is below
#    ceil(c * (L + 1) * w / W) for its weight w of total weight W.  The first candidate in ring
#    order under its bound is chosen; keys move off a hot member only while it is hot, so
#    affinity holds otherwise.
#    A member whose engine is saturated (its gossiped engine load: requests queueing inside
#    vLLM, or a full KV cache) is passed over the same way while another is not; when every
#    candidate is saturated or over its bound, the bound alone decides.
# 3. The rest of the ring order follows as fallbacks, so a refusal or a timeout moves on
#    deterministically.


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    load: int = 0
    weight: float = 1.0
    status: str = "serving"
    models: frozenset[str] = frozenset()  # empty: serves any model
    capabilities: frozenset[str] = frozenset()
    saturated: bool = False  # its engine queues requests or its KV cache is full (gossiped)


def bound(total_load: int, weight: float, total_weight: float, c: float, floor: int = 0) -> int:
    """The most in-flight tasks a member may hold, counting the one being placed.  Below
    ``floor`` nobody counts as hot: at light load a few tasks more or less on one GPU cost
    nothing, and moving keys would cost their cache affinity."""
    return max(floor, math.ceil(c * (total_load + 1) * weight / total_weight))


def eligible(candidate: Candidate, model: str, capabilities: frozenset[str]) -> bool:
    if candidate.status != "serving":
        return False
    if model and candidate.models and model not in candidate.models:
        return False
    return capabilities <= candidate.capabilities


def place(
    key: str,
    candidates: Mapping[str, Candidate],
    *,
    ring: Ring | None = None,
    c: float = 1.25,
    floor: int = 0,
    model: str = "",
    capabilities: frozenset[str] = frozenset(),
) -> list[str]:
    """Members to try, in order (empty when none is eligible)."""
    if c < 1:
        raise ValueError("c must be >= 1")
    pool = {n: cand for n, cand in candidates.items() if eligible(cand, model, capabilities)}
    if not pool:
        return []
    if ring is None or set(ring.members) != set(pool):
        ring = Ring({n: cand.weight for n, cand in pool.items()})
    order = ring.successors(key)
    total_load = sum(cand.load for cand in pool.values())
    total_weight = sum(cand.weight for cand in pool.values())
    under = [
        cand.load < bound(total_load, cand.weight, total_weight, c, floor)
        for cand in (pool[name] for name in order)
    ]
    for prefer_unsaturated in (True, False):
        for i, name in enumerate(order):
            if under[i] and not (prefer_unsaturated and pool[name].saturated):
                return [name, *order[:i], *order[i + 1 :]]
    return order


class LoadCounts(dict[str, int]):
    """Per member in-flight counts with their sum kept as they change (``total``): bounded
    loads read the sum on every task, which must not cost a pass over every member.

    The forwarder and its ledger change a count four times a forwarded task: they set it
    with ``dict.__setitem__`` and change ``total`` themselves, sparing a Python call each
    time; every other write goes through the methods below, which keep ``total``."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, member: str, count: int) -> None:
        self.total += count - self.get(member, 0)
        dict.__setitem__(self, member, count)

    def __delitem__(self, member: str) -> None:
        self.total -= self[member]
        super().__delitem__(member)

    def pop(self, member: str, *default: int) -> int:  # type: ignore[override]
        if member in self:
            self.total -= self[member]
        return super().pop(member, *default)

    def popitem(self) -> tuple[str, int]:
        member, count = super().popitem()
        self.total -= count
        return member, count

    def clear(self) -> None:
        super().clear()
        self.total = 0

    def setdefault(self, member: str, count: int = 0) -> int:
        if member not in self:
            self[member] = count
        return self[member]

    def update(self, *args: object, **kwargs: int) -> None:
        for member, count in dict(*args, **kwargs).items():
            self[member] = count
