"""Real daemons on loopback, real faults: SIGKILL (crash), SIGSTOP/SIGCONT (stalls), SIGTERM
(graceful leave).  Figures come from the daemons' own JSON event logs ("member" lines carry
the wall-clock time at which the observer learned something).

    python -m simulations cluster --nodes 16 [--crashes 5] [--stallers 2] [--json]
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
    crashes: int = 5
    stallers: int = 2
    stall_s: float = 2.0
    stall_every_s: float = 10.0
    stall_period_s: float = 40.0
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
        for d in self.daemons:  # launch all, then wait: start-up overlaps
            d.launch()
        deadline = time.monotonic() + timeout_s
        for d in self.daemons:
            d.wait_ready(max(0.1, deadline - time.monotonic()))

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
        t0 = time.monotonic()
        cluster.start()
        report["converged_after_start_s"] = round(
            cluster.wait_converged() + (time.monotonic() - t0) * 0, 3
        )
        say(
            f"{run.nodes} daemons up and converged ({report['converged_after_start_s']} s after the last started)"
        )

        # Dissemination: SIGUSR1 makes a daemon re-announce itself with a new incarnation.
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
                    for e in d.events()
                    if e.get("msg") == "member"
                    and e["member"] == origin.name
                    and e["event"] in ("alive", "joined")
                    and e["incarnation"] >= announced["incarnation"]
                ]
                if seen:
                    times.append(min(seen) - announced["at"])
            learn.extend(times)
            if len(times) == run.nodes - 1:
                t100.append(max(times))
            say(
                f"dissemination {trial + 1}: {len(times)}/{run.nodes - 1} in {max(times) if times else math.nan:.3f} s"
            )
        report["dissemination"] = {
            "time_to_100pct_s": summarize(t100),
            "member_learn_s": summarize(learn),
        }

        # Stalls run in the background from here on: SIGSTOP stall_s out of every stall_every_s.
        stalled = rng.sample(range(1, run.nodes), run.stallers) if run.stallers else []
        stop_stalls = threading.Event()

        def staller(index: int) -> None:
            phase = rng.random() * run.stall_every_s
            if stop_stalls.wait(phase):
                return
            while not stop_stalls.is_set():
                d = cluster.daemons[index]
                d.pause()
                stop_stalls.wait(run.stall_s)
                d.resume()
                if stop_stalls.wait(run.stall_every_s - run.stall_s):
                    return

        threads = [threading.Thread(target=staller, args=(i,), daemon=True) for i in stalled]
        for t in threads:
            t.start()
        stall_started = time.time()

        # Detection: SIGKILL, measure, restart (so that N stays the same).
        first: list[float] = []
        everyone: list[float] = []
        candidates = [i for i in range(run.nodes) if i not in stalled]
        for trial in range(run.crashes):
            victim = rng.choice(candidates)
            d = cluster.daemons[victim]
            killed_at = time.time()
            d.kill()
            d.wait(5)
            time.sleep(run.detect_window_s)
            dead_at: dict[str, float] = {}
            for other in cluster.daemons:
                if other is d:
                    continue
                for e in other.events():
                    if (
                        e.get("msg") == "member"
                        and e["member"] == d.name
                        and e["event"] == "dead"
                        and e["at"] >= killed_at
                    ):
                        dead_at.setdefault(other.name, e["at"] - killed_at)
            if dead_at:
                first.append(min(dead_at.values()))
            if len(dead_at) == run.nodes - 1:
                everyone.append(max(dead_at.values()))
            say(
                f"crash {trial + 1}: first dead {min(dead_at.values()) if dead_at else math.nan:.3f} s, "
                f"{len(dead_at)}/{run.nodes - 1} know"
            )
            cluster.restart(victim)
            time.sleep(2.0)
        report["detection"] = {
            "first_declared_s": summarize(first),
            "all_members_know_s": summarize(everyone),
        }

        remaining = run.stall_period_s - (time.time() - stall_started)
        if remaining > 0:
            time.sleep(remaining)
        stop_stalls.set()
        for t in threads:
            t.join()
        stalled_names = {cluster.daemons[i].name for i in stalled}
        false_dead = suspicions = 0
        for d in cluster.daemons:
            for e in d.events():
                if (
                    e.get("msg") == "member"
                    and e["member"] in stalled_names
                    and e["at"] >= stall_started
                ):
                    false_dead += e["event"] == "dead"
                    suspicions += e["event"] == "suspect"
        report["stalls"] = {
            "stallers": sorted(stalled_names),
            "stall_s": run.stall_s,
            "every_s": run.stall_every_s,
            "observed_s": round(time.time() - stall_started, 1),
            "declared_dead": false_dead,
            "suspicions": suspicions,
        }
        say(f"stalls: {report['stalls']}")
    finally:
        cluster.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m simulations cluster")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--crashes", type=int, default=5)
    p.add_argument("--dissemination-trials", type=int, default=5)
    p.add_argument("--stallers", type=int, default=2)
    p.add_argument("--stall-period-s", type=float, default=40.0)
    p.add_argument("--preset", default="local")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = run_cluster(
        ClusterRun(
            nodes=args.nodes,
            seed=args.seed,
            crashes=args.crashes,
            dissemination_trials=args.dissemination_trials,
            stallers=args.stallers,
            stall_period_s=args.stall_period_s,
            preset=args.preset,
        )
    )
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0
