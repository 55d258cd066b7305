"""The runner's drain hand-off (gossipd/ingress/runner.py take_queued, settle_stopped,
requeue) against withdrawals and cancels that land while a queued task is away being
offered elsewhere (gossipd/admin.py's drain and the daemon's shutdown offer them one by one);
and a running task withdrawn, then wanted again before its aborted worker ended
(core/lifecycle.py rule 3b), also as the daemon stops.  And what the release of a held Result
(Runner.end_held) tells admission's rule 5."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from gossipd.config import load_config
from gossipd.core.admission import Verdict
from gossipd.core.lifecycle import Abort
from gossipd.core.messages import Result, Task
from gossipd.daemon import Daemon
from gossipd.engines.base import EngineDead
from gossipd.ingress.runner import Runner


def _runner_of(*overrides: str) -> Iterator[Runner]:
    """The runner of a daemon that is built, not run (its workers are the test's)."""
    config = load_config(
        environ={},
        overrides=[
            'ingress.bind="tcp://127.0.0.1:0"',
            'gossip.bind=""',
            'journal.path=""',
            'metrics.bind=""',
            *overrides,
        ],
    )
    daemon = Daemon(config)
    try:
        yield daemon.ingress.runner
    finally:
        daemon._ctx.destroy(linger=0)


@pytest.fixture
def runner() -> Iterator[Runner]:
    yield from _runner_of()


@pytest.fixture
def echo_runner() -> Iterator[Runner]:
    """With the echo engine at 10 ms a token: a task stays in the engine a while."""
    yield from _runner_of('engine.kind="echo"', "engine.token_delay_s=0.01")


async def _withdrawn_then_wanted_again(runner: Runner, task_id: str) -> None:
    """Forwarder A's task runs in a worker; A withdraws it (its worker is cancelled) and B
    forwards it again before that worker has ended."""
    task = Task(v=1, id=task_id, prompt="a b c", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)
    now = time.monotonic()  # (the runner's clock: deadlines count from it)
    _, owned = runner.book.offer(task, now, now, forwarder=b"A")
    runner.enqueue(owned)  # type: ignore[arg-type]
    while runner.running == 0:  # its worker has it in the engine
        await asyncio.sleep(0.001)
    assert runner.withdraw(task_id, b"A")  # aborted: its worker is cancelled...
    runner.book.offer(task, now, now, forwarder=b"B")  # ...and it comes back first


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


def test_a_task_forwarded_again_while_its_withdrawn_run_is_aborted_runs_for_the_new_forwarder(
    echo_runner: Runner,
) -> None:
    """core/lifecycle.py rule 3b with a real worker: withdrawn while it ran, forwarded here
    again before the aborted worker ended.  The worker's end queues it again and it runs to a
    Result whose TaskDone goes to the new forwarder (before: dropped silently, the new
    forwarder waited for its deadline)."""
    runner = echo_runner
    ended: list[tuple[list[object], bool]] = []
    runner.on_finished.append(lambda owned, result: ended.append((owned.notify(), result.ok)))

    async def race() -> None:
        worker = asyncio.create_task(runner.work_forever())
        try:
            async with asyncio.timeout(5):
                await _withdrawn_then_wanted_again(runner, "t4")
                while not ended:
                    await asyncio.sleep(0.005)
        finally:
            runner.admission.begin_shutdown()  # (an idle worker outlives a cancel otherwise)
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(race())
    assert ended == [([b"B"], True)]
    assert runner.restarts == 1 and runner.results["ok"] == 1
    assert runner.book.get("t4") is None and runner.admission.pending == 0


def test_a_shutdown_that_lands_while_a_restarting_task_is_aborted_ends_its_worker(
    echo_runner: Runner,
) -> None:
    """The shutdown's cancel and the withdrawal's abort reach the worker as one
    CancelledError: the worker answers the task shutting_down and ends, instead of running
    it again past the grace and then waiting for work for ever (a review found the hang)."""
    runner = echo_runner

    async def race() -> None:
        worker = asyncio.create_task(runner.work_forever())
        async with asyncio.timeout(5):
            await _withdrawn_then_wanted_again(runner, "t5")
            runner.admission.begin_shutdown()  # ...as the daemon stops, as the daemon does
            runner.refuse_queued()
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)  # it ends

    asyncio.run(race())
    assert runner.results["shutting_down"] == 1 and runner.restarts == 0
    assert runner.book.get("t5") is None and runner.admission.pending == 0


