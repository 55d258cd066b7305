"""Two versions of the HTTP door, paired: ``gossipd bench http``'s gossipd variant (2
daemons, echo engine, both doors, about half the requests forwarded) started once per side
per round, the sides alternating, the bench's wrk at each concurrency; medians over rounds of
req/s, CPU microseconds a request of both daemons and of wrk (the clients), p50 and p99.  The sides:

- ``--base-tree DIR``: the daemons' code from DIR (a checkout of another commit: ``git
  worktree add /tmp/base HEAD~1``) against this tree's;
- ``--pinned``: this tree's daemons as the kernel schedules them against the same daemons
  each pinned to a core of its own once started (``taskset -a -p -c I PID``: daemon I on
  core I, all its threads; wrk stays free), as an operator's CPUAffinity= would;
- otherwise one setting's two values in this tree, ``--setting KEY=OLD,NEW`` (default
  ``node.zmq_io_batch=false,true``; ``fanout.peer_transport=zmq,loop`` compares the peer
  channels), passed as the daemons' GOSSIPD_* environment variable.

    .venv/bin/python scripts/door_paired.py [--base-tree DIR | --pinned | --setting KEY=OLD,NEW]
        [--rounds 3] [--seconds 4] [--concurrency 1,16,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.tools.bench.http import _gossipd
from gossipd.tools.bench.http_peers import Wrk, new_workdir

SETTING = "node.zmq_io_batch=false,true"  # the default --setting
PINNED = "pinned"  # --pinned's sides, in place of a setting
HERE = Path(__file__).resolve().parents[1]


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended and waited-for children: wrk's, once it ends."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env_name(key: str) -> str:
    """``fanout.peer_transport`` -> GOSSIPD_FANOUT__PEER_TRANSPORT (gossipd/config/load.py's
    rule; an environment variable beats the config's default)."""
    return "GOSSIPD_" + key.upper().replace(".", "__")


def _side(new: bool, base_tree: Path | None, setting: str) -> None:
    """The environment the daemons start with: which setting, or which tree's code (they
    run ``python -m gossipd`` from this process's working directory, set to / in main)."""
    if setting == PINNED:
        return  # (the same daemons both sides; one_side pins the new side's)
    if base_tree is None:
        key, _, values = setting.partition("=")
        old, new_value = values.split(",")
        os.environ[_env_name(key)] = new_value if new else old
    else:
        os.environ["PYTHONPATH"] = str(HERE if new else base_tree)


def one_side(
    new: bool, base_tree: Path | None, levels: list[int], seconds: int, setting: str
) -> dict[int, dict[str, float]]:
    _side(new, base_tree, setting)
    workdir = new_workdir()
    cluster, urls, pids = _gossipd(workdir)
    try:
        if new and setting == PINNED:
            if len(pids) > (os.cpu_count() or 1):
                raise SystemExit(f"--pinned: {len(pids)} daemons, fewer cores")
            for core, pid in enumerate(pids):
                # -a: every thread of it (the loop's, libzmq's I/O threads)
                subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)],
                               check=True, capture_output=True)  # fmt: skip
        wrk = Wrk(workdir)
        wrk.run(urls, 16, 2, pids)  # warm
        out = {}
        for c in levels:
            before = _children_cpu_s()
            w = wrk.run(urls, c, seconds, pids)
            client_s = _children_cpu_s() - before  # wrk's (the daemons have not ended)
            out[c] = {
                "req_per_s": w.req_per_s,
                "cpu_us_per_req": w.cpu_us_per_req or 0.0,
                "p50_us": w.p50_us,
                "p99_us": w.p99_us,
                "client_cpu_us_per_req": client_s * 1e6 / max(1, w.requests),
            }
        return out
    finally:
        cluster.stop()
        if setting != PINNED:
            os.environ.pop(_env_name(setting.partition("=")[0]), None)
        os.environ.pop("PYTHONPATH", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-tree", type=Path, default=None)
    parser.add_argument("--setting", default=SETTING, help="KEY=OLD,NEW")
    parser.add_argument("--pinned", action="store_true", help="free against pinned daemons")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    base_tree = args.base_tree.resolve() if args.base_tree else None
    if base_tree is not None and not (base_tree / "gossipd" / "__main__.py").exists():
        raise SystemExit(f"--base-tree {base_tree}: no gossipd package there")
    os.chdir("/")  # `python -m gossipd` takes the package from PYTHONPATH, not from here
    if args.pinned:
        if base_tree is not None:
            raise SystemExit("--pinned compares this tree with itself: no --base-tree")
        args.setting = PINNED
        names = ("free", "pinned")
    elif base_tree is not None:
        names = ("base", "head")
    else:
        key, _, values = args.setting.partition("=")
        if len(values.split(",")) != 2:
            raise SystemExit(f"--setting {args.setting!r}: expected KEY=OLD,NEW")
        names = tuple(f"{key}={v}" for v in values.split(","))
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        row: dict[str, Any] = {}
        for new in order:
            print(f"round {r + 1}/{args.rounds}: {names[new]}", file=sys.stderr)
            row[names[new]] = one_side(new, base_tree, levels, args.seconds, args.setting)
        rounds.append(row)
    medians: dict[str, Any] = {}
    for c in levels:
        m = {}
        for side in names:
            m[side] = {
                k: round(statistics.median(r[side][c][k] for r in rounds), 1)
                for k in (
                    "req_per_s",
                    "cpu_us_per_req",
                    "client_cpu_us_per_req",
                    "p50_us",
                    "p99_us",
                )
            }
        old, new = m[names[0]], m[names[1]]
        m["cpu_ratio"] = round(new["cpu_us_per_req"] / old["cpu_us_per_req"], 3)
        m["req_per_s_ratio"] = round(new["req_per_s"] / old["req_per_s"], 3)
        medians[str(c)] = m
    report = {
        "sides": list(names),
        "base_tree": str(base_tree) if base_tree else None,
        "setting": None if base_tree or args.pinned else args.setting,
        "rounds": rounds,
        "medians": medians,
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for c, m in medians.items():
        d, b = m[names[0]], m[names[1]]
        print(
            f"c={c}: req/s {d['req_per_s']:,.0f} -> {b['req_per_s']:,.0f} "
            f"(x{m['req_per_s_ratio']}), CPU us/req {d['cpu_us_per_req']} -> "
            f"{b['cpu_us_per_req']} (x{m['cpu_ratio']}), wrk's CPU us/req "
            f"{d['client_cpu_us_per_req']} -> {b['client_cpu_us_per_req']}, p50 {d['p50_us']:.0f} -> "
            f"{b['p50_us']:.0f} us, p99 {d['p99_us']:.0f} -> {b['p99_us']:.0f} us"
        )


if __name__ == "__main__":
    main()
