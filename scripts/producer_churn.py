"""What producers that come and go leave behind in an idle daemon.

Each of ``--producers`` producers binds a reply port of its own, sends one task, reads its
Result and goes (as each ``gossipd submit`` or client run does); then the daemon (echo
engine, no membership) sits idle, and for each of ``--windows`` windows of ``--seconds``
this prints its CPU (every thread, % of a core), its open file descriptors and the
connections this network namespace tried to open (/proc/net/snmp ActiveOpens: libzmq
connecting again to the reply ports nobody listens on any more).  With ``--base-tree DIR``
a daemon of DIR's code runs the same first (PYTHONPATH), for a paired figure.
bench/README.md, "Producers that come and go".

    .venv/bin/python scripts/producer_churn.py [--producers 1000] [--windows 3]
        [--seconds 5] [--base-tree DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from gossipd.tools.bench.loadgen import make_frames
from gossipd.tools.bench.membership import cpu_ns
from gossipd.tools.launcher import DaemonProcess

HERE = Path(__file__).resolve().parent.parent


def active_opens() -> int:
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    return int(tcp[1][tcp[0].index("ActiveOpens")])


def one_side(tree: Path, producers: int, windows: int, seconds: float) -> dict[str, Any]:
    daemon = DaemonProcess(
        name="churn", overrides=['gossip.bind=""'], env={"PYTHONPATH": str(tree)}
    ).start()
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(daemon.endpoint)
        started = time.perf_counter()
        for i in range(producers):
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            ((_, frame),) = make_frames(1, f"tcp://127.0.0.1:{port}", run=f"churn-{i}")
            push.send(frame)
            if not pull.poll(10_000):
                raise SystemExit(f"producer {i}: no Result within 10 s")
            pull.recv()
            pull.close()
        out: dict[str, Any] = {"churn_s": round(time.perf_counter() - started, 2), "windows": []}
        for _ in range(windows):
            c0, o0 = cpu_ns(daemon.pid), active_opens()
            time.sleep(seconds)  # (idle: what it does meanwhile is the figure)
            c1, o1 = cpu_ns(daemon.pid), active_opens()
            out["windows"].append(
                {
                    "cpu_pct_of_core": round((c1 - c0) / (seconds * 1e9) * 100, 2),
                    "connects_per_s": round((o1 - o0) / seconds, 1),
                    "open_fds": len(os.listdir(f"/proc/{daemon.pid}/fd")),
                }
            )
            print(str(tree), json.dumps(out["windows"][-1]), file=sys.stderr)
        return out
    finally:
        daemon.stop()
        ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producers", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--base-tree", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.chdir("/")  # `python -m gossipd` takes the package from PYTHONPATH, not from here
    report: dict[str, Any] = {"producers": args.producers, "seconds": args.seconds}
    if args.base_tree is not None:
        report["base"] = one_side(
            args.base_tree.resolve(), args.producers, args.windows, args.seconds
        )
    report["head"] = one_side(HERE, args.producers, args.windows, args.seconds)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for side in ("base", "head"):
        if side in report:
            for w in report[side]["windows"]:
                print(
                    f"{side}: {w['cpu_pct_of_core']}% of a core, {w['connects_per_s']} "
                    f"connects/s, {w['open_fds']} fds"
                )


if __name__ == "__main__":
    main()
