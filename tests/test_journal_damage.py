"""The journal against damage, full disks, failed compactions and a second daemon: what it
promises in docs/OPERATIONS.md ("What the journal does with damage and a full disk").

Real files throughout; a full disk is a real one (a 256 KiB tmpfs, mounted as root), or where
mounting is not allowed, a write the journal's ``os.write`` makes in part before it raises
ENOSPC (what a full disk does)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gossipd.ingress.journal as journal_module
from gossipd.config import load_config
from gossipd.core.messages import Task, encode
from gossipd.errors import StartupError
from gossipd.ingress.journal import Journal, NotAJournal
from gossipd.ingress.journal_files import JournalInUse
from gossipd.ops import preflight
from tests.helpers import gossipd_cli

NOBODY = 65534


def task(i: int, prompt: str = "p") -> Task:
    return Task(v=1, id=f"t{i}", prompt=prompt, reply_to="tcp://127.0.0.1:9")


def write_before_checksums(path: Path, records: list[tuple[int, object]]) -> None:
    """A journal as 0.3.5 wrote it: [kind, body] records, no checksum."""
    with path.open("ab") as fh:
        for kind, body in records:
            fh.write(msgspec.msgpack.encode([kind, body]))


def replayed(path: Path) -> tuple[list[str], Journal]:
    again = Journal(path)
    ids = [t.id for t in again.replay()]
    again.close()
    return ids, again


def body_at(data: bytes, t: Task) -> int:
    """Where ``t``'s encoded task begins in ``data`` (its record's header is before it)."""
    at = data.find(encode(t))
    assert at > 0
    return at


# -- a write the file system refuses --------------------------------------------------------


class SmallDisk:
    """A file system with ~16 KiB free after ``fill()``, all of it after ``free()``."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch, mounted: bool) -> None:
        self.dir = directory
        self.mounted = mounted
        self._monkeypatch = monkeypatch
        self._room: list[int] | None = None  # (injected: bytes left before ENOSPC)

    def fill(self, room: int | None = None) -> None:
        """Leave ~16 KiB free, or ``room`` bytes (0: none) of what is free now."""
        if self.mounted:
            if room is None:
                size = 256 * 1024 - 16 * 1024
            else:
                stat = os.statvfs(self.dir)
                size = stat.f_bavail * stat.f_frsize - room
            with (self.dir / "filler").open("wb") as fh, contextlib.suppress(OSError):
                fh.write(b"\0" * size)
            return
        self._room = [16 * 1024 if room is None else room]
        real_write = os.write

        def write(fd: int, data: bytes | memoryview) -> int:
            if self._room is None or fd <= 2:
                return real_write(fd, data)
            if self._room[0] == 0:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            n = real_write(fd, bytes(data)[: self._room[0]])  # the bytes that fit
            self._room[0] -= n
            return n

        self._monkeypatch.setattr(journal_module.os, "write", write)

    def free(self) -> None:
        if self.mounted:
            (self.dir / "filler").unlink()
        else:
            self._room = None


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield SmallDisk(mnt, monkeypatch, mounted)
    finally:
        if mounted:
            # (lazily: a journal a failed test left open keeps it busy)
            subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_a_write_a_full_disk_refuses_leaves_nothing_of_its_record_in_the_file(
    small_disk: SmallDisk,
) -> None:
    """A record larger than the write buffer was written at once; the disk took part of it,
    and the records written once space was freed landed after that part: at the next start
    its length swallowed them (153 accepted tasks lost, 50 finished ones run again).  Now the
    file is cut back to where the failed write began."""
    small_disk.fill()
    path = small_disk.dir / "journal"
    j = Journal(path)
    j.accept(task(0, "x" * 20))
    for i in range(50):  # a0..a49: accepted before the fault, finished after it
        j.accept(Task(v=1, id=f"a{i}", prompt="y", reply_to="tcp://127.0.0.1:9"))
    j.flush()
    j.accept(task(1, "x" * 64 * 1024))  # refused part-way: not durable until the rewrite
    assert j.write_errors == 1
    small_disk.free()
    for i in range(50):
        j.done(f"a{i}")
    for i in range(2, 602):
        j.accept(task(i, "x" * 20))
        if i % 2 == 0:
            j.done(f"t{i}")
    j.flush()
    crashed = small_disk.dir.parent / "crashed"  # the file as a SIGKILL here leaves it
    shutil.copyfile(path, crashed)
    ids, again = replayed(crashed)
    assert ids == ["t0"] + [f"t{i}" for i in range(3, 602, 2)]  # t1: not durable
    assert again.damaged_bytes == 0 and again.unreadable_tasks == 0
    j.close()  # the stop rewrites the file from what is unfinished: t1 is durable then
    assert replayed(path)[0] == ["t0", "t1"] + [f"t{i}" for i in range(3, 602, 2)]


