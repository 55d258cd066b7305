"""The `gossipd` command: run a daemon or a local cluster, see and steer a cluster, submit
tasks, run the demo and the benchmarks."""

# This module: the argument tree (build_parser) and main, the entry point; what each
# subcommand does is in commands.py. The docstring above is `gossipd --help`'s description.

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gossipd.errors import ConfigError, StartupError
from gossipd.tools.commands import (
    DEFAULT_ENDPOINT,
    cmd_bench,
    cmd_check_config,
    cmd_cluster_drain,
    cmd_demo,
    cmd_drain,
    cmd_keygen,
    cmd_model,
    cmd_reference,
    cmd_run,
    cmd_status,
    cmd_submit,
    cmd_systemd_render,
    cmd_up,
)
from gossipd.tools.producer_opts import add_producer_args


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


def _nodes(text: str) -> int | list[int]:
    """--nodes: one count, or several comma-separated (bench place)."""
    counts = [int(part) for part in text.split(",")]
    return counts[0] if len(counts) == 1 else counts


def _counts(text: str) -> list[int]:
    """--concurrency: positive counts, comma-separated."""
    counts = [int(part) for part in text.split(",")]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive counts, found {text!r}")
    return counts


def _at_least_1(text: str) -> int:
    """--window: a count of 1 or more (0 let no task go, and no deadline ever fired)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, found {value}")
    return value


def _seconds_above_0(text: str) -> float:
    """--resubmit-after: seconds above 0 (0 resent every task at every loop turn)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, found {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, found {text}")
    return value


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
    add_producer_args(p, per_endpoint=False)
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
        add_producer_args(p, per_endpoint=False)
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
    # Checked, and unused by the plan itself (it goes through etcd): one set of producer
    # options and variables serves every producer-side command.
    add_producer_args(p, per_endpoint=False)
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
    p.add_argument(
        "--window", type=_at_least_1, default=1000, help="tasks outstanding at once (--file)"
    )
    p.add_argument(
        "--resubmit-after",
        type=_seconds_above_0,
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
    add_producer_args(p)  # --reply-bind, --secret-key, --server-key
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "demo", help="start a daemon on the embedded default, push tasks through it, stop it"
    )
    p.add_argument("--tasks", type=int, default=2000, help="tasks to push (default 2000)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "keygen", help="write CURVE key pairs: NAME.key and NAME.key_secret for each NAME"
    )
    p.add_argument(
        "name",
        nargs="+",
        help="node ids (one per instance: HOST-gpu0 HOST-gpu1 ...) or any names (producers)",
    )
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
        choices=[
            "ingress",
            "route",
            "ring",
            "engine",
            "prefix",
            "hedge",
            "budgets",
            "place",
            "membership",
            "http",
            "openai",
        ],
        help="ingress: one daemon vs raw pyzmq; route: the cost of a forward hop; ring: "
        "placement balance and churn; place: placement's cost per task as N grows; engine: the daemon's overhead on vLLM; prefix: "
        "prefix-cache hit rate by placement policy (six fresh 3-daemon vLLM clusters: many "
        "minutes on 2 cores); hedge: a stalled member, hedging off/on; budgets: a well-behaved "
        "producer's latency alone and beside a runaway at 10x its token budget; membership: "
        "idle CPU, wake-ups and RSS per daemon, crash detection (--peers serf: beside Serf); "
        "http: the OpenAI-compatible door (2 daemons) against a stub engine alone, with "
        "--peers beside vllm-router and sglang-router (wrk, Linux); "
        "openai: vLLM's own benchmark client against `vllm serve`, one and two daemons with "
        "the vLLM engine behind their HTTP doors (same model and load, interleaved rounds)",
    )
    p.add_argument(
        "--peers",
        nargs="?",
        const="all",
        choices=["all", "serf", "routers", "vllm-router", "sglang-router"],
        default="",
        help="the same figures for other software in the same run; alone (or 'all'): every "
        "peer of the benchmark.  membership: 'serf', as many HashiCorp Serf agents (Debian "
        "package serf).  http: 'routers' (= all), or one of 'vllm-router' (round_robin and "
        "consistent_hash) and 'sglang-router' (round_robin), from PyPI, in --router-venv",
    )
    p.add_argument(
        "--router-venv",
        type=Path,
        default=None,
        help="http: the venv holding vllm-router and sglang-router (default: "
        "$GOSSIPD_ROUTER_VENV, else ~/.cache/gossipd/routers-venv); make it with "
        "'python3 -m venv DIR && DIR/bin/pip install vllm-router sglang-router', never in "
        "gossipd's own venv (their dependencies conflict)",
    )
    p.add_argument(
        "--concurrency",
        type=_counts,
        default=None,
        help="http: connections, comma-separated (default 1,16,64); openai: requests in "
        "flight, one count (default 8)",
    )
    p.add_argument(
        "--idle-s", type=float, default=20.0, help="membership: the idle window (default 20)"
    )
    p.add_argument(
        "--crashes", type=int, default=3, help="membership: SIGKILLs on each side (default 3)"
    )
    p.add_argument("--model", help="engine/prefix: a model directory (default: make the tiny one)")
    p.add_argument("--max-tokens", type=int, default=16, help="engine: tokens per request")
    p.add_argument(
        "--plot",
        help="prefix: a PNG bar chart of the hit rates; route: a PNG of the latency CDFs; "
        "http: a PNG of req/s by concurrency per variant",
    )
    p.add_argument("--keys", type=int, default=1_000_000, help="ring: keys to place")
    p.add_argument(
        "--nodes",
        type=_nodes,
        default=None,
        help="route, prefix: daemons (3); ring: members (64); membership: daemons and Serf "
        "agents (16); place: member counts, comma-separated (64,1000,10000)",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="ingress, route: tasks per run (default 20000; with --curve, ingress 60000 and "
        "route 60000 per throughput run, so that each run lasts about a second)",
    )
    p.add_argument(
        "--variants",
        default="vllm-serve,gossipd,gossipd-2",
        help="openai: the servers to measure, comma-separated (default %(default)s)",
    )
    p.add_argument("--rate", type=float, default=300.0, help="hedge: tasks per second")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="hedge: how long to send (4); budgets: per phase (4); http: per window, whole "
        "seconds (3)",
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
        "more on a shared machine); engine, budgets, http: rounds (default 3)",
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
        status = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is caught below, not at exit
        return status
    except BrokenPipeError:
        # Read by `| head` that has stopped: end quietly, as other tools do (128 + SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
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
