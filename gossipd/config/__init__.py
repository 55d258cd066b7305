"""Typed configuration: TOML file, then GOSSIPD_* environment variables, then CLI ``--set``.

Every field has a unit in its name and a bound.  A bad configuration stops start-up with one
line naming the source (file, variable or flag), the key, what was found and what is
expected (``ConfigError``; the CLI turns it into exit status 2).

The defaults are the embedded default, the same as ``configs/local.toml``: one node on
loopback with the echo engine (a test checks that the two agree).

Where each part lives: ``rules`` (the Section base, bounded types, address checks),
``node`` (the node's own sections), ``data_path`` (the request path's sections), ``load``
(``Config`` and how it is built).  Everything is imported from here.
"""

from gossipd.config.data_path import (
    BudgetsConfig,
    FanoutConfig,
    HttpConfig,
    IngressConfig,
    JournalConfig,
)
from gossipd.config.load import (
    ENV_PREFIX,
    NODE_ID_PLACEHOLDER,
    Config,
    load_config,
    node_id,
    parse_scalar,
    resolve_node_id,
    resolved,
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
    SwimOverrides,
    TracingConfig,
)
from gossipd.config.rules import Positive, Seconds, Section, split_seed

__all__ = [
    "ENV_PREFIX",
    "NODE_ID_PLACEHOLDER",
    "BudgetsConfig",
    "Config",
    "EngineConfig",
    "EtcdConfig",
    "FanoutConfig",
    "GossipConfig",
    "GpuConfig",
    "HttpConfig",
    "IngressConfig",
    "JournalConfig",
    "LifecycleConfig",
    "LogConfig",
    "MembershipConfig",
    "MetricsConfig",
    "NodeConfig",
    "Positive",
    "Seconds",
    "Section",
    "SecurityConfig",
    "SwimOverrides",
    "TracingConfig",
    "load_config",
    "node_id",
    "parse_scalar",
    "resolve_node_id",
    "resolved",
    "split_seed",
]
