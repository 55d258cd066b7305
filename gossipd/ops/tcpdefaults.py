"""What the daemon asks of the kernel for every TCP socket, whoever speaks on it (the event
loop's servers and links, or libzmq's sockets through their context's defaults).

- **The listen backlog**: connections the kernel queues for a listening socket until the
  process takes them.  Past it a SYN is dropped and its client waits for TCP's first
  retransmission, 1 s later: asyncio's and libzmq's default (100) started half of 200
  producers of one host connecting at once 1 s late (scripts/connect_storm.py).
- **Keepalive**: a connection whose peer vanished without a FIN (a host powered off, a link
  cut for good) on which this side only reads (a producer's PUSH to the ingress, a member's
  to gossip) would stay open for ever, its descriptor and state with it.  After
  ``KEEPALIVE_IDLE_S`` of silence the kernel probes, ``KEEPALIVE_INTERVAL_S`` apart, and
  closes the connection when ``KEEPALIVE_PROBES`` go unanswered: about 2 minutes.  A live
  peer's kernel answers the probes, a stopped or busy peer's too; nothing reaches the
  program.
- **Retransmission's backoff, the event loop's connections** (TCP_RTO_MAX_MS, Linux 6.15
  and later; elsewhere TCP's own 120 s): at most ``RETRANSMIT_MAX_S`` between two
  retransmissions of data nobody acknowledged.  After a cut of a minute, TCP's backoff
  (doubling to 120 s) sent its next try 48 s after the link healed, so a member was
  unreachable that long after it was back (bench/README, "Cut links").  A side effect:
  TCP gives up after its 15 retransmissions, reckoned with the capped interval, so a cut
  of more than about 14 s now closes the connection (before, about 15 minutes), and what
  was in flight is lost as on any drop (the forwarder's ack timeouts, held Results and
  Confirms, and migration cover it: docs/PROTOCOL.md, "Fan-out").  A peer that is stopped
  or slow to read is never cut: its kernel answers TCP's zero-window probes, and what was
  written arrives, late.  (TCP_USER_TIMEOUT would close a cut link sooner, but since
  Linux 5.11 it also closes one whose peer has not read for that long, losing what was
  written to a paused member: tried, and taken out.)
- **Connecting** (ZMQ_CONNECT_TIMEOUT, and the loop client's own): an attempt with no answer
  within ``CONNECT_TIMEOUT_S`` is given up and tried again, instead of waiting on SYN
  retransmissions (1, 2, 4 ... 64 s apart) after the peer is back.
"""

from __future__ import annotations

import socket

import zmq

LISTEN_BACKLOG = 1024
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 6
RETRANSMIT_MAX_S = 1.0  # (the kernel takes 1 s to 120 s)
CONNECT_TIMEOUT_S = 1.0
TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)  # (linux/tcp.h; Python 3.11 lacks it)


def keep_alive(sock: socket.socket) -> None:
    """Keepalive and the retransmission cap on ``sock`` (a connection the event loop speaks
    on), as this module's constants say when it is called."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    _cap_retransmits(sock)


def _cap_retransmits(sock: socket.socket) -> bool:
    """TCP_RTO_MAX_MS on ``sock``; False where the kernel (before 6.15) refuses it: TCP's
    own backoff then."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, int(RETRANSMIT_MAX_S * 1000))
    except OSError:
        return False
    return True


def retransmit_cap_available() -> bool:
    """Whether this kernel takes TCP_RTO_MAX_MS (Linux 6.15 and later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return _cap_retransmits(sock)


def set_context_defaults(ctx: zmq.Context) -> None:
    """The backlog, keepalive and the connect bound on every socket ``ctx`` makes from now
    on (pyzmq applies a context's options to each new socket; a kind's own options, set
    after, win).  libzmq has no retransmission cap: `fanout.peer_transport = "zmq"` keeps
    TCP's backoff."""
    ctx.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    ctx.setsockopt(zmq.TCP_KEEPALIVE, 1)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    ctx.setsockopt(zmq.CONNECT_TIMEOUT, int(CONNECT_TIMEOUT_S * 1000))
