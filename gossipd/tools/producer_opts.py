"""The options every producer-side command shares (submit, status, drain, undrain, cluster
drain): where daemons send their answers (``--reply-bind``) and the CURVE keys
(``--secret-key``, ``--server-key``), each also from the environment, or from a producer
configuration file (``--producer-config FILE`` or GOSSIPD_PRODUCER_CONFIG)::

    [producer]
    secret_key = "/home/me/.gossipd/me.key_secret"
    server_key = ["/home/me/.gossipd/peers/n1-gpu0.key"]   # or one string
    reply_bind = "tcp://10.0.0.20:*"

A flag beats its variable, which beats the file; relative paths in the file are taken from
the file's directory (docs/OPERATIONS.md, "Security": the producer host's commands)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from gossipd.errors import StartupError
from gossipd.keyfiles import read_key_file
from gossipd.security import is_loopback, is_wildcard_host
from gossipd.tools.client import DEFAULT_REPLY_BIND, ProducerKeys

_REPLY_BIND_RE = re.compile(
    r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(?:\*|\d{1,5})$"
)


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
    p.add_argument(
        "--producer-config",
        default="",
        metavar="FILE",
        help="a TOML file whose [producer] table gives secret_key, server_key, reply_bind "
        "(what the flags and variables do not); env GOSSIPD_PRODUCER_CONFIG",
    )


_FILE_KEYS = ("secret_key", "server_key", "reply_bind")


def _from_file(args: argparse.Namespace) -> dict[str, str | list[str]]:
    """The [producer] table of --producer-config (or GOSSIPD_PRODUCER_CONFIG), checked, with
    its paths made absolute; {} when none is given."""
    path_text = getattr(args, "producer_config", "") or os.environ.get(
        "GOSSIPD_PRODUCER_CONFIG", ""
    )
    if not path_text:
        return {}
    path = Path(path_text).expanduser()
    try:
        table = tomllib.loads(path.read_text()).get("producer")
    except OSError as exc:
        raise StartupError(
            f"cannot read the producer configuration {path}: {exc.strerror}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"{path}: not valid TOML: {exc}") from None
    if not isinstance(table, dict):
        raise StartupError(f"{path}: expected a [producer] table with {', '.join(_FILE_KEYS)}")
    unknown = sorted(set(table) - set(_FILE_KEYS))
    if unknown:
        raise StartupError(
            f"{path}: [producer] {', '.join(unknown)}: unknown; expected {', '.join(_FILE_KEYS)}"
        )
    out: dict[str, str | list[str]] = {}
    for key, value in table.items():
        values = value if key == "server_key" and isinstance(value, list) else [value]
        if not all(isinstance(v, str) and v for v in values):
            raise StartupError(f"{path}: [producer] {key}: expected a non-empty string")
        if key == "reply_bind":
            out[key] = value
        else:
            files = [str(path.parent / Path(v).expanduser()) for v in values]
            out[key] = files if key == "server_key" else files[0]
    return out


def reply_bind(args: argparse.Namespace, endpoints: Sequence[str] = ()) -> str:
    """--reply-bind (or GOSSIPD_REPLY_BIND), checked: the address is also what the daemons are
    told to connect to, so it must name this host, not a wildcard.  A loopback one with a
    daemon ``endpoints`` off this host gets a warning on stderr: tasks that daemon forwards
    to members on other hosts are answered from there, and 127.0.0.1 is not this host there."""
    env = os.environ.get("GOSSIPD_REPLY_BIND", "")
    from_file = str(_from_file(args).get("reply_bind", ""))
    value = args.reply_bind or env or from_file or DEFAULT_REPLY_BIND
    where = (
        "--reply-bind"
        if args.reply_bind
        else "GOSSIPD_REPLY_BIND"
        if env
        else "[producer] reply_bind"
    )
    match = _REPLY_BIND_RE.match(value)
    if match is None:
        raise StartupError(
            f"{where} {value!r}: expected tcp://IP:PORT (PORT may be *), an address of this "
            "host that the daemons can reach"
        )
    if is_wildcard_host(match.group("host")):
        raise StartupError(
            f"{where} {value!r}: not a wildcard host: the address is also sent to the daemons "
            "as where to answer; give this host's address on their network, e.g. "
            "tcp://10.0.0.9:*"
        )
    if is_loopback(value) and any(not is_loopback(e) for e in endpoints):
        print(
            f"gossipd: warning: answers go to {value}, which only daemons on this host can "
            "reach; tasks run by members on other hosts will not be answered: give "
            "--reply-bind tcp://THIS_HOST_IP:* (or GOSSIPD_REPLY_BIND)",
            file=sys.stderr,
        )
    return value


def producer_keys(args: argparse.Namespace, endpoints: Sequence[str] | None) -> ProducerKeys | None:
    """--secret-key and --server-key (or GOSSIPD_SECRET_KEY / GOSSIPD_SERVER_KEY): CURVE.
    ``endpoints`` None: a command that asks no daemon (cluster drain goes by etcd), so any
    number of server keys is fine (one environment can serve every command)."""
    secret = (
        args.secret_key
        or os.environ.get("GOSSIPD_SECRET_KEY", "")
        or str(_from_file(args).get("secret_key", ""))
    )
    servers = server_key_files(args)
    if not secret and not servers:
        return None
    if not secret or not servers:
        raise StartupError(
            "CURVE needs both --secret-key FILE and --server-key FILE "
            "(or GOSSIPD_SECRET_KEY and GOSSIPD_SERVER_KEY)"
        )
    if endpoints is not None and len(endpoints) == 1 and len(servers) > 1:
        raise StartupError(
            f"this command asks one daemon: give its NODE.key once (--server-key, or "
            f"GOSSIPD_SERVER_KEY), not {len(servers)} (status finds the other members' keys "
            "beside it)"
        )
    if endpoints is not None and len(servers) not in (1, len(endpoints)):
        raise StartupError(
            f"give --server-key once (all daemons) or once per --endpoint ({len(endpoints)})"
        )
    try:
        return ProducerKeys.from_files(secret, servers)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read a key file: {exc}") from None


def server_key_files(args: argparse.Namespace) -> list[str]:
    from_env = [p for p in os.environ.get("GOSSIPD_SERVER_KEY", "").split(",") if p]
    from_file = _from_file(args).get("server_key", [])
    return list(args.server_key) or from_env or list(from_file)


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
                    return read_key_file(path)[0]
                except (OSError, ValueError):
                    return None
        return None

    return find
