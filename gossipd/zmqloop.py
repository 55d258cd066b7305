"""ZeroMQ on the asyncio loop: readiness waits and batched receive (the reply sender, which
sends on the same sockets, is gossipd/replysender.py).

We drive plain (non-asyncio) pyzmq sockets ourselves: the loop watches each socket's ZMQ_FD
and we drain with NOBLOCK calls.  That costs no Future per message, which matters at tens of
thousands of messages per second on two cores.

ZMQ_FD is edge-triggered: it signals "look at ZMQ_EVENTS again", not "readable".  So a reader
goes back to waiting only after a read of ZMQ_EVENTS that found nothing to read, and also
re-checks (every ``RECHECK_S`` in a wait, every ``READER_RECHECK_S`` in a long-lived reader)
in case another call on the same socket consumed the signal; a send on a socket that a
reader watches calls ``kick``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import zmq

from gossipd.ops.logs import HANDLER_FAILURES, RateLimiter, handler_name
from gossipd.sockets import SocketKind

log = logging.getLogger("gossipd.zmqloop")

# Plain ints for the per-message paths: pyzmq's enum members make every `&` a Flag operation
# (an EVENTS check measured 5.6 us with them, 3.5 us with ints).
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)
_REPLY = SocketKind.REPLY  # read per reply: a global (see core/admission.py on enums)

RECHECK_S = 0.05
# A long-lived reader's safety net only (kick() covers our own sends, and
# tests/test_zmqloop.py sees every message with the recheck pushed out to 60 s): each
# reader's recheck is a wake-up of an idle daemon, 20 a second each at RECHECK_S.
READER_RECHECK_S = 1.0


def int_option(sock: zmq.Socket) -> Callable[[int], int]:
    """``sock.getsockopt`` for the integer options read here (EVENTS, FD): pyzmq types it
    as returning int or bytes."""
    return cast(Callable[[int], int], sock.getsockopt)


async def wait_events(sock: zmq.Socket, mask: int, timeout_s: float | None = None) -> bool:
    """Wait until ``sock``'s ZMQ_EVENTS has a bit of ``mask``; False on timeout."""
    option = int_option(sock)
    if option(EVENTS) & mask:
        return True
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    fd = option(zmq.FD)
    while True:
        wait_s = RECHECK_S if deadline is None else min(RECHECK_S, deadline - loop.time())
        if wait_s <= 0:
            return False
        # One future per wait, resolved by the fd or by the recheck timer (no Task, no
        # asyncio.wait_for: this runs once per idle-to-busy transition of every socket).
        fut: asyncio.Future[None] = loop.create_future()
        wake = _resolver(fut)
        loop.add_reader(fd, wake)
        timer = loop.call_later(wait_s, wake)
        _waiters[id(sock)] = wake
        try:
            await fut
        finally:
            timer.cancel()
            loop.remove_reader(fd)
            if _waiters.get(id(sock)) is wake:
                del _waiters[id(sock)]
        if option(EVENTS) & mask:
            return True


# The wake-up of whoever waits on a socket, so that a send on that socket from elsewhere can
# re-check it: a send may consume the edge-triggered ZMQ_FD signal meant for the waiter.
_waiters: dict[int, Callable[[], None]] = {}


def kick(sock: zmq.Socket) -> None:
    """Call after sending on a socket that another coroutine waits to read."""
    wake = _waiters.get(id(sock))
    if wake is not None:
        wake()


def _resolver(fut: asyncio.Future[None]):
    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    return wake


# A handler that fails for every message, or reply addresses that cannot be connected to
# (replysender.py), must not flood the log: one budget for both lines.
FAILURE_LOG = RateLimiter(per_s=1.0, burst=5)


