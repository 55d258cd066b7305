"""`gossipd bench route --nodes 3`: fan-out cost with real daemons (echo engine, zero delay).

Tasks enter at a random daemon, so about 2/3 enter at a non-owner and take one forward hop.
Added latency per hop = latency of 1-hop tasks minus latency of 0-hop tasks, both measured in
the same rounds at window 1 (no queueing), p50 and p99.  Throughput at a window of 300 is
compared with raw pyzmq PUSH/PULL + MessagePack (one raw echo server) measured in the same run.
The floor under the added latency per hop is measured in the same rounds too: the same tasks
at window 1 through a raw pyzmq relay to the raw echo server, minus straight to it (one
ZeroMQ hop through one Python process that reads the task, and nothing else: raw_echo.py).
"""

from __future__ import annotations

import json
import random
import statistics
from typing import Any

from gossipd.core.ring import Ring
from gossipd.tools.bench.curvecompare import (
    PRODUCERS,
    SIDES,
    print_ratios,
    producers_of,
    report_producers,
    round_note,
    round_order,
)
from gossipd.tools.bench.ingress import _raw_server
from gossipd.tools.bench.loadgen import ProducerCurve, drive, drive_many
from gossipd.tools.bench.plotting import percent_figure, save_percent_figure
from gossipd.tools.progress import Steps, percentile
from simulations.cluster import Cluster


def main(
    *,
    nodes: int,
    tasks: int,
    repeats: int,
    as_json: bool,
    journal: bool = False,
    plot: str | None = None,
    curve: bool = False,
    batch_replies: bool = False,
    batch_tasks: bool = False,
    producer: str = "both",
    throughput_tasks: int = 0,
) -> int:
    """``batch_replies``: the cluster's tasks ask for Replies frames (several results in one
    frame); ``batch_tasks``: the generator sends each refill as Tasks frames (several tasks
    in one).  The raw server's runs never use either.  ``curve``: compare with and without
    CURVE instead, for ``producer`` (``curvecompare.producers_of``);
    ``throughput_tasks``: tasks per throughput run with ``curve`` (0: 4 x ``tasks``)."""
    if curve:
        return main_curve(
            nodes=nodes,
            tasks=tasks,
            repeats=repeats,
            as_json=as_json,
            producer=producer,
            throughput_tasks=throughput_tasks,
        )
    opts: dict[str, Any] = {"batch_replies": batch_replies, "batch_tasks": batch_tasks}
    steps = Steps(repeats + 1, "bench route")  # on stderr: stdout is the report
    say = steps.note
    rng = random.Random(7)
    # The journal's fsync costs the same with or without a hop; off by default here so that
    # the figures isolate forwarding (--journal to include it).
    journal_overrides = [] if journal else ['journal.path=""']
    steps.start(f"starting {nodes} daemons, a raw pyzmq echo server and a raw relay to it")
    raw_proc, raw_endpoint = _raw_server()
    relay_proc, relay_endpoint = _raw_server(relay_to=raw_endpoint)
    cluster = Cluster(nodes, extra_overrides=journal_overrides)
    cluster.start()
    try:
        cluster.wait_converged(30)
        cluster.wait_meta(30)
        ring = Ring({d.name: 1.0 for d in cluster.daemons})
        endpoints = [d.endpoint for d in cluster.daemons]
        names = [d.name for d in cluster.daemons]
        keys = [f"k{i}" for i in range(tasks)]
        entry = [rng.randrange(nodes) for _ in range(tasks)]
        hops = [0 if names[entry[i]] == ring.owner(keys[i]) else 1 for i in range(tasks)]
        zero, one, tput_raw, tput_cluster = [], [], [], []
        raw_zero: list[float] = []  # window 1, straight to the raw echo server
        raw_one: list[float] = []  # window 1, through the raw relay
        warm = min(1000, tasks)  # (--tasks below 1,000 used to index past the keys)
        drive_many(
            endpoints,
            warm,
            100,
            run="warm",
            entry_of=entry[:warm],
            keys=keys[:warm],
            **opts,
        )
        for r in range(repeats):
            steps.start(f"round {r + 1}/{repeats}: latency at window 1, then throughput")
            lat = drive_many(endpoints, tasks, 1, run=f"lat{r}", entry_of=entry, keys=keys, **opts)
            assert lat.by_task_ms is not None
            zero += [lat.by_task_ms[i] for i in range(tasks) if hops[i] == 0]
            one += [lat.by_task_ms[i] for i in range(tasks) if hops[i] == 1]
            raw_zero += drive(raw_endpoint, tasks, 1, run=f"rawlat{r}").latencies_ms
            raw_one += drive(relay_endpoint, tasks, 1, run=f"relaylat{r}").latencies_ms
            tput_raw.append(drive(raw_endpoint, tasks * 4, 300, run=f"raw{r}").tasks_per_s)
            tput_cluster.append(
                drive_many(
                    endpoints,
                    tasks * 4,
                    300,
                    run=f"tp{r}",
                    entry_of=entry * 4,
                    keys=keys * 4,
                    **opts,
                ).tasks_per_s
            )
            say(
                f"round {r + 1}/{repeats}: raw {tput_raw[-1]:,.0f}/s, cluster {tput_cluster[-1]:,.0f}/s"
            )
    finally:
        cluster.stop()
        for proc in (relay_proc, raw_proc):
            proc.terminate()
            proc.wait()
        steps.close()
    zero.sort()
    one.sort()
    raw_zero.sort()
    raw_one.sort()
    p = {q: round(percentile(one, q) - percentile(zero, q), 3) for q in (50, 99)}
    raw_hop = {q: round(percentile(raw_one, q) - percentile(raw_zero, q), 3) for q in (50, 99)}
    raw_tps, cl_tps = statistics.median(tput_raw), statistics.median(tput_cluster)
    report = {
        "benchmark": "route",
        "nodes": nodes,
        "batch_replies": batch_replies,
        "batch_tasks": batch_tasks,
        "forwarded_fraction": round(sum(hops) / len(hops), 3),
        "latency_0_hop_ms": {
            "p50": round(percentile(zero, 50), 3),
            "p99": round(percentile(zero, 99), 3),
        },
        "latency_1_hop_ms": {
            "p50": round(percentile(one, 50), 3),
            "p99": round(percentile(one, 99), 3),
        },
        "hop_overhead_ms": {"p50": p[50], "p99": p[99]},
        # The floor from the same rounds: one raw ZeroMQ hop through a Python relay.
        "raw_zmq_hop_ms": {"p50": raw_hop[50], "p99": raw_hop[99]},
        "hop_over_raw_p50_ms": round(p[50] - raw_hop[50], 3),
        "raw_zmq_tasks_per_s": round(raw_tps, 1),
        "cluster_tasks_per_s": round(cl_tps, 1),
        "ratio_vs_raw_zmq": round(cl_tps / raw_tps, 3),
        "goals": {"hop_overhead_p50_ms": 0.3, "hop_overhead_p99_ms": 2.0, "ratio_vs_raw_zmq": 0.25},
    }
    if plot:
        plot_latency(zero, one, report, plot)
        say(f"wrote {plot}")
    if as_json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 0


