"""The token-budget gate at the ingress: charge each producer's task against its share of its
budget before the task is routed (gossipd/core/tokenbudgets.py holds the rules).

Where the budgets come from (``source``):
- ``leader``: the leader's ``budgets`` directive (with etcd); applied as it arrives, and kept
  while no newer one comes (etcd down: the last known budgets stay in force);
- ``local``: computed here from the ``budgets`` section of the configuration and this
  daemon's own view of the members' capacity, every ``budgets.interval_s`` (no etcd, or with
  etcd until the first directive arrives);
- the gate is not built at all when ``budgets.enabled`` is false.

The leader's duty (``publish_budgets``) computes the same table from its view and publishes
it as a ``budgets`` directive when it changes, and every ``REPUBLISH_INTERVALS`` intervals
anyway (a member that joined since learns it).

Not thread-safe; called from the loop only (the ingress's fd callback and the timers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.config import BudgetsConfig
from gossipd.core.gossip_messages import DIRECTIVE_BODY_BYTES_MAX, GpuState
from gossipd.core.messages import Task
from gossipd.core.tokenbudgets import (
    Budgets,
    TokenBuckets,
    TokenBucketStatistics,
    compute_budgets,
    decode_budgets,
    local_share,
    producer_identity,
    task_cost_tokens,
)

if TYPE_CHECKING:
    from gossipd.membership.gossip import GossipService

log = logging.getLogger("gossipd.ingress.budgets")

DIRECTIVE_KIND = "budgets"
# The leader publishes unchanged budgets again after this many budgets.interval_s.
REPUBLISH_INTERVALS = 10


def serving_capacity(gpus: Iterable[GpuState | None]) -> list[float]:
    """The capacity weights that budgets are computed from: live members' that serve."""
    return [
        gpu.capacity_weight or 1.0  # (0: a member that does not say, as placement reads it)
        for gpu in gpus
        if gpu is not None and gpu.status == "serving"
    ]


def entries_capacity(gpus: Iterable[GpuState | None]) -> float:
    """Rule 3's W: the capacity weights of every live member, serving or not (a drained or
    unhealthy member is still an entry point: it takes producers' tasks and routes them on,
    so it enforces its part too); one whose GpuState has not come yet counts 1, as
    placement reads it."""
    return sum((gpu.capacity_weight or 1.0) if gpu is not None else 1.0 for gpu in gpus)


@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    source: str  # "local" or "leader"
    share: float  # the part of every budget this entry point enforces
    cluster_tokens_per_s: float
    buckets: TokenBucketStatistics
    directives_applied: int  # budgets directives from the leader applied here
    directives_invalid: int  # ... whose body was not a budgets table (ignored)


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
        self.directives_applied = 0
        self.directives_invalid = 0
        # Every live entry point's capacity, as this daemon sees the members (rule 3's W;
        # start_budgets sets it when there is membership): None, the budgets' own total.
        self.entries: Callable[[], float] | None = None
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
        entries = self.entries() if self.entries is not None else 0.0
        share = local_share(budgets, self._capacity_weight, entries)
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

    def check(self, task: Task, now: float, identity: str | None = None) -> int:
        """Charge ``task`` (to ``identity``, else its producer's by tokenbudgets' rule 1): 0
        when admitted, else its retry-after hint in ms."""
        c = self._config
        identity = self._identity(task, identity)
        cost = task_cost_tokens(_chars(task), task.params.max_tokens, c.chars_per_token)
        cost += _ids(task)
        return self.buckets.charge(identity, cost, now)

    def check_together(self, tasks: list[Task], now: float, identity: str | None = None) -> int:
        """``check`` for the tasks of one request (one producer, one key) as one task of
        their summed cost: 0 when admitted (every one charged), else the retry-after hint."""
        return self.buckets.charge(self._identity(tasks[0], identity), self._cost(tasks), now)

    def _cost(self, tasks: list[Task]) -> int:
        per_token = self._config.chars_per_token
        return sum(
            task_cost_tokens(_chars(t), t.params.max_tokens, per_token) + _ids(t) for t in tasks
        )

    def _identity(self, task: Task, identity: str | None) -> str:
        """Whose budget: ``identity`` as the door says; "" (a door whose clients carry no
        identity): as a task without CURVE, by its key; None: tokenbudgets' rule 1."""
        if identity:
            return identity
        producer_key = task.producer_key if identity is None else ""
        return producer_identity(producer_key, task.key, self._config.key_separator)

    def refusal(
        self, task: Task, identity: str | None = None, *, together: list[Task] | None = None
    ) -> str:
        """What an over_budget answer says (``together``: the tasks of one request)."""
        c = self._config
        identity = self._identity(task, identity)
        rate = self.buckets.rate(identity)
        what = f"these {len(together)} tasks of one request cost" if together else "this task costs"
        return (
            f"producer {identity!r} is over its token budget here ({rate:.1f} tokens/s at this "
            f"daemon, {self.share:.3f} of its cluster budget, burst {c.burst_s:g} s); {what} "
            f"{self._cost(together or [task])} tokens: resend it after retry_after_ms"
        )

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            source=self.source,
            share=self.share,
            cluster_tokens_per_s=self.budgets.cluster_tokens_per_s if self.budgets else 0.0,
            buckets=self.buckets.statistics(),
            directives_applied=self.directives_applied,
            directives_invalid=self.directives_invalid,
        )

    def on_directive(self, directive: Any, body: object) -> None:
        """A ``budgets`` directive the fence admitted (the newest of the highest term)."""
        try:
            budgets = decode_budgets(body)
        except ValueError as exc:
            self.directives_invalid += 1
            log.warning(
                "ignored a budgets directive", extra={"leader": directive.leader, "error": str(exc)}
            )
            return
        self.directives_applied += 1
        self.apply(budgets, source="leader")


