"""The `gossipd` command: run a daemon or a local cluster, see and steer a cluster, submit
tasks, run the demo and the benchmarks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gossipd.config import Config, load_config
from gossipd.errors import ConfigError, StartupError

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, help="TOML file (default: the embedded default)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable); GOSSIPD_SECTION__KEY=VALUE works too",
    )
    p.add_argument("--bind", help="shorthand for --set ingress.bind=ENDPOINT")
    p.add_argument("--metrics", help="shorthand for --set metrics.bind=HOST:PORT")


def _config_from(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.bind:
        overrides.append(f"ingress.bind={args.bind}")
    if args.metrics:
        overrides.append(f"metrics.bind={args.metrics}")
    return load_config(args.config, overrides=overrides)


def _run_loop(coro: object) -> int:
    import uvloop

    return uvloop.run(coro)  # type: ignore[arg-type]


def cmd_run(args: argparse.Namespace) -> int:
    from gossipd.daemon import Daemon
    from gossipd.ops.logs import setup_logging
    from gossipd.ops.memory import return_large_buffers

    config = _config_from(args)
    return_large_buffers()  # freed prompts and frames go back to the OS (ops/memory.py)
    daemon_holder: list[Daemon] = []

    async def main() -> int:
        daemon = Daemon(config)
        daemon_holder.append(daemon)
        setup_logging(level=config.log.level, fmt=config.log.format, node=daemon.node)
        return await daemon.run()

    return _run_loop(main())


def cmd_check_config(args: argparse.Namespace) -> int:
    import msgspec

    from gossipd.config import resolved

    config = _config_from(args)
    print(msgspec.json.format(msgspec.json.encode(resolved(config))).decode())
    return 0


def _producer_keys(args: argparse.Namespace, endpoints: list[str]) -> object:
    """--secret-key and --server-key (or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY): CURVE."""
    import os

    from gossipd.tools.client import ProducerKeys

    secret = args.secret_key or os.environ.get("GOSSIPD_SECRET_KEY", "")
    servers = args.server_key or [
        p for p in os.environ.get("GOSSIPD_SERVER_KEY", "").split(",") if p
    ]
    if not secret and not servers:
        return None
    if not secret or not servers:
        raise StartupError("CURVE needs both --secret-key FILE and --server-key FILE")
    if len(servers) not in (1, len(endpoints)):
        raise StartupError(
            f"give --server-key once (all daemons) or once per --endpoint ({len(endpoints)})"
        )
    try:
        return ProducerKeys.from_files(secret, servers)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read a key file: {exc}") from None


def cmd_keygen(args: argparse.Namespace) -> int:
    from gossipd.security import write_key_pair

    try:
        public, secret = write_key_pair(args.name, args.out)
    except FileExistsError as exc:
        print(f"gossipd keygen: {exc}", file=sys.stderr)
        return 2
    print(f"public key (distribute): {public}\nsecret key (keep, mode 0600): {secret}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from gossipd.tools import submit
    from gossipd.tools.client import NotConnected

    endpoints = args.endpoint or [DEFAULT_ENDPOINT]
    connect_timeout_s = args.connect_timeout or None
    curve = _producer_keys(args, endpoints)
    try:
        if args.file:
            return _submit_file(args, endpoints, connect_timeout_s, curve)
        if args.prompt is None:
            print("gossipd submit: give a PROMPT or --file FILE", file=sys.stderr)
            return 2
        return _run_loop(
            submit.submit_one(
                endpoints,
                args.prompt,
                max_tokens=args.max_tokens,
                timeout_s=args.timeout,
                stream=args.stream,
                key=args.key,
                as_json=args.json,
                connect_timeout_s=connect_timeout_s,
                curve=curve,  # type: ignore[arg-type]
            )
        )
    except NotConnected as exc:
        print(f"gossipd submit: {exc}", file=sys.stderr)
        return 1


def _submit_file(
    args: argparse.Namespace,
    endpoints: list[str],
    connect_timeout_s: float | None,
    curve: object = None,
) -> int:
    from gossipd.tools import submit

    numbered = submit.read_numbered_task_lines(args.file)
    out = submit.ResultWriter(args.out) if args.out else None

    async def many() -> int:
        report = await submit.submit_many(
            endpoints,
            [line for _, line in numbered],
            numbers=[n for n, _ in numbered],
            resubmit_after_s=args.resubmit_after,
            window=args.window,
            show_progress=not args.no_progress,
            connect_timeout_s=connect_timeout_s,
            out=out,
            curve=curve,  # type: ignore[arg-type]
            pack_tasks=not args.no_pack,
        )
        submit.print_report(report, as_json=args.json)
        return 0 if report.ok == report.total else 1

    try:
        return _run_loop(many())
    finally:
        if out is not None:
            out.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from gossipd.tools.demo import run_demo

    return run_demo(tasks=args.tasks)


def cmd_status(args: argparse.Namespace) -> int:
    from gossipd.tools.admin import status_main

    return status_main(
        args.endpoint,
        watch=args.watch,
        as_json=args.json,
        interval_s=args.interval,
        timeout_s=args.timeout,
    )


def cmd_drain(args: argparse.Namespace) -> int:
    from gossipd.tools.admin import drain_main

    return drain_main(
        args.endpoint, args.node, drain_it=args.command == "drain", timeout_s=args.timeout
    )


def cmd_cluster_drain(args: argparse.Namespace) -> int:
    from gossipd.tools.cluster import drain_main

    config = _config_from(args)
    endpoints = [e for e in (args.etcd or "").split(",") if e]
    return drain_main(args, config.etcd, endpoints, args.cluster or config.node.cluster)


def cmd_up(args: argparse.Namespace) -> int:
    from gossipd.tools.up import UpOptions, run_up

    return run_up(
        UpOptions(
            nodes=args.nodes,
            demo=args.demo,
            as_json=args.json,
            engine=args.engine,
            model=args.model,
            tasks=args.tasks,
            log_dir=args.log_dir,
            etcd=[e for e in args.etcd.split(",") if e] if args.etcd else None,
        )
    )


def cmd_model(args: argparse.Namespace) -> int:
    from gossipd.tools.tinymodel import make_tiny

    out = make_tiny(args.directory, seed=args.seed)
    print(f"wrote a tiny Llama (seed {args.seed}) to {out}")
    return 0


def _nodes(text: str) -> int | list[int]:
    """--nodes: one count, or several comma-separated (bench place)."""
    counts = [int(part) for part in text.split(",")]
    return counts[0] if len(counts) == 1 else counts


def cmd_bench(args: argparse.Namespace) -> int:
    if args.repeats is None:
        args.repeats = 5 if args.curve else 3
    if args.curve and (args.batch_replies or args.batch_tasks):
        print(
            "gossipd bench: --curve measures its producers itself (see --producer); "
            "--batch-replies and --batch-tasks are for runs without --curve",
            file=sys.stderr,
        )
        return 2
    if args.producer is not None and not args.curve:
        print(
            "gossipd bench: --producer chooses what --curve measures: add --curve", file=sys.stderr
        )
        return 2
    if args.what == "place":
        from gossipd.tools.bench.place import main as bench_place

        nodes = args.nodes if isinstance(args.nodes, list) or args.nodes is None else [args.nodes]
        return bench_place(nodes=nodes, as_json=args.json)
    if args.what == "ring":
        from gossipd.tools.bench.ring import main as bench_ring

        return bench_ring(keys=args.keys, nodes=args.nodes or 64, as_json=args.json)
    if args.what == "route":
        from gossipd.tools.bench.route import main as bench_route

        return bench_route(
            nodes=args.nodes or 3,
            tasks=min(args.tasks or 20_000, 5000),
            throughput_tasks=60_000 if args.curve and args.tasks is None else 0,
            repeats=args.repeats,
            as_json=args.json,
            plot=args.plot,
            curve=args.curve,
            batch_replies=args.batch_replies,
            batch_tasks=args.batch_tasks,
            producer=args.producer or "both",
        )
    if args.what == "engine":
        from gossipd.tools.bench.engine import main as bench_engine

        return bench_engine(
            model=args.model, rounds=args.repeats, max_tokens=args.max_tokens, as_json=args.json
        )
    if args.what == "prefix":
        from gossipd.tools.bench.prefix import main as bench_prefix

        return bench_prefix(
            model=args.model, nodes=args.nodes or 3, as_json=args.json, plot=args.plot
        )
    if args.what == "hedge":
        from gossipd.tools.bench.hedge import main as bench_hedge

        return bench_hedge(
            rate=args.rate, seconds=args.seconds, stall_ms=args.stall_ms, as_json=args.json
        )
    if args.what == "ingress":
        from gossipd.tools.bench.ingress import main as bench_ingress

        return bench_ingress(
            tasks=args.tasks or (60_000 if args.curve else 20_000),
            window=args.window,
            repeats=args.repeats,
            as_json=args.json,
            curve=args.curve,
            batch_replies=args.batch_replies,
            batch_tasks=args.batch_tasks,
            producer=args.producer or "both",
        )
    if args.what == "budgets":
        from gossipd.tools.bench.budgets import main as bench_budgets

        return bench_budgets(
            nodes=args.nodes or 2,
            rounds=args.repeats,
            seconds=args.seconds,
            compare_off=args.compare_off,
            as_json=args.json,
        )
    raise AssertionError(args.what)


def cmd_systemd_render(args: argparse.Namespace) -> int:
    from gossipd.ops.systemd import RenderError, render_node

    try:
        summary = render_node(
            out_dir=args.out,
            gpus_spec=args.gpus,
            sysfs_root=args.sysfs,
            config_path=args.config,
            bin_path=args.bin,
            port_stride=args.port_stride,
            state_root=args.state_root,
        )
    except RenderError as exc:
        print(f"gossipd systemd render: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from gossipd.tools.reference import render

    text = render(args.what)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gossipd import __version__

    parser = argparse.ArgumentParser(prog="gossipd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gossipd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from gossipd.tools.up import DEFAULT_NODES, DEFAULT_TASKS

    p = sub.add_parser(
        "up",
        help="a local cluster: N daemons on loopback (one per GPU), a live status view; "
        "--demo drives it end to end",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=DEFAULT_NODES,
        help=f"daemons to start (default {DEFAULT_NODES})",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="stream prompts, send keyed tasks, SIGKILL one daemon halfway and restart it, "
        "print a summary, stop everything",
    )
    p.add_argument("--json", action="store_true", help="--demo: print the summary as JSON")
    p.add_argument(
        "--engine",
        choices=["auto", "vllm", "echo"],
        default="auto",
        help="auto (default): vLLM when installed, else the echo engine",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=Path("models/tiny"),
        help="vLLM model directory (default models/tiny, made if missing)",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=DEFAULT_TASKS,
        help=f"--demo: keyed tasks (default {DEFAULT_TASKS})",
    )
    p.add_argument("--log-dir", type=Path, help="daemon logs and journals (default: a temp dir)")
    p.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...]",
        help="elect a leader through this etcd cluster (default: election off)",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "status",
        help="members, state, load, model, draining, checksum agreement, as any daemon sees them",
    )
    p.add_argument(
        "--endpoint",
        "-e",
        default=DEFAULT_ENDPOINT,
        help=f"any daemon's ingress (default {DEFAULT_ENDPOINT})",
    )
    p.add_argument("--watch", "-w", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between looks")
    p.add_argument("--json", action="store_true", help="print JSON (one object per look)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for answers")
    p.set_defaults(func=cmd_status)

    for verb, what in (
        ("drain", "new tasks go to other members, queued ones are handed off; it keeps running"),
        ("undrain", "back to serving after a drain"),
    ):
        p = sub.add_parser(verb, help=f"{verb} a member: {what}")
        p.add_argument("node", help="the member's node id (as gossipd status shows it)")
        p.add_argument(
            "--endpoint",
            "-e",
            default=DEFAULT_ENDPOINT,
            help=f"any daemon's ingress; it relays to NODE (default {DEFAULT_ENDPOINT})",
        )
        p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
        p.set_defaults(func=cmd_drain)

    p = sub.add_parser("cluster", help="cluster-wide operations carried out by the leader (etcd)")
    cluster_sub = p.add_subparsers(dest="cluster_command", required=True)
    p = cluster_sub.add_parser(
        "drain",
        help="drain members one at a time (NODE...: each then leaves; --rolling: every member "
        "is drained, restarted and back serving before the next: the upgrade path)",
    )
    p.add_argument("nodes", nargs="*", metavar="NODE", help="members to drain, in this order")
    p.add_argument(
        "--rolling", action="store_true", help="every live member in turn, the leader last"
    )
    p.add_argument(
        "--follow", action="store_true", help="write nothing: show the plan in hand until it ends"
    )
    p.add_argument(
        "--cancel", action="store_true", help="drop the plan in hand (nothing is undone)"
    )
    p.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...]",
        help="etcd endpoints (default: etcd.endpoints of the configuration)",
    )
    p.add_argument("--cluster", help="cluster name (default: node.cluster of the configuration)")
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds a member may take to leave, or to come back serving, before the plan "
        "fails (default 300)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="stop following after this many seconds (the plan goes on; default 0: until it ends)",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_cluster_drain)

    p = sub.add_parser("run", help="run one daemon in the foreground")
    _add_config_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check-config", help="validate a configuration and print it resolved")
    _add_config_args(p)
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser(
        "submit",
        help="submit one prompt or a JSONL file of tasks",
        description="Submit one prompt, or a JSONL file of tasks (one JSON object a line: "
        '{"prompt": ..., "id"?, "key"?, "params"?, "stream"?, "timeout_ms"?, "model"?}; '
        "README.md, 'Submitting a file of tasks').",
    )
    p.add_argument("prompt", nargs="?", help="the prompt (or give --file)")
    p.add_argument(
        "--endpoint",
        "-e",
        action="append",
        help=f"daemon ingress (default {DEFAULT_ENDPOINT}); repeatable",
    )
    p.add_argument("--file", "-f", type=Path, help="JSONL file, one task per line")
    p.add_argument(
        "--out",
        "-o",
        type=Path,
        help="--file: write every Result to this file, one JSON object per line (with "
        "'line', its task's line number)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--timeout", type=float, default=30.0, help="task deadline in seconds")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--key", default="", help="placement key (sessions keep one key)")
    p.add_argument("--window", type=int, default=1000, help="tasks outstanding at once (--file)")
    p.add_argument(
        "--resubmit-after",
        type=float,
        default=5.0,
        help="resend an unanswered task after S seconds",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=1.5,
        metavar="S",
        help="fail when no daemon accepts a connection within S seconds (default 1.5; "
        "0: wait for one as long as the tasks' deadlines allow)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true", help="--file: no progress lines")
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="--file: send one frame per task, not several tasks in one Tasks frame "
        "(the default; it falls back by itself for a daemon older than Tasks frames)",
    )
    p.add_argument(
        "--secret-key",
        default="",
        help="CURVE: this producer's NAME.key_secret (gossipd keygen); env GOSSIPD_SECRET_KEY",
    )
    p.add_argument(
        "--server-key",
        action="append",
        default=[],
        help="CURVE: a daemon's NODE.key, once for all or once per --endpoint in order; "
        "env GOSSIPD_SERVER_KEY (comma-separated)",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "demo", help="start a daemon on the embedded default, push tasks through it, stop it"
    )
    p.add_argument("--tasks", type=int, default=2000, help="tasks to push (default 2000)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("keygen", help="write a CURVE key pair: NAME.key and NAME.key_secret")
    p.add_argument("name", help="a node id (peers) or any name (producers)")
    p.add_argument("--out", type=Path, default=Path("."), help="directory (default: here)")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("model", help="make the small model that tests and benchmarks use")
    model_sub = p.add_subparsers(dest="model_command", required=True)
    p = model_sub.add_parser(
        "make-tiny", help="write a tokenizer and a seeded random 2-layer Llama (HF format)"
    )
    p.add_argument("directory", type=Path, help="where to write the model (made if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("systemd", help="systemd units for this node (one daemon per GPU)")
    systemd_sub = p.add_subparsers(dest="systemd_command", required=True)
    p = systemd_sub.add_parser(
        "render",
        help="write the units, each instance's settings and NUMA binding for this node's GPUs",
        description="Write gossipd@.service, gossipd.target, and for each GPU N its settings "
        "(etc/gossipd/N.env: ports = gossipd.toml's + N x --port-stride) and its CPU/NUMA "
        "binding (gossipd@N.service.d/numa.conf), laid out under OUT as under / "
        "(docs/OPERATIONS.md).",
    )
    p.add_argument("--gpus", help="GPU indices, e.g. 0-7 or 0,2,4 (default: every GPU found)")
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument(
        "--config",
        type=Path,
        default=Path("/etc/gossipd/gossipd.toml"),
        help="the node's configuration, read now and by every instance (default %(default)s)",
    )
    p.add_argument(
        "--sysfs",
        type=Path,
        default=Path("/sys"),
        help="sysfs root to read the GPUs from (default /sys, and NVML first; another root, "
        "e.g. a fake tree for tests, skips NVML)",
    )
    p.add_argument(
        "--bin",
        default="/opt/gossipd/bin/gossipd",
        help="the gossipd executable the units run (default %(default)s)",
    )
    p.add_argument(
        "--port-stride",
        type=int,
        default=10,
        help="instance N listens on each port of the config + N x this (default %(default)s)",
    )
    p.add_argument(
        "--state-root",
        default="/var/lib/gossipd",
        help="where each instance's journal goes, STATE_ROOT/N/journal (default %(default)s, "
        "the units' StateDirectory; change it only to run instances by hand)",
    )
    p.set_defaults(func=cmd_systemd_render)

    p = sub.add_parser(
        "bench", help="benchmarks (figures against a baseline measured in the same run)"
    )
    p.add_argument(
        "what",
        choices=["ingress", "route", "ring", "engine", "prefix", "hedge", "budgets", "place"],
        help="ingress: one daemon vs raw pyzmq; route: the cost of a forward hop; ring: "
        "placement balance and churn; place: placement's cost per task as N grows; engine: the daemon's overhead on vLLM; prefix: "
        "prefix-cache hit rate by placement policy (six fresh 3-daemon vLLM clusters: many "
        "minutes on 2 cores); hedge: a stalled member, hedging off/on; budgets: a well-behaved "
        "producer's latency alone and beside a runaway at 10x its token budget",
    )
    p.add_argument("--model", help="engine/prefix: a model directory (default: make the tiny one)")
    p.add_argument("--max-tokens", type=int, default=16, help="engine: tokens per request")
    p.add_argument(
        "--plot",
        help="prefix: a PNG bar chart of the hit rates; route: a PNG of the latency CDFs",
    )
    p.add_argument("--keys", type=int, default=1_000_000, help="ring: keys to place")
    p.add_argument(
        "--nodes",
        type=_nodes,
        default=None,
        help="route, prefix: daemons (3); ring: members (64); place: member counts, "
        "comma-separated (64,1000,10000)",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="ingress, route: tasks per run (default 20000; with --curve, ingress 60000 and "
        "route 60000 per throughput run, so that each run lasts about a second)",
    )
    p.add_argument("--rate", type=float, default=300.0, help="hedge: tasks per second")
    p.add_argument(
        "--seconds", type=float, default=4.0, help="hedge: how long to send; budgets: per phase"
    )
    p.add_argument(
        "--compare-off",
        action="store_true",
        help="budgets: one more round on a cluster with budgets off (what they prevent)",
    )
    p.add_argument("--stall-ms", type=int, default=1000, help="hedge: how long a member stops")
    p.add_argument(
        "--window", type=int, default=500, help="ingress: tasks outstanding at once (default 500)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="ingress, route: runs of each side (default 3; 5 with --curve, whose ratios swing "
        "more on a shared machine); engine, budgets: rounds (default 3)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON (progress goes to stderr)"
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="ingress/route: the same with and without CurveZMQ (ratio_curve_vs_plain)",
    )
    p.add_argument(
        "--producer",
        choices=["both", "client", "frame-per-task"],
        default=None,
        help="ingress/route --curve: the producers to measure: one that packs as gossipd's "
        "Client does (Tasks and Replies frames; the headline ratio) and one that sends a frame "
        "per task each way (default: both, side by side)",
    )
    p.add_argument(
        "--batch-replies",
        action="store_true",
        help="ingress/route without --curve: the generator's tasks ask for Replies frames "
        "(batch_replies: several results in one frame; not to the raw server)",
    )
    p.add_argument(
        "--batch-tasks",
        action="store_true",
        help="ingress/route without --curve: the generator sends each refill of its window as "
        "Tasks frames (several tasks in one frame; not to the raw server)",
    )
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "reference",
        help="print a reference document generated from the code (docs/CONFIG.md, METRICS.md)",
    )
    p.add_argument(
        "what",
        choices=["config", "metrics"],
        help="config: every key with its type, default and bound; metrics: every metric",
    )
    p.add_argument("--out", "-o", type=Path, help="write it to this file instead of stdout")
    p.set_defaults(func=cmd_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"gossipd: configuration error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"gossipd: cannot start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
