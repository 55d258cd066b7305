"""A task that engines die under, and an engine that stops stepping.

- ``engine.deaths_per_task_max``: a dead engine's running task is handed to another member
  (runner.py's rescue) only while fewer engines than that have died under it; the count
  travels with the hand-off (``Forward.engine_deaths``), so that one task that kills engines
  (a query of death) takes down at most that many, not the whole cluster one by one.
- ``engine.stall_timeout_s``: engines/stall.py says when an engine holding requests has made
  no step for that long.

The real thing, vLLM engine cores SIGSTOPped and SIGKILLed under a task across three
daemons, is tests/test_vllm_death.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.config import load_config
from gossipd.core.journeys import HandedOff
from gossipd.core.messages import ErrorCode, Result, Task
from gossipd.core.peer_messages import Forward
from gossipd.daemon import Daemon
from gossipd.engines.base import EngineDead, EngineNotRunning
from gossipd.engines.stall import StallWatch
from gossipd.fanout.owner import OwnerEndpoint
from gossipd.ingress.runner import Runner
from gossipd.looppeer import LoopPeerServer
from tests.helpers import wait_until
from tests.test_forwarder import _forwarder, _forwards, _reply, _task
from tests.test_runner_hand_off import _runner_of


class _DeadEngine:
    """An engine that dies under every request it is given (``before``: it was dead
    already when the request came)."""

    def __init__(self, before: bool = False) -> None:
        self.before = before

    async def generate(self, request: object) -> AsyncIterator[object]:
        if self.before:
            raise EngineNotRunning("the engine is not running")
        raise EngineDead("the engine's process died")
        yield  # (an async generator, as engines are)


@pytest.fixture
def runner() -> Iterator[Runner]:
    yield from _runner_of("engine.deaths_per_task_max=2")


def _run_once(
    runner: Runner, deaths_before: int, *, dead_before: bool = False
) -> tuple[list[int], list[Result]]:
    """One task, ``deaths_before`` engines having died under it already, in a runner whose
    engine dies under it (or was dead before it came: ``dead_before``): the counts the
    rescue saw (one per call) and the answers sent."""
    offered: list[int] = []
    answers: list[Result] = []

    async def rescue(task: Task, received_at: float) -> bool:
        owned = runner.book.get(task.id)
        assert owned is not None
        offered.append(owned.engine_deaths)  # what the hand-off's Forward carries
        return True

    async def case() -> None:
        runner._engine = _DeadEngine(dead_before)  # type: ignore[assignment]
        runner._links.rescue = rescue
        runner.on_finished.append(lambda owned, result: answers.append(result))
        worker = asyncio.create_task(runner.work_forever())
        task = Task(v=1, id="q1", prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)
        now = time.monotonic()
        _, owned = runner.book.offer(task, now, now)
        assert owned is not None
        owned.engine_deaths = deaths_before
        runner.enqueue(owned)
        for _ in range(200):
            if runner.admission.pending == 0:
                break
            await asyncio.sleep(0.005)
        assert runner.admission.pending == 0
        worker.cancel()

    asyncio.run(case())
    return offered, answers


def test_a_first_engine_death_hands_the_task_on_with_its_count(runner: Runner) -> None:
    offered, answers = _run_once(runner, deaths_before=0)
    assert offered == [1] and answers == []
    assert runner.results["handed_off_engine_dead"] == 1 and runner.not_handed_on == 0


def test_a_task_that_saw_its_second_engine_die_is_answered_and_not_handed_on(
    runner: Runner,
) -> None:
    """It came here handed off by a member whose engine died under it; ours dies too."""
    offered, answers = _run_once(runner, deaths_before=1)
    assert offered == []  # no other member's engine is risked on it
    [result] = answers
    assert not result.ok and result.error is not None
    assert result.error.code == ErrorCode.ENGINE_ERROR.value
    assert "2nd engine to die under it" in result.error.message
    assert "engine.deaths_per_task_max 2" in result.error.message
    assert runner.not_handed_on == 1 and runner.results["handed_off_engine_dead"] == 0


def test_a_task_that_only_waited_while_the_engine_died_is_handed_on_uncounted(
    runner: Runner,
) -> None:
    """Workers take queued tasks until the drain takes the rest: the engine, dead already,
    refuses them (EngineNotRunning).  They never ran in it: handed on, their count as it
    was (before, each such task counted a death: at the bound, answered engine_error)."""
    offered, answers = _run_once(runner, deaths_before=1, dead_before=True)
    assert offered == [1] and answers == [] and runner.not_handed_on == 0


def test_one_death_allowed_never_hands_a_running_task_on() -> None:
    for r in _runner_of("engine.deaths_per_task_max=1"):
        offered, answers = _run_once(r, deaths_before=0)
        assert offered == [] and len(answers) == 1 and r.not_handed_on == 1


def test_the_hand_off_carries_the_count_in_its_forward() -> None:
    fw, _ = _forwarder(["me", "a"], attempts_max=3)
    fw.hand_off(_task(), 0.0, 0.0, engine_deaths=1)
    [(_, fwd)] = _forwards(fw.take_outbox())
    assert fwd.engine_deaths == 1
    fw.on_reply(_reply(fwd, "a", True), 0.01)
    assert fw.take_events() == [HandedOff(_task(), True, "a")]
    fw.route(_task(1), 0.0)  # an ordinary forward says none
    assert all(f.engine_deaths == 0 for _, f in _forwards(fw.take_outbox()))


def test_a_migration_or_a_moved_keeps_the_count() -> None:
    """The count lives in the forwarder's ledger too: when the member that took a dead
    engine's task dies in turn, the migration's Forward carries it (before: 0, and the task
    could take two more engines); a Moved that tells an entry its task's new member brings
    the count with it, and that member's death migrates it with the count."""
    fw, placement = _forwarder(["me", "a", "b"], attempts_max=3)
    fw.hand_off(_task(), 0.0, 0.0, engine_deaths=1)
    [(addr, fwd)] = _forwards(fw.take_outbox())
    taker = addr.removeprefix("addr-")
    fw.on_reply(_reply(fwd, taker, True), 0.01)
    placement.members.remove(taker)
    placement.members.remove("me")  # (unhealthy: placement leaves it out)
    assert fw.member_dead(taker, 1.0) == 1
    [(_, again)] = _forwards(fw.take_outbox())
    assert again.engine_deaths == 1 and again.task.id == "t0"

    entry, placement = _forwarder(["a", "b", "c", "e"], me="e")  # (the first owns)
    entry.route(_task(), 0.0)
    [(_, first)] = _forwards(entry.take_outbox())
    entry.on_reply(_reply(first, "a", True), 0.01)
    assert entry.moved("t0", "a", "b", engine_deaths=1)  # a's engine died under it
    placement.members.remove("a")
    placement.members.remove(to := "b")
    assert entry.member_dead(to, 1.0) == 1
    [(_, migrated)] = _forwards(entry.take_outbox())
    assert migrated.engine_deaths == 1


