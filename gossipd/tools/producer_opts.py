"""The options every producer-side command shares (submit, status, drain, undrain, cluster
drain): where daemons send their answers (``--reply-bind``) and the CURVE keys
(``--secret-key``, ``--server-key``), each also from the environment (docs/OPERATIONS.md,
"Security": the producer host's commands)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import zmq.auth

from gossipd.errors import StartupError
from gossipd.tools.client import ProducerKeys

DEFAULT_REPLY_BIND = "tcp://127.0.0.1:*"
_REPLY_BIND_RE = re.compile(
    r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(?:\*|\d{1,5})$"
)
_WILDCARDS = {"*", "0.0.0.0", "[::]", "[::0]", "[0:0:0:0:0:0:0:0]"}


def add_producer_args(p: argparse.ArgumentParser, *, per_endpoint: bool = True) -> None:
    p.add_argument(
        "--reply-bind",
        default="",
        metavar="tcp://IP:PORT",
        help="where the daemons send answers: an address of this host that they can reach "
        f"(PORT may be *: a free one; default {DEFAULT_REPLY_BIND}, for daemons on this "
        "host); env GOSSIPD_REPLY_BIND",
    )
    p.add_argument(
        "--secret-key",
        default="",
        help="CURVE: this producer's NAME.key_secret (gossipd keygen); env GOSSIPD_SECRET_KEY",
    )
    once = "once for all or once per --endpoint in order" if per_endpoint else "the daemon's"
    p.add_argument(
        "--server-key",
        action="append",
        default=[],
        help=f"CURVE: a daemon's NODE.key, {once}; env GOSSIPD_SERVER_KEY (comma-separated)",
    )


def reply_bind(args: argparse.Namespace) -> str:
    """--reply-bind (or GOSSIPD_REPLY_BIND), checked: the address is also what the daemons are
    told to connect to, so it must name this host, not a wildcard."""
    value = args.reply_bind or os.environ.get("GOSSIPD_REPLY_BIND", "") or DEFAULT_REPLY_BIND
    where = "--reply-bind" if args.reply_bind else "GOSSIPD_REPLY_BIND"
    match = _REPLY_BIND_RE.match(value)
    if match is None:
        raise StartupError(
            f"{where} {value!r}: expected tcp://IP:PORT (PORT may be *), an address of this "
            "host that the daemons can reach"
        )
    if match.group("host") in _WILDCARDS:
        raise StartupError(
            f"{where} {value!r}: not a wildcard host: the address is also sent to the daemons "
            "as where to answer; give this host's address on their network, e.g. "
            "tcp://10.0.0.9:*"
        )
    return value


def producer_keys(args: argparse.Namespace, endpoints: Sequence[str]) -> ProducerKeys | None:
    """--secret-key and --server-key (or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY): CURVE."""
    secret = args.secret_key or os.environ.get("GOSSIPD_SECRET_KEY", "")
    servers = server_key_files(args)
    if not secret and not servers:
        return None
    if not secret or not servers:
        raise StartupError(
            "CURVE needs both --secret-key FILE and --server-key FILE "
            "(or GOSSIPD_SECRET_KEY and GOSSIPD_SERVER_KEY)"
        )
    if len(servers) not in (1, len(endpoints)):
        raise StartupError(
            f"give --server-key once (all daemons) or once per --endpoint ({len(endpoints)})"
        )
    try:
        return ProducerKeys.from_files(secret, servers)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read a key file: {exc}") from None


def server_key_files(args: argparse.Namespace) -> list[str]:
    return list(args.server_key) or [
        p for p in os.environ.get("GOSSIPD_SERVER_KEY", "").split(",") if p
    ]


def member_key_finder(args: argparse.Namespace) -> Callable[[str], bytes | None]:
    """A member's public key by node id: ``NODE.key`` beside a --server-key file (a copy of
    the daemons' peer_keys_dir on the producer host), or None."""
    dirs = list(dict.fromkeys(str(Path(s).parent) for s in server_key_files(args)))

    def find(node: str) -> bytes | None:
        if "/" in node or node.startswith("."):
            return None
        for folder in dirs:
            path = Path(folder) / f"{node}.key"
            if path.is_file():
                try:
                    return zmq.auth.load_certificate(str(path))[0]
                except (OSError, ValueError):
                    return None
        return None

    return find
