"""Token budgets per producer: who a producer is, what it may spend, and the buckets that
enforce it at each entry point (sans-IO: every input carries ``now``).

Rules:
1. Identity (``producer_identity``): ``curve:<z85 key>`` when the task came over CURVE (the
   key the ZAP handler authenticated, ``Task.producer_key``); else ``prefix:<P>`` when the
   task's ``key`` holds the separator and P (what precedes its first occurrence) is not
   empty; else ``default``.  Only the CURVE identity is authenticated: without CURVE a
   producer can name any prefix, so budgets are cooperative there.
2. Budgets (``compute_budgets``): the cluster's rate is ``tokens_per_s_per_capacity`` x the sum
   of the live serving members' ``capacity_weight``; a producer named in ``tokens_per_s`` gets
   that absolute rate; one named in ``shares`` gets that share of the cluster's rate; any
   other gets ``default_share`` of it.  Shares need not sum to 1: a budget is a ceiling, not a
   reservation.
3. Shares of a budget (``local_share``): the entry point with capacity weight w enforces
   w / W of every budget, W the capacity of every live member as it sees them, serving or
   not (a drained or unhealthy member still takes producers' tasks and routes them on; the
   budgets' own capacity total, of the serving members, when it knows none); the entry
   points' shares add up to the budget (sum of w = W), so a producer that spreads its tasks
   over the entry points in proportion to their capacity (equally, for equal GPUs) gets its
   whole budget, and one that sends everything to one entry point gets that entry point's
   share: never more than its budget.
4. Cost (``task_cost_tokens``): ceil(prompt characters / chars_per_token) + max_tokens,
   charged once at the entry point when the task is admitted there.  No correction at
   completion: the entry point does not see the result (the owner answers the producer), and
   max_tokens is what the producer reserves of the engine.
5. Buckets (``TokenBuckets``): one per identity, holding up to burst = rate x burst_s tokens,
   refilled at rate.  A task is admitted when the level is >= 0 and then costs its tokens, so
   the level may go below zero (a task bigger than the burst still runs, later tasks wait
   until the debt is repaid).  Refused: ``retry_after_ms`` = ceil(-level / rate) in ms, at
   least 1, at most ``retry_after_max_ms``; a rate of 0 refuses with ``retry_after_max_ms``.
   Over any interval of length t an identity is admitted at most burst + rate x t + one
   task's cost.
6. Bounded memory: at most ``producers_max`` buckets.  A full bucket carries no state (a new
   one starts full), so when the table is full the full ones are dropped; if none is full, a
   new identity is charged to the shared ``overflow`` bucket (at the default rate), so that
   cycling through identities gains nothing.  The sweep runs at most once per time a bucket
   takes to fill, so a flood of new identities costs O(1) each.

Theory: the leader computes one Budgets table from the gossiped capacity and the configured
policy and gossips it; every daemon scales it by its own share and charges tasks against it
before routing them, so a runaway producer is refused at the door, costing a decode and an
answer, and never reaches a queue or an engine that others are waiting on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import msgspec

DEFAULT_IDENTITY = "default"
OVERFLOW_IDENTITY = "overflow"
IDENTITY_CHARS_MAX = 300
BUDGETS_PRODUCERS_MAX = 1000  # named producers in one Budgets table (fits a 64 KiB directive)
# A level this close below zero counts as zero: the float error of refilling exactly the
# retry-after hint's worth must not refuse the retry.
LEVEL_EPSILON_TOKENS = 1e-6

Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]


class Budgets(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The table the leader publishes (the ``budgets`` directive's body): tokens/s for the
    whole cluster per producer, before any entry point's share is taken."""

    capacity_total: Rate  # the sum of capacity_weight the rates were computed from
    cluster_tokens_per_s: Rate
    default_tokens_per_s: Rate
    producers: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=IDENTITY_CHARS_MAX)], Rate],
        msgspec.Meta(max_length=BUDGETS_PRODUCERS_MAX),
    ] = msgspec.field(default_factory=dict)
    burst_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 1.0

    def rate(self, identity: str) -> float:
        return self.producers.get(identity, self.default_tokens_per_s)


def decode_budgets(body: object) -> Budgets:
    """A directive's decoded body as Budgets; ``ValueError`` when it is not one."""
    try:
        return msgspec.convert(body, Budgets)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid budgets directive: {exc}") from None


def producer_identity(producer_key: str, key: str, separator: str) -> str:
    """Rule 1: whose budget a task is charged to."""
    if producer_key:
        return "curve:" + producer_key
    if separator:
        prefix, found, _ = key.partition(separator)
        if found and prefix:
            return "prefix:" + prefix
    return DEFAULT_IDENTITY


def task_cost_tokens(prompt_chars: int, max_tokens: int, chars_per_token: float) -> int:
    """Rule 4: the tokens a task is charged at admission."""
    return math.ceil(prompt_chars / chars_per_token) + max_tokens


def compute_budgets(
    capacity_weights: Iterable[float],
    *,
    tokens_per_s_per_capacity: float,
    default_share: float,
    shares: Mapping[str, float],
    tokens_per_s: Mapping[str, float],
    burst_s: float,
) -> Budgets:
    """Rule 2, from the capacity weights of the live serving members."""
    capacity_total = sum(capacity_weights)
    cluster = tokens_per_s_per_capacity * capacity_total
    producers = {identity: share * cluster for identity, share in shares.items()}
    producers.update(tokens_per_s)
    return Budgets(
        capacity_total=capacity_total,
        cluster_tokens_per_s=cluster,
        default_tokens_per_s=default_share * cluster,
        producers=producers,
        burst_s=burst_s,
    )


