"""Admin requests: an operator's StatusQuery and Drain, taken on the ingress PULL like tasks and
answered at their ``reply_to`` (docs/PROTOCOL.md, "Admin").

    StatusQuery -> StatusReport: this daemon (status, engine, model, load, checksum of its
                   live set) and every member as it sees them (state, gossiped GPU state)
    Drain       -> AdminReply:   for this node, drain (new tasks go to other members, queued
                   ones are handed off, running ones finish; the process keeps running) or
                   undrain (back to serving); for another member, relayed once to that
                   member over the rpc channel (authenticated between members under
                   CURVE), which answers reply_to itself

With CURVE, answers go as a Task's replies do: over a connection to a server that proves it
holds the asking producer's key (the key the ingress read; a relayed Drain carries it).

Handlers run in the ingress socket's fd callback and never wait; the hand-off of queued tasks
runs as a task in the daemon's TaskGroup.  Counted by kind and outcome
(``gossipd_admin_requests_total``); malformed admin messages are refused by the decoder and
counted as ``gossipd_messages_refused_total{reason="bad_admin"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from gossipd.core.admin_messages import AdminReply, LoadReport, StatusReport, encode_admin
from gossipd.core.messages import (
    Drain,
    ErrorCode,
    StatusQuery,
    Task,
    encode,
    error_result,
    reply_route,
)
from gossipd.engines.base import Engine
from gossipd.ingress.service import Ingress
from gossipd.replysender import ReplySender

if TYPE_CHECKING:
    from gossipd.fanout.forwarding import Dispatcher
    from gossipd.membership.gossip import GossipService

log = logging.getLogger("gossipd.admin")

# Admin requests a daemon answers a second at its ingress, and the burst above that (an
# operator's tool asks a few; `gossipd up` asks each daemon once a second).
ADMIN_REQUESTS_PER_S = 50
ADMIN_REQUESTS_BURST = 100


class Admin:
    def __init__(
        self,
        *,
        node: str,
        ingress: Ingress,
        replies: ReplySender,
        engine: Engine,
        version: str,
        engine_dead: Callable[[], bool],
        election: bool = False,
        gossip: GossipService | None = None,
        dispatcher: Dispatcher | None = None,
        relay: Callable[[str, Drain], bool] | None = None,
    ) -> None:
        self.node = node
        self._election = election  # etcd.endpoints set: this daemon campaigns
        self._ingress = ingress
        self._replies = replies
        self._engine = engine
        self._version = version
        self._engine_dead = engine_dead
        self.gossip = gossip  # None without membership (gossip.bind unset)
        self.dispatcher = dispatcher
        # A Drain for another member, to that member (False: not a live member known here).
        self._relay_to = relay
        self.drained = False
        self.on_drain: list[Callable[[bool], None]] = []  # the leader resigns when drained
        self.requests: Counter[str] = Counter()  # "kind:outcome"
        # Admin requests bypass admission: a 1 MiB Tasks frame of StatusQueries asked for
        # 26,900 reports (~1 GB) in one loop turn.  A token bucket bounds them.
        self._tokens = float(ADMIN_REQUESTS_BURST)
        self._tokens_at = float("-inf")
        self._tg: asyncio.TaskGroup | None = None
        # A drain's hand-off of the queued tasks (one offer at a time), and whether the
        # daemon's stop asked it to end (its tasks then back in the queue, for the stop).
        self._hand_off_task: asyncio.Task[None] | None = None
        self._hand_off_stopping = False

    def _allowance(self, now: float) -> bool:
        """One admin request's token, if the bucket has one."""
        elapsed = now - self._tokens_at
        self._tokens = min(ADMIN_REQUESTS_BURST, self._tokens + elapsed * ADMIN_REQUESTS_PER_S)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg

    # -- the handler the ingress calls ------------------------------------------------------

    def handle(self, msg: StatusQuery | Drain, now: float, producer_key: str = "") -> None:
        """A request from a producer at our ingress; ``producer_key``: the key it came with
        under CURVE (the answer goes only to a server holding it)."""
        if not self._allowance(now):
            kind = "status" if isinstance(msg, StatusQuery) else "drain" if msg.drain else "undrain"
            self.requests[f"{kind}:overloaded"] += 1
            wait_ms = max(1, int(1000 / ADMIN_REQUESTS_PER_S))
            why = (f"more than {ADMIN_REQUESTS_PER_S} admin requests a second "
                   f"(burst {ADMIN_REQUESTS_BURST}): ask again later")  # fmt: skip
            refusal = error_result(
                msg.id, ErrorCode.OVERLOADED, why, node=self.node, retry_after_ms=wait_ms
            )
            self._replies.send(reply_route(msg.reply_to, producer_key), encode(refusal))
            return
        if type(msg) is StatusQuery:
            self.requests["status:ok"] += 1
            route = reply_route(msg.reply_to, producer_key)
            self._replies.send(route, encode_admin(self.report(msg.id)))
            return
        assert isinstance(msg, Drain)
        # The daemon's field: what the producer put there is replaced by what the ingress read.
        self.handle_drain(msgspec.structs.replace(msg, producer_key=producer_key))

    def handle_drain(self, msg: Drain) -> None:
        """A Drain from our ingress, or relayed by a member over rpc (its producer_key is
        the one the first member read)."""
        kind = "drain" if msg.drain else "undrain"
        if msg.node != self.node:
            self._relay(msg, kind)
            return
        ok, text = self.set_drained(msg.drain)
        self.requests[f"{kind}:{'ok' if ok else 'refused'}"] += 1
        self._answer(msg, ok, text)

    def _relay(self, msg: Drain, kind: str) -> None:
        """Pass a Drain for another member on to that member, once."""
        relayed = msgspec.structs.replace(msg, relayed=True)
        if not msg.relayed and self._relay_to is not None and self._relay_to(msg.node, relayed):
            self.requests[f"{kind}:relayed"] += 1
            return
        self.requests[f"{kind}:refused"] += 1
        if msg.relayed:
            why = f"a relayed {kind} for {msg.node!r} reached {self.node!r}; not relayed again"
        else:
            live = sorted(m.node for m in self.gossip.live_members()) if self.gossip else []
            why = (
                f"no live member named {msg.node!r} known here; members: "
                f"{', '.join([self.node, *live])}"
            )
        self._answer(msg, False, why)

    def _answer(self, msg: Drain, ok: bool, text: str) -> None:
        reply = AdminReply(id=msg.id, node=self.node, ok=ok, status=self.status(), message=text)
        route = reply_route(msg.reply_to, msg.producer_key)
        self._replies.send(route, encode_admin(reply))

    # -- drain --------------------------------------------------------------------------------

    def set_drained(self, drain: bool) -> tuple[bool, str]:
        """Drain (``True``) or undrain this daemon; returns (done, what happened)."""
        if self.gossip is None or self.dispatcher is None:
            return (
                False,
                "draining needs membership (gossip.bind): a lone daemon has no member to send tasks to",
            )
        if self._ingress.intake.admission.shutting_down:
            return False, "this daemon is shutting down"
        if drain == self.drained:
            return True, f"already {'draining' if drain else 'serving'}"
        self.drained = drain
        self.dispatcher.set_draining(drain)
        for on_drain in self.on_drain:
            on_drain(drain)
        if drain:
            self.gossip.set_status("draining")
            queued = self._ingress.runner.take_queued()
            if queued:
                assert self._tg is not None, "start() first"
                self._hand_off_task = self._tg.create_task(
                    self._hand_off(queued), name="drain-hand-off"
                )
            log.info("drained by request", extra={"queued": len(queued)})
            return True, (
                f"draining: new tasks go to other members; {len(queued)} queued offered to them"
                " (those no member takes run here)"
            )
        if not self._engine_dead():
            self.gossip.set_status("serving")
        log.info("undrained by request")
        return True, "serving again"

    async def _hand_off(self, queued: list[tuple[Task, float]]) -> None:
        assert self.dispatcher is not None
        for i, (task, received_at) in enumerate(queued):
            if self._hand_off_stopping:  # the daemon stops: its stop offers the rest
                self._requeue(queued[i:])
                return
            # Stopped while earlier ones were offered: answered (or dropped) here, not run
            # elsewhere.
            if self._ingress.runner.settle_stopped(task):
                continue
            try:
                took = await self.dispatcher.hand_off(task, received_at)
            except asyncio.CancelledError:
                # (this one's offer included: if a member takes it after all, its answer
                # is a second one: docs/PROTOCOL.md, "Duplicate final Results")
                self._requeue(queued[i:])
                raise
            if took:
                self._ingress.runner.release(
                    task, error_result(task.id, ErrorCode.SHUTTING_DOWN, "handed off")
                )
            else:  # no member took it: it runs here after all
                self._ingress.runner.requeue(task)

    def _requeue(self, rest: list[tuple[Task, float]]) -> None:
        for task, _ in rest:
            self._ingress.runner.requeue(task)

    async def stop_hand_off(self, timeout_s: float) -> None:
        """The daemon stops: a drain's hand-off still under way ends after the offer in hand
        (cancelled after ``timeout_s``), its tasks back in the run queue, where the stop takes
        them (offered within its grace, else answered shutting_down).  Left running, it
        held them past the grace unanswered, and the stop waited for it for ever (its
        offer's answer never came once the dispatcher stopped)."""
        task = self._hand_off_task
        if task is None or task.done():
            return
        self._hand_off_stopping = True
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- status -------------------------------------------------------------------------------

    def status(self) -> str:
        if self._ingress.intake.admission.shutting_down:
            return "shutting_down"
        if self._engine_dead():
            return "unhealthy"
        return "draining" if self.drained else "serving"

    def report(self, query_id: str) -> StatusReport:
        ing = self._ingress
        served, failed = ing.runner.served()
        stats = ing.statistics()
        load = LoadReport(
            pending=ing.intake.admission.pending,
            queued=stats.queued,
            running=stats.running,
            received=stats.received,
            served=served,
            failed=failed,
        )
        gossip = self.gossip
        core = gossip.core if gossip is not None else None
        term = core.fence.term if core is not None else None
        return StatusReport(
            id=query_id,
            node=self.node,
            software_version=self._version,
            engine=self._engine.name,
            model=(ing.intake.model or getattr(self._engine, "model", "") or "")[:128],
            status=self.status(),  # type: ignore[arg-type]
            drained=self.drained,
            gossip=core is not None,
            incarnation=core.table.incarnation if core is not None else 0,
            checksum=core.table.checksum() if core is not None else 0,
            gpu=gossip.last_gpu_state if gossip is not None else None,
            load=load,
            members=[m.record() for m in core.table.members.values()] if core is not None else [],
            leader=term.leader if term is not None else None,
            term=term.token if term is not None else None,
            election=self._election,
        )

    def statistics(self) -> dict[str, int]:
        return dict(self.requests)
