"""Run by tests/test_keepalive.py inside a network namespace of its own (``unshare --net``):
a producer connected to a daemon's PULL vanishes without a FIN (nftables drops every packet
from the daemon's port to it, as if its host were gone), and each PULL (the event loop's,
libzmq's) must close that connection.  Keepalive shortened to 1 s idle, 2 probes 1 s apart.
Prints one JSON line: for each side, the seconds until the daemon's end of the connection
left the kernel's established ones, or null if it was still there after 20 s."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.looppull import LoopPullServer
from gossipd.ops import tcpdefaults

IDLE_S, INTERVAL_S, PROBES = 1, 1, 2
WAIT_S = 20.0


def established_from(port: int) -> int:
    """Connections in state ESTABLISHED whose local port is ``port`` (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for row in rows if int(row[1].split(":")[1], 16) == port and row[3] == "01")


def vanish_behind(port: int) -> None:
    """Drop every packet the daemon's port sends (keepalive probes included)."""
    rules = (
        "table inet vanish {\n  chain in {\n    type filter hook input priority 0;\n"
        f"    tcp sport {port} drop\n  }}\n}}\n"
    )
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)


def unvanish() -> None:
    subprocess.run(["nft", "delete", "table", "inet", "vanish"], check=False)


async def until_closed(port: int) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < WAIT_S:
        if not established_from(port):
            return round(time.monotonic() - started, 1)
        await asyncio.sleep(0.1)
    return None


async def connect_and_vanish(
    producer_ctx: zmq.Context, addr: str, got: list[bytes]
) -> tuple[int, zmq.Socket]:
    """A producer's PUSH connects and is read once; then the daemon's packets stop reaching
    it.  Its socket is returned to be kept open (closed, it would send its FIN)."""
    port = int(addr.rsplit(":", 1)[1])
    push = producer_ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(addr)
    push.send(b"hello")
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert got == [b"hello"], got
    assert established_from(port) == 1
    vanish_behind(port)
    return port, push


async def loop_side(producer_ctx: zmq.Context) -> float | None:
    tcpdefaults.KEEPALIVE_IDLE_S = IDLE_S
    tcpdefaults.KEEPALIVE_INTERVAL_S = INTERVAL_S
    tcpdefaults.KEEPALIVE_PROBES = PROBES
    server = LoopPullServer(message_bytes_max=1 << 20)
    got: list[bytes] = []
    addr = server.bind("tcp://127.0.0.1:0")
    server.receive(lambda frames, sender: got.extend(frames), lambda: None)
    port, push = await connect_and_vanish(producer_ctx, addr, got)
    try:
        return await until_closed(port)
    finally:
        unvanish()
        push.close()
        server.close()


async def zmq_side(producer_ctx: zmq.Context) -> float | None:
    ctx = zmq.Context()
    tcpdefaults.set_context_defaults(ctx, IDLE_S, INTERVAL_S, PROBES)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:0")
    addr = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    got: list[bytes] = []

    async def read() -> None:
        while True:
            try:
                got.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                await asyncio.sleep(0.02)

    reader = asyncio.ensure_future(read())
    try:
        port, push = await connect_and_vanish(producer_ctx, addr, got)
        try:
            return await until_closed(port)
        finally:
            push.close()
    finally:
        reader.cancel()
        unvanish()
        ctx.destroy(linger=0)


async def main() -> None:
    producer_ctx = zmq.Context()  # the producer's own: no keepalive of its own
    try:
        out = {"loop": await loop_side(producer_ctx), "zmq": await zmq_side(producer_ctx)}
    finally:
        producer_ctx.destroy(linger=0)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