def local_share(budgets: Budgets, capacity_weight: float, entries_capacity: float = 0.0) -> float:
    """Rule 3: the part of every budget this entry point enforces (0..1), of
    ``entries_capacity`` (every live entry point's capacity weight; 0: the budgets')."""
    total = entries_capacity if entries_capacity > 0.0 else budgets.capacity_total
    if total <= 0.0:
        return 1.0  # nobody's capacity known: a lone entry point enforces the whole budget
    return min(1.0, capacity_weight / total)


def retry_after_ms(level: float, rate: float, retry_after_max_ms: int) -> int:
    """Rule 5: how long until a bucket at ``level`` (< 0) is back at 0, at least 1 (0 would
    read as "admitted": TokenBuckets.charge), at most ``retry_after_max_ms`` (cut before
    rounding: a tiny rate's wait is no integer)."""
    longest = max(1, retry_after_max_ms)
    if rate <= 0.0:
        return longest
    wait_ms = -level / rate * 1000.0
    if not wait_ms < longest:  # (infinite too)
        return longest
    return max(1, math.ceil(wait_ms))


@dataclass(frozen=True, slots=True)
class TokenBucketStatistics:
    producers: int  # buckets held now
    admitted: int
    refused: int
    admitted_tokens: int
    overflowed: int  # charges that went to the shared overflow bucket (table full)
    swept: int  # full buckets dropped to make room


class TokenBuckets:
    """Rules 5 and 6: per-identity buckets at rates scaled to this entry point."""

    def __init__(self, *, producers_max: int, retry_after_max_ms: int) -> None:
        if producers_max < 1:
            raise ValueError("producers_max must be >= 1")
        self._producers_max = producers_max
        self._retry_after_max_ms = retry_after_max_ms
        self._rates: Mapping[str, float] = {}
        self._default_rate = 0.0
        self._burst_s = 1.0
        # identity -> [level, updated_at]; the overflow bucket is kept apart (never swept).
        self._buckets: dict[str, list[float]] = {}
        self._overflow: list[float] | None = None
        self._next_sweep_at = -math.inf
        self._admitted = 0
        self._refused = 0
        self._admitted_tokens = 0
        self._overflowed = 0
        self._swept = 0

    def set_rates(self, rates: Mapping[str, float], default_rate: float, burst_s: float) -> None:
        """New local rates (tokens/s at this entry point); levels carry over, capped at the
        new bursts when next charged."""
        self._rates = dict(rates)
        self._default_rate = default_rate
        self._burst_s = burst_s
        self._next_sweep_at = -math.inf

    def rate(self, identity: str) -> float:
        if identity == OVERFLOW_IDENTITY:
            return self._default_rate
        return self._rates.get(identity, self._default_rate)

    def charge(self, identity: str, cost: int, now: float) -> int:
        """Charge ``cost`` tokens to ``identity``: 0 when admitted, else the retry-after hint
        in ms (>= 1)."""
        bucket, rate = self._bucket(identity, now)
        level = self._refill(bucket, rate, now)
        if level >= -LEVEL_EPSILON_TOKENS and rate > 0.0:
            bucket[0] = level - cost
            self._admitted += 1
            self._admitted_tokens += cost
            return 0
        self._refused += 1
        return retry_after_ms(level, rate, self._retry_after_max_ms)

    def _refill(self, bucket: list[float], rate: float, now: float) -> float:
        burst = rate * self._burst_s
        level = min(burst, bucket[0] + rate * max(0.0, now - bucket[1]))
        bucket[0], bucket[1] = level, max(bucket[1], now)
        return level

    def _bucket(self, identity: str, now: float) -> tuple[list[float], float]:
        bucket = self._buckets.get(identity)
        if bucket is not None:
            return bucket, self.rate(identity)
        if len(self._buckets) >= self._producers_max:
            self._sweep(now)
        if len(self._buckets) < self._producers_max:
            rate = self.rate(identity)
            bucket = self._buckets[identity] = [rate * self._burst_s, now]
            return bucket, rate
        self._overflowed += 1
        if self._overflow is None:
            self._overflow = [self._default_rate * self._burst_s, now]
        return self._overflow, self._default_rate

    def _sweep(self, now: float) -> None:
        """Drop the buckets that have refilled (rule 6); no sweep before one can have."""
        if now < self._next_sweep_at:
            return
        soonest_s = math.inf
        for identity, bucket in list(self._buckets.items()):
            rate = self.rate(identity)
            burst = rate * self._burst_s
            level = bucket[0] + rate * max(0.0, now - bucket[1])
            if level >= burst:
                del self._buckets[identity]
                self._swept += 1
            elif rate > 0.0:
                soonest_s = min(soonest_s, (burst - level) / rate)
        self._next_sweep_at = now + soonest_s if len(self._buckets) >= self._producers_max else now

    def level(self, identity: str, now: float) -> float | None:
        """The bucket's level at ``now`` (None: no bucket), without charging."""
        bucket = self._overflow if identity == OVERFLOW_IDENTITY else self._buckets.get(identity)
        if bucket is None:
            return None
        rate = self.rate(identity)
        return min(rate * self._burst_s, bucket[0] + rate * max(0.0, now - bucket[1]))

    def statistics(self) -> TokenBucketStatistics:
        return TokenBucketStatistics(
            producers=len(self._buckets),
            admitted=self._admitted,
            refused=self._refused,
            admitted_tokens=self._admitted_tokens,
            overflowed=self._overflowed,
            swept=self._swept,
        )
