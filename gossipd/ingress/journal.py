"""The local journal of accepted tasks: the only durable state a daemon keeps.

Append-only records, one MessagePack array each: [1, task bytes] when a task is accepted,
[4, MessagePack [task id, deadline]] right after it (from 0.3.0: its deadline in
milliseconds since the epoch, by this host's clock, so that a restart keeps it instead of
giving the task its whole timeout again), [3, MessagePack [task id, forwarder]] after them
when a peer forwarded it (after a restart that forwarder's Withdraw is honoured, since it may
have migrated the task while we were down, and it gets the TaskDone), [2, task id] when its
final result was sent.  Writes are buffered and
made durable in batches (flush + fsync every ``fsync_interval_s``, off the event loop), so a
crash loses at most that window of acceptances; the producer's resubmission covers that
window.  When the file passes ``compact_bytes`` it is rewritten with only the unfinished
tasks (write, fsync, rename).
On start-up ``replay`` returns the tasks accepted but never finished, to run again.
A torn last record (crash mid-write) is ignored; a record of a kind this version does not
know (written by a later one) is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import msgspec

from gossipd.core.messages import Task, encode

log = logging.getLogger("gossipd.ingress.journal")

ACCEPT, DONE, FORWARDED, DEADLINE = 1, 2, 3, 4
SYNC_RETRY_S = 1.0  # after a sync the file system refused
_encoder = msgspec.msgpack.Encoder()
_task_decoder = msgspec.msgpack.Decoder(Task)
_forwarded_decoder = msgspec.msgpack.Decoder(tuple[str, str])
_deadline_decoder = msgspec.msgpack.Decoder(tuple[str, int])


def _forwarded_record(task_id: str, src: str) -> bytes:
    return _encoder.encode([FORWARDED, _encoder.encode([task_id, src])])


def _deadline_record(task_id: str, deadline_ms: int) -> bytes:
    return _encoder.encode([DEADLINE, _encoder.encode([task_id, deadline_ms])])


class Journal:
    def __init__(
        self, path: str | Path, *, fsync_interval_s: float = 0.01, compact_bytes: int = 64 * 2**20
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync_interval_s = fsync_interval_s
        self._compact_bytes = compact_bytes
        self._open: OrderedDict[str, bytes] = OrderedDict()  # unfinished: id -> task bytes
        self.forwarded: dict[str, str] = {}  # unfinished ids a peer forwarded -> that peer
        # Unfinished ids -> their deadline (ms since the epoch); absent: written before 0.3.0.
        self.deadlines: dict[str, int] = {}
        self._file = self.path.open("ab")
        self._size = self.path.stat().st_size
        self._dirty = False
        self._written = asyncio.Event()  # set with _dirty: sync_forever sleeps on it
        self.appended = 0
        self.syncs = 0
        self.compactions = 0
        self.damaged_bytes = 0  # at replay: bytes mid-file that were no record (skipped)
        self.unreadable_tasks = 0  # at replay: accepted tasks that did not decode
        # Writes, syncs and compactions the file system refused (a full disk): the daemon
        # serves on, those tasks not durable, and says so (logged, counted).
        self.write_errors = 0
        self._compact_again_at = 0  # appended count before compaction is tried again

    def replay(self) -> list[Task]:
        """Tasks accepted and not finished, oldest first (also kept as open here)."""
        self._open.clear()
        self.forwarded.clear()
        self.deadlines.clear()
        # Records about an accepted task: its kind -> how to read it, where it is kept.
        about: dict[int, tuple[msgspec.msgpack.Decoder, dict]] = {
            FORWARDED: (_forwarded_decoder, self.forwarded),
            DEADLINE: (_deadline_decoder, self.deadlines),
        }
        # Mapped, not read: the file's pages are the page cache's (clean, reclaimable), so
        # a large journal costs the daemon's memory only its unfinished tasks (read whole,
        # a 100 MiB file of finished tasks took 100 MiB more).
        with _mapped(self.path) as data:
            torn_at = self._read_records(data, about)
        if torn_at is not None:
            # A torn tail (a crash mid-write: nothing readable after it): cut it, so that
            # records appended from now on stay readable.
            self._file.close()
            with self.path.open("r+b") as fh:
                fh.truncate(torn_at)
            self._file = self.path.open("ab")
            self._size = torn_at
        return [_task_decoder.decode(b) for b in self._open.values()]

    def _read_records(
        self, data: bytes | mmap.mmap, about: dict[int, tuple[msgspec.msgpack.Decoder, dict]]
    ) -> int | None:
        """Read ``data``'s records into the open set; where a torn tail begins, if any."""
        decoder = msgspec.msgpack.Decoder()
        # Records are concatenated MessagePack values; decode them one by one.
        offset = 0
        records = 0
        torn = False
        damaged: list[tuple[int, int]] = []  # (offset, bytes) of damage skipped mid-file
        while offset < len(data):
            try:
                value, offset = _decode_one(decoder, data, offset)
            except ValueError:
                resume = _next_record(decoder, data, offset + 1)
                if resume is not None:
                    # Damage with records after it (a stray byte, a flipped length): those
                    # bytes are skipped, counted, and left in the file; what follows is read.
                    damaged.append((offset, resume - offset))
                    offset = resume
                    continue
                torn = True
                break
            records += 1
            if isinstance(value, list) and len(value) == 2:
                kind, body = value
                if kind == ACCEPT and isinstance(body, bytes):
                    try:
                        task = _task_decoder.decode(body)
                    except (msgspec.DecodeError, RecursionError):
                        self.unreadable_tasks += 1  # (its task is lost: said below)
                        continue
                    self._open[task.id] = body
                elif kind == DONE and isinstance(body, str):
                    self._open.pop(body, None)
                    self.forwarded.pop(body, None)
                    self.deadlines.pop(body, None)
                elif kind in about and isinstance(body, bytes):  # [task id, value]
                    read, values = about[kind]
                    try:
                        task_id, value = read.decode(body)
                    except (msgspec.DecodeError, RecursionError):
                        continue
                    if task_id in self._open:
                        values[task_id] = value
        if torn:
            log.warning(
                "journal ends in a torn record; ignored",
                extra={"path": str(self.path), "records": records},
            )
        if damaged or self.unreadable_tasks:
            self.damaged_bytes = sum(n for _, n in damaged)
            log.error(
                "journal damaged: bytes that are no record were skipped, and accepted tasks "
                "that do not decode were not replayed (the file is kept as it is)",
                extra={
                    "path": str(self.path),
                    "damaged_at": [at for at, _ in damaged[:10]],
                    "damaged_bytes": self.damaged_bytes,
                    "unreadable_tasks": self.unreadable_tasks,
                },
            )
        return offset if torn else None

    def accept(self, task: Task, deadline_ms: int | None = None) -> None:
        """``deadline_ms``: when the task's deadline passes, in ms since the epoch."""
        body = encode(task)
        self._open[task.id] = body
        record = _encoder.encode([ACCEPT, body])
        if deadline_ms is not None:
            self.deadlines[task.id] = deadline_ms
            record += _deadline_record(task.id, deadline_ms)
        self._write(record)

    def mark_forwarded(self, task_id: str, src: str) -> None:
        """The accepted ``task_id`` came from member ``src``'s Forward."""
        if task_id in self._open and task_id not in self.forwarded:
            self.forwarded[task_id] = src
            self._write(_forwarded_record(task_id, src))

    def done(self, task_id: str) -> None:
        if self._open.pop(task_id, None) is not None:
            self.forwarded.pop(task_id, None)
            self.deadlines.pop(task_id, None)
            self._write(_encoder.encode([DONE, task_id]))

    @property
    def unfinished(self) -> int:
        return len(self._open)

    def _write(self, record: bytes) -> None:
        try:
            self._file.write(record)
        except OSError as exc:  # (a full disk: the task runs, not durable)
            self._failed("write", exc)
            return
        self._size += len(record)
        if not self._dirty:
            self._dirty = True
            self._written.set()
        self.appended += 1

    async def sync_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._dirty:  # nothing to sync: sleep until a record is written
                self._written.clear()
                await self._written.wait()
            await asyncio.sleep(self._fsync_interval_s)
            if self._dirty:
                self._dirty = False
                try:
                    self._file.flush()
                    await loop.run_in_executor(None, os.fsync, self._file.fileno())
                    self.syncs += 1
                except OSError as exc:
                    self._failed("sync", exc)
                    self._dirty = True  # tried again after a pause
                    await asyncio.sleep(SYNC_RETRY_S)
            if (
                self._size > self._compact_bytes
                and len(self._open) * 4 < self.appended
                and self.appended >= self._compact_again_at
            ):
                self.compact()

    def compact(self) -> None:
        """Rewrite the file with only the unfinished tasks (the file system refusing: the
        old file is kept, and compaction waits for as many records again)."""
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            self._rewrite(tmp)
        except OSError as exc:
            self._failed("compact", exc)
            tmp.unlink(missing_ok=True)
            self._compact_again_at = 2 * self.appended
            return
        self._size = self.path.stat().st_size
        self.appended = len(self._open)
        self._compact_again_at = 0
        self.compactions += 1

    def _rewrite(self, tmp: Path) -> None:
        with tmp.open("wb") as out:
            for task_id, body in self._open.items():
                out.write(_encoder.encode([ACCEPT, body]))
                if task_id in self.deadlines:
                    out.write(_deadline_record(task_id, self.deadlines[task_id]))
                if task_id in self.forwarded:
                    out.write(_forwarded_record(task_id, self.forwarded[task_id]))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        _fsync_directory(self.path.parent)  # the rename itself durable, not only the data
        old, self._file = self._file, self.path.open("ab")
        with contextlib.suppress(OSError):  # (its buffer is superseded by the new file)
            old.close()

    def _failed(self, what: str, exc: OSError) -> None:
        self.write_errors += 1
        if self.write_errors == 1 or self.write_errors % 1000 == 0:  # (not a line a task)
            log.error(
                "the journal cannot be written: tasks accepted now are not durable (free "
                "space on its file system)",
                extra={"path": str(self.path), "what": what, "error": str(exc),
                       "errors": self.write_errors},
            )  # fmt: skip

    def close(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:  # what was not written is lost; the rest of the stop goes on
            self._failed("close", exc)
        finally:
            with contextlib.suppress(OSError):
                self._file.close()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """The file's bytes, mapped read-only (b"" for an empty file, which cannot be mapped)."""
    with path.open("rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)  # read once, front to back
            yield mapped


def _decode_one(
    decoder: msgspec.msgpack.Decoder, data: bytes | mmap.mmap, offset: int
) -> tuple[object, int]:
    """Decode the MessagePack value starting at ``offset``; ValueError if it is incomplete."""
    # Our records are 2-element arrays: fixarray header 0x92, a positive fixint, then either
    # bin (0xc4/0xc5/0xc6) or str (0xa0-0xbf, 0xd9/0xda/0xdb).
    end = _record_end(data, offset)
    try:
        return decoder.decode(data[offset:end]), end
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def _next_record(
    decoder: msgspec.msgpack.Decoder, data: bytes | mmap.mmap, start: int
) -> int | None:
    """Where the first whole record at or after ``start`` begins; None if there is none."""
    at = data.find(b"\x92", start)
    while at != -1:
        try:
            _decode_one(decoder, data, at)
            return at
        except ValueError:
            at = data.find(b"\x92", at + 1)
    return None


def _record_end(data: bytes | mmap.mmap, offset: int) -> int:
    def need(n: int) -> None:
        if offset + n > len(data):
            raise ValueError("truncated")

    need(3)
    # Any record kind, known or not (0..127): a kind added by a later version is skipped by
    # replay, not taken for a torn tail that would cut the file there.
    if data[offset] != 0x92 or data[offset + 1] > 0x7F:
        raise ValueError("not a journal record")
    pos = offset + 2
    tag = data[pos]
    if 0xA0 <= tag <= 0xBF:
        length, head = tag & 0x1F, 1
    elif tag in (0xC4, 0xD9):
        need(4)
        length, head = data[pos + 1], 2
    elif tag in (0xC5, 0xDA):
        need(5)
        length, head = int.from_bytes(data[pos + 1 : pos + 3], "big"), 3
    elif tag in (0xC6, 0xDB):
        need(7)
        length, head = int.from_bytes(data[pos + 1 : pos + 5], "big"), 5
    else:
        raise ValueError("unexpected record body")
    end = pos + head + length
    if end > len(data):
        raise ValueError("truncated")
    return end
