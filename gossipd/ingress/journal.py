"""The local journal of accepted tasks: the only durable state a daemon keeps.

Append-only records (journal_format.py: each a MessagePack array [kind, body, check], the check
a CRC-32 of the record; files written before 0.3.6 hold [kind, body] records, read as well):
ACCEPT with the task's bytes when a task is accepted, DEADLINE with MessagePack [task id,
deadline] right after it (from 0.3.0: its deadline in milliseconds since the epoch, by this
host's clock, so that a restart keeps it instead of giving the task its whole timeout again),
FORWARDED with MessagePack [task id, forwarder] after them when a peer forwarded it (after a
restart that forwarder's Withdraw is honoured, since it may have migrated the task while we
were down, and it gets the TaskDone), RUNNING with MessagePack [task id, deaths] each time a
worker gives it to the engine (from 0.3.6; ``deaths``: the engines and daemons that had died
under it before, Owned.engine_deaths; -1: it left the engine, its Result held for its
forwarder's word), DONE with the task id when its final result was sent.
A task still unfinished at a restart whose last RUNNING says ``deaths`` had one more die under
it: this daemon (``died_under``: deaths + 1), so that a task that kills its daemon is not run
again for ever (engine.deaths_per_task_max).  A RUNNING record of a task already replayed
once, or already counting a death, is written out at once, not at the next sync: a task that
kills the daemon within the sync's 10 ms must still leave it behind.
Writes are buffered (8 KiB) and made durable in batches (written, then fsync every
``fsync_interval_s``, off the event loop), so a crash loses at most that window of
acceptances; the producer's resubmission covers that window.  A write the file system
refuses (a full disk) leaves nothing of its records: the file is cut back to where the
write began and those records dropped (their tasks run, not durable).  When the file passes
``compact_bytes`` and more than half of it is garbage (finished tasks' records), it is
rewritten with only the unfinished tasks, off the event loop (journal_files.py: write, copy
what was appended meanwhile, fsync, rename; from the rename on the new file is the journal,
even if the directory's fsync then fails).
On start-up ``replay`` returns the tasks accepted but never finished, to run again: a record
that fails its check is skipped, and the records after it read; a torn last record (a crash
mid-write) is cut off; a record of a kind this version does not know (written by a later one)
is skipped.  One journal has one daemon: the file is locked (flock) while a Journal holds it,
and a second Journal on it raises JournalInUse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.core.messages import Task, encode
from gossipd.ingress import journal_files, journal_format
from gossipd.ingress.journal_files import Aborted, Snapshot, mapped, open_locked
from gossipd.ingress.journal_format import ACCEPT, DEADLINE, DONE, FORWARDED, RUNNING, Reader

log = logging.getLogger("gossipd.ingress.journal")

SYNC_RETRY_S = 1.0  # after a sync the file system refused
BUFFER_BYTES = 8192  # records are written out once this many are buffered (or at a sync)
_task_decoder = msgspec.msgpack.Decoder(Task)
# What a task's records weigh beside its bytes (headers, checks, its small records), for the
# count of live bytes that decides a compaction.
_RECORDS_OVERHEAD = 64
_T = TypeVar("_T")


class NotAJournal(Exception):
    """journal.path names a file that holds something else: replay would cut it to nothing
    (a tail with no record in it reads as torn), so start-up stops instead."""

    def __init__(self, path: Path, size: int, first: int) -> None:
        super().__init__(
            f"journal.path = {str(path)!r} holds {size} bytes and not one journal record "
            f"(its first byte is {first:#04x}; a journal's records start with 0x92 or 0x93): "
            "point journal.path at a file of its own, or move this one away if it is a "
            "journal no longer wanted"
        )
        self.path = path


# Journal files of every version begin with a record's array header (journal_format.py).
_RECORD_HEADS = (journal_format.CHECKED, journal_format.UNCHECKED)
# A compaction that failed is not tried again for this long (as many records again, too,
# when it was due to the file's size): each try writes every unfinished task.
COMPACT_RETRY_S = 10.0


class Journal:
    def __init__(
        self,
        path: str | Path,
        *,
        fsync_interval_s: float = 0.01,
        compact_bytes: int = 64 * 2**20,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: when a failed compaction may be tried again (gossipd/clock.py)."""
        self.path = Path(path)
        self._clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync_interval_s = fsync_interval_s
        self._compact_bytes = compact_bytes
        self._open: OrderedDict[str, bytes] = OrderedDict()  # unfinished: id -> task bytes
        self.forwarded: dict[str, str] = {}  # unfinished ids a peer forwarded -> that peer
        # Unfinished ids -> their deadline (ms since the epoch); absent: written before 0.3.0.
        self.deadlines: dict[str, int] = {}
        # Unfinished ids an engine was given -> the deaths their last RUNNING record counted.
        self.runs: dict[str, int] = {}
        # At replay: unfinished ids that were running when the daemon went down -> the
        # engines and daemons that have died under them, this one's included.
        self.died_under: dict[str, int] = {}
        self._replayed: set[str] = set()  # unfinished ids read at replay
        # Read (replay) and appended to; locked: JournalInUse where another holds it.
        self._file = open_locked(self.path)
        self._pending = bytearray()  # records not yet written to the file
        self._file_size = os.fstat(self._file.fileno()).st_size  # what the file holds
        self._size = self._file_size  # and with what is pending
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
        self._compact_again_after = 0.0  # ...and the monotonic time (COMPACT_RETRY_S)
        # A write was refused (its records dropped, DONEs among them): the file is rewritten
        # from what is unfinished at the next sync that succeeds, else finished tasks would
        # run again at the next start.
        self._rewrite_due = False
        # The bytes the unfinished tasks' records take (about): the rest of the file is
        # garbage, and a compaction is due when it is more than half (and compact_bytes).
        self._live_bytes = 0
        # A compaction under way (sync_forever's): its writing in a thread of its own
        # (_rewriter), the records appended meanwhile held in the buffer while it copies
        # them and renames (_holding); _abort asks it to stop (close); _placed is its file
        # once renamed over the journal, until the loop takes it.
        self._compacting: asyncio.Task[None] | None = None
        self._rewriter: concurrent.futures.ThreadPoolExecutor | None = None
        self._holding = False
        self._abort = threading.Event()
        self._placed: io.FileIO | None = None
        # A child forked from here (vLLM forks its engine core) shares the locked file: it
        # lets go of it, else, outliving a daemon that was killed, it would hold the lock.
        os.register_at_fork(after_in_child=_let_go_in_child(weakref.ref(self)))

    def fileno(self) -> int:
        return self._file.fileno()

    def replay(self) -> list[Task]:
        """Tasks accepted and not finished, oldest first (also kept as open here).  Raises
        NotAJournal for a file that holds no record and does not begin as one, and OSError
        where the file cannot be read or its torn tail cut."""
        self._open.clear()
        self.forwarded.clear()
        self.deadlines.clear()
        self.runs.clear()
        self.flush()
        # Records about an accepted task: its kind -> where it is kept.
        about: dict[int, dict] = {
            FORWARDED: self.forwarded,
            DEADLINE: self.deadlines,
            RUNNING: self.runs,
        }
        # Mapped, not read: the file's pages are the page cache's (clean, reclaimable), so
        # a large journal costs the daemon's memory only its unfinished tasks (read whole,
        # a 100 MiB file of finished tasks took 100 MiB more).
        with mapped(self._file.fileno()) as data:
            data_first = data[0] if len(data) else -1
            reader = Reader(data)
            for kind, body, value in reader:
                if kind == ACCEPT:
                    if isinstance(value, Task) and isinstance(body, bytes):
                        self._open[value.id] = body
                    else:
                        self.unreadable_tasks += 1  # (its task is lost: said below)
                elif kind == DONE and isinstance(value, str):
                    self._open.pop(value, None)
                    self.forwarded.pop(value, None)
                    self.deadlines.pop(value, None)
                    self.runs.pop(value, None)
                elif kind in about and isinstance(value, tuple) and value[0] in self._open:
                    about[kind][value[0]] = value[1]  # [task id, value]
        if reader.records == 0 and reader.torn_at == 0 and data_first not in _RECORD_HEADS:
            # Not one record, and not the start of one torn short either (each begins with
            # an array header): another file, which the cut below would empty.
            raise NotAJournal(self.path, os.fstat(self._file.fileno()).st_size, data_first)
        self._report(reader)
        if reader.torn_at is not None:
            # A torn tail (a crash mid-write: nothing readable after it): cut it, so that
            # records appended from now on stay readable.
            os.ftruncate(self._file.fileno(), reader.torn_at)
            self._size = self._file_size = reader.torn_at
        for task_id in [t for t, deaths in self.runs.items() if deaths < 0]:
            del self.runs[task_id]  # (off the engine: RUNNING -1)
        self.died_under = {task_id: deaths + 1 for task_id, deaths in self.runs.items()}
        self._replayed = set(self._open)
        self._live_bytes = sum(len(b) + _RECORDS_OVERHEAD for b in self._open.values())
        return [_task_decoder.decode(b) for b in self._open.values()]

    def _report(self, reader: Reader) -> None:
        if reader.torn_at is not None:
            log.warning(
                "journal ends in a torn record; cut off",
                extra={"path": str(self.path), "records": reader.records,
                       "at": reader.torn_at},
            )  # fmt: skip
        if reader.damaged or self.unreadable_tasks:
            self.damaged_bytes = sum(n for _, n in reader.damaged)
            log.error(
                "journal damaged: bytes that are no record were skipped, and accepted tasks "
                "that do not decode were not replayed (the file is kept as it is)",
                extra={
                    "path": str(self.path),
                    "damaged_at": [at for at, _ in reader.damaged[:10]],
                    "damaged_bytes": self.damaged_bytes,
                    "unreadable_tasks": self.unreadable_tasks,
                },
            )

    def accept(self, task: Task, deadline_ms: int | None = None) -> None:
        """``deadline_ms``: when the task's deadline passes, in ms since the epoch."""
        body = encode(task)
        if task.id not in self._open:
            self._live_bytes += len(body) + _RECORDS_OVERHEAD
        self._open[task.id] = body
        journal_format.append(self._pending, ACCEPT, body)
        if deadline_ms is not None:
            self.deadlines[task.id] = deadline_ms
            journal_format.append(
                self._pending, DEADLINE, journal_format.pair(task.id, deadline_ms)
            )
        self._appended()

    def mark_forwarded(self, task_id: str, src: str) -> None:
        """The accepted ``task_id`` came from member ``src``'s Forward."""
        if task_id in self._open and task_id not in self.forwarded:
            self.forwarded[task_id] = src
            journal_format.append(self._pending, FORWARDED, journal_format.pair(task_id, src))
            self._appended()

    def started(self, task_id: str, deaths: int) -> None:
        """A worker gives the accepted ``task_id`` to the engine; ``deaths``: engines and
        daemons that died under it before (Owned.engine_deaths)."""
        if task_id not in self._open:
            return
        # (a copy sent again while the restart asked starts from 0: the count stays)
        deaths = max(deaths, self.died_under.get(task_id, 0))
        self.runs[task_id] = deaths
        journal_format.append(self._pending, RUNNING, journal_format.pair(task_id, deaths))
        self._appended()
        if deaths or task_id in self._replayed:
            # (rare: a task that may be what kills its daemon leaves this record behind
            # even if it does so at once; written, the page cache keeps it past our death)
            self.flush()

    def off_engine(self, task_id: str) -> None:
        """``task_id`` left the engine without finishing here yet (its Result held for its
        forwarder's word): a restart must not count a death under it (RUNNING -1)."""
        if self.runs.pop(task_id, None) is not None:
            journal_format.append(self._pending, RUNNING, journal_format.pair(task_id, -1))
            self._appended()

    def done(self, task_id: str) -> None:
        body = self._open.pop(task_id, None)
        if body is not None:
            self._live_bytes -= len(body) + _RECORDS_OVERHEAD
            self.forwarded.pop(task_id, None)
            self.deadlines.pop(task_id, None)
            self.runs.pop(task_id, None)
            self.died_under.pop(task_id, None)
            self._replayed.discard(task_id)
            journal_format.append(self._pending, DONE, task_id)
            self._appended()

    @property
    def unfinished(self) -> int:
        return len(self._open)

    def _appended(self) -> None:
        """Records were appended to the buffer: written out once it is full."""
        self._size = self._file_size + len(self._pending)
        self.appended += 1
        if len(self._pending) >= BUFFER_BYTES:
            self.flush()
        self._note_written()

    def flush(self) -> None:
        """Write the buffered records to the file (not yet durable: sync_forever makes them
        so); a write the file system refuses is counted and leaves nothing of them."""
        try:
            self._write_out()
        except OSError as exc:  # (a full disk: those tasks run, not durable)
            self._failed("write", exc)

    def _write_out(self) -> None:
        """Write the buffer; where the file system refuses part of it (ENOSPC, EIO), cut the
        file back to where it began and drop the buffer, then raise: a part of a record
        left mid-file would be read as damage, and all of it would come after that."""
        if not self._pending or self._holding:
            return
        fd = self._file.fileno()
        written = 0
        try:
            with memoryview(self._pending) as view:
                while written < len(view):
                    written += os.write(fd, view[written:])
        except OSError:
            self._pending.clear()
            self._rewrite_due = True
            if written:
                with contextlib.suppress(OSError):  # (else the reader skips it: damage)
                    os.ftruncate(fd, self._file_size)
            self._size = self._file_size
            raise
        self._pending.clear()
        self._file_size += written

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
                    self._write_out()
                    await loop.run_in_executor(None, os.fsync, self._file.fileno())
                    self.syncs += 1
                except OSError as exc:
                    self._failed("sync", exc)
                    # A failed fsync leaves the pages it did not write marked clean (Linux):
                    # a later fsync succeeds without them.  Only a rewrite from what is in
                    # memory makes those records durable.
                    self._rewrite_due = True
                    self._dirty = True  # tried again after a pause
                    await asyncio.sleep(SYNC_RETRY_S)
                    continue
                if self._rewrite_due and self._may_compact():
                    self._start_compaction()  # the file system takes writes again
                    continue
            if (
                self._size > self._compact_bytes
                and self._size - self._live_bytes > self._live_bytes  # over half garbage
                and self.appended >= self._compact_again_at
                and self._may_compact()
            ):
                self._start_compaction()

    def _may_compact(self) -> bool:
        return self._compacting is None and self._clock.monotonic() >= self._compact_again_after

    def _start_compaction(self) -> None:
        self._compacting = asyncio.get_running_loop().create_task(
            self._compact_off_loop(), name="journal-compaction"
        )

    async def _compact_off_loop(self) -> None:
        """compact(), its writing, syncing and renaming in a thread, the loop serving on.
        The snapshot of the unfinished tasks is written to NAME.tmp while new records go to
        the journal (and are synced) as usual; then, the records held in the buffer, those
        appended since the snapshot are copied after it, and the new file is synced and
        renamed over the journal; the held records follow into it."""
        tmp = self._tmp_path()
        rewrite_was_due, self._rewrite_due = self._rewrite_due, False
        new: io.FileIO | None = None
        try:
            self._write_out()
            mark, snapshot = self._file_size, self._snapshot()
            new = await self._in_thread(self._write_tmp, tmp, snapshot)
            self._holding = True  # (the old file holds still while its tail is copied)
            end = self._file_size
            await self._in_thread(self._finish_tmp, new, mark, end, tmp)
        except OSError as exc:
            self._holding = False
            self._compaction_failed(exc, new, tmp)
            self._rewrite_due = self._rewrite_due or rewrite_was_due
            self.flush()  # (what waited while the tail was copied)
            return
        finally:
            self._compacting = None
        old = self._take_placed()
        self.flush()  # the records held meanwhile: into the new file
        self._note_written()  # (synced by sync_forever)
        try:
            # (closed there too: the old file's last close frees its blocks, tens of ms
            # for a large one)
            await self._in_thread(journal_files.let_go, old, self.path.parent)
        except OSError as exc:
            self._failed("rename", exc)

    def _compaction_failed(self, exc: OSError, new: io.FileIO | None, tmp: Path) -> None:
        """The journal stays as it was: the .tmp goes, the failure is said (unless the
        journal closes), and compaction waits for as many records again and
        COMPACT_RETRY_S."""
        journal_files.drop(new, tmp)
        if not isinstance(exc, Aborted):
            self._failed("compact", exc)
        self._compact_again_at = 2 * self.appended
        self._compact_again_after = self._clock.monotonic() + COMPACT_RETRY_S

    def _snapshot(self) -> list[Snapshot]:
        deadlines, forwarded, runs = self.deadlines, self.forwarded, self.runs
        return [
            (i, body, deadlines.get(i), forwarded.get(i), runs.get(i))
            for i, body in self._open.items()
        ]

    def _write_tmp(self, tmp: Path, snapshot: list[Snapshot]) -> io.FileIO:
        """(In the rewriter's thread.)  ``tmp`` made with the snapshot's records."""
        new = journal_files.open_tmp(tmp)
        try:
            journal_files.write_snapshot(new, snapshot, self._abort)
        except BaseException:
            new.close()
            raise
        return new

    def _finish_tmp(self, new: io.FileIO, mark: int, end: int, tmp: Path) -> None:
        """(In the rewriter's thread, the journal's writes held.)  The records appended since
        the snapshot copied after it, then ``new`` synced and renamed over the journal."""
        journal_files.copy_tail(self._file.fileno(), mark, end, new)
        if self._abort.is_set():
            raise Aborted("the journal closes: its compaction is dropped")
        journal_files.put_in_place(new, tmp, self.path)
        self._placed = new  # (the journal from here: the loop, or close, takes it)

    def _take_placed(self) -> io.FileIO:
        """The compaction's file, renamed over the journal, becomes the journal's file; the
        old one, to close."""
        new, self._placed = self._placed, None
        assert new is not None
        old, self._file = self._file, new
        self._holding = False
        self._file_size = os.fstat(new.fileno()).st_size
        self._size = self._file_size + len(self._pending)
        self.appended = len(self._open)
        self._compact_again_at = 0
        self._compact_again_after = 0.0
        self.compactions += 1
        return old

    async def _in_thread(self, call: Callable[..., _T], *args: Any) -> _T:
        if self._rewriter is None:
            self._rewriter = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="journal-rewrite"
            )
        return await asyncio.wrap_future(self._rewriter.submit(call, *args))

    def _note_written(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._written.set()

    def _tmp_path(self) -> Path:
        return self.path.with_suffix(self.path.suffix + ".tmp")

    def compact(self) -> None:
        """Rewrite the file with only the unfinished tasks, here and now (a stop, a test;
        sync_forever compacts off the loop): the file system refusing before the rename,
        the old file is kept, and compaction waits for as many records again and
        COMPACT_RETRY_S.  From the rename on, the new file is the journal: a directory fsync
        that fails then is counted and logged, the rename perhaps not durable yet."""
        tmp = self._tmp_path()
        try:
            new = self._rewrite(tmp)
        except OSError as exc:
            self._compaction_failed(exc, None, tmp)
            return
        self._pending.clear()  # (superseded: the new file holds every unfinished task)
        self._rewrite_due = False
        self._placed = new
        try:
            journal_files.let_go(self._take_placed(), self.path.parent)
        except OSError as exc:
            self._failed("rename", exc)

    def _rewrite(self, tmp: Path) -> io.FileIO:
        """``tmp`` written with the unfinished tasks, made durable, locked and renamed over the
        journal: the new journal's file, open (raises, leaving the journal as it was, where
        any of that fails)."""
        new = self._write_tmp(tmp, self._snapshot())
        try:
            journal_files.put_in_place(new, tmp, self.path)
        except BaseException:
            new.close()
            raise
        return new

    def _failed(self, what: str, exc: OSError) -> None:
        self.write_errors += 1
        extra = {"path": str(self.path), "what": what, "error": str(exc),
                 "errors": self.write_errors}  # fmt: skip
        if what == "compact":  # (tried again after COMPACT_RETRY_S at the soonest)
            directory = str(self.path.parent)
            log.error(
                f"the journal cannot be compacted in {directory}: it grows past "
                "journal.compact_bytes until a compaction succeeds (a compaction writes "
                f"{self.path.name}.tmp in that directory and renames it over the journal: "
                "the directory must be writable by this user, with free space)",
                extra={**extra, "directory": directory},
            )
        elif what == "rename":
            log.error(
                "the journal was compacted but its directory could not be synced: the new "
                "file is the journal now, and a power loss before the next sync of the "
                "directory may bring back the old one (its finished tasks run again)",
                extra=extra,
            )
        elif self.write_errors == 1 or self.write_errors % 1000 == 0:  # (not a line a task)
            log.error(
                "the journal cannot be written: tasks accepted now are not durable (free "
                "space on its file system)",
                extra=extra,
            )

    def close(self) -> None:
        self._stop_compaction()
        try:
            self._write_out()
            os.fsync(self._file.fileno())
            if self._rewrite_due:  # (a write was refused since the last rewrite)
                self.compact()
        except OSError as exc:  # what was not written is lost; the rest of the stop goes on
            self._failed("close", exc)
        finally:
            with contextlib.suppress(OSError):
                self._file.close()

    def _stop_compaction(self) -> None:
        """A compaction under way is asked to stop and waited for (its thread writes at
        most a chunk more); where it had renamed its file over the journal already, that
        file is the journal's from here."""
        compacting, self._compacting = self._compacting, None
        if compacting is not None:
            compacting.cancel()
        if self._rewriter is not None:
            self._abort.set()
            self._rewriter.shutdown(wait=True)
            self._rewriter = None
        if self._placed is not None:
            with contextlib.suppress(OSError):
                journal_files.let_go(self._take_placed(), self.path.parent)
        elif compacting is not None:
            journal_files.drop(None, self._tmp_path())  # (its unfinished file)
        self._holding = False


def _let_go_in_child(ref: weakref.ref[Journal]) -> Callable[[], None]:
    """What a forked child runs: its copy of the journal's descriptor pointed at /dev/null.
    flock belongs to the open file, which the copy shares; an engine core that outlives a
    daemon SIGKILLed would otherwise hold the lock, and the restarted daemon stop with
    JournalInUse."""

    def let_go() -> None:
        journal = ref()
        if journal is None or journal._file.closed:
            return
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, journal._file.fileno(), inheritable=False)  # (as it was: CLOEXEC)
            os.close(null)

    return let_go
