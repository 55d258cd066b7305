"""A journal's files on disk (journal.py keeps the records and decides): the journal opened
and locked, mapped to be read at replay, and its compaction: the unfinished tasks written to
``NAME.tmp``, the records appended to the journal meanwhile copied after them, then the new
file made durable and renamed over the journal.

The compaction's steps run in a thread of the journal's own (a compaction of a large journal wrote, synced and
renamed on the event loop: 84 ms for 32 MiB on a fast disk, past systemd's watchdog for a
GiB on a slow one), or inline where nothing else runs (a stop, a test).  Each raises OSError
with the journal as it was (the .tmp removed by the caller) where the file system refuses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from gossipd.ingress import journal_format
from gossipd.ingress.journal_format import ACCEPT, DEADLINE, FORWARDED, RUNNING

_LOCK_TRIES = 10  # opening a file that a compaction replaced between the open and the lock
CHUNK_BYTES = 2**20  # written (and the abort looked at) this much at a time


class Aborted(OSError):
    """The journal is closing: the compaction stops where it is (the .tmp is dropped)."""


# One unfinished task as the snapshot holds it: id, the task's bytes, deadline (ms), the
# member that forwarded it, the deaths its last RUNNING record counted (None: absent).
Snapshot = tuple[str, bytes, int | None, str | None, int | None]


def open_tmp(tmp: Path) -> io.FileIO:
    """A new ``tmp``, locked (before it is the journal): a .tmp left behind (a compaction
    killed midway, perhaps another user's, or a link) is removed, never reopened."""
    tmp.unlink(missing_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o666)
    try:
        new = open(fd, "a+b", buffering=0)  # noqa: SIM115  (kept: the journal's file)
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        new.close()
        raise
    return new


def write_snapshot(
    new: io.FileIO, snapshot: Iterable[Snapshot], abort: threading.Event | None = None
) -> None:
    """Each task's records into ``new``: ACCEPT, then its DEADLINE, FORWARDED and RUNNING."""
    fd = new.fileno()
    out = bytearray()
    for task_id, body, deadline, forwarder, deaths in snapshot:
        journal_format.append(out, ACCEPT, body)
        if deadline is not None:
            journal_format.append(out, DEADLINE, journal_format.pair(task_id, deadline))
        if forwarder is not None:
            journal_format.append(out, FORWARDED, journal_format.pair(task_id, forwarder))
        if deaths is not None:
            journal_format.append(out, RUNNING, journal_format.pair(task_id, deaths))
        if len(out) >= CHUNK_BYTES:
            _check(abort)
            write_all(fd, out)
    write_all(fd, out)


def copy_tail(src_fd: int, start: int, end: int, new: io.FileIO) -> None:
    """The journal's bytes [start, end) (whole records: written since the snapshot) appended
    to ``new``."""
    at = start
    while at < end:
        chunk = os.pread(src_fd, min(CHUNK_BYTES, end - at), at)
        if not chunk:
            raise OSError(f"the journal ended at {at} bytes, {end} were expected")
        out = bytearray(chunk)
        write_all(new.fileno(), out)
        at += len(chunk)


def put_in_place(new: io.FileIO, tmp: Path, path: Path) -> None:
    """``new`` (written at ``tmp``) made durable and renamed over ``path``: from the rename
    on, it is the journal."""
    os.fsync(new.fileno())
    os.replace(tmp, path)


def let_go(old: io.FileIO, directory: Path) -> None:
    """After the rename: the old file closed (its last close frees its blocks) and the
    directory synced, the rename durable (raises OSError where that sync fails)."""
    with contextlib.suppress(OSError):
        old.close()
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, buffer: bytearray) -> None:
    with memoryview(buffer) as view:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
    buffer.clear()


def drop(new: io.FileIO | None, tmp: Path) -> None:
    """A compaction that did not finish: its file closed and removed."""
    if new is not None:
        with contextlib.suppress(OSError):
            new.close()
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def _check(abort: threading.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise Aborted("the journal closes: its compaction is dropped")


class JournalInUse(Exception):
    """Another Journal (another daemon) holds this file: two would replay the same tasks,
    and one's compaction would unlink the file the other writes to."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"journal.path = {str(path)!r} is in use by another process (another gossipd "
            "given the same journal.path?): give each daemon its own journal"
        )
        self.path = path


def open_locked(path: Path) -> io.FileIO:
    """``path`` opened to read and append, locked for this Journal (JournalInUse where
    another holds it)."""
    for _ in range(_LOCK_TRIES):
        file = open(path, "a+b", buffering=0)  # noqa: SIM115  (kept: the journal's file)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            file.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalInUse(path) from None
            raise
        # The holder's compaction may have renamed a new file over the path between our
        # open and our lock: the lock is then on its old file, which no journal uses.
        with contextlib.suppress(FileNotFoundError):
            here, now = os.fstat(file.fileno()), os.stat(path)
            if (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino):
                return file
        file.close()
    raise JournalInUse(path)


@contextlib.contextmanager
def mapped(fd: int) -> Iterator[bytes | mmap.mmap]:
    """The file's bytes, mapped read-only (b"" for an empty file, which cannot be mapped)."""
    if os.fstat(fd).st_size == 0:
        yield b""
        return
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # read once, front to back
        yield mapped
