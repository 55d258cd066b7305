"""`gossipd status` and `gossipd drain`: the operator's side of the admin messages.

Status of a cluster, from any daemon: ask that daemon (a StatusQuery to its ingress), then ask
every live member it knows at the member's gossiped ingress address, all at once, and put the
answers together: each member's own status and load, how every other member sees it, and
whether all members agree on the member-set checksum.  Drain: one Drain to the daemon asked,
which relays it to the member named (docs/PROTOCOL.md, "Admin").

With CURVE (``ProducerKeys``): the answers' PULL is served with the producer's key pair, each
request's PUSH checks the daemon's key; the other members asked for status are checked
against ``member_key(node)`` (their ``NODE.key`` beside the --server-key file), and one whose
key is not known is shown as the asked daemon sees it.

Plain blocking pyzmq with deadlines: these are one-shot commands.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from gossipd.core.admin_messages import AdminReply, StatusReport, decode_admin_answer, encode_admin
from gossipd.core.gossip_messages import MemberRecord
from gossipd.core.messages import PROTOCOL_VERSION, Drain, Result, StatusQuery, endpoint_problem
from gossipd.errors import RemoteProtocolError
from gossipd.ops.fdlimits import FIXED_SOCKETS, MEMBERS_MAX, raise_open_files, size_context
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG
from gossipd.security import is_wildcard_host
from gossipd.tools.client import DEFAULT_REPLY_BIND, REPLY_BYTES_MAX, ProducerKeys

DEFAULT_TIMEOUT_S = 2.0
MemberKey = Callable[[str], bytes | None]


class AdminError(Exception):
    """The request could not be made or was refused; the message says what to do."""


class _Asker:
    """One PULL for answers, one PUSH per endpoint (so each gets its own request)."""

    def __init__(
        self,
        ctx: zmq.Context | None = None,
        *,
        reply_bind: str = DEFAULT_REPLY_BIND,
        curve: ProducerKeys | None = None,
    ) -> None:
        self._own = ctx is None
        if ctx is None:
            # One PUSH a member, all at once: sized for the largest cluster (libzmq's default
            # of 1,023 sockets made `status` on ~1,020 members end in a traceback).
            ctx = zmq.Context()
            size_context(ctx, MEMBERS_MAX + FIXED_SOCKETS)
            raise_open_files(2 * (MEMBERS_MAX + FIXED_SOCKETS), at_least=0)
        self._ctx = ctx
        self.curve = curve
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, REPLY_BYTES_MAX)  # a daemon's answer, bounded
        self._pull.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)  # every member asked answers at once
        self._pushes: list[zmq.Socket] = []
        if curve is not None:  # daemons answer only a server holding our key
            self._pull.setsockopt(zmq.CURVE_SERVER, 1)
            self._pull.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            self._pull.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        try:
            self._pull.bind(reply_bind)
        except zmq.ZMQError as exc:
            self.close()
            raise AdminError(
                f"cannot bind the reply address {reply_bind}: {exc.strerror} (--reply-bind: "
                "an address of this host)"
            ) from None
        self.reply_to = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(
        self, endpoint: str, frame: bytes, timeout_s: float, server_key: bytes | None = None
    ) -> bool:
        """False when no connection to ``endpoint`` came up within ``timeout_s``.  With CURVE,
        ``server_key`` is the daemon's (None: the first --server-key)."""
        push = self._ctx.socket(zmq.PUSH)
        self._pushes.append(push)  # (closed by close() whatever fails below: else term hangs)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IMMEDIATE, 1)  # send only once connected: fail fast otherwise
        push.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        if self.curve is not None:
            push.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public)
            push.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
            push.setsockopt(zmq.CURVE_SERVERKEY, server_key or self.curve.server_key(0))
        push.connect(endpoint)
        try:
            push.send(frame)
        except zmq.Again:
            return False
        return True

    def collect(
        self, ids: set[str], timeout_s: float
    ) -> dict[str, StatusReport | AdminReply | Result]:
        out: dict[str, StatusReport | AdminReply | Result] = {}
        deadline = time.monotonic() + timeout_s
        while ids - out.keys():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._pull.poll(left_ms):
                break
            try:
                answer = decode_admin_answer(self._pull.recv())
            except RemoteProtocolError:
                continue  # not an answer of ours
            if answer.id in ids:
                out[answer.id] = answer
        return out

    def close(self) -> None:
        for sock in [*self._pushes, self._pull]:
            sock.close(linger=0)
        if self._own:
            self._ctx.term()


def _check(endpoint: str) -> None:
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise AdminError(f"endpoint {problem}")


