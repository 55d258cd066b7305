"""`gossipd up --demo`: the demo that drives a local cluster (gossipd/tools/up.py) end to end.

Streamed prompts, then keyed tasks (sessions) at a steady rate; halfway one daemon is SIGKILLed
and restarted at once (as systemd would); once it serves again, a last tenth of the tasks;
then a few chat completions through every daemon's OpenAI-compatible door, and a summary
(served, lost, answered twice, p50/p99, which daemon served what).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gossipd.core.messages import Result
from gossipd.core.sampling import SamplingParams
from gossipd.tools.admin import format_status
from gossipd.tools.client import Client, TaskHandle
from gossipd.tools.progress import percentile

if TYPE_CHECKING:  # (up.py imports this module: its names for the annotations only)
    from gossipd.tools.up import LocalCluster, Say, UpOptions

SESSIONS = 30  # session keys the demo's tasks spread over
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question below in one short sentence.",
    "Summarise the following document for an engineer who has five minutes to read it.",
]


@dataclass
class _Phase:
    name: str
    results: list[Result] = field(default_factory=list)


def run_demo(
    cluster: LocalCluster, opts: UpOptions, kind: str, say: Say, start_timeout_s: float
) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_demo(cluster, opts, kind, say, start_timeout_s))


async def _demo(
    cluster: LocalCluster, opts: UpOptions, kind: str, say: Say, start_timeout_s: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    rate = opts.rate_per_s or (30.0 if kind == "vllm" else 100.0)
    timeout_s = 120.0 if kind == "vllm" else 30.0
    victim = cluster.daemons[-1]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    latencies_ms: list[float] = []
    results: dict[str, Result] = {}
    streamed = _Phase("streamed prompts")
    phases = [_Phase("before the kill"), _Phase("victim down"), _Phase("after the restart")]
    tail = max(1, opts.tasks // 10)
    half = (opts.tasks - tail) // 2
    started = loop.time()

    async with Client(cluster.endpoints(), resubmit_after_s=opts.resubmit_after_s) as client:
        say(
            "streamed prompts"
            + (" (the tiny model has random weights: gibberish)" if kind == "vllm" else "")
            + ":"
        )
        for i, prompt in enumerate(PROMPTS):
            handle = await client.submit(
                prompt,
                key=f"session-{i}",
                stream=True,
                params=SamplingParams(max_tokens=12, ignore_eos=True),
                timeout_s=timeout_s,
            )
            say(f"  session-{i}: ", end="")
            async for delta in handle.deltas():
                say(delta.replace("\n", " "), end="")
            result = await handle.result()
            streamed.results.append(result)
            say(
                f"  <- {result.node}, {result.timings.total_ms:.0f} ms"
                if result.ok
                else f"  <- error {result.error}"
            )

        waiters: list[asyncio.Task[None]] = []

        async def wait(handle: TaskHandle, phase: _Phase) -> None:
            result = await handle.result()
            results[handle.id] = result
            phase.results.append(result)
            if result.ok:
                latencies_ms.append((loop.time() - handle.submitted_at) * 1e3)

        async def send(count: int, offset: int, phase: _Phase) -> None:
            first = loop.time()
            for j in range(count):
                i = offset + j
                await asyncio.sleep(max(0.0, first + j / rate - loop.time()))
                handle = await client.submit(
                    f"task {i} of session {i % SESSIONS}: {PROMPTS[i % len(PROMPTS)]}",
                    key=f"session-{i % SESSIONS}",
                    params=params,
                    timeout_s=timeout_s,
                )
                waiters.append(loop.create_task(wait(handle, phase)))

        say(f"sending {opts.tasks} tasks over {SESSIONS} session keys at {rate:.0f}/s")
        await send(half, 0, phases[0])
        say(f"SIGKILL {victim.name} (pid {victim.pid}) after {half} tasks; restarting it at once")
        victim.kill()
        victim.wait(10)
        victim.kill_group()  # its engine core goes with it, as on a machine crash
        victim.stop()
        cluster.launch(victim)
        await send(opts.tasks - tail - half, half, phases[1])
        say(f"waiting for {victim.name} to serve again")
        await asyncio.to_thread(cluster.wait_ready, [victim], start_timeout_s, say)
        await asyncio.to_thread(cluster.wait_converged, 60.0)
        await send(tail, opts.tasks - tail, phases[2])
        await asyncio.gather(*waiters)
        stats = client.statistics()
        status = await asyncio.to_thread(cluster.status)
        http = await asyncio.to_thread(_through_the_http_doors, cluster)
    ok = sum(r.ok for r in results.values())
    lat = sorted(latencies_ms)
    served_by = Counter(r.node for r in results.values() if r.ok)
    names = [d.name for d in cluster.daemons]

    def by_node(rs: list[Result]) -> dict[str, int]:
        """Every daemon, 0 for one that served none (a missing name read as "not counted")."""
        counts = Counter(r.node for r in rs if r.ok)
        return {n: counts.get(n, 0) for n in names} | dict(sorted(counts.items()))

    # What each daemon says it ran since its last start (the status table's SERVED): the
    # victim's count began again at its restart, and a task run twice counts at both.
    since_start = {
        r["node"]: r.get("load", {}).get("served")
        for r in (status["members"] if status is not None else [])
    }
    return {
        "nodes": len(cluster.daemons),
        "engine": kind,
        "model": str(opts.model) if kind == "vllm" else "",
        "tasks": opts.tasks,
        "ok": ok,
        "lost": opts.tasks - ok,
        "errors": dict(Counter(r.error.code for r in results.values() if r.error is not None)),
        "answered_twice": stats.duplicate_results,
        "resubmitted": stats.resubmitted,
        "killed": 1,
        "restarted": 1,
        "victim": victim.name,
        "latency_ms": {
            "p50": round(percentile(lat, 50), 1) if lat else None,
            "p99": round(percentile(lat, 99), 1) if lat else None,
        },
        "served_by": dict(sorted(served_by.items())),
        "served_by_phase": {p.name: by_node(p.results) for p in [streamed, *phases]},
        "results_by_daemon": by_node([*streamed.results, *results.values()]),
        "served_since_start": {n: since_start.get(n) for n in names},
        "http": http,
        "elapsed_s": round(loop.time() - started, 1),
        "final_status": format_status(status) if status is not None else "",
        "log_dir": str(cluster.log_dir),
    }


def print_summary(s: dict[str, Any], say: Say) -> None:
    say(s.get("final_status", ""))
    say(
        f"\nsummary: {s['nodes']} daemons, {s['engine']} engine; {s['tasks']} tasks: "
        f"{s['ok']} ok, {s['lost']} lost, {s['answered_twice']} answered twice "
        f"({s['resubmitted']} resubmitted by the producer); "
        f"latency p50 {s['latency_ms']['p50']} ms, p99 {s['latency_ms']['p99']} ms; "
        f"{s['elapsed_s']} s"
    )
    say(f"killed {s['victim']} once (SIGKILL) and restarted it")
    for phase, counts in s["served_by_phase"].items():
        say(f"  {phase:<18} " + ", ".join(f"{n}: {c}" for n, c in counts.items()))
    say("  total              " + ", ".join(f"{n}: {c}" for n, c in s["served_by"].items()))
    say(
        "  with the streamed  "
        + ", ".join(f"{n}: {c}" for n, c in s["results_by_daemon"].items())
        + "  (each Result by the daemon that sent it)"
    )
    say(
        "  status SERVED      "
        + ", ".join(
            f"{n}: {c if c is not None else '-'}" for n, c in s["served_since_start"].items()
        )
        + f"  (what each ran since its last start: {s['victim']}'s count began again at its"
        " restart; a task run at two daemons, replayed from a journal or migrated, counts at both)"
    )
    http = s.get("http") or {}
    say(
        f"  OpenAI HTTP doors  {http.get('ok', 0)} of {http.get('requests', 0)} chat "
        f"completions ok, served by "
        + ", ".join(f"{n}: {c}" for n, c in http.get("served_by", {}).items())
    )
    if s["errors"]:
        say(f"  errors: {s['errors']}")


def _through_the_http_doors(cluster: LocalCluster, per_door: int = 4) -> dict[str, Any]:
    """A few chat completions through each daemon's OpenAI-compatible door, as any OpenAI
    client sends them (stdlib HTTP here), each with its own session (placed by key)."""
    import urllib.error
    import urllib.request

    served: Counter[str] = Counter()
    ok = sent = 0
    for d in cluster.running():
        url = d.http_url
        if not url:
            continue
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
        for i in range(per_door):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"hello from the demo, {i}"}],
                "max_tokens": 8,
            }
            request = urllib.request.Request(
                f"{url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json", "x-session-id": f"demo-{d.name}-{i}"},
            )
            sent += 1
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
                    ok += answer["choices"][0]["message"]["role"] == "assistant"
                    served[response.headers.get("x-gossipd-member", "?")] += 1
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                continue
    return {"requests": sent, "ok": ok, "served_by": dict(sorted(served.items()))}
