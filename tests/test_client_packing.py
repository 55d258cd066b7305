"""The Client packs the tasks of one loop turn into Tasks frames (docs/PROTOCOL.md, "Tasks"),
against real daemon processes, and falls back to one frame per task for a daemon that does
not take Tasks frames."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from gossipd.core.codec import decode_intake
from gossipd.core.messages import ErrorCode, Result, encode, error_result
from gossipd.errors import LocalProtocolError
from gossipd.ops.scrape import scrape
from gossipd.tools.client import Client, ClientStatistics, ProducerKeys
from gossipd.tools.packing import PACK_BYTES_MAX, PACK_ITEMS_MAX
from tests.helpers import run_with_context
from tests.test_curve import Keys, curve_daemon


def _submit_in_one_turn(client: Client, n: int, **kwargs: Any) -> Any:
    """n submits gathered: all of them run in one turn of the loop (no slot to wait for)."""
    return asyncio.gather(
        *(client.submit(f"t{i}", task_id=f"t{i}", max_tokens=2, **kwargs) for i in range(n))
    )


def test_tasks_of_one_turn_leave_in_tasks_frames_and_each_gets_one_result(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory('metrics.bind="127.0.0.1:0"')
    n = 6 * PACK_ITEMS_MAX + 5  # seven packs

    async def main(ctx: zmq.Context) -> tuple[list[Result], ClientStatistics]:
        async with Client([daemon.endpoint], ctx=ctx, resubmit_after_s=60) as client:
            handles = await _submit_in_one_turn(client, n, timeout_s=30)
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 30)
            await asyncio.sleep(0.2)  # a second Result for some id would land by now
            return results, client.statistics()

    results, stats = run_with_context(main)
    assert [r.text for r in results] == [f"t{i} t{i}" for i in range(n)]
    assert stats.packs_sent == 7 and stats.tasks_packed == n and stats.frames_sent == 7
    assert stats.duplicate_results == stats.unknown_replies == stats.resubmitted == 0
    assert stats.completed == n and stats.packs_refused == 0
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_messages_received_total"] == n, "the daemon read each item"


def test_a_lone_task_leaves_as_a_plain_task_frame() -> None:
    """No daemon: the frames wait in the Client's queue, where we look at them."""

    async def main(ctx: zmq.Context) -> tuple[list[bytes], ClientStatistics]:
        async with Client(["tcp://127.0.0.1:1"], ctx=ctx, id_prefix="c") as client:
            await client.submit("alone")
            await asyncio.sleep(0)
            await _submit_in_one_turn(client, 3)
            await asyncio.sleep(0)
            return [frame for frame, _ in client._unsent], client.statistics()

    frames, stats = run_with_context(main)
    maps = [msgpack.unpackb(f) for f in frames]
    assert [m["t"] for m in maps] == [1, 6] and maps[0]["prompt"] == "alone"
    assert maps[1]["id"] == "c-pack-1" and maps[1]["reply_to"].startswith("tcp://127.0.0.1:")
    assert [item["id"] for item in maps[1]["items"]] == ["t0", "t1", "t2"]
    assert stats.frames_sent == 2 and stats.packs_sent == 1 and stats.tasks_packed == 3
    # A daemon of today reads the pack's id and reply_to as unknown keys, and ignores them.
    assert len(decode_intake(frames[1], bytes_max=1 << 20).items) == 3  # type: ignore[union-attr]


def test_packs_are_bounded_in_bytes_and_a_larger_task_goes_alone() -> None:
    third = PACK_BYTES_MAX // 3 + 1000  # two fit in a pack, three do not

    async def main(ctx: zmq.Context) -> list[bytes]:
        async with Client(["tcp://127.0.0.1:1"], ctx=ctx) as client:
            await asyncio.gather(
                *(client.submit("x" * third, task_id=f"b{i}") for i in range(5)),
                client.submit("y" * (PACK_BYTES_MAX + 1), task_id="huge"),
                client.submit("small", task_id="s"),
            )
            await asyncio.sleep(0)
            return [frame for frame, _ in client._unsent]

    frames = run_with_context(main)
    maps = [msgpack.unpackb(f) for f in frames]
    shapes = [[i["id"] for i in m["items"]] if m["t"] == 6 else m["id"] for m in maps]
    # In order; at most PACK_BYTES_MAX of tasks in a pack.
    assert shapes == [["b0", "b1"], ["b2", "b3"], "b4", "huge", "s"]
    assert all(len(f) < PACK_BYTES_MAX + 1024 for f in frames if msgpack.unpackb(f)["t"] == 6)


