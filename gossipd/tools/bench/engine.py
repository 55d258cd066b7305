"""`gossipd bench engine`: what the daemon adds to a real vLLM engine's latency.

Two engines on the same tiny model and settings, alive side by side for the whole run:
- direct: an AsyncLLM in this process, called with ``generate()`` (the baseline, no gossipd);
- daemon: a `gossipd run` process with the vllm engine, reached through gossipd's Client
  (PUSH task, streamed Chunks, Result: the whole producer path).
Rounds alternate direct / daemon at each concurrency, so drift on this shared machine hits
both alike.  For each request: time to first token (first non-empty text) and total time,
measured by the caller.  Waves alternate (ABBA) between the paths; overhead_ratio is the
median over wave pairs of daemon p50 / direct p50, minus 1, the worst of TTFT and total at
concurrency 1 and 32 (goal: <= 0.05).  Pooled p50s and the added milliseconds are reported too.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gossipd.tools.launcher import DaemonProcess
from gossipd.tools.progress import Steps, percentile
from gossipd.tools.tinymodel import CPU_ENGINE_SETTINGS, engine_overrides

PROMPTS = [
    f"Request {i}: summarise the following document for an engineer who has five minutes."
    for i in range(64)
]


def _overrides(model: Path) -> list[str]:
    # One daemon: no membership, no fan-out, no journal.
    return [*engine_overrides(model), 'gossip.bind=""', 'journal.path=""']


async def _direct_round(
    llm: Any, concurrency: int, n: int, max_tokens: int, tag: str
) -> list[tuple[float, float]]:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[float, float]:
        async with sem:
            t0 = time.perf_counter()
            first = 0.0
            async for out in llm.generate(PROMPTS[i % len(PROMPTS)], params, f"{tag}-{i}"):
                if not first and out.outputs and out.outputs[0].text:
                    first = time.perf_counter()
            end = time.perf_counter()
            return (first or end) - t0, end - t0

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _daemon_round(
    client: Any, concurrency: int, n: int, max_tokens: int
) -> list[tuple[float, float, float]]:
    """Per request: time to first token and total time at the caller, and the time to first
    token the daemon itself measured (from receipt; Result.timings), so that the difference
    is the two process hops between caller and daemon."""
    from gossipd.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[float, float, float]:
        async with sem:
            t0 = time.perf_counter()
            handle = await client.submit(PROMPTS[i % len(PROMPTS)], stream=True, params=params)
            first = 0.0
            async for _delta in handle.deltas():
                if not first:
                    first = time.perf_counter()
            result = await handle.result()
            end = time.perf_counter()
            if not result.ok:
                raise RuntimeError(f"daemon task failed: {result.error}")
            return (first or end) - t0, end - t0, result.timings.first_token_ms / 1e3

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _figures(samples: list[tuple[float, ...]]) -> dict[str, float]:
    ttft = sorted(s[0] * 1e3 for s in samples)
    total = sorted(s[1] * 1e3 for s in samples)
    return {
        "n": len(samples),
        "ttft_p50_ms": round(percentile(ttft, 50), 3),
        "ttft_p90_ms": round(percentile(ttft, 90), 3),
        "total_p50_ms": round(percentile(total, 50), 3),
        "total_p90_ms": round(percentile(total, 90), 3),
    }


async def _run(model: Path, rounds: int, max_tokens: int, steps: Steps) -> dict[str, Any]:
    from gossipd.config import EngineConfig
    from gossipd.engines.vllm import VllmEngine
    from gossipd.tools.client import Client

    daemon = DaemonProcess(overrides=_overrides(model), name="bench-engine")
    daemon.launch()  # its engine loads while ours does
    steps.start("starting two vLLM engines (direct, and in a daemon): a minute or so on 2 cores")
    direct = VllmEngine(EngineConfig(kind="vllm", model=str(model), **CPU_ENGINE_SETTINGS))  # type: ignore[arg-type]
    await direct.start()
    llm = direct._llm
    # Waves per round at each concurrency: one wave = `concurrency` requests at once on one
    # path, then the same on the other (order alternating: ABBA), so that drift on this shared
    # machine falls on both paths alike and each pair of waves gives one paired ratio.
    plan = {1: 40, 32: 8}
    samples: dict[str, dict[int, list[tuple[float, ...]]]] = {
        "direct": {c: [] for c in plan},
        "daemon": {c: [] for c in plan},
    }
    paired: dict[int, dict[str, list[float]]] = {c: {"ttft": [], "total": []} for c in plan}
    try:
        await asyncio.to_thread(daemon.wait_ready, 300.0)
        async with Client([daemon.endpoint], resubmit_after_s=60.0) as client:
            # Warm both paths (first requests compile kernels and fill allocator pools).
            await _direct_round(llm, 8, 16, max_tokens, "warm")
            await _daemon_round(client, 8, 16, max_tokens)
            wave = 0
            for r in range(rounds):
                steps.start(f"round {r + 1}/{rounds}: {sum(plan.values())} waves on each path")
                for concurrency, waves in plan.items():
                    for _ in range(waves):
                        wave += 1
                        tag = f"w{wave}"
                        if wave % 2:
                            d = await _direct_round(llm, concurrency, concurrency, max_tokens, tag)
                            g = await _daemon_round(client, concurrency, concurrency, max_tokens)
                        else:
                            g = await _daemon_round(client, concurrency, concurrency, max_tokens)
                            d = await _direct_round(llm, concurrency, concurrency, max_tokens, tag)
                        samples["direct"][concurrency] += d
                        samples["daemon"][concurrency] += g
                        for i, metric in enumerate(("ttft", "total")):
                            paired[concurrency][metric].append(
                                statistics.median(x[i] for x in g)
                                / statistics.median(x[i] for x in d)
                            )
        out: dict[str, Any] = {"max_tokens": max_tokens, "rounds": rounds, "by_concurrency": {}}
        worst = 0.0
        for concurrency in plan:
            d_fig = _figures(samples["direct"][concurrency])
            g_fig = _figures(samples["daemon"][concurrency])
            # The headline: the median over wave pairs of daemon p50 / direct p50, minus 1.
            ratios = {
                metric: round(statistics.median(values) - 1, 4)
                for metric, values in paired[concurrency].items()
            }
            pooled = {
                "ttft": round(g_fig["ttft_p50_ms"] / d_fig["ttft_p50_ms"] - 1, 4),
                "total": round(g_fig["total_p50_ms"] / d_fig["total_p50_ms"] - 1, 4),
            }
            worst = max(worst, *ratios.values())
            daemon_samples = samples["daemon"][concurrency]
            # Where the added first-token time goes: inside the daemon (its own measure, from
            # receipt) against the direct call, and the two hops between caller and daemon.
            inside = sorted(s[2] * 1e3 for s in daemon_samples)
            hops = sorted((s[0] - s[2]) * 1e3 for s in daemon_samples)
            out["by_concurrency"][str(concurrency)] = {
                "direct": d_fig,
                "daemon": g_fig,
                "overhead_ratio": ratios,
                "pooled_p50_ratio": pooled,
                "added_ms_p50": {
                    "ttft": round(g_fig["ttft_p50_ms"] - d_fig["ttft_p50_ms"], 3),
                    "total": round(g_fig["total_p50_ms"] - d_fig["total_p50_ms"], 3),
                },
                "wave_pairs": len(paired[concurrency]["ttft"]),
                "ttft_breakdown_p50_ms": {
                    "inside_daemon": round(percentile(inside, 50), 3),
                    "direct_call": d_fig["ttft_p50_ms"],
                    "hops_caller_daemon": round(percentile(hops, 50), 3),
                },
            }
        out["overhead_ratio"] = round(worst, 4)
        out["goal_overhead_ratio_max"] = 0.05
        out["goal_met"] = worst <= 0.05
        return out
    finally:
        daemon.stop(timeout_s=30)
        await direct.stop()


def main(*, model: str | None, rounds: int, max_tokens: int, as_json: bool) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report
    steps = Steps(rounds + 1, "bench engine")  # on stderr: stdout is the report
    with steps, tempfile.TemporaryDirectory(prefix="gossipd-bench-model-") as tmp:
        if model is None:
            from gossipd.tools.tinymodel import make_tiny

            steps.note("making the tiny model")
            model_dir = make_tiny(Path(tmp) / "tiny")
        else:
            model_dir = Path(model)
        report = asyncio.run(_run(model_dir, rounds, max_tokens, steps))
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"vLLM through the daemon vs the same AsyncLLM called directly ({max_tokens} tokens)")
    print(
        f"{'conc':>5} {'path':>7} {'ttft p50':>10} {'ttft p90':>10} {'total p50':>10} {'total p90':>10}"
    )
    for conc, row in report["by_concurrency"].items():
        for path in ("direct", "daemon"):
            f = row[path]
            print(
                f"{conc:>5} {path:>7} {f['ttft_p50_ms']:>8.2f}ms {f['ttft_p90_ms']:>8.2f}ms "
                f"{f['total_p50_ms']:>8.2f}ms {f['total_p90_ms']:>8.2f}ms"
            )
        o, a, b = row["overhead_ratio"], row["added_ms_p50"], row["ttft_breakdown_p50_ms"]
        print(
            f"{conc:>5} overhead (median of {row['wave_pairs']} paired waves): "
            f"ttft {o['ttft']:+.1%} ({a['ttft']:+.2f} ms), total {o['total']:+.1%} ({a['total']:+.2f} ms)"
        )
        print(
            f"{conc:>5} first token p50: {b['inside_daemon']:.2f} ms inside the daemon "
            f"(direct call {b['direct_call']:.2f} ms) + {b['hops_caller_daemon']:.2f} ms "
            "for the two hops between caller and daemon"
        )
    print(
        f"overhead_ratio (worst p50) {report['overhead_ratio']:+.1%}, goal <= 5%: "
        f"{'met' if report['goal_met'] else 'MISSED'}"
    )
    return 0
