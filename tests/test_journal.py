"""The journal of accepted tasks: replay, torn tails, compaction (real files, real fsync)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import Config, load_config
from gossipd.core.codec import decode_reply
from gossipd.core.messages import ErrorCode, Result, Task, encode
from gossipd.daemon import Daemon
from gossipd.ingress.journal import Journal
from gossipd.ingress.journal_format import ACCEPT, DONE, RUNNING, Reader, record
from gossipd.ingress.runner import stop_workers
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


def test_damage_mid_file_is_skipped_and_counted_and_the_records_after_it_are_read(
    tmp_path: Path,
) -> None:
    """A stray byte between records was taken for a torn tail: the file was cut there, the
    records after it lost for good (t2) and a finished task run again (t1).  Now the bytes
    that are no record are skipped, counted and left in the file."""
    j = Journal(tmp_path / "j")
    j.accept(task(1))
    j.close()
    with (tmp_path / "j").open("ab") as fh:
        fh.write(b"\x00")  # damage
    j = Journal(tmp_path / "j")  # (appended to as it is: records follow the damage)
    j.accept(task(2))
    j.close()
    with (tmp_path / "j").open("ab") as fh:
        fh.write(record(DONE, "t1"))  # t1's DONE (that object never held t1)
    size = (tmp_path / "j").stat().st_size
    again = Journal(tmp_path / "j")
    assert [t.id for t in again.replay()] == ["t2"]
    assert again.damaged_bytes == 1 and (tmp_path / "j").stat().st_size == size


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "0.3.5"])
def test_an_accepted_task_that_does_not_decode_is_counted_and_the_rest_replayed(
    tmp_path: Path, checked: bool
) -> None:
    """Deep nesting in a task's body raised RecursionError out of replay (the daemon exited
    at every start, and systemd started it into the same file); a body that is no Task was
    skipped without a word.  In a journal of 0.3.5 (no checks) too: a record begins where
    each ends, so they are whole, their tasks unreadable."""
    deep = b"\x81\xa1x" + b"\x91" * 200_000 + b"\xc0"  # {"x": [[[...]]]}
    bodies = [encode(task(1)), deep, b"\x01", encode(task(2))]  # (b"\x01": no Task)
    with (tmp_path / "j").open("wb") as fh:
        for body in bodies:
            fh.write(record(ACCEPT, body) if checked else msgspec.msgpack.encode([1, body]))
    again = Journal(tmp_path / "j")
    assert [t.id for t in again.replay()] == ["t1", "t2"]
    assert again.unreadable_tasks == 2 and again.damaged_bytes == 0


def test_a_full_disk_is_counted_and_the_journal_goes_on_without_raising() -> None:
    """/dev/full refuses every write with ENOSPC: a large record's write, the sync and the
    close each raised (inside the intake: an admitted task never queued; in sync_forever:
    the daemon exited; at close: the rest of the stop skipped)."""

    async def run() -> Journal:
        j = Journal("/dev/full", fsync_interval_s=0.001)
        j.accept(task(1, prompt="x" * 100_000))  # larger than the buffer: written at once
        j.accept(task(2))  # buffered: the sync's flush fails
        sync = asyncio.create_task(j.sync_forever())
        await wait_until_async(lambda: j.write_errors >= 2, 5.0, "the sync's failure")
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)
        j.close()
        return j

    j = asyncio.run(run())
    assert j.write_errors >= 3 and j.syncs == 0
    assert j.unfinished == 2  # the tasks themselves go on (not durable)


def test_a_record_of_an_unknown_kind_is_skipped_not_taken_for_a_torn_tail(
    tmp_path: Path,
) -> None:
    """A later version may add record kinds: this one must read past them, not cut there."""
    j = Journal(tmp_path / "j")
    j.accept(task(1))
    j.close()
    with (tmp_path / "j").open("ab") as fh:
        fh.write(record(9, b"from a later version"))
        fh.write(record(9, "t1"))
        fh.write(record(ACCEPT, encode(task(2))))  # a known record after them
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


def test_a_task_running_when_the_daemon_went_down_replays_with_one_more_death(
    tmp_path: Path,
) -> None:
    """RUNNING records: a task an engine was given, unfinished at the restart, had its
    daemon die under it (``died_under``: the last start's count + 1); one only queued has no
    count; one finished has none; compaction keeps the count."""
    j = Journal(tmp_path / "j")
    for i in range(4):
        j.accept(task(i))
    j.started("t0", 0)
    j.started("t1", 1)  # handed here by a member whose engine died under it
    j.started("t3", 0)
    j.done("t3")
    j.started("t9", 0)  # (not accepted here: nothing to record)
    j.close()
    again = Journal(tmp_path / "j")
    assert [t.id for t in again.replay()] == ["t0", "t1", "t2"]
    assert again.died_under == {"t0": 1, "t1": 2}  # t2 only waited
    again.compact()
    again.close()
    third = Journal(tmp_path / "j")
    third.replay()
    assert third.died_under == {"t0": 1, "t1": 2}


def test_a_resent_copy_keeps_the_count_and_a_held_result_counts_no_death(tmp_path: Path) -> None:
    """A producer's resend of a replayed task, admitted fresh (0 deaths) while the restart
    asked, wrote RUNNING 0 over the count: a task that kills its daemon then looped for
    ever.  And a task whose Result was held for its forwarder's word (off the engine, no
    DONE yet) counted a death at the next restart, and could be answered engine_error."""
    path = tmp_path / "j"
    j = Journal(path)
    j.accept(task(1))
    j.accept(task(2))
    j.started("t1", 0)
    j.started("t2", 0)
    j.off_engine("t2")  # its Result held
    j.close()
    again = Journal(path)
    again.replay()
    assert again.died_under == {"t1": 1}
    again.accept(task(1))  # the resend, admitted while the restart asked
    again.started("t1", 0)
    again.close()
    third = Journal(path)
    assert [t.id for t in third.replay()] == ["t1", "t2"]
    assert third.died_under == {"t1": 2}


def test_a_replayed_tasks_running_record_is_written_at_once_a_first_runs_at_the_sync(
    tmp_path: Path,
) -> None:
    """A task that kills its daemon within the sync's 10 ms must still leave its RUNNING
    record behind once it has been replayed (else it is replayed without a count for ever);
    a first run's waits for the batch like every other record."""
    path = tmp_path / "j"
    j = Journal(path)
    j.accept(task(1))
    j.accept(task(2))
    j.flush()
    j.close()
    again = Journal(path)
    again.replay()
    size = path.stat().st_size
    again.accept(task(3))
    again.started("t3", 0)  # a first run: buffered
    assert path.stat().st_size == size
    again.started("t1", 0)  # replayed: written out (with what was buffered before it)
    written = path.stat().st_size
    assert written > size
    runs = [r.value for r in Reader(path.read_bytes()) if r.kind == RUNNING]
    assert runs == [("t3", 0), ("t1", 0)]
    again.done("t1")
    again.accept(task(4))
    again.started("t4", 1)  # a count already: written out too
    assert path.stat().st_size > written