def test_a_cancel_in_the_same_turn_does_not_overtake_its_task(daemon_factory: Any) -> None:
    daemon = daemon_factory('metrics.bind="127.0.0.1:0"', "engine.token_delay_s=0.05")

    async def main(ctx: zmq.Context) -> tuple[list[Result], ClientStatistics]:
        async with Client([daemon.endpoint], ctx=ctx, resubmit_after_s=60) as client:
            handles = [
                await client.submit(f"p{i}", task_id=f"p{i}", max_tokens=40, timeout_s=20)
                for i in range(10)
            ]
            assert await client.cancel("p3")  # no await has yielded since the submits
            results = [await asyncio.wait_for(h.result(), 20) for h in handles]
            return results, client.statistics()

    results, stats = run_with_context(main)
    assert stats.packs_sent == 1 and stats.tasks_packed == 10, "the tasks left in one pack"
    cancelled = results[3]
    assert cancelled.error is not None and cancelled.error.code == "cancelled", cancelled
    assert cancelled.node != "client", "the daemon cancelled it"
    assert all(r.ok for i, r in enumerate(results) if i != 3)
    metrics = scrape(daemon.metrics_port)
    assert metrics.get("gossipd_cancels_total{outcome=unknown}", 0) == 0
    assert metrics["gossipd_cancels_total{outcome=here}"] == 1


