"""The baselines: the least a Python process can do per message over the same sockets.

- Echo server: raw pyzmq PULL -> MessagePack decode -> reply -> PUSH to reply_to.  No
  validation, no admission, no engine.
- Relay (``--relay-to ENDPOINT``): PULL -> MessagePack decode (to read the task, as a daemon
  must to place it) -> the same bytes on a PUSH to the echo server, which answers the producer
  directly, as a task's owner does.  Latency through the relay minus latency straight to the
  echo server, at window 1, is one ZeroMQ hop through one Python process on this machine: the
  floor under gossipd's added latency per hop (``gossipd bench route``).

Run as ``python -m gossipd.tools.bench.raw_echo ENDPOINT [--relay-to ENDPOINT]``; prints
"ready" when bound.
"""

from __future__ import annotations

import signal
import sys

import msgpack
import zmq


def main(endpoint: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    replies: dict[str, zmq.Socket] = {}
    print("ready", flush=True)
    while True:
        msg = msgpack.unpackb(pull.recv())
        reply_to = msg["reply_to"]
        sock = replies.get(reply_to)
        if sock is None:
            sock = replies[reply_to] = ctx.socket(zmq.PUSH)
            sock.connect(reply_to)
        words = msg["prompt"].split()
        sock.send(msgpack.packb({"v": 1, "t": 3, "id": msg["id"], "ok": True, "text": words[0]}))


def relay(endpoint: str, to: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(to)
    print("ready", flush=True)
    while True:
        frame = pull.recv()
        msgpack.unpackb(frame)
        push.send(frame)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--relay-to":
        relay(sys.argv[1], sys.argv[3])
    else:
        main(sys.argv[1])