def plot_latency(zero: list[float], one: list[float], report: dict[str, Any], path: str) -> None:
    """Latency distribution (CDF) of tasks run where they entered and of forwarded ones; the
    horizontal gap between the curves is the added latency per hop at each percentile."""
    fig, ax = percent_figure(3.8)
    import matplotlib.ticker

    for label, values in (("run where it entered (0 hops)", zero), ("forwarded (1 hop)", one)):
        ys = [100 * (i + 1) / len(values) for i in range(len(values))]
        ax.plot(values, ys, label=f"{label}, n={len(values):,}")
    hop = report["hop_overhead_ms"]
    for q in (50, 99):
        ax.axhline(q, color="grey", linewidth=0.5, linestyle=":")
    ax.set_xscale("log")
    ticks = [
        t for t in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 50) if zero[0] / 2 <= t <= one[-1] * 2
    ]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("latency at the producer, window 1 (ms, log scale)")
    ax.set_ylabel("tasks (%)")
    title = (
        f"gossipd bench route: {report['nodes']} daemons, echo engine, zero delay\n"
        f"added per hop p50 {hop['p50']:.3f} ms, p99 {hop['p99']:.3f} ms "
        f"(raw ZeroMQ relay p50 {report['raw_zmq_hop_ms']['p50']:.3f}); "
        f"throughput {report['ratio_vs_raw_zmq']:.2f}x raw pyzmq"
    )
    save_percent_figure(fig, ax, title, path)


