"""What every configuration section shares: the Section base, the bounded number types, and
the checks of addresses a section runs in its ``__post_init__``."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from gossipd.core.messages import endpoint_problem

_BIND_RE = re.compile(
    r"^(?:tcp://(?:\*|[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]):(?:\*|\d{1,5})|ipc://.+)\Z"
)
_HOSTPORT_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]):\d{1,5}$")

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


def check_bind(field: str, value: str) -> None:
    if not _BIND_RE.match(value):
        raise ValueError(f"{field}: expected tcp://HOST:PORT or ipc://PATH, found {value!r}")
    if value.startswith("tcp://"):
        check_port(field, value)


def check_hostport(field: str, value: str, *, zero: bool = True) -> None:
    """HOST:PORT (a listening address, where port 0 picks one; else ``zero`` False)."""
    if not _HOSTPORT_RE.match(value):
        raise ValueError(f"{field}: expected HOST:PORT, found {value!r}")
    check_port(field, value, zero=zero)


def check_port(field: str, value: str, *, zero: bool = True) -> None:
    """The port after the last colon is a TCP port (ZeroMQ took 99999 as 99999 mod 65536,
    and Python's bind raised OverflowError)."""
    port = value.rpartition(":")[2]
    if port != "*" and not (0 if zero else 1) <= int(port) <= 65535:
        raise ValueError(f"{field}: port {port} is outside {0 if zero else 1}..65535 ({value!r})")


def check_advertised(field: str, value: str, *, bind: bool = False) -> None:
    """An address members are told to connect to (an advertise, a seed, or a bind that is
    its own advertise): peers refuse gossip naming one that endpoint_problem refuses, so it
    is refused here, at start-up.  A bind's port 0 or * becomes the bound port."""
    if bind and "*" in value.partition("://")[2].rpartition(":")[0]:
        return  # a wildcard host: an advertise is required and checked instead
    head, colon, port = value.rpartition(":")
    if bind and value.startswith("tcp://") and colon and port in ("0", "*"):
        value = f"{head}:1"
    problem = endpoint_problem(value)
    if problem is not None:
        raise ValueError(f"{field}: members could not connect to it: {problem}")


def split_seed(seed: str) -> tuple[str, str]:
    """A gossip seed "NODE@ADDR" or "ADDR": (node or "", address)."""
    node, at, addr = seed.partition("@")
    if at and "://" not in node:
        return node, addr
    return "", seed


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass
