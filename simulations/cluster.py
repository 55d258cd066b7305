"""Real daemons on loopback, real faults: SIGKILL (crash), SIGSTOP/SIGCONT (stalls), SIGTERM
(graceful leave).  Figures come from the daemons' own JSON event logs ("member" lines carry
the wall-clock time at which the observer learned something).

    python -m simulations cluster [--nodes 16] [--crashes 10] [--stallers 3]
        [--stall-period-s 600] [--set gossip.swim.crash_by_refusal=false] [--json]

A quick run (a minute): ``--crashes 3 --dissemination-trials 1 --stall-period-s 20``.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipd.tools.curvekeys import CurveLayout
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from gossipd.tools.progress import summarize


@dataclass
class ClusterRun:
    nodes: int = 16
    seed: int = 1
    dissemination_trials: int = 5
    crashes: int = 10
    stallers: int = 3
    stall_s: float = 2.0
    stall_every_s: float = 10.0
    stall_period_s: float = 600.0
    detect_window_s: float = 10.0
    preset: str = "local"
    log_dir: str | None = None
    progress: bool = True
    extra_overrides: list[str] = field(default_factory=list)


class Cluster:
    """N daemons that join through the first three."""

    def __init__(
        self,
        n: int,
        *,
        preset: str = "local",
        log_dir: str | None = None,
        extra_overrides: list[str] | None = None,
        curve: bool = False,
        overrides_for: Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        """``curve``: CURVE on every socket, keys made under log_dir/keys (a producer key
        "producer" among them: ``self.keys.pair("producer")``).  ``overrides_for(i)``: more
        overrides for daemon ``i`` only (after the shared ones)."""
        self._overrides_for = overrides_for
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="gossipd-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keys: CurveLayout | None = None
        if curve:
            self.keys = CurveLayout(
                self.log_dir / "keys",
                nodes=[f"d{i:02d}" for i in range(n)],
                producers=["producer"],
            )
        self.daemons: list[DaemonProcess] = []
        self._extra = extra_overrides or []
        self._preset = preset
        protos = [DaemonProcess(name=f"d{i:02d}", log_dir=self.log_dir) for i in range(n)]
        self.seeds = [
            f"d{i:02d}@{d.gossip_endpoint}" if curve else d.gossip_endpoint
            for i, d in enumerate(protos[:3])
        ]
        for i, proto in enumerate(protos):
            self.daemons.append(self._make(i, proto.port, proto.gossip_port, proto.rpc_port))

    def _make(self, i: int, port: int, gossip_port: int, rpc_port: int) -> DaemonProcess:
        seeds = json.dumps(self.seeds)
        journal = json.dumps(str(self.log_dir / f"d{i:02d}.journal"))
        overrides = [
            f"node.id=d{i:02d}",
            f"gossip.bind=tcp://127.0.0.1:{gossip_port}",
            f"gossip.seeds={seeds}",
            f"gossip.preset={self._preset}",
            f"journal.path={journal}",
            f"fanout.rpc_bind=tcp://127.0.0.1:{rpc_port}",
            *(self.keys.overrides(f"d{i:02d}") if self.keys is not None else []),
            *self._extra,
            *(self._overrides_for(i) if self._overrides_for is not None else []),
        ]
        return DaemonProcess(name=f"d{i:02d}", log_dir=self.log_dir, port=port, overrides=overrides)

    def start(self, timeout_s: float = 60.0) -> None:
        try:
            for d in self.daemons:  # launch all, then wait: start-up overlaps
                d.launch()
            deadline = time.monotonic() + timeout_s
            for d in self.daemons:
                d.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()  # (those launched would run on: a caller's try begins after start)
            raise

    def restart(self, i: int, *, kill: bool = False, new_ports: bool = False) -> DaemonProcess:
        """Stop daemon ``i`` (SIGTERM and wait; SIGKILL with ``kill``) and start it again under
        its name: on its ports (ingress, gossip, rpc), or on new ones with ``new_ports``."""
        old = self.daemons[i]
        if kill:
            old.kill()
            old.wait(10)
        old.stop(timeout_s=5)
        if new_ports:
            ports = (free_tcp_port(), free_tcp_port(), free_tcp_port())
        else:
            ports = (
                old.port,
                self._port_of(old, "gossip.bind"),
                self._port_of(old, "fanout.rpc_bind"),
            )
        new = self._make(i, *ports)
        self.daemons[i] = new
        new.start()
        return new

    @staticmethod
    def _port_of(daemon: DaemonProcess, key: str) -> int:
        for item in daemon._overrides:
            if item.startswith(f"{key}="):
                return int(item.rsplit(":", 1)[1])
        raise AssertionError(f"no {key}")

    def wait_meta(self, timeout_s: float = 20.0) -> None:
        """Wait until every daemon has every other's GPU state (with its rpc endpoint)."""
        deadline = time.monotonic() + timeout_s
        names = {d.name for d in self.daemons}
        while time.monotonic() < deadline:
            ok = True
            for d in self.daemons:
                seen = {
                    e["member"]
                    for e in d.events()
                    if e.get("msg") == "member" and e["event"] == "meta"
                }
                if not (names - {d.name}) <= seen:
                    ok = False
                    break
            if ok:
                return
            time.sleep(0.2)
        raise TimeoutError("GPU state did not spread")

    def views(self) -> dict[str, dict[str, str]]:
        """Each live daemon's view {member: state}, rebuilt from its member events."""
        out: dict[str, dict[str, str]] = {}
        for d in self.daemons:
            if d.proc is None or d.proc.poll() is not None:
                continue
            view: dict[str, str] = {}
            for e in d.events():
                if e.get("msg") == "member" and e["member"] != d.name:
                    kind = e["event"]
                    view[e["member"]] = {
                        "joined": "alive",
                        "alive": "alive",
                        "suspect": "suspect",
                        "dead": "dead",
                        "left": "left",
                    }.get(kind, view.get(e["member"], "alive"))
            out[d.name] = view
        return out

    def wait_converged(self, timeout_s: float = 60.0) -> float:
        t0 = time.monotonic()
        names = {d.name for d in self.daemons}
        while time.monotonic() - t0 < timeout_s:
            views = self.views()
            if all(
                {m for m, s in v.items() if s in ("alive", "suspect")} == names - {n}
                for n, v in views.items()
            ):
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError("the cluster did not converge")

    def stop(self) -> None:
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.resume()
        for d in self.daemons:
            d.stop(timeout_s=15)


def run_cluster(run: ClusterRun) -> dict[str, Any]:
    """Three phases on one cluster: dissemination (SIGUSR1 re-announces), crashes (one SIGKILL
    at a time, no stalls, each victim restarted and the cluster converged again before the
    next), then stalls (``stallers`` members SIGSTOPped ``stall_s`` out of every
    ``stall_every_s`` for ``stall_period_s``, nothing else happening)."""
    rng = random.Random(run.seed)
    say = (
        (lambda text: print(text, file=sys.stderr, flush=True))
        if run.progress
        else (lambda text: None)
    )
    cluster = Cluster(
        run.nodes, preset=run.preset, log_dir=run.log_dir, extra_overrides=run.extra_overrides
    )
    report: dict[str, Any] = {
        "nodes": run.nodes,
        "preset": run.preset,
        "log_dir": str(cluster.log_dir),
    }
    try:
        cluster.start()
        report["converged_after_start_s"] = round(cluster.wait_converged(), 3)
        say(
            f"{run.nodes} daemons up and converged "
            f"({report['converged_after_start_s']} s after the last started)"
        )
        report["dissemination"] = _dissemination(cluster, run, rng, say)
        report["detection"] = _crashes(cluster, run, rng, say)
        report["stalls"] = _stalls(cluster, run, rng, say)
        say(f"stalls: {report['stalls']}")
    finally:
        cluster.stop()
    return report


def _member_lines(daemon: DaemonProcess, member: str, since: float) -> list[dict[str, Any]]:
    return [
        e
        for e in daemon.events()
        if e.get("msg") in ("member", "member port refused")
        and e.get("member") == member
        and e.get("at", 0.0) >= since
    ]


def wait_known_dead(
    observers: Sequence[DaemonProcess],
    victim: str,
    killed_at: float,
    window_s: float,
    *,
    poll_s: float = 0.1,
) -> dict[str, float]:
    """Seconds from ``killed_at`` (wall clock) until each observer logged ``victim`` dead,
    by its own clock; waits until all have, or ``window_s`` has passed (then some are
    missing)."""
    dead_at: dict[str, float] = {}
    deadline = time.monotonic() + window_s
    while True:
        for other in observers:
            dead = [
                e["at"] for e in _member_lines(other, victim, killed_at) if e.get("event") == "dead"
            ]
            if dead:
                dead_at[other.name] = min(dead) - killed_at
        if len(dead_at) == len(observers) or time.monotonic() > deadline:
            return dead_at
        time.sleep(poll_s)


def _dissemination(
    cluster: Cluster, run: ClusterRun, rng: random.Random, say: Callable[[str], None]
) -> dict[str, Any]:
    """SIGUSR1 makes a daemon re-announce itself with a new incarnation: how long until each
    member has heard it."""
    learn: list[float] = []
    t100: list[float] = []
    for trial in range(run.dissemination_trials):
        origin = rng.choice(cluster.daemons)
        mark = len(origin.events())
        origin.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        announced = None
        while announced is None and time.monotonic() < deadline:
            announced = next(
                (e for e in origin.events()[mark:] if e.get("msg") == "announced"), None
            )
            time.sleep(0.05)
        assert announced is not None, "the daemon did not announce"
        time.sleep(3.0)
        times = []
        for d in cluster.daemons:
            if d is origin:
                continue
            seen = [
                e["at"]
                for e in _member_lines(d, origin.name, 0.0)
                if e["event"] in ("alive", "joined")
                and e["incarnation"] >= announced["incarnation"]
            ]
            if seen:
                times.append(min(seen) - announced["at"])
        learn.extend(times)
        if len(times) == run.nodes - 1:
            t100.append(max(times))
        say(
            f"dissemination {trial + 1}: {len(times)}/{run.nodes - 1} in "
            f"{max(times) if times else math.nan:.3f} s"
        )
    return {"time_to_100pct_s": summarize(t100), "member_learn_s": summarize(learn)}


def _crashes(
    cluster: Cluster, run: ClusterRun, rng: random.Random, say: Callable[[str], None]
) -> dict[str, Any]:
    """SIGKILL one daemon at a time: when the first member declared it dead, when every
    survivor knew (the daemons' own clocks, from their logs); then restart it on its ports
    and wait for the cluster to converge again (N stays the same)."""
    first: list[float] = []
    everyone: list[float] = []
    incomplete = by_refusal = 0
    for trial in range(run.crashes):
        victim = rng.randrange(run.nodes)
        d = cluster.daemons[victim]
        others = [o for o in cluster.daemons if o is not d]
        killed_at = time.time()
        d.kill()
        d.wait(5)
        dead_at = wait_known_dead(others, d.name, killed_at, run.detect_window_s, poll_s=0.2)
        refused = sum(
            e.get("verdict") == "dead"
            for other in others
            for e in _member_lines(other, d.name, killed_at)
            if e["msg"] == "member port refused"
        )
        by_refusal += refused > 0
        if dead_at:
            first.append(min(dead_at.values()))
        if len(dead_at) == len(others):
            everyone.append(max(dead_at.values()))
        else:
            incomplete += 1
        say(
            f"crash {trial + 1} ({d.name}): first dead {min(dead_at.values()) if dead_at else math.nan:.3f} s, "
            f"{len(dead_at)}/{len(others)} know after "
            f"{max(dead_at.values()) if dead_at else math.nan:.3f} s; {refused} by refusal"
        )
        cluster.restart(victim)
        cluster.wait_converged(timeout_s=60)
        time.sleep(1.0)
    return {
        "rounds": run.crashes,
        "first_declared_s": summarize(first),
        "all_members_know_s": summarize(everyone),
        "rounds_not_all_known_within_window": incomplete,
        "window_s": run.detect_window_s,
        "rounds_declared_by_refusal": by_refusal,
    }


