"""CPU time per task, by process and thread, with and without CURVE (issue 14).

    PYTHONPATH=$PWD python scripts/curve_cpu.py ingress|route [--tasks N] [--repeats R]
        [--window W] [--modes plain,curve,plainB,curveB]

Runs the generator of `gossipd bench` against daemons started as the benches start them (one
daemon for ingress, a cluster of three for route; one plain and one with CURVE on every
socket), alternating the modes in each round; a mode is ``plain`` or ``curve`` and then
``B`` (the tasks set ``batch_replies``) and/or ``T`` (each refill goes as Tasks frames).  Around
each run it reads every thread's run time from /proc/PID/task/TID/schedstat (nanoseconds on a
CPU, not sampled), for the daemons and for this process (the generator), and prints the median
per task of: daemons' main (Python) threads, daemons' ZeroMQ IO threads, the generator's main
thread and its IO thread, with the median throughput and the median paired ratio to the first
mode.  CPU per task is steadier than throughput on a shared machine, though it still depends
on the load (batches are larger when the daemons are saturated).  Linux only.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gossipd.tools.bench.loadgen import LoadResult, ProducerCurve, drive_many, one_daemon_keys
from gossipd.tools.launcher import DaemonProcess
from simulations.cluster import Cluster


def run_ns_by_role(pid: int, prefix: str) -> dict[str, int]:
    """Nanoseconds on a CPU so far: ``PREFIX main`` (the Python thread), ``PREFIX io`` (ZeroMQ
    IO threads), ``PREFIX other``."""
    out: dict[str, int] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            comm = Path(f"{base}/{tid}/comm").read_text().strip()
            run_ns = int(Path(f"{base}/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        role = "main" if comm == "python" else "io" if comm.startswith("ZMQbg/IO") else "other"
        key = f"{prefix} {role}"
        out[key] = out.get(key, 0) + run_ns
    return out


def measure(
    pids: list[int], run: Callable[[], LoadResult], tasks: int
) -> tuple[float, dict[str, float]]:
    def snapshot() -> dict[str, int]:
        total: dict[str, int] = {}
        for pid, prefix in [(p, "daemons") for p in pids] + [(os.getpid(), "generator")]:
            for key, ns in run_ns_by_role(pid, prefix).items():
                total[key] = total.get(key, 0) + ns
        return total

    before = snapshot()
    result = run()
    after = snapshot()
    per_task_us = {k: (after[k] - before.get(k, 0)) / tasks / 1e3 for k in after}
    per_task_us = {k: v for k, v in per_task_us.items() if not k.endswith("other") or v > 0.01}
    per_task_us["total"] = sum(per_task_us.values())
    return result.tasks_per_s, per_task_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=["ingress", "route"])
    parser.add_argument("--tasks", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=0, help="default: the bench's (500, 300)")
    parser.add_argument("--modes", default="plain,curve,plainB,curveB")
    args = parser.parse_args()
    modes = args.modes.split(",")
    window = args.window or (500 if args.bench == "ingress" else 300)
    rng = random.Random(7)
    stop: list[Callable[[], object]] = []
    try:
        if args.bench == "ingress":
            keys, producer = one_daemon_keys("gossipd-cpu-keys-")
            plain = DaemonProcess(name="plain", overrides=['gossip.bind=""']).start()
            stop.append(plain.stop)
            secure = DaemonProcess(
                name="curve", overrides=['gossip.bind=""', *keys.overrides("bench")]
            ).start()
            stop.append(secure.stop)
            sides = {
                "plain": ([plain.endpoint], [plain.pid]),
                "curve": ([secure.endpoint], [secure.pid]),
            }
            entry = [0] * args.tasks
            task_keys: list[str] | None = None
        else:
            clusters = {
                "plain": Cluster(3, extra_overrides=['journal.path=""']),
                "curve": Cluster(3, extra_overrides=['journal.path=""'], curve=True),
            }
            layout = clusters["curve"].keys
            assert layout is not None
            public, secret = layout.pair("producer")
            producer = ProducerCurve(
                public, secret, [layout.public(d.name) for d in clusters["curve"].daemons]
            )
            for c in clusters.values():
                c.start()
                stop.append(c.stop)
            for c in clusters.values():
                c.wait_converged(30)
                c.wait_meta(30)
            sides = {
                name: ([d.endpoint for d in c.daemons], [d.pid for d in c.daemons])
                for name, c in clusters.items()
            }
            entry = [rng.randrange(3) for _ in range(args.tasks)]
            task_keys = [f"k{i}" for i in range(args.tasks)]

        def run_of(mode: str, label: str, n: int) -> Callable[[], LoadResult]:
            side = mode.rstrip("BT")
            endpoints, _ = sides[side]
            return lambda: drive_many(
                endpoints,
                n,
                window,
                run=label,
                entry_of=entry[:n],
                keys=task_keys[:n] if task_keys else None,
                curve=producer if side == "curve" else None,
                batch_replies="B" in mode,
                batch_tasks="T" in mode,
            )

        for mode in modes:
            run_of(mode, f"warm-{mode}", 2000)()
        rows: dict[str, list[tuple[float, dict[str, float]]]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in modes:
                pids = sides[mode.rstrip("BT")][1]
                rows[mode].append(
                    measure(pids, run_of(mode, f"{mode}-{r}", args.tasks), args.tasks)
                )
    finally:
        for fn in reversed(stop):
            fn()
    print(
        f"bench {args.bench}: {args.tasks} tasks a run, window {window}, {args.repeats} rounds; "
        f"load average {os.getloadavg()[0]:.2f} at the end"
    )
    print("CPU us per task (median over rounds); B = batch_replies, T = Tasks frames")
    for mode in modes:
        keys_ = sorted(rows[mode][0][1])
        med = {
            k: round(statistics.median(row[1].get(k, 0.0) for row in rows[mode]), 2) for k in keys_
        }
        tps = statistics.median(row[0] for row in rows[mode])
        print(f"  {mode:7} {tps:9,.0f} tasks/s  " + "  ".join(f"{k} {v}" for k, v in med.items()))
    first = [row[0] for row in rows[modes[0]]]
    for mode in modes[1:]:
        paired = statistics.median(row[0] / f for row, f in zip(rows[mode], first, strict=True))
        print(f"  {mode} / {modes[0]} throughput, paired median: {paired:.3f}")
    for suffix in ("B", "T", "BT"):
        if f"curve{suffix}" in modes and f"plain{suffix}" in modes:
            pairs = zip(rows[f"curve{suffix}"], rows[f"plain{suffix}"], strict=True)
            paired = statistics.median(c[0] / p[0] for c, p in pairs)
            print(f"  curve{suffix} / plain{suffix} throughput, paired median: {paired:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
