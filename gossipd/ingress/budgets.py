"""The token-budget gate at the ingress: charge each producer's task against its share of its
budget before the task is routed (gossipd/core/tokenbudgets.py holds the rules).

Where the budgets come from (``source``):
- ``leader``: the leader's ``budgets`` directive (with etcd); applied as it arrives, and kept
  while no newer one comes (etcd down: the last known budgets stay in force);
- ``local``: computed here from this section of the configuration and this daemon's own
  view of the members' capacity, every ``budgets.interval_s`` (no etcd, or with etcd until
  the first directive arrives);
- the gate is not built at all when ``budgets.enabled`` is false.

Not thread-safe; called from the loop only (the ingress's fd callback and the timers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gossipd.config import BudgetsConfig
from gossipd.core.messages import GpuState, Task
from gossipd.core.tokenbudgets import (
    Budgets,
    TokenBuckets,
    TokenBucketStatistics,
    compute_budgets,
    local_share,
    producer_identity,
    task_cost_tokens,
)

log = logging.getLogger("gossipd.ingress.budgets")


def serving_capacity(gpus: Iterable[GpuState | None]) -> list[float]:
    """The capacity weights that budgets are computed from: live members' that serve."""
    return [gpu.capacity_weight for gpu in gpus if gpu is not None and gpu.status == "serving"]


@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    source: str  # "local" or "leader"
    share: float  # the part of every budget this entry point enforces
    cluster_tokens_per_s: float
    buckets: TokenBucketStatistics


class BudgetGate:
    def __init__(
        self, config: BudgetsConfig, *, capacity_weight: float, retry_after_max_ms: int
    ) -> None:
        self._config = config
        self._capacity_weight = capacity_weight
        self.buckets = TokenBuckets(
            producers_max=config.producers_max, retry_after_max_ms=retry_after_max_ms
        )
        self.source = "local"
        self.budgets: Budgets | None = None
        self.share = 1.0
        # Until the first budgets are applied, this daemon alone: its own capacity.
        self.apply(self.compute([capacity_weight]), source="local")

    def compute(self, capacity_weights: Iterable[float]) -> Budgets:
        """The budgets this configuration gives for these members' capacity (the leader's
        duty, and each daemon's own without a leader)."""
        c = self._config
        return compute_budgets(
            capacity_weights,
            tokens_per_s_per_capacity=c.tokens_per_s_per_capacity,
            default_share=c.default_share,
            shares=c.shares,
            tokens_per_s=c.tokens_per_s,
            burst_s=c.burst_s,
        )

    def apply(self, budgets: Budgets, *, source: str) -> None:
        """Enforce ``budgets`` from now on, scaled to this entry point's share."""
        share = local_share(budgets, self._capacity_weight)
        changed = budgets != self.budgets or source != self.source
        self.budgets, self.source, self.share = budgets, source, share
        self.buckets.set_rates(
            {identity: rate * share for identity, rate in budgets.producers.items()},
            budgets.default_tokens_per_s * share,
            budgets.burst_s,
        )
        if changed:
            log.info(
                "token budgets applied",
                extra={
                    "source": source,
                    "share": round(share, 4),
                    "cluster_tokens_per_s": budgets.cluster_tokens_per_s,
                    "default_tokens_per_s": budgets.default_tokens_per_s,
                    "producers": len(budgets.producers),
                },
            )

    def check(self, task: Task, now: float) -> int:
        """Charge ``task``: 0 when admitted, else its retry-after hint in ms."""
        c = self._config
        identity = producer_identity(task.producer_key, task.key, c.key_separator)
        cost = task_cost_tokens(len(task.prompt), task.params.max_tokens, c.chars_per_token)
        return self.buckets.charge(identity, cost, now)

    def refusal(self, task: Task) -> str:
        """What an over_budget answer says."""
        c = self._config
        identity = producer_identity(task.producer_key, task.key, c.key_separator)
        rate = self.buckets.rate(identity)
        return (
            f"producer {identity!r} is over its token budget here ({rate:.1f} tokens/s at this "
            f"daemon, {self.share:.3f} of its cluster budget, burst {c.burst_s:g} s); this task "
            f"costs {task_cost_tokens(len(task.prompt), task.params.max_tokens, c.chars_per_token)}"
            " tokens: resend it after retry_after_ms"
        )

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            source=self.source,
            share=self.share,
            cluster_tokens_per_s=self.budgets.cluster_tokens_per_s if self.budgets else 0.0,
            buckets=self.buckets.statistics(),
        )


async def recompute_forever(
    gate: BudgetGate,
    members: Callable[[], Iterable[GpuState | None]],
    interval_s: float,
    *,
    local: Callable[[], bool],
) -> None:
    """Without a leader's budgets (``local()`` true): recompute them here from this daemon's
    view of the members every ``interval_s``."""
    import asyncio

    while True:
        if local():
            gate.apply(gate.compute(serving_capacity(members())), source="local")
        await asyncio.sleep(interval_s)
