"""`gossipd bench prefix`: vLLM's prefix-cache hit rate under three placement policies.

A shared-prefix workload (a dozen "system prompts", each followed by many different questions,
in random order, keyless) is pushed to every daemon of a 3-daemon cluster, each daemon with a
real vLLM engine on the tiny model.  For each policy a fresh cluster (empty caches) runs the
same workload; the hit rate is vLLM's own count: prompt tokens found in its prefix cache over
prompt tokens looked up, summed over the engines (gossipd_engine_prefix_cache_* metrics).

- round_robin: each entry daemon sends its n-th task to member n mod N;
- key: consistent hashing of the task id (what keyless tasks get without prefix affinity);
- prefix: prefix-aware placement (gossipd/core/prefix.py).

Two cache sizes: "tight" (16 KV-cache blocks per engine: the shared prefixes of about a third
of the groups besides the running requests, so placement decides what stays cached) and
"roomy" (vLLM sizes it by memory: everything fits).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from gossipd.core.sampling import SamplingParams
from gossipd.ops.scrape import scrape
from gossipd.tools.bench.plotting import percent_figure, save_percent_figure
from gossipd.tools.client import Client
from gossipd.tools.progress import Progress, Steps
from gossipd.tools.tinymodel import engine_overrides
from simulations.cluster import Cluster

POLICIES = ("round_robin", "key", "prefix")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "peer",
    "daemon",
    "gossips",
    "membership",
    "state",
    "elects",
    "leader",
    "fans",
    "tasks",
    "consistent",
    "hashing",
    "bounded",
    "loads",
    "helpful",
    "assistant",
    "answer",
    "question",
    "short",
    "sentence",
    "summarise",
    "document",
    "engineer",
    "minutes",
    "translate",
    "french",
    "german",
    "spanish",
    "sea",
]


def workload(groups: int, per_group: int, seed: int = 1) -> list[str]:
    """Prompts: a ~1,000-character system prompt per group (about 270 tokens: two full
    128-token KV blocks) plus a ~100-character question of its own, shuffled."""
    rng = random.Random(seed)
    systems = [
        f"System {g}. " + " ".join(rng.choice(WORDS) for _ in range(150)) for g in range(groups)
    ]
    prompts = [
        systems[g][:1000] + f"\nQuestion {g}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(14))
        for g in range(groups)
        for i in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


async def _push(endpoints: list[str], prompts: list[str], window: int) -> int:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    progress = Progress(len(prompts), "  tasks")
    done = 0

    async def wait(handle: Any) -> bool:
        nonlocal done
        result = await handle.result()
        done += 1
        progress.update(done)
        return bool(result.ok)

    async with Client(endpoints, outstanding_max=window, resubmit_after_s=120.0) as client:
        waiters = [
            asyncio.ensure_future(wait(await client.submit(p, params=params, timeout_s=300.0)))
            for p in prompts
        ]
        oks = await asyncio.gather(*waiters)
    progress.close(done)
    return sum(oks)


def run_policy(
    model: Path, policy: str, kv_cache_blocks: int, prompts: list[str], nodes: int, say: Any
) -> dict[str, Any]:
    overrides = [
        *engine_overrides(model, kv_cache_blocks=kv_cache_blocks, max_num_seqs=8),
        'metrics.bind="127.0.0.1:0"',
        'journal.path=""',
        f"fanout.policy={policy}",
    ]
    cluster = Cluster(nodes, extra_overrides=overrides)
    t0 = time.monotonic()
    cluster.start(timeout_s=400)
    try:
        cluster.wait_converged(60)
        cluster.wait_meta(60)
        say(f"  {policy}: {nodes} engines up in {time.monotonic() - t0:.0f} s; pushing")
        t1 = time.monotonic()
        ok = asyncio.run(_push([d.endpoint for d in cluster.daemons], prompts, window=24))
        seconds = time.monotonic() - t1
        per_engine = {}
        for d in cluster.daemons:
            m = scrape(d.metrics_port)
            per_engine[d.name] = {
                "queries": m.get("gossipd_engine_prefix_cache_queries_tokens_total", 0.0),
                "hits": m.get("gossipd_engine_prefix_cache_hits_tokens_total", 0.0),
                "tasks": m.get("gossipd_task_results_total{outcome=ok}", 0.0),
            }
    finally:
        cluster.stop()
    queries = sum(e["queries"] for e in per_engine.values())
    hits = sum(e["hits"] for e in per_engine.values())
    return {
        "policy": policy,
        "ok": ok,
        "tasks": len(prompts),
        "seconds": round(seconds, 1),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "per_engine": per_engine,
    }


def plot_hit_rates(report: dict[str, Any], path: str) -> None:
    """Bar chart: hit rate per policy, one group of bars per cache size."""
    caches = sorted({r["cache"] for r in report["runs"]}, reverse=True)
    fig, ax = percent_figure(3.6)
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        rates = [
            next(r["hit_rate"] for r in report["runs"] if r["cache"] == c and r["policy"] == policy)
            for c in caches
        ]
        xs = [x + i * width for x in range(len(caches))]
        bars = ax.bar(xs, [100 * r for r in rates], width, label=policy)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([x + width for x in range(len(caches))], [f"{c} KV cache" for c in caches])
    ax.set_ylabel("prefix-cache hits (% of prompt tokens)")
    title = (
        f"vLLM, {report['tasks']} keyless tasks, {report['groups']} shared prefixes, "
        f"{report['nodes']} daemons"
    )
    save_percent_figure(fig, ax, title, path)


def main(
    *,
    model: str | None,
    nodes: int,
    as_json: bool,
    plot: str | None = None,
    groups: int = 12,
    per_group: int = 30,
) -> int:
    prompts = workload(groups, per_group)
    # Tight: per engine, 16 blocks of 128 tokens: the running requests' own blocks (8 x 1)
    # plus the shared prefixes (2 blocks each) of about a third of the groups, so what a
    # placement sends to an engine decides what stays cached; roomy: sized by memory.
    caches = {"tight": 16, "roomy": 0}
    report: dict[str, Any] = {"nodes": nodes, "groups": groups, "tasks": len(prompts), "runs": []}
    # Progress on stderr (stdout is the report): a line per run with an ETA, a heartbeat
    # while engines load (each run starts a fresh cluster: a minute or two on 2 cores).
    steps = Steps(len(caches) * len(POLICIES), "bench prefix")
    with steps, tempfile.TemporaryDirectory(prefix="gossipd-bench-model-") as tmp:
        if model is None:
            from gossipd.tools.tinymodel import make_tiny

            steps.note("making the tiny model")
            model_dir = make_tiny(Path(tmp) / "tiny")
        else:
            model_dir = Path(model)
        for cache, blocks in caches.items():
            for policy in POLICIES:
                steps.start(
                    f"{cache} KV cache (kv_cache_blocks={blocks or 'by memory'}), {policy}: "
                    f"starting {nodes} vLLM daemons"
                )
                run = run_policy(model_dir, policy, blocks, prompts, nodes, steps.note)
                run["cache"] = cache
                report["runs"].append(run)
                steps.note(
                    f"{policy}: hit rate {run['hit_rate']:.1%} ({run['ok']}/{run['tasks']} ok)"
                )
    if plot:
        plot_hit_rates(report, plot)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"vLLM prefix-cache hit rate, {nodes} daemons, {len(prompts)} keyless tasks in {groups} groups"
    )
    print(f"{'cache':>6} {'policy':>12} {'hit rate':>9} {'ok':>9} {'seconds':>8}")
    for run in report["runs"]:
        print(
            f"{run['cache']:>6} {run['policy']:>12} {run['hit_rate']:>8.1%} "
            f"{run['ok']:>4}/{run['tasks']:<4} {run['seconds']:>8.1f}"
        )
    return 0