def test_sync_forever_makes_records_durable_in_batches(tmp_path: Path) -> None:
    async def main() -> tuple[int, int]:
        j = Journal(tmp_path / "j", fsync_interval_s=0.01)
        runner = asyncio.create_task(j.sync_forever())
        for i in range(100):
            j.accept(task(i))
        await wait_until_async(lambda: j.syncs >= 1, 5, "the first fsync")
        syncs = j.syncs  # 1: that fsync covered all 100
        # ...all on disk before this journal is closed
        durable = sum(r.kind == ACCEPT for r in Reader((tmp_path / "j").read_bytes()))
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
            st.sampled_from(["accept", "accept_by", "forwarded", "started", "held", "done"]),
            st.integers(0, 20),
        ),
        max_size=60,
    ),
    st.integers(0, 40),
    st.booleans(),
)
def test_replay_matches_a_model_whatever_the_history_and_cut(
    ops: list[tuple[str, int]], cut: int, compact: bool
) -> None:
    """Unfinished tasks in acceptance order, which of them a peer forwarded, their
    deadlines, and the deaths under those an engine was given, whatever the history, after a
    compaction too; any cut of the file replays without raising."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j"
        j = Journal(path)
        model: dict[str, None] = {}
        forwarded: dict[str, str] = {}
        deadlines: dict[str, int] = {}
        runs: dict[str, int] = {}
        for n, (kind, i) in enumerate(ops):
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
            elif kind == "started":
                j.started(f"t{i}", n % 3)
                if f"t{i}" in model:  # the last start's count
                    runs[f"t{i}"] = n % 3
            elif kind == "held":  # off the engine, its Result held
                j.off_engine(f"t{i}")
                runs.pop(f"t{i}", None)
            else:
                j.done(f"t{i}")
                model.pop(f"t{i}", None)
                forwarded.pop(f"t{i}", None)
                deadlines.pop(f"t{i}", None)
                runs.pop(f"t{i}", None)
        if compact:
            j.compact()
        j.close()
        data = path.read_bytes()
        again = Journal(path)
        assert [t.id for t in again.replay()] == list(model)
        assert again.forwarded == forwarded
        assert again.deadlines == deadlines
        assert again.runs == runs
        assert again.died_under == {task_id: deaths + 1 for task_id, deaths in runs.items()}
        again.close()
        # Any cut of the file replays to a prefix-consistent state without raising.
        path.write_bytes(data[: max(0, len(data) - cut)])
        Journal(path).replay()


# -- a restart's replay (gossipd/ingress/replay.py) on a daemon that is built, not run -------


def _daemon_with_journal(path: Path, tasks: list[Task], *overrides: str) -> Daemon:
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
            *overrides,
        ],
    )
    return Daemon(config)


def test_a_restart_with_seeds_waits_journal_replay_join_wait_s_for_a_first_member(
    tmp_path: Path,
) -> None:
    """Nobody live: the question waits the configured join wait (not the default 2 s), then
    runs the tasks."""
    daemon = _daemon_with_journal(
        tmp_path / "j",
        [task(0), task(1)],
        'gossip.seeds=["tcp://127.0.0.1:9"]',  # a seed other than itself: members expected
        "journal.replay_join_wait_s=0.3",
    )
    try:
        assert daemon.replay is not None and daemon.journal is not None
        assert daemon.replay.read(fanout=False) == 2
        began = time.monotonic()
        asyncio.run(daemon.replay.run(lambda: [], lambda member, tasks: True))
        waited = time.monotonic() - began
        assert daemon.replay.outcomes == {"run": 2}
        assert 0.3 <= waited < 1.5, waited  # the default would be 2 s
        daemon.ingress.intake.begin_shutdown()
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)


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


def _results(frames: list[bytes]) -> dict[str, str]:
    """The Results among ``frames``: task id -> "ok" or its error code."""
    answers = [decode_reply(f) for f in frames]
    return {r.id: (r.error.code if r.error else "ok") for r in answers if isinstance(r, Result)}


def _restart_and_answer(daemon: Daemon, frames: list[bytes], answers: int) -> None:
    """The restart's replay with one worker, until ``answers`` Results are in ``frames``;
    then the workers stop as the daemon stops them."""

    async def restart() -> None:
        assert daemon.replay is not None
        await daemon.engine.start()
        worker = asyncio.create_task(daemon.ingress.runner.work_forever())
        try:
            await daemon.replay.run(lambda: [], None)
            await wait_until_async(lambda: len(_results(frames)) == answers, 10, "the answers")
        finally:  # as the daemon stops its workers
            daemon.ingress.intake.begin_shutdown()
            await stop_workers([worker])
            await daemon.engine.stop()

    asyncio.run(restart())


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
        _restart_and_answer(daemon, frames, 2)
        assert daemon.replay.outcomes == {"cancelled": 1, "run": 1}
        assert intake.cancels == {"refused": 1, "here": 1}
        assert _results(frames) == {"t0": ErrorCode.CANCELLED, "t1": "ok"}
        # Answered as a queued task's Cancel is: from the results cache to a resubmission.
        assert intake.admit(task(0), time.monotonic(), answer=True).name == "DUPLICATE_DONE"
        intake.handle_cancel("t9", "")  # after the replay: no task, as before
        assert intake.cancels["unknown"] == 1
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert Journal(tmp_path / "j").replay() == []  # both ended: neither runs again


def test_a_cancel_while_the_restart_asked_holds_for_the_producers_resent_copy(
    tmp_path: Path,
) -> None:
    """PROTOCOL.md: a Cancel for a task waiting for the members' answers is kept and the
    task answered cancelled.  When the producer resent it meanwhile, that copy was taken
    ("held_here") and ran, answering ok: the Cancel was counted and lost."""
    daemon = _daemon_with_journal(tmp_path / "j", [task(0)])
    frames: list[bytes] = []
    try:
        assert daemon.replay is not None and daemon.journal is not None
        daemon.replies.deliver_locally("tcp://127.0.0.1:9", frames.append)
        assert daemon.replay.read(fanout=False) == 1
        intake = daemon.ingress.intake
        intake.handle_cancel("t0", "")  # its producer, while the members are asked
        resent = msgspec.structs.replace(task(0), attempt=1)
        assert intake.admit(resent, time.monotonic(), answer=True).name == "ADMIT"
        _restart_and_answer(daemon, frames, 1)
        assert daemon.replay.outcomes == {"held_here": 1}
        assert _results(frames) == {"t0": ErrorCode.CANCELLED}
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)


def test_a_stop_ends_the_restarts_question_at_once(tmp_path: Path) -> None:
    """The question waits up to 2 s for a first member (3 s in all): a stop meanwhile ends it
    at once, so the daemon's stop can wait for it to settle its tasks before it hands its
    queue off and flushes its replies."""
    from gossipd.ingress.replay import JournalReplay

    daemon = _daemon_with_journal(tmp_path / "j", [task(0)])
    try:
        assert daemon.journal is not None
        replay = JournalReplay(
            daemon.journal,
            daemon.ingress.intake,
            node=daemon.node,
            clock=daemon.clock,
            expect_members=True,  # seeds to join: it waits for a first member
        )
        assert replay.read(fanout=False) == 1

        async def restart() -> float:
            asyncio.get_running_loop().call_later(0.1, daemon.ingress.intake.begin_shutdown)
            started = time.monotonic()
            await replay.run(lambda: [], lambda member, tasks: True)
            return time.monotonic() - started

        assert asyncio.run(restart()) < 1.0
        assert replay.outcomes == {"left_for_next_start": 1}
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t0"]


def test_a_cancel_while_the_restart_asked_goes_on_to_the_member_that_holds_the_task(
    tmp_path: Path,
) -> None:
    from gossipd import __version__
    from gossipd.core.gossip_messages import GpuState
    from gossipd.core.messages import Cancel
    from gossipd.core.peer_messages import ReplayKnown
    from gossipd.membership.gossip import MemberView

    daemon = _daemon_with_journal(tmp_path / "j", [task(0), task(1)])
    member = MemberView(
        "m1", "alive", 1, "tcp://127.0.0.1:1", GpuState(software_version=__version__)
    )
    passed: list[tuple[str, object]] = []
    try:
        replay = daemon.replay
        assert replay is not None and daemon.journal is not None
        assert replay.read(fanout=True) == 2
        daemon.ingress.intake.handle_cancel("t0", "")

        def ask(to: str, tasks: list[tuple[str, str]]) -> bool:
            # m1 holds t0 (its producer resubmitted it there while we were down)
            known = ReplayKnown(node=to, known=[i for i, _ in tasks if i == "t0"])
            asyncio.get_running_loop().call_soon(replay.on_known, known, True)
            return True

        async def restart() -> None:
            await replay.run(lambda: [member], ask, pass_cancel=lambda m, c: passed.append((m, c)))

        asyncio.run(restart())
        assert replay.outcomes == {"known_elsewhere": 1, "run": 1}
        assert passed == [("m1", Cancel(v=1, id="t0", producer_key=""))]
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)
    assert [t.id for t in Journal(tmp_path / "j").replay()] == ["t1"]  # t0: m1 answers it


def test_a_member_placement_cannot_reach_yet_is_asked_once_it_can_not_taken_for_one_that_holds_nothing(
    tmp_path: Path,
) -> None:
    """A restarted daemon learns a member from gossip a moment before placement knows its
    rpc address.  Asked in between, the send failed, the member counted as holding nothing,
    and the task it had answered for the producer ran again here (CI: a second answer, in
    tests/test_fanout.py's restart test).  Now it is asked once placement can reach it."""
    from gossipd import __version__
    from gossipd.core.gossip_messages import GpuState
    from gossipd.core.peer_messages import ReplayKnown
    from gossipd.membership.gossip import MemberView

    daemon = _daemon_with_journal(
        tmp_path / "j",
        [task(0)],
        'gossip.seeds=["tcp://127.0.0.1:9"]',  # members expected
    )
    member = MemberView(
        "m1", "alive", 1, "tcp://127.0.0.1:1", GpuState(software_version=__version__)
    )
    looks = 0

    def can_ask(to: str) -> bool:  # placement learns m1's address at the third look
        nonlocal looks
        looks += 1
        return looks >= 3

    try:
        replay = daemon.replay
        assert replay is not None and daemon.journal is not None
        assert replay.read(fanout=True) == 1

        def ask(to: str, tasks: list[tuple[str, str]]) -> bool:
            assert looks >= 3, "asked before placement could reach it"
            known = ReplayKnown(node=to, known=[i for i, _ in tasks])  # m1 answered t0
            asyncio.get_running_loop().call_soon(replay.on_known, known, True)
            return True

        asyncio.run(replay.run(lambda: [member], ask, can_ask=can_ask))
        assert replay.outcomes == {"known_elsewhere": 1}  # not run again here
        daemon.journal.close()
    finally:
        daemon._ctx.destroy(linger=0)


def test_a_restart_expects_members_only_from_a_seed_that_is_not_itself() -> None:
    """A lone daemon bound to every interface that lists itself as a seed by the address it
    advertises does not wait for members at a restart (it compared the seed with the bind
    only, and waited 2 s); a seed elsewhere, by name or by address, is waited for."""
    from gossipd.ingress.replay import expects_members

    def config(bind: str, advertise: str, *seeds: str) -> Config:
        return load_config(
            environ={},
            overrides=[
                f"gossip.bind={json.dumps(bind)}",
                f"gossip.advertise={json.dumps(advertise)}",
                f"gossip.seeds={json.dumps(seeds)}",
            ],
        )

    wild, mine = "tcp://0.0.0.0:7946", "tcp://10.0.0.5:7946"
    assert not expects_members(config(wild, mine, mine), "d0")
    assert not expects_members(config(mine, "", mine), "d0")
    assert not expects_members(config(wild, mine, "d0@tcp://10.9.9.9:7946"), "d0")
    assert expects_members(config(wild, mine, "tcp://10.0.0.6:7946"), "d0")
    assert expects_members(config(wild, mine, mine, "tcp://10.0.0.5:7947"), "d0")
    assert expects_members(config(wild, mine, "d1@" + mine), "d0")


def test_the_journals_damage_is_in_the_metrics(tmp_path: Path) -> None:
    """The damage replay skipped, as Prometheus sees it (gossipd_journal_errors_total)."""
    path = tmp_path / "j"
    daemon = _daemon_with_journal(path, [task(1)])
    daemon._ctx.destroy(linger=0)
    assert daemon.journal is not None
    daemon.journal.close()
    with path.open("ab") as fh:
        fh.write(b"\x00\x00" + record(ACCEPT, b"\x01"))  # damage, a bad task
    after = Journal(path)
    after.accept(task(2))  # (a record after them: the damage is mid-file)
    after.close()
    daemon = _daemon_with_journal(path, [])
    try:
        assert daemon.replay is not None and daemon.replay.read(fanout=False)
        text = daemon._metrics_text().decode()
    finally:
        daemon._ctx.destroy(linger=0)
    assert 'gossipd_journal_errors_total{kind="damaged_bytes"} 2.0' in text
    assert 'gossipd_journal_errors_total{kind="unreadable_tasks"} 1.0' in text
    assert 'gossipd_journal_errors_total{kind="write"} 0.0' in text


def test_replay_holds_the_unfinished_tasks_in_memory_not_the_whole_file(tmp_path: Path) -> None:
    """A 16 MiB journal of tasks that all finished but one: replay's Python allocations stay
    far under the file's size (the file is mapped: its pages are the page cache's, not the
    daemon's heap; it was read whole into one bytes object before)."""
    import tracemalloc

    path = tmp_path / "j"

    async def write() -> None:
        journal = Journal(path, compact_bytes=1 << 40)
        for i in range(4_000):
            journal.accept(task(i, prompt="x" * 4_000))
            if i != 1_234:
                journal.done(f"t{i}")
        journal.close()

    asyncio.run(write())
    assert path.stat().st_size > 16 * 2**20
    journal = Journal(path)
    tracemalloc.start()
    try:
        replayed = journal.replay()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        journal.close()
    assert [t.id for t in replayed] == ["t1234"]
    assert peak < 2 * 2**20, peak
