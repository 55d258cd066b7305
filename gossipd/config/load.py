"""The whole configuration (``Config``) and how it is built: the TOML file, then GOSSIPD_*
environment variables, then CLI ``--set``; a bad value becomes one ConfigError line naming
its source."""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gossipd.config.data_path import (
    BudgetsConfig,
    FanoutConfig,
    HttpConfig,
    IngressConfig,
    JournalConfig,
)
from gossipd.config.node import (
    EngineConfig,
    EtcdConfig,
    GossipConfig,
    GpuConfig,
    LifecycleConfig,
    LogConfig,
    MembershipConfig,
    MetricsConfig,
    NodeConfig,
    SecurityConfig,
    TracingConfig,
)
from gossipd.config.rules import Section
from gossipd.errors import ConfigError


class Config(Section, frozen=True):
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    ingress: IngressConfig = msgspec.field(default_factory=IngressConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    gossip: GossipConfig = msgspec.field(default_factory=GossipConfig)
    fanout: FanoutConfig = msgspec.field(default_factory=FanoutConfig)
    journal: JournalConfig = msgspec.field(default_factory=JournalConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    lifecycle: LifecycleConfig = msgspec.field(default_factory=LifecycleConfig)
    membership: MembershipConfig = msgspec.field(default_factory=MembershipConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    budgets: BudgetsConfig = msgspec.field(default_factory=BudgetsConfig)
    etcd: EtcdConfig = msgspec.field(default_factory=EtcdConfig)


ENV_PREFIX = "GOSSIPD_"


def parse_scalar(text: str) -> Any:
    """A value from the environment or a flag: a TOML literal if it is one, else a string."""
    try:
        return tomllib.loads(f"x = {text}")["x"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(
    tree: dict[str, Any],
    path: Sequence[str],
    value: Any,
    origins: dict[str, str],
    source: str,
) -> None:
    """Set ``path`` to ``value`` and record where it came from.  A table merges key by key into
    the table already there, so a later source (a variable, a flag) changes the keys it names
    and leaves the others as the earlier sources set them."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
        node = child
    if not isinstance(value, dict):
        node[path[-1]] = value
        origins[".".join(path)] = source
        return
    if not isinstance(node.get(path[-1]), dict):
        node[path[-1]] = {}
        origins[".".join(path)] = source
    for key, item in value.items():
        _set_path(tree, [*path, key], item, origins, source)


def _lookup(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


_MSGSPEC_ERR_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(
    exc: msgspec.ValidationError, tree: Mapping[str, Any], origins: Mapping[str, str]
) -> str:
    match = _MSGSPEC_ERR_RE.match(str(exc))
    assert match is not None
    what, path = match.group("what"), (match.group("path") or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]*)`", what)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        section = _section_type(path)
        expected = ", ".join(section.__struct_fields__) if section else "a known key"
        return f"{_origin(origins, key)}: {key}: unknown key; expected one of: {expected}"
    found = _lookup(tree, path.split(".")) if path else None
    field_rule = re.match(r"([\w.]+): (.*)", what, re.S)
    if isinstance(found, Mapping) and field_rule:  # a section's __post_init__ names the key
        path = f"{path}.{field_rule.group(1)}"
        what, found = field_rule.group(2), None
    source = _origin(origins, path)
    what = what[0].lower() + what[1:] if what else what
    found_text = (
        f"; found {found!r}"
        if found is not None and not isinstance(found, Mapping) and repr(found) not in what
        else ""
    )
    return f"{source}: {path or '(top level)'}: {what}{found_text}"


def _origin(origins: Mapping[str, str], path: str) -> str:
    """Where the value at ``path`` came from: its own source, else its table's, else the
    file's (or the embedded default)."""
    parts = path.split(".") if path else []
    while parts:
        key = ".".join(parts)
        if key in origins:
            return origins[key]
        parts.pop()
    return origins[""]


def _section_type(path: str) -> type[msgspec.Struct] | None:
    section: type[msgspec.Struct] = Config
    for part in path.split(".") if path else []:
        field = next((f for f in msgspec.structs.fields(section) if f.name == part), None)
        if field is None or not (
            isinstance(field.type, type) and issubclass(field.type, msgspec.Struct)
        ):
            return None
        section = field.type
    return section


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
    hostname: str | None = None,
) -> Config:
    """Build the configuration.  ``overrides`` are ``section.key=value`` strings (CLI --set).
    ``hostname`` (default: this host's) names the node in ``{node_id}`` placeholders
    (``resolve_node_id``); "" leaves them as written (``gossipd systemd render`` fills them
    per instance)."""
    tree: dict[str, Any] = {}
    origins: dict[str, str] = {"": "embedded default"}
    if path is not None:
        origins[""] = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(
                f"{path}: cannot read the configuration file: {exc.strerror}"
            ) from None
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        _set_path(tree, keys, parse_scalar(raw), origins, f"environment variable {name}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        _set_path(tree, keys, parse_scalar(raw), origins, f"flag --set {dotted}")
    try:
        config = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, tree, origins)) from None
    if hostname == "":
        return config
    return resolve_node_id(config, socket.gethostname() if hostname is None else hostname)


NODE_ID_PLACEHOLDER = "{node_id}"


def resolve_node_id(config: Config, hostname: str) -> Config:
    """``{node_id}`` in security.secret_key_file replaced by this daemon's node id: one
    gossipd.toml names every instance's own key pair."""
    template = config.security.secret_key_file
    if NODE_ID_PLACEHOLDER not in template:
        return config
    path = template.replace(NODE_ID_PLACEHOLDER, node_id(config, hostname))
    security = msgspec.structs.replace(config.security, secret_key_file=path)
    return msgspec.structs.replace(config, security=security)


def resolved(config: Config) -> dict[str, Any]:
    """The configuration as plain data, as `gossipd check-config` prints it: every section,
    with gossip.swim resolved (the preset's values with the overrides applied)."""
    tree: dict[str, Any] = msgspec.to_builtins(config)
    swim = msgspec.to_builtins(config.gossip.swim_config(cluster=config.node.cluster))
    tree["gossip"]["swim"] = {k: v for k, v in swim.items() if k != "cluster"}
    return tree


def node_id(config: Config, hostname: str) -> str:
    return config.node.id or f"{hostname}-gpu{config.node.gpu_index}"
