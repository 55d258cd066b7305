"""`gossipd bench budgets`: can a runaway producer starve a well-behaved one?

Real daemons (``--nodes``, 2) with token budgets on, the echo engine at a known service rate
(``concurrency`` workers x ``max_tokens`` x ``token_delay_s`` a task), and two producers that
push keyed tasks through every daemon (a PUSH socket connected to all: round-robin):

- "good" (key prefix ``good:``, a share of 0.3 of the cluster's rate) sends ``--good-load`` of
  the cluster's capacity, open loop, and measures each task's latency (send to Result);
- "runaway" (``bad:``, a share of 0.1) sends ``--overdrive`` (10) x its budget, open loop,
  from another process, ignoring every hint.

Phases alternate in the same run (good alone, good with the runaway; the order flips every
round), ``--seconds`` each; reported: good's p50/p99 per phase and the medians over the
rounds, the ratio of the medians of p99 (with the runaway / alone: the goal is <= 1.2), and
what the runaway got (ok, over_budget, its admitted tokens/s against its budget).
``--compare-off`` adds one round on a fresh cluster with budgets off, to show what the
budgets prevent.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from collections import Counter
from typing import Any

import msgpack
import zmq

from gossipd.core.tokenbudgets import task_cost_tokens
from gossipd.ops.scrape import scrape
from gossipd.tools.bench.loadgen import final_results
from gossipd.tools.progress import Steps, percentile
from simulations.cluster import Cluster

GOOD_SHARE = 0.3
RUNAWAY_SHARE = 0.1
PROMPT = "w x y z a b"  # 11 characters: 3 tokens at 4 characters a token


def _task(task_id: str, key: str, reply_to: str, max_tokens: int) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "t": 1,
            "id": task_id,
            "key": key,
            "prompt": PROMPT,
            "params": {"max_tokens": max_tokens},
            "reply_to": reply_to,
            "timeout_ms": 10_000,
        }
    )


def _runaway(
    endpoints: list[str],
    rate_per_s: float,
    start_at: float,
    seconds: float,
    max_tokens: int,
    tag: str,
    out: Any,
) -> None:
    """The runaway producer (a child process): open loop at ``rate_per_s``, no retries."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    reply_to = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    for endpoint in endpoints:
        push.connect(endpoint)
    codes: Counter[str] = Counter()
    hints: list[int] = []
    answered: set[str] = set()
    while time.time() < start_at:
        time.sleep(0.005)
    start = time.monotonic()
    sent = 0
    total = int(rate_per_s * seconds)
    while True:
        now = time.monotonic()
        while sent < total and now >= start + sent / rate_per_s:
            push.send(_task(f"bad-{tag}-{sent}", f"bad:{sent}", reply_to, max_tokens))
            sent += 1
        if sent >= total and (sum(codes.values()) >= total or now - start > seconds + 5):
            break
        for reply in final_results(pull, 2):
            if reply["id"] not in answered:
                answered.add(reply["id"])
                code = "ok" if reply["ok"] else reply["error"]["code"]
                codes[code] += 1
                if code == "over_budget":
                    hints.append(reply["error"]["retry_after_ms"])
    ctx.destroy(linger=0)
    out.put(
        {
            "sent": sent,
            "codes": dict(codes),
            "unanswered": sorted(set(f"bad-{tag}-{i}" for i in range(sent)) - answered)[:20],
            "retry_after_ms_p50": percentile(sorted(hints), 50) if hints else None,
        }
    )


def _good(
    push: zmq.Socket,
    pull: zmq.Socket,
    reply_to: str,
    *,
    rate_per_s: float,
    seconds: float,
    max_tokens: int,
    tag: str,
) -> dict[str, Any]:
    """The well-behaved producer, open loop in this process: latency of each task."""
    total = int(rate_per_s * seconds)
    sent_at: dict[str, float] = {}
    latency_ms: list[float] = []
    codes: Counter[str] = Counter()
    start = time.monotonic()
    sent = 0
    while True:
        now = time.monotonic()
        while sent < total and now >= start + sent / rate_per_s:
            task_id = f"good-{tag}-{sent}"
            sent_at[task_id] = time.monotonic()
            push.send(_task(task_id, f"good:{sent}", reply_to, max_tokens))
            sent += 1
        if sent >= total and (sum(codes.values()) >= total or now - start > seconds + 10):
            break
        for reply in final_results(pull, 1):
            if reply["id"] not in sent_at:
                continue
            codes["ok" if reply["ok"] else reply["error"]["code"]] += 1
            if reply["ok"]:
                latency_ms.append((time.monotonic() - sent_at.pop(reply["id"])) * 1e3)
    lat = sorted(latency_ms)
    return {
        "sent": total,
        "codes": dict(codes),
        "p50_ms": round(percentile(lat, 50), 2) if lat else None,
        "p99_ms": round(percentile(lat, 99), 2) if lat else None,
    }


