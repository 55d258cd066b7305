"""`python -m simulations fanout --nodes N --tasks T --seed S --faults crash,stall,... [--json]`
and `... fanout --swarm K`: the whole-daemon simulator (simulations/fanout.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from simulations.fanout import FAULT_KINDS, FanoutRun, run_fanout, swarm, trace_for


def _faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {unknown}; choose from {FAULT_KINDS}")
    return kinds


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations fanout", description=__doc__)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--tasks", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--faults",
        type=_faults,
        default=FAULT_KINDS,
        help="comma-separated: crash,stall,partition,loss (empty: none)",
    )
    p.add_argument(
        "--fault-events",
        type=int,
        default=0,
        help="faults to inject (0: one of each kind per 10 simulated s)",
    )
    p.add_argument("--load", type=float, default=0.7, help="offered load, share of engine capacity")
    p.add_argument("--hedge", action="store_true")
    p.add_argument(
        "--degrade",
        action="store_true",
        help="crash --crash-share of the members at once, mid-run; report throughput before and after",
    )
    p.add_argument("--crash-share", type=float, default=0.2)
    p.add_argument(
        "--saturated-waiting",
        type=int,
        default=0,
        help="owners with this many tasks waiting refuse if_free Forwards (0: never saturated)",
    )
    p.add_argument(
        "--queue-wait-target-s",
        type=float,
        default=0.0,
        help="owners refuse (overloaded) a task expected to queue longer (0: half its deadline)",
    )
    p.add_argument("--service-s", type=float, default=0.05, help="mean engine time of a task")
    p.add_argument(
        "--resubmit-s",
        type=float,
        default=2.0,
        help="a producer resends an id after this long without a Result",
    )
    p.add_argument(
        "--no-hold-results",
        action="store_true",
        help="owners send every Result at once (no held Results, no Confirm: to compare)",
    )
    p.add_argument(
        "--confirm-results",
        choices=("always", "suspect"),
        default="suspect",
        help="which forwarded Results wait for their forwarder's Confirm (fanout.confirm_results)",
    )
    p.add_argument(
        "--cancel-every",
        type=int,
        default=50,
        metavar="N",
        help="every N-th task is cancelled by its producer and an intruder, as many by the "
        "intruder alone (0: none)",
    )
    p.add_argument(
        "--abort-s",
        type=float,
        default=FanoutRun.abort_s,
        metavar="S",
        help="an aborted engine request holds its slot and task this long (0: instant)",
    )
    p.add_argument(
        "--swarm",
        type=int,
        default=0,
        metavar="K",
        help="run K short seeds with random fault mixes instead",
    )
    p.add_argument(
        "--trace", metavar="TASK_ID", help="replay the seed and print this task's events"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    def show(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    started = time.monotonic()
    if args.swarm:
        report = swarm(args.swarm, seed=args.seed, progress=show)
        report["wall_s"] = round(time.monotonic() - started, 1)
        for f in report["failures"]:  # type: ignore[attr-defined]
            show(
                f"FAILED: replay with --seed {f['seed']} --nodes {f['nodes']} --tasks {f['tasks']} "
                f"--faults {','.join(f['faults'])} --fault-events {f['fault_events']} "
                f"--load {f['load']!r} --cancel-every {f['cancel_every']} "
                f"--abort-s {f['abort_s']!r}" + (" --hedge" if f["hedge"] else "")
            )
        print(
            json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items())
        )
        return 1 if report["failing"] else 0
    run = FanoutRun(
        nodes=args.nodes,
        tasks=args.tasks,
        seed=args.seed,
        faults=args.faults,
        fault_events=args.fault_events,
        load=args.load,
        hedge=args.hedge,
        progress=show,
        crash_at_s=-1.0,
        crash_share=args.crash_share,
        saturated_waiting=args.saturated_waiting,
        queue_wait_target_s=args.queue_wait_target_s,
        service_s=args.service_s,
        resubmit_s=args.resubmit_s,
        hold_results=not args.no_hold_results,
        confirm_results=args.confirm_results,
        cancel_every=args.cancel_every,
        abort_s=args.abort_s,
    )
    if args.degrade:
        run.faults = ()
        run.crash_at_s = 0.5 * args.tasks / (run.load * run.nodes * run.slots / run.service_s)
    if args.trace:
        print("\n".join(trace_for(run, args.trace)))
        return 0
    report = run_fanout(run)
    world = report.pop("_world")
    if args.degrade:
        from simulations.fanout import degradation

        report["degradation"] = degradation(world, run.crash_at_s)  # type: ignore[arg-type]
    report["wall_s"] = round(time.monotonic() - started, 1)
    if report["invariant_violations"] or report["lost"]:
        show(
            f"INVARIANT BROKEN: replay with --seed {args.seed}; --trace TASK_ID prints a task's events"
        )
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 1 if report["invariant_violations"] or report["lost"] else 0
