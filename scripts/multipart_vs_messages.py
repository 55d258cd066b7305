"""libzmq alone: bursts of small frames PUSH -> PULL on loopback TCP, sent as one multipart
message per burst or one message per frame (issue 27: what replies as separate messages
cost at the ZeroMQ level).  python scripts/multipart_vs_messages.py [BURST] [ROUNDS]"""

from __future__ import annotations

import multiprocessing
import sys
import time
from multiprocessing.connection import Connection

import zmq

N = 200_000
FRAME = b"x" * 90  # about a small Result


def _read(port: int, total: int, out: Connection) -> None:
    """The receiving producer, in a process of its own (no GIL shared with the sender)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://127.0.0.1:{port}")
    pull.recv()  # the warm-up message
    out.send(time.perf_counter())
    got = 0
    while got < total:
        pull.poll(1000)
        while True:
            try:
                pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
    out.send(time.perf_counter())
    pull.close(0)
    ctx.term()


def run(burst: int, multipart: bool) -> float:
    total = N // burst * burst
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    mine, theirs = multiprocessing.Pipe()
    reader = multiprocessing.Process(target=_read, args=(port, total, theirs))
    reader.start()
    push.send(b"w")
    started = mine.recv()
    send, more, last = push.send, int(zmq.SNDMORE) | zmq.NOBLOCK, int(zmq.NOBLOCK)
    for _ in range(total // burst):
        for _ in range(burst - 1):
            send(FRAME, more if multipart else last)
        send(FRAME, last)
        time.sleep(0)  # a loop turn between bursts
    ended = mine.recv()
    reader.join()
    push.close(0)
    ctx.term()
    return total / (ended - started)


if __name__ == "__main__":
    burst = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        a, b = run(burst, True), run(burst, False)
        print(f"burst {burst}: multipart {a:,.0f}/s, messages {b:,.0f}/s, ratio {b / a:.2f}")
