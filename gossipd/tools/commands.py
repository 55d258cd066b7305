"""What each `gossipd` subcommand does: the cmd_* functions that cli.py's parser dispatches
to (config loading, the event loop, CURVE keys for producers), each importing its tool lazily."""

from __future__ import annotations

import argparse
import sys

from gossipd.config import Config, load_config
from gossipd.errors import StartupError

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


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
    import faulthandler
    import socket

    from gossipd.config import node_id
    from gossipd.daemon import Daemon
    from gossipd.ops.logs import setup_logging
    from gossipd.ops.memory import return_large_buffers

    config = _config_from(args)
    return_large_buffers()  # freed prompts and frames go back to the OS (ops/memory.py)
    # A fatal signal (SIGBUS from an I/O error under the mapped journal, SIGSEGV in an
    # extension) prints every thread's Python stack to stderr (the journal of systemd), not
    # nothing: the process ends as it would, systemd restarts it.
    faulthandler.enable()
    daemon_holder: list[Daemon] = []

    async def main() -> int:
        # Before the daemon is built: its constructor's warnings (SCHED_BATCH, the open-files
        # limit) are log lines as OPERATIONS.md says, not Python's bare last-resort text.
        node = node_id(config, socket.gethostname())
        setup_logging(level=config.log.level, fmt=config.log.format, node=node)
        daemon = Daemon(config)
        daemon_holder.append(daemon)
        return await daemon.run()

    return _run_loop(main())


def cmd_check_config(args: argparse.Namespace) -> int:
    """Print the configuration resolved, after the checks `gossipd run` makes before it binds
    (ops/preflight.py): exit 2 wherever `run` would."""
    import socket

    import msgspec

    from gossipd.config import node_id, resolved
    from gossipd.ops import preflight

    config = _config_from(args)
    try:
        preflight.check(config, node_id(config, socket.gethostname()))
    except StartupError as exc:
        print(f"gossipd check-config: `gossipd run` would refuse it: {exc}", file=sys.stderr)
        return 2
    print(msgspec.json.format(msgspec.json.encode(resolved(config))).decode())
    return 0


def _producer_keys(args: argparse.Namespace, endpoints: list[str] | None) -> object:
    """--secret-key and --server-key (or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY): CURVE."""
    from gossipd.tools.producer_opts import producer_keys

    return producer_keys(args, endpoints)


def _reply_bind(args: argparse.Namespace, endpoints: list[str] = []) -> str:  # noqa: B006
    """--reply-bind (or GOSSIPD_REPLY_BIND), checked (a warning when the daemons asked may
    not reach it)."""
    from gossipd.tools.producer_opts import reply_bind

    return reply_bind(args, endpoints)


def cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gossipd.security import key_name_problem, write_key_pair

    names = args.name
    for problem in filter(None, map(key_name_problem, names)):  # (before any is written)
        print(f"gossipd keygen: {problem}", file=sys.stderr)
        return 2
    clash = [
        str(path)
        for name in names
        for path in (Path(args.out) / f"{name}.key", Path(args.out) / f"{name}.key_secret")
        if path.exists()
    ]
    if clash or len(set(names)) != len(names):
        why = f"{', '.join(clash)} already exists" if clash else "a name is given twice"
        print(f"gossipd keygen: {why}; remove them first to replace keys", file=sys.stderr)
        return 2
    for name in names:
        try:
            public, secret = write_key_pair(name, args.out)
        except (OSError, ValueError) as exc:
            print(f"gossipd keygen: {exc}", file=sys.stderr)
            return 2
        print(f"public key (distribute): {public}\nsecret key (keep, mode 0600): {secret}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    import zmq

    from gossipd.core.messages import endpoint_problem
    from gossipd.tools import submit
    from gossipd.tools.client import NotConnected

    endpoints = args.endpoint or [DEFAULT_ENDPOINT]
    for endpoint in endpoints:  # (ZeroMQ's refusal was reported as the reply address's)
        if (problem := endpoint_problem(endpoint)) is not None:
            print(f"gossipd submit: --endpoint {endpoint!r}: {problem}", file=sys.stderr)
            return 2
    connect_timeout_s = args.connect_timeout or None
    curve = _producer_keys(args, endpoints)
    reply_bind = _reply_bind(args, endpoints)
    try:
        if args.file:
            return _submit_file(args, endpoints, connect_timeout_s, curve, reply_bind)
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
                reply_bind=reply_bind,
            )
        )
    except NotConnected as exc:
        print(f"gossipd submit: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:  # binding the reply address
        print(
            f"gossipd submit: cannot bind the reply address {reply_bind}: {exc.strerror} "
            "(--reply-bind: an address of this host)",
            file=sys.stderr,
        )
        return 2


def _submit_file(
    args: argparse.Namespace,
    endpoints: list[str],
    connect_timeout_s: float | None,
    curve: object,
    reply_bind: str,
) -> int:
    from gossipd.tools import submit

    try:
        total = submit.count_task_lines(args.file)
        tasks_file = args.file.open("rb")  # (a pipe: waits for its writer, then streams)
    except OSError as exc:
        print(f"gossipd submit: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        out = submit.ResultWriter(args.out) if args.out else None
    except OSError as exc:
        tasks_file.close()
        print(f"gossipd submit: cannot write --out {args.out}: {exc.strerror}", file=sys.stderr)
        return 2

    async def many() -> int:
        report = await submit.submit_many(
            endpoints,
            submit.read_task_lines(tasks_file, args.file),
            total=total,
            resubmit_after_s=args.resubmit_after,
            window=args.window,
            show_progress=not args.no_progress,
            connect_timeout_s=connect_timeout_s,
            out=out,
            curve=curve,  # type: ignore[arg-type]
            pack_tasks=not args.no_pack,
            reply_bind=reply_bind,
        )
        submit.print_report(report, as_json=args.json)
        return 0 if report.ok == report.total else 1

    try:
        return _run_loop(many())
    finally:
        tasks_file.close()
        if out is not None:
            out.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from gossipd.tools.demo import run_demo

    return run_demo(tasks=args.tasks)


def cmd_status(args: argparse.Namespace) -> int:
    from gossipd.tools.admin import status_main
    from gossipd.tools.producer_opts import member_key_finder

    return status_main(
        args.endpoint,
        watch=args.watch,
        as_json=args.json,
        interval_s=args.interval,
        timeout_s=args.timeout,
        reply_bind=_reply_bind(args, [args.endpoint]),
        curve=_producer_keys(args, [args.endpoint]),  # type: ignore[arg-type]
        member_key=member_key_finder(args),
    )


def cmd_drain(args: argparse.Namespace) -> int:
    from gossipd.tools.admin import drain_main

    return drain_main(
        args.endpoint,
        args.node,
        drain_it=args.command == "drain",
        timeout_s=args.timeout,
        reply_bind=_reply_bind(args, [args.endpoint]),
        curve=_producer_keys(args, [args.endpoint]),  # type: ignore[arg-type]
    )


def cmd_cluster_drain(args: argparse.Namespace) -> int:
    from gossipd.tools.cluster import drain_main

    _reply_bind(args)  # checked like every producer-side command's; the plan goes by etcd
    _producer_keys(args, None)
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
    if args.peers and args.what not in ("membership", "http"):
        print("gossipd bench: --peers is for membership and http", file=sys.stderr)
        return 2
    if args.what == "http":
        from gossipd.tools.bench.http import main as bench_http
        from gossipd.tools.bench.http_peers import default_router_venv

        if args.peers == "serf":
            print("gossipd bench http: --peers takes routers, vllm-router or sglang-router "
                  "(alone: all of them)", file=sys.stderr)  # fmt: skip
            return 2
        return bench_http(
            peers=args.peers,
            rounds=args.repeats,
            seconds=args.seconds or 3.0,
            concurrency=args.concurrency or [1, 16, 64],
            router_venv=args.router_venv or default_router_venv(),
            as_json=args.json,
            plot_path=args.plot,
        )
    if args.what == "membership":
        from gossipd.tools.bench.membership import main as bench_membership

        if args.peers not in ("", "all", "serf"):
            print("gossipd bench membership: --peers takes serf", file=sys.stderr)
            return 2

        if isinstance(args.nodes, list):
            print("gossipd bench membership: --nodes takes one count (16)", file=sys.stderr)
            return 2
        return bench_membership(
            nodes=args.nodes or 16,
            peers="serf" if args.peers else "",
            idle_s=args.idle_s,
            crashes=args.crashes,
            as_json=args.json,
        )
    if args.what == "openai":
        from gossipd.tools.bench.openai import main as bench_openai

        if args.concurrency is not None and len(args.concurrency) > 1:
            print("gossipd bench openai: --concurrency takes one count", file=sys.stderr)
            return 2

        return bench_openai(
            model=args.model,
            variants=[v for v in args.variants.split(",") if v],
            rounds=args.repeats,
            prompts=args.tasks or 64,
            concurrency=(args.concurrency or [8])[0],
            as_json=args.json,
        )
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
            rate=args.rate,
            seconds=args.seconds or 4.0,
            stall_ms=args.stall_ms,
            as_json=args.json,
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
            seconds=args.seconds or 4.0,
            compare_off=args.compare_off,
            as_json=args.json,
        )
    raise AssertionError(args.what)


def cmd_systemd_render(args: argparse.Namespace) -> int:
    from gossipd.ops.systemd import RenderError
    from gossipd.ops.systemd_node import render_node

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
