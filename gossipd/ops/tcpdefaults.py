"""What the daemon asks of the kernel for every TCP socket, whoever speaks on it (the event
loop's servers and links, or libzmq's sockets through their context's defaults).

- **The listen backlog**: connections the kernel queues for a listening socket until the
  process takes them.  Past it a SYN is dropped and its client waits for TCP's first
  retransmission, 1 s later: asyncio's and libzmq's default (100) started half of 200
  producers of one host connecting at once 1 s late (scripts/connect_storm.py).
- **Keepalive**: a connection whose peer vanished without a FIN (a host powered off, a link
  cut for good) on which this side only reads (a producer's PUSH to the ingress, a member's
  to gossip) would stay open for ever, its descriptor and state with it.  After
  ``KEEPALIVE_IDLE_S`` of silence the kernel probes, ``KEEPALIVE_INTERVAL_S`` apart; a peer
  that does not answer has its connection closed at the next probe's time (the bound on
  unacknowledged data below ends it there; without that bound, after ``KEEPALIVE_PROBES``
  probes): about 70 s.  A live peer's kernel answers the probes; nothing reaches the
  program.
- **Unacknowledged data** (TCP_USER_TIMEOUT, libzmq's ZMQ_TCP_MAXRT): a connection whose
  written data no ACK has answered for ``UNACKED_CLOSE_S`` is closed (a cut link), instead
  of TCP retransmitting with its backoff for about 15 minutes.  After a cut of a minute the
  next retransmission came about 40 s after the link healed, so a member was unreachable
  that long after it was back (48 s, scripts: bench/README "Cut links"); closed, the link
  is made anew as soon as a connect succeeds.  A peer that is slow to read is not cut: its
  kernel answers the zero-window probes.
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
UNACKED_CLOSE_S = 5.0
CONNECT_TIMEOUT_S = 1.0


def keep_alive(sock: socket.socket) -> None:
    """Keepalive and the bound on unacknowledged data on ``sock`` (a connection the event
    loop speaks on), as this module's constants say when it is called."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(UNACKED_CLOSE_S * 1000))


def set_context_defaults(ctx: zmq.Context) -> None:
    """All of the above on every socket ``ctx`` makes from now on (pyzmq applies a
    context's options to each new socket; a kind's own options, set after, win: gossip's
    TCP_MAXRT of 2 s, a reply socket's ingress.reply_timeout_s)."""
    ctx.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    ctx.setsockopt(zmq.TCP_KEEPALIVE, 1)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    ctx.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    ctx.setsockopt(zmq.TCP_MAXRT, int(UNACKED_CLOSE_S * 1000))
    ctx.setsockopt(zmq.CONNECT_TIMEOUT, int(CONNECT_TIMEOUT_S * 1000))
