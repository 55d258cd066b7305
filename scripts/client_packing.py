"""The producer Client's throughput with and without packing tasks into Tasks frames, plain
and with CURVE (issue 14).

    PYTHONPATH=$PWD python scripts/client_packing.py [--tasks N] [--batch B] [--repeats R]

Starts one daemon without CURVE and one with it (as `gossipd bench ingress --curve` does),
then in each round runs the four modes in turn, alternating: a Client (uvloop, as
`gossipd submit`) submits N tasks (max_tokens 1) in batches of B gathered in one loop turn
and waits for each batch's Results.  Prints the median tasks/s of every mode, the paired
median ratios packed/single and curve/plain, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from gossipd.tools.client import Client, ProducerKeys
from gossipd.tools.curvekeys import CurveLayout
from gossipd.tools.launcher import DaemonProcess

MODES = ("plain-single", "plain-packed", "curve-single", "curve-packed")


async def run(endpoint: str, tasks: int, batch: int, curve: ProducerKeys | None, pack: bool):
    async with Client(
        [endpoint], curve=curve, pack_tasks=pack, resubmit_after_s=60, connect_timeout_s=10
    ) as client:
        started = time.perf_counter()
        for first in range(0, tasks, batch):
            handles = await asyncio.gather(
                *(client.submit("x", max_tokens=1) for _ in range(min(batch, tasks - first)))
            )
            results = await asyncio.gather(*(h.result() for h in handles))
            assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
        elapsed_s = time.perf_counter() - started
        return tasks / elapsed_s, client.statistics()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keys = CurveLayout(
        tempfile.mkdtemp(prefix="gossipd-pack-keys-"), nodes=["bench"], producers=["p"]
    )
    public, secret = keys.pair("p")
    producer = ProducerKeys(public=public, secret=secret, server_keys=[keys.public("bench")])
    plain = DaemonProcess(name="plain", overrides=['gossip.bind=""']).start()
    secure = DaemonProcess(name="curve", overrides=['gossip.bind=""', *keys.overrides("bench")])
    secure.start()
    rows: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for mode in MODES:  # warm up
            curve = producer if mode.startswith("curve") else None
            endpoint = secure.endpoint if curve else plain.endpoint
            uvloop.run(run(endpoint, 2000, args.batch, curve, mode.endswith("packed")))
        for r in range(args.repeats):
            for mode in MODES:
                curve = producer if mode.startswith("curve") else None
                endpoint = secure.endpoint if curve else plain.endpoint
                tps, stats = uvloop.run(
                    run(endpoint, args.tasks, args.batch, curve, mode.endswith("packed"))
                )
                rows[mode].append(tps)
                print(
                    f"round {r + 1} {mode:13} {tps:8,.0f} tasks/s  frames {stats.frames_sent} "
                    f"packs {stats.packs_sent}",
                    file=sys.stderr,
                )
    finally:
        plain.stop()
        secure.stop()
    print(
        f"{args.tasks} tasks a run in gathered batches of {args.batch}, {args.repeats} rounds; "
        f"load average {os.getloadavg()[0]:.2f} at the end"
    )
    for mode in MODES:
        print(f"  {mode:13} median {statistics.median(rows[mode]):8,.0f} tasks/s")

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rows[a], rows[b], strict=True))

    for a, b in (
        ("plain-packed", "plain-single"),
        ("curve-packed", "curve-single"),
        ("curve-single", "plain-single"),
        ("curve-packed", "plain-packed"),
    ):
        print(f"  {a} / {b}: paired median {paired(a, b):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
