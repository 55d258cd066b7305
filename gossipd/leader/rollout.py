"""Rolling drain, the leader's side and every member's (core/rollout.py has the rules).

The duty (while we lead): every ``ROLLOUT_TICK_S`` read the plan and its progress from etcd
(``<prefix>/drain/plan``, ``<prefix>/drain/progress``, JSON; one transaction, so both at one
revision), ask ``rollout.advance`` what the membership view means for them, store the new
progress with a fenced put (a deposed leader's write fails, and it stops), and gossip the
order as a fenced ``drain`` directive: at once when it changes, again every ``REPUBLISH_S``
while it stands.  The put, or before an order with no new progress a check, is one
transaction that also requires both keys still as read (their mod_revisions): a plan
cancelled (``gossipd cluster drain --cancel``) or replaced since the read gets no progress
and no order; the duty reads again.  (Read in two gets and written on the leader's fence
only, a cancel landing between them made the leader start the dropped plan over.)

The member side: a ``drain`` directive naming this daemon, issued after it started, is
obeyed: "drain" through the operator's drain path (gossipd/admin.py ``set_drained``), "leave" by
the graceful shutdown of SIGTERM (exit 0), "restart" by the same shutdown with exit status
``EXIT_RESTART`` so that systemd (Restart=on-failure) starts it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from aetcd import rpc

from gossipd.clock import SYSTEM_CLOCK
from gossipd.core import rollout
from gossipd.core.rollout import Order, Plan, Progress, Seen
from gossipd.leader.duties import Fenced

if TYPE_CHECKING:
    from gossipd.admin import Admin
    from gossipd.membership.gossip import GossipService

log = logging.getLogger("gossipd.leader.rollout")

DRAIN = "drain"  # the directive's kind
PLAN_KEY = "drain/plan"
PROGRESS_KEY = "drain/progress"
ROLLOUT_TICK_S = 0.25  # while a plan is in etcd
IDLE_TICK_S = 1.0  # while none runs: a new plan starts within this
REPUBLISH_S = 2.0
# A daemon told to restart exits with this status (non-zero: systemd's Restart=on-failure
# starts it again; EX_TEMPFAIL).
EXIT_RESTART = 75


def plan_key(prefix: str) -> bytes:
    return f"{prefix}/{PLAN_KEY}".encode()


def progress_key(prefix: str) -> bytes:
    return f"{prefix}/{PROGRESS_KEY}".encode()


class Rollout:
    def __init__(
        self,
        *,
        node: str,
        gossip: GossipService,
        admin: Admin,
        stop: Callable[[int], None],
        started_wall_s: float,
        wall: Callable[[], float],
        monotonic: Callable[[], float] = SYSTEM_CLOCK.monotonic,
    ) -> None:
        self.node = node
        self._gossip = gossip
        self._admin = admin
        self._stop = stop  # graceful shutdown with this exit status
        self._started_wall_s = started_wall_s
        self._wall = wall
        self._monotonic = monotonic  # (the re-sends' timing: a wall clock may step)
        self.orders: dict[str, int] = {}  # "action:outcome" on this member
        self._leaving = False

    # -- the leader's duty --------------------------------------------------------------------

    def live(self) -> dict[str, Seen]:
        """Our live members (ourselves included) as the plan's core wants them."""
        out: dict[str, Seen] = {}
        core = self._gossip.core
        if core is None:
            return out
        out[self.node] = Seen(
            node=self.node,
            incarnation=core.table.incarnation,
            status=self._admin.status(),
            inflight=self._gossip.load(),
        )
        for m in self._gossip.live_members():
            out[m.node] = Seen(
                node=m.node,
                incarnation=m.incarnation,
                status=m.gpu.status if m.gpu is not None else "",
                inflight=m.gpu.inflight if m.gpu is not None else 0,
            )
        return out

    async def duty(self, ctx: Any) -> None:
        last: tuple[str, str, str] | None = None
        # When the order was last sent, by the monotonic clock: a wall clock stepped back
        # held the re-sends off for as long (the plan's own times stay wall-clock: rule 5).
        published_at = -REPUBLISH_S
        while True:
            stored = await read_stored(ctx.client, ctx.prefix)
            plan, progress = stored.plan, stored.progress
            active = plan is not None and not (
                progress is not None and progress.plan == plan.id and progress.status != "running"
            )
            if active:
                assert plan is not None
                now_s = self._wall()
                new, order = rollout.advance(plan, progress, self.live(), self.node, now_s)
                due = order is not None and (
                    (order.plan, order.node, order.action) != last
                    or self._monotonic() - published_at >= REPUBLISH_S
                )
                # The plan and progress must still be as read when we act on them.
                unchanged = {
                    plan_key(ctx.prefix): stored.plan_revision,
                    progress_key(ctx.prefix): stored.progress_revision,
                }
                outcome = Fenced.OK
                if new != progress:
                    encoded = msgspec.json.encode(new)
                    outcome = await ctx.fenced_put_if(progress_key(ctx.prefix), encoded, unchanged)
                elif due:
                    outcome = await ctx.fenced_check(unchanged)
                if outcome is Fenced.DEPOSED:
                    log.warning("drain: no longer the leader (a fenced write or check refused)")
                    return
                if outcome is Fenced.CHANGED:
                    log.info("drain plan changed since read (cancelled or replaced): read again",
                             extra={"plan": plan.id})  # fmt: skip
                    await asyncio.sleep(ROLLOUT_TICK_S)
                    continue
                if new != progress and (
                    progress is None
                    or (new.index, new.phase, new.status)
                    != (progress.index, progress.phase, progress.status)
                ):
                    log.info("drain step", extra={"plan": plan.id, "state": rollout.describe(new)})
                if order is not None and due:
                    ctx.publish(DRAIN, msgspec.to_builtins(order))
                    last, published_at = (order.plan, order.node, order.action), self._monotonic()
            await asyncio.sleep(ROLLOUT_TICK_S if active else IDLE_TICK_S)

    # -- every member ---------------------------------------------------------------------------

    def on_order(self, directive: Any, body: object) -> None:
        try:
            order = msgspec.convert(body, Order)
        except msgspec.ValidationError as exc:
            self._count("bad", "refused")
            log.warning("drain directive refused: bad body", extra={"error": str(exc)})
            return
        if order.node != self.node:
            return
        if order.issued_wall_s < self._started_wall_s:
            self._count(order.action, "before_start")  # our previous life's order
            return
        if order.action == "drain":
            ok, text = self._admin.set_drained(True)
            self._count("drain", "ok" if ok else "refused")
            if ok and text.startswith("draining"):
                log.info("drained by the leader", extra={"plan": order.plan})
            return
        if self._leaving:
            return
        if not self._admin.drained:
            self._count(order.action, "not_drained")  # e.g. undrained by hand meanwhile
            return
        self._leaving = True
        self._count(order.action, "ok")
        log.info(f"{order.action} ordered by the leader", extra={"plan": order.plan})
        self._stop(EXIT_RESTART if order.action == "restart" else 0)

    def _count(self, action: str, outcome: str) -> None:
        key = f"{action}:{outcome}"
        self.orders[key] = self.orders.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class Stored:
    """The plan and its progress as read at one revision, with their keys' mod_revisions
    (0: absent) for the duty's compare-and-swap."""

    plan: Plan | None
    progress: Progress | None
    plan_revision: int
    progress_revision: int