def test_a_held_result_sent_at_its_release_counts_for_rule_5_and_one_dropped_does_not(
    runner: Runner,
) -> None:
    """A forwarded send 2 whose Result was held (fanout/holding.py): released and sent, it
    counts as answered then, and send 1 migrated here afterwards (it entered before) is
    not answered again; dropped (its forwarder had the task run elsewhere), nothing was
    answered here and send 1 gets the cached Result."""

    async def release() -> None:  # (a sent Result goes out through the reply sender)
        for task_id, send in (("h1", True), ("h2", False)):
            task = Task(v=1, id=task_id, prompt="p", reply_to="tcp://127.0.0.1:9", attempt=2)
            entered = time.monotonic()
            _, owned = runner.book.offer(task, entered, entered, forwarder=b"A")
            result = Result(id=task_id, ok=True, text="t", node="n")
            runner.book.finish(task_id, result)  # the runner's finish, before it holds it
            runner.end_held(owned, result, send=send)  # type: ignore[arg-type]
            late = msgspec.structs.replace(task, attempt=1)
            verdict, cached = runner.book.offer(late, entered, time.monotonic(), forwarder=b"B")
            assert verdict is Verdict.DUPLICATE_DONE
            assert cached == (None if send else result), task_id

    asyncio.run(release())
    assert runner.admission.statistics().answered_later == 1


def test_idle_workers_end_when_their_task_group_ends_because_a_sibling_failed(
    runner: Runner,
) -> None:
    """A daemon's background task that fails ends its task group, and the daemon exits
    (systemd restarts it).  Idle workers took the group's cancel for a stray abort of a task
    they had finished and waited for work again: the group never ended, and the process
    stayed up serving nothing (a gossip send's ZMQError did that) until SIGKILL."""

    async def fail_soon() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("a sibling's bug")

    async def group() -> None:
        async with asyncio.TaskGroup() as tg:
            for _ in range(4):
                tg.create_task(runner.work_forever())
            tg.create_task(fail_soon())

    ended: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(group())
        except BaseException as exc:  # what ended it is the test's answer
            ended.append(exc)

    # In a thread of its own: the old workers swallowed even a timeout's cancel.
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert ended, "the task group did not end within 5 s of its sibling's failure"
    assert isinstance(ended[0], ExceptionGroup)
    assert [type(e) for e in ended[0].exceptions] == [RuntimeError]


def test_an_abort_that_lands_after_its_task_finished_is_dropped_and_the_worker_goes_on(
    echo_runner: Runner,
) -> None:
    """The cancel that aborts a running task lands where its worker next waits: after the
    task finished, that is the wait for the next task.  It is the abort's, not the worker's
    end: the worker drops it and runs what comes next."""
    runner = echo_runner
    done: list[str] = []

    def finished(owned: object, result: Result) -> None:
        done.append(result.id)
        if result.id == "first":
            runner._abort("first")  # its worker still holds it: the cancel lands later

    runner.on_finished.append(finished)

    async def two_tasks() -> None:
        worker = asyncio.create_task(runner.work_forever())
        try:
            async with asyncio.timeout(5):
                for task_id in ("first", "second"):
                    task = Task(v=1, id=task_id, prompt="a b", reply_to="tcp://127.0.0.1:9")
                    now = time.monotonic()
                    _, owned = runner.book.offer(task, now, now)
                    runner.enqueue(owned)  # type: ignore[arg-type]
                    while task_id not in done:
                        await asyncio.sleep(0.005)
                    await asyncio.sleep(0.02)  # the abort's cancel has landed by now
                    assert not worker.done()
        finally:
            runner.admission.begin_shutdown()
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(two_tasks())
    assert done == ["first", "second"] and runner.results["ok"] == 2


class _DeadEngine:
    """An engine that dies under the first request it is given."""

    async def generate(self, request: object) -> AsyncIterator[object]:
        raise EngineDead("the engine's process died")
        yield  # (an async generator, as engines are)


@pytest.mark.parametrize("taken", [True, False])
def test_a_cancel_while_a_dead_engines_task_is_offered_elsewhere_keeps_its_worker(
    runner: Runner, taken: bool
) -> None:
    """The engine dies under a task; its worker offers the task to another member (the
    rescue) and a Cancel lands meanwhile.  It cancelled the worker inside that await: the
    worker ended (one fewer for good), and the task was never answered nor freed (pending
    stayed 1).  Now the worker is left alone; taken elsewhere, the task leaves here (the
    hand-off passes the Cancel on); taken by nobody, it is answered cancelled here."""
    offered = asyncio.Event()
    decided: asyncio.Future[bool]

    async def rescue(task: Task, received_at: float) -> bool:
        offered.set()
        return await decided

    async def case() -> None:
        nonlocal decided
        decided = asyncio.get_running_loop().create_future()
        runner._engine = _DeadEngine()  # type: ignore[assignment]
        runner._links.rescue = rescue
        worker = asyncio.create_task(runner.work_forever())
        task = Task(v=1, id="t9", prompt="p", reply_to="tcp://127.0.0.1:9", timeout_ms=10_000)
        now = time.monotonic()
        _, owned = runner.book.offer(task, now, now)
        runner.enqueue(owned)  # type: ignore[arg-type]
        await asyncio.wait_for(offered.wait(), 5)
        assert runner.cancel("t9") == "here"
        await asyncio.sleep(0.01)
        assert not worker.done()  # the Cancel did not end the worker
        decided.set_result(taken)
        for _ in range(100):
            if runner.admission.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert runner.admission.pending == 0 and not worker.done()
        if taken:
            assert runner.results["handed_off_engine_dead"] == 1
        else:
            assert runner.results["cancelled"] == 1
        worker.cancel()

    asyncio.run(case())
