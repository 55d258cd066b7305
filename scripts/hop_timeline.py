"""Where the added latency of a forwarded task goes at window 1, stage by stage.

Two 2-daemon clusters (echo engine, no journal) run side by side: one as shipped, and one
whose owner sends what goes back to its forwarders (accepts and TaskDones) every 20 ms
instead of right after each Result (an experiment only: it widens the window in which an
owner's death has a task answered twice, docs/PROTOCOL.md "Duplicate final Results"), to
measure what that message costs the next task.  A producer sends one task at a time to d00
(PUSH, blocking), in rounds that alternate between the clusters and between keys d00 owns
(0 hops) and keys d01 owns (1 hop).  Each daemon records the monotonic time (the clock the
producer reads too) of a few points of the path (its socket reads, placement, the
Forward's send, the owner's decode and admission, the engine's end, the Result's send) and
writes them at exit; the report gives each point's median offset from the producer's send.

    .venv/bin/python scripts/hop_timeline.py [--tasks 1500] [--rounds 2] [--json]

What it showed on the 2-vCPU VM: bench/README.md, "Where the hop goes".
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root

import zmq

from gossipd.core.ring import Ring
from gossipd.tools.bench.loadgen import make_frames
from simulations.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]

# Loaded by each daemon process (PYTHONPATH) before gossipd: wraps the points measured.
SITE = """
import atexit, json, os, sys, time, importlib, importlib.abc
OUT = os.environ.get("HOP_TIMELINE_DIR")
if OUT:
    EV = []
    mono = time.monotonic_ns

    def _mark(cls, meth, name):
        orig = getattr(cls, meth)
        def wrapped(*a, **k):
            EV.append((mono(), name))
            return orig(*a, **k)
        setattr(cls, meth, wrapped)

    def _install():
        from gossipd import looppeer, peerchannel, replysender, zmqloop
        from gossipd.fanout import owner, forwarding
        from gossipd.ingress import intake, runner
        orig_read = zmqloop.SocketReader._read
        def _read(self):
            EV.append((mono(), "read " + getattr(self._on_messages, "__qualname__", "peer replies")))
            return orig_read(self)
        zmqloop.SocketReader._read = _read
        _mark(peerchannel.ZmqPeerClient, "send", "entry: Forward to the owner's socket")
        _mark(looppeer.LoopPeerClient, "send", "entry: Forward to the owner's socket")
        _mark(looppeer.LoopPeerServer, "_on_messages", "read peer channel (loop)")
        _mark(forwarding.Dispatcher, "route", "entry: placement")
        _mark(owner.OwnerEndpoint, "_on_forward", "owner: Forward decoded")
        _mark(intake.Intake, "admit", "admission")
        _mark(runner.Runner, "_finish", "engine done")
        _mark(replysender.ReplySender, "_send_by_socket", "Result to the producer's socket")
        _mark(peerchannel.ZmqPeerServer, "send", "owner: TaskDone (and any accept) to the forwarder")
        _mark(looppeer.LoopPeerServer, "send", "owner: TaskDone (and any accept) to the forwarder")
        if os.environ.get("HOP_DELAY_OWNER_REPLIES"):
            import asyncio
            flush = owner.OwnerEndpoint._flush_router
            def _flush_later(self):
                if getattr(self, "_hop_later", None) is None:
                    def go():
                        self._hop_later = None
                        flush(self)
                    self._hop_later = asyncio.get_running_loop().call_later(0.02, go)
            owner.OwnerEndpoint._flush_router = _flush_later

    class _Hook(importlib.abc.MetaPathFinder):
        done = False
        def find_spec(self, name, path, target=None):
            if name == "gossipd.daemon" and not _Hook.done:
                _Hook.done = True
                _install()
            return None

    sys.meta_path.insert(0, _Hook())
    atexit.register(lambda: json.dump(EV, open(os.path.join(OUT, f"{os.getpid()}.json"), "w")))
