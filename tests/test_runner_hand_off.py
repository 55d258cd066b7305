"""The runner's drain hand-off (gossipd/ingress/runner.py take_queued / requeue) against
withdrawals and cancels that land while a queued task is away being offered elsewhere."""

from __future__ import annotations

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


def test_a_task_cancelled_while_offered_elsewhere_runs_here_to_its_cancelled_answer(
    runner: Runner,
) -> None:
    task = _taken(runner, "t2")
    assert runner.book.cancel("t2") is Abort.ABORT
    assert runner.requeue(task)
    owned = runner.book.get("t2")
    assert owned is not None and runner.book.start(owned)  # a worker takes it, and answers it
