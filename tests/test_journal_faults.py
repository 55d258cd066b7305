"""The journal where its file system or its operator gets it wrong (a review's findings): a
failed fsync, a file that is no journal, a stale or planted .tmp, a compaction that keeps
failing, a wall clock set back across a restart."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gossipd.core.messages import Task
from gossipd.ingress import journal as journal_module
from gossipd.ingress.journal import Journal, NotAJournal
from gossipd.ingress.replay import JournalReplay, Verdict
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import gossipd_cli, wait_until_async


def task(i: int, timeout_ms: int = 30_000) -> Task:
    return Task(v=1, id=f"t{i}", prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=timeout_ms)


def test_a_failed_fsync_has_the_journal_rewritten_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux marks the pages a failed fsync did not write clean: the next fsync succeeds
    without them.  Only a refused write had the file rewritten, so tasks accepted before an
    fsync's EIO were silently not durable; now any failed sync has it rewritten."""
    real_fsync = os.fsync
    failures = [OSError(errno.EIO, "Input/output error")]

    def fsync(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(journal_module, "SYNC_RETRY_S", 0.01)

    async def run() -> Journal:
        j = Journal(tmp_path / "j", fsync_interval_s=0.001)
        for i in range(3):
            j.accept(task(i))
        sync = asyncio.create_task(j.sync_forever())
        await wait_until_async(lambda: j.compactions == 1, 5.0, "the rewrite after the EIO")
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)
        j.close()
        return j

    j = asyncio.run(run())
    assert j.write_errors == 1 and j.syncs >= 1
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t0", "t1", "t2"]


def test_a_file_that_is_no_journal_is_refused_and_kept_not_cut_to_nothing(
    tmp_path: Path,
) -> None:
    """journal.path pointed at another file: no record in it reads as a torn tail, and
    replay cut the whole file to 0 bytes; now it is refused, whole, and `gossipd run`
    stops with exit 2 and why."""
    path = tmp_path / "gossipd.env"
    text = b"GOSSIPD_NODE__ID=gpu-3\nGOSSIPD_GOSSIP__SEEDS='[\"tcp://10.0.0.1:7946\"]'\n"
    path.write_bytes(text)
    j = Journal(path)
    with pytest.raises(NotAJournal) as refused:
        j.replay()
    j.close()
    assert "not one journal record" in str(refused.value) and path.read_bytes() == text
    proc = gossipd_cli(
        "run",
        "--set", f"journal.path={json.dumps(str(path))}",
        "--set", f"ingress.bind=tcp://127.0.0.1:{free_tcp_port()}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot start" in proc.stderr and "not one journal record" in proc.stderr
    assert "Traceback" not in proc.stderr and path.read_bytes() == text


def test_a_tmp_left_or_planted_beside_the_journal_is_replaced_never_written_through(
    tmp_path: Path,
) -> None:
    """The compaction opened NAME.tmp with O_TRUNC, following a link: a .tmp linked to
    another file had that file emptied and written with the journal, and the link renamed
    over the journal.  It is now removed first and made anew (O_EXCL, O_NOFOLLOW)."""
    victim = tmp_path / "precious"
    victim.write_bytes(b"not the journal's")
    (tmp_path / "j.tmp").symlink_to(victim)
    j = Journal(tmp_path / "j")
    for i in range(5):
        j.accept(task(i))
    j.done("t0")
    j.compact()
    j.close()
    assert j.compactions == 1 and victim.read_bytes() == b"not the journal's"
    assert not (tmp_path / "j").is_symlink() and not (tmp_path / "j.tmp").exists()
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t1", "t2", "t3", "t4"]


def test_a_compaction_that_keeps_failing_is_tried_again_after_a_pause_not_at_every_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a refused write the file is to be rewritten: every sync (each 10 ms) tried the
    whole rewrite again and logged an error each time (50 a second on a nearly full disk)."""
    tries: list[float] = []

    def write_tmp(self: Journal, tmp: Path, snapshot: object) -> Any:
        tries.append(time.monotonic())
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Journal, "_write_tmp", write_tmp)

    async def run() -> None:
        j = Journal(tmp_path / "j", fsync_interval_s=0.001)
        j._rewrite_due = True  # (as a refused write leaves it)
        sync = asyncio.create_task(j.sync_forever())
        for i in range(100):  # records keep coming: a sync every few ms
            j.accept(task(i))
            await asyncio.sleep(0.005)
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)

    with caplog.at_level(logging.ERROR, logger="gossipd.ingress.journal"):
        asyncio.run(run())
    assert len(tries) == 1, len(tries)
    assert sum("cannot be compacted" in r.getMessage() for r in caplog.records) == 1


def test_a_replayed_tasks_deadline_is_never_later_than_its_whole_timeout_from_now(
    tmp_path: Path,
) -> None:
    """received_at = now + (deadline - wall) - timeout: with the wall clock set back an hour
    across the restart, a task accepted with 1 s left came back with an hour and a second;
    now at most its whole timeout from the restart."""
    wall = time.time()
    j = Journal(tmp_path / "j")
    j.accept(task(1, timeout_ms=1000), deadline_ms=int((wall + 3600 + 1) * 1000))
    j.mark_forwarded("t1", "member-b")
    j.close()
    admitted: list[float] = []

    def admit(task: Task, received_at: float, **_: Any) -> Verdict:
        admitted.append(received_at)
        return Verdict.ADMIT

    intake = SimpleNamespace(
        admission=SimpleNamespace(knows=lambda _: False, shutting_down=False),
        admit=admit,
        book=SimpleNamespace(expect_withdraw=lambda *_: None),
    )
    clock = SimpleNamespace(monotonic=lambda: 500.0, wall=lambda: wall)
    replay = JournalReplay(
        Journal(tmp_path / "j"),
        intake,
        node="a",
        clock=clock,
        expect_members=False,  # type: ignore[arg-type]
    )
    assert replay.read(fanout=True) == 1
    assert admitted == [500.0]
