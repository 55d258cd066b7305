"""What the daemon asks of the kernel for every TCP socket, whoever speaks on it (the event
loop's servers and links, or libzmq's sockets through their context's defaults).

- **The listen backlog**: connections the kernel queues for a listening socket until the
  process takes them.  Past it a SYN is dropped and its client waits for TCP's first
  retransmission, 1 s later: asyncio's and libzmq's default (100) started half of 200
  producers of one host connecting at once 1 s late (scripts/connect_storm.py).
- **Keepalive**: a connection whose peer vanished without a FIN (a host powered off, a link
  cut for good) on which this side only reads (a producer's PUSH to the ingress, a member's
  to gossip) would stay open for ever, its descriptor and state with it.  After
  ``KEEPALIVE_IDLE_S`` of silence the kernel probes, and a peer that answers none of
  ``KEEPALIVE_PROBES`` probes ``KEEPALIVE_INTERVAL_S`` apart has its connection closed:
  about 2 minutes.  A live peer's kernel answers the probes; nothing reaches the program.
"""

from __future__ import annotations

import socket

import zmq

LISTEN_BACKLOG = 1024
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 6


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on ``sock`` (a connection the event loop speaks on), as this module's
    constants say when it is called."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def set_context_defaults(
    ctx: zmq.Context,
    idle_s: int = KEEPALIVE_IDLE_S,
    interval_s: int = KEEPALIVE_INTERVAL_S,
    probes: int = KEEPALIVE_PROBES,
) -> None:
    """The backlog and keepalive on every socket ``ctx`` makes from now on (pyzmq applies a
    context's options to each new socket)."""
    ctx.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    ctx.setsockopt(zmq.TCP_KEEPALIVE, 1)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval_s)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_CNT, probes)
