"""Is anything listening at a member's gossip address?  One TCP connect (the IO half of
gossipd/core/refusal.py).

Only ECONNREFUSED counts: the host answered that no socket listens on that port, which is
what a crashed process leaves behind.  A stalled process's kernel still completes the connect
into the listening socket's backlog; a vanished host times out or is unreachable.  The
connect is plain TCP and closed at once, before ZeroMQ's greeting or any CURVE handshake, so
it carries nothing and asks nothing of the peer's ZAP handler.
"""

from __future__ import annotations

import asyncio
import ipaddress

# Addresses that are not a peer's: connecting there reaches this host (Linux maps 0.0.0.0 to
# the local host), so a refusal would speak of us, not of the member.
_UNSPECIFIED = {"*", ""}


def tcp_target(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ZeroMQ ``tcp://host:port`` endpoint, or None when it is not one we
    can check (another transport, a wildcard or unspecified host, a bad port)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port_text = endpoint[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not sep or host in _UNSPECIFIED or ";" in host:
        return None
    try:
        port = int(port_text)
    except ValueError:
        return None
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return None
    except ValueError:
        pass  # a name: resolved when connecting
    if not 0 < port < 65536:
        return None
    return host, port


async def connection_refused(endpoint: str, timeout_s: float) -> bool:
    """True only if a TCP connect to ``endpoint`` is refused (nothing listens there); False
    when it is accepted, times out, fails otherwise, or ``endpoint`` is not checkable."""
    target = tcp_target(endpoint)
    if target is None:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(*target)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.transport.abort()
    return False
