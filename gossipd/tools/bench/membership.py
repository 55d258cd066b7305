"""`gossipd bench membership [--peers serf] [--nodes 16] [--idle-s 20] [--json]`: what
membership costs when nothing happens, and how soon everyone knows of a crash.

In one run, on loopback:
1. one gossipd daemon alone (no peers): its CPU and its main thread's wake-ups over the idle
   window (the event loop's thread: each voluntary or involuntary context switch of it is one
   wake-up);
2. ``--nodes`` gossipd daemons (echo engine, the default ``lan`` preset: probe every 1 s,
   gossip every 200 ms, as memberlist's LAN defaults) and, with ``--peers serf``, as many
   HashiCorp Serf agents (Debian package ``serf``; memberlist inside) side by side: time from
   launch until every member lists every other; then both sides idle together for
   ``--idle-s``: CPU (on-CPU time of every thread, /proc/PID/task/*/schedstat) and RSS per
   agent; then ``--crashes`` SIGKILLs, one member at a time on each side: time until every
   survivor declares it dead (gossipd: the daemons' logged ``member`` events; Serf: its
   ``member-failed`` event handler, stamped as it runs).

The goals of issue 25 are printed beside the figures: gossipd's idle CPU per daemon <= 1% of
a core and <= 2x Serf's per agent from the same run, a lone daemon's main thread <= 20
wake-ups a second, a crash known to all <= 0.1 s.  Linux only (/proc).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gossipd.tools.launcher import free_tcp_port
from gossipd.tools.progress import Steps, summarize
from simulations.cluster import Cluster, wait_known_dead

GOALS = {
    "idle_cpu_pct_per_daemon_max": 1.0,
    "idle_cpu_ratio_vs_serf_max": 2.0,
    "lone_main_thread_wakeups_per_s_max": 20.0,
    "crash_known_to_all_s_max": 0.1,
}


# -- what /proc says about a process ----------------------------------------------------------


def cpu_ns(pid: int) -> int:
    """Nanoseconds on a CPU so far, every thread of ``pid`` (threads that exited are lost:
    measure across a window in which none do)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def switches(pid: int) -> int:
    """Context switches of the main thread (the event loop's): one per wake-up."""
    total = 0
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
            total += int(line.split()[1])
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle_figures(pids: dict[str, list[int]], seconds: float) -> dict[str, dict[str, Any]]:
    """Each side's processes over the same window: CPU % of a core, main-thread wake-ups a
    second and RSS (at the end) per agent."""
    start = {side: [(cpu_ns(p), switches(p)) for p in ps] for side, ps in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    out: dict[str, dict[str, Any]] = {}
    for side, ps in pids.items():
        cpu = [
            100.0 * (cpu_ns(p) - c0) / 1e9 / elapsed
            for p, (c0, _s0) in zip(ps, start[side], strict=True)
        ]
        wake = [(switches(p) - s0) / elapsed for p, (_c0, s0) in zip(ps, start[side], strict=True)]
        rss = [rss_mb(p) for p in ps]
        out[side] = {
            "agents": len(ps),
            "window_s": round(elapsed, 2),
            "cpu_pct_per_agent": _stats(cpu),
            "main_thread_wakeups_per_s": _stats(wake),
            "rss_mb_per_agent": _stats(rss),
        }
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


# -- Serf agents ------------------------------------------------------------------------------


def serf_binary() -> str:
    serf = shutil.which("serf")
    if serf is None:
        raise RuntimeError(
            "serf is not installed: `apt-get install -y serf` (HashiCorp Serf, the reference "
            "this benchmark compares with), or run without --peers"
        )
    return serf


class SerfAgents:
    """``n`` Serf agents on loopback joined through the first; each stamps the wall-clock time
    of its ``member-failed`` events into a file (its event handler, run by /bin/sh)."""

    def __init__(self, n: int, workdir: Path) -> None:
        self.serf = serf_binary()
        self.n = n
        self.dir = workdir
        self.names = [f"serf{i:02d}" for i in range(n)]
        self.bind = [free_tcp_port() for _ in range(n)]
        self.rpc = [free_tcp_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n

    def failed_file(self, i: int) -> Path:
        return self.dir / f"{self.names[i]}.failed"

    def launch(self) -> None:
        for i in range(self.n):
            handler = f"member-failed=cat >> /dev/null; date +%s.%N >> {self.failed_file(i)}"
            cmd = [
                str(self.serf),
                "agent",
                f"-node={self.names[i]}",
                f"-bind=127.0.0.1:{self.bind[i]}",
                f"-rpc-addr=127.0.0.1:{self.rpc[i]}",
                "-log-level=err",
                f"-event-handler={handler}",
            ]
            if i:
                cmd.append(f"-join=127.0.0.1:{self.bind[0]}")
            log = open(self.dir / f"{self.names[i]}.log", "wb")  # noqa: SIM115 (kept open)
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            if i == 0:
                time.sleep(0.2)  # the first must listen before the others join it

    def alive_seen_by(self, i: int) -> set[str]:
        out = subprocess.run(
            [str(self.serf), "members", f"-rpc-addr=127.0.0.1:{self.rpc[i]}", "-status=alive"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}

    def wait_converged(self, timeout_s: float, live: list[int] | None = None) -> None:
        live = list(range(self.n)) if live is None else live
        want = {self.names[i] for i in live}
        deadline = time.monotonic() + timeout_s
        pending = list(live)
        while pending:
            if time.monotonic() > deadline:
                i = pending[0]
                seen = sorted(self.alive_seen_by(i))
                proc = self.procs[i]
                log = (self.dir / f"{self.names[i]}.log").read_text(errors="replace")[-600:]
                raise TimeoutError(
                    f"Serf did not converge: {len(pending)} agents short; {self.names[i]} "
                    f"(exit code {proc.poll() if proc else None}) sees "
                    f"{len(seen)} alive: {seen}; its log ends: {log!r}"
                )
            pending = [i for i in pending if self.alive_seen_by(i) != want]
            if pending:
                time.sleep(0.1)

    def pids(self, live: list[int]) -> list[int]:
        return [p.pid for i, p in enumerate(self.procs) if p is not None and i in live]

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait(5)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(5)


# -- the run ----------------------------------------------------------------------------------


def _serf_crashes(agents: SerfAgents, rounds: int, window_s: float) -> list[float | None]:
    """Kill the last live agents one at a time: seconds until every survivor's handler ran
    (None: not everyone within ``window_s``)."""
    out: list[float | None] = []
    live = list(range(agents.n))
    for _ in range(rounds):
        victim = live.pop()
        marks = {i: _lines(agents.failed_file(i)) for i in live}
        killed_at = time.time()
        agents.kill(victim)
        deadline = time.monotonic() + window_s
        known: dict[int, float] = {}
        while len(known) < len(live) and time.monotonic() < deadline:
            for i in live:
                new = _lines(agents.failed_file(i))[len(marks[i]) :]
                if new and i not in known:
                    known[i] = float(new[0]) - killed_at
            time.sleep(0.05)
        out.append(max(known.values()) if len(known) == len(live) else None)
    return out


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def _gossipd_crashes(cluster: Cluster, rounds: int, window_s: float) -> list[float | None]:
    out: list[float | None] = []
    live = list(cluster.daemons)
    for _ in range(rounds):
        victim = live.pop()
        killed_at = time.time()
        victim.kill()
        victim.wait(5)
        known = wait_known_dead(live, victim.name, killed_at, window_s)
        out.append(max(known.values()) if len(known) == len(live) else None)
    return out


def _crash_figures(times: list[float | None]) -> dict[str, Any]:
    seen = [t for t in times if t is not None]
    return {"rounds": len(times), "not_all_known": len(times) - len(seen), **summarize(seen)}


def run(*, nodes: int, peers: str, idle_s: float, crashes: int, steps: Steps) -> dict[str, Any]:
    if peers == "serf":
        serf_binary()  # before anything runs: a missing Serf is said at once
    workdir = Path(tempfile.mkdtemp(prefix="gossipd-bench-membership-"))
    report: dict[str, Any] = {"nodes": nodes, "idle_s": idle_s, "preset": "lan"}
    overrides = ['metrics.bind="127.0.0.1:0"']

    steps.start("a lone gossipd daemon")
    lone = Cluster(1, preset="lan", log_dir=str(workdir / "lone"), extra_overrides=overrides)
    try:
        lone.start()
        time.sleep(2.0)  # past start-up's one-off work
        fig = idle_figures({"gossipd": [lone.daemons[0].pid]}, idle_s)["gossipd"]
        report["lone_gossipd"] = {
            "cpu_pct": fig["cpu_pct_per_agent"]["mean"],
            "main_thread_wakeups_per_s": fig["main_thread_wakeups_per_s"]["mean"],
            "rss_mb": fig["rss_mb_per_agent"]["mean"],
        }
    finally:
        lone.stop()

    serf: SerfAgents | None = None
    cluster = Cluster(
        nodes, preset="lan", log_dir=str(workdir / "gossipd"), extra_overrides=overrides
    )
    try:
        if peers == "serf":
            steps.start(f"{nodes} Serf agents")
            serf = SerfAgents(nodes, workdir)
            t0 = time.monotonic()
            serf.launch()
            serf.wait_converged(120)
            report["serf"] = {"converged_after_launch_s": round(time.monotonic() - t0, 3)}
        steps.start(f"{nodes} gossipd daemons")
        t0 = time.monotonic()
        cluster.start(timeout_s=120)
        ready = time.monotonic() - t0
        cluster.wait_converged(120)
        report["gossipd"] = {
            "ready_after_launch_s": round(ready, 3),
            "converged_after_launch_s": round(time.monotonic() - t0, 3),
        }
        time.sleep(3.0)
        steps.start(f"idle side by side for {idle_s:g} s")
        pids = {"gossipd": [d.pid for d in cluster.daemons]}
        if serf is not None:
            pids["serf"] = serf.pids(list(range(nodes)))
        for side, fig in idle_figures(pids, idle_s).items():
            report[side].update(fig)
        steps.start(f"{crashes} SIGKILLs on each side")
        report["gossipd"]["crash_known_to_all_s"] = _crash_figures(
            _gossipd_crashes(cluster, crashes, 10.0)
        )
        if serf is not None:
            report["serf"]["crash_known_to_all_s"] = _crash_figures(
                _serf_crashes(serf, crashes, 30.0)
            )
    finally:
        cluster.stop()
        if serf is not None:
            serf.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    g = report["gossipd"]
    if serf is not None:
        s = report["serf"]
        report["idle_cpu_ratio_vs_serf"] = round(
            g["cpu_pct_per_agent"]["mean"] / max(1e-9, s["cpu_pct_per_agent"]["mean"]), 3
        )
        report["rss_ratio_vs_serf"] = round(
            g["rss_mb_per_agent"]["mean"] / max(1e-9, s["rss_mb_per_agent"]["mean"]), 3
        )
    report["goals"] = _goals(report)
    return report


def _goals(report: dict[str, Any]) -> dict[str, Any]:
    g = report["gossipd"]
    crash = g["crash_known_to_all_s"]
    checks: dict[str, Any] = {
        "idle_cpu_pct_per_daemon": (
            g["cpu_pct_per_agent"]["mean"],
            g["cpu_pct_per_agent"]["mean"] <= GOALS["idle_cpu_pct_per_daemon_max"],
        ),
        "lone_main_thread_wakeups_per_s": (
            report["lone_gossipd"]["main_thread_wakeups_per_s"],
            report["lone_gossipd"]["main_thread_wakeups_per_s"]
            <= GOALS["lone_main_thread_wakeups_per_s_max"],
        ),
        "crash_known_to_all_s_max": (
            crash["max"],
            crash["not_all_known"] == 0
            and crash["max"] is not None
            and crash["max"] <= GOALS["crash_known_to_all_s_max"],
        ),
    }
    if "idle_cpu_ratio_vs_serf" in report:
        ratio = report["idle_cpu_ratio_vs_serf"]
        checks["idle_cpu_ratio_vs_serf"] = (ratio, ratio <= GOALS["idle_cpu_ratio_vs_serf_max"])
    return {name: {"value": v, "met": met} for name, (v, met) in checks.items()}


def _print(report: dict[str, Any]) -> None:
    lone = report["lone_gossipd"]
    print(
        f"lone gossipd daemon: {lone['cpu_pct']:.2f}% of a core, main thread "
        f"{lone['main_thread_wakeups_per_s']:.1f} wake-ups/s, {lone['rss_mb']:.1f} MB"
    )
    sides = [s for s in ("gossipd", "serf") if s in report]
    print(f"\n{report['nodes']} agents each, idle {report['idle_s']:g} s side by side:")
    print(f"{'':10}{'CPU % mean':>12}{'max':>8}{'wakeups/s':>11}{'RSS MB':>9}"
          f"{'converged s':>13}{'crash->all s p50':>18}{'max':>8}")  # fmt: skip
    for side in sides:
        r = report[side]
        crash = r["crash_known_to_all_s"]
        print(
            f"{side:10}{r['cpu_pct_per_agent']['mean']:>12.3f}{r['cpu_pct_per_agent']['max']:>8.3f}"
            f"{r['main_thread_wakeups_per_s']['mean']:>11.1f}{r['rss_mb_per_agent']['mean']:>9.1f}"
            f"{r['converged_after_launch_s']:>13.2f}{_num(crash['p50']):>18}{_num(crash['max']):>8}"
        )
    if "idle_cpu_ratio_vs_serf" in report:
        print(
            f"\ngossipd / Serf per agent: idle CPU {report['idle_cpu_ratio_vs_serf']:.2f}x, "
            f"RSS {report['rss_ratio_vs_serf']:.2f}x"
        )
    print("\ngoals (issue 25):")
    for name, goal in report["goals"].items():
        print(f"  {name}: {goal['value']} {'met' if goal['met'] else 'NOT met'}")


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(
    *, nodes: int = 16, peers: str = "", idle_s: float = 20.0, crashes: int = 3, as_json: bool
) -> int:
    if not sys.platform.startswith("linux"):
        print("gossipd bench membership: Linux only (it reads /proc)", file=sys.stderr)
        return 2
    try:
        with Steps(total=5 if peers else 4, label="bench membership") as steps:
            report = run(nodes=nodes, peers=peers, idle_s=idle_s, crashes=crashes, steps=steps)
    except RuntimeError as exc:
        print(f"gossipd bench membership: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
