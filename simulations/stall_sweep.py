"""`python -m simulations stalls`: how often 2 s stalls under loss get a healthy member declared
dead.  Over --seeds seeds: --nodes members, --stallers of them paused --stall-s every 10 s
(at t = 2, 12, ...), --seconds simulated at --loss; prints the runs with a false death."""

from __future__ import annotations

import argparse
import json

from gossipd.core.swim_config import SwimConfig
from simulations.__main__ import _overrides
from simulations.netsim import NetworkModel, Simulation


def sweep(
    *,
    nodes: int,
    stallers: int,
    stall_s: float,
    seconds: float,
    loss: float,
    seeds: int,
    config: SwimConfig,
) -> dict[str, object]:
    runs_with_false_death = 0
    members_declared = 0
    for seed in range(seeds):
        sim = Simulation(nodes, seed=seed, network=NetworkModel(loss=loss), config=config)
        for start in range(2, int(seconds), 10):
            sim.run_until(float(start))
            for i in range(stallers):
                sim.pause(i, stall_s)
        sim.run_until(seconds + 2.0)
        dead = {e.node for _, e in sim.trace.events if e.kind == "dead"}
        runs_with_false_death += bool(dead)
        members_declared += len(dead)
    return {
        "nodes": nodes,
        "stallers": stallers,
        "loss": loss,
        "seeds": seeds,
        "runs_with_false_death": runs_with_false_death,
        "members_declared_dead": members_declared,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations stalls", description=__doc__)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--stallers", type=int, default=2)
    p.add_argument("--stall-s", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--loss", type=float, default=0.1)
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--swim", action="append", default=[], metavar="FIELD=VALUE")
    args = p.parse_args(argv)
    report = sweep(
        nodes=args.nodes,
        stallers=args.stallers,
        stall_s=args.stall_s,
        seconds=args.seconds,
        loss=args.loss,
        seeds=args.seeds,
        config=SwimConfig.sim(**_overrides(args.swim)),
    )
    print(json.dumps(report))
    return 0
