"""Many producers of one host connecting at the same instant, paired by ``ingress.receiver``.

The loop's ingress lets at most 32 connections of one host shake hands at once
(gossipd/looppeer.py, HANDSHAKES_PER_HOST_MAX); one more is closed at accept, counted as
``busy``, and libzmq's PUSH connects again 100 ms later with its messages still queued.
Here ``--producers`` PUSH sockets (one process, all from 127.0.0.1: one host) connect to one
daemon (echo engine) at once and each sends ``--tasks`` tasks straight away; each side reads
them with its own receiver, the sides alternating over ``--rounds``.  For each round: every
task answered once (``drive_many`` raises on a task unanswered, and ignores a second
answer), the time from the first connect to the last answer, the latency's p50/p99/max,
and the ``busy`` closes of the daemon's ingress (``gossipd_ingress_connections_closed_total``;
libzmq's PULL has none).  bench/README.md, "Producers of one host connecting at once".

    .venv/bin/python scripts/connect_storm.py [--producers 200] [--tasks 5] [--rounds 3]
        [--curve] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gossipd.tools.bench.loadgen import ProducerCurve, drive_many, one_daemon_keys
from gossipd.tools.launcher import DaemonProcess
from scripts.ingress_receiver_paired import SIDES, start_receiver_daemons

_BUSY = re.compile(r'^gossipd_ingress_connections_closed_total\{reason="busy"\} (\S+)$', re.M)


def busy_closes(daemon: DaemonProcess) -> int:
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        found = _BUSY.search(answer.read().decode())
    return int(float(found.group(1))) if found else 0


def one_round(
    daemon: DaemonProcess, producers: int, tasks: int, run: str, curve: ProducerCurve | None
) -> dict[str, Any]:
    busy_before = busy_closes(daemon)
    n = producers * tasks
    res = drive_many(
        [daemon.endpoint] * producers,  # one PUSH socket each, all connecting now
        n,
        n,  # every task sent at once, each queued in its socket until its handshake is done
        run=run,
        entry_of=[i % producers for i in range(n)],
        curve=None
        if curve is None
        else ProducerCurve(curve.public, curve.secret, curve.server_keys * producers),
        timeout_s=60.0,
    )
    lat = sorted(res.latencies_ms)
    return {
        "answered": len(lat),
        "ok": res.ok,
        "all_answered_s": round(res.elapsed_s, 3),
        "p50_ms": round(lat[len(lat) // 2], 1),
        "p99_ms": round(lat[min(len(lat) - 1, len(lat) * 99 // 100)], 1),
        "max_ms": round(lat[-1], 1),
        "busy_closes": busy_closes(daemon) - busy_before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producers", type=int, default=200)
    ap.add_argument("--tasks", type=int, default=5, help="per producer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    keys, curve = one_daemon_keys("gossipd-storm-keys-") if args.curve else (None, None)
    daemons = start_receiver_daemons(keys, ['metrics.bind="127.0.0.1:0"'])
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                row = one_round(daemons[side], args.producers, args.tasks, f"{side}-{r}", curve)
                rows[side].append(row)
                print(side, json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for d in daemons.values():
            d.stop()
    report: dict[str, Any] = {
        "producers": args.producers,
        "tasks_per_producer": args.tasks,
        "curve": args.curve,
        "rounds": rows,
    }
    for side in SIDES:
        report[side] = {
            k: statistics.median(row[k] for row in rows[side])
            for k in ("all_answered_s", "p50_ms", "p99_ms", "max_ms", "busy_closes")
        }
        report[side]["lost"] = sum(
            args.producers * args.tasks - row["answered"] for row in rows[side]
        )
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for side in SIDES:
        m = report[side]
        print(
            f"{side}: all {args.producers * args.tasks} answered in {m['all_answered_s']} s "
            f"(median), p50 {m['p50_ms']} ms, p99 {m['p99_ms']} ms, max {m['max_ms']} ms, "
            f"busy closes {m['busy_closes']}, lost {m['lost']}"
        )


if __name__ == "__main__":
    main()