async def read_stored(client: Any, prefix: str) -> Stored:
    """The stored plan and progress, read in one transaction (both at one revision: a cancel
    cannot fall between them); None where absent or unreadable (logged)."""
    await client.connect()
    reply = await client.kvstub.Txn(
        rpc.TxnRequest(
            compare=[],
            success=[
                rpc.RequestOp(request_range=rpc.RangeRequest(key=plan_key(prefix))),
                rpc.RequestOp(request_range=rpc.RangeRequest(key=progress_key(prefix))),
            ],
            failure=[],
        ),
        timeout=client.request_timeout_s,
    )
    plan_kvs = reply.responses[0].response_range.kvs
    progress_kvs = reply.responses[1].response_range.kvs
    plan_revision = plan_kvs[0].mod_revision if plan_kvs else 0
    progress_revision = progress_kvs[0].mod_revision if progress_kvs else 0
    plan = progress = None
    if plan_kvs:
        try:
            plan = rollout.plan_decoder.decode(plan_kvs[0].value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("drain plan in etcd unreadable; ignored", extra={"error": str(exc)})
    if plan is not None and progress_kvs:
        try:
            progress = rollout.progress_decoder.decode(progress_kvs[0].value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("drain progress unreadable; starting over", extra={"error": str(exc)})
    return Stored(plan, progress, plan_revision, progress_revision)


async def read_plan(client: Any, prefix: str) -> tuple[Plan | None, Progress | None]:
    """The stored plan and progress (None where absent or unreadable: logged)."""
    stored = await read_stored(client, prefix)
    return stored.plan, stored.progress
