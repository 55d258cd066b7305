"""The owner's side of fan-out: the server (a ``PeerServer``, gossipd/peerchannel.py; in the
daemon a ZeroMQ ROUTER) that peers forward tasks to.

A Forward is admitted like a task from a producer (same admission, same dedup); the forwarder
gets a ForwardReply (accepted, or refused with the reason) and, once the task's final Result
has gone to the producer, a TaskDone so that it can forget the task.  Replies for one
forwarder are sent together at the end of an event-loop turn (PeerBatch).

Rule: a TaskDone never leaves before its Result.  It is queued in the callback that finds the
Result gone from the reply sender (handed to ZeroMQ, or dropped as undeliverable:
``ReplySender.when_sent``) and leaves with the ROUTER's next flush, queued behind that
callback, without the ``fanout.ack_delay_s`` wait of accepts (an owner killed between the two
leaves a forwarder that migrates the task and has it answered twice; one that sent the
TaskDone first, a task whose Result may never have left).  A Result held while its forwarder
may have migrated the task (fanout/holding.py) holds its TaskDone with it.  Accepts may wait
up to ``fanout.ack_delay_s`` to share a message; one still held when its task's TaskDone is
queued is not sent: the TaskDone stands for it (``_hold_accept``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import msgspec
import zmq

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import FanoutConfig
from gossipd.core.admission import Verdict
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.lifecycle import Owned
from gossipd.core.membership import MemberEvent
from gossipd.core.messages import PROTOCOL_VERSION, Cancel, Drain, Result, Task
from gossipd.core.owner import Admit, Owner, Refused
from gossipd.core.peer_messages import (
    Confirm,
    ConfirmReply,
    Forward,
    ForwardReply,
    ModelCard,
    ModelQuery,
    Moved,
    PeerBatch,
    Relay,
    ReplayKnown,
    ReplayQuery,
    TaskDone,
    Withdraw,
    decode_peer,
    encode_peer,
)
from gossipd.core.replaycheck import replay_known
from gossipd.errors import RemoteProtocolError, TransportClosed
from gossipd.ingress.service import Ingress
from gossipd.ops.logs import RateLimiter, note_handler_failure
from gossipd.peerchannel import PeerServer, ZmqPeerServer
from gossipd.security import node_of
from gossipd.zmtp import CURVE_OVERHEAD

# What an owner sends back on a forwarder's connection.
_ToForwarder = ForwardReply | TaskDone | ConfirmReply | Relay | ModelCard | ReplayKnown

# Messages read from a peer socket before the loop runs anything else.
PEER_READ_MAX = 256
# Forwarders' routes whose replies we relay (one per door of a member; a restarted door's
# new route replaces the least recently asked beyond this).
RELAY_ROUTES_MAX = 1024
# Members whose latest connection is remembered (for relays): more than a cluster has.
LINKS_MAX = 4096
# A Relay's fields beside its frame and route, with room to spare: a reply that would not
# fit one peer message with them goes by socket.
RELAY_ROOM = 256
# Our messages to a forwarder are at most this large (and at most fanout.message_bytes_max),
# so relayed replies waiting in the ROUTER's queue for a forwarder that does not read are
# bounded in bytes: its high-water mark (peerchannel.ROUTER_SNDHWM messages) x this, 64 MiB
# per connection.  A larger reply goes by socket (the reply sender's byte budget).
ROUTER_MESSAGE_BYTES_MAX = 64 * 1024


class ReplyRoutes(Protocol):
    """The reply sender as the owner relays through it (gossipd/replysender.ReplySender)."""

    def relay(self, endpoint: str, deliver: Callable[[bytes], None] | None) -> None: ...

    def send_direct(self, endpoint: str, frame: bytes) -> None: ...


log = logging.getLogger("gossipd.fanout.owner")

# Enum members read per task as globals (Python 3.11: ~80 ns through the class, see
# core/admission.py).
_ADMIT = Verdict.ADMIT
_DUPLICATE_PENDING = Verdict.DUPLICATE_PENDING


def zmq_peer_server(
    config: FanoutConfig,
    ctx: zmq.Context,
    *,
    serve_curve: Callable[[zmq.Socket], None] | None = None,
) -> ZmqPeerServer:
    """The daemon's server for its peers: a ROUTER with fan-out's limits; ``serve_curve``
    makes it a CURVE server (gossipd/security.py), whose frames then carry their sender."""
    return ZmqPeerServer(
        ctx,
        message_bytes_max=config.message_bytes_max,
        recv_batch_max=PEER_READ_MAX,
        serve_curve=serve_curve,
    )


def peer_frames(items: list[Any], bytes_max: int) -> list[tuple[bytes, int]]:
    """Encode ``items`` as one message, or split it so that no message exceeds the receiver's
    limit ``bytes_max`` on the wire (a batch of large prompts): libzmq's MAXMSGSIZE, and the
    loop channel's, count a CURVE MESSAGE's overhead too.  Returns (frame, number of items
    in it)."""
    frame = encode_peer(items[0] if len(items) == 1 else PeerBatch(items=items))
    if len(frame) + CURVE_OVERHEAD <= bytes_max or len(items) == 1:
        return [(frame, len(items))]
    half = len(items) // 2
    return peer_frames(items[:half], bytes_max) + peer_frames(items[half:], bytes_max)


def peer_items(frame: bytes, bytes_max: int) -> Sequence[object]:
    """The fan-out messages in one frame (a PeerBatch unpacked), the inverse of
    ``peer_frames``; raises ``RemoteProtocolError`` for what is not one."""
    msg = decode_peer(frame, bytes_max=bytes_max)
    return msg.items if isinstance(msg, PeerBatch) else (msg,)


def _source(item: object, sender: str) -> str:
    """The node a fan-out message says it comes from (a Cancel names none: its sender's,
    ``sender`` being the connection's user id, "NODE KEY")."""
    if type(item) is Forward:
        return item.src
    if type(item) in (Withdraw, TaskDone, Confirm, ModelQuery, ReplayQuery, Moved):
        return item.node  # type: ignore[attr-defined]  # each of the six has one
    return node_of(sender)


class OwnerEndpoint:
    def __init__(
        self,
        config: FanoutConfig,
        *,
        server: PeerServer,
        node: str,
        ingress: Ingress,
        send_to_member: Callable[[str, TaskDone], None],
        on_peer_done: Callable[[TaskDone | Moved], None],
        on_accepted: Callable[[Task, str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        task_bytes_max: int = 1 << 62,
        load_record: Callable[[], LoadRecord | None] = lambda: None,
        peer_allowed: Callable[[str, str, str], bool] | None = None,
        saturated: Callable[[float], bool] = lambda now: False,
        on_drain: Callable[[Drain], object] = lambda msg: None,
        on_confirm: Callable[[Confirm], ConfirmReply] | None = None,
        on_withdraw_held: Callable[[str, str], None] | None = None,
        replies: ReplyRoutes | None = None,
        relay_allowed: Callable[[str, str], bool] = lambda src, producer_key: True,
        model_card: Callable[[], ModelCard] | None = None,
        replay_finished: Callable[[str, list[str]], list[str]] = lambda member, ids: [],
    ) -> None:
        self.config = config
        self._clock = clock
        self.node = node
        # Peers' connections (in the daemon a ZeroMQ ROUTER at fanout.rpc_bind; under CURVE
        # it gives each frame's sender: its key's node).
        self._server = server
        self._bound = False  # between bind() and close(): replies may go
        self._ingress = ingress
        # The owner's decisions on Forwards (core/owner.py); its counters are ours.
        self.core = Owner(node=node, task_bytes_max=task_bytes_max)
        self.counters = self.core.counters
        self._router_out: dict[bytes, list[_ToForwarder]] = {}
        # Accepts held for fanout.ack_delay_s, by forwarder and task id (_hold_accept).
        self._accepts_out: dict[bytes, dict[str, ForwardReply]] = {}
        self._router_flush_soon = False  # a flush is queued for the next loop turns
        self._router_flush_timer: asyncio.TimerHandle | None = None  # ...or for ack_delay_s
        self._on_accepted = on_accepted  # (task, forwarder): the journal marks it
        # Send a TaskDone to a member's ROUTER by name; and a TaskDone that a member sent us as
        # its forwarder (a task it re-ran from its journal).
        self._send_to_member = send_to_member
        self._on_peer_done = on_peer_done
        self._on_drain = on_drain  # a Drain another member relayed to us (gossipd/admin.py)
        # An owner's Confirm about tasks we forwarded to it: our ledger's answer.
        self._on_confirm = on_confirm
        # Each forwarder's connection identity -> its node (Forward.src): whose the task is,
        # for the Results held while that member is not alive (fanout/holding.py).
        self.member_of = self.core.member_of
        # A Withdraw for a task that ended here: (task id, forwarder) to the ResultHolder.
        self.on_withdraw_held = on_withdraw_held
        # (member, ids): those of the ids we forwarded to that member and had its TaskDone
        # for (our forwarder's ledger): a restarted member asking about them answered them.
        self._replay_finished = replay_finished
        self._invalid_log = RateLimiter(per_s=1.0, burst=5)
        self._stale_log = RateLimiter(per_s=1.0, burst=5)
        # Under CURVE (gossipd/security.py): peer_allowed(key's user id, claimed source, "rpc")
        # says whether a message may be taken (its key still authorised, speaking for itself).
        self.peer_allowed = peer_allowed
        # Our load as we answer (issue 17): the first ForwardReply or TaskDone queued for a
        # forwarder carries it, the rest that leave with it none; a saturated refusal always
        # does, an invalid or stale Forward's refusal never.  None carries none.
        self.load_record = load_record
        # Is our engine saturated as we read it now (fanout.engine_*_saturated, our latest
        # engine sample)?  A Forward with if_free is then refused at once ("saturated"):
        # the owner check of issue 17.  Never, without it.
        self.saturated = saturated
        # Forward.relay: replies to a forwarder's route go back on its connection as Relay
        # items (the reply sender hands them to us: ReplySender.relay); route -> the
        # forwarder's node, the RELAY_ROUTES_MAX routes most recently asked for; each
        # member's latest connection (a reconnect is followed at its next Forward).  Under
        # CURVE ``relay_allowed(src, producer_key)`` says the route is src's own (its key):
        # no member can draw another's replies to itself.
        self._replies = replies
        self._relay_allowed = relay_allowed
        self._relays: dict[str, str] = {}
        self._message_max = min(config.message_bytes_max, ROUTER_MESSAGE_BYTES_MAX)
        self._link_of: dict[str, bytes] = {}  # a member: its latest connection (bounded)
        # Our model and its max_model_len, for a member's ModelQuery (GET /v1/models there).
        self._model_card = model_card

    def bind(self) -> str:
        endpoint = self._server.bind(self.config.rpc_bind)
        self._bound = True
        return self.config.rpc_advertise or endpoint

    def start(self) -> None:
        """Take peers' frames from the server as they arrive (ZeroMQ: in the ROUTER's fd
        callback: a forward is admitted in the callback that sees it arrive)."""
        self._server.start(self._on_peer_frame, self._on_malformed)

    @property
    def server_protocol_errors(self) -> int:
        return self._server.protocol_errors

    @property
    def server_busy(self) -> int:
        return self._server.busy

    def stop(self) -> None:
        self._server.stop()

    def close(self) -> None:
        self._bound = False
        self._server.close()

    def _on_malformed(self) -> None:
        self.counters.bad_peer_messages += 1  # a peer sent a message of several parts

    def _on_peer_frame(self, identity: bytes, frame: bytes, sender: str) -> None:
        """One frame from a forwarder's connection.  With CURVE (``peer_allowed``),
        ``sender`` is "NODE KEY" (ZAP: its key and the node it belongs to); every item must
        name that node as its source (Forward.src, Withdraw.node, TaskDone.node), and a
        Cancel must come from a member whose key is still authorised."""
        try:
            items = peer_items(frame, self.config.message_bytes_max)
        except RemoteProtocolError as exc:
            self.counters.bad_peer_messages += 1
            log.warning("refused a peer message", extra={"hint": exc.hint[:200]})
            return
        allowed = self.peer_allowed
        for item in items:
            if allowed is not None and not allowed(sender, _source(item, sender), "rpc"):
                self.counters.refused_unauthorised += 1
                continue
            try:  # (free until it catches)
                self._on_forward(identity, item)
            except Exception:  # one item's bug: the rest of its batch go on
                note_handler_failure("OwnerEndpoint.on_peer_item", log, "handling a peer's item")

    def _on_forward(self, identity: bytes, msg: object) -> None:
        if type(msg) is not Forward:  # the rarer kinds first tested here, not per Forward
            self._on_other(identity, msg)
            return
        assert isinstance(msg, Forward)
        now = self._clock.monotonic()
        decision = self.core.forward(
            identity, msg, now, saturated=msg.if_free and self.saturated(now)
        )
        if type(decision) is not Admit:
            assert isinstance(decision, Refused)
            self._refused(identity, msg, decision)
            return
        link_of = self._link_of
        if msg.src not in link_of and len(link_of) >= LINKS_MAX:
            # A src per Forward (anyone's word without CURVE) must not grow it without end:
            # the oldest goes (a member's relays then go by socket until its next Forward).
            del link_of[next(iter(link_of))]
        link_of[msg.src] = identity
        if msg.relay and self._replies is not None:
            # Before admission: a Result it sends at once (the results cache) is relayed too.
            self._relay_to(msg.src, msg.task)
        verdict = self._ingress.intake.admit(
            decision.task, decision.received_at, answer=False, now=now, forwarder=identity
        )
        if msg.engine_deaths and (verdict is _ADMIT or verdict is _DUPLICATE_PENDING):
            self._note_engine_deaths(msg)  # (a dead engine's hand-off: rare)
        # Our load on the first reply queued for this forwarder only: one record a message,
        # not one per task in a batch.
        load = self.load_record() if decision.with_load else None
        answer = self.core.admitted(msg, verdict, self._ingress.intake.retry_after_ms, load)
        if not answer.accepted:
            self._to_forwarder(identity, answer.reply)
            return
        if verdict is _ADMIT and self._on_accepted is not None:
            self._on_accepted(msg.task, msg.src)
        # Held before its TaskDone can be queued (below, or at once by the engine): the
        # TaskDone then stands for it.
        self._hold_accept(identity, msg.task.id, answer.reply)
        if answer.done_now and self.core.done_after(msg.task, (identity,), ""):
            # admit() has just sent the cached Result (or, rule 5, had it sent before)
            self._when_replies_sent(msg.task.route)

    def _note_engine_deaths(self, msg: Forward) -> None:
        """The engines that died running a task handed to us: ours, if it dies too, counts
        on from there (the runner's engine.deaths_per_task_max)."""
        owned = self.intake_entry(msg.task.id)
        if owned is not None and owned.task.producer_key == msg.task.producer_key:
            owned.engine_deaths = max(owned.engine_deaths, msg.engine_deaths)

    def _relay_to(self, member: str, task: Task) -> None:
        """From now on, replies to ``task``'s route go back to ``member`` (the member whose
        door that route is), if the route is that member's own."""
        route = task.route
        relays = self._relays
        known = relays.get(route)
        # Asked again by another member, the route is checked again: under CURVE a member
        # may name any producer_key, and the route would follow whoever asked last.
        if known != member and not self._relay_allowed(member, task.producer_key):
            self.counters.relays_refused += 1
            return
        if known is not None:
            del relays[route]  # re-inserted: the most recent last
        else:
            if len(relays) >= RELAY_ROUTES_MAX:
                oldest = next(iter(relays))  # a door gone long ago: its replies by socket
                del relays[oldest]
                self._replies.relay(oldest, None)  # type: ignore[union-attr]
            self._replies.relay(route, partial(self._relay_out, route))  # type: ignore[union-attr]
        relays[route] = member

    def _relay_out(self, route: str, frame: bytes) -> None:
        """A reply to a relayed route: queued for its member's latest connection, sent this
        turn (its TaskDone, queued after it, leaves with it); one that cannot fit a peer
        message goes to the route's socket instead."""
        identity = self._link_of.get(self._relays.get(route, ""))
        if identity is None or len(frame) + len(route) + RELAY_ROOM > self._message_max:
            self.counters.relays_by_socket += 1
            self._replies.send_direct(route, frame)  # type: ignore[union-attr]
            return
        item = Relay(node=self.node, to=route, frame=frame)
        queue = self._router_out.get(identity)
        if queue is None:
            self._router_out[identity] = [item]
        else:
            queue.append(item)
        self.counters.replies_relayed += 1
        if not self._router_flush_soon:
            self._router_flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush_router)

    def _refused(self, identity: bytes, msg: Forward, refused: Refused) -> None:
        """A Forward refused before admission: the reply now (the forwarder tries the next
        member on it), a rate-limited warning for an invalid or stale one."""
        reply = refused.reply
        if refused.why == "saturated":  # with our load: why the forwarder should go on
            reply = msgspec.structs.replace(reply, load=self.load_record())
        else:
            limiter = self._invalid_log if refused.why == "invalid" else self._stale_log
            if limiter.allow():
                extra: dict[str, object] = {
                    "code": reply.code,
                    "hint": refused.hint[:200],
                    "src": msg.src,
                }
                if refused.why == "stale":
                    extra.update(
                        task=msg.task.id, boot=msg.boot, latest_boot=self.core.latest_boot(msg.src)
                    )
                extra["suppressed_since_last"] = limiter.take_suppressed()
                log.warning(
                    "refused a forwarded task"
                    if refused.why == "invalid"
                    else "refused a Forward from an earlier process of its sender",
                    extra=extra,
                )
        self._to_forwarder(identity, reply)

    def _on_other(self, identity: bytes, msg: object) -> None:
        """A peer's Cancel, Withdraw, TaskDone, relayed Drain, Confirm (answered from our
        ledger when ``on_confirm`` is set), ModelQuery or ReplayQuery (answered from our task
        book); anything else is counted as bad."""
        if getattr(msg, "v", 0) != PROTOCOL_VERSION:
            self.counters.bad_peer_messages += 1  # an item of a PeerBatch in another version
            return
        if isinstance(msg, Cancel):
            # The producer key the entry daemon read: only the task's own key cancels it.
            self._ingress.intake.handle_cancel(msg.id, msg.producer_key)
        elif isinstance(msg, Withdraw):
            self._withdraw(self._connection_of(identity, msg), msg.id)
        elif isinstance(msg, (TaskDone, Moved)):  # (to the forwarder's side, as replies)
            self._on_peer_done(msg)
        elif isinstance(msg, Drain):
            self._on_drain(msg)
        elif isinstance(msg, Confirm) and self._on_confirm is not None:
            self._to_forwarder(identity, self._on_confirm(msg))
        elif isinstance(msg, ModelQuery) and self._model_card is not None:
            self._to_forwarder(identity, self._model_card())
        elif isinstance(msg, ReplayQuery):
            book = self._ingress.intake.book
            answer = replay_known(msg, self.node, book.held, self._replay_finished)
            self._to_forwarder(identity, answer)
        else:
            self.counters.bad_peer_messages += 1

    def intake_entry(self, task_id: str) -> Owned | None:
        """The task book's entry of ``task_id`` (admitted here, not yet released)."""
        return self._ingress.intake.book.get(task_id)

    def _connection_of(self, identity: bytes, msg: Withdraw) -> bytes:
        """The connection the withdrawing member forwarded the task on: a member that
        reconnected since (its first connection dropped, re-keyed, or closed by us as busy)
        withdraws on a new one, which the task does not know; matched by member, a stalled
        owner now drops such a copy (it ran beside the migrated one)."""
        owned = self.intake_entry(msg.id)
        if owned is None or identity in owned.forwarders:
            return identity
        member_of = self.core.member_of
        for forwarder in owned.forwarders:
            if isinstance(forwarder, bytes) and member_of.get(forwarder) == msg.node:
                return forwarder
        return identity

    def _withdraw(self, identity: bytes, task_id: str) -> None:
        """Drop the copy of ``task_id`` that this forwarder gave us, unless another forwarder
        (or its producer directly) still counts on it (core/lifecycle.py, rule 3)."""
        member = self.core.withdrawn(identity, self._ingress.runner.withdraw(task_id, identity))
        if member is not None and self.on_withdraw_held is not None:  # its Result may be held
            self.on_withdraw_held(task_id, member)

    def _to_forwarder(self, identity: bytes, msg: _ToForwarder) -> None:
        """Queue for one forwarder at once (a refusal: the forwarder tries the next member
        on it; an answer to its question); everything queued until the flush goes as one
        message.  A TaskDone is queued by ``_results_left``, which schedules the flush
        itself."""
        queue = self._router_out.get(identity)
        if queue is None:
            self._router_out[identity] = [msg]
        else:
            queue.append(msg)
        self._flush_soon()

    def _hold_accept(self, identity: bytes, task_id: str, accept: ForwardReply) -> None:
        """Hold an accept up to ``fanout.ack_delay_s`` (like TCP's delayed ACK): the
        forwarder needs it only for its ack timeout, so it is woken once for many instead of
        once per task.  A task that ends meanwhile has its Result sent to the producer before
        the flush, and its TaskDone stands for the accept, which is not sent: the forwarder
        takes a TaskDone for a Forward still awaiting its answer as that answer (one message
        and one ledger entry fewer a quick task, on both sides)."""
        held = self._accepts_out.get(identity)
        if held is None:
            self._accepts_out[identity] = {task_id: accept}
        else:
            earlier = held.pop(task_id, None)
            if earlier is not None:  # (another Forward of the id on this connection: both go)
                self._router_out.setdefault(identity, []).append(earlier)
            held[task_id] = accept
        delay = self.config.ack_delay_s
        if delay <= 0:
            self._flush_soon()
        elif self._router_flush_timer is None and not self._router_flush_soon:
            self._router_flush_timer = asyncio.get_running_loop().call_later(
                delay, self._flush_router
            )

    def _flush_soon(self) -> None:
        if not self._router_flush_soon:
            self._router_flush_soon = True
            # One turn later than the producers' replies, which are queued already.
            asyncio.get_running_loop().call_soon(self._flush_router_next_turn)

    def _flush_router_next_turn(self) -> None:
        asyncio.get_running_loop().call_soon(self._flush_router)

    def _flush_router(self) -> None:
        self._router_flush_soon = False
        if self._router_flush_timer is not None:
            self._router_flush_timer.cancel()
            self._router_flush_timer = None
        out, self._router_out = self._router_out, {}
        accepts, self._accepts_out = self._accepts_out, {}
        self.core.flushed()
        if not self._bound or not (out or accepts):
            return
        for identity, held in accepts.items():
            if held:  # (before the rest: an accept was queued before its task's replies)
                out[identity] = [*held.values(), *out.get(identity, ())]
        send = self._server.send
        for identity, items in out.items():
            start = 0
            for frame, count in peer_frames(items, self._message_max):
                # Refused: its connection gone or full; the forwarder times out, tries the next.
                try:
                    sent = send(identity, frame)
                except (TransportClosed, zmq.ZMQError):  # closing: one failure, not the rest
                    sent = False
                if not sent:
                    self._not_sent(identity, items[start : start + count])
                start += count
        self._server.flush()

    def _not_sent(self, identity: bytes, items: Sequence[object]) -> None:
        """``items`` for ``identity`` could not go: counted; the replies among them go to
        their routes' sockets instead (the door's reply socket serves), and the member's
        replies go that way until it forwards to us again on a live connection."""
        member = self.member_of.get(identity, "")
        if self._link_of.get(member) == identity:
            del self._link_of[member]
        relays = [i for i in items if type(i) is Relay] if self._replies is not None else []
        counters = self.counters
        counters.replies_dropped += len(items) - len(relays)
        counters.replies_relayed -= len(relays)
        counters.relays_by_socket += len(relays)
        for relay in relays:
            assert isinstance(relay, Relay)
            self._replies.send_direct(relay.to, relay.frame)  # type: ignore[union-attr]

    def member_event(self, event: MemberEvent) -> None:
        """A member declared dead or gone: its next process's boot starts afresh (Owner)."""
        if event.kind in ("dead", "left"):
            self.core.member_dead(event.node)

    def task_finished(self, owned: Owned, result: Result) -> None:
        """A task's final Result has just been handed to the reply sender (an ingress
        on_finished listener): its forwarders hear a TaskDone right after it leaves."""
        if self.core.task_finished(owned):
            self._when_replies_sent(owned.task.route)

    def _when_replies_sent(self, route: str) -> None:
        """Told when every reply to ``route`` so far has left (handed to ZeroMQ at once, or
        in the callback that sends the reply sender's batch for that address at the end of
        the turn, or drains its queue): the TaskDones waiting on it go then."""
        self._ingress.runner.when_replies_sent(route, partial(self._results_left, route))

    def _results_left(self, reply_to: str) -> None:
        """The Results to ``reply_to`` have been handed to ZeroMQ: their TaskDones go now."""
        core = self.core
        to_links, to_members = core.results_left(reply_to, None, self.load_record)
        router_out = self._router_out  # (no flush before the end of this turn)
        accepts_out = self._accepts_out
        for identity, done in to_links:
            held = accepts_out.get(identity)  # type: ignore[call-overload]
            accept = None if held is None else held.pop(done.id, None)
            if accept is not None:  # not sent: the TaskDone stands for it (_hold_accept)
                self.counters.accepts_in_done += 1
                if accept.load is not None and done.load is None:  # the load it carried
                    done = msgspec.structs.replace(done, load=accept.load)
            queue = router_out.get(identity)  # type: ignore[call-overload]
            if queue is None:
                router_out[identity] = [done]  # type: ignore[index]
            else:
                queue.append(done)
        for member, done in to_members:  # a task re-run from the journal: by name
            self._send_to_member(member, done)
        # Their Results are with ZeroMQ: the TaskDones leave at the start of the next loop
        # turn, together with those of the other producers' Results of this turn and any
        # accepts waiting for the forwarder (one message per forwarder, not one per producer).
        if not self._router_flush_soon:
            self._router_flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush_router)