class SocketReader:
    """Reads a socket inside the loop's fd callback: when ZMQ_FD fires, up to ``batch_max``
    queued messages (read by ``recv``, the socket's recv or recv_multipart) go to
    ``on_messages`` right there, with no future and no task wake-up between the socket and
    the handler.  One message one way, DEALER to ROUTER at 1 ms spacing, measured here:
    151-157 us to this reader against 174-177 us to a task woken through a future.

    For handlers that never wait (they queue work for tasks).  A full batch leaves the rest
    for a later turn, so other callbacks and tasks run in between.  An exception from the
    handler is logged and the reader goes on."""

    def __init__(
        self,
        sock: zmq.Socket,
        recv: Callable[[int], Any],
        batch_max: int,
        on_messages: Callable[[list[Any]], None],
        batch_bytes_max: int = 0,
    ) -> None:
        self._sock = sock
        self._option = option = int_option(sock)
        self._recv = recv
        self._batch_max = batch_max
        # With single-frame recv: also stop a batch once it holds this many bytes (0: no
        # limit), so that a burst of large messages is not all held at once while handled.
        self._batch_bytes_max = batch_bytes_max
        self._on_messages = on_messages
        self._handler = handler_name(on_messages)
        self._loop = asyncio.get_running_loop()
        self._fd = option(zmq.FD)
        self._closed = False
        self._soon = False  # a read is queued with call_soon
        self.handler_failures = 0  # batches whose handler raised (a bug; logged)
        self._loop.add_reader(self._fd, self._read)
        # A send on this socket may consume the fd's signal (kick() calls this), and the
        # recheck covers any other call that does.
        _waiters[id(sock)] = self._look
        self._recheck = self._loop.call_later(READER_RECHECK_S, self._on_recheck)
        self._read_soon()  # what came before the fd was registered

    def _read_soon(self) -> None:
        if not self._soon:
            self._soon = True
            self._loop.call_soon(self._read_queued)

    def _read_queued(self) -> None:
        self._soon = False
        self._read()

    def _on_recheck(self) -> None:
        self._recheck = self._loop.call_later(READER_RECHECK_S, self._on_recheck)
        self._look()

    def _look(self) -> None:
        """Read soon if a message waits.  An EVENTS read (3.5 us), not a recv that would end
        in zmq.Again (7.9 us): this runs after every send on the socket (kick) and 20 times a
        second for an idle one; it also re-arms the fd."""
        if not self._closed and self._option(EVENTS) & POLLIN:
            self._read_soon()

    def _read(self) -> None:
        if self._closed:
            return
        option, recv = self._option, self._recv
        try:
            first = recv(NOBLOCK)
        except zmq.Again:
            self._look()  # nothing to read (the fd fired for another event): re-arm it
            return
        # A lone message, the common case below saturation, ends with an EVENTS read (3.5 us)
        # that also re-arms the fd, not with a zmq.Again exception (7.9 us) and that read.
        more = False
        if option(EVENTS) & POLLIN:
            if self._batch_bytes_max:
                messages = _drain_bytes(recv, [first], self._batch_max, self._batch_bytes_max)
            else:
                messages = _drain(recv, [first], self._batch_max)
            # A full batch may leave more behind; one that ended on zmq.Again needs the
            # EVENTS read to re-arm the fd (and it may show a message that came meanwhile).
            more = len(messages) >= self._batch_max or bool(option(EVENTS) & POLLIN)
        else:
            messages = [first]
        try:
            self._on_messages(messages)
        except Exception:
            self.handler_failures += 1
            HANDLER_FAILURES[self._handler] += 1
            if FAILURE_LOG.allow():
                log.exception(
                    "a socket reader's handler failed; reading on",
                    extra={"suppressed_since_last": FAILURE_LOG.take_suppressed()},
                )
        if more:
            # Queued after what the handler woke (workers), so that they run first: results
            # flow while input floods in.
            self._read_soon()

    def close(self) -> None:
        """Stop reading (before the socket is closed)."""
        if self._closed:
            return
        self._closed = True
        self._recheck.cancel()
        self._loop.remove_reader(self._fd)
        if _waiters.get(id(self._sock)) == self._look:
            del _waiters[id(self._sock)]


async def recv_batch(sock: zmq.Socket, batch_max: int) -> list[bytes]:
    """Wait for at least one message, then return up to ``batch_max`` queued ones."""
    while True:
        frames: list[bytes] = _drain(sock.recv, [], batch_max)
        if frames:
            return frames
        await wait_events(sock, POLLIN)


def _drain_bytes(
    recv: Callable[[int], bytes], into: list[bytes], batch_max: int, bytes_max: int
) -> list[bytes]:
    """``_drain`` that also stops once ``into`` holds ``bytes_max`` bytes."""
    size = sum(map(len, into))
    try:
        while len(into) < batch_max and size < bytes_max:
            frame = recv(NOBLOCK)
            into.append(frame)
            size += len(frame)
    except zmq.Again:
        pass
    return into


def _drain(recv: Callable[[int], Any], into: list[Any], batch_max: int) -> list[Any]:
    """Append queued messages to ``into`` until it holds ``batch_max`` or none is left."""
    try:
        while len(into) < batch_max:
            into.append(recv(NOBLOCK))
    except zmq.Again:
        pass
    return into