def _stalls(
    cluster: Cluster, run: ClusterRun, rng: random.Random, say: Callable[[str], None]
) -> dict[str, Any]:
    """``stallers`` members (not the seeds' first) SIGSTOPped ``stall_s`` out of every
    ``stall_every_s``, each at its own phase, for ``stall_period_s``: none may be declared
    dead.  Counts the suspicions of them, and refusals of their ports (must be none: a stopped
    process's kernel still accepts connections)."""
    stalled = rng.sample(range(1, run.nodes), run.stallers) if run.stallers else []
    phases = {i: rng.random() * run.stall_every_s for i in stalled}
    stop_stalls = threading.Event()
    stalls_done = dict.fromkeys(stalled, 0)

    def staller(index: int) -> None:
        if stop_stalls.wait(phases[index]):
            return
        while not stop_stalls.is_set():
            d = cluster.daemons[index]
            d.pause()
            stop_stalls.wait(run.stall_s)
            d.resume()
            stalls_done[index] += 1
            if stop_stalls.wait(run.stall_every_s - run.stall_s):
                return

    threads = [threading.Thread(target=staller, args=(i,), daemon=True) for i in stalled]
    stall_started = time.time()
    try:
        for t in threads:
            t.start()
        next_say = time.monotonic() + 60
        end = time.monotonic() + run.stall_period_s
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_say:
                next_say += 60
                say(f"stalls: {round(time.time() - stall_started)} s of {run.stall_period_s:.0f}")
    finally:  # (an interrupt: no staller SIGSTOPs a daemon while the cluster stops)
        stop_stalls.set()
        for t in threads:
            if t.is_alive() or t.ident is not None:
                t.join()
    time.sleep(2.0)  # the last stall's suspicions end (refuted) or not
    stalled_names = {cluster.daemons[i].name for i in stalled}
    false_dead = suspicions = refusals = 0
    for d in cluster.daemons:
        for name in stalled_names:
            for e in _member_lines(d, name, stall_started):
                false_dead += e.get("event") == "dead"
                suspicions += e.get("event") == "suspect"
                refusals += e["msg"] == "member port refused"
    return {
        "stallers": sorted(stalled_names),
        "stall_s": run.stall_s,
        "every_s": run.stall_every_s,
        "stalls": sum(stalls_done.values()),
        "observed_s": round(time.time() - stall_started, 1),
        "declared_dead": false_dead,
        "suspicions": suspicions,
        "port_refusals": refusals,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m simulations cluster",
        description="Real daemons on loopback: dissemination, SIGKILL detection, SIGSTOP stalls.",
    )
    p.add_argument("--nodes", type=int, default=16, help="daemons to run")
    p.add_argument("--seed", type=int, default=1, help="seed of the harness's choices")
    p.add_argument("--crashes", type=int, default=10, help="SIGKILL rounds, one at a time")
    p.add_argument(
        "--dissemination-trials", type=int, default=5, help="SIGUSR1 re-announces to time"
    )
    p.add_argument("--stallers", type=int, default=3, help="members SIGSTOPped periodically")
    p.add_argument(
        "--stall-period-s",
        type=float,
        default=600.0,
        help="how long the stall phase runs (the issue's figure: 600; shorter for a quick run)",
    )
    p.add_argument("--stall-s", type=float, default=2.0, help="length of one SIGSTOP")
    p.add_argument("--stall-every-s", type=float, default=10.0, help="one stall per this")
    p.add_argument(
        "--detect-window-s", type=float, default=10.0, help="wait this long for every member"
    )
    p.add_argument("--preset", default="local", help="gossip.preset of every daemon")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every daemon (e.g. gossip.swim.crash_by_refusal=false)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of indented JSON")
    args = p.parse_args(argv)
    report = run_cluster(
        ClusterRun(
            nodes=args.nodes,
            seed=args.seed,
            crashes=args.crashes,
            dissemination_trials=args.dissemination_trials,
            stallers=args.stallers,
            stall_s=args.stall_s,
            stall_every_s=args.stall_every_s,
            stall_period_s=args.stall_period_s,
            detect_window_s=args.detect_window_s,
            preset=args.preset,
            extra_overrides=args.set,
        )
    )
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0
