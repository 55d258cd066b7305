"""Rolling drain, the leader's side and every member's (core/rollout.py has the rules).

The duty (while we lead): every ``ROLLOUT_TICK_S`` read the plan and its progress from etcd
(``<prefix>/drain/plan``, ``<prefix>/drain/progress``, JSON), ask ``rollout.advance`` what
the membership view means for them, store the new progress with a fenced put (a deposed
leader's write fails, and it stops), and gossip the order as a fenced ``drain`` directive:
at once when it changes, again every ``REPUBLISH_S`` while it stands.

The member side: a ``drain`` directive naming this daemon, issued after it started, is
obeyed: "drain" through the operator's drain path (gossipd/admin.py ``set_drained``), "leave" by
the graceful shutdown of SIGTERM (exit 0), "restart" by the same shutdown with exit status
``EXIT_RESTART`` so that systemd (Restart=on-failure) starts it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.core import rollout
from gossipd.core.rollout import Order, Plan, Progress, Seen

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
    ) -> None:
        self.node = node
        self._gossip = gossip
        self._admin = admin
        self._stop = stop  # graceful shutdown with this exit status
        self._started_wall_s = started_wall_s
        self._wall = wall
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
        published_at = 0.0
        while True:
            plan, progress = await read_plan(ctx.client, ctx.prefix)
            active = plan is not None and not (
                progress is not None and progress.plan == plan.id and progress.status != "running"
            )
            if active:
                assert plan is not None
                now_s = self._wall()
                new, order = rollout.advance(plan, progress, self.live(), self.node, now_s)
                if new != progress:
                    if not await ctx.fenced_put(progress_key(ctx.prefix), msgspec.json.encode(new)):
                        log.warning("drain progress not stored: no longer the leader")
                        return
                    if progress is None or (new.index, new.phase, new.status) != (
                        progress.index,
                        progress.phase,
                        progress.status,
                    ):
                        log.info(
                            "drain step", extra={"plan": plan.id, "state": rollout.describe(new)}
                        )
                if order is not None:
                    key = (order.plan, order.node, order.action)
                    if key != last or now_s - published_at >= REPUBLISH_S:
                        ctx.publish(DRAIN, msgspec.to_builtins(order))
                        last, published_at = key, now_s
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


async def read_plan(client: Any, prefix: str) -> tuple[Plan | None, Progress | None]:
    """The stored plan and progress (None where absent or unreadable: logged)."""
    got = await client.get(plan_key(prefix))
    if got is None:
        return None, None
    try:
        plan = rollout.plan_decoder.decode(got.value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("drain plan in etcd unreadable; ignored", extra={"error": str(exc)})
        return None, None
    got = await client.get(progress_key(prefix))
    progress = None
    if got is not None:
        try:
            progress = rollout.progress_decoder.decode(got.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("drain progress unreadable; starting over", extra={"error": str(exc)})
    return plan, progress