def no_connection(endpoint: str, timeout_s: float, curve: bool) -> str:
    """Why no request could go to ``endpoint``, and what to do: nothing listens there, or
    something does but no ZeroMQ handshake completed (CURVE keys missing or not its)."""
    listening = False
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
                listening = True
        except (OSError, ValueError):
            pass
    if not listening:
        return (
            f"nothing listens at {endpoint} (no connection within {timeout_s:g} s): start a "
            "daemon with `gossipd run` or give the right --endpoint"
        )
    if curve:
        return (
            f"{endpoint} accepts connections but no CURVE handshake completed within "
            f"{timeout_s:g} s: is --server-key that daemon's NODE.key, and this producer's "
            "NAME.key in its security.producer_keys_dir?"
        )
    return (
        f"{endpoint} accepts connections but no handshake completed within {timeout_s:g} s: "
        "if the daemon runs with security.curve, give --secret-key FILE and --server-key FILE "
        "(or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY)"
    )


def _no_answer(what: str, endpoint: str, timeout_s: float, reply_to: str) -> str:
    return (
        f"no answer from {what} within {timeout_s:g} s (asked through {endpoint}; answers "
        f"go to {reply_to}: if the daemons are on another host, give --reply-bind with an "
        "address of this host they can reach)"
    )


