"""The baseline server: raw pyzmq PULL -> MessagePack decode -> reply -> PUSH to reply_to.

No validation, no admission, no engine: the least a Python server can do per message.
Run as ``python -m gossipd.tools.bench.raw_echo ENDPOINT``; prints "ready" when bound.
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


if __name__ == "__main__":
    main(sys.argv[1])
