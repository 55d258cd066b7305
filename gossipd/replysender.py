"""The reply sender: Chunks and Results to producers' reply addresses (and to the HTTP door
and the peer channel, which it delivers to in this process), by PUSH on pooled sockets, never
blocking; and TurnBatching, the rule for which messages wait for the end of a loop turn."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import zmq

from gossipd.core.codec import replies_frame, replies_groups
from gossipd.core.messages import Chunk, Result, encode
from gossipd.hostnames import FAILED, HostNames, name_in
from gossipd.sockets import CloseReason, SocketKind, SocketPool
from gossipd.zmqloop import FAILURE_LOG, NOBLOCK, POLLOUT, wait_events

log = logging.getLogger("gossipd.replysender")

_REPLY = SocketKind.REPLY  # read per reply: a global (see core/admission.py on enums)


@dataclass(frozen=True, slots=True)
class ReplyStatistics:
    sockets_open: int
    sent: int
    queued: int
    dropped_undeliverable: int
    dropped_queue_full: int
    sockets_closed_idle: int
    sockets_evicted: int
    queued_bytes: int = 0  # bytes waiting in the queues (reply_queue_bytes_max)
    dropped_queue_bytes: int = 0  # replies dropped: the queues held reply_queue_bytes_max


class _Peer:
    __slots__ = ("batch", "endpoint", "flusher", "queue", "queue_replies", "sock", "waiters")

    def __init__(self, endpoint: str, sock: zmq.Socket) -> None:
        self.endpoint = endpoint
        self.sock = sock
        # Sent at the end of this loop turn, in order: a reply (bytes), or a run of replies
        # sent with ``pack=True`` (a list), which leaves as Replies frames.
        self.batch: list[bytes | list[bytes]] = []
        self.queue: deque[bytes] = deque()
        # How many replies each queued frame holds (a Replies frame: several).
        self.queue_replies: deque[int] = deque()
        self.flusher: asyncio.Task[None] | None = None
        # when_sent callbacks: called once batch and queue are empty (handed to ZeroMQ, or
        # dropped).
        self.waiters: list[Callable[[], None]] = []

    def held(self) -> int:
        """Replies in the batch and the queue."""
        return sum(self.queue_replies) + sum(1 if type(i) is bytes else len(i) for i in self.batch)

    def clear_queue(self) -> int:
        """Empty the queue; returns the replies it held."""
        replies = sum(self.queue_replies)
        self.queue.clear()
        self.queue_replies.clear()
        return replies

    def release_waiters(self) -> None:
        waiters, self.waiters = self.waiters, []
        for callback in waiters:
            callback()


class _Awaiting:
    """Replies to an address whose host name is being looked up (hostnames.py)."""

    __slots__ = ("frames", "waiters")

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, bool]] = []  # (frame, pack), in order
        self.waiters: list[Callable[[], None]] = []  # when_sent's


class TurnBatching:
    """Whether a message leaves at once or waits for the end of the loop turn.

    Messages of one turn wait and leave together when it ends (``on_turn_end`` sends them):
    one wake-up of the receiver for many.  When the previous turn sent one message at most
    (light load), a turn's first message leaves at once instead, so that a lone message does
    not wait for the rest of its turn."""

    __slots__ = ("_armed", "_count", "_on_turn_end", "_quiet")

    def __init__(self, on_turn_end: Callable[[], None]) -> None:
        self._on_turn_end = on_turn_end
        self._armed = False  # on_turn_end is due at the end of this turn
        self._count = 0  # messages in this turn
        self._quiet = True  # the last turn had one message at most

    def send_now(self) -> bool:
        """Count one message: True to send it now, False to queue it for the turn's end."""
        if self._armed:
            self._count += 1
            return False
        asyncio.get_running_loop().call_soon(self._end_turn)
        self._armed = True  # (after: without a running loop nothing would ever end the turn)
        self._count = 1
        return self._quiet

    def _end_turn(self) -> None:
        self._armed = False
        self._quiet = self._count <= 1
        self._on_turn_end()


def reconnect_max_ms(timeout_s: float) -> int:
    """The longest wait between a reply socket's reconnects: half the time replies wait for
    it (ingress.reply_timeout_s), between 100 ms (libzmq's first wait) and 2 s."""
    return int(min(2000.0, max(100.0, timeout_s * 500)))