def test_a_sync_a_full_disk_refuses_keeps_no_part_of_the_batch(small_disk: SmallDisk) -> None:
    """The batch of small records a sync writes out, refused part-way, leaves nothing: the
    records journaled once space is freed are read after the ones before the fault."""
    path = small_disk.dir / "journal"
    j = Journal(path)
    j.accept(task(0))
    j.flush()
    small_disk.fill()
    for i in range(1, 800):  # ~40 KiB of records: more than the disk has left
        j.accept(task(i, "z" * 30))
    j.flush()
    assert j.write_errors >= 1
    small_disk.free()
    j.accept(task(900))
    j.close()
    ids, again = replayed(path)
    assert ids[0] == "t0" and ids[-1] == "t900"
    assert again.damaged_bytes == 0 and again.unreadable_tasks == 0


def test_done_records_a_full_disk_refused_are_not_lost_once_it_has_room(
    small_disk: SmallDisk,
) -> None:
    """Tasks accepted and synced finish while the disk is full: their DONE records are
    refused and dropped.  Nothing wrote them again, so after a clean stop, the disk free
    again, the next start ran every one of them a second time (a review: 1,000 of 1,000).
    Now a refused write has the file rewritten from what is unfinished at the next sync
    that succeeds, or at the stop."""
    path = small_disk.dir / "journal"
    j = Journal(path)
    for i in range(1000):
        j.accept(task(i))
    j.flush()
    os.fsync(j.fileno())
    small_disk.fill(room=0)  # another process's file takes the rest
    for i in range(1000):
        j.done(f"t{i}")
    j.flush()
    assert j.write_errors >= 1  # the DONEs refused: not on the disk
    small_disk.free()
    j.accept(task(1001))
    j.close()
    assert replayed(path)[0] == ["t1001"]


def test_the_rewrite_after_a_refused_write_waits_for_a_sync_that_succeeds(
    small_disk: SmallDisk,
) -> None:
    """The same, with the daemon running on: its sync loop rewrites the file as soon as a
    write succeeds again, not only at the stop."""

    async def run() -> None:
        path = small_disk.dir / "journal"
        j = Journal(path, fsync_interval_s=0.001)
        syncing = asyncio.create_task(j.sync_forever())
        for i in range(1000):
            j.accept(task(i))
        j.flush()
        small_disk.fill(room=0)
        for i in range(1000):
            j.done(f"t{i}")
        j.flush()
        assert j.write_errors >= 1 and j.compactions == 0
        small_disk.free()
        j.accept(task(1002))
        for _ in range(500):
            if j.compactions:
                break
            await asyncio.sleep(0.002)
        assert j.compactions == 1
        syncing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await syncing
        j._file.close()  # (no close(): as a SIGKILL leaves it)
        assert replayed(path)[0] == ["t1002"]

    asyncio.run(run())


# -- damage the reader meets -----------------------------------------------------------------

FORMATS = ["checked", "0.3.5"]


def journal_of(path: Path, form: str, ops: list[tuple[str, Task | str]]) -> None:
    """Write ``ops`` (("accept", task) / ("done", id)) as this version does or as 0.3.5 did."""
    if form == "checked":
        j = Journal(path)
        for op, arg in ops:
            if op == "accept":
                assert isinstance(arg, Task)
                j.accept(arg)
            else:
                assert isinstance(arg, str)
                j.done(arg)
        j.close()
    else:
        write_before_checksums(
            path,
            [
                (1, encode(arg)) if isinstance(arg, Task) else (2, arg)
                for _, arg in ops  # (as 0.3.5: a DONE for an unfinished task only)
            ],
        )