def test_the_descendants_of_a_process_are_found_below_it() -> None:
    """What abandon() kills with a hung engine core: its workers too (tensor parallelism),
    found through /proc before the core dies."""
    from gossipd.engines.vllm import _descendants

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30; wait"])
    try:
        wait_until(lambda: len(_descendants(shell.pid)) == 2, 10, "both sleeps to start")
        assert all(pid != shell.pid for pid in _descendants(shell.pid))
        assert shell.pid in _descendants(os.getpid())
    finally:
        for pid in _descendants(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait()


# -- the stall watch --------------------------------------------------------------------------

# One look a health interval: (seconds since the last look, unfinished requests, steps made).
_looks = st.lists(
    st.tuples(
        st.floats(0.01, 2.0, allow_nan=False),
        st.integers(0, 3),
        st.booleans(),
    ),
    max_size=60,
)


@given(_looks, st.floats(0.5, 20.0))
def test_stalled_exactly_when_requests_waited_the_timeout_without_a_step(
    looks: list[tuple[float, int, bool]], timeout_s: float
) -> None:
    watch = StallWatch(timeout_s)
    now, steps = 0.0, 0
    # The model: the last look that saw a step or an idle engine, or came late (the daemon's
    # loop held up for half the timeout or more).
    quiet_since = 0.0
    first = True
    for gap, unfinished, stepped in looks:
        now += gap
        steps += stepped
        said = watch.stalled(now, unfinished, steps)
        if first or unfinished == 0 or stepped or gap >= timeout_s / 2:
            quiet_since = now
            assert not said
        else:
            assert said == (now - quiet_since >= timeout_s)
        first = False


def test_an_idle_engine_is_never_stalled_and_a_zero_timeout_never_says_so() -> None:
    watch = StallWatch(1.0)
    assert not any(watch.stalled(t / 10, 0, 7) for t in range(1001))  # idle up to 100 s
    # Busy from 100.1 s on, a look each 0.1 s: the count runs from the last idle look...
    said = [watch.stalled(t / 10, 1, 7) for t in range(1001, 1011)]
    assert said == [False] * 9 + [True]  # ...1 s without a step at 101.0 s
    assert watch.stalled(101.1, 1, 8) is False  # a step: fine again
    assert not any(watch.stalled(t / 10, 1, 8) for t in range(1012, 1021))
    assert watch.stalled(102.1, 1, 8) is True
    assert watch.stalled(102.7, 1, 8) is False  # a late look (the loop held up 0.6 s)
    off = StallWatch(0.0)
    assert not any(off.stalled(float(t), 5, 0) for t in range(100))


def test_a_forward_counts_deaths_only_on_the_same_producers_admitted_task() -> None:
    """An owner takes a Forward's engine_deaths onto the task it admitted (or holds as the
    same task, pending); never onto another producer's task of the same id, which the
    Forward was refused for (id_in_use): any peer could otherwise have a task answered
    engine_error at its first engine death."""
    overrides = ['ingress.bind="tcp://127.0.0.1:0"', 'gossip.bind=""', 'journal.path=""']
    config = load_config(environ={}, overrides=[*overrides, 'metrics.bind=""'])
    daemon = Daemon(config)  # (built, not run: its ingress admits what the owner takes)
    try:
        owner = OwnerEndpoint(
            config.fanout,
            server=LoopPeerServer(message_bytes_max=1 << 20),
            node="o",
            ingress=daemon.ingress,
            send_to_member=lambda member, done: None,
            on_peer_done=lambda msg: None,
        )

        async def case() -> None:  # (the owner queues its replies on the running loop)
            key_a, key_b = "a" * 40, "b" * 40
            mine = Task(v=1, id="x", prompt="p", reply_to="tcp://127.0.0.1:9", producer_key=key_a)
            theirs = msgspec.structs.replace(mine, producer_key=key_b)
            owner._on_forward(b"m1", Forward(req=1, src="m1", task=mine, remaining_ms=5000))
            entry = owner.intake_entry("x")
            assert entry is not None and entry.engine_deaths == 0
            hostile = Forward(req=2, src="m2", task=theirs, remaining_ms=5000, engine_deaths=1000)
            owner._on_forward(b"m2", hostile)
            assert entry.engine_deaths == 0  # refused id_in_use: not counted
            again = Forward(req=3, src="m1", task=mine, remaining_ms=5000, engine_deaths=1)
            owner._on_forward(b"m1", again)  # the same task, pending: its count is taken
            assert entry.engine_deaths == 1

        asyncio.run(case())
    finally:
        daemon._ctx.destroy(linger=0)
