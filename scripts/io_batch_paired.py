"""``node.zmq_io_batch`` on and off, paired: ``gossipd bench http``'s gossipd variant (2
daemons, echo engine, both doors, about half the requests forwarded) started once per setting
per round, the two alternating, the bench's wrk at each concurrency; medians over rounds of
req/s, CPU microseconds a request of both daemons, p50 and p99.

    .venv/bin/python scripts/io_batch_paired.py [--rounds 3] [--seconds 4]
        [--concurrency 1,16,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.tools.bench.http import _gossipd
from gossipd.tools.bench.http_peers import Wrk, new_workdir

SETTING = "GOSSIPD_NODE__ZMQ_IO_BATCH"  # an environment variable beats the config's default


def one_setting(batch: bool, levels: list[int], seconds: int) -> dict[int, dict[str, float]]:
    os.environ[SETTING] = "true" if batch else "false"
    workdir = new_workdir()
    cluster, urls, pids = _gossipd(workdir)
    try:
        wrk = Wrk(workdir)
        wrk.run(urls, 16, 2, pids)  # warm
        out = {}
        for c in levels:
            w = wrk.run(urls, c, seconds, pids)
            out[c] = {
                "req_per_s": w.req_per_s,
                "cpu_us_per_req": w.cpu_us_per_req or 0.0,
                "p50_us": w.p50_us,
                "p99_us": w.p99_us,
            }
        return out
    finally:
        cluster.stop()
        os.environ.pop(SETTING, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        row: dict[str, Any] = {}
        for batch in order:
            print(f"round {r + 1}/{args.rounds}: zmq_io_batch={batch}", file=sys.stderr)
            row["batch" if batch else "default"] = one_setting(batch, levels, args.seconds)
        rounds.append(row)
    medians: dict[str, Any] = {}
    for c in levels:
        m = {}
        for side in ("default", "batch"):
            m[side] = {
                k: round(statistics.median(r[side][c][k] for r in rounds), 1)
                for k in ("req_per_s", "cpu_us_per_req", "p50_us", "p99_us")
            }
        m["cpu_ratio"] = round(m["batch"]["cpu_us_per_req"] / m["default"]["cpu_us_per_req"], 3)
        m["req_per_s_ratio"] = round(m["batch"]["req_per_s"] / m["default"]["req_per_s"], 3)
        medians[str(c)] = m
    report = {"rounds": rounds, "medians": medians, "load": os.getloadavg()}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for c, m in medians.items():
        d, b = m["default"], m["batch"]
        print(
            f"c={c}: req/s {d['req_per_s']:,.0f} -> {b['req_per_s']:,.0f} "
            f"(x{m['req_per_s_ratio']}), CPU us/req {d['cpu_us_per_req']} -> "
            f"{b['cpu_us_per_req']} (x{m['cpu_ratio']}), p50 {d['p50_us']:.0f} -> "
            f"{b['p50_us']:.0f} us, p99 {d['p99_us']:.0f} -> {b['p99_us']:.0f} us"
        )


if __name__ == "__main__":
    main()