def _cluster_run(
    budgets: bool,
    *,
    nodes: int,
    rounds: int,
    seconds: float,
    concurrency: int,
    token_delay_s: float,
    max_tokens: int,
    good_load: float,
    overdrive: float,
    steps: Steps,
) -> dict[str, Any]:
    cost = task_cost_tokens(len(PROMPT), max_tokens, 4.0)
    tasks_per_s_per_daemon = concurrency / (max_tokens * token_delay_s)
    tokens_per_s_per_capacity = tasks_per_s_per_daemon * cost
    cluster_tasks_per_s = tasks_per_s_per_daemon * nodes
    runaway_budget_tokens_per_s = RUNAWAY_SHARE * tokens_per_s_per_capacity * nodes
    runaway_rate = overdrive * runaway_budget_tokens_per_s / cost
    good_rate = good_load * cluster_tasks_per_s
    cluster = Cluster(
        nodes,
        extra_overrides=[
            f"budgets.enabled={'true' if budgets else 'false'}",
            f"budgets.tokens_per_s_per_capacity={tokens_per_s_per_capacity}",
            f'budgets.shares={{"prefix:good" = {GOOD_SHARE}, "prefix:bad" = {RUNAWAY_SHARE}}}',
            "engine.kind=echo",
            f"engine.token_delay_s={token_delay_s}",
            f"ingress.concurrency_max={concurrency}",
            'journal.path=""',
            'metrics.bind="127.0.0.1:0"',
        ],
    )
    steps.start(f"budgets {'on' if budgets else 'off'}: starting {nodes} daemons")
    cluster.start()
    ctx = zmq.Context()
    spawn = multiprocessing.get_context("spawn")
    phases: dict[str, list[dict[str, Any]]] = {"alone": [], "with_runaway": []}
    runaway: list[dict[str, Any]] = []
    try:
        cluster.wait_converged(30)
        cluster.wait_meta(30)
        endpoints = [d.endpoint for d in cluster.daemons]
        pull = ctx.socket(zmq.PULL)
        reply_to = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        for endpoint in endpoints:
            push.connect(endpoint)
        time.sleep(0.5)  # connections up: the first tasks measure the daemons, not TCP
        for r in range(rounds):
            order = ("alone", "with_runaway") if r % 2 == 0 else ("with_runaway", "alone")
            for phase in order:
                steps.start(f"budgets {'on' if budgets else 'off'}: round {r + 1}, {phase}")
                tag = f"{int(budgets)}-{r}-{phase}"
                child = None
                if phase == "with_runaway":
                    out = spawn.Queue()
                    start_at = time.time() + 1.5  # the child's start-up is not in the phase
                    child = spawn.Process(
                        target=_runaway,
                        args=(endpoints, runaway_rate, start_at, seconds, max_tokens, tag, out),
                    )
                    child.start()
                    while time.time() < start_at:
                        time.sleep(0.005)
                phases[phase].append(
                    _good(
                        push,
                        pull,
                        reply_to,
                        rate_per_s=good_rate,
                        seconds=seconds,
                        max_tokens=max_tokens,
                        tag=tag,
                    )
                )
                if child is not None:
                    runaway.append(out.get(timeout=seconds + 30))
                    child.join(10)
                time.sleep(max(1.0, 1.5 * max_tokens * token_delay_s))  # queues drain
        refused: Counter[str] = Counter()
        for d in cluster.daemons:
            for name, value in scrape(d.metrics_port).items():
                if name.startswith("gossipd_messages_refused_total{"):
                    refused[name.split("reason=", 1)[1].rstrip("}")] += int(value)
    finally:
        ctx.destroy(linger=0)
        cluster.stop()
    alone_p99 = [p["p99_ms"] for p in phases["alone"] if p["p99_ms"] is not None]
    with_p99 = [p["p99_ms"] for p in phases["with_runaway"] if p["p99_ms"] is not None]
    runaway_ok = sum(r["codes"].get("ok", 0) for r in runaway)
    return {
        "budgets": budgets,
        "good_tasks_per_s": round(good_rate, 1),
        "runaway_tasks_per_s": round(runaway_rate, 1),
        "cluster_capacity_tasks_per_s": cluster_tasks_per_s,
        "task_cost_tokens": cost,
        "runaway_budget_tokens_per_s": round(runaway_budget_tokens_per_s, 1),
        "runaway_admitted_tokens_per_s": round(runaway_ok * cost / (seconds * len(runaway)), 1)
        if runaway
        else None,
        "good_alone": phases["alone"],
        "good_with_runaway": phases["with_runaway"],
        "runaway": runaway,
        "good_p99_ms_alone_median": statistics.median(alone_p99) if alone_p99 else None,
        "good_p99_ms_with_runaway_median": statistics.median(with_p99) if with_p99 else None,
        "good_p50_ms_alone_median": statistics.median(
            p["p50_ms"] for p in phases["alone"] if p["p50_ms"] is not None
        ),
        "good_p50_ms_with_runaway_median": statistics.median(
            p["p50_ms"] for p in phases["with_runaway"] if p["p50_ms"] is not None
        ),
        "p99_ratio_with_vs_alone": round(
            statistics.median(with_p99) / statistics.median(alone_p99), 3
        )
        if alone_p99 and with_p99
        else None,
        "runaway_over_budget": sum(r["codes"].get("over_budget", 0) for r in runaway),
        "daemon_refusals": dict(refused),
    }


