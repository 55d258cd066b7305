"""`python -m simulations election`: the command line of simulations/election.py."""

from __future__ import annotations

import argparse
import json
import sys

from simulations.election import QUICK, ElectionRun, run_election
from simulations.election import __doc__ as ELECTION_DOC


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m simulations election", description=(ELECTION_DOC or "").split("\n\n")[0]
    )
    p.add_argument("--daemons", type=int, default=5, help="gossipd daemons (echo engine)")
    p.add_argument("--ttl", type=float, default=2.0, help="leader lease TTL, seconds (etcd.ttl_s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the fault schedule")
    p.add_argument("--etcd", type=int, default=1, choices=(1, 3), help="etcd members")
    p.add_argument(
        "--etcd-down-s",
        type=float,
        default=None,
        help="etcd stopped this long at the end (30; --quick: 4)",
    )
    p.add_argument(
        "--quiet-s",
        type=float,
        default=None,
        help="left alone after each fault has settled (5; --quick: 0.5)",
    )
    p.add_argument("--rate", type=float, default=20.0, help="producer tasks per second")
    p.add_argument("--etcd-heartbeat-ms", type=int, default=100, help="etcd --heartbeat-interval")
    p.add_argument(
        "--etcd-election-ms",
        type=int,
        default=1000,
        help="etcd --election-timeout (its smallest lease TTL is ceil(1.5 x this) in whole seconds)",
    )
    p.add_argument("--quick", action="store_true", help="short periods, for tests")
    p.add_argument("--log-dir", help="keep the daemons' and etcd's logs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="one JSON line (progress still on stderr)")
    args = p.parse_args(argv)
    run = ElectionRun(
        daemons=args.daemons,
        ttl_s=args.ttl,
        rounds=args.rounds,
        etcd_members=args.etcd,
        rate_per_s=args.rate,
        etcd_heartbeat_ms=args.etcd_heartbeat_ms,
        etcd_election_ms=args.etcd_election_ms,
        log_dir=args.log_dir,
        **(QUICK if args.quick else {}),
    )
    if args.etcd_down_s is not None:
        run.etcd_down_s = args.etcd_down_s
    if args.quiet_s is not None:
        run.quiet_s = args.quiet_s
    report = run_election(run)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    ok = (
        report["overlapping_terms"] == 0
        and report["token_regressions"] == 0
        and report["tasks_lost"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
