"""Which member runs a task: the ring's preference order, filtered and bounded (sans-IO).

1. Candidates are live members that are serving (not draining, not unhealthy) and that serve
   the task's model and capabilities.
2. Bounded loads (Mirrokni et al., as HAProxy and Vimeo use it): with total in-flight load L
   over the candidates and c >= 1, a member may take the task only while its load is below
   ceil(c * (L + 1) * w / W) for its weight w of total weight W.  The first candidate in ring
   order under its bound is chosen; keys move off a hot member only while it is hot, so
   affinity holds otherwise.
   A member whose engine is saturated (its gossiped engine load: requests queueing inside
   vLLM, or a full KV cache) is passed over the same way while another is not; when every
   candidate is saturated or over its bound, the bound alone decides.
3. The rest of the ring order follows as fallbacks, so a refusal or a timeout moves on
   deterministically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gossipd.core.ring import Ring


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
    loads read the sum on every task, which must not cost a pass over every member."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, member: str, count: int) -> None:
        # Twice a forwarded task: dict's own method, not super() (a lookup and an object).
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

    def setdefault(self, member: str, count: int = 0) -> int:  # type: ignore[override]
        if member not in self:
            self[member] = count
        return self[member]

    def update(self, *args: object, **kwargs: int) -> None:  # type: ignore[override]
        for member, count in dict(*args, **kwargs).items():  # type: ignore[call-overload]
            self[member] = count