async def recompute_forever(
    gate: BudgetGate,
    members: Callable[[], Iterable[GpuState | None]],
    interval_s: float,
    *,
    local: Callable[[], bool],
) -> None:
    """Without a leader's budgets (``local()`` true): recompute them here from this daemon's
    view of the members every ``interval_s``; with them, this entry point's share of them
    again (the live members change)."""
    while True:
        if local():
            gate.apply(gate.compute(serving_capacity(members())), source="local")
        elif gate.budgets is not None:
            gate.apply(gate.budgets, source=gate.source)
        await asyncio.sleep(interval_s)


async def publish_budgets(
    ctx: Any,
    gate: BudgetGate,
    members: Callable[[], Iterable[GpuState | None]],
    interval_s: float,
) -> None:
    """The leader's duty (``LeaderDuties``): the budgets of the members' capacity, published
    as a ``budgets`` directive when they change and every REPUBLISH_INTERVALS intervals."""
    last: Budgets | None = None
    quiet = 0
    while True:
        budgets = gate.compute(serving_capacity(members()))
        if budgets != last or quiet >= REPUBLISH_INTERVALS:
            body = msgspec.to_builtins(budgets)
            size = len(msgspec.msgpack.encode(body))
            if size > DIRECTIVE_BODY_BYTES_MAX:  # config validation should make this impossible
                log.error("budgets table too large for a directive", extra={"bytes": size})
            elif ctx.publish(DIRECTIVE_KIND, body):
                log.info(
                    "published token budgets",
                    extra={
                        "token": ctx.token,
                        "capacity_total": budgets.capacity_total,
                        "cluster_tokens_per_s": budgets.cluster_tokens_per_s,
                    },
                )
                last, quiet = budgets, 0
        else:
            quiet += 1
        await asyncio.sleep(interval_s)


def start_budgets(
    tg: asyncio.TaskGroup,
    gate: BudgetGate | None,
    config: BudgetsConfig,
    *,
    node: str,
    capacity_weight: float,
    gossip: GossipService | None,
    leadership: Any,
) -> list[asyncio.Task[None]]:
    """Say once how token budgets are set, and start what keeps them current: the leader's
    duty and subscription with etcd (``leadership``, gossipd.leader.Leadership), a local
    recomputation until the leader's first budgets arrive (or always, without etcd);
    ``gate`` None: budgets are off."""
    if gate is None:
        log.info("token budgets: off (budgets.enabled = false)")
        return []
    if leadership is None:
        log.info(
            "token budgets: computed here from the configuration and the gossiped "
            "capacity every budgets.interval_s (no etcd: no leader)",
            extra={"interval_s": config.interval_s},
        )
    else:
        log.info(
            "token budgets: set by the leader (etcd) and gossiped; until its first "
            "budgets arrive, computed here; while etcd is away, the last ones stay",
            extra={"interval_s": config.interval_s},
        )
    if gossip is None:
        return []  # alone: the budgets of our own capacity, set at construction

    def members() -> list[GpuState | None]:
        # Ourselves always (our own Meta may not be back from gossip yet: our status as we
        # gossip it, a drained daemon's capacity is no budget's), then the others.
        return [
            GpuState(capacity_weight=capacity_weight, status=gossip.status),  # type: ignore[arg-type]
            *(m.gpu for m in gossip.live_members() if m.node != node),
        ]

    gate.entries = lambda: entries_capacity(members())

    if leadership is not None:
        leadership.directives.subscribe(DIRECTIVE_KIND, gate.on_directive)
        leadership.duties.register(
            DIRECTIVE_KIND, lambda ctx: publish_budgets(ctx, gate, members, config.interval_s)
        )
    return [
        tg.create_task(
            recompute_forever(
                gate, members, config.interval_s, local=lambda: gate.source == "local"
            ),
            name="budgets",
        )
    ]


def _ids(task: Task) -> int:
    """A prompt given as token ids: that many tokens (its text prompt is then "")."""
    ids = task.params.prompt_token_ids
    return 0 if ids is None else len(ids)


def _chars(task: Task) -> int:
    """The characters a task is charged for: its prompt's, and a structured output's form's
    (the engine compiles it: the largest grammar the wire takes costs it about 2 s of CPU,
    bench/README "Structured output's compile"; charged as prompt, a client's budget bounds
    how much of that it may ask)."""
    form = task.params.structured
    if form is None:
        return len(task.prompt)
    return len(task.prompt) + sum(map(len, form.texts()))
