"""`python -m simulations hostcut`: one host of daemons cut off and healed, in virtual time (the
SWIM simulator, the core's LAN preset), over many seeds: how long each side takes to hold
every member beyond the cut dead, and how long after the heal every member holds all alive
(issue 24; docs/MEMBERSHIP.md "A host cut off").  The shape defaults to the test bed's: 3
hosts x 2 daemons, one host cut for 15 s.  Prints one line per figure, or JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from gossipd.core.membership import State
from gossipd.core.swim_config import SwimConfig
from simulations.netsim import NetworkModel, Simulation

STEP_S = 0.01  # how often the tables are looked at


def cut_and_heal(
    seed: int, hosts: int, per_host: int, cut_s: float, loss: float, host: int = 0
) -> dict[str, float]:
    """One run: seconds to {cut_side, other_side} (the slowest member of the side to hold
    every member beyond the cut dead; inf: not within the cut), to {cut_side_first,
    other_side_first} (the slowest member of the side to hold one of them dead: it sees the
    cut) and to ``heal``."""
    n = hosts * per_host
    sim = Simulation(n, seed=seed, config=SwimConfig.lan(), network=NetworkModel(loss=0.0))
    t0 = 5.0 + seed % 997 / 997  # the cut falls anywhere in a probe round
    sim.run_until(t0)
    cut = list(range(host * per_host, (host + 1) * per_host))
    rest = [i for i in range(n) if i not in cut]
    sim.partition([rest, cut])
    sim.net.loss = loss  # during the cut only (it was set from the start, warm-up included)
    names = [m.name for m in sim.members]
    seen: dict[int, float] = {}
    first: dict[int, float] = {}  # when the member first held one beyond the cut dead
    t = t0
    while t < t0 + cut_s:
        t += STEP_S
        sim.run_until(t)
        for i in range(n):
            table = sim.members[i].core.table.members
            beyond = cut if i in rest else rest
            dead = [table[names[j]].state is State.DEAD for j in beyond]
            if i not in first and any(dead):
                first[i] = t - t0
            if i not in seen and all(dead):
                seen[i] = t - t0
    sim.heal()
    sim.net.loss = 0.0
    healed_at, heal = t, float("inf")
    while t < healed_at + 60.0:
        t += STEP_S
        sim.run_until(t)
        if all(m.core.table.live_count() == n for m in sim.members):
            heal = t - healed_at
            break
    inf = float("inf")
    return {
        "cut_side_first": max(first.get(i, inf) for i in cut),
        "other_side_first": max(first.get(i, inf) for i in rest),
        "cut_side": max(seen.get(i, inf) for i in cut),
        "other_side": max(seen.get(i, inf) for i in rest),
        "heal": heal,
    }


def summarise(xs: list[float], within_s: float) -> dict[str, float | int]:
    xs = sorted(xs)
    return {
        "p50": round(statistics.median(xs), 3),
        "p90": round(xs[max(0, int(0.9 * len(xs)) - 1)], 3),
        "max": round(xs[-1], 3),
        "within": sum(x <= within_s for x in xs),
        "runs": len(xs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations hostcut", description=__doc__)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--per-host", type=int, default=2, help="daemons per host")
    p.add_argument("--cut-s", type=float, default=15.0)
    p.add_argument("--loss", type=float, default=0.0, help="during the cut, 0..1")
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runs = [
        cut_and_heal(s, args.hosts, args.per_host, args.cut_s, args.loss) for s in range(args.seeds)
    ]
    report = {
        "shape": f"{args.hosts} hosts x {args.per_host}, host 0 cut {args.cut_s} s, "
        f"loss {args.loss}, {args.seeds} seeds",
        "cut_side_first_dead_s": summarise([r["cut_side_first"] for r in runs], 3.0),
        "other_side_first_dead_s": summarise([r["other_side_first"] for r in runs], 3.0),
        "cut_side_all_dead_s": summarise([r["cut_side"] for r in runs], 3.0),
        "other_side_all_dead_s": summarise([r["other_side"] for r in runs], 3.0),
        "heal_all_alive_s": summarise([r["heal"] for r in runs], 5.0),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(report["shape"])
    for key, goal in (
        ("cut_side_first_dead_s", 3.0),
        ("other_side_first_dead_s", 3.0),
        ("cut_side_all_dead_s", 3.0),
        ("other_side_all_dead_s", 3.0),
        ("heal_all_alive_s", 5.0),
    ):
        s = report[key]
        print(
            f"  {key}: p50 {s['p50']} s, p90 {s['p90']} s, max {s['max']} s; "
            f"within {goal} s: {s['within']}/{s['runs']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
