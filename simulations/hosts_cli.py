"""`python -m simulations hosts`: a bed of hosts (network namespaces), gossipd deployed on
them as docs/OPERATIONS.md says, a producer host, a nemesis; the report as JSON.

    python -m simulations hosts --hosts 3 --gpus 2 --curve --etcd \
        --nemesis partition,kill,pause,loss --rate 200 --duration 60 --json

Needs root (namespaces, a bridge), `ip`, and `nft` for the loss fault (the report says when it
is missing).  Progress lines go to stderr.  Exit status 1 when a task was lost, a term had two
leaders, or the producer failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from simulations.hosts_deploy import BedOptions
from simulations.hosts_nemesis import FAULTS, NemesisOptions
from simulations.hosts_net import BedUnavailable
from simulations.hosts_scenario import ScenarioOptions, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m simulations hosts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--gpus", type=int, default=2, help="daemons per host (a fake topology)")
    p.add_argument("--curve", action="store_true", help="CURVE on every socket (keys by keygen)")
    p.add_argument("--etcd", action="store_true", help="etcd on host h0; daemons elect a leader")
    p.add_argument(
        "--nemesis", default="", help=f"faults in order, comma-separated: {','.join(FAULTS)}"
    )
    p.add_argument("--rate", type=float, default=100.0, help="tasks per second (default 100)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    p.add_argument("--cut-s", type=float, default=15.0, help="partition: how long (default 15)")
    p.add_argument("--pause-s", type=float, default=5.0, help="pause: how long (default 5)")
    p.add_argument("--loss-s", type=float, default=10.0, help="loss: how long (default 10)")
    p.add_argument("--loss-percent", type=int, default=5)
    p.add_argument("--keep", action="store_true", help="keep the bed's directory (logs, ids)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting written into every host's gossipd.toml (repeatable), e.g. "
        "fanout.confirm_results=suspect",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    faults = [f for f in args.nemesis.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"--nemesis: unknown {', '.join(unknown)} (choose from {', '.join(FAULTS)})")
    opts = ScenarioOptions(
        bed=BedOptions(
            hosts=args.hosts,
            gpus=args.gpus,
            curve=args.curve,
            etcd=args.etcd,
            keep=args.keep,
            settings=args.set,
        ),
        nemesis=faults,
        nemesis_opts=NemesisOptions(
            cut_s=args.cut_s,
            pause_s=args.pause_s,
            loss_s=args.loss_s,
            loss_percent=args.loss_percent,
        ),
        rate=args.rate,
        duration_s=args.duration,
    )
    try:
        report = run(opts)
    except BedUnavailable as exc:
        print(f"simulations hosts: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a step of the deployment failed: its command and output
        print(f"simulations hosts: the deployment failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
