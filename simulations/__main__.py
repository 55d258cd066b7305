"""`python -m simulations swim|fanout|cluster|chaos|stopping|election|freshness|hostcut|hosts
...` (each with --help)."""

from __future__ import annotations

import argparse
import json
import sys

from gossipd.core.swim_config import SwimConfig
from simulations.scenarios.swim import SwimRun, plot, run_swim, summary_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("swim", help="SWIM membership in virtual time")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--loss", type=float, default=0.0, help="message loss probability, 0..1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dissemination-trials", type=int, default=10)
    p.add_argument("--crash-trials", type=int, default=10)
    p.add_argument(
        "--stallers", type=int, default=0, help="members that pause --stall-s every --stall-every-s"
    )
    p.add_argument("--stall-s", type=float, default=2.0)
    p.add_argument("--stall-every-s", type=float, default=10.0)
    p.add_argument(
        "--partition-s", type=float, default=0.0, help="split in halves this long, then heal"
    )
    p.add_argument(
        "--extra-s", type=float, default=0.0, help="simulate this much longer at the end"
    )
    p.add_argument(
        "--swim",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a SwimConfig field (repeatable), e.g. contain_suspicions=false",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "cluster":
        from simulations.cluster import main as cluster_main

        return cluster_main(argv[1:])
    if argv and argv[0] == "fanout":
        from simulations.fanout_cli import main as fanout_main

        return fanout_main(argv[1:])
    if argv and argv[0] == "stopping":
        from simulations.stopping import main as stopping_main

        return stopping_main(argv[1:])
    if argv and argv[0] == "freshness":
        from simulations.freshness import main as freshness_main

        return freshness_main(argv[1:])
    if argv and argv[0] == "simtime":
        from simulations.simtime import main as simtime_main

        return simtime_main(argv[1:])
    if argv and argv[0] == "stalls":
        from simulations.stall_sweep import main as stalls_main

        return stalls_main(argv[1:])
    if argv and argv[0] == "chaos":
        from simulations.chaos import main as chaos_main

        return chaos_main(argv[1:])
    if argv and argv[0] == "hostcut":
        from simulations.hostcut import main as hostcut_main

        return hostcut_main(argv[1:])
    if argv and argv[0] == "hosts":
        from simulations.hosts_cli import main as hosts_main

        return hosts_main(argv[1:])
    if argv and argv[0] == "election":
        from simulations.election_cli import main as election_main

        return election_main(argv[1:])
    sub.add_parser("cluster", help="real daemons on loopback with real faults (see --help there)")
    sub.add_parser("freshness", help="how old the load state placement decisions use is")
    sub.add_parser("simtime", help="the simulator's cost per N (start-up, CPU per second)")
    sub.add_parser("stalls", help="how often 2 s stalls under loss cause a false death")
    sub.add_parser("chaos", help="real daemons serving tasks through SIGKILL and SIGTERM")
    sub.add_parser("election", help="real etcd and daemons electing a leader through faults")
    sub.add_parser("hostcut", help="a host of daemons cut off and healed, over many seeds")
    sub.add_parser("hosts", help="hosts as network namespaces, deployed as OPERATIONS.md says")
    sub.add_parser("stopping", help="what stopping one daemon under load costs its producers")
    sub.add_parser("fanout", help="whole daemons (membership, fan-out, owners) in virtual time")
    args = parser.parse_args(argv)
    run = SwimRun(
        nodes=args.nodes,
        loss=args.loss,
        seed=args.seed,
        dissemination_trials=args.dissemination_trials,
        crash_trials=args.crash_trials,
        stallers=args.stallers,
        stall_s=args.stall_s,
        stall_every_s=args.stall_every_s,
        partition_s=args.partition_s,
        extra_s=args.extra_s,
        progress=not args.quiet,
        config=SwimConfig.sim(**_overrides(args.swim)),
    )
    try:
        report = run_swim(run)
    except Exception:
        print(f"simulation failed; replay with --seed {args.seed}", file=sys.stderr)
        raise
    if args.plot:
        plot(report, args.plot)
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    if args.json:
        print(json.dumps(public))
    else:
        print("\n".join(summary_lines(public)))
    return 0


def _overrides(pairs: list[str]) -> dict[str, object]:
    """``FIELD=VALUE`` pairs as SwimConfig overrides, each VALUE converted to its field's type."""
    defaults = SwimConfig()
    out: dict[str, object] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in SwimConfig.field_names():
            raise SystemExit(f"--swim {pair!r}: expected FIELD=VALUE with a SwimConfig field")
        kind = type(getattr(defaults, name))
        if kind is bool:
            out[name] = text.lower() in ("1", "true", "yes", "on")
        else:
            out[name] = kind(text)
    return out


if __name__ == "__main__":
    sys.exit(main())