class ReplySender:
    """Sends results and chunks to producers' reply addresses by PUSH, never blocking.

    One pooled socket per reply address (at most ``sockets_max``, least recently used closed
    first, idle ones closed after ``idle_s``).  A message that cannot go at once waits in that
    address's queue (at most ``queue_max`` messages, and at most ``queue_bytes_max`` bytes in
    the queues of all addresses together) for up to ``timeout_s``; then it is dropped and
    counted, and the socket is closed.  A message that finds no room is dropped and counted
    at once.  Messages to one address keep their order.

    Messages for one address within one turn of the event loop leave together at the turn's
    end, each its own one-frame ZeroMQ message (docs/PROTOCOL.md: a multipart message would
    lose every part but the first at a producer that reads one frame per message, as
    zeromq.js's ``for await (const [frame] of sock)`` does): when an engine step yields a
    token for 32 streamed tasks of one producer, the 32 sends follow one another and libzmq's
    I/O thread writes them out together.  When the last turn sent one reply at most (light
    load), a turn's first reply leaves at once instead: a lone reply does not wait for the
    rest of the turn.  Replies to one address leave in the order they were sent here (a
    task's Chunks before its Result), whichever of them are packed.

    Replies sent with ``pack=True`` (tasks whose producer set ``batch_replies``) that leave
    together go as Replies frames instead, several in one frame (``codec.pack_replies``):
    under CURVE libzmq encrypts each frame on its own, about 1 us of CPU per frame at each
    end here, so a turn's 32 Results cost one encryption instead of 32.
    """

    def __init__(
        self,
        pool: SocketPool,
        *,
        sockets_max: int,
        idle_s: float,
        timeout_s: float,
        queue_max: int,
        queue_bytes_max: int = 1 << 62,
        names: HostNames | None = None,
    ) -> None:
        """``names``: where a reply address's host name is looked up (its own threads: see
        hostnames.py)."""
        self._pool = pool
        # (gossip and the peer channel look names up in it too: fanout/assembly.py)
        self.names = names if names is not None else HostNames(timeout_s=timeout_s)
        # Replies to addresses whose host name is being looked up (counted in the queues'
        # bytes, at most queue_max each): sent in order once it is, dropped if it is not.
        self._awaiting: dict[str, _Awaiting] = {}
        self._lookups: set[asyncio.Future[None]] = set()  # their tasks
        pool.register(
            SocketKind.REPLY,
            on_close=self._on_socket_closed,
            sockets_max=sockets_max,
            idle_s=idle_s,
            linger_ms=1000,
            # A reply the producer's host does not acknowledge within timeout_s (a cut link,
            # a host gone) is given up with its connection, as a queued one is here: else
            # TCP keeps retransmitting it, ever more slowly, and delivers it after a heal,
            # long after the forwarder had the task answered elsewhere (PROTOCOL.md
            # "Duplicate final Results").  IMMEDIATE (sockets.py) drops what waited in
            # ZeroMQ for that connection with it.
            # IPV6: a reply_to may be tcp://[IPv6]:PORT (PROTOCOL.md); libzmq's sockets are
            # IPv4 only by default, and such a reply would never leave.
            # RECONNECT_IVL_MAX: a producer that is gone (each `gossipd submit` or client
            # run binds a reply port of its own) is tried again 100, 300, 700 ms ... after
            # the drop, then every reconnect_max_ms (half of timeout_s, 2 s at most)
            # until its socket idles out, not every 100 ms: 1,000 producers gone cost the
            # idle daemon a fifth of a core in refused connects (bench/README, "Producers
            # that come and go").  One that comes back at the same address is reached
            # within that bound of its return, its replies waiting up to timeout_s.
            options={
                zmq.TCP_MAXRT: max(1, int(timeout_s * 1000)),
                zmq.IPV6: 1,
                zmq.RECONNECT_IVL_MAX: reconnect_max_ms(timeout_s),
            },
            keep=self._holds,  # still flushing: no idle close, evicted last
        )
        self._timeout_s = timeout_s
        self._queue_max = queue_max
        self._queue_bytes_max = queue_bytes_max
        self._queued_bytes = 0  # in every peer's queue (not the turn's batches)
        self._dropped_queue_bytes = 0
        self._peers: dict[str, _Peer] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._closed = False
        self._batched: list[_Peer] = []  # peers with a non-empty batch, in first-use order
        self._turn = TurnBatching(self._send_batches)
        self._sent = 0
        self._dropped_undeliverable = 0
        self._dropped_queue_full = 0
        self._closed_idle = 0
        self._evicted = 0
        # Reply addresses served in this process (the HTTP door's): handed over directly,
        # as frames, or as the messages themselves (send_message: no encoding at all).
        self._local: dict[str, Callable[[bytes], None]] = {}
        self._local_messages: dict[str, Callable[[Chunk | Result], None]] = {}
        # ...and every route whose replies go elsewhere than a socket of ours: those, and
        # the routes of forwarders that asked their owner (us) to relay (Forward.relay).
        self._divert: dict[str, Callable[[bytes], None]] = {}

    def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg

    def deliver_locally(
        self,
        endpoint: str,
        deliver: Callable[[bytes], None],
        deliver_message: Callable[[Chunk | Result], None] | None = None,
    ) -> None:
        """Replies to ``endpoint`` (a route this daemon serves itself: the HTTP door's reply
        address) go to ``deliver`` at once, in order, instead of through a socket; those
        given to ``send_message`` go to ``deliver_message`` unencoded, when it is given."""
        self._local[endpoint] = deliver
        self._divert[endpoint] = deliver
        if deliver_message is None:
            self._local_messages.pop(endpoint, None)
        else:
            self._local_messages[endpoint] = deliver_message

    def relay(self, endpoint: str, deliver: Callable[[bytes], None] | None) -> None:
        """Replies to ``endpoint`` (the route of a forwarder that holds its clients itself:
        Forward.relay) go to ``deliver``, which sends them back on that forwarder's
        connection, instead of to a socket of their own; None: to the socket again."""
        if endpoint in self._local:
            return
        if deliver is None:
            self._divert.pop(endpoint, None)
        else:
            self._divert[endpoint] = deliver

    @property
    def local_routes(self) -> Collection[str]:
        """The routes ``deliver_locally`` serves (a live view)."""
        return self._local.keys()

    def deliver_here(self, endpoint: str, frame: bytes) -> bool:
        """Hand ``frame`` (a reply an owner relayed back to us, Relay) to the route served
        in this process; False if none is."""
        deliver = self._local.get(endpoint)
        if deliver is None:
            return False
        deliver(frame)
        return True

    def _holds(self, endpoint: str) -> bool:
        """Replies wait for ``endpoint``: queued, or in this turn's batch."""
        peer = self._peers.get(endpoint)
        return peer is not None and bool(peer.queue or peer.batch)

    def stop(self) -> None:
        """Cancel the background tasks (queued replies stay until ``close``; those waiting
        for a host name's lookup are dropped and counted: a stalled resolver must not hold
        up the daemon's stop)."""
        for peer in self._peers.values():
            if peer.flusher is not None:
                peer.flusher.cancel()
        for lookup in self._lookups:
            lookup.cancel()

    def _open(self, endpoint: str, address: str | None = None) -> _Peer:
        peer = _Peer(endpoint, self._pool.open(SocketKind.REPLY, endpoint, address=address))
        self._peers[endpoint] = peer
        return peer

    def send(self, endpoint: str, frame: bytes, pack: bool = False) -> None:
        """Queue ``frame`` for ``endpoint`` (already validated as connectable); ``pack``: the
        producer takes Replies frames (``Task.batch_replies``)."""
        if self._closed:
            return
        if self._divert and (deliver := self._divert.get(endpoint)) is not None:
            deliver(frame)
            return
        self._send_by_socket(endpoint, frame, pack)

    def send_message(self, endpoint: str, message: Chunk | Result, pack: bool = False) -> None:
        """``send`` for a Chunk or Result not yet encoded: a route served in this process
        takes the message itself (the door's own tasks: no encode and decode between the
        runner and the door, 1.3 us a reply here), any other its frame."""
        if self._local_messages and (take := self._local_messages.get(endpoint)) is not None:
            if not self._closed:
                take(message)
            return
        self.send(endpoint, encode(message), pack)

    def send_direct(self, endpoint: str, frame: bytes) -> None:
        """``frame`` to ``endpoint``'s socket even when its replies are relayed (a relayed
        reply that cannot go on its forwarder's connection)."""
        if not self._closed:
            self._send_by_socket(endpoint, frame, False)

    def _send_by_socket(self, endpoint: str, frame: bytes, pack: bool) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            address = None
            named = name_in(endpoint)
            if named is not None:  # (a host name: never given to libzmq, hostnames.py)
                address = self.names.address(named[0])
                if address is None or endpoint in self._awaiting:
                    self._await_name(endpoint, named, frame, pack)
                    return
                if address == FAILED:
                    self._dropped_undeliverable += 1
                    return
            try:
                peer = self._open(endpoint, address)
            except zmq.ZMQError as exc:
                # ZeroMQ refused the address (messages.endpoint_problem lets through only
                # what it takes; a refusal here is a gap in that check): the reply is
                # dropped and counted, and the daemon goes on.
                self._dropped_undeliverable += 1
                if FAILURE_LOG.allow():
                    log.warning("a reply address could not be connected to: reply dropped",
                                extra={"endpoint": endpoint[:200], "error": str(exc)})  # fmt: skip
                return
        if peer.queue:
            # Behind what waits: into the turn's batch, queued at the turn's end with its
            # packed runs kept (a slow reader is when packing saves the most).
            self._turn.send_now()  # (arms the turn's end)
        elif self._turn.send_now():
            self._pool.touch(_REPLY, endpoint)
            self._send_now(peer, [frame])
            return
        batch = peer.batch
        if not batch:
            # A use of the socket (LRU, idle close): once per turn, not per reply.
            self._pool.touch(_REPLY, endpoint)
            self._batched.append(peer)
        if not pack:
            batch.append(frame)
        elif batch and type(last := batch[-1]) is list:
            last.append(frame)
        else:
            batch.append([frame])

    def _await_name(self, endpoint: str, named: tuple[str, int], frame: bytes, pack: bool) -> None:
        """``frame`` waits for ``endpoint``'s host name to be looked up (bounded as a queue)."""
        awaiting = self._awaiting.get(endpoint)
        if awaiting is not None and len(awaiting.frames) >= self._queue_max:
            self._dropped_queue_full += 1
            return
        if self._queued_bytes + len(frame) > self._queue_bytes_max:
            self._dropped_queue_bytes += 1
            return
        if awaiting is None:
            awaiting = self._awaiting[endpoint] = _Awaiting()
            lookup = self._look_up(endpoint, named)
            if self._tg is not None:
                task = self._tg.create_task(lookup, name="reply-name")
            else:  # (not started: a test's sender)
                task = asyncio.ensure_future(lookup)
            self._lookups.add(task)  # (kept, and cancelled by stop)
            task.add_done_callback(self._lookups.discard)
        self._queued_bytes += len(frame)
        awaiting.frames.append((frame, pack))

    async def _look_up(self, endpoint: str, named: tuple[str, int]) -> None:
        """Look ``endpoint``'s host name up, then send what waited for it (or drop it)."""
        address = FAILED  # (a stop that cancels the lookup drops what waited)
        try:
            address = await self.names.look_up(*named)
        finally:
            awaiting = self._awaiting.pop(endpoint, None)
            if awaiting is not None:  # (else closed meanwhile: dropped there)
                self._after_lookup(endpoint, awaiting, address)

    def _after_lookup(self, endpoint: str, awaiting: _Awaiting, address: str) -> None:
        self._queued_bytes -= sum(len(frame) for frame, _ in awaiting.frames)
        if address == FAILED or self._closed:
            self._dropped_undeliverable += len(awaiting.frames)
        else:
            for frame, pack in awaiting.frames:  # (the name is known now: a socket opens)
                self._send_by_socket(endpoint, frame, pack)
        for callback in awaiting.waiters:
            self.when_sent(endpoint, callback)

    def when_sent(self, endpoint: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` once nothing sent to ``endpoint`` so far is held here any more:
        at once if nothing is, else right after the end of the turn sends the address's batch,
        or when its queue (a producer slow to read, or not connected) drains or is dropped.
        For a message that must not leave before a reply (the owner's TaskDone after the
        task's Result: a forwarder that forgot a task whose Result never left could not
        migrate it)."""
        awaiting = self._awaiting.get(endpoint)
        if awaiting is not None:
            awaiting.waiters.append(callback)
            return
        peer = self._peers.get(endpoint)
        if peer is None or not (peer.batch or peer.queue):
            callback()
        else:
            peer.waiters.append(callback)

    def _send_batches(self) -> None:
        """End of the loop turn: each address's replies, one message each, or into its queue."""
        batched, self._batched = self._batched, []
        for peer in batched:
            batch, peer.batch = peer.batch, []
            if not peer.sock.closed and batch:
                self._send_now(peer, batch)
            if peer.waiters and not peer.queue:
                peer.release_waiters()

    def _send_now(self, peer: _Peer, batch: list[bytes | list[bytes]]) -> None:
        """``batch``'s replies in order, each its own one-frame message (a packed run as
        Replies frames); what cannot go now into the address's queue, in order, a packed run
        as its Replies frames."""
        if not peer.queue:
            send = peer.sock.send
            done = 0
            try:
                for item in batch:
                    if type(item) is bytes:
                        send(item, NOBLOCK)
                        self._sent += 1
                    else:
                        self._send_packed(send, item)  # type: ignore[arg-type]
                    done += 1
                return
            except zmq.Again:
                batch = batch[done:]  # a packed run cut short holds only what did not go
        for item in batch:
            if type(item) is bytes:
                self._enqueue(peer, item)
            else:
                for group in replies_groups(item):  # type: ignore[arg-type]
                    self._enqueue(peer, replies_frame(group), len(group))

    def _send_packed(self, send: Callable[[bytes, int], Any], replies: list[bytes]) -> None:
        """A run of packed replies as Replies frames; on zmq.Again, ``replies`` is left
        holding those not sent, and it is raised."""
        groups = replies_groups(replies)
        for n, group in enumerate(groups):
            try:
                send(replies_frame(group), NOBLOCK)
            except zmq.Again:
                del replies[: sum(map(len, groups[:n]))]
                raise
            self._sent += len(group)

    def _enqueue(self, peer: _Peer, frame: bytes, replies: int = 1) -> None:
        """``frame`` (holding ``replies`` replies) behind what waits for ``peer``."""
        if len(peer.queue) >= self._queue_max:
            self._dropped_queue_full += replies
            return
        if self._queued_bytes + len(frame) > self._queue_bytes_max:
            self._dropped_queue_bytes += replies
            return
        self._queued_bytes += len(frame)
        peer.queue.append(frame)
        peer.queue_replies.append(replies)
        if peer.flusher is None and self._tg is not None:
            peer.flusher = self._tg.create_task(self._flush(peer), name="reply-flush")

    async def _flush(self, peer: _Peer) -> None:
        try:
            while peer.queue:
                if not await wait_events(peer.sock, POLLOUT, self._timeout_s):
                    self._queued_bytes -= sum(map(len, peer.queue))
                    dropped = peer.clear_queue()
                    self._dropped_undeliverable += dropped
                    log.warning(
                        "reply address does not accept messages; dropped them",
                        extra={"endpoint": peer.endpoint, "dropped": dropped},
                    )
                    if self._peers.get(peer.endpoint) is peer:
                        self._pool.close(SocketKind.REPLY, peer.endpoint, linger_ms=0)
                    return
                try:
                    while peer.queue:
                        peer.sock.send(peer.queue[0], NOBLOCK)
                        self._queued_bytes -= len(peer.queue.popleft())
                        self._sent += peer.queue_replies.popleft()
                except zmq.Again:
                    continue
        finally:
            peer.flusher = None
        if peer.waiters and not peer.batch:
            peer.release_waiters()

    def _on_socket_closed(self, endpoint: str, reason: CloseReason) -> None:
        """The pool closes ``endpoint``'s socket (evicted, idle, timed out or ours closing):
        what is still queued for it is dropped and counted."""
        peer = self._peers.pop(endpoint)
        if reason is CloseReason.EVICTED:
            self._evicted += 1
        elif reason is CloseReason.IDLE:
            self._closed_idle += 1
        if peer.flusher is not None:
            peer.flusher.cancel()
        self._dropped_undeliverable += peer.held()
        self._queued_bytes -= sum(map(len, peer.queue))
        peer.clear_queue()
        peer.batch.clear()
        peer.release_waiters()  # nothing is held for the address any more

    async def flush(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until every queued message has been handed to ZeroMQ."""
        self._send_batches()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._awaiting or any(p.queue for p in self._peers.values())) and (
            loop.time() < deadline
        ):
            await asyncio.sleep(0.01)

    def close(self, linger_ms: int = 2000) -> None:
        """Close every socket; ZeroMQ keeps trying to deliver sent messages for ``linger_ms``."""
        if not self._closed:
            self._send_batches()
        self._closed = True
        for awaiting in self._awaiting.values():  # (their lookups find nothing to send)
            self._dropped_undeliverable += len(awaiting.frames)
            self._queued_bytes -= sum(len(frame) for frame, _ in awaiting.frames)
            for callback in awaiting.waiters:
                callback()
        self._awaiting.clear()
        self._pool.close_kind(SocketKind.REPLY, linger_ms=linger_ms)

    def statistics(self) -> ReplyStatistics:
        return ReplyStatistics(
            sockets_open=len(self._peers),
            sent=self._sent,
            queued=sum(p.held() for p in self._peers.values())
            + sum(len(a.frames) for a in self._awaiting.values()),
            dropped_undeliverable=self._dropped_undeliverable,
            dropped_queue_full=self._dropped_queue_full,
            sockets_closed_idle=self._closed_idle,
            sockets_evicted=self._evicted,
            queued_bytes=self._queued_bytes,
            dropped_queue_bytes=self._dropped_queue_bytes,
        )
