"""Fan-out, the forwarder's side: the asyncio driver of ``core/forwarder.py``.

The decisions (who gets a task, acks, retries, breakers, hedging, withdrawal, migration,
hand-off) are the core's; this module feeds it inputs with the time and sends what it
returns:
    ingress task -> Forwarder.route -> outbox -> PeerLinks (DEALER -> peer's ROUTER)
    peer ForwardReply / TaskDone -> Forwarder.on_reply       (PeerLinks' fd callback)
    membership "dead" -> Forwarder.member_dead                (gossip listener)
    one loop timer at Forwarder.next_deadline() -> Forwarder.tick
    events: Refuse -> the producer gets the error; HandedOff -> the awaiting hand_off();
            RunHere -> our intake's admit, its verdict back (Forwarder.local_verdict)
The owner's side (admitting forwarded tasks) is ``fanout/owner.py``; which member should run
a task is ``core/placer.py`` (fed by ``fanout/placement_feed.py``); the sockets to peers are ``fanout/peerlinks.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import FanoutConfig
from gossipd.core.admission import Verdict
from gossipd.core.forwarder import Forwarder
from gossipd.core.journeys import ForwarderSettings, HandedOff, Refuse, Route, RunHere
from gossipd.core.lifecycle import Owned, Stop
from gossipd.core.membership import MemberEvent
from gossipd.core.messages import PROTOCOL_VERSION, Cancel, Drain, Task
from gossipd.core.peer_messages import (
    MOVED_FROM_VERSION,
    Confirm,
    ConfirmReply,
    Forward,
    ForwardReply,
    ModelCard,
    ModelQuery,
    Moved,
    Relay,
    ReplayKnown,
    ReplayQuery,
    TaskDone,
)
from gossipd.core.placer import Placer
from gossipd.core.releases import release_at_least
from gossipd.fanout.owner import OwnerEndpoint
from gossipd.fanout.peerlinks import PeerLinks
from gossipd.ops.logs import note_handler_failure

log = logging.getLogger("gossipd.fanout.forwarding")

# Enum members read per task as globals (Python 3.11: ~80 ns through the class, see
# core/admission.py).
_LOCAL = Route.LOCAL
# Replies in which a member speaks of its own tasks: taken only from the member at the
# address they came from (docs/PROTOCOL.md, "A member cannot speak for another").
_SPOKEN_FOR = frozenset((ForwardReply, TaskDone, ConfirmReply))
# What an owner says back on our connection to it (and a TaskDone by name on our server):
# another kind there, or another version, is refused and counted, as the owner side does.
_OWNERS_SAY = frozenset(
    (Relay, ForwardReply, TaskDone, ConfirmReply, ModelCard, Moved, ReplayKnown)
)


@dataclass(frozen=True, slots=True)
class FanoutStatistics:
    """The fan-out parts' counters in one view (metrics read this)."""

    local: int
    forwarded: int
    accepted_from_peers: int
    refused_to_peers: int
    attempts_failed: int
    unavailable: int
    migrated: int
    expired_not_migrated: int
    cancelled_not_migrated: int
    handed_off: int
    bad_peer_messages: int
    replies_dropped: int
    prefix_hits: int
    hedged: int
    hedge_wins: int
    resends_absorbed: int
    hedges_over_budget: int
    withdrawn: int
    peer_links_closed: int
    peer_protocol_errors: int  # peer connections closed for breaking ZMTP (loop channel)
    peer_connections_busy: int  # closed for the rpc server's bounds (loop channel)
    withdrawn_by_peers: int
    forwarded_bytes: int = 0  # tasks remembered for migration (budgets.task_bytes)
    forwarded_evicted_count: int = 0  # ...forgotten for room: fanout.forwarded_max
    forwarded_evicted_bytes: int = 0  # ...fanout.forwarded_bytes_max
    forwarded_expired: int = 0  # ...past their deadline and the window after it (no TaskDone)
    invalid_from_peers: int = 0  # Forwards refused as ingress would refuse their task
    refused_saturated: int = 0  # Forwards with if_free refused: our engine was saturated
    refused_stale: int = 0  # Forwards from an earlier process of their sender (Forward.boot)
    replies_relayed: int = 0  # replies we sent back on a forwarder's connection (Relay)
    relays_by_socket: int = 0  # ...that could not go on it: sent to the route's socket
    relays_refused: int = 0  # Forward.relay for a route not its sender's own (CURVE)
    accepts_in_done: int = 0  # accepts not sent: their task's TaskDone stood for them
    relayed_unroutable: int = 0  # Relays to us for a route not served here (dropped)
    moved: int = 0  # tasks we forwarded that their owner handed over to another (Moved)