class OldDaemon:
    """Stands for a daemon older than Tasks frames (t = 6), which cannot run here: a plain
    PULL + msgpack loop that does what such a daemon did: a map with a `t` outside 1..4 is
    answered with a bad_request Result to its top-level reply_to and id, a Task (t = 1) with
    an ok Result.  It records the `t` of every frame."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.endpoint = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.push = ctx.socket(zmq.PUSH)
        self.kinds: list[int] = []
        self.pack_ids: list[str] = []
        self._connected: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, reply_to: str, result: Result) -> None:
        if reply_to not in self._connected:
            self.push.connect(reply_to)
            self._connected.add(reply_to)
        self.push.send(encode(result))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.pull.poll(20):
                continue
            msg = msgpack.unpackb(self.pull.recv())
            kind = msg.get("t")
            self.kinds.append(kind)
            if kind == 1:
                self._answer(msg["reply_to"], Result(id=msg["id"], ok=True, text=msg["prompt"]))
            elif kind not in (2, 3, 4) and msg.get("reply_to") and msg.get("id"):
                self.pack_ids.append(msg["id"])
                why = f"unknown message type t={kind}: the ingress takes 1 (Task), 4 (Cancel)"
                self._answer(
                    msg["reply_to"],
                    error_result(msg["id"], ErrorCode.BAD_REQUEST, why, node="old"),
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pull.close(linger=0)
        self.push.close(linger=0)


N_OLD = 2 * PACK_ITEMS_MAX + 10  # three packs


def test_a_daemon_without_tasks_frames_gets_every_task_alone_at_once(caplog: Any) -> None:
    async def main(ctx: zmq.Context) -> tuple[list[Result], ClientStatistics, OldDaemon, float]:
        old = OldDaemon(ctx)
        try:
            # A long resubmission timer: a task left to it would fail the wait below.
            async with Client(
                [old.endpoint], ctx=ctx, resubmit_after_s=60, connect_timeout_s=5
            ) as client:
                started = time.monotonic()
                first = await _submit_in_one_turn(client, N_OLD, timeout_s=50)  # <= 3 packs
                results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in first)), 10)
                more = [await client.submit(f"m{i}", timeout_s=50) for i in range(50)]
                results += await asyncio.wait_for(asyncio.gather(*(h.result() for h in more)), 10)
                return results, client.statistics(), old, time.monotonic() - started
        finally:
            old.close()

    with caplog.at_level("WARNING", logger="gossipd.tools.packing"):
        results, stats, old, elapsed_s = run_with_context(main)
    assert all(r.ok for r in results) and len(results) == N_OLD + 50
    assert elapsed_s < 10, "no task waited for the resubmission timer"
    # Three packs when the first refusal comes after the turn; on a loaded machine it can
    # come before the last pack leaves, whose tasks then go alone (packing.refused).
    packs = old.kinds.count(6)
    assert 1 <= packs <= 3, old.kinds
    assert old.kinds == [6] * packs + [1] * (N_OLD + 50), "packs, refused; then a frame a task"
    assert [p.split("-pack-")[1] for p in old.pack_ids] == [str(i + 1) for i in range(packs)]
    assert stats.packs_sent == packs and stats.packs_refused == packs
    assert stats.resubmitted == 0
    assert stats.frames_sent == packs + N_OLD + 50 and stats.completed == N_OLD + 50
    warnings = [r for r in caplog.records if "refused a Tasks frame" in r.getMessage()]
    assert len(warnings) == 1


def test_a_task_cancelled_in_a_refused_pack_ends_cancelled_and_is_not_resent() -> None:
    async def main(ctx: zmq.Context) -> tuple[list[Result], OldDaemon]:
        old = OldDaemon(ctx)
        try:
            async with Client(
                [old.endpoint], ctx=ctx, resubmit_after_s=60, connect_timeout_s=5
            ) as client:
                handles = await _submit_in_one_turn(client, 3, timeout_s=50)
                assert await client.cancel("t1")  # in the same turn: after the pack
                results = [await asyncio.wait_for(h.result(), 10) for h in handles]
                return results, old
        finally:
            old.close()

    results, old = run_with_context(main)
    assert results[0].ok and results[2].ok
    assert results[1].error is not None and results[1].error.code == "cancelled"
    assert results[1].node == "client"
    assert old.kinds == [6, 4, 1, 1], "the pack, its Cancel, the two others alone"


def test_without_packing_every_task_is_a_frame() -> None:
    async def main(ctx: zmq.Context) -> list[bytes]:
        async with Client(["tcp://127.0.0.1:1"], ctx=ctx, pack_tasks=False) as client:
            await _submit_in_one_turn(client, 5)
            await asyncio.sleep(0)
            return [frame for frame, _ in client._unsent]

    assert [msgpack.unpackb(f)["t"] for f in run_with_context(main)] == [1] * 5


def test_packed_tasks_from_a_curve_producer_run(daemon_factory: Any, tmp_path: Path) -> None:
    keys = Keys(tmp_path, peers=["s0"], producers=["p1"])
    daemon = curve_daemon(daemon_factory, keys, "s0")
    public, secret = keys.pair("p1")
    curve = ProducerKeys(public=public, secret=secret, server_keys=[keys.public("s0")])
    n = 2 * PACK_ITEMS_MAX + 10  # three packs

    async def main(ctx: zmq.Context) -> tuple[list[Result], ClientStatistics]:
        async with Client(
            [daemon.endpoint], ctx=ctx, curve=curve, resubmit_after_s=60, connect_timeout_s=5
        ) as client:
            handles = await _submit_in_one_turn(client, n, timeout_s=30)
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 30)
            return results, client.statistics()

    results, stats = run_with_context(main)
    assert [r.text for r in results] == [f"t{i} t{i}" for i in range(n)]
    assert stats.packs_sent == 3 and stats.frames_sent == 3 and stats.resubmitted == 0


def _one_pack_of_large_tasks(
    endpoint: str, resubmit_after_s: float, wait_s: float
) -> tuple[list[Result], ClientStatistics]:
    """A pack of PACK_ITEMS_MAX tasks of 1 kB each (33 KB) to ``endpoint``: every Result."""

    async def main(ctx: zmq.Context) -> tuple[list[Result], ClientStatistics]:
        async with Client([endpoint], ctx=ctx, resubmit_after_s=resubmit_after_s) as client:
            handles = await asyncio.gather(
                *(
                    client.submit("x" * 1000, task_id=f"L{i}", max_tokens=1, timeout_s=30)
                    for i in range(PACK_ITEMS_MAX)
                )
            )
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), wait_s)
            return results, client.statistics()

    results, stats = run_with_context(main)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:2]
    return results, stats


def test_a_pack_over_a_daemons_size_limit_is_refused_and_its_tasks_go_alone_at_once(
    daemon_factory: Any,
) -> None:
    """A daemon of today with a small ingress.message_bytes_max refuses a larger pack with
    bad_request for the pack's id (PROTOCOL.md, "Tasks"): the Client stops packing and sends
    the pack's tasks alone at once (a resubmission timer of 60 s would fail the 10 s wait)."""
    daemon = daemon_factory("ingress.message_bytes_max=16384")
    _, stats = _one_pack_of_large_tasks(daemon.endpoint, resubmit_after_s=60, wait_s=10)
    assert stats.packs_sent == 1 and stats.packs_refused == 1 and stats.resubmitted == 0
    assert stats.frames_sent == 1 + PACK_ITEMS_MAX


