"""`gossipd cluster drain`: hand the leader a drain plan through etcd and follow it.

    gossipd cluster drain NODE...      drain those members one at a time; each leaves
    gossipd cluster drain --rolling    every member in turn: drain, restart, back serving
    gossipd cluster drain --follow     show the plan in hand until it ends
    gossipd cluster drain --cancel     drop the plan (the member in hand stays as it is)

The plan goes to ``/gossipd/<cluster>/drain/plan`` (JSON, core/rollout.py ``Plan``); the
leader's duty (gossipd/leader/rollout.py) carries it out and keeps its progress in
``/gossipd/<cluster>/drain/progress``, which this command reads every ``POLL_S``, printing
each change.  Exit 0 when the plan is done, 1 when it failed or could not be handed over.
etcd endpoints come from ``--etcd`` or the configuration's ``etcd.endpoints``.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gossipd.config import EtcdConfig
from gossipd.core import rollout
from gossipd.core.rollout import Plan
from gossipd.errors import StartupError
from gossipd.leader.rollout import plan_key, progress_key, read_plan

POLL_S = 0.5
NO_LEADER_HINT_S = 10.0  # no progress after this long: say what may be wrong


class ClusterError(Exception):
    """The command cannot go on; the message says what to do."""


def cluster_prefix(cluster: str) -> str:
    return f"/gossipd/{cluster}"


def etcd_settings(base: EtcdConfig, endpoints: Sequence[str]) -> EtcdConfig:
    """The configuration's etcd section (TLS files, timeouts) with ``endpoints`` ("HOST:PORT"
    or "http://HOST:PORT") instead of its own, when given."""
    if not endpoints:
        endpoints = base.endpoints
    if not endpoints:
        raise ClusterError(
            "no etcd endpoints: pass --etcd HOST:PORT[,HOST:PORT...] or set etcd.endpoints"
        )
    plain = [e.split("://", 1)[-1].rstrip("/") for e in endpoints]
    try:
        return msgspec.convert(
            {**msgspec.to_builtins(base), "endpoints": plain}, EtcdConfig, strict=False
        )
    except msgspec.ValidationError as exc:
        raise ClusterError(f"etcd endpoints {list(endpoints)}: {exc}") from None


async def connect(settings: EtcdConfig) -> Any:
    """The daemons' etcd client (several endpoints, TLS) on these settings, checked with one
    request."""
    from gossipd.leader.client import EtcdClient, unavailable

    try:
        client = EtcdClient(settings)
    except StartupError as exc:
        raise ClusterError(str(exc)) from None
    left = len(settings.endpoints)  # each endpoint tried once, at most
    while True:
        try:
            await client.connect()
            await client.get(b"/gossipd/")  # any request: is etcd there?
            return client
        except Exception as exc:  # unreachable, refused, TLS: say which, and stop
            left -= 1
            if left > 0 and unavailable(exc):
                client.next_endpoint()
                continue
            await client.close()
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else type(exc).__name__
            raise ClusterError(
                f"etcd at {', '.join(settings.endpoints)} did not answer ({why[:300]})"
            ) from None


async def run_drain(
    settings: EtcdConfig,
    cluster: str,
    *,
    nodes: Sequence[str],
    rolling: bool,
    follow: bool,
    cancel: bool,
    step_timeout_s: float,
    timeout_s: float,
    say: Callable[[str], None],
) -> int:
    prefix = cluster_prefix(cluster)
    client = await connect(settings)
    try:
        plan, progress = await read_plan(client, prefix)
        running = plan is not None and (
            progress is None or progress.plan != plan.id or progress.status == "running"
        )
        if cancel:
            await client.delete(plan_key(prefix))
            await client.delete(progress_key(prefix))
            say(f"drain plan {plan.id if plan else '(none)'} dropped")
            return 0
        if follow:
            if plan is None:
                raise ClusterError("no drain plan in etcd to follow")
        else:
            if running:
                assert plan is not None
                raise ClusterError(
                    f"drain plan {plan.id} ({plan.mode}) is still running: follow it with "
                    "`gossipd cluster drain --follow`, or drop it with --cancel"
                )
            try:
                plan = Plan(
                    id=f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}",
                    mode="rolling" if rolling else "drain",
                    nodes=list(nodes),
                    step_timeout_s=step_timeout_s,
                    created_wall_s=time.time(),
                )
            except ValueError as exc:
                raise ClusterError(str(exc)) from None
            await client.put(plan_key(prefix), msgspec.json.encode(plan))
            what = "every member" if not nodes else ", ".join(nodes)
            say(f"drain plan {plan.id} ({plan.mode}: {what}) handed to the leader")
        assert plan is not None
        return await _follow(client, prefix, plan, timeout_s, say)
    finally:
        await client.close()


async def _follow(
    client: Any, prefix: str, plan: Plan, timeout_s: float, say: Callable[[str], None]
) -> int:
    started = time.monotonic()
    shown: tuple[str, int] | None = None
    steps_shown = 0
    hinted = False
    while True:
        _, progress = await read_plan(client, prefix)
        if progress is not None and progress.plan == plan.id:
            for line in progress.steps[steps_shown:]:
                say(f"  {line}")
            steps_shown = len(progress.steps)
            line = rollout.describe(progress)
            if (line, steps_shown) != shown:
                say(line)
                shown = (line, steps_shown)
            if progress.status == "done":
                return 0
            if progress.status == "failed":
                return 1
        elif not hinted and time.monotonic() - started > NO_LEADER_HINT_S:
            say(
                f"no leader has taken the plan after {NO_LEADER_HINT_S:.0f} s: are the daemons "
                "configured with etcd.endpoints, and is one of them the leader "
                "(gossipd_is_leader)?"
            )
            hinted = True
        if timeout_s and time.monotonic() - started > timeout_s:
            say(f"gave up following after {timeout_s} s; the plan goes on (--follow to watch)")
            return 1
        await asyncio.sleep(POLL_S)


def drain_main(args: Any, base: EtcdConfig, endpoints: Sequence[str], cluster: str) -> int:
    if args.rolling and args.nodes:
        print("gossipd cluster drain: give NODE... or --rolling, not both", file=sys.stderr)
        return 2
    if not (args.rolling or args.nodes or args.follow or args.cancel):
        print("gossipd cluster drain: name members (NODE...), or --rolling", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    try:
        return asyncio.run(
            run_drain(
                etcd_settings(base, endpoints),
                cluster,
                nodes=args.nodes,
                rolling=args.rolling,
                follow=args.follow,
                cancel=args.cancel,
                step_timeout_s=args.step_timeout,
                timeout_s=args.timeout,
                say=say,
            )
        )
    except ClusterError as exc:
        print(f"gossipd cluster drain: {exc}", file=sys.stderr)
        return 1
