"""`gossipd bench ingress`: one daemon (echo engine, zero delay) against raw pyzmq.

Both servers run as separate processes and get identical task bytes from the same closed-loop
generator; runs alternate (raw, daemon, raw, daemon, ...) so machine noise hits both, and we
report medians over ``repeats`` and the ratio of median throughputs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

from gossipd.tools.bench.curvecompare import (
    PRODUCERS,
    SIDES,
    print_ratios,
    producers_of,
    report_producers,
    round_note,
    round_order,
)
from gossipd.tools.bench.loadgen import LoadResult, drive, one_daemon_keys
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from gossipd.tools.progress import Steps


def _raw_server(relay_to: str = "") -> tuple[subprocess.Popen[str], str]:
    """The raw echo server, or with ``relay_to`` a raw relay to one (raw_echo.py)."""
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    relay = ["--relay-to", relay_to] if relay_to else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipd.tools.bench.raw_echo", endpoint, *relay],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the raw echo server did not start")
    return proc, endpoint


def _median_summary(results: list[LoadResult]) -> dict[str, float]:
    summaries = [r.summary() for r in results]
    return {k: round(statistics.median(s[k] for s in summaries), 3) for k in summaries[0]}


def main(
    *,
    tasks: int,
    window: int,
    repeats: int,
    as_json: bool,
    curve: bool = False,
    batch_replies: bool = False,
    batch_tasks: bool = False,
    producer: str = "both",
) -> int:
    """``batch_replies``: the daemon's tasks ask for Replies frames (several results in one
    frame); ``batch_tasks``: the generator sends each refill as Tasks frames (several tasks in
    one).  The raw server's runs never use either.  ``curve``: compare with and without
    CURVE instead, for ``producer`` (``curvecompare.producers_of``)."""
    if curve:
        return main_curve(
            tasks=tasks, window=window, repeats=repeats, as_json=as_json, producer=producer
        )
    opts: dict[str, Any] = {"batch_replies": batch_replies, "batch_tasks": batch_tasks}
    steps = Steps(repeats + 1, "bench ingress")  # on stderr: stdout is the report
    steps.start("starting a daemon and a raw pyzmq echo server; warming both")
    raw_proc, raw_endpoint = _raw_server()
    daemon = DaemonProcess(name="bench").start()
    raw_runs: list[LoadResult] = []
    daemon_runs: list[LoadResult] = []
    try:
        # Warm-up: connections, caches, first-touch allocations.
        drive(raw_endpoint, min(2000, tasks), window, run="warm-raw")
        drive(daemon.endpoint, min(2000, tasks), window, run="warm-daemon", **opts)
        for i in range(repeats):
            steps.start(f"round {i + 1}/{repeats}: {tasks} tasks to each side")
            raw_runs.append(drive(raw_endpoint, tasks, window, run=f"raw-{i}"))
            daemon_runs.append(drive(daemon.endpoint, tasks, window, run=f"daemon-{i}", **opts))
            steps.note(
                f"raw {raw_runs[-1].tasks_per_s:,.0f} tasks/s, "
                f"daemon {daemon_runs[-1].tasks_per_s:,.0f} tasks/s"
            )
    finally:
        raw_proc.terminate()
        raw_proc.wait()
        daemon.stop()
        steps.close()
    raw, dmn = _median_summary(raw_runs), _median_summary(daemon_runs)
    ratio = round(dmn["tasks_per_s"] / raw["tasks_per_s"], 3)
    report = {
        "benchmark": "ingress",
        "tasks_per_run": tasks,
        "window": window,
        "repeats": repeats,
        "batch_replies": batch_replies,
        "batch_tasks": batch_tasks,
        "raw_zmq": raw,
        "daemon": dmn,
        "ratio_vs_raw_zmq": ratio,
        "goal_ratio": 0.35,
    }
    if as_json:
        print(json.dumps(report))
    else:
        print(f"{'':10}{'tasks/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
        for name, s in (("raw zmq", raw), ("daemon", dmn)):
            print(f"{name:10}{s['tasks_per_s']:>12,.0f}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}")
        print(f"ratio_vs_raw_zmq = {ratio} (goal >= 0.35)")
    ok = all(r.ok == r.tasks for r in raw_runs + daemon_runs)
    return 0 if ok else 1


def main_curve(*, tasks: int, window: int, repeats: int, as_json: bool, producer: str) -> int:
    """`--curve`: the same daemon with and without CURVE, alternating runs in one process
    pair, for each kind of producer (``curvecompare``); per producer,
    ``ratio_curve_vs_plain`` is the ratio of median throughputs and ``ratio_paired_median``
    the median of the rounds' own ratios."""
    kinds = producers_of(producer)
    keys, producer_keys = one_daemon_keys("gossipd-bench-keys-")
    steps = Steps(repeats + 1, "bench ingress --curve")  # on stderr: stdout is the report
    steps.start("starting a daemon without CURVE and one with it; warming both")
    plain = DaemonProcess(name="plain", overrides=['gossip.bind=""']).start()
    secure = DaemonProcess(
        name="curve", overrides=['gossip.bind=""', *keys.overrides("bench")]
    ).start()
    sides = {"plain": (plain.endpoint, None), "curve": (secure.endpoint, producer_keys)}
    runs: dict[tuple[str, str], list[LoadResult]] = {(k, s): [] for k in kinds for s in SIDES}
    try:
        for kind in kinds:
            for side, (endpoint, cv) in sides.items():
                drive(
                    endpoint,
                    min(2000, tasks),
                    window,
                    run=f"warm-{side}-{kind}",
                    curve=cv,
                    **PRODUCERS[kind].opts(),
                )
        for i in range(repeats):
            steps.start(f"round {i + 1}/{repeats}: {tasks} tasks a run")
            for kind, side in round_order(i, kinds):
                endpoint, cv = sides[side]
                runs[kind, side].append(
                    drive(
                        endpoint,
                        tasks,
                        window,
                        run=f"{side}-{kind}-{i}",
                        curve=cv,
                        **PRODUCERS[kind].opts(),
                    )
                )
            steps.note(round_note(kinds, lambda kind, side: runs[kind, side][-1].tasks_per_s))
    finally:
        plain.stop()
        secure.stop()
        steps.close()
    report: dict[str, Any] = {
        "benchmark": "ingress",
        "curve": True,
        "tasks_per_run": tasks,
        "window": window,
        "repeats": repeats,
    }
    report_producers(
        report,
        kinds,
        "tasks_per_s",
        lambda kind, side: _median_summary(runs[kind, side]),
        lambda kind, side: [r.tasks_per_s for r in runs[kind, side]],
    )
    if as_json:
        print(json.dumps(report))
    else:
        print(f"{'':26}{'tasks/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
        for kind in kinds:
            for side in ("plain", "curve_on"):
                s = report["producers"][kind][side]
                name = f"{kind}, {side}"
                print(
                    f"{name:26}{s['tasks_per_s']:>12,.0f}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}"
                )
        print_ratios(report)
    ok = all(r.ok == r.tasks for rs in runs.values() for r in rs)
    return 0 if ok else 1
