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
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.forwarder import HandedOff
from gossipd.core.messages import ErrorCode, Result, Task
from gossipd.engines.base import EngineDead
from gossipd.engines.stall import StallWatch
from gossipd.ingress.runner import Runner
from tests.test_forwarder import _forwarder, _forwards, _reply, _task
from tests.test_runner_hand_off import _runner_of


class _DeadEngine:
    """An engine that dies under every request it is given."""

    async def generate(self, request: object) -> AsyncIterator[object]:
        raise EngineDead("the engine's process died")
        yield  # (an async generator, as engines are)


@pytest.fixture
def runner() -> Iterator[Runner]:
    yield from _runner_of("engine.deaths_per_task_max=2")


def _run_once(runner: Runner, deaths_before: int) -> tuple[list[int], list[Result]]:
    """One task, ``deaths_before`` engines having died under it already, in a runner whose
    engine dies under it: the counts the rescue saw (one per call) and the answers sent."""
    offered: list[int] = []
    answers: list[Result] = []

    async def rescue(task: Task, received_at: float) -> bool:
        owned = runner.book.get(task.id)
        assert owned is not None
        offered.append(owned.engine_deaths)  # what the hand-off's Forward carries
        return True

    async def case() -> None:
        runner._engine = _DeadEngine()  # type: ignore[assignment]
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


# -- the stall watch --------------------------------------------------------------------------

# One look a health interval: (seconds since the last look, unfinished requests, steps made).
_looks = st.lists(
    st.tuples(
        st.floats(0.01, 5.0, allow_nan=False),
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
    quiet_since = 0.0  # the model: the last look that saw a step or an idle engine
    first = True
    for gap, unfinished, stepped in looks:
        now += gap
        steps += stepped
        said = watch.stalled(now, unfinished, steps)
        if first or unfinished == 0 or stepped:
            quiet_since = now
            assert not said
        else:
            assert said == (now - quiet_since >= timeout_s)
        first = False


def test_an_idle_engine_is_never_stalled_and_a_zero_timeout_never_says_so() -> None:
    watch = StallWatch(1.0)
    assert not any(watch.stalled(t / 10, 0, 7) for t in range(1001))  # idle up to 100 s
    assert watch.stalled(100.1, 1, 7) is False  # busy since the last look: the clock runs...
    assert watch.stalled(100.9, 1, 7) is False
    assert watch.stalled(101.0, 1, 7) is True  # ...1 s without a step
    assert watch.stalled(101.1, 1, 8) is False  # a step: fine again
    assert watch.stalled(102.0, 1, 8) is False and watch.stalled(102.1, 1, 8) is True
    off = StallWatch(0.0)
    assert not any(off.stalled(float(t), 5, 0) for t in range(100))
