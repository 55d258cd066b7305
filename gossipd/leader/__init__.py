"""Leadership through etcd (issue 15): election (election.py, its decisions in
gossipd/core/election.py), leader duties (duties.py), directives on members (directives.py),
composed by leadership.py.  Off when ``etcd.endpoints`` is empty; then nothing of aetcd or
gRPC is imported."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gossipd.errors import StartupError

if TYPE_CHECKING:
    from gossipd.config import Config
    from gossipd.leader.leadership import Leadership

log = logging.getLogger("gossipd.leader")


def build_leadership(config: Config, *, node: str, gossip: Any) -> Leadership | None:
    """The daemon's leadership, or None when no etcd is configured (said once, here)."""
    if not config.etcd.endpoints:
        log.info(
            "no etcd configured (etcd.endpoints is empty): leader election and leader "
            "duties are off; every daemon serves as usual"
        )
        return None
    try:
        from gossipd.leader.leadership import Leadership
    except ImportError as exc:
        raise StartupError(
            f"etcd.endpoints is set but its client package is missing ({exc.name}): "
            "pip install -e '.[etcd]'"
        ) from None
    leadership = Leadership(config, node=node, gossip=gossip)
    log.info(
        "leader election through etcd",
        extra={
            "endpoints": list(config.etcd.endpoints),
            "ttl_s": config.etcd.ttl_s,
            "prefix": leadership.prefix,
            "tls": bool(config.etcd.ca_file),
        },
    )
    return leadership
