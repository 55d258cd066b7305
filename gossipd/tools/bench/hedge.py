"""`gossipd bench hedge`: what hedging buys when a member stalls, and what it costs.

Two fresh 3-daemon clusters in the same run, hedging off then on, otherwise alike: echo engine
at 20 ms a token, 4 tokens (an 80 ms task, like a short LLM call).  An open-loop producer
pushes keyed tasks at a fixed rate through the two entry points that stay up; after a second, one
member is stopped (SIGSTOP, a stand-in for a long GC pause or a stuck loop) for
``--stall-ms`` and then resumed.  Reported per mode: latency p50/p99/max over all tasks and
over the tasks whose key the stalled member owns, failures, and Results the producer got
twice (hedging's cost; gossipd's Client drops them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from typing import Any

import msgpack
import zmq

from gossipd.core.ring import Ring
from gossipd.ops.scrape import scrape
from gossipd.tools.bench.loadgen import final_results
from gossipd.tools.progress import Steps, percentile
from simulations.cluster import Cluster


def _figures(latencies_ms: list[float]) -> dict[str, float]:
    lat = sorted(latencies_ms)
    if not lat:
        return {"n": 0}
    return {
        "n": len(lat),
        "p50_ms": round(percentile(lat, 50), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "max_ms": round(lat[-1], 2),
    }


def _one_mode(hedge: bool, *, rate: float, seconds: float, stall_ms: int) -> dict[str, Any]:
    cluster = Cluster(
        3,
        extra_overrides=[
            f"fanout.hedge={'true' if hedge else 'false'}",
            "engine.token_delay_s=0.02",
            'journal.path=""',
            'metrics.bind="127.0.0.1:0"',
        ],
    )
    cluster.start()
    ctx = zmq.Context()
    try:
        cluster.wait_converged(30)
        cluster.wait_meta(30)
        victim = cluster.daemons[1]
        ring = Ring({d.name: 1.0 for d in cluster.daemons})
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        pushes = []
        for d in cluster.daemons:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(d.endpoint)
            pushes.append(sock)
        total = int(rate * seconds)
        sent_at: dict[str, float] = {}
        owner_of: dict[str, str] = {}
        latency: dict[str, float] = {}
        results: Counter[str] = Counter()
        failed = 0
        start = time.monotonic()
        stall_at, resume_at = start + 1.0, start + 1.0 + stall_ms / 1000
        stalled = resumed = False
        i = 0
        while True:
            now = time.monotonic()
            if not stalled and now >= stall_at:
                os.kill(victim.pid, signal.SIGSTOP)
                stalled = True
            if stalled and not resumed and now >= resume_at:
                os.kill(victim.pid, signal.SIGCONT)
                resumed = True
            while i < total and now >= start + i / rate:
                task_id, key = f"h{int(hedge)}-{i}", f"key-{i}"
                frame = {
                    "v": 1,
                    "t": 1,
                    "id": task_id,
                    "key": key,
                    "prompt": "a b c d",
                    "params": {"max_tokens": 4},
                    "reply_to": f"tcp://127.0.0.1:{port}",
                }
                sent_at[task_id] = time.monotonic()
                owner_of[task_id] = ring.owner(key)
                # Into the two members that keep running: what a stalled entry point holds
                # is beyond any fan-out (its producer resubmits elsewhere after a timeout).
                pushes[(i % 2) * 2].send(msgpack.packb(frame))
                i += 1
            if (
                i >= total
                and resumed
                and (len(latency) + failed >= total or now - start > seconds + 15)
            ):
                break
            for reply in final_results(pull, 2):
                results[reply["id"]] += 1
                if results[reply["id"]] > 1:
                    continue
                if reply["ok"]:
                    latency[reply["id"]] = (time.monotonic() - sent_at[reply["id"]]) * 1e3
                else:
                    failed += 1
        # Late duplicates (a withdrawn copy that had finished) arrive after the stall ends.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if pull.poll(100):
                reply = msgpack.unpackb(pull.recv())
                if reply.get("t") == 3:
                    results[reply["id"]] += 1
        entry_stats: Counter[str] = Counter()
        for d in cluster.daemons:
            m = scrape(d.metrics_port)
            for name in (
                "forwarded",
                "attempts_failed",
                "hedged",
                "hedge_wins",
                "hedges_over_budget",
                "withdrawn",
                "withdrawn_by_peers",
            ):
                entry_stats[name] += int(m.get(f"gossipd_fanout_{name}_total", 0))
        victims = [ms for t, ms in latency.items() if owner_of[t] == victim.name]
        # Sent while the owner was stopped: what hedging can help (tasks it had accepted
        # before it stopped wait for it whatever the forwarder does).
        in_stall = [
            ms
            for t, ms in latency.items()
            if owner_of[t] == victim.name and stall_at <= sent_at[t] < resume_at
        ]
        return {
            "hedge": hedge,
            "tasks": total,
            "answered": len(latency) + failed,
            "failed": failed,
            "lost": total - len(results),
            "answered_twice": sum(n > 1 for n in results.values()),
            "all": _figures(list(latency.values())),
            "owned_by_stalled_member": _figures(victims),
            "sent_to_stalled_owner_during_stall": _figures(in_stall),
            "fanout": dict(entry_stats),
        }
    finally:
        ctx.destroy(linger=0)
        cluster.stop()


def main(*, rate: float, seconds: float, stall_ms: int, as_json: bool) -> int:
    runs = []
    with Steps(2, "bench hedge") as steps:  # on stderr: stdout is the report
        for hedge in (False, True):
            steps.start(
                f"hedging {'on' if hedge else 'off'}: 3 daemons, {int(rate * seconds)} tasks, "
                f"{stall_ms} ms stall"
            )
            runs.append(_one_mode(hedge, rate=rate, seconds=seconds, stall_ms=stall_ms))
    off, on = runs
    from gossipd.config import FanoutConfig

    defaults = FanoutConfig()
    report = {
        "benchmark": "hedge",
        "config": {
            k: getattr(defaults, k)
            for k in (
                "ack_timeout_s",
                "ack_delay_s",
                "hedge_quantile",
                "hedge_min_s",
                "hedge_budget",
            )
        },
        "rate_per_s": rate,
        "stall_ms": stall_ms,
        "runs": runs,
        "during_stall_p50_ratio_on_vs_off": round(
            on["sent_to_stalled_owner_during_stall"]["p50_ms"]
            / off["sent_to_stalled_owner_during_stall"]["p50_ms"],
            3,
        ),
    }
    if as_json:
        print(json.dumps(report))
        return 0
    print(
        f"hedging with one of 3 members stopped for {stall_ms} ms ({rate:.0f} tasks/s, 80 ms tasks)"
    )
    print(f"{'hedge':>6} {'set':>8} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9}  lost failed twice")
    for r in runs:
        for label, f in (
            ("all", r["all"]),
            ("owned", r["owned_by_stalled_member"]),
            ("in stall", r["sent_to_stalled_owner_during_stall"]),
        ):
            print(
                f"{'on' if r['hedge'] else 'off':>6} {label:>8} {f['n']:>6} {f['p50_ms']:>7.1f}ms "
                f"{f['p99_ms']:>7.1f}ms {f['max_ms']:>7.1f}ms  {r['lost']:>4} {r['failed']:>6} "
                f"{r['answered_twice']:>5}"
            )
        print(f"{'':>6} fan-out: {r['fanout']}")
    print(
        "p50 of the tasks sent to the stalled owner during the stall, on / off: "
        f"{report['during_stall_p50_ratio_on_vs_off']}"
    )
    return 0
