"""Fan-out, the forwarder's side: send each task to the member that should run it, and keep it
alive if that member dies.  (The owner's side, which admits forwarded tasks, is ``rpc.py``;
which member should run a task is ``placer.py``; the sockets to peers are ``peerlinks.py``.)

    ingress (any daemon) -> placement (ring + bounded loads over gossiped state)
      -> self: run here | peer: Forward over DEALER -> peer's ROUTER -> ForwardReply
      refused or no reply within ack_timeout_s -> next candidate, exponential backoff with
      jitter, all within the task's deadline and attempts_max -> in the end `unavailable`
      (or `overloaded` when everyone said so) listing every attempt.

Ownership: once a peer accepts, it runs the task and answers the producer itself; it sends
us TaskDone when it has.  Until then we remember the task: if membership declares the peer
dead, we dispatch the task again, same id, to the next member (migration).  The producer drops
chunks it already has by their sequence numbers, and the client resolves a task id once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import zmq

from gossipd.config import FanoutConfig
from gossipd.core.acktimes import AckTimes
from gossipd.core.admission import Verdict
from gossipd.core.breaker import Breaker
from gossipd.core.deadlines import DeadlineWheel
from gossipd.core.forwarded import ForwardedLedger
from gossipd.core.membership import MemberEvent
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Cancel,
    ErrorCode,
    Forward,
    ForwardReply,
    Result,
    Task,
    TaskDone,
    Withdraw,
)
from gossipd.gossip import GossipService
from gossipd.ingress import Ingress
from gossipd.peerlinks import PeerLinks
from gossipd.placer import Placer
from gossipd.rpc import OwnerEndpoint

log = logging.getLogger("gossipd.dispatch")

HEDGE_BURST = 10.0  # hedges allowed back to back before fanout.hedge_budget limits them


@dataclass(slots=True)
class DispatchStatistics:
    local: int = 0
    forwarded: int = 0
    accepted_from_peers: int = 0
    refused_to_peers: int = 0
    attempts_failed: int = 0
    unavailable: int = 0
    migrated: int = 0
    handed_off: int = 0
    bad_peer_messages: int = 0
    replies_dropped: int = 0
    prefix_hits: int = 0  # keyless tasks placed on a member that holds their prefix
    hedged: int = 0  # forwards also sent to a second member (the owner was slow to ack)
    hedge_wins: int = 0  # ...where the second member accepted first
    hedges_over_budget: int = 0  # slow acks not hedged: fanout.hedge_budget was spent
    withdrawn: int = 0  # copies we withdrew: a hedge lost, no ack in time, or declared dead
    peer_links_closed: int = 0  # connections to non-members closed after peer_idle_close_s
    withdrawn_by_peers: int = 0  # copies a forwarder withdrew from us before they finished


@dataclass(slots=True)
class _Sent:
    req: int
    breaker: Breaker
    timeout_s: float
    sent_at: float  # time.monotonic()
    task_id: str


@dataclass(slots=True)
class _InFlight:
    """A first forward awaiting its reply without a coroutine (the common case)."""

    task: Task
    owner: str
    received_at: float
    sent: _Sent
    token: int = 0  # the ack deadline's slot in the timer wheel
    hedge_timer: asyncio.TimerHandle | None = None
    group: _Hedge | None = None  # set once a hedged copy went out


@dataclass(slots=True)
class _Hedge:
    """The copies of one hedged task: the first to accept wins, the others are withdrawn."""

    flights: list[_InFlight]
    winner: str = ""


def _expire(future: asyncio.Future[ForwardReply]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class Dispatcher:
    def __init__(
        self,
        config: FanoutConfig,
        *,
        ctx: zmq.Context,
        node: str,
        ingress: Ingress,
        gossip: GossipService,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.node = node
        self._ctx = ctx
        self._ingress = ingress
        self._gossip = gossip
        self._rng = rng
        self.owner: OwnerEndpoint | None = None
        self.stats = DispatchStatistics()
        self._links = PeerLinks(config, ctx=ctx, stats=self.stats, on_reply=self._on_peer_reply)
        self._pending: dict[int, asyncio.Future[ForwardReply] | _InFlight] = {}
        self._req = 0
        self._breakers: dict[str, Breaker] = {}
        # Each member's rpc address when we last forwarded to it: still known once the
        # member is declared dead and gone from the live view (see _member_event).
        self._last_addr: dict[str, str] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._acks: asyncio.Task[None] | None = None
        self._idle_links: asyncio.Task[None] | None = None
        self._ack_wheel = DeadlineWheel(0.01)
        self._ack_times = AckTimes(quantile=config.hedge_quantile)
        self._hedge_credit = HEDGE_BURST  # hedges allowed now; each forward adds hedge_budget
        self.placer = Placer(config, node=node, ingress=ingress, gossip=gossip, stats=self.stats)
        # The placer's load counts, which forwarding keeps up to date.
        self._outstanding = self.placer.outstanding
        # Accepted forwards we answer for until their TaskDone (migration).
        self._ledger = ForwardedLedger(self._outstanding, entries_max=config.forwarded_max)
        self._local_ids = self.placer.local_ids
        self.endpoint = ""

    # -- wiring --------------------------------------------------------------------------------

    def bind(self) -> str:
        self.owner = OwnerEndpoint(
            self.config, ctx=self._ctx, node=self.node, ingress=self._ingress, stats=self.stats
        )
        self.endpoint = self.owner.bind()
        self._ingress.router = self.route
        self._ingress.cancel_elsewhere = self.cancel_forwarded
        self._ingress.on_admitted.append(self.placer.record_prefix)
        self._ingress.on_released.append(lambda task: self._local_ids.discard(task.id))
        self._ingress.on_finished.append(self._task_finished)
        self._ingress.on_finished.append(self.owner.task_finished)
        self.owner.send_to_member = self._send_to_member
        self.owner.on_peer_done = lambda msg: self._ledger.done(msg.id, msg.node)
        self._gossip.listeners.append(self._member_event)
        return self.endpoint

    def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        assert self.owner is not None
        self.owner.start()
        self._acks = tg.create_task(self.expire_acks_forever(), name="rpc-ack-deadlines")
        self._idle_links = tg.create_task(self.close_idle_links_forever(), name="rpc-idle-links")

    def stop(self) -> None:
        """Cancel the background tasks (call before leaving the TaskGroup)."""
        if self.owner is not None:
            self.owner.stop()
        for task in (self._acks, self._idle_links):
            if task is not None:
                task.cancel()
        self._links.stop()

    def close(self) -> None:
        self._links.close()
        if self.owner is not None:
            self.owner.close()

    def route(self, task: Task, now: float) -> bool:
        """Called by the ingress for each new task: False to run it here, True if taken."""
        owner = self.placer.owner_for(task)
        if owner is None:
            self.stats.unavailable += 1
            self._ingress.send_error(
                task, ErrorCode.UNAVAILABLE, f"no live member serves model {task.model!r}"
            )
            return True
        if owner == self.node:
            self.stats.local += 1
            self._local_ids.add(task.id)
            return False
        assert self._tg is not None
        # Count it against the chosen member at once: the tasks of this same batch must see it.
        self._outstanding[owner] = self._outstanding.get(owner, 0) + 1
        sent = self._send_forward(owner, task, now + task.timeout_ms / 1000.0, 1)
        if isinstance(sent, ForwardReply):
            self._tg.create_task(
                self._dispatch(task, now, None, reserved=owner, first=(owner, sent))
            )
            return True
        # The common case needs no coroutine: the reply (or its timeout) is handled by a
        # callback; only a refusal or a timeout starts the retrying coroutine.
        flight = _InFlight(task, owner, now, sent)
        # Ack deadlines go in a timer wheel (two dict operations) rather than a loop timer
        # per task; a sweep every 10 ms expires them (see core/deadlines.py).
        flight.token = self._ack_wheel.add(sent.req, time.monotonic() + sent.timeout_s)
        self._pending[sent.req] = flight
        if self.config.hedge:
            self._arm_hedge(flight)
        return True

    def prefix_summary(self) -> list[int]:
        return self.placer.prefix_summary()

    async def close_idle_links_forever(self) -> None:
        every_s = min(60.0, self.config.peer_idle_close_s / 4)
        while True:
            await asyncio.sleep(every_s)
            members = set(self.placer.view().addrs.values())
            self._links.close_idle(members, time.monotonic())

    async def expire_acks_forever(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            for req in self._ack_wheel.expire(time.monotonic()):
                self._flight_timeout(req)  # type: ignore[arg-type]

    def _flight_reply(self, flight: _InFlight, reply: ForwardReply) -> None:
        self._land(flight)
        self._ack_times.observe(time.monotonic() - flight.sent.sent_at)
        if reply.accepted or reply.code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN):
            flight.sent.breaker.success()
        group = flight.group
        if reply.accepted:
            if group is not None:
                if group.winner:  # a copy that lost accepted after all: take it back
                    self._withdraw(flight)
                    return
                group.winner = flight.owner
                first = group.flights[0]
                if flight is not first:
                    # The owner was outrun: a failure for its breaker, so that a member that
                    # keeps stalling is skipped outright rather than hedged task after task.
                    first.sent.breaker.failure(time.monotonic())
                    self.stats.hedge_wins += 1
                for other in group.flights:
                    if other is not flight:
                        self._withdraw(other)
            self.stats.forwarded += 1
            self._ledger.accepted(flight.task, flight.owner, flight.received_at)
            return
        if group is not None and self._still_racing(group):
            return  # refused, but another copy may yet be accepted
        self._retry(flight, reply)

    def _flight_timeout(self, req: int) -> None:
        flight = self._pending.get(req)
        if not isinstance(flight, _InFlight):
            return
        self._land(flight)
        flight.sent.breaker.failure(time.monotonic())
        self.stats.attempts_failed += 1
        self._send_withdraw(flight.owner, flight.sent.task_id)
        if flight.group is not None and self._still_racing(flight.group):
            return
        self._retry(
            flight, ForwardReply(req=req, node=flight.owner, accepted=False, code="no reply")
        )

    def _land(self, flight: _InFlight) -> None:
        """A flight's wait is over (answered, timed out or withdrawn): stop its timers."""
        del self._pending[flight.sent.req]
        self._ack_wheel.remove(flight.sent.req, flight.token)
        if flight.hedge_timer is not None:
            flight.hedge_timer.cancel()
            flight.hedge_timer = None
        self._outstanding[flight.owner] -= 1

    # -- hedging -------------------------------------------------------------------------------

    def _arm_hedge(self, flight: _InFlight) -> None:
        self._hedge_credit = min(HEDGE_BURST, self._hedge_credit + self.config.hedge_budget)
        waited = self._ack_times.quantile()
        if waited is None:
            return  # no estimate of a normal ack time yet
        delay = max(self.config.hedge_min_s, waited)
        if delay < flight.sent.timeout_s:
            flight.hedge_timer = asyncio.get_running_loop().call_later(delay, self._hedge, flight)

    def _hedge(self, flight: _InFlight) -> None:
        """The owner is slower to ack than usual: send the task to the next member too."""
        flight.hedge_timer = None
        if self._pending.get(flight.sent.req) is not flight:
            return
        if self._hedge_credit < 1.0:
            self.stats.hedges_over_budget += 1
            return
        task = flight.task
        order = self.placer.order(task, exclude=frozenset({flight.owner, self.node}))
        if not order:
            return
        member = order[0]
        deadline = flight.received_at + task.timeout_ms / 1000.0
        sent = self._send_forward(member, task, deadline, task.attempt + 2)
        if isinstance(sent, ForwardReply):
            return
        self._outstanding[member] = self._outstanding.get(member, 0) + 1
        copy = _InFlight(task, member, flight.received_at, sent)
        copy.token = self._ack_wheel.add(sent.req, time.monotonic() + sent.timeout_s)
        self._pending[sent.req] = copy
        flight.group = copy.group = _Hedge([flight, copy])
        self._hedge_credit -= 1.0
        self.stats.hedged += 1

    def _still_racing(self, group: _Hedge) -> bool:
        """Has the hedged task a winner, or a copy still awaiting its answer?"""
        return bool(group.winner) or any(self._pending.get(f.sent.req) is f for f in group.flights)

    def _withdraw(self, flight: _InFlight) -> None:
        """Take back a losing copy: stop waiting for it, and tell its member to drop it."""
        if self._pending.get(flight.sent.req) is flight:
            self._land(flight)
        self._send_withdraw(flight.owner, flight.task.id)

    def _send_withdraw(self, member: str, task_id: str, addr: str | None = None) -> None:
        """Tell ``member`` (at ``addr``, else its live address) to drop its copy of a task
        that another member runs: sent after a hedge lost, after a forward went unanswered
        (a stalled member that resumes reads the Forward and then this, and answers nothing)
        and when the member is declared dead.  A member that never accepted the copy ignores
        it."""
        addr = addr or self.placer.addr(member)
        if addr is not None:
            self._links.send(addr, Withdraw(id=task_id, node=self.node))
            self.stats.withdrawn += 1

    def _send_to_member(self, member: str, msg: TaskDone) -> None:
        addr = self.placer.addr(member) or self._last_addr.get(member)
        if addr is not None:
            self._links.send(addr, msg)

    def _retry(self, flight: _InFlight, reply: ForwardReply) -> None:
        assert self._tg is not None
        self._tg.create_task(
            self._dispatch(flight.task, flight.received_at, None, first=(flight.owner, reply))
        )

    # -- forwarding ----------------------------------------------------------------------------

    async def _dispatch(
        self,
        task: Task,
        received_at: float,
        order: list[str] | None,
        reserved: str | None = None,
        first: tuple[str, _Sent | ForwardReply] | None = None,
    ) -> bool:
        """Try the members in ``order`` (computed here when None); answer the producer with an
        error if none takes it.  ``first``: an attempt already sent to that member.
        Returns True when someone (maybe us) accepted the task."""
        try:
            if first is not None:
                member, sent = first
                reply = (
                    sent
                    if isinstance(sent, ForwardReply)
                    else await self._await_reply(member, sent)
                )
                if reply is not None and reply.accepted:
                    self.stats.forwarded += 1
                    self._ledger.accepted(task, member, received_at)
                    return True
                done = [f"{member}: {'no reply' if reply is None else reply.code}"]
                order = [m for m in self.placer.order(task) if m != member]
                return await self._try_members(task, received_at, order, done)
            return await self._try_members(
                task, received_at, order if order is not None else self.placer.order(task)
            )
        finally:
            if reserved is not None:
                self._outstanding[reserved] -= 1

    async def _try_members(
        self, task: Task, received_at: float, order: list[str], attempts: list[str] | None = None
    ) -> bool:
        cfg = self.config
        deadline = received_at + task.timeout_ms / 1000.0
        attempts = attempts if attempts is not None else []
        overloaded_hint = 0
        for n, member in enumerate(
            order[: max(0, cfg.attempts_max - len(attempts))], start=len(attempts)
        ):
            now = time.monotonic()
            if now >= deadline:
                attempts.append("deadline reached")
                break
            if n:
                backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (n - 1))
                await asyncio.sleep(
                    min(backoff * (0.5 + self._rng.random()), max(0.0, deadline - now))
                )
            if member == self.node:
                verdict = self._ingress.admit(task, received_at, answer=False)
                if verdict in (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE):
                    self.stats.local += 1
                    return True
                attempts.append(f"{member}: {verdict.value}")
                if verdict is Verdict.OVERLOADED:
                    overloaded_hint = max(overloaded_hint, self._ingress.retry_after_ms)
                continue
            reply = await self._call(member, task, received_at, deadline, n + 1)
            if reply is None:
                attempts.append(f"{member}: no reply")
                continue
            if reply.accepted:
                self.stats.forwarded += 1
                self._ledger.accepted(task, member, received_at)
                return True
            attempts.append(f"{member}: {reply.code}")
            if reply.code == ErrorCode.OVERLOADED:
                overloaded_hint = max(overloaded_hint, reply.retry_after_ms)
        self.stats.unavailable += 1
        everyone_busy = attempts and all(
            a.endswith(("overloaded", "shutting_down")) for a in attempts
        )
        code = ErrorCode.OVERLOADED if everyone_busy and overloaded_hint else ErrorCode.UNAVAILABLE
        self._ingress.send_error(
            task,
            code,
            "no member took the task; attempts: " + "; ".join(attempts or ["none"]),
            retry_after_ms=overloaded_hint or self._ingress.retry_after_ms,
        )
        return False

    def _send_forward(
        self, member: str, task: Task, deadline: float, attempt: int
    ) -> _Sent | ForwardReply:
        """Send one Forward now (no await); a ForwardReply when it could not even be sent."""
        breaker = self._breakers.get(member)
        if breaker is None:
            breaker = self._breakers[member] = Breaker(
                failures_max=self.config.breaker_failures, open_s=self.config.breaker_open_s
            )
        now = time.monotonic()
        if not breaker.allow(now):
            return ForwardReply(req=0, node=member, accepted=False, code="circuit_open")
        addr = self.placer.addr(member)
        if addr is None:
            return ForwardReply(req=0, node=member, accepted=False, code="not_a_member")
        self._last_addr[member] = addr
        self._req += 1
        req = self._req
        remaining_ms = max(1, int((deadline - now) * 1000))
        forward = Forward(
            req=req, src=self.node, task=task, remaining_ms=remaining_ms, attempt=attempt
        )
        self._links.send(addr, forward)
        timeout = min(self.config.ack_timeout_s, max(0.0, deadline - now))
        return _Sent(req, breaker, timeout, now, task.id)

    async def _await_reply(self, member: str, sent: _Sent) -> ForwardReply | None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ForwardReply] = loop.create_future()
        self._pending[sent.req] = future
        timer = loop.call_later(sent.timeout_s, _expire, future)
        try:
            reply = await future
        except TimeoutError:
            sent.breaker.failure(time.monotonic())
            self.stats.attempts_failed += 1
            self._send_withdraw(member, sent.task_id)
            return None
        finally:
            timer.cancel()
            self._pending.pop(sent.req, None)
        self._ack_times.observe(time.monotonic() - sent.sent_at)
        if reply.accepted or reply.code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN):
            sent.breaker.success()  # it answered: the peer is healthy, just busy
        return reply

    async def _call(
        self, member: str, task: Task, received_at: float, deadline: float, attempt: int
    ) -> ForwardReply | None:
        sent = self._send_forward(member, task, deadline, attempt)
        if isinstance(sent, ForwardReply):
            return sent
        return await self._await_reply(member, sent)

    def cancel_forwarded(self, task_id: str) -> bool:
        """Pass a producer's Cancel to the member we forwarded the task to (False: none)."""
        entry = self._ledger.get(task_id)
        addr = None if entry is None else self.placer.addr(entry.owner)
        if entry is None or addr is None:
            return False
        self._links.send(addr, Cancel(v=PROTOCOL_VERSION, id=task_id))
        return True

    def _on_peer_reply(self, msg: object) -> None:
        if isinstance(msg, ForwardReply):
            waiter = self._pending.get(msg.req)
            if isinstance(waiter, _InFlight):
                self._flight_reply(waiter, msg)
            elif waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, TaskDone):
            self._ledger.done(msg.id, msg.node)

    def _task_finished(self, task: Task, result: Result) -> None:
        self._local_ids.discard(task.id)

    # -- membership changes and drain ----------------------------------------------------------

    def _member_event(self, event: MemberEvent) -> None:
        if event.kind != "dead":
            return
        self.placer.prefix_index.forget_member(event.node)
        orphans = self._ledger.owned_by(event.node)
        # A member declared dead may only have stalled: withdraw its copies, so that if it
        # comes back it drops them instead of running them beside the migrated ones (a dead
        # one never reads this; one restarted on the address drops them if it re-runs them
        # from its journal).  Its last address: it is gone from the live view.
        addr = self._last_addr.get(event.node)
        for f in orphans:
            self._ledger.forget(f.task.id)
            self.stats.migrated += 1
            if addr is not None:
                self._send_withdraw(event.node, f.task.id, addr)
            order = self.placer.order(f.task, exclude=frozenset({event.node}))
            if self._tg is not None:
                self._tg.create_task(self._dispatch(f.task, f.received_at, order))
        if orphans:
            log.info(
                "migrating tasks off a dead member",
                extra={"member": event.node, "tasks": len(orphans)},
            )

    async def hand_off(self, task: Task, received_at: float) -> bool:
        """At drain: give a queued task to the next member (never to us)."""
        order = [m for m in self.placer.order(task, exclude=frozenset({self.node}))]
        if not order:
            return False
        ok = await self._dispatch_quiet(task, received_at, order)
        if ok:
            self.stats.handed_off += 1
        return ok

    async def _dispatch_quiet(self, task: Task, received_at: float, order: list[str]) -> bool:
        deadline = received_at + task.timeout_ms / 1000.0
        for n, member in enumerate(order[: self.config.attempts_max]):
            reply = await self._call(member, task, received_at, deadline, n + 1)
            if reply is not None and reply.accepted:
                self._ledger.accepted(task, member, received_at)
                return True
        return False

    def outstanding(self) -> dict[str, int]:
        """Per member: tasks we sent it (or are sending) that it has not reported done."""
        return {m: n for m, n in self._outstanding.items() if n}

    def local_unfinished(self) -> int:
        return len(self._local_ids)