"""


def _cluster(site: Path, out: Path, delay: bool) -> Cluster:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    os.environ["HOP_TIMELINE_DIR"] = str(out)
    os.environ.pop("HOP_DELAY_OWNER_REPLIES", None)
    if delay:
        os.environ["HOP_DELAY_OWNER_REPLIES"] = "1"
    cluster = Cluster(2, extra_overrides=['journal.path=""'])
    cluster.start()  # (its processes take the environment above)
    return cluster


def _send(endpoint: str, keys: list[str], run: str) -> list[tuple[int, int]]:
    """Window 1: (sent, answered) monotonic ns per task."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    times = []
    try:
        for _, frame in make_frames(len(keys), f"tcp://127.0.0.1:{port}", run=run, keys=keys):
            sent = time.monotonic_ns()
            push.send(frame)
            pull.recv()
            times.append((sent, time.monotonic_ns()))
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    return times


def _timeline(points: list[list[tuple[int, str]]], times: list[tuple[int, int]]) -> list[Any]:
    """Each point's median offset (us) from the producer's send: its first time within each
    task's window, where it happened in at least a quarter of them."""
    events = sorted((t, f"d0{i} {name}") for i, evs in enumerate(points) for t, name in evs)
    stamps = [t for t, _ in events]
    offsets: dict[str, list[float]] = {}

    for sent, answered in times:
        seen = set()
        for k in range(bisect.bisect_left(stamps, sent), bisect.bisect_right(stamps, answered)):
            name = events[k][1]
            if name not in seen:
                seen.add(name)
                offsets.setdefault(name, []).append((events[k][0] - sent) / 1e3)
    rows = [
        (round(statistics.median(v), 1), name, len(v))
        for name, v in offsets.items()
        if len(v) >= len(times) / 4
    ]
    rows.append(
        (
            round(statistics.median((b - a) / 1e3 for a, b in times), 1),
            "producer has the Result",
            len(times),
        )
    )
    return sorted(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=1500, help="tasks of each kind per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hop-timeline-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    variants = {"shipped": False, "owner_replies_every_20ms": True}
    clusters, outs = {}, {}
    for name, delay in variants.items():
        outs[name] = work / name
        outs[name].mkdir()
        clusters[name] = _cluster(work / "site", outs[name], delay)
    times: dict[str, dict[str, list[tuple[int, int]]]] = {v: {"0": [], "1": []} for v in variants}
    pids = {}
    try:
        for name, cluster in clusters.items():
            cluster.wait_converged(30)
            cluster.wait_meta(30)
            pids[name] = [d.proc.pid for d in cluster.daemons]  # type: ignore[union-attr]
        ring = Ring({"d00": 1.0, "d01": 1.0})
        keys = [f"k{i}" for i in range(args.tasks * 4)]
        owned = {
            h: [k for k in keys if ring.owner(k) == ("d00" if h == "0" else "d01")] for h in "01"
        }
        for name, cluster in clusters.items():  # warm-up, not counted
            _send(cluster.daemons[0].endpoint, owned["0"][:300], f"warm-{name}")
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                for hops in ("0", "1") if r % 2 == 0 else ("1", "0"):
                    ks = owned[hops][: args.tasks]
                    times[name][hops] += _send(
                        clusters[name].daemons[0].endpoint, ks, f"{name}{hops}r{r}"
                    )
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    report: dict[str, Any] = {}
    for name in variants:
        points = [json.loads((outs[name] / f"{pid}.json").read_text()) for pid in pids[name]]
        report[name] = {
            f"{h}_hop": {
                "p50_us": round(statistics.median((b - a) / 1e3 for a, b in t), 1),
                "timeline": _timeline(points, t),
            }
            for h, t in times[name].items()
        }
        report[name]["added_per_hop_p50_us"] = round(
            report[name]["1_hop"]["p50_us"] - report[name]["0_hop"]["p50_us"], 1
        )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for name in variants:
        print(f"== {name}: added per hop p50 {report[name]['added_per_hop_p50_us']} us")
        for h in ("0", "1"):
            print(f"  {h} hop(s), p50 {report[name][f'{h}_hop']['p50_us']} us after the send:")
            for offset, point, n in report[name][f"{h}_hop"]["timeline"]:
                print(f"    {offset:8.1f} us  {point}  ({n} tasks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
