"""A restart is a fresh start (membership rules 6 and 8): a daemon restarted after SIGTERM or
SIGKILL, on its ports or on new ones, runs its share of keyed tasks again within 5 s of
serving.  Before the rule its peers kept its previous life's GPU state (status draining, a
version the new process would take minutes to pass) and sent it nothing for ~200 s, or ever."""

from __future__ import annotations

import asyncio
import time

import pytest

from gossipd.core.ring import Ring
from gossipd.tools.client import Client
from simulations.cluster import Cluster

SHARE_WITHIN_S = 5.0
SPACING_S = 0.02  # one keyed task every 20 ms (50 tasks/s), all through the daemon that stays


@pytest.mark.parametrize(
    ("kill", "new_ports"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["sigterm", "sigkill", "sigterm-new-ports", "sigkill-new-ports"],
)
def test_a_restarted_daemon_runs_its_share_of_keyed_tasks_within_5s(
    tmp_path, kill: bool, new_ports: bool
) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(2, log_dir=str(tmp_path), extra_overrides=["engine.token_delay_s=0.001"])
    try:
        cluster.start()
        cluster.wait_converged(timeout_s=20)
        cluster.wait_meta(timeout_s=20)
        ring = Ring({"d00": 1.0, "d01": 1.0})
        keys = [k for k in (f"session-{i}" for i in range(400)) if ring.owner(k) == "d01"][:50]
        entry = cluster.daemons[0]
        done: list[tuple[float, str]] = []  # (wall time of the Result, the node that ran it)

        async def main() -> tuple[float, float]:
            async with Client([entry.endpoint], resubmit_after_s=30) as client:
                stop = asyncio.Event()

                async def one(i: int) -> None:
                    handle = await client.submit("x", key=keys[i % len(keys)], max_tokens=2)
                    result = await handle.result()
                    assert result.ok, result.error
                    done.append((time.time(), result.node))

                async def feed() -> None:
                    running: set[asyncio.Task[None]] = set()
                    i = 0
                    while not stop.is_set():
                        task = asyncio.create_task(one(i))
                        running.add(task)
                        task.add_done_callback(running.discard)
                        i += 1
                        await asyncio.sleep(SPACING_S)
                    await asyncio.gather(*running)

                feeder = asyncio.create_task(feed())
                await asyncio.sleep(1.5)
                stopped_at = time.time()
                restarted = await asyncio.to_thread(
                    cluster.restart, 1, kill=kill, new_ports=new_ports
                )
                serving_at = next(e["ts"] for e in restarted.events() if e["msg"] == "serving")
                deadline = time.monotonic() + SHARE_WITHIN_S + 3.0
                while time.monotonic() < deadline and not _ran_on_d01_since(done, serving_at):
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # a window of steady state after it came back
                stop.set()
                await feeder
                return stopped_at, serving_at

        stopped_at, serving_at = asyncio.run(main())
    finally:
        cluster.stop()
    before = [node for at, node in done if at < stopped_at]
    assert before and before.count("d01") / len(before) > 0.9, "d01 ran its keys before"
    first = _ran_on_d01_since(done, serving_at)
    assert first, "the restarted d01 ran none of its keys' tasks"
    print(f"first task on the restarted d01 {first - serving_at:.3f} s after it served")
    assert first - serving_at <= SHARE_WITHIN_S, f"first task on d01 {first - serving_at:.2f} s"
    settled = [node for at, node in done if at > first + 0.5]
    assert settled and settled.count("d01") / len(settled) > 0.9, settled


def _ran_on_d01_since(done: list[tuple[float, str]], since: float) -> float:
    return next((at for at, node in done if at >= since and node == "d01"), 0.0)
