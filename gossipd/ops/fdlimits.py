"""How many sockets and file descriptors a daemon may hold.

libzmq's context holds at most 1,023 sockets unless told otherwise, and each ZeroMQ socket
takes file descriptors of its own (a mailbox, its connections).  The socket pool's bounds are
higher: gossip keeps up to PEER_SOCKETS_MAX PUSH sockets, each with a disconnect monitor
(two sockets a member), the reply sender up to ``ingress.reply_sockets_max``, and the
``zmq`` peer transport one DEALER a member.  At the default a cluster of about 340 members
filled the context: every new gossip, reply or peer socket failed (counted as dropped sends),
and the daemon could no longer reach new members or producers.  So the context is sized for
the pool's bounds, and the soft limit on open files raised toward the hard one, which
systemd's unit sets (LimitNOFILE=65536; a shell's is often 1,024).
"""

from __future__ import annotations

import logging
import resource

import zmq

log = logging.getLogger("gossipd.ops.fdlimits")

MEMBERS_MAX = 10_000  # the largest cluster placement is measured at (bench/README.md)
FIXED_SOCKETS = 256  # binds, their readers, admin, the door's reply socket, tools: ample
FDS_PER_SOCKET = 2  # a mailbox and, mostly, one connection


def sockets_wanted(*, gossip_sockets_max: int, reply_sockets_max: int) -> int:
    """Gossip's sockets and their monitors, the reply sockets, a peer DEALER a member."""
    return 2 * gossip_sockets_max + reply_sockets_max + MEMBERS_MAX + FIXED_SOCKETS


def size_context(ctx: zmq.Context, sockets: int) -> int:
    """Let ``ctx`` hold ``sockets`` (within libzmq's own limit); before any socket is made.
    Returns what it may hold now."""
    allowed = min(sockets, ctx.get(zmq.SOCKET_LIMIT))
    ctx.set(zmq.MAX_SOCKETS, allowed)
    return int(ctx.get(zmq.MAX_SOCKETS))


def raise_open_files(wanted: int, *, at_least: int) -> tuple[int, int]:
    """Raise the soft limit on open files toward ``wanted`` (never past the hard limit, never
    down).  Returns (soft, hard) after; warns when the hard limit is below ``at_least``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit", extra={"error": str(exc)})
    if hard != resource.RLIM_INFINITY and hard < at_least:
        log.warning(
            "the open-files limit may be too low for a large cluster: raise LimitNOFILE "
            "(systemd) or ulimit -n",
            extra={"soft": soft, "hard": hard, "wanted": at_least},
        )
    return soft, hard
