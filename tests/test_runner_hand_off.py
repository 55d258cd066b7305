"""The runner's drain hand-off (gossipd/ingress/runner.py take_queued, settle_stopped,
requeue) against withdrawals and cancels that land while a queued task is away being
offered elsewhere (gossipd/admin.py's drain and the daemon's shutdown offer them one by one)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gossipd.config import load_config
from gossipd.core.lifecycle import Abort
from gossipd.core.messages import Task
from gossipd.daemon import Daemon
from gossipd.ingress.runner import Runner


@pytest.fixture
def runner() -> Iterator[Runner]:
    config = load_config(
        environ={},
        overrides=[
            'ingress.bind="tcp://127.0.0.1:0"',
            'gossip.bind=""',
            'journal.path=""',
            'metrics.bind=""',
        ],
    )
    daemon = Daemon(config)
    try:
        yield daemon.ingress.runner
    finally:
        daemon._ctx.destroy(linger=0)


def _taken(runner: Runner, task_id: str) -> Task:
    task = Task(v=1, id=task_id, prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)
    _, owned = runner.book.offer(task, 0.0, 0.0, forwarder=b"A")
    runner.enqueue(owned)  # type: ignore[arg-type]
    assert [t.id for t, _ in runner.take_queued()] == [task_id]
    return task


def test_a_task_withdrawn_while_offered_elsewhere_leaves_when_no_member_took_it(
    runner: Runner,
) -> None:
    task = _taken(runner, "t1")
    assert runner.book.withdraw("t1", b"A") is Abort.ABORT  # no worker runs it: nothing to stop
    assert not runner.requeue(task)
    assert runner.book.get("t1") is None and runner.admission.pending == 0
    assert runner.results["withdrawn"] == 1


def test_a_task_cancelled_while_offered_elsewhere_is_answered_here_not_run_elsewhere(
    runner: Runner,
) -> None:
    async def drain_asks() -> None:  # (its answer goes out through the reply sender)
        task = _taken(runner, "t2")
        assert runner.book.cancel("t2") is Abort.ABORT  # no worker runs it: nothing to stop
        assert runner.settle_stopped(task)  # what the drain asks before offering it
        assert runner.book.get("t2") is None and runner.admission.pending == 0
        assert runner.results["cancelled"] == 1
        assert not runner.requeue(task)

    asyncio.run(drain_asks())


def test_a_task_not_stopped_is_offered_and_put_back_when_no_member_took_it(
    runner: Runner,
) -> None:
    task = _taken(runner, "t3")
    assert not runner.settle_stopped(task)
    assert runner.requeue(task)
    owned = runner.book.get("t3")
    assert owned is not None and runner.book.start(owned)  # a worker takes it here
