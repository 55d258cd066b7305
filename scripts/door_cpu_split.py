"""Where the daemons' CPU goes under ``gossipd bench http``'s load: its gossipd variant (2
daemons, echo engine, both doors, about half the requests forwarded) under the bench's wrk,
and per daemon, from /proc, the user and system CPU a request and the context switches a
request (all its threads), at each concurrency.  The bench's own figure is their sum over
both daemons; this splits it: system time is the sockets' and the wake-ups', user time the
Python (the interpreter, msgspec, uvloop, httptools) and libzmq's threads.

    .venv/bin/python scripts/door_cpu_split.py [--concurrency 1,16,64] [--seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.tools.bench.http import _gossipd
from gossipd.tools.bench.http_peers import Wrk, new_workdir

FIELDS = ("user_us", "sys_us", "voluntary_switches", "involuntary_switches")


def _usage(pid: int) -> tuple[float, float, int, int]:
    """(user s, system s, voluntary and involuntary context switches of all its threads)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    voluntary = involuntary = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    # (fields 14 and 15 of stat: utime and stime, in clock ticks; [11] and [12] after the name)
    return int(stat[11]) / tick, int(stat[12]) / tick, voluntary, involuntary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.chdir("/")  # `python -m gossipd` takes the package from PYTHONPATH, not from here
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    workdir = new_workdir()
    cluster, urls, pids = _gossipd(workdir)
    report: dict[str, Any] = {"seconds": args.seconds, "by_concurrency": {}}
    try:
        wrk = Wrk(workdir)
        wrk.run(urls, 16, 2, pids)  # warm
        for c in (int(x) for x in args.concurrency.split(",")):
            before = [_usage(p) for p in pids]
            w = wrk.run(urls, c, args.seconds, pids)
            after = [_usage(p) for p in pids]
            n = max(1, w.requests)
            daemons = []
            for b, a in zip(before, after, strict=True):
                d = [x - y for x, y in zip(a, b, strict=True)]
                daemons.append(
                    {
                        "user_us": round(d[0] * 1e6 / n, 1),
                        "sys_us": round(d[1] * 1e6 / n, 1),
                        "voluntary_switches": round(d[2] / n, 3),
                        "involuntary_switches": round(d[3] / n, 3),
                    }
                )
            report["by_concurrency"][str(c)] = {
                "req_per_s": round(w.req_per_s, 1),
                "p50_us": w.p50_us,
                "daemons": daemons,
                "both": {k: round(sum(x[k] for x in daemons), 3) for k in FIELDS},
            }
    finally:
        cluster.stop()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for c, r in report["by_concurrency"].items():
        both = r["both"]
        print(
            f"c={c}: {r['req_per_s']:,.0f} req/s, p50 {r['p50_us']:.0f} us; both daemons a "
            f"request: user {both['user_us']} us, system {both['sys_us']} us, context "
            f"switches {both['voluntary_switches']} voluntary, "
            f"{both['involuntary_switches']} involuntary"
        )
        for i, d in enumerate(r["daemons"]):
            print(f"    daemon {i}: user {d['user_us']} us, system {d['sys_us']} us")


if __name__ == "__main__":
    main()
