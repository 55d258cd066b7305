"""What a producer's Client hands out and reports, beside it (gossipd/tools/client.py): the
handle of one submitted task, the Client's statistics, its CURVE keys, and the error that no
daemon could be reached.  ``gossipd.tools.client`` exports them too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from gossipd.core.messages import Chunk, Result, Task
from gossipd.errors import LocalProtocolError
from gossipd.keyfiles import KeyFileError, read_key_file


class NotConnected(ConnectionError):
    """No daemon accepted a connection at any of the endpoints within the wait: nothing
    listens there (or it is unreachable)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout_s: float,
        *,
        handshake: bool = False,
        curve: bool = False,
    ) -> None:
        """``handshake``: a connection was made, but no handshake completed on it (``curve``:
        this producer gave keys)."""
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        where = ", ".join(endpoints)
        if handshake and curve:
            super().__init__(
                f"{where} accepts connections but no CURVE handshake completed within "
                f"{timeout_s:g} s: is --server-key that daemon's NODE.key, and this "
                "producer's NAME.key in its security.producer_keys_dir?"
            )
            return
        if handshake:
            super().__init__(
                f"{where} accepts connections but no handshake completed within "
                f"{timeout_s:g} s: if the daemon runs with security.curve, give --secret-key "
                "FILE and --server-key FILE (or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY)"
            )
            return
        super().__init__(
            f"no daemon at {where}: no connection within {timeout_s:g} s (nothing listens "
            "there, or it is unreachable); start one with `gossipd run` or give the right "
            "--endpoint"
        )


class TaskHandle:
    """One submitted task.  ``result()`` waits for its final Result; with ``stream=True``,
    ``deltas()`` yields its text in order, each piece once, even across resubmissions."""

    __slots__ = (
        "_buffered",
        "_deltas",
        "_next_seq",
        "_result",
        "_timer",
        "attempts",
        "backing_off",
        "cancelled",
        "deadline",
        "submitted_at",
        "task",
    )

    def __init__(self, task: Task, loop: asyncio.AbstractEventLoop) -> None:
        self.task = task
        self.attempts = 1
        self.cancelled = False  # cancel() was called: never sent again
        # Refused with a retry hint and waiting it out: no daemon holds it now (a Cancel
        # then ends it here).
        self.backing_off = False
        self.submitted_at = loop.time()
        self.deadline = self.submitted_at + task.timeout_ms / 1000.0  # loop time
        self._result: asyncio.Future[Result] = loop.create_future()
        self._deltas: asyncio.Queue[str | None] | None = asyncio.Queue() if task.stream else None
        self._next_seq = 0
        self._buffered: dict[int, str] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def id(self) -> str:
        return self.task.id

    def done(self) -> bool:
        return self._result.done()

    async def result(self) -> Result:
        return await asyncio.shield(self._result)

    async def deltas(self) -> AsyncIterator[str]:
        if self._deltas is None:
            raise LocalProtocolError("deltas() needs a task submitted with stream=True")
        while True:
            delta = await self._deltas.get()
            if delta is None:
                return
            yield delta

    def _on_chunk(self, chunk: Chunk) -> bool:
        """Deliver in order; False for a duplicate chunk."""
        if self._deltas is None or chunk.seq < self._next_seq or chunk.seq in self._buffered:
            return False
        self._buffered[chunk.seq] = chunk.delta
        while self._next_seq in self._buffered:
            self._deltas.put_nowait(self._buffered.pop(self._next_seq))
            self._next_seq += 1
        return True

    def _resolve(self, result: Result) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._result.done():
            self._result.set_result(result)
        if self._deltas is not None:
            self._deltas.put_nowait(None)


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    submitted: int
    outstanding: int
    resubmitted: int
    retried: int
    completed: int
    duplicate_replies: int  # Chunks already delivered (a resubmission or a migration)
    duplicate_results: int  # Results for a task already resolved: the first one was kept
    unknown_replies: int  # for an id not outstanding and not resolved lately
    bad_replies: int
    local_deadline_exceeded: int
    cancelled: int
    frames_sent: int  # every frame handed to the PUSH socket (or queued until connected)
    packs_sent: int  # Tasks frames (several tasks in one frame: docs/PROTOCOL.md, "Tasks")
    tasks_packed: int  # tasks that left inside a Tasks frame
    packs_refused: int  # Tasks frames a daemon refused: their tasks were resent one a frame
    unsent_bytes: int  # frames waiting here for a daemon to take them (now)
    unsent_frames_dropped: int  # oldest task frames dropped over unsent_bytes_max (resent later)


@dataclass(frozen=True, slots=True)
class ProducerKeys:
    """CurveZMQ for a producer: its key pair (z85), which the daemons must have authorised,
    and each daemon's public key.  The reply socket is served with the same key pair: the
    daemons deliver results only to the holder of the key that submitted the task."""

    public: bytes
    secret: bytes
    server_keys: Sequence[bytes]  # one per endpoint, in order; or one for all

    @classmethod
    def from_files(cls, secret_key_file: str, server_key_files: Sequence[str]) -> ProducerKeys:
        """From ``NAME.key_secret`` (``gossipd keygen``) and the daemons' ``NODE.key`` files."""
        public, secret = read_key_file(secret_key_file)
        if not secret:
            raise KeyFileError(
                f"{secret_key_file!r} holds no secret key: give the NAME.key_secret file, "
                "not NAME.key"
            )
        servers = [read_key_file(path)[0] for path in server_key_files]
        return cls(public=public, secret=secret, server_keys=servers)

    def server_key(self, index: int) -> bytes:
        if len(self.server_keys) == 1:
            return self.server_keys[0]
        return self.server_keys[index]
