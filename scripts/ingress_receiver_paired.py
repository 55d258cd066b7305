"""``ingress.receiver`` paired: one daemon reading its ingress with the loop's PULL and one
with libzmq's (echo engine, no membership), the bench's closed-loop generator
(``gossipd bench ingress``'s ``drive``) alternating between them; tasks/s, p50/p99 and the
daemon's CPU a task (every thread, /proc schedstat), medians of the rounds.
bench/README.md, "The ingress on the loop".

    .venv/bin/python scripts/ingress_receiver_paired.py [--rounds 3] [--tasks 20000]
        [--window 500] [--curve] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gossipd.tools.bench.loadgen import drive, one_daemon_keys
from gossipd.tools.bench.membership import cpu_ns
from gossipd.tools.curvekeys import CurveLayout
from gossipd.tools.launcher import DaemonProcess

SIDES = ("loop", "zmq")


def start_receiver_daemons(
    keys: CurveLayout | None, extra: Sequence[str] = ()
) -> dict[str, DaemonProcess]:
    """One daemon (echo engine, no membership) per ``ingress.receiver``, with ``keys``'
    CURVE ("bench") when given, and ``extra`` overrides."""
    return {
        side: DaemonProcess(
            name=side,
            overrides=[
                'gossip.bind=""',
                f'ingress.receiver="{side}"',
                *extra,
                *(keys.overrides("bench") if keys is not None else []),
            ],
        ).start()
        for side in SIDES
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    keys, cv = one_daemon_keys("gossipd-receiver-keys-") if args.curve else (None, None)
    daemons = start_receiver_daemons(keys)
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        for side, d in daemons.items():
            drive(d.endpoint, min(2000, args.tasks), args.window, run=f"warm-{side}", curve=cv)
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                d = daemons[side]
                c0 = cpu_ns(d.pid)
                res = drive(d.endpoint, args.tasks, args.window, run=f"{side}-{r}", curve=cv)
                cpu_us = (cpu_ns(d.pid) - c0) / 1e3 / res.tasks
                row = {**res.summary(), "cpu_us_per_task": round(cpu_us, 2), "ok": res.ok}
                rows[side].append(row)
                print(side, json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for d in daemons.values():
            d.stop()
    report: dict[str, Any] = {"curve": args.curve, "tasks": args.tasks, "window": args.window}
    for side in SIDES:
        report[side] = {
            k: statistics.median(row[k] for row in rows[side])
            for k in ("tasks_per_s", "p50_ms", "p99_ms", "cpu_us_per_task")
        }
        report[side]["rounds"] = rows[side]
    report["ratio_loop_vs_zmq"] = round(
        report["loop"]["tasks_per_s"] / report["zmq"]["tasks_per_s"], 3
    )
    if args.json:
        print(json.dumps(report))
    else:
        for side in SIDES:
            s = report[side]
            print(
                f"{side:5} {s['tasks_per_s']:>10,.0f} tasks/s  p50 {s['p50_ms']:.3f} ms  "
                f"p99 {s['p99_ms']:.3f} ms  CPU {s['cpu_us_per_task']:.1f} us a task"
            )
        print(f"ratio_loop_vs_zmq = {report['ratio_loop_vs_zmq']}")


if __name__ == "__main__":
    main()