def ask_status(
    endpoints: Sequence[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    reply_bind: str = DEFAULT_REPLY_BIND,
    curve: ProducerKeys | None = None,
    server_keys: Sequence[bytes | None] = (),
) -> dict[str, StatusReport | str]:
    """Each endpoint's StatusReport, or a string saying why there is none.  ``server_keys``:
    with CURVE, each endpoint's daemon key (default: the first --server-key).  An endpoint
    no socket connects to gets its reason, and the others are still asked (one member's
    odd address does not sink the whole status)."""
    out: dict[str, StatusReport | str] = {}
    for e in endpoints:
        problem = endpoint_problem(e)
        if problem is not None:
            out[e] = f"endpoint {problem}"
    asker = _Asker(reply_bind=reply_bind, curve=curve)
    try:
        ids: dict[str, str] = {}
        started = time.monotonic()
        for i, endpoint in enumerate(endpoints):
            if endpoint in out:
                continue
            query_id = f"status-{secrets.token_hex(6)}"
            query = StatusQuery(v=PROTOCOL_VERSION, id=query_id, reply_to=asker.reply_to)
            left_s = max(0.05, timeout_s - (time.monotonic() - started))
            key = server_keys[i] if i < len(server_keys) else None
            if asker.send(endpoint, encode_admin(query), left_s, key):
                ids[query_id] = endpoint
            else:
                out[endpoint] = no_connection(endpoint, timeout_s, curve is not None)
        left_s = max(0.05, timeout_s - (time.monotonic() - started))
        answers = asker.collect(set(ids), left_s)
        for query_id, endpoint in ids.items():
            answer = answers.get(query_id)
            if isinstance(answer, StatusReport):
                out[endpoint] = answer
            elif isinstance(answer, Result) and answer.error is not None:
                out[endpoint] = f"{endpoint} refused: {answer.error.code}: {answer.error.message}"
            else:
                out[endpoint] = _no_answer(endpoint, endpoint, timeout_s, asker.reply_to)
        return out
    finally:
        asker.close()


def cluster_status(
    endpoint: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    reply_bind: str = DEFAULT_REPLY_BIND,
    curve: ProducerKeys | None = None,
    member_key: MemberKey = lambda node: None,
) -> dict[str, Any]:
    """The cluster as seen from ``endpoint``'s daemon and from each member it knows.  With
    CURVE, a member is asked itself only when ``member_key(node)`` knows its key."""
    first = ask_status([endpoint], timeout_s, reply_bind=reply_bind, curve=curve)[endpoint]
    if isinstance(first, str):
        raise AdminError(first)
    live = [m for m in first.members if m.state in ("alive", "suspect")]
    ingresses = {
        m.node: reachable_ingress(m.gpu.ingress, m.addr)
        for m in live
        if m.gpu is not None and m.gpu.ingress
    }
    reports: dict[str, StatusReport | str] = {first.node: first}
    keys = {node: member_key(node) for node in ingresses} if curve is not None else {}
    for node, key in keys.items():
        if key is None:
            reports[node] = f"not asked: no {node}.key beside the --server-key file"
            del ingresses[node]
    asked = list(ingresses.values())
    answers = (
        ask_status(
            asked,
            timeout_s,
            reply_bind=reply_bind,
            curve=curve,
            server_keys=[keys.get(node) for node in ingresses],
        )
        if asked
        else {}
    )
    for node, ingress in ingresses.items():
        reports[node] = answers[ingress]
    for m in live:
        reports.setdefault(m.node, "its ingress address is not known yet (no GPU state gossiped)")
    return assemble(first, reports, asked=endpoint)


def reachable_ingress(ingress: str, gossip_addr: str) -> str:
    """A member's gossiped ingress, with a wildcard host (``ingress.bind = "tcp://0.0.0.0:..."``)
    replaced by the host of its gossip address: the address its peers reach it at."""
    if not ingress.startswith("tcp://") or not gossip_addr.startswith("tcp://"):
        return ingress
    host, _, port = ingress.removeprefix("tcp://").rpartition(":")
    if not is_wildcard_host(host):
        return ingress
    gossip_host = gossip_addr.removeprefix("tcp://").rpartition(":")[0]
    return ingress if is_wildcard_host(gossip_host) else f"tcp://{gossip_host}:{port}"


def assemble(
    first: StatusReport, reports: dict[str, StatusReport | str], *, asked: str
) -> dict[str, Any]:
    """One row per member (the asked daemon's view, with each member's own answer)."""
    seen: dict[str, dict[str, str]] = {}  # member -> {peer: status as that peer sees it}
    for peer, report in reports.items():
        if isinstance(report, StatusReport):
            for rec in report.members:
                if rec.state in ("alive", "suspect"):
                    status = rec.gpu.status if rec.gpu is not None else "unknown"
                    seen.setdefault(rec.node, {})[peer] = status
    rows = [_row(first.node, "alive", reports[first.node], None, seen)]
    for rec in sorted(first.members, key=lambda r: r.node):
        rows.append(_row(rec.node, rec.state, reports.get(rec.node), rec, seen))
    live_reports = [
        r for n, r in reports.items() if any(row["node"] == n and row["live"] for row in rows)
    ]
    checksums = {r.checksum for r in live_reports if isinstance(r, StatusReport)}
    answered = all(isinstance(r, StatusReport) for r in live_reports)
    return {
        "asked": asked,
        "node": first.node,
        "software_version": first.software_version,
        "gossip": first.gossip,
        "members_live": sum(row["live"] for row in rows),
        "checksums_agree": answered and len(checksums) == 1,
        "checksums": sorted(f"{c:016x}" for c in checksums),
        "leader": first.leader,  # the highest term the asked daemon has seen; null before any
        "term": first.term,
        "election": "etcd" if first.election else "off",
        "members": rows,
    }


def _row(
    node: str,
    state: str,
    report: StatusReport | str | None,
    rec: MemberRecord | None,
    seen: dict[str, dict[str, str]],
) -> dict[str, Any]:
    own = report if isinstance(report, StatusReport) else None
    gpu = own.gpu if own is not None and own.gpu is not None else (rec.gpu if rec else None)
    row: dict[str, Any] = {
        "node": node,
        "state": state,
        "live": state in ("alive", "suspect"),
        "reachable": own is not None,
        "status": own.status if own is not None else (gpu.status if gpu else "unknown"),
        "seen_as": seen.get(node, {}),
        "engine": own.engine if own is not None else "",
        "model": own.model if own is not None else (gpu.model if gpu else ""),
        "ingress": gpu.ingress if gpu else "",
        "gpu_index": gpu.gpu_index if gpu else None,
    }
    if own is not None:
        row["drained"] = own.drained
        row["incarnation"] = own.incarnation
        row["checksum"] = f"{own.checksum:016x}"
        row["load"] = {
            "pending": own.load.pending,
            "queued": own.load.queued,
            "running": own.load.running,
            "served": own.load.served,
            "failed": own.load.failed,
            "received": own.load.received,
        }
    elif isinstance(report, str):
        row["error"] = report
    if gpu is not None:
        row["gpu"] = {
            "memory_free_mb": gpu.memory_free_mb,
            "memory_total_mb": gpu.memory_total_mb,
            "utilization_pct": gpu.utilization_pct,
        }
        row["engine_load"] = {
            "inflight": gpu.inflight,
            "running_requests": gpu.running_requests,
            "waiting_requests": gpu.waiting_requests,
            "kv_cache_usage_ratio": round(gpu.kv_cache_usage_ratio, 3),
            "queued_tokens": gpu.queued_tokens,
        }
    return row


def format_status(status: dict[str, Any]) -> str:
    header = (
        f"{'NODE':<12} {'STATE':<8} {'STATUS':<13} {'ENGINE':<6} {'MODEL':<14} "
        f"{'GPU':>3} {'UTIL%':>5} {'MEM FREE':>9} {'PEND':>5} {'RUN':>4} {'WAIT':>4} {'KV%':>4} "
        f"{'SERVED':>7}  SEEN AS BY PEERS"
    )
    lines = [header]
    for row in status["members"]:
        load = row.get("load", {})
        eng = row.get("engine_load", {})
        views = sorted(set(row["seen_as"].values()))
        seen = ",".join(views) if views else "-"
        model = os.path.basename(row["model"].rstrip("/")) or "-"
        gpu = row.get("gpu", {})
        mem = (
            f"{gpu['memory_free_mb'] / 1024:.1f}/{gpu['memory_total_mb'] / 1024:.0f}G"
            if gpu.get("memory_total_mb")
            else "-"
        )
        lines.append(
            f"{row['node']:<12} {row['state']:<8} {row['status']:<13} {row['engine'] or '-':<6} "
            f"{model[:14]:<14} {row['gpu_index'] if row['gpu_index'] is not None else '-':>3} "
            f"{gpu.get('utilization_pct', '-'):>5} {mem:>9} {load.get('pending', '-'):>5} {eng.get('running_requests', '-'):>4} "
            f"{eng.get('waiting_requests', '-'):>4} "
            f"{round(100 * eng['kv_cache_usage_ratio']) if eng else '-':>4} "
            f"{load.get('served', '-'):>7}  {seen}"
            + (f"  ({row['error']})" if "error" in row else "")
        )
    agree = (
        f"all {status['members_live']} agree ({status['checksums'][0]})"
        if status["checksums_agree"]
        else f"DISAGREE or incomplete: {', '.join(status['checksums']) or 'none'}"
    )
    lines.append(f"member-set checksum: {agree}; leader: {_leader_text(status)}")
    return "\n".join(printable(line) for line in lines)


def printable(text: str) -> str:
    """``text`` with control and format characters written as escapes: what daemons report
    (node names are any 128 characters, gossiped by anyone without CURVE) must not move the
    operator's cursor, clear the screen or start a line of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _leader_text(status: dict[str, Any]) -> str:
    if status["leader"] is not None:
        return f"{status['leader']} (term {status['term']})"
    if status["election"] == "off":
        return "none (election off: this daemon has no etcd.endpoints)"
    return "none seen yet (election through etcd: no leader term has reached this daemon)"


def status_main(
    endpoint: str,
    *,
    watch: bool,
    as_json: bool,
    interval_s: float,
    timeout_s: float,
    reply_bind: str = DEFAULT_REPLY_BIND,
    curve: ProducerKeys | None = None,
    member_key: MemberKey = lambda node: None,
) -> int:
    while True:
        try:
            status = cluster_status(
                endpoint, timeout_s, reply_bind=reply_bind, curve=curve, member_key=member_key
            )
        except AdminError as exc:
            print(printable(f"gossipd status: {exc}"), file=sys.stderr)
            if not watch:
                return 1
            time.sleep(interval_s)
            continue
        if as_json:
            print(json.dumps(status), flush=True)
        else:
            if watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(printable(f"{time.strftime('%H:%M:%S')} asked {endpoint} ({status['node']})"))
            print(format_status(status), flush=True)
        if not watch:
            return 0
        time.sleep(interval_s)


def drain(
    endpoint: str,
    node: str,
    *,
    drain: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    reply_bind: str = DEFAULT_REPLY_BIND,
    curve: ProducerKeys | None = None,
) -> AdminReply:
    """Ask ``endpoint``'s daemon to drain (or undrain) ``node``; raise AdminError if refused.
    The daemon relays it to ``node``, which answers."""
    _check(endpoint)
    asker = _Asker(reply_bind=reply_bind, curve=curve)
    try:
        request = Drain(
            v=PROTOCOL_VERSION,
            id=f"drain-{secrets.token_hex(6)}",
            reply_to=asker.reply_to,
            node=node,
            drain=drain,
        )
        if not asker.send(endpoint, encode_admin(request), timeout_s):
            raise AdminError(no_connection(endpoint, timeout_s, curve is not None))
        answer = asker.collect({request.id}, timeout_s).get(request.id)
        reply_to = asker.reply_to
    finally:
        asker.close()
    if answer is None:
        raise AdminError(_no_answer(repr(node), endpoint, timeout_s, reply_to))
    if isinstance(answer, Result):  # (a daemon answers a Drain with a Result only to refuse)
        if answer.error is None:
            raise AdminError(f"{endpoint} answered the Drain with a task's Result: not a daemon?")
        raise AdminError(f"{endpoint} refused: {answer.error.code}: {answer.error.message}")
    if not isinstance(answer, AdminReply) or not answer.ok:
        raise AdminError(getattr(answer, "message", "unexpected answer"))
    return answer


def drain_main(
    endpoint: str,
    node: str,
    *,
    drain_it: bool,
    timeout_s: float,
    reply_bind: str = DEFAULT_REPLY_BIND,
    curve: ProducerKeys | None = None,
) -> int:
    verb = "drain" if drain_it else "undrain"
    try:
        reply = drain(
            endpoint, node, drain=drain_it, timeout_s=timeout_s, reply_bind=reply_bind, curve=curve
        )
    except AdminError as exc:
        print(printable(f"gossipd {verb}: {exc}"), file=sys.stderr)
        return 1
    print(printable(f"{reply.node}: {reply.status} ({reply.message})"))
    return 0
