"""``gossip.receiver`` paired: 16 idle daemons on loopback with the loop's PULL and with
libzmq's, alternating; each side's idle CPU, main-thread wake-ups and RSS a daemon (15 s
window), and 2 SIGKILLs known to all.  bench/README.md, "The membership socket on the loop".

    .venv/bin/python scripts/gossip_receiver_paired.py [ROUNDS]   # about 1 minute a side
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gossipd.tools.bench.membership import _crash_figures, _gossipd_crashes, idle_figures
from simulations.cluster import Cluster


def one(side: str) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"gossip-receiver-{side}-"))
    overrides = ['metrics.bind="127.0.0.1:0"', f'gossip.receiver="{side}"']
    cluster = Cluster(16, preset="lan", log_dir=str(workdir), extra_overrides=overrides)
    try:
        cluster.start(timeout_s=120)
        cluster.wait_converged(120)
        time.sleep(3.0)  # past start-up's one-off work
        fig = idle_figures({"g": [d.pid for d in cluster.daemons]}, 15.0)["g"]
        crash = _crash_figures(_gossipd_crashes(cluster, 2, 10.0))
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "cpu_pct": fig["cpu_pct_per_agent"]["mean"],
        "wakeups_per_s": fig["main_thread_wakeups_per_s"]["mean"],
        "rss_mb": fig["rss_mb_per_agent"]["mean"],
        "crash_known_to_all_s": crash,
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    out: dict[str, list[dict[str, Any]]] = {"loop": [], "zmq": []}
    for r in range(rounds):
        for side in ("loop", "zmq") if r % 2 == 0 else ("zmq", "loop"):
            row = one(side)
            out[side].append(row)
            print(side, json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
