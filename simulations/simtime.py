"""`python -m simulations simtime`: what the SWIM simulator costs at N members: start-up and
CPU seconds per simulated second (``time.process_time``, comparable on a shared machine),
and peak memory.  Prints one JSON line per --nodes value."""

from __future__ import annotations

import argparse
import json
import resource
import time

from simulations.netsim import NetworkModel, Simulation


def measure(nodes: int, seconds: float, loss: float, seed: int) -> dict[str, float]:
    c0 = time.process_time()
    sim = Simulation(nodes, seed=seed, network=NetworkModel(loss=loss))
    c1, w1 = time.process_time(), time.monotonic()
    sim.run_until(seconds)
    c2, w2 = time.process_time(), time.monotonic()
    return {
        "nodes": nodes,
        "loss": loss,
        "simulated_s": seconds,
        "startup_cpu_s": round(c1 - c0, 3),
        "run_cpu_s": round(c2 - c1, 2),
        "run_wall_s": round(w2 - w1, 2),
        "cpu_s_per_simulated_s": round((c2 - c1) / seconds, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations simtime", description=__doc__)
    p.add_argument("--nodes", default="1000,4000,10000", help="comma-separated member counts")
    p.add_argument("--seconds", type=float, default=30.0, help="simulated seconds each")
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for n in (int(x) for x in args.nodes.split(",")):
        print(json.dumps(measure(n, args.seconds, args.loss, args.seed)), flush=True)
    return 0
