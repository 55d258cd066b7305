"""The journal of accepted tasks: replay, torn tails, compaction (real files, real fsync)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import load_config
from gossipd.core.messages import ErrorCode, Result, Task, decode_reply
from gossipd.daemon import Daemon
from gossipd.ingress.journal import Journal
from tests.helpers import wait_until_async


def task(i: int, prompt: str = "p") -> Task:
    return Task(v=1, id=f"t{i}", prompt=prompt * (i % 7 + 1), reply_to="tcp://127.0.0.1:9")


def test_replay_returns_accepted_tasks_not_done_in_order(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j")
    for i in range(10):
        j.accept(task(i))
    for i in (1, 4, 9):
        j.done(f"t{i}")
    j.close()
    again = Journal(tmp_path / "j")
    assert [t.id for t in again.replay()] == [f"t{i}" for i in (0, 2, 3, 5, 6, 7, 8)]


def test_a_torn_tail_is_cut_and_later_records_stay_readable(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j")
    j.accept(task(1))
    j.close()
    with (tmp_path / "j").open("ab") as fh:
        fh.write(b"\x92\x01\xc5\x10")  # a record cut short by a crash
    j2 = Journal(tmp_path / "j")
    assert [t.id for t in j2.replay()] == ["t1"]
    j2.accept(task(2))
    j2.close()
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t1", "t2"]


def test_a_record_of_an_unknown_kind_is_skipped_not_taken_for_a_torn_tail(
    tmp_path: Path,
) -> None:
    """A later version may add record kinds: this one must read past them, not cut there."""
    import msgspec

    from gossipd.core.messages import encode

    j = Journal(tmp_path / "j")
    j.accept(task(1))
    j.close()
    with (tmp_path / "j").open("ab") as fh:
        fh.write(msgspec.msgpack.encode([9, b"from a later version"]))
        fh.write(msgspec.msgpack.encode([9, "t1"]))
        fh.write(msgspec.msgpack.encode([1, encode(task(2))]))  # a known record after them
    j2 = Journal(tmp_path / "j")
    assert [t.id for t in j2.replay()] == ["t1", "t2"]
    j2.accept(task(3))
    j2.done("t1")
    j2.close()
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t2", "t3"]


def test_compaction_keeps_only_unfinished_tasks(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j", compact_bytes=4096)
    for i in range(200):
        j.accept(task(i, "x" * 50))
    for i in range(195):
        j.done(f"t{i}")
    size_before = (tmp_path / "j").stat().st_size
    j.compact()
    j.close()
    assert (tmp_path / "j").stat().st_size < size_before / 10
    assert [t.id for t in Journal(tmp_path / "j").replay()] == [f"t{i}" for i in range(195, 200)]


def test_deadlines_survive_replay_and_compaction_and_leave_with_done(tmp_path: Path) -> None:
    """From 0.3.0 each task's deadline (ms since the epoch) is journaled beside it; a task
    journaled without one (before 0.3.0) replays with none."""
    j = Journal(tmp_path / "j")
    j.accept(task(1), 1_000)
    j.accept(task(2))  # as before 0.3.0
    j.accept(task(3), 3_000)
    j.done("t3")
    j.close()
    again = Journal(tmp_path / "j")
    assert [t.id for t in again.replay()] == ["t1", "t2"]
    assert again.deadlines == {"t1": 1_000}
    again.compact()
    again.close()
    third = Journal(tmp_path / "j")
    assert [t.id for t in third.replay()] == ["t1", "t2"] and third.deadlines == {"t1": 1_000}


def test_sync_forever_makes_records_durable_in_batches(tmp_path: Path) -> None:
    async def main() -> tuple[int, int]:
        j = Journal(tmp_path / "j", fsync_interval_s=0.01)
        runner = asyncio.create_task(j.sync_forever())
        for i in range(100):
            j.accept(task(i))
        await wait_until_async(lambda: j.syncs >= 1, 5, "the first fsync")
        syncs = j.syncs  # 1: that fsync covered all 100
        reader = Journal(tmp_path / "j")  # ...all on disk before this journal is closed
        durable = len(reader.replay())
        reader.close()
        runner.cancel()
        j.close()
        return syncs, durable

    syncs, durable = asyncio.run(main())
    assert durable == 100
    assert syncs == 1, "100 acceptances, one batch, one fsync"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["accept", "accept_by", "forwarded", "done"]), st.integers(0, 20)
        ),
        max_size=60,
    ),
    st.integers(0, 40),
    st.booleans(),
)
def test_replay_matches_a_model_whatever_the_history_and_cut(
    ops: list[tuple[str, int]], cut: int, compact: bool
) -> None:
    """Unfinished tasks in acceptance order, which of them a peer forwarded, and their
    deadlines, whatever the history, after a compaction too; any cut of the file replays without raising."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j"
        j = Journal(path)
        model: dict[str, None] = {}
        forwarded: dict[str, str] = {}
        deadlines: dict[str, int] = {}
        for kind, i in ops:
            if kind in ("accept", "accept_by"):
                deadline = 1000 + i if kind == "accept_by" else None
                j.accept(task(i), deadline)
                model.setdefault(f"t{i}", None)  # a re-accepted pending task keeps its place
                if deadline is not None:  # the latest acceptance's deadline
                    deadlines[f"t{i}"] = deadline
            elif kind == "forwarded":
                j.mark_forwarded(f"t{i}", f"d{i % 3}")
                if f"t{i}" in model:  # only an unfinished task is marked, once
                    forwarded.setdefault(f"t{i}", f"d{i % 3}")
            else:
                j.done(f"t{i}")
                model.pop(f"t{i}", None)
                forwarded.pop(f"t{i}", None)
                deadlines.pop(f"t{i}", None)
        if compact:
            j.compact()
        j.close()
        data = path.read_bytes()
        again = Journal(path)
        assert [t.id for t in again.replay()] == list(model)
        assert again.forwarded == forwarded
        assert again.deadlines == deadlines
        # Any cut of the file replays to a prefix-consistent state without raising.
        path.write_bytes(data[: max(0, len(data) - cut)])
        Journal(path).replay()


