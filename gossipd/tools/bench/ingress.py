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

from gossipd.tools.bench.loadgen import LoadResult, ProducerCurve, drive
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from gossipd.tools.progress import Steps


def _raw_server() -> tuple[subprocess.Popen[str], str]:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipd.tools.bench.raw_echo", endpoint],
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


def _paired_median(curve: list[LoadResult], plain: list[LoadResult]) -> float:
    pairs = zip(curve, plain, strict=True)
    return round(statistics.median(c.tasks_per_s / p.tasks_per_s for c, p in pairs), 3)


def main(
    *,
    tasks: int,
    window: int,
    repeats: int,
    as_json: bool,
    curve: bool = False,
    batch_replies: bool = False,
    batch_tasks: bool = False,
) -> int:
    """``batch_replies``: the daemon's tasks ask for Replies frames (several results in one
    frame); ``batch_tasks``: the generator sends each refill as Tasks frames (several tasks in
    one).  The raw server's runs never use either."""
    if curve:
        return main_curve(
            tasks=tasks,
            window=window,
            repeats=repeats,
            as_json=as_json,
            batch_replies=batch_replies,
            batch_tasks=batch_tasks,
        )
    opts = {"batch_replies": batch_replies, "batch_tasks": batch_tasks}
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


def main_curve(
    *,
    tasks: int,
    window: int,
    repeats: int,
    as_json: bool,
    batch_replies: bool = False,
    batch_tasks: bool = False,
) -> int:
    """`--curve`: the same daemon with and without CURVE, alternating runs in one process
    pair; ``ratio_curve_vs_plain`` is the ratio of median throughputs, ``ratio_paired_median``
    the median of the rounds' own ratios."""
    import tempfile

    from gossipd.tools.curvekeys import CurveLayout

    keys = CurveLayout(
        tempfile.mkdtemp(prefix="gossipd-bench-keys-"), nodes=["bench"], producers=["producer"]
    )
    public, secret = keys.pair("producer")
    producer = ProducerCurve(public, secret, [keys.public("bench")])
    plain = DaemonProcess(name="plain", overrides=['gossip.bind=""']).start()
    secure = DaemonProcess(
        name="curve", overrides=['gossip.bind=""', *keys.overrides("bench")]
    ).start()
    runs: dict[str, list[LoadResult]] = {"plain": [], "curve": []}
    try:
        opts = {"batch_replies": batch_replies, "batch_tasks": batch_tasks}
        drive(plain.endpoint, min(2000, tasks), window, run="warm-plain", **opts)
        drive(
            secure.endpoint,
            min(2000, tasks),
            window,
            run="warm-curve",
            curve=producer,
            **opts,
        )
        for i in range(repeats):
            runs["plain"].append(drive(plain.endpoint, tasks, window, run=f"plain-{i}", **opts))
            runs["curve"].append(
                drive(
                    secure.endpoint,
                    tasks,
                    window,
                    run=f"curve-{i}",
                    curve=producer,
                    **opts,
                )
            )
            if not as_json:
                print(
                    f"round {i + 1}/{repeats}: plain {runs['plain'][-1].tasks_per_s:,.0f} "
                    f"tasks/s, curve {runs['curve'][-1].tasks_per_s:,.0f} tasks/s",
                    file=sys.stderr,
                )
    finally:
        plain.stop()
        secure.stop()
    p, c = _median_summary(runs["plain"]), _median_summary(runs["curve"])
    ratio = round(c["tasks_per_s"] / p["tasks_per_s"], 3)
    report = {
        "benchmark": "ingress",
        "curve": True,
        "tasks_per_run": tasks,
        "window": window,
        "repeats": repeats,
        "batch_replies": batch_replies,
        "batch_tasks": batch_tasks,
        "plain": p,
        "curve_on": c,
        "ratio_curve_vs_plain": ratio,
        # The median of each round's curve/plain (runs side by side): steadier than the
        # ratio of medians on a shared machine whose load drifts between rounds.
        "ratio_paired_median": _paired_median(runs["curve"], runs["plain"]),
        "goal_ratio": 0.9,
    }
    if as_json:
        print(json.dumps(report))
    else:
        print(f"{'':10}{'tasks/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
        for name, s in (("plain", p), ("curve", c)):
            print(f"{name:10}{s['tasks_per_s']:>12,.0f}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}")
        print(f"ratio_curve_vs_plain = {ratio} (goal >= 0.9)")
        print(f"ratio_paired_median = {report['ratio_paired_median']}")
    ok = all(r.ok == r.tasks for r in runs["plain"] + runs["curve"])
    return 0 if ok else 1
