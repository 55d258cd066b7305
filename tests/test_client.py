"""The producer client and `gossipd submit`, against real daemon processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import msgpack
import zmq

from gossipd.core.messages import Result, Task, encode
from gossipd.core.sampling import SamplingParams
from gossipd.tools.client import Client, ClientStatistics
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from tests.helpers import gossipd_cli, run_with_context, scrape


def test_submit_file_of_10000_tasks_all_succeed(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory()
    path = tmp_path / "tasks.jsonl"
    with path.open("w") as fh:
        for i in range(10_000):
            fh.write(
                json.dumps({"id": f"f{i}", "prompt": f"task {i}", "params": {"max_tokens": 4}})
                + "\n"
            )
    proc = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(path), "--json", timeout_s=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["total"] == 10_000 and report["ok"] == 10_000 and report["failed"] == {}
    assert report["latency_ms"]["p99"] >= report["latency_ms"]["p50"] > 0
    assert "submit [" in proc.stderr, "progress is shown"


def test_submit_exit_status_is_1_when_a_task_fails(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory()
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine"})
        + "\n"
        + json.dumps({"prompt": "bad", "params": {"top_p": 0}})
        + "\n"
        + "this is not json\n"
    )
    proc = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(path), "--json", "--no-progress"
    )
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] == 1 and report["failed"] == {"bad_request": 2}
    assert f"{path}:2" in proc.stderr and f"{path}:3" in proc.stderr


def test_submit_one_prompt_streams_to_stdout(daemon_factory) -> None:
    daemon = daemon_factory()
    proc = gossipd_cli("submit", "-e", daemon.endpoint, "a b c", "--stream", "--max-tokens", "4")
    assert proc.returncode == 0 and proc.stdout == "a b c a\n"


def test_client_resubmits_on_timeout_and_the_daemon_runs_the_task_once(daemon_factory) -> None:
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}", "engine.token_delay_s=0.05")

    async def main() -> tuple:
        async with Client([daemon.endpoint], resubmit_after_s=0.1) as client:
            result = await client.run("x", max_tokens=10, timeout_s=10)
            return result, client.statistics()

    result, stats = asyncio.run(main())
    assert result.ok and result.text == "x" + " x" * 9
    assert stats.resubmitted >= 3
    metrics = scrape(port)
    assert metrics["gossipd_task_duplicates_total"] >= 3
    assert metrics["gossipd_engine_generated_tokens_total"] == 10


def test_client_delivers_tasks_sent_before_the_daemon_started(tmp_path: Path) -> None:
    """At-least-once: the producer may start first; tasks wait in ZeroMQ and are resent."""
    daemon = DaemonProcess(log_dir=tmp_path)

    async def main() -> list:
        async with Client([daemon.endpoint], resubmit_after_s=0.5) as client:
            handles = [
                await client.submit(f"early {i}", max_tokens=2, timeout_s=20) for i in range(20)
            ]
            # All 20 are sent (in ZeroMQ's queue, or the client's) before the daemon exists.
            assert client.statistics().submitted == 20 and daemon.proc is None
            await asyncio.to_thread(daemon.start)
            return [await h.result() for h in handles]

    try:
        results = asyncio.run(main())
    finally:
        daemon.stop()
    assert [r.text for r in results] == [f"early {i}" for i in range(20)]


def test_client_gives_a_local_deadline_result_when_nobody_answers() -> None:
    async def main():  # type: ignore[no-untyped-def]
        async with Client([f"tcp://127.0.0.1:{free_tcp_port()}"], resubmit_after_s=0.1) as client:
            return await client.run("x", timeout_s=0.3)

    result = asyncio.run(main())
    assert not result.ok and result.error.code == "deadline_exceeded" and result.node == "client"


def test_client_retries_overloaded_until_it_runs(daemon_factory) -> None:
    daemon = daemon_factory(
        "ingress.pending_max=2",
        "ingress.concurrency_max=2",
        "ingress.retry_after_ms=20",
        "engine.token_delay_s=0.01",
    )

    async def main():  # type: ignore[no-untyped-def]
        async with Client([daemon.endpoint]) as client:
            handles = [await client.submit(f"p{i}", max_tokens=3, timeout_s=20) for i in range(30)]
            results = [await h.result() for h in handles]
            return results, client.statistics()

    results, stats = asyncio.run(main())
    assert all(r.ok for r in results)
    assert stats.retried > 0


def test_stream_deltas_are_in_order_and_once_each(daemon_factory) -> None:
    daemon = daemon_factory("engine.token_delay_s=0.01")

    async def main():  # type: ignore[no-untyped-def]
        async with Client([daemon.endpoint], resubmit_after_s=0.03) as client:
            task = Task(
                v=1,
                id="stream-1",
                prompt="a b c",
                params=SamplingParams(max_tokens=12),
                reply_to=client.reply_to,
                stream=True,
            )
            handle = await client.submit_task(task)
            deltas = [d async for d in handle.deltas()]
            return deltas, await handle.result()

    deltas, result = asyncio.run(main())
    assert "".join(deltas) == result.text and len(deltas) == 12


def test_client_retries_overloaded_after_the_hint_with_what_is_left_of_the_deadline() -> None:
    """A stand-in daemon refuses the first copy with retry_after_ms=300: the second copy comes
    after the hint, with timeout_ms shortened by the time spent; the third is answered."""
    import msgpack
    import zmq

    from gossipd.core.messages import ErrorCode, Result, encode, error_result

    async def main():  # type: ignore[no-untyped-def]
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        seen: list[tuple[float, dict]] = []  # type: ignore[type-arg]
        loop = asyncio.get_running_loop()

        async def daemon() -> None:
            while len(seen) < 2:
                if not pull.poll(0):
                    await asyncio.sleep(0.005)
                    continue
                task = msgpack.unpackb(pull.recv())
                seen.append((loop.time(), task))
                if len(seen) == 1:
                    push.connect(task["reply_to"])
                    refusal = error_result(
                        task["id"], ErrorCode.OVERLOADED, "busy", retry_after_ms=300
                    )
                    push.send(encode(refusal))
                else:
                    push.send(encode(Result(id=task["id"], ok=True, text="done")))

        try:
            async with Client([f"tcp://127.0.0.1:{port}"], resubmit_after_s=30) as client:
                served = asyncio.create_task(daemon())
                result = await client.run("x", timeout_s=5)
                await served
                return result, seen, client.statistics()
        finally:
            ctx.destroy(linger=0)

    result, seen, stats = asyncio.run(main())
    assert result.ok and stats.retried == 1
    (t0, first), (t1, second) = seen
    assert t1 - t0 >= 0.3, "the retry waited for the hint"
    assert first["timeout_ms"] == 5000 and second.get("attempt") == 1
    assert 4000 < second["timeout_ms"] <= 5000 - 300, "the retry carries what is left"


@contextlib.contextmanager
def _stand_in_daemon(ctx: zmq.Context) -> Iterator[tuple[str, zmq.Socket, zmq.Socket]]:
    """A stand-in daemon's sockets: its endpoint, the PULL it reads tasks from, and a PUSH
    to connect to their reply_to (both closed at the end)."""
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        yield f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}", pull, push
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def test_client_keeps_the_first_final_result_and_counts_later_ones() -> None:
    """A second final Result for one id (an owner killed between its Result and its
    TaskDone, a resubmission answered from the cache, a hedged copy) is dropped and counted;
    the task resolves with the first.  A stand-in daemon answers one task twice."""

    async def main(ctx: zmq.Context) -> tuple[Result, ClientStatistics]:
        with _stand_in_daemon(ctx) as (endpoint, pull, push):
            async with Client([endpoint], ctx=ctx, resubmit_after_s=30) as client:
                handle = await client.submit("x", timeout_s=10)
                task = msgpack.unpackb(await asyncio.to_thread(pull.recv))
                push.connect(task["reply_to"])
                for text, node in (("first", "d01"), ("second", "d02")):
                    push.send(encode(Result(id=task["id"], ok=True, text=text, node=node)))
                result = await asyncio.wait_for(handle.result(), 5)
                for _ in range(200):  # the second one lands after the first
                    if client.statistics().duplicate_results:
                        break
                    await asyncio.sleep(0.01)
                push.send(encode(Result(id="never-sent", ok=True, text="?", node="d03")))
                for _ in range(200):
                    if client.statistics().unknown_replies:
                        break
                    await asyncio.sleep(0.01)
                return result, client.statistics()

    result, stats = run_with_context(main)
    assert result.text == "first" and result.node == "d01"
    assert stats.duplicate_results == 1 and stats.unknown_replies == 1
    assert stats.completed == 1 and stats.outstanding == 0


def test_a_cancel_while_a_refusal_is_waited_out_ends_the_task_at_once() -> None:
    """Refused with a retry hint, the task is held by no daemon: a Cancel then found nothing
    to cancel, and the handle waited for its whole deadline (a review's reading).  It ends
    at once now, ``cancelled``, and is not sent again."""
    from gossipd.core.messages import ErrorCode, error_result

    async def main(ctx: zmq.Context) -> tuple[Result, float, int]:
        with _stand_in_daemon(ctx) as (endpoint, pull, push):
            async with Client([endpoint], ctx=ctx, resubmit_after_s=30) as client:
                handle = await client.submit("x", timeout_s=20)
                task = msgpack.unpackb(await asyncio.to_thread(pull.recv))
                push.connect(task["reply_to"])
                refusal = error_result(
                    task["id"], ErrorCode.OVERLOADED, "busy", retry_after_ms=5000
                )
                push.send(encode(refusal))
                for _ in range(200):
                    if client.statistics().retried:
                        break
                    await asyncio.sleep(0.01)
                began = asyncio.get_running_loop().time()
                assert await client.cancel(task["id"])
                result = await asyncio.wait_for(handle.result(), 5)
                took = asyncio.get_running_loop().time() - began
                await asyncio.sleep(0.1)
                frames = 0
                while pull.poll(0):  # the Cancel; no copy of the task
                    frames += msgpack.unpackb(pull.recv())["t"] == 1
                return result, took, frames

    result, took, tasks_sent_again = run_with_context(main)
    assert result.error is not None and result.error.code == "cancelled"
    assert took < 1.0 and tasks_sent_again == 0


def test_closing_the_client_ends_every_outstanding_handle_and_a_same_id_race_is_refused() -> None:
    """close() cancelled the handles' timers and left their results pending for ever; and two
    submits of one id that both waited for a slot both got in, the second overwriting the
    first, whose deadline then removed the second (its Result counted a duplicate)."""
    from gossipd.errors import LocalProtocolError

    async def main(ctx: zmq.Context) -> tuple[list[Result], str]:
        with _stand_in_daemon(ctx) as (endpoint, pull, push):
            refused = ""
            async with Client(
                [endpoint], ctx=ctx, resubmit_after_s=30, outstanding_max=1
            ) as client:
                held = await client.submit("x", task_id="holds-the-slot", timeout_s=60)
                first = asyncio.create_task(client.submit("x", task_id="twice", timeout_s=60))
                await asyncio.sleep(0.05)  # (it waits for the one slot)
                try:
                    await client.submit("x", task_id="twice", timeout_s=60)
                except LocalProtocolError as exc:
                    refused = str(exc)
                task = msgpack.unpackb(await asyncio.to_thread(pull.recv))  # the stand-in daemon
                push.connect(task["reply_to"])
                push.send(encode(Result(id=task["id"], ok=True, text="done")))  # a slot frees
                handle = await first
            # (the client is closed: every handle still outstanding has its result)
            results = [await asyncio.wait_for(h.result(), 2) for h in (held, handle)]
        return results, refused

    results, refused = run_with_context(main)
    assert results[0].ok and results[1].error is not None
    assert results[1].error.code == "cancelled" and "closed" in results[1].error.message
    assert "already outstanding" in refused


def test_frames_waiting_for_a_daemon_are_bounded_in_bytes_and_their_tasks_still_run(
    tmp_path: Path,
) -> None:
    """With no daemon up, every resubmission queued one more copy of its task in the Client,
    without bound (a copy per task every resubmit_after_s for as long as the outage lasted).
    Now the oldest task frames are dropped over unsent_bytes_max and their tasks go again at
    their timers: once a daemon starts, every task runs."""
    daemon = DaemonProcess(log_dir=tmp_path)
    bound = 16 * 1024
    prompt = "p" * 400

    async def main() -> tuple[list[Result], list[int], ClientStatistics]:
        seen: list[int] = []
        async with Client(
            [daemon.endpoint], resubmit_after_s=0.1, unsent_bytes_max=bound
        ) as client:
            handles = [
                await client.submit(f"{prompt} {i}", max_tokens=2, timeout_s=30) for i in range(100)
            ]
            for _ in range(15):  # ten resubmissions of each task while nobody takes them
                await asyncio.sleep(0.1)
                seen.append(client.statistics().unsent_bytes)
            await asyncio.to_thread(daemon.start)
            results = [await h.result() for h in handles]
            return results, seen, client.statistics()

    try:
        results, seen, stats = asyncio.run(main())
    finally:
        daemon.stop()
    assert [r.text for r in results] == [f"{prompt} {i}" for i in range(100)]
    frame_max = 1024  # one task alone (a resubmission is never packed)
    assert max(seen) <= bound + frame_max and min(seen) > bound // 2
    assert stats.unsent_frames_dropped > 0 and stats.unsent_bytes == 0
