"""Graceful degradation on real daemons: open-loop load near capacity, SIGKILL one daemon, and
see what producers get.  Each daemon runs the echo engine at a known service rate
(``concurrency`` workers x ``max_tokens`` x ``token_delay_s`` a task); a gossipd Client submits
tasks at ``load`` x the cluster's capacity to the daemons that stay up, and honours
``retry_after_ms`` on ``overloaded``.  Reported per phase (before / after the kill, by submit
time): tasks, ok, p50/p99 latency of ok tasks (submit to result, retries included), final
errors by code, and the daemons' refusals by reason.

    python -m gossipd.tools.bench.overload [--nodes 3] [--load 0.9] [--timeout-s 3] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from typing import Any

from gossipd.ops.scrape import scrape
from gossipd.tools.client import Client
from gossipd.tools.progress import percentile
from simulations.cluster import Cluster


async def _drive(
    endpoints: list[str],
    rate_per_s: float,
    duration_s: float,
    kill_at_s: float,
    kill: Any,
    *,
    max_tokens: int,
    timeout_s: float,
) -> tuple[list[tuple[float, float, str]], dict[str, int]]:
    """Submit at ``rate_per_s`` for ``duration_s``; returns (submitted at, latency, outcome)."""
    out: list[tuple[float, float, str]] = []
    async with Client(endpoints, resubmit_after_s=timeout_s + 5) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiters = []
        killed = False

        async def one(handle: Any, at: float) -> None:
            result = await handle.result()
            code = "ok" if result.ok else result.error.code
            out.append((at, loop.time() - start - at, code))

        n = 0
        while (now := loop.time() - start) < duration_s:
            if not killed and now >= kill_at_s:
                kill()
                killed = True
            while n < now * rate_per_s:
                handle = await client.submit(
                    f"w{n} x y z", max_tokens=max_tokens, timeout_s=timeout_s
                )
                waiters.append(asyncio.create_task(one(handle, n / rate_per_s)))
                n += 1
            await asyncio.sleep(0.002)
        await asyncio.gather(*waiters)
        stats = client.statistics()
    return out, {"retried": stats.retried, "resubmitted": stats.resubmitted}


def _phase(rows: list[tuple[float, float, str]]) -> dict[str, Any]:
    ok = sorted(lat for _, lat, code in rows if code == "ok")
    codes = Counter(code for _, _, code in rows if code != "ok")
    return {
        "tasks": len(rows),
        "ok": len(ok),
        "p50_s": round(percentile(ok, 50), 3) if ok else None,
        "p99_s": round(percentile(ok, 99), 3) if ok else None,
        "errors": dict(codes),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.9, help="share of the cluster's capacity")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=5)
    ap.add_argument("--token-delay-s", type=float, default=0.02)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--before-s", type=float, default=8.0)
    ap.add_argument("--after-s", type=float, default=14.0)
    ap.add_argument("--set", action="append", default=[], help="a daemon config override")
    args = ap.parse_args()
    service_s = args.max_tokens * args.token_delay_s
    rate = args.load * args.nodes * args.concurrency / service_s
    overrides = [
        "engine.kind=echo",
        f"engine.token_delay_s={args.token_delay_s}",
        f"ingress.concurrency_max={args.concurrency}",
        "metrics.bind=127.0.0.1:0",
        *args.set,
    ]
    cluster = Cluster(
        args.nodes, log_dir=tempfile.mkdtemp(prefix="gossipd-overload-"), extra_overrides=overrides
    )
    cluster.start()
    try:
        cluster.wait_meta()
        victim = cluster.daemons[-1]
        entries = [d.endpoint for d in cluster.daemons[:-1]]
        rows, client_stats = asyncio.run(
            _drive(
                entries,
                rate,
                args.before_s + args.after_s,
                args.before_s,
                victim.kill,
                max_tokens=args.max_tokens,
                timeout_s=args.timeout_s,
            )
        )
        refused: Counter[str] = Counter()
        for d in cluster.daemons[:-1]:
            for name, value in scrape(d.metrics_port).items():
                if name.startswith("gossipd_messages_refused_total{"):
                    refused[name.split("reason=", 1)[1].rstrip("}")] += int(value)
    finally:
        for d in cluster.daemons:
            d.stop(timeout_s=5)
    kill_at = args.before_s
    report = {
        "rate_per_s": round(rate, 1),
        "capacity_per_s": args.nodes * args.concurrency / service_s,
        "overrides": args.set,
        "before": _phase([r for r in rows if r[0] < kill_at]),
        "after_0_2s": _phase([r for r in rows if kill_at <= r[0] < kill_at + 2]),
        "after_2s_on": _phase([r for r in rows if r[0] >= kill_at + 2]),
        "client": client_stats,
        "daemon_refusals": dict(refused),
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
