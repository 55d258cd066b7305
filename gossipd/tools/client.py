"""The producer client: submit tasks to daemons, await results or iterate streamed chunks.

Delivery is at-least-once: a task with no answer after ``resubmit_after_s`` is sent again with
the same id (``attempt`` + 1, ``timeout_ms`` what is left of its deadline); the daemon's
de-duplication turns that into an exactly-once effect.  ``overloaded``, ``shutting_down``,
``over_budget`` and ``unavailable`` answers are retried after their retry-after hint while the
task's deadline allows (``retry_codes``; docs/PROTOCOL.md, "Error codes"): ``unavailable``
means no member took the task this time (e.g. every member tried had just died and was not
yet declared dead), and the retry is placed on what membership knows then.  Every task ends
with exactly one Result:
the daemon's, or a local ``deadline_exceeded`` one when the deadline passed with no answer.
A second final Result for an id can still arrive (a resubmitted task's cached Result, an owner
killed between its Result and its TaskDone, a hedged copy: docs/PROTOCOL.md, "Duplicate final
Results"); the first one resolves the task, later ones are dropped and counted
(``duplicate_results``).

Tasks submitted (or resent) in one turn of the event loop leave together at its end, packed
into Tasks frames (gossipd/tools/packing.py; a lone task as a plain Task): fewer frames to
encrypt under CURVE and to read at both ends.  A daemon older than Tasks frames refuses the
first one; the Client then resends its tasks at once, one frame each, and packs no more.

Usage::

    async with Client(["tcp://127.0.0.1:5557"]) as client:
        result = await client.run("hello world", max_tokens=8)
        handle = await client.submit("stream me", stream=True)
        async for delta in handle.deltas():
            print(delta, end="")
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from gossipd.core.codec import REPLY_FRAME_BYTES_MAX, decode_replies
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    TASK_ID_CHARS_MAX,
    Cancel,
    Chunk,
    ErrorCode,
    Result,
    Task,
    encode,
    error_result,
)
from gossipd.core.sampling import SamplingParams
from gossipd.errors import LocalProtocolError, RemoteProtocolError
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG
from gossipd.tools.client_parts import ClientStatistics, NotConnected, ProducerKeys, TaskHandle
from gossipd.tools.packing import PACK_BYTES_MAX, PackedTask, TaskPacker
from gossipd.zmqloop import NOBLOCK, POLLIN, POLLOUT, SocketReader, wait_events

log = logging.getLogger("gossipd.tools.client")

# (the public names of the producer library, those of client_parts.py included)
__all__ = [
    "DEFAULT_REPLY_BIND",
    "RETRYABLE_CODES",
    "Client",
    "ClientStatistics",
    "NotConnected",
    "ProducerKeys",
    "TaskHandle",
]

# A Result carries the whole output text; bound what one reply may make us hold.
REPLY_BYTES_MAX = REPLY_FRAME_BYTES_MAX
# The codes that mean "not now": the same id again after retry_after_ms, while the deadline
# allows (docs/PROTOCOL.md, "Error codes"); the last one is final at the deadline.
RETRYABLE_CODES = frozenset(
    {
        ErrorCode.OVERLOADED.value,
        ErrorCode.SHUTTING_DOWN.value,
        ErrorCode.OVER_BUDGET.value,
        ErrorCode.UNAVAILABLE.value,
    }
)
# Ids of resolved tasks remembered to tell a duplicate Result from one for an id never sent
# here (statistics only: a reply for an id not outstanding is dropped either way).
FINISHED_IDS_MAX = 65_536


# Replies on loopback: for daemons on this host; a producer elsewhere binds an address of its own.
DEFAULT_REPLY_BIND = "tcp://127.0.0.1:*"
# Frames queued in ZeroMQ for one connected daemon (its pipe; ZeroMQ's default is 1,000, and
# gossipd's was unlimited, so a stalled daemon's pipe grew with every resubmission): with
# packs of at most 64 KiB that is at most 64 MiB a daemon.  Past it the PUSH sends to another
# connected daemon, and with every pipe full frames wait here, in ``_unsent``, bounded in
# bytes.  Against 0 (unlimited): `gossipd submit` of 30,000 tasks, window 1,000, the same
# throughput within this machine's noise (19-26k tasks/s either way, packed or not).
SEND_FRAMES_PER_DAEMON_MAX = 1024
# Frames waiting here while no daemon takes them (none connected, or all stalled).  Over it
# the oldest task frames are dropped: their tasks' timers send them again (a resubmission
# repeats a task whose first copy may still be waiting here, so a long outage would otherwise
# pile up a copy per task every resubmit_after_s).  Cancels are never dropped.
UNSENT_BYTES_MAX = 64 * 1024 * 1024


class Client:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        reply_bind: str = DEFAULT_REPLY_BIND,
        ctx: zmq.Context | None = None,
        resubmit_after_s: float = 5.0,
        outstanding_max: int = 10_000,
        retry_codes: Iterable[str] = RETRYABLE_CODES,
        id_prefix: str | None = None,
        connect_timeout_s: float | None = None,
        curve: ProducerKeys | None = None,
        pack_tasks: bool = True,
        pack_bytes_max: int = PACK_BYTES_MAX,
        unsent_bytes_max: int = UNSENT_BYTES_MAX,
    ) -> None:
        """``connect_timeout_s``: entering ``async with`` waits until a connection to at
        least one endpoint is made, and raises ``NotConnected`` if none is within that long
        (None: do not wait; tasks wait, queued here, for a daemon to appear).  ``curve``:
        connect with CurveZMQ (the daemons run with ``security.curve``).  ``pack_tasks``:
        the tasks submitted (or resent) in one turn of the event loop leave together in
        Tasks frames (gossipd/tools/packing.py) of at most ``pack_bytes_max`` bytes (keep it
        at most the daemons' ``ingress.message_bytes_max``); it turns itself off for good
        when a daemon refuses a Tasks frame (one older than them).  ``unsent_bytes_max``:
        the frames waiting here while no daemon takes them, at most (the newest frame is
        kept even alone over it); the oldest task frames are dropped over it and their tasks
        go again at their resubmission timers."""
        if not endpoints:
            raise LocalProtocolError("a Client needs at least one daemon endpoint")
        if curve is not None and len(curve.server_keys) not in (1, len(endpoints)):
            raise LocalProtocolError(
                f"give one server key for all daemons or one per endpoint ({len(endpoints)}), "
                f"not {len(curve.server_keys)}"
            )
        self._curve = curve
        self._endpoints = list(endpoints)
        self._reply_bind = reply_bind
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._resubmit_after_s = resubmit_after_s
        self._slots = asyncio.Semaphore(outstanding_max)
        self._retry_codes = frozenset(retry_codes)
        self._prefix = id_prefix if id_prefix is not None else secrets.token_hex(6)
        self._counter = 0
        self._outstanding: dict[str, TaskHandle] = {}
        self._awaiting_slot: set[str] = set()  # ids submitted, waiting for a slot
        self._finished: OrderedDict[str, None] = OrderedDict()  # at most FINISHED_IDS_MAX
        self._push: zmq.Socket | None = None
        self._pull: zmq.Socket | None = None
        self._receiver: SocketReader | None = None
        # (frame, a task frame: droppable over unsent_bytes_max; Cancels are not)
        self._unsent: deque[tuple[bytes, bool]] = deque()
        self._unsent_bytes = 0
        self._unsent_bytes_max = unsent_bytes_max
        self._flusher: asyncio.Task[None] | None = None
        self._pack_tasks = pack_tasks
        self._pack_bytes_max = pack_bytes_max
        self._packer: TaskPacker | None = None  # made at open(), with our reply_to
        self.reply_to = ""
        self._stats = dict.fromkeys(ClientStatistics.__slots__, 0)
        self._connect_timeout_s = connect_timeout_s
        self._monitor: zmq.Socket | None = None  # the PUSH's connection events, until connected

    async def __aenter__(self) -> Client:
        self.open()
        if self._connect_timeout_s is not None:
            try:
                await self.wait_connected(self._connect_timeout_s)
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def open(self) -> None:
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, REPLY_BYTES_MAX)
        self._pull.setsockopt(zmq.LINGER, 0)
        # Every daemon that answers connects: a large cluster's at once past libzmq's 100
        # would have their SYNs dropped, and retried 1 s later (docs/PROTOCOL.md, Sockets).
        self._pull.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        curve = self._curve
        if curve is not None:
            self._pull.setsockopt(zmq.CURVE_SERVER, 1)
            self._pull.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            self._pull.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        self._pull.bind(self._reply_bind)
        self.reply_to = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._packer = TaskPacker(
            self._send_frame,
            reply_to=self.reply_to,
            id_prefix=self._prefix,
            enabled=self._pack_tasks,
            bytes_max=self._pack_bytes_max,
        )
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, SEND_FRAMES_PER_DAEMON_MAX)
        # Only hand tasks to daemons we are connected to: a dead daemon's pipe would otherwise
        # swallow its round-robin share until our resubmission timer fired.
        self._push.setsockopt(zmq.IMMEDIATE, 1)
        self._push.setsockopt(zmq.LINGER, 1000)
        if self._connect_timeout_s is not None:  # before connect(): see every connection
            self._monitor = self._push.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
        if curve is not None:
            self._push.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            self._push.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        for i, endpoint in enumerate(self._endpoints):
            if curve is not None:  # taken per connection, at connect
                self._push.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key(i))
            self._push.connect(endpoint)
        loop = asyncio.get_running_loop()
        self._receiver = SocketReader(
            self._pull, self._pull.recv, 512, lambda frames: self._on_replies(frames, loop)
        )

    async def wait_connected(self, timeout_s: float) -> None:
        """Return once a connection to some endpoint is ready (a ZeroMQ socket monitor's
        HANDSHAKE_SUCCEEDED event on our PUSH: a connection whose handshake fails, CURVE keys
        missing or not the daemon's, carries nothing); raise
        ``NotConnected`` if none is made within ``timeout_s``, saying which of the two it
        was.  Needs ``connect_timeout_s`` set (the monitor starts before connect)."""
        monitor = self._monitor
        if monitor is None:
            raise LocalProtocolError("wait_connected() needs a Client made with connect_timeout_s")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        ready = zmq.EVENT_HANDSHAKE_SUCCEEDED  # (libzmq 4.3 says it for NULL too)
        connected = False
        try:
            while True:
                try:
                    event = parse_monitor_message(monitor.recv_multipart(NOBLOCK))
                except zmq.Again:
                    left_s = deadline - loop.time()
                    if left_s <= 0 or not await wait_events(monitor, POLLIN, left_s):
                        raise NotConnected(
                            self._endpoints, timeout_s, handshake=connected,
                            curve=self._curve is not None,
                        ) from None  # fmt: skip
                    continue
                connected = connected or event["event"] == zmq.EVENT_CONNECTED
                if event["event"] == ready:
                    return
        finally:
            self._stop_monitor()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            if self._push is not None:
                self._push.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    async def close(self) -> None:
        self._stop_monitor()
        if self._packer is not None:
            self._packer.close()
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._receiver is not None:
            self._receiver.close()  # before the socket closes
            self._receiver = None
        for handle in list(self._outstanding.values()):  # (awaited results must not hang)
            why = "the Client was closed before the task's result came"
            self._complete(handle, error_result(handle.id, ErrorCode.CANCELLED, why, node="client"))
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._pull = None
        if self._own_ctx:
            self._ctx.term()

    def new_id(self) -> str:
        self._counter += 1
        return f"{self._prefix}-{self._counter}"

    async def submit(
        self,
        prompt: str,
        *,
        task_id: str | None = None,
        key: str = "",
        params: SamplingParams | None = None,
        max_tokens: int | None = None,
        timeout_s: float = 30.0,
        stream: bool = False,
        model: str = "",
    ) -> TaskHandle:
        """Send a task; returns at once with its handle (waits only for a free slot).  The
        task leaves at the end of this loop turn, with the others submitted in it."""
        if params is None:
            params = (
                SamplingParams() if max_tokens is None else SamplingParams(max_tokens=max_tokens)
            )
        task = Task(
            v=PROTOCOL_VERSION,
            id=self.new_id() if task_id is None else task_id,
            key=key,
            prompt=prompt,
            params=params,
            reply_to=self.reply_to,
            timeout_ms=max(1, int(timeout_s * 1000)),
            stream=stream,
            model=model,
            batch_replies=True,
        )
        return await self.submit_task(task)

    async def submit_task(self, task: Task) -> TaskHandle:
        if self._push is None:
            raise LocalProtocolError("open the Client (async with) before submitting")
        if task.id in self._outstanding or task.id in self._awaiting_slot:
            raise LocalProtocolError(f"task id {task.id!r} is already outstanding")
        if not 1 <= len(task.id) <= TASK_ID_CHARS_MAX:  # the daemon would refuse it unanswerably
            raise LocalProtocolError(
                f"task id of {len(task.id)} characters: ids are 1..{TASK_ID_CHARS_MAX} characters"
            )
        assert self._packer is not None
        if task.id.startswith(self._packer.pack_id_prefix):
            raise LocalProtocolError(
                f"task id {task.id!r}: ids starting with {self._packer.pack_id_prefix!r} are "
                'this Client\'s Tasks frame ids (docs/PROTOCOL.md, "Tasks"); choose another'
            )
        # (its id taken while it waits for a slot: a second submit of it is refused, not
        # let in to overwrite this one)
        self._awaiting_slot.add(task.id)
        try:
            await self._slots.acquire()
        finally:
            self._awaiting_slot.discard(task.id)
        loop = asyncio.get_running_loop()
        handle = TaskHandle(task, loop)
        self._outstanding[task.id] = handle
        self._stats["submitted"] += 1
        self._send(task)
        self._arm(handle, loop)
        return handle

    async def run(self, prompt: str, **kwargs: object) -> Result:
        handle = await self.submit(prompt, **kwargs)  # type: ignore[arg-type]
        return await handle.result()

    async def cancel(self, task_id: str) -> bool:
        """Ask the daemons to cancel a task: it is aborted in the engine and its result is
        ``cancelled`` (or whatever it finished with first).  It is no longer resubmitted; the
        handle resolves when that result arrives, or at the task's deadline.  False: not
        outstanding here."""
        handle = self._outstanding.get(task_id)
        if handle is None or handle.done():
            return False
        if handle._timer is not None:
            handle._timer.cancel()
        handle.cancelled = True
        backing_off = handle.backing_off
        assert self._packer is not None
        self._packer.flush()  # the task, if packed in this turn, goes before its Cancel
        # PUSH spreads messages round robin over the connected daemons; one copy per endpoint
        # reaches the daemon that took the task (the others count it as unknown).
        cancel = encode(Cancel(v=PROTOCOL_VERSION, id=task_id))
        for _ in self._endpoints:
            self._send_frame(cancel, droppable=False)
        self._stats["cancelled"] += 1
        if backing_off:  # refused, waiting to go again: no daemon took it (a copy sent before
            # the refusal and still running elsewhere has the Cancels above)
            why = "cancelled before any daemon took it (it waited out a refusal's retry hint)"
            self._complete(handle, error_result(task_id, ErrorCode.CANCELLED, why, node="client"))
        else:
            deadline = _local_deadline(handle)
            handle._timer = asyncio.get_running_loop().call_at(
                deadline, self._on_timer, handle, deadline
            )
        return True

    def _arm(
        self, handle: TaskHandle, loop: asyncio.AbstractEventLoop, delay_s: float | None = None
    ) -> None:
        deadline = _local_deadline(handle)
        wake = loop.time() + (self._resubmit_after_s if delay_s is None else delay_s)
        handle._timer = loop.call_at(min(wake, deadline), self._on_timer, handle, deadline)

    def _on_timer(self, handle: TaskHandle, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if handle.done():
            return
        if loop.time() >= deadline:
            self._stats["local_deadline_exceeded"] += 1
            self._complete(
                handle,
                error_result(
                    handle.id,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"no result within the deadline after {handle.attempts} attempt(s)",
                    node="client",
                ),
            )
            return
        self._stats["resubmitted"] += 1
        # Alone, never packed: if its pack was lost unanswered (a frame ZeroMQ dropped as
        # over the daemon's size limit, a connection that broke), this one gets through.
        self._resend(handle, loop, alone=True)

    def _resend(
        self,
        handle: TaskHandle,
        loop: asyncio.AbstractEventLoop,
        delay_s: float | None = None,
        *,
        alone: bool = False,
    ) -> None:
        handle.attempts += 1
        handle.backing_off = False
        # Tasks are immutable: copy with the new attempt number, and what is left of the
        # deadline (timeout_ms counts from a daemon's receipt, and the daemon decides by it
        # whether the task can still wait in its queue).
        remaining_ms = max(1, int((handle.deadline - loop.time()) * 1000))
        handle.task = msgspec.structs.replace(
            handle.task, attempt=min(handle.attempts - 1, 1000), timeout_ms=remaining_ms
        )
        self._send(handle.task, alone=alone)
        self._arm(handle, loop, delay_s)

    def _send(self, task: Task, *, alone: bool = False) -> None:
        """Hand a task to the packer: it leaves at the end of this loop turn (``alone``: now,
        as a frame of its own)."""
        assert self._packer is not None
        self._packer.add((task.id, task.attempt), encode(task), alone=alone)

    def _send_frame(self, frame: bytes, *, droppable: bool = True) -> None:
        """Hand a message to ZeroMQ, or queue it here while no daemon takes it (the socket
        only sends to connected daemons, SEND_FRAMES_PER_DAEMON_MAX frames queued for each);
        never blocks the caller."""
        assert self._push is not None
        self._stats["frames_sent"] += 1
        if not self._unsent:
            try:
                self._push.send(frame, NOBLOCK)
                return
            except zmq.Again:
                pass
        self._make_room(len(frame))
        self._unsent.append((frame, droppable))
        self._unsent_bytes += len(frame)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_unsent())

    def _make_room(self, size: int) -> None:
        """Drop the oldest task frames until ``size`` more bytes fit in unsent_bytes_max (the
        Cancels among them kept, in order)."""
        unsent = self._unsent
        kept: list[tuple[bytes, bool]] = []
        while unsent and self._unsent_bytes + size > self._unsent_bytes_max:
            frame, droppable = unsent.popleft()
            if droppable:
                self._unsent_bytes -= len(frame)
                self._stats["unsent_frames_dropped"] += 1
            else:
                kept.append((frame, droppable))
        unsent.extendleft(reversed(kept))

    async def _flush_unsent(self) -> None:
        assert self._push is not None
        while self._unsent:
            frame = self._unsent[0][0]
            try:
                self._push.send(frame, NOBLOCK)
            except zmq.Again:
                await wait_events(self._push, POLLOUT)
                continue
            self._unsent.popleft()
            self._unsent_bytes -= len(frame)

    def _complete(self, handle: TaskHandle, result: Result) -> None:
        self._outstanding.pop(handle.id, None)
        self._finished[handle.id] = None
        if len(self._finished) > FINISHED_IDS_MAX:
            self._finished.popitem(last=False)
        self._stats["completed"] += 1
        self._slots.release()
        handle._resolve(result)

    def _on_replies(self, frames: list[bytes], loop: asyncio.AbstractEventLoop) -> None:
        for frame in frames:
            self._on_reply(frame, loop)

    def _on_reply(self, frame: bytes, loop: asyncio.AbstractEventLoop) -> None:
        """One frame: a Chunk or Result, or a Replies frame of several (our tasks set
        ``batch_replies``: fewer frames, each encrypted on its own under CURVE)."""
        try:
            replies = decode_replies(frame)
        except RemoteProtocolError as exc:
            self._stats["bad_replies"] += 1
            log.warning("undecodable reply", extra={"hint": exc.hint[:200]})
            return
        for reply in replies:
            self._on_one_reply(reply, loop)

    def _on_one_reply(self, reply: Chunk | Result, loop: asyncio.AbstractEventLoop) -> None:
        if type(reply) is Result and reply.error is not None and self._packer is not None:
            refused = self._packer.refused(reply)  # a bad_request for a pack id of ours
            if refused is not None:
                self._resend_refused(refused, loop)
                return
        handle = self._outstanding.get(reply.id)
        if handle is None:
            if type(reply) is Result and reply.id in self._finished:
                self._stats["duplicate_results"] += 1  # the first one resolved the task
            else:
                self._stats["unknown_replies"] += 1  # a late chunk, or an id never sent here
            return
        if isinstance(reply, Chunk):
            if not handle._on_chunk(reply):
                self._stats["duplicate_replies"] += 1
            return
        code = reply.error.code if reply.error is not None else ""
        deadline = handle.deadline
        retry_s = (reply.error.retry_after_ms / 1000.0) if reply.error is not None else 0.0
        retry = code in self._retry_codes and not handle.cancelled
        if retry and loop.time() + retry_s < deadline:
            self._stats["retried"] += 1
            if handle._timer is not None:
                handle._timer.cancel()
            handle.backing_off = True
            handle._timer = loop.call_later(max(retry_s, 0.001), self._resend, handle, loop, None)
            return
        self._complete(handle, reply)

    def _resend_refused(self, tasks: list[PackedTask], loop: asyncio.AbstractEventLoop) -> None:
        """A daemon refused the Tasks frame these tasks were in (it takes no Tasks frames):
        send each again now, alone, rather than at its resubmission timer, unless it was sent
        again since (another attempt is under way) or its deadline passed (its timer ends
        it).  A task cancelled since never reached a daemon: it ends here, ``cancelled``."""
        for task_id, attempt in tasks:
            handle = self._outstanding.get(task_id)
            if handle is None or handle.done() or handle.task.attempt != attempt:
                continue
            if loop.time() >= handle.deadline:
                continue
            if handle._timer is not None:
                handle._timer.cancel()
            if handle.cancelled:
                why = "cancelled before any daemon took it (its Tasks frame was refused)"
                self._complete(
                    handle, error_result(task_id, ErrorCode.CANCELLED, why, node="client")
                )
            else:
                self._resend(handle, loop)

    def statistics(self) -> ClientStatistics:
        packer = self._packer
        packing = {
            "packs_sent": packer.packs_sent if packer else 0,
            "tasks_packed": packer.tasks_packed if packer else 0,
            "packs_refused": packer.packs_refused if packer else 0,
        }
        now = {"outstanding": len(self._outstanding), "unsent_bytes": self._unsent_bytes}
        return ClientStatistics(**{**self._stats, **packing, **now})


def _local_deadline(handle: TaskHandle) -> float:
    """When the client gives up on a task (loop time): its deadline plus a second, which
    leaves the daemon time to report deadline_exceeded itself."""
    return handle.deadline + 1.0