@pytest.mark.parametrize("form", FORMATS)
def test_a_flipped_bit_in_a_length_loses_that_record_only(tmp_path: Path, form: str) -> None:
    """A length flipped upward put the records after it inside the record's body: t11..t16
    lost, t1..t10's DONEs unread (run again).  Now the record fails its checksum (a record of
    0.3.5: its body fails to decode as its kind) and the next record is looked for from the
    byte after its start."""
    path = tmp_path / "j"
    t0 = task(0, "p" * 300)  # a body of more than 255 bytes: a 2-byte length
    ops: list[tuple[str, Task | str]] = [("accept", task(i)) for i in range(1, 11)]
    ops += [("accept", t0)] + [("done", f"t{i}") for i in range(1, 11)]
    ops += [("accept", task(i)) for i in range(11, 41)]
    journal_of(path, form, ops)
    data = bytearray(path.read_bytes())
    data[body_at(data, t0) - 2] ^= 0x04  # the length's high byte: +1024
    path.write_bytes(bytes(data))
    ids, again = replayed(path)
    assert ids == [f"t{i}" for i in range(11, 41)]
    assert again.damaged_bytes > 0


PROMPT = ("Переведи на хорватский. В čem je problem? " + "Ovo je dugačak tekst. " * 20) * 4  # noqa: RUF001


@pytest.mark.parametrize("form", FORMATS)
def test_a_torn_last_record_is_cut_where_it_begins_even_where_its_text_reads_as_one(
    tmp_path: Path, form: str
) -> None:
    """Cyrillic Ve, a space and "č" are D0 92 20 C4 8D: 0x92, a kind, a bin8: it was taken for a record after the
    damage, so the torn record was not cut where it began, and the records the restarted
    daemon wrote next were read as its body (t21..t33 lost)."""
    path = tmp_path / "j"
    t0 = task(0, PROMPT)
    journal_of(path, form, [("accept", task(i)) for i in range(1, 21)] + [("accept", t0)])
    data = path.read_bytes()
    start = body_at(data, t0) - 5  # 0x9?, kind, 0xc5, length
    path.write_bytes(data[: start + 600])  # the crash left 600 bytes of it
    j = Journal(path)
    assert len(j.replay()) == 20
    assert path.stat().st_size == start
    for i in range(21, 61):
        j.accept(task(i))
    for i in range(1, 21):
        j.done(f"t{i}")
    j.close()
    ids, again = replayed(path)
    assert ids == [f"t{i}" for i in range(21, 61)]
    assert again.damaged_bytes == 0


def test_a_journal_written_before_checksums_replays_and_is_appended_to(tmp_path: Path) -> None:
    """A daemon upgraded in place replays the journal 0.3.5 wrote ([kind, body] records),
    deadlines and forwarders too, and appends its own records after them."""
    path = tmp_path / "j"
    enc = msgspec.msgpack.encode
    write_before_checksums(
        path,
        [
            (1, encode(task(1))),
            (4, enc(["t1", 1_000])),
            (1, encode(task(2))),
            (3, enc(["t2", "d7"])),
            (1, encode(task(3))),
            (9, b"a kind from a later version"),
            (2, "t3"),
        ],
    )
    j = Journal(path)
    assert [t.id for t in j.replay()] == ["t1", "t2"]
    assert j.deadlines == {"t1": 1_000} and j.forwarded == {"t2": "d7"}
    j.accept(task(4), 4_000)
    j.done("t1")
    j.close()
    ids, again = replayed(path)
    assert ids == ["t2", "t4"] and again.deadlines == {"t4": 4_000}
    assert again.forwarded == {"t2": "d7"} and again.damaged_bytes == 0


# A history of records: (op, i) with op accept/done; each op one or two records.
histories = st.lists(
    st.tuples(st.sampled_from(["accept", "done"]), st.integers(0, 12)), max_size=30
)


def model_of(ops: list[tuple[str, int]]) -> list[str]:
    open_: dict[str, None] = {}
    for op, i in ops:
        if op == "accept":
            open_.setdefault(f"t{i}", None)
        else:
            open_.pop(f"t{i}", None)
    return list(open_)


def write_history(path: Path, ops: list[tuple[str, int]]) -> list[tuple[int, int, tuple]]:
    """Journal ``ops``, one record each (accept: no deadline); each record's (start, end,
    op) in the file, the ops that wrote nothing (a DONE for no open task) left out."""
    j = Journal(path)
    spans: list[tuple[int, int, tuple]] = []
    for op, i in ops:
        j.flush()
        before = path.stat().st_size
        if op == "accept":
            j.accept(task(i, "q" * i))
        else:
            j.done(f"t{i}")
        j.flush()
        after = path.stat().st_size
        if after > before:
            spans.append((before, after, (op, i)))
    j.close()
    return spans