class Dispatcher:
    def __init__(
        self,
        config: FanoutConfig,
        *,
        node: str,
        forwarder: Forwarder,
        placer: Placer,
        links: PeerLinks,
        owner: OwnerEndpoint,
        send_error: Callable[[Refuse], None],
        admit_here: Callable[[Task, float], Verdict],
        clock: Clock = SYSTEM_CLOCK,
        tracer: Any = None,
        on_confirm_reply: Callable[[ConfirmReply], None] = lambda msg: None,
        deliver_relayed: Callable[[str, bytes], bool] = lambda route, frame: False,
        on_model_card: Callable[[ModelCard, bool], None] = lambda msg, its_own: None,
        on_replay_known: Callable[[ReplayKnown, bool], None] = lambda msg, its_own: None,
        retry_after_here: Callable[[], int] = lambda: 0,
        node_at: Callable[[str], str | None] = lambda addr: None,
    ) -> None:
        self.config = config
        # The member that claims an address now (gossip's, core/addresses.py): a member's
        # last address is used only while no other member claims it.
        self._node_at = node_at
        self._clock = clock
        self.node = node
        self.forwarder = forwarder
        self.placer = placer
        self.owner = owner
        self._links = links
        self._send_error = send_error
        # Our admission, for the forwarder's RunHere (a retry or a migration whose next
        # member is ourselves): its verdict goes back at once (Forwarder.local_verdict).
        self._admit_here = admit_here
        # Our admission's hint for its latest refusal (Intake.retry_after_ms): an overloaded
        # RunHere counts with it, as a member's refusal counts with its own.
        self._retry_after_here = retry_after_here
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._hand_offs: dict[str, list[asyncio.Future[HandedOff]]] = {}
        self._idle_links: asyncio.Task[None] | None = None
        # When tracing is on (gossipd/ops/tracing.py); None costs nothing.
        self.tracer = tracer
        self.loads_refused = 0  # load records on a reply that named another member
        # ConfirmReplies to our Confirms (the owner's held Results, fanout/holding.py).
        self.on_confirm_reply = on_confirm_reply
        # Replies an owner relayed back to us (Forward.relay), to the route served here
        # (ReplySender.deliver_here: the HTTP door's); False: no such route here.
        self._deliver_relayed = deliver_relayed
        self.relayed_unroutable = 0  # Relays for a route not served here (counted, dropped)
        # ForwardReplies, TaskDones and ConfirmReplies naming a member other than the one at
        # the address they came from (dropped: a member cannot speak for another).
        self.replies_for_another = 0
        # Items on our connections that no owner sends (a Forward, a Drain, ...) or in
        # another version: refused, counted with the undecodable ones.
        self.replies_refused = 0
        # Members' answers to our ModelQuerys (GET /v1/models: core/modelcards.py).
        self.on_model_card = on_model_card
        # Members' answers to our ReplayQuerys (a restart: core/replaycheck.py).
        self.on_replay_known = on_replay_known

    def set_draining(self, draining: bool) -> None:
        """Drained or stopping: the placer sends every task elsewhere (False: back to serving)."""
        self.placer.set_draining(draining)

    @staticmethod
    def settings(
        config: FanoutConfig, retry_after_ms: int, retry_after_max_ms: int
    ) -> ForwarderSettings:
        return ForwarderSettings.of(config, retry_after_ms, retry_after_max_ms)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, tg: asyncio.TaskGroup) -> None:
        self.owner.start()
        self._idle_links = tg.create_task(self.close_idle_links_forever(), name="rpc-idle-links")

    def stop(self) -> None:
        """Cancel the background work (call before leaving the TaskGroup)."""
        self.owner.stop()
        if self._idle_links is not None:
            self._idle_links.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._links.stop()

    def close(self) -> None:
        self._links.close()
        self.owner.close()

    # -- inputs ----------------------------------------------------------------------------

    def route(self, task: Task, now: float) -> bool:
        """Called by the ingress for each new task: False to run it here, True if taken."""
        if self.forwarder.route(task, now) is _LOCAL:
            return False  # nothing to send: the ingress admits it (the common case, no flush)
        if self._flush_once():  # (_flush, its first pass written out: once a task)
            self._flush()
        return True

    def on_peer_replies(self, msgs: list[object], addr: str = "") -> None:
        """ForwardReplies, TaskDones, Relays, ConfirmReplies, ModelCards and ReplayKnowns
        read from the peer links (one read's worth), from the member at ``addr``."""
        now = self._clock.monotonic()
        on_reply = self.forwarder.on_reply
        tracer = self.tracer
        on_load = self.placer.on_load
        placer_addr = self.placer.addr
        # The last sender found at ``addr`` in our view (the view cannot move within this
        # call): its batch-mates skip the look.  (None, not "": a node "" is looked up.)
        addr_of: str | None = None
        for msg in msgs:
            # (a try costs nothing until it catches, in 3.11)
            try:
                if type(msg) not in _OWNERS_SAY or msg.v != PROTOCOL_VERSION:  # type: ignore[attr-defined]
                    self.replies_refused += 1
                    continue
                if type(msg) is Relay:
                    if not self._deliver_relayed(msg.to, msg.frame):
                        self.relayed_unroutable += 1
                    continue
                if addr and type(msg) in _SPOKEN_FOR:
                    # ``node`` must be the member at ``addr``, the connection it came on (as
                    # its address is now, or was when we last forwarded to it: a reply may
                    # outlive a move).
                    node = msg.node  # type: ignore[attr-defined]
                    if node != addr_of:
                        if placer_addr(node) == addr:
                            addr_of = node
                        elif self._last_addr(node) != addr:
                            self.replies_for_another += 1
                            continue
                if type(msg) is ConfirmReply:
                    self.on_confirm_reply(msg)
                    continue
                if type(msg) is ModelCard:
                    # Only a member's own card counts: it came on our connection to its address.
                    self.on_model_card(msg, bool(addr) and self.placer.addr(msg.node) == addr)
                    continue
                if type(msg) is Moved:
                    # Only from our owner server (addr ""), whose source check binds `node` to
                    # the sender's key: one back on our own connection to a member is no
                    # owner's word (any member could move another's tasks to a name that
                    # never dies).
                    if addr:
                        self.replies_for_another += 1
                    else:
                        self.forwarder.moved(
                            msg.id, msg.node, msg.to, msg.engine_deaths, self._clock.monotonic()
                        )
                    continue
                if type(msg) is ReplayKnown:  # (ModelCard's rule)
                    self.on_replay_known(msg, bool(addr) and self.placer.addr(msg.node) == addr)
                    continue
                if tracer is not None and type(msg) is TaskDone:
                    tracer.forward_done(msg.id)
                # (a ForwardReply or a TaskDone: the kinds above went on)
                load = msg.load  # type: ignore[attr-defined]
                if load is not None:
                    # An owner speaks for its own load only (docs/PROTOCOL.md, "Load").
                    if load.node == msg.node:  # type: ignore[attr-defined]
                        on_load(load, now)
                    else:
                        self.loads_refused += 1
                on_reply(msg, now)
            except Exception:  # one message's bug: its batch-mates and the flush go on
                note_handler_failure("Dispatcher.on_peer_replies", log, "handling a peer's reply")
        self._flush()

    def member_event(self, event: MemberEvent) -> None:
        if event.kind != "dead":
            return
        self.placer.prefix_index.forget_member(event.node)
        moved = self.forwarder.member_dead(event.node, self._clock.monotonic())
        self._flush()
        if moved:
            log.info(
                "migrating tasks off a dead member", extra={"member": event.node, "tasks": moved}
            )

    def cancel_forwarded(self, task_id: str, producer_key: str = "") -> str | None:
        """Pass a producer's Cancel to the member we forwarded the task to: "forwarded",
        "refused" (another key's task) or None (none)."""
        outcome = self.forwarder.cancel(task_id, producer_key)
        self._flush()
        return outcome

    def task_finished(self, task: Task, *_: object) -> None:
        """A task admitted here ended (released without a result, or refused)."""
        self.forwarder.local_finished(task.id)

    def local_finished(self, owned: Owned, _result: object) -> None:
        """A task admitted here finished (the runner's on_finished listener)."""
        self.forwarder.local_finished(owned.task.id)

    async def hand_off(self, task: Task, received_at: float) -> bool:
        """Give an admitted task to another member (never us): at drain, or when our engine
        died.  True when one accepted it."""
        future: asyncio.Future[HandedOff] = asyncio.get_running_loop().create_future()
        self._hand_offs.setdefault(task.id, []).append(future)
        owned = self.owner.intake_entry(task.id)  # (its count goes with it: the runner's)
        deaths = owned.engine_deaths if owned is not None else 0
        self.forwarder.hand_off(task, received_at, self._clock.monotonic(), deaths)
        self._flush()
        outcome = await future
        if not outcome.ok:
            return False
        to = outcome.to
        if outcome.done:  # it ended at ``to`` already: its forwarders forget it
            self._tell_done(task)
            return True
        self._tell_moved(task, to)
        # A Cancel or a Withdraw taken while it was offered (the caller releases it next,
        # and no worker of ours runs it to look at its stop): passed on to ``to``.
        owned = self.owner.intake_entry(task.id)
        stop = owned.stop if owned is not None else None
        if stop is Stop.CANCELLED or stop is Stop.WITHDRAWN:
            self.forwarder.stop_handed_off(task, to, withdrawn=stop is Stop.WITHDRAWN)
            self._flush()
        return True

    def _tell_done(self, task: Task) -> None:
        """A task handed off whose taker's TaskDone stood for its accept: it ended there,
        its Result gone to the producer, so the members that forwarded it to us hear our
        TaskDone (by name, as for a task re-run from the journal), not a Moved: told that
        it runs at the taker, they would answer for it there until its window passed (the
        taker's TaskDone came to us), and run it again if the taker died meanwhile."""
        owned = self.owner.intake_entry(task.id)
        if owned is None:
            return
        for member in set(self.owner.core.forwarders_of(owned)) - {self.node, ""}:
            self.send_to_member(member, TaskDone(id=task.id, node=self.node))

    def _tell_moved(self, task: Task, to: str) -> None:
        """The members that forwarded ``task`` to us (still admitted here: the caller
        releases it after) hear that it runs at ``to`` now (Moved), so that they answer for
        it there: drained and gone, we would migrate nothing, and our death after ``to``
        answered would have them run it again."""
        owned = self.owner.intake_entry(task.id)
        if owned is None:
            return
        told = not owned.from_producer  # (a producer's own task: ours to answer for)
        for member in set(self.owner.core.forwarders_of(owned)) - {self.node}:
            addr = self.placer.addr(member) if member else None
            # (an earlier release refuses the message, logged and counted: not sent)
            if addr is not None and release_at_least(
                self.placer.release(member), MOVED_FROM_VERSION
            ):
                moved = Moved(id=task.id, node=self.node, to=to, engine_deaths=owned.engine_deaths)
                self._links.send_alone(addr, moved)
            else:
                told = False
        if told:
            # Every forwarder answers for it at ``to`` now: ours would migrate it a second
            # time if ``to`` died while we are still up (a drain, our engine dead).
            self.forwarder.ledger.forget(task.id)

    def relay_drain(self, member: str, msg: Drain) -> bool:
        """An operator's Drain for ``member``, to its rpc address; False when it is no live
        member we know."""
        addr = self.placer.addr(member)
        if addr is None:
            return False
        self._links.send(addr, msg)
        return True

    def confirm(self, msg: Confirm) -> ConfirmReply:
        """An owner asks whether we still route these tasks to it: our ledger answers."""
        still, migrated, unknown = self.forwarder.ledger.confirm(msg.ids, msg.node)
        return ConfirmReply(node=self.node, still_mine=still, migrated=migrated, unknown=unknown)

    def finished_by(self, member: str, task_ids: list[str]) -> list[str]:
        """Those of ``task_ids`` we forwarded to ``member`` and had its TaskDone for: a
        restarted member asking (ReplayQuery) answered them before it went down."""
        return self.forwarder.ledger.finished_by(member, task_ids)

    def ask_model_card(self, member: str) -> bool:
        """Send ``member`` a ModelQuery; False when it is no live member we know."""
        return self._ask(member, ModelQuery(node=self.node))

    def ask_replays(self, member: str, tasks: list[tuple[str, str]]) -> bool:
        """Send ``member`` a ReplayQuery for ``tasks`` ((id, producer key) pairs); False
        when it is no live member we know."""
        return self._ask(member, ReplayQuery(node=self.node, tasks=tasks))

    def can_ask(self, member: str) -> bool:
        """Do we know where to send ``member`` a question?  (Placement learns a member's rpc
        address a moment after gossip shows it: a member asked in between was taken for one
        that holds nothing, and a restart re-ran a task that member had answered.)"""
        return self.placer.addr(member) is not None

    def _ask(self, member: str, question: ModelQuery | ReplayQuery) -> bool:
        """A question alone in its message (a member before 0.3.0 would refuse a batch
        that held one), to a live member by name."""
        addr = self.placer.addr(member)
        if addr is None:
            return False
        self._links.send_alone(addr, question)
        return True

    def send_to_member(self, member: str, msg: TaskDone | Confirm | Cancel) -> None:
        """The owner's TaskDone for a task re-run from its journal, or its Confirm about
        Results it holds, to the forwarder by name; a restart's Cancel for a task a member
        said it holds (ingress/replay.py), to that member."""
        addr = self.placer.addr(member) or self._last_addr(member)
        if addr is not None:
            self._links.send(addr, msg)

    def _last_addr(self, member: str) -> str | None:
        """Where ``member`` was when we last forwarded to it, unless another member claims
        that address now: a forger that gave a member its own address, then had it declared
        dead, was sent what was meant for that member there, and its answers were taken as
        that member's (PROTOCOL.md, threat model)."""
        addr = self.forwarder.last_addr(member)
        if addr is not None and self._node_at(addr) not in (None, member):
            return None
        return addr

    # -- outputs ---------------------------------------------------------------------------

    def _flush(self) -> None:
        while self._flush_once():
            pass  # a RunHere answered: what the forwarder did next goes out too

    def _flush_once(self) -> bool:
        """Send what the forwarder queued and act on its events; True if a RunHere was
        answered (the forwarder has more to say)."""
        outbox, events, at = self.forwarder.take_all()
        tracer = self.tracer
        for addr, msg in outbox:
            if tracer is not None and type(msg) is Forward:
                msg = tracer.forwarding(msg, addr)
            self._links.send(addr, msg)
        answered = False
        for event in events:
            if type(event) is RunHere:
                verdict = self._admit_here(event.task, event.received_at)
                self.forwarder.local_verdict(
                    event.task.id, verdict, self._clock.monotonic(), self._retry_after_here()
                )
                answered = True
            elif isinstance(event, Refuse):
                if tracer is not None:
                    tracer.refused(event.task.id, event.code)
                self._send_error(event)
            else:
                assert isinstance(event, HandedOff)
                self._handed_off(event)
        if at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, at - self._clock.monotonic()), self._on_timer)
            self._timer_at = at
        return answered

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        self.forwarder.tick(self._clock.monotonic())
        self._flush()

    def _handed_off(self, event: HandedOff) -> None:
        waiters = self._hand_offs.get(event.task.id)
        if not waiters:
            return
        future = waiters.pop(0)
        if not waiters:
            del self._hand_offs[event.task.id]
        if not future.done():
            future.set_result(event)

    # -- upkeep ----------------------------------------------------------------------------

    async def close_idle_links_forever(self) -> None:
        every_s = min(60.0, self.config.peer_idle_close_s / 4)
        while True:
            await asyncio.sleep(every_s)
            members = set(self.placer.view().addrs.values())
            self._links.close_idle(members, self._clock.monotonic())

    def prefix_summary(self) -> list[int]:
        return self.placer.prefix_summary()

    async def wait_settled(self, timeout_s: float) -> bool:
        """Wait until every forward has its answer and no retry is pending (at shutdown, so
        that no task is left unsent in a peer socket's queue).  False if ``timeout_s``
        passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.forwarder.settled():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def outstanding(self) -> dict[str, int]:
        """Per member: tasks we sent it (or are sending) that it has not reported done."""
        return self.forwarder.outstanding()

    def local_unfinished(self) -> int:
        return len(self.forwarder.local_ids)

    def statistics(self) -> FanoutStatistics:
        fw = self.forwarder.counters
        owner = self.owner.counters
        links = self._links.counters
        return FanoutStatistics(
            local=fw.local,
            forwarded=fw.forwarded,
            accepted_from_peers=owner.accepted_from_peers,
            refused_to_peers=owner.refused_to_peers,
            attempts_failed=fw.attempts_failed + links.sends_dropped,
            unavailable=fw.unavailable,
            migrated=fw.migrated,
            expired_not_migrated=fw.expired_not_migrated,
            cancelled_not_migrated=fw.cancelled_not_migrated,
            handed_off=fw.handed_off,
            moved=fw.moved,
            bad_peer_messages=owner.bad_peer_messages
            + links.bad_messages
            + self.replies_for_another
            + self.replies_refused,
            replies_dropped=owner.replies_dropped,
            prefix_hits=self.placer.prefix_hits,
            hedged=fw.hedged,
            hedge_wins=fw.hedge_wins,
            resends_absorbed=fw.resends_absorbed,
            hedges_over_budget=fw.hedges_over_budget,
            withdrawn=fw.withdrawn,
            peer_links_closed=links.links_closed,
            peer_protocol_errors=self.owner.server_protocol_errors
            + self._links.channel_protocol_errors,
            peer_connections_busy=self.owner.server_busy,
            withdrawn_by_peers=owner.withdrawn_by_peers,
            forwarded_bytes=self.forwarder.ledger.bytes,
            forwarded_evicted_count=self.forwarder.ledger.evicted_count,
            forwarded_evicted_bytes=self.forwarder.ledger.evicted_bytes,
            forwarded_expired=self.forwarder.ledger.expired,
            invalid_from_peers=owner.invalid_from_peers,
            refused_saturated=owner.refused_saturated,
            refused_stale=owner.refused_stale,
            replies_relayed=owner.replies_relayed,
            relays_by_socket=owner.relays_by_socket,
            relays_refused=owner.relays_refused,
            accepts_in_done=owner.accepts_in_done,
            relayed_unroutable=self.relayed_unroutable,
        )
