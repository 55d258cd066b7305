"""Run by tests/test_dead_peers.py inside a network namespace of its own (``unshare --net``),
with gossipd/ops/tcpdefaults.py's bounds shortened (keepalive after 1 s idle, 2 probes 1 s
apart; unacknowledged data for 1 s closes; a connect waits 1 s).  Prints one JSON line.

- ``vanish``: a producer connected to a daemon's PULL vanishes without a FIN (nftables drops
  every packet from the daemon's port to it, as if its host were gone), and each PULL (the
  event loop's, libzmq's) must close that connection: for each, the seconds until the
  daemon's end left the kernel's established connections, or null if still there after 20 s.
- ``cut``: a member's rpc link (the loop's client and server; libzmq's DEALER and ROUTER) is
  cut both ways for 4 s while a frame is sent, then healed: for each, whether the client's
  connection had been given up by the end of the cut, and the seconds from the heal until a
  frame sent then came back (null: not within 20 s)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.looppull import LoopPullServer
from gossipd.ops import tcpdefaults

WAIT_S = 20.0
CUT_S = 4.0
tcpdefaults.KEEPALIVE_IDLE_S = 1
tcpdefaults.KEEPALIVE_INTERVAL_S = 1
tcpdefaults.KEEPALIVE_PROBES = 2
tcpdefaults.UNACKED_CLOSE_S = 1.0


def established_from(port: int, end: int = 1) -> int:
    """Connections in state ESTABLISHED whose local port (end 1; 2: remote port) is
    ``port`` (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for row in rows if int(row[end].split(":")[1], 16) == port and row[3] == "01")


def vanish_behind(port: int, both_ways: bool = False) -> None:
    """Drop every packet the daemon's port sends (keepalive probes included); both ways:
    and every packet sent to it."""
    to_it = f"    tcp dport {port} drop\n" if both_ways else ""
    rules = (
        "table inet vanish {\n  chain in {\n    type filter hook input priority 0;\n"
        f"    tcp sport {port} drop\n{to_it}  }}\n}}\n"
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
    tcpdefaults.set_context_defaults(ctx)
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


async def cut_and_heal(port: int, send: Callable[[bytes], None], got: list[bytes]) -> dict:
    """The link to ``port`` (up: b"before" came back) cut both ways for CUT_S, a frame sent
    meanwhile; then healed, and a frame sent."""
    vanish_behind(port, both_ways=True)
    try:
        send(b"during")  # written into the cut link: what it does to that link is the point
        await asyncio.sleep(CUT_S)
        given_up = established_from(port, end=2) == 0  # (the client's end: remote port)
    finally:
        unvanish()
    healed = time.monotonic()
    send(b"after")
    while b"after" not in got and time.monotonic() - healed < WAIT_S:
        await asyncio.sleep(0.05)
    back_s = round(time.monotonic() - healed, 1) if b"after" in got else None
    return {"given_up_in_cut": given_up, "back_after_heal_s": back_s}


async def loop_cut() -> dict:
    server = LoopPeerServer(message_bytes_max=1 << 16)
    addr = server.bind("tcp://127.0.0.1:0")
    server.start(lambda identity, frame, sender: server.send(identity, frame), lambda: None)
    got: list[bytes] = []
    client = LoopPeerClient(message_bytes_max=1 << 16)
    client.start(lambda addr, frames: got.extend(frames))
    try:
        client.send(addr, b"before")
        await until(lambda: b"before" in got)
        return await cut_and_heal(int(addr.rsplit(":", 1)[1]), lambda f: client.send(addr, f), got)
    finally:
        client.close()
        server.close()


async def zmq_cut() -> dict:
    ctx = zmq.Context()
    tcpdefaults.set_context_defaults(ctx)
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    dealer.connect(addr)
    got: list[bytes] = []

    async def serve() -> None:
        while True:
            with contextlib.suppress(zmq.Again):
                router.send_multipart(router.recv_multipart(zmq.NOBLOCK))
            try:
                got.append(dealer.recv(zmq.NOBLOCK))
            except zmq.Again:
                await asyncio.sleep(0.01)

    server = asyncio.ensure_future(serve())
    try:
        dealer.send(b"before")
        await until(lambda: b"before" in got)
        return await cut_and_heal(int(addr.rsplit(":", 1)[1]), dealer.send, got)
    finally:
        server.cancel()
        ctx.destroy(linger=0)


async def until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "not within 10 s"
        await asyncio.sleep(0.01)


async def main(mode: str) -> None:
    if mode == "cut":
        out = {"loop": await loop_cut(), "zmq": await zmq_cut()}
    else:
        producer_ctx = zmq.Context()  # the producer's own: no keepalive of its own
        try:
            out = {"loop": await loop_side(producer_ctx), "zmq": await zmq_side(producer_ctx)}
        finally:
            producer_ctx.destroy(linger=0)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
