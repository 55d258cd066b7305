"""RunQueue: FIFO, no lost items, few wake-ups for work that never suspends, full ramp-up for
work that does."""

from __future__ import annotations

import asyncio

from gossipd.ingress.runner import RunQueue


async def _run_workers(
    q: RunQueue[int], workers: int, work_s: float | None, items: int
) -> tuple[list[int], int]:
    seen: list[int] = []
    all_seen = asyncio.Event()
    concurrent = 0
    peak = 0

    async def worker() -> None:
        nonlocal concurrent, peak
        while True:
            item = await q.get()
            concurrent += 1
            peak = max(peak, concurrent)
            if work_s is not None:
                await asyncio.sleep(work_s)  # the behaviour under test: work that suspends
            seen.append(item)
            concurrent -= 1
            if len(seen) == items:
                all_seen.set()

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    await asyncio.sleep(0)  # one turn: every worker reaches q.get() and waits there
    for i in range(items):
        q.put_nowait(i)
    await asyncio.wait_for(all_seen.wait(), 10)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return seen, peak


def test_RunQueue_fast_work_is_fifo_with_few_wakeups() -> None:
    q: RunQueue[int] = RunQueue()
    seen, _ = asyncio.run(_run_workers(q, workers=64, work_s=None, items=500))
    assert seen == list(range(500))
    assert q.wakeups <= 3  # one worker drains the burst; asyncio.Queue would wake 64+


def test_RunQueue_suspending_work_ramps_up_to_all_workers() -> None:
    q: RunQueue[int] = RunQueue()
    seen, peak = asyncio.run(_run_workers(q, workers=16, work_s=0.02, items=64))
    assert sorted(seen) == list(range(64))
    assert peak == 16


def test_RunQueue_cancelled_woken_worker_passes_the_wakeup_on() -> None:
    async def main() -> int:
        q: RunQueue[int] = RunQueue()
        a = asyncio.create_task(q.get())
        b = asyncio.create_task(q.get())
        await asyncio.sleep(0)  # one turn: a, then b, wait in q.get()
        q.put_nowait(1)  # wakes a
        a.cancel()  # ...which is cancelled before it runs
        return await asyncio.wait_for(b, 1.0)

    assert asyncio.run(main()) == 1