@settings(max_examples=150, deadline=None)
@given(histories, st.data())
def test_one_damaged_byte_loses_the_record_it_hits_and_no_other(
    ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    """Any one byte changed anywhere: replay is the history without the record that byte is
    in (a lost ACCEPT, or a DONE whose task runs again), never any other record; the
    damage is counted (the last record: cut, as a torn one is)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j"
        spans = write_history(path, ops)
        if not spans:
            return
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(raw))
        hit = next(k for k, (start, end, _) in enumerate(spans) if start <= at < end)
        if len(spans) == 1 and at == 0 and raw[0] not in (0x92, 0x93):  # no record, nor its head
            with pytest.raises(NotAJournal):  # (it may be another file: not cut, kept)
                replayed(path)
            assert path.read_bytes() == raw
            return
        ids, again = replayed(path)
        assert ids == model_of([op for k, (_, _, op) in enumerate(spans) if k != hit])
        if hit == len(spans) - 1:  # the last record: a torn tail, cut
            assert path.stat().st_size == spans[hit][0]
        else:
            assert again.damaged_bytes > 0


@settings(max_examples=150, deadline=None)
@given(histories, st.data())
def test_any_cut_replays_the_whole_records_before_it_and_what_is_appended_after(
    ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    """A crash may cut the file anywhere: replay is the history of the records wholly
    before the cut, the file is cut back to their end, and what is journaled next reads."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j"
        spans = write_history(path, ops)
        size = spans[-1][1] if spans else 0
        cut = data.draw(st.integers(0, size), label="cut")
        with path.open("r+b") as fh:
            fh.truncate(cut)
        whole = [op for start, end, op in spans if end <= cut]
        j = Journal(path)
        assert [t.id for t in j.replay()] == model_of(whole)
        assert path.stat().st_size == max([0] + [end for _, end, _ in spans if end <= cut])
        j.accept(task(99))
        j.close()
        ids, again = replayed(path)
        assert ids == model_of([*whole, ("accept", 99)]) and again.damaged_bytes == 0


# -- compaction ------------------------------------------------------------------------------


def test_a_compaction_whose_directory_sync_fails_after_the_rename_writes_to_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename had replaced the file when the directory's fsync raised (EIO): the journal
    acted as if the old file were kept and wrote on to it, unlinked (t100..t199 unreadable
    after a restart).  Now it writes to the new file whatever the directory's fsync says."""
    real_fsync = os.fsync
    failed: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    path = tmp_path / "journal"
    j = Journal(path, compact_bytes=4096)
    for i in range(100):
        j.accept(task(i, "x" * 100))
    for i in range(90):
        j.done(f"t{i}")
    j.compact()
    assert failed and j.compactions == 1
    assert os.fstat(j.fileno()).st_ino == path.stat().st_ino
    for i in range(100, 200):
        j.accept(task(i))
    j.close()
    assert replayed(path)[0] == [f"t{i}" for i in range(90, 200)]


def test_a_failed_compaction_says_it_is_one_and_names_the_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compaction refused (here: journal.tmp cannot be made) was logged as a full disk."""
    path = tmp_path / "journal"
    (tmp_path / "journal.tmp").mkdir()  # (what a read-only directory does, for root too)
    j = Journal(path, compact_bytes=4096)
    for i in range(10):
        j.accept(task(i))
    with caplog.at_level(logging.ERROR, logger="gossipd.ingress.journal"):
        j.compact()
    j.accept(task(10))
    j.close()
    assert j.compactions == 0 and j.write_errors == 1
    [record] = caplog.records
    assert "compact" in record.getMessage() and str(tmp_path) in record.getMessage()
    assert replayed(path)[0] == [f"t{i}" for i in range(11)]


# -- one daemon a journal --------------------------------------------------------------------


def test_a_second_journal_on_one_path_is_refused_also_after_a_compaction(tmp_path: Path) -> None:
    """Two daemons given one journal.path both replayed the same tasks (each ran them), and
    one's compaction unlinked the file the other wrote to."""
    path = tmp_path / "journal"
    a = Journal(path, compact_bytes=4096)
    with pytest.raises(JournalInUse, match=str(path)):
        Journal(path)
    for i in range(50):
        a.accept(task(i, "x" * 100))
        a.done(f"t{i}")
    a.compact()
    assert a.compactions == 1
    with pytest.raises(JournalInUse):
        Journal(path)
    a.accept(task(60))
    a.close()
    assert replayed(path)[0] == ["t60"]  # (free once closed)


def test_a_forked_child_that_outlives_its_daemon_does_not_hold_the_journal(
    tmp_path: Path,
) -> None:
    """vLLM forks its engine core, and a fork shares the journal's locked file: a daemon
    SIGKILLed while its engine core lived on left the lock held, and the daemon restarted
    stopped with JournalInUse (status 2).  A forked child now lets go of its copy."""
    path = tmp_path / "journal"
    code = (
        "import os, sys, time\n"
        "from gossipd.ingress.journal import Journal\n"
        f"j = Journal({str(path)!r})\n"
        "j.replay()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        # (after the at-fork hooks: it has let go; one write each, so that the two lines
        # cannot interleave on the shared pipe, as print's two writes can unbuffered)
        "    os.write(1, b'forked\\n')\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.write(1, b'%d\\n' % child)\n"
        "time.sleep(60)\n"
    )
    daemon = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    child = 0
    try:
        assert daemon.stdout is not None
        lines = {daemon.stdout.readline().strip() for _ in range(2)}  # (in either order)
        assert "forked" in lines, lines  # (under load the child may run after its parent)
        child = int(next(line for line in lines if line != "forked"))
        daemon.kill()  # SIGKILL: its child, the engine core, lives on
        daemon.wait(10)
        Journal(path).close()  # the restarted daemon takes its journal
    finally:
        daemon.kill()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_daemon_whose_journal_another_holds_stops_at_start_up_with_status_2(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    holder = Journal(path)
    try:
        proc = gossipd_cli(
            "run",
            "--set",
            f"journal.path={str(path)!r}",
            "--set",
            'gossip.bind=""',
            "--bind",
            "tcp://127.0.0.1:0",
            timeout_s=30,
        )
    finally:
        holder.close()
    assert proc.returncode == 2, proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("gossipd: cannot start:") and str(path) in last
    assert "another" in last and "Traceback" not in proc.stderr


# -- preflight -------------------------------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's own are its user's only)."""
    d = Path(tempfile.mkdtemp(prefix="gossipd-preflight-", dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d)


@contextlib.contextmanager
def as_another_user() -> Iterator[None]:
    """This process as nobody for the block (when it runs as root): real and effective ids,
    which os.access reads, and no supplementary groups; root again after, from the saved
    id.  In-process: a subprocess as nobody cannot import gossipd from a checkout that only
    root can read (CI's clone in a 0700 directory)."""
    if os.geteuid() != 0:
        yield
        return
    groups = os.getgroups()
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, 0)
    os.setresuid(NOBODY, NOBODY, 0)
    try:
        yield
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
        os.setgroups(groups)


def check_config_as_another_user(journal: Path) -> str:
    """What `gossipd check-config` (ops/preflight.py's check) says of ``journal`` as
    journal.path, as a user without root's privileges: the StartupError it stops with (exit
    status 2), or "" where it passes."""
    config = load_config(environ={}, overrides=[f"journal.path={str(journal)!r}"])
    with as_another_user():
        try:
            preflight.check(config, "n")
        except StartupError as exc:
            return str(exc)
    return ""


def _own(path: Path, mode: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("directory_read_only", "cannot compact it"),
        ("file_write_only", "not readable"),
        ("fine", ""),
    ],
)
def test_preflight_refuses_a_journal_it_could_not_replay_or_compact(
    shared_dir: Path, case: str, expected: str
) -> None:
    """A read-only directory passed (every compaction then failed: the file grew without
    bound), and so did a write-only file (replay raised PermissionError after binding: exit
    1, and systemd restarted it into the same error)."""
    state = shared_dir / "state"
    state.mkdir()
    journal = state / "journal"
    journal.touch()
    _own(journal, 0o200 if case == "file_write_only" else 0o600)
    if case != "directory_read_only":
        _own(state, 0o700)
    refusal = check_config_as_another_user(journal)
    if not expected:
        assert refusal == ""
        return
    assert "cannot open journal.path" in refusal and expected in refusal
    assert str(journal) in refusal