def main(
    *,
    nodes: int = 2,
    rounds: int = 3,
    seconds: float = 4.0,
    concurrency: int = 4,
    token_delay_s: float = 0.01,
    max_tokens: int = 10,
    good_load: float = 0.125,
    overdrive: float = 10.0,
    compare_off: bool = False,
    as_json: bool = False,
) -> int:
    settings = dict(
        nodes=nodes,
        seconds=seconds,
        concurrency=concurrency,
        token_delay_s=token_delay_s,
        max_tokens=max_tokens,
        good_load=good_load,
        overdrive=overdrive,
    )
    total = 1 + 2 * rounds + (3 if compare_off else 0)
    with Steps(total, "bench budgets") as steps:  # on stderr: stdout is the report
        on = _cluster_run(True, rounds=rounds, steps=steps, **settings)  # type: ignore[arg-type]
        off = (
            _cluster_run(False, rounds=1, steps=steps, **settings)  # type: ignore[arg-type]
            if compare_off
            else None
        )
    report = {
        "benchmark": "budgets",
        "settings": {**settings, "rounds": rounds},
        "p99_ratio_with_vs_alone": on["p99_ratio_with_vs_alone"],
        "good_p99_ms_alone_median": on["good_p99_ms_alone_median"],
        "good_p99_ms_with_runaway_median": on["good_p99_ms_with_runaway_median"],
        "runaway_over_budget": on["runaway_over_budget"],
        "runaway_admitted_tokens_per_s": on["runaway_admitted_tokens_per_s"],
        "runaway_budget_tokens_per_s": on["runaway_budget_tokens_per_s"],
        "budgets_on": on,
        "budgets_off": off,
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if as_json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"good producer p99, medians over {rounds} rounds: alone "
        f"{on['good_p99_ms_alone_median']} ms, with a runaway at {overdrive:g}x its budget "
        f"{on['good_p99_ms_with_runaway_median']} ms (ratio {on['p99_ratio_with_vs_alone']})"
    )
    print(
        f"runaway: {on['runaway_over_budget']} over_budget answers; admitted "
        f"{on['runaway_admitted_tokens_per_s']} tokens/s against a budget of "
        f"{on['runaway_budget_tokens_per_s']}"
    )
    if off is not None:
        print(
            f"budgets off (one round): good p99 alone {off['good_p99_ms_alone_median']} ms, "
            f"with the runaway {off['good_p99_ms_with_runaway_median']} ms "
            f"(ratio {off['p99_ratio_with_vs_alone']})"
        )
    return 0