def test_a_pack_zeromq_drops_unanswered_reaches_the_daemon_by_its_resubmissions(
    daemon_factory: Any,
) -> None:
    """Over four times the daemon's ingress.message_bytes_max, ZeroMQ drops the frame with
    the connection and nobody answers: the resubmission timer sends each task again alone
    (never packed), so every task still runs."""
    daemon = daemon_factory("ingress.message_bytes_max=4096")  # drops frames over 16 KiB
    _, stats = _one_pack_of_large_tasks(daemon.endpoint, resubmit_after_s=0.5, wait_s=20)
    assert stats.packs_sent == 1 and stats.packs_refused == 0, "dropped, not refused"
    assert stats.resubmitted == PACK_ITEMS_MAX and stats.tasks_packed == PACK_ITEMS_MAX


def test_a_task_id_that_looks_like_a_pack_id_is_refused_locally() -> None:
    async def main(ctx: zmq.Context) -> str:
        async with Client(["tcp://127.0.0.1:1"], ctx=ctx, id_prefix="c") as client:
            try:
                await client.submit("p", task_id="c-pack-7")
            except LocalProtocolError as exc:
                return str(exc)
            return ""

    assert "Tasks frame ids" in run_with_context(main)


class BusyDaemon(OldDaemon):
    """Answers every task `overloaded` with a short retry-after hint."""

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.pull.poll(20):
                continue
            msg = msgpack.unpackb(self.pull.recv())
            self.kinds.append(msg.get("t"))
            if msg.get("t") == 1:
                busy = error_result(
                    msg["id"], ErrorCode.OVERLOADED, "busy", node="busy", retry_after_ms=20
                )
                self._answer(msg["reply_to"], busy)


def test_a_cancelled_task_is_not_retried_after_an_overloaded_answer() -> None:
    async def main(ctx: zmq.Context) -> tuple[Result, BusyDaemon]:
        busy = BusyDaemon(ctx)
        try:
            async with Client(
                [busy.endpoint], ctx=ctx, resubmit_after_s=60, connect_timeout_s=5
            ) as client:
                handle = await client.submit("p", task_id="c0", timeout_s=1.0)
                await asyncio.sleep(0)  # it leaves
                assert await client.cancel("c0")
                result = await asyncio.wait_for(handle.result(), 10)
                return result, busy
        finally:
            busy.close()

    result, busy = run_with_context(main)
    assert busy.kinds.count(1) == 1, "sent once: a cancelled task is not retried"
    assert result.error is not None and result.error.code == "overloaded"