# -- a restart's replay (gossipd/ingress/replay.py) on a daemon that is built, not run -------


def _daemon_with_journal(path: Path, tasks: list[Task]) -> Daemon:
    journal = Journal(path)
    for t in tasks:
        journal.accept(t, int(time.time() * 1000) + 60_000)
    journal.close()
    config = load_config(
        environ={},
        overrides=[
            'ingress.bind="tcp://127.0.0.1:0"',
            'gossip.bind=""',
            f"journal.path={json.dumps(str(path))}",
            'metrics.bind=""',
        ],
    )
    return Daemon(config)


def test_a_replay_whose_daemon_began_to_stop_while_it_asked_leaves_the_tasks_for_next_start(
    tmp_path: Path,
) -> None:
    daemon = _daemon_with_journal(tmp_path / "j", [task(0), task(1)])
    try:
        assert daemon.replay is not None and daemon.journal is not None
        assert daemon.replay.read(fanout=False) == 2
        daemon.ingress.intake.begin_shutdown()  # a stop while the members were asked
        asyncio.run(daemon.replay.run(lambda: [], None))
        assert daemon.replay.outcomes == {"left_for_next_start": 2}
        assert daemon.ingress.intake.admission.pending == 0  # neither answered nor run
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t0", "t1"]


def test_a_task_sent_again_while_the_restart_asked_is_left_to_that_copy_and_its_record(
    tmp_path: Path,
) -> None:
    daemon = _daemon_with_journal(tmp_path / "j", [task(0), task(1)])
    try:
        assert daemon.replay is not None and daemon.journal is not None
        assert daemon.replay.read(fanout=False) == 2
        intake = daemon.ingress.intake
        intake.admit(task(0), time.monotonic(), answer=True)  # its producer's resubmission
        asyncio.run(daemon.replay.run(lambda: [], None))
        assert daemon.replay.outcomes == {"held_here": 1, "run": 1}
        assert intake.admission.pending == 2  # one copy of each, both queued
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert sorted(t.id for t in Journal(tmp_path / "j").replay()) == ["t0", "t1"]


def test_a_cancel_while_the_restart_asked_answers_the_task_cancelled_instead_of_running_it(
    tmp_path: Path,
) -> None:
    daemon = _daemon_with_journal(tmp_path / "j", [task(0), task(1)])
    frames: list[bytes] = []
    try:
        assert daemon.replay is not None and daemon.journal is not None
        # The tasks' reply address, served in-process (as the HTTP door's is): what they get.
        daemon.replies.deliver_locally("tcp://127.0.0.1:9", frames.append)
        assert daemon.replay.read(fanout=False) == 2
        intake = daemon.ingress.intake
        intake.handle_cancel("t0", "another-key")  # not its producer: changes nothing
        intake.handle_cancel("t0", "")  # its producer, while the members are asked
        asyncio.run(daemon.replay.run(lambda: [], None))
        assert daemon.replay.outcomes == {"cancelled": 1, "run": 1}
        assert intake.cancels == {"refused": 1, "here": 1}
        answers = [decode_reply(f) for f in frames]
        assert [(r.id, r.error.code) for r in answers if isinstance(r, Result) and r.error] == [
            ("t0", ErrorCode.CANCELLED)
        ]
        assert intake.admission.pending == 1  # t1 alone runs
        intake.handle_cancel("t9", "")  # after the replay: no task, as before
        assert intake.cancels["unknown"] == 1
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t1"]