def main_curve(
    *, nodes: int, tasks: int, repeats: int, as_json: bool, producer: str, throughput_tasks: int
) -> int:
    """`--curve`: two clusters of ``nodes`` daemons, one with CURVE on every socket (ingress,
    replies, gossip, rpc), driven alternately with the same keys, entry points and window,
    for each kind of producer (``curvecompare``); per producer, ``ratio_curve_vs_plain`` is the
    ratio of median throughputs (window 300), and the 0- and 1-hop latencies (window 1) are
    reported for both sides."""
    kinds = producers_of(producer)
    rng = random.Random(7)
    n_tp = throughput_tasks or tasks * 4
    steps = Steps(repeats + 1, "bench route --curve")  # on stderr: stdout is the report
    steps.start(f"starting two clusters of {nodes} daemons, one with CURVE; warming both")
    plain = Cluster(nodes, extra_overrides=['journal.path=""'])
    secure = Cluster(nodes, extra_overrides=['journal.path=""'], curve=True)
    assert secure.keys is not None
    public, secret = secure.keys.pair("producer")
    producer_keys = ProducerCurve(
        public, secret, [secure.keys.public(d.name) for d in secure.daemons]
    )
    plain.start()
    secure.start()
    sides = {"plain": (plain, None), "curve": (secure, producer_keys)}
    figures: dict[tuple[str, str], dict[str, list[float]]] = {
        (k, s): {"tput": [], "zero": [], "one": []} for k in kinds for s in SIDES
    }
    try:
        for c in (plain, secure):
            c.wait_converged(30)
            c.wait_meta(30)
        ring = Ring({d.name: 1.0 for d in plain.daemons})  # the same names in both
        names = [d.name for d in plain.daemons]
        keys = [f"k{i}" for i in range(tasks)]
        entry = [rng.randrange(nodes) for _ in range(tasks)]
        hops = [0 if names[entry[i]] == ring.owner(keys[i]) else 1 for i in range(tasks)]
        # The throughput runs: the same keys and entry points, repeated.
        times = -(-n_tp // tasks)
        entry_tp, keys_tp = (entry * times)[:n_tp], (keys * times)[:n_tp]
        warm = min(1000, tasks)
        for kind in kinds:
            for side, (c, cv) in sides.items():
                drive_many(
                    [d.endpoint for d in c.daemons],
                    warm,
                    100,
                    run=f"warm-{side}-{kind}",
                    entry_of=entry[:warm],
                    keys=keys[:warm],
                    curve=cv,
                    **PRODUCERS[kind].opts(),
                )
        for r in range(repeats):
            steps.start(f"round {r + 1}/{repeats}: {tasks} tasks at window 1, {n_tp} at 300")
            for kind, side in round_order(r, kinds):
                c, cv = sides[side]
                endpoints = [d.endpoint for d in c.daemons]
                f = figures[kind, side]
                opts = PRODUCERS[kind].opts()
                lat = drive_many(
                    endpoints,
                    tasks,
                    1,
                    run=f"lat{r}-{side}-{kind}",
                    entry_of=entry,
                    keys=keys,
                    curve=cv,
                    **opts,
                )
                assert lat.by_task_ms is not None
                f["zero"] += [lat.by_task_ms[i] for i in range(tasks) if hops[i] == 0]
                f["one"] += [lat.by_task_ms[i] for i in range(tasks) if hops[i] == 1]
                f["tput"].append(
                    drive_many(
                        endpoints,
                        n_tp,
                        300,
                        run=f"tp{r}-{side}-{kind}",
                        entry_of=entry_tp,
                        keys=keys_tp,
                        curve=cv,
                        **opts,
                    ).tasks_per_s
                )
            steps.note(round_note(kinds, lambda kind, side: figures[kind, side]["tput"][-1]))
    finally:
        plain.stop()
        secure.stop()
        steps.close()

    def side_figures(f: dict[str, list[float]]) -> dict[str, Any]:
        zero, one = sorted(f["zero"]), sorted(f["one"])
        return {
            "cluster_tasks_per_s": round(statistics.median(f["tput"]), 1),
            "latency_0_hop_ms": {f"p{q}": round(percentile(zero, q), 3) for q in (50, 99)},
            "latency_1_hop_ms": {f"p{q}": round(percentile(one, q), 3) for q in (50, 99)},
        }

    report: dict[str, Any] = {
        "benchmark": "route",
        "curve": True,
        "nodes": nodes,
        "tasks_per_throughput_run": n_tp,
        "repeats": repeats,
    }
    report_producers(
        report,
        kinds,
        "cluster_tasks_per_s",
        lambda kind, side: side_figures(figures[kind, side]),
        lambda kind, side: figures[kind, side]["tput"],
    )
    if as_json:
        print(json.dumps(report))
    else:
        for kind in kinds:
            for side in ("plain", "curve_on"):
                print(f"{kind}, {side}: {report['producers'][kind][side]}")
        print_ratios(report)
    return 0
