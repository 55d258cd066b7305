"""A producer's tasks packed into Tasks frames (docs/PROTOCOL.md, "Tasks").

The tasks handed to a ``TaskPacker`` in one turn of the event loop leave together, at the
end of that turn (``loop.call_soon``: no timer, no latency beyond the turn), as one Tasks
frame, or as a few when they exceed ``bytes_max`` or ``items_max``; a lone task leaves as
the plain Task frame it is, so light load adds no bytes.  Why: under CURVE ZeroMQ encrypts
every frame and the daemon reads every frame's producer key (together about 2 us of CPU a
frame on a 2-core VM), so 32 tasks in one frame cost that once instead of 32 times.

Each Tasks frame carries an ``id`` of its own (a pack id, never a task id) and the
producer's ``reply_to``.  A daemon that takes Tasks frames ignores both; one that does not
(older than ``t`` = 6) answers the frame ``bad_request`` for that id.  ``refused`` tells the
owner which tasks such a pack held, and packing stops for good: from then on every task
leaves as a frame of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

from gossipd.core.codec import pack_tasks
from gossipd.core.messages import ErrorCode, Result

log = logging.getLogger("gossipd.tools.packing")

# Well under the daemons' default ingress.message_bytes_max (1 MiB).  A daemon refuses a
# frame over its limit with bad_request (the Client then stops packing), but ZeroMQ drops one
# over four times the limit with the connection, unanswered: at 64 KiB that needs a limit set
# below 16 KiB (the Client's pack_bytes_max is for such a cluster; a timer's resubmission
# goes alone, so a dropped pack's tasks still arrive).
PACK_BYTES_MAX = 64 * 1024
# Items in one pack: at 32 the per-frame cost is already 1/32 a task, and a turn's tasks leave
# in several frames, so the daemon starts on the first while the producer still encodes the
# rest.  Measured (scripts/client_packing.py's loop, 2-core VM, load ~1.3): 200 tasks gathered
# at a time ran 1.27x (plain) and 1.32x (CURVE) the throughput of one frame a task with 32,
# but 1.01x and 1.02x with 256 (no overlap: the daemon idled while the Client built the pack);
# `gossipd submit` (a sliding window of 1000) gained 1.17x with either.
PACK_ITEMS_MAX = 32
# Packs whose task ids are remembered, to resend them when a daemon refuses the pack.
PACKS_REMEMBERED_MAX = 1024
# A pack id is at most the 128 characters of a task id (docs/PROTOCOL.md): the prefix is cut.
_PREFIX_CHARS_MAX = 64


# A packed task: its id and its attempt number (``Task.attempt``), so that a refused pack's
# task is resent only if it was not sent again since.
PackedTask = tuple[str, int]


class TaskPacker:
    """Packs the encoded tasks handed to ``add`` in one loop turn; ``send_frame`` sends a
    frame (the owner's, never blocking).  ``enabled=False``: every task goes alone."""

    def __init__(
        self,
        send_frame: Callable[[bytes], None],
        *,
        reply_to: str,
        id_prefix: str,
        enabled: bool = True,
        bytes_max: int = PACK_BYTES_MAX,
        items_max: int = PACK_ITEMS_MAX,
        remembered_max: int = PACKS_REMEMBERED_MAX,
    ) -> None:
        self._send_frame = send_frame
        self._reply_to = reply_to
        self._id_prefix = f"{id_prefix[:_PREFIX_CHARS_MAX]}-pack-"
        self.enabled = enabled
        self._bytes_max = bytes_max
        self._items_max = items_max
        self._remembered_max = remembered_max
        self._tasks: list[PackedTask] = []
        self._frames: list[bytes] = []
        self._bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._recent: OrderedDict[str, list[PackedTask]] = OrderedDict()  # pack id -> tasks
        self.packs_sent = 0
        self.tasks_packed = 0
        self.packs_refused = 0

    @property
    def pack_id_prefix(self) -> str:
        """Every pack id starts with it; no task id of the owner's may (``refused``)."""
        return self._id_prefix

    def add(self, task: PackedTask, frame: bytes, *, alone: bool = False) -> None:
        """Send this encoded task (``task``: its id and attempt) at the end of the loop's
        turn, packed with the others; ``alone``: now, as a frame of its own (after what was
        added before it)."""
        if alone or not self.enabled or len(frame) > self._bytes_max:
            self.flush()  # what was added before leaves before it
            self._send_frame(frame)
            return
        if self._frames and (
            self._bytes + len(frame) > self._bytes_max or len(self._frames) >= self._items_max
        ):
            self.flush()
        self._tasks.append(task)
        self._frames.append(frame)
        self._bytes += len(frame)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what was added now (before a message that must not overtake it)."""
        tasks, frames = self._take()
        if not frames:
            return
        if len(frames) == 1:
            self._send_frame(frames[0])
            return
        self.packs_sent += 1
        self.tasks_packed += len(frames)
        pack_id = f"{self._id_prefix}{self.packs_sent}"
        self._recent[pack_id] = tasks
        if len(self._recent) > self._remembered_max:
            self._recent.popitem(last=False)
        self._send_frame(pack_tasks(frames, pack_id=pack_id, reply_to=self._reply_to))

    def close(self) -> None:
        """Drop what was not sent yet (the owner is closing its sockets)."""
        self._take()

    def _take(self) -> tuple[list[PackedTask], list[bytes]]:
        """The tasks and frames added since the last flush; empties the pack."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        taken = self._tasks, self._frames
        self._tasks, self._frames, self._bytes = [], [], 0
        return taken

    def refused(self, result: Result) -> list[PackedTask] | None:
        """If ``result`` refuses one of our recent packs (``bad_request`` for its pack id):
        stop packing for good and return the tasks it held (id, attempt), to be resent one
        frame each.  None: it is no answer to a pack of ours."""
        if result.error is None or result.error.code != ErrorCode.BAD_REQUEST.value:
            return None
        tasks = self._recent.pop(result.id, None)
        if tasks is None:
            return None
        self.packs_refused += 1
        if self.enabled:
            self.enabled = False
            for frame in self._take()[1]:  # a pack begun in this turn leaves as single frames
                self._send_frame(frame)
            log.warning(
                "a daemon refused a Tasks frame (t = 6) with bad_request: it does not take "
                "them (a daemon older than Tasks frames) or not this one; sending one frame "
                "per task from now on, and the refused frame's tasks again at once",
                extra={"node": result.node, "hint": result.error.message[:300]},
            )
        return tasks
