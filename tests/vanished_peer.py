"""Run by tests/test_dead_peers.py (and scripts/cut_link.py) inside a network namespace of
its own (``unshare --net``), gossipd/ops/tcpdefaults.py's bounds as they are but where
said; nftables drops packets.  Prints one JSON line.

- ``vanish`` (keepalive shortened: 1 s idle, 2 probes 1 s apart): a producer connected to a daemon's PULL vanishes without a FIN (every packet
  from the daemon's port to it dropped, as if its host were gone), and each PULL (the event
  loop's, libzmq's) must close that connection: for each, the seconds until the daemon's end
  left the kernel's established connections, or null if still there after 20 s.
- ``cut [SECONDS]``: a member's rpc link (the loop's client and server) cut both ways for
  CUT_S (or SECONDS) while a frame is sent, then healed and one more sent (``loop_cut``).
- ``stall``: a member whose loop stops while 8 MiB are written to it (``loop_stall``).
- ``dial``: a member's rpc port unreachable while a connect is tried (``loop_dial``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.looppull import LoopPullServer
from gossipd.ops import tcpdefaults

WAIT_S = 20.0
CUT_S = 9.0  # (TCP's backoff would retry 12.6 s in: 3.6 s after the heal; SYNs 15 s in)
STALL_S = 7.0
DIAL_CUT_S = 20.0  # (SYNs 15 and 31 s in: 11 s after the heal without the connect bound)


def established() -> list[tuple[int, int]]:
    """(local port, remote port) of each connection in state ESTABLISHED (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [(int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16))
            for row in rows if row[3] == "01"]  # fmt: skip


def established_from(port: int) -> int:
    """Connections established whose local port is ``port``."""
    return sum(1 for local, _ in established() if local == port)


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


async def loop_cut(cut_s: float = CUT_S) -> dict:
    """A member's rpc link (the loop's client and server, up: b"before" came back) cut both
    ways for ``cut_s`` while a frame is sent, then healed and a frame sent: whether the link
    held, the seconds from the heal until that frame came back, and what arrived."""
    server = LoopPeerServer(message_bytes_max=1 << 16)
    addr = server.bind("tcp://127.0.0.1:0")
    port = int(addr.rsplit(":", 1)[1])
    server.start(lambda identity, frame, sender: server.send(identity, frame), lambda: None)
    got: list[bytes] = []
    client = LoopPeerClient(message_bytes_max=1 << 16)
    client.start(lambda addr, frames: got.extend(frames))
    try:
        client.send(addr, b"before")
        await until(lambda: b"before" in got)
        client_port = client_end(port)
        vanish_behind(port, both_ways=True)
        try:
            client.send(addr, b"during")  # into the cut: TCP retransmits it, backing off
            await asyncio.sleep(cut_s)
        finally:
            unvanish()
        healed = time.monotonic()
        client.send(addr, b"after")
        while b"after" not in got and time.monotonic() - healed < WAIT_S:
            await asyncio.sleep(0.05)
        back_s = round(time.monotonic() - healed, 1) if b"after" in got else None
        return {
            "same_connection": client_end(port) == client_port,
            "back_after_heal_s": back_s,
            "arrived": [frame.decode() for frame in got],
        }
    finally:
        client.close()
        server.close()


def client_end(port: int) -> int | None:
    """The local port of the one established connection to ``port`` (None: none)."""
    ends = [local for local, remote in established() if remote == port]
    return ends[0] if len(ends) == 1 else None


async def loop_stall() -> dict:
    """A member whose whole loop stops for STALL_S (as a stopped or swapping process): the
    rpc client writes 8 MiB to it meanwhile, past every buffer (its window closes).  What it
    wrote must arrive once it runs again, on the same connection."""
    ready, box = threading.Event(), {}

    def member() -> None:
        async def main() -> None:
            server = LoopPeerServer(message_bytes_max=1 << 20)
            box["addr"] = server.bind("tcp://127.0.0.1:0")
            got: list[int] = []
            box["got"] = got
            server.start(lambda identity, frame, sender: got.append(len(frame)), lambda: None)
            ready.set()
            while not box.get("stop"):
                await asyncio.sleep(0.02)
                if "stall_s" in box:
                    time.sleep(box.pop("stall_s"))  # the loop stopped: nothing read
            server.close()

        asyncio.run(main())

    thread = threading.Thread(target=member, daemon=True)
    thread.start()
    ready.wait(10)
    addr = box["addr"]
    client = LoopPeerClient(message_bytes_max=1 << 20)
    client.start(lambda addr, frames: None)
    try:
        client.send(addr, b"x")
        await until(lambda: len(box["got"]) == 1)
        client_port = client_end(int(addr.rsplit(":", 1)[1]))
        box["stall_s"] = STALL_S
        await asyncio.sleep(0.1)
        for _ in range(64):
            client.send(addr, b"y" * (128 * 1024))
        await asyncio.sleep(STALL_S)
        deadline = time.monotonic() + WAIT_S
        while len(box["got"]) < 65 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {
            "arrived": len(box["got"]) - 1,
            "same_connection": client_end(int(addr.rsplit(":", 1)[1])) == client_port,
        }
    finally:
        box["stop"] = True
        client.close()
        thread.join(10)


async def loop_dial() -> dict:
    """A member's rpc port unreachable (its SYNs dropped) for DIAL_CUT_S while a frame waits
    to go, then reachable: the seconds from then until the frame arrived."""
    server = LoopPeerServer(message_bytes_max=1 << 16)
    addr = server.bind("tcp://127.0.0.1:0")
    got: list[bytes] = []
    server.start(lambda identity, frame, sender: got.append(frame), lambda: None)
    client = LoopPeerClient(message_bytes_max=1 << 16)
    client.start(lambda addr, frames: None)
    vanish_behind(int(addr.rsplit(":", 1)[1]), both_ways=True)
    try:
        client.send(addr, b"waiting")
        await asyncio.sleep(DIAL_CUT_S)
    finally:
        unvanish()
    healed = time.monotonic()
    try:
        while not got and time.monotonic() - healed < WAIT_S:
            await asyncio.sleep(0.05)
        return {"arrived_after_heal_s": round(time.monotonic() - healed, 1) if got else None}
    finally:
        client.close()
        server.close()


async def until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "not within 10 s"
        await asyncio.sleep(0.01)


async def main(mode: str, cut_s: float = CUT_S) -> None:
    if mode == "cut":
        out = await loop_cut(cut_s)
    elif mode == "stall":
        out = await loop_stall()
    elif mode == "dial":
        out = await loop_dial()
    else:  # keepalive shortened: 1 s idle, 2 probes 1 s apart
        tcpdefaults.KEEPALIVE_IDLE_S = 1
        tcpdefaults.KEEPALIVE_INTERVAL_S = 1
        tcpdefaults.KEEPALIVE_PROBES = 2
        producer_ctx = zmq.Context()  # the producer's own: no keepalive of its own
        try:
            out = {"loop": await loop_side(producer_ctx), "zmq": await zmq_side(producer_ctx)}
        finally:
            producer_ctx.destroy(linger=0)
    print(json.dumps(out))


if __name__ == "__main__":  # MODE [CUT_S]: scripts/cut_link.py runs "cut" for as long
    asyncio.run(main(sys.argv[1], *(float(arg) for arg in sys.argv[2:3])))
