"""One hop of the peer channel, the two transports side by side: a request/reply between
two processes through ``ZmqPeerClient``/``ZmqPeerServer`` (libzmq's DEALER/ROUTER, read in
the loop's fd callbacks) and ``LoopPeerClient``/``LoopPeerServer`` (ZMTP spoken by the loop
itself, gossipd/looppeer.py), with and without CURVE.  The server echoes each frame; the
client sends 1 (or 16) at a time and waits for the replies.

Per variant, interleaved rounds, medians over rounds: round trip p50 and p99 (1 at a time),
CPU microseconds per round trip of the client and of the server process (both at 1 and at
16 at a time).  The frame is 300 bytes, about a forwarded completion's.

    .venv/bin/python scripts/peer_hop.py [--rounds 3] [--trips 5000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
import zmq
from zmq.utils import z85

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.peerchannel import PeerClient, PeerServer, ZmqPeerClient, ZmqPeerServer
from gossipd.security import DOMAIN_PEERS, Security, load_key_pair, write_key_pair
from gossipd.sockets import SocketKind, SocketPool
from gossipd.zmtp import PeerCurve

FRAME = b"f" * 300
BYTES_MAX = 1 << 20
VARIANTS = ("zmq", "loop", "zmq+curve", "loop+curve")


def _keys(root: Path) -> None:
    (root / "peers").mkdir()
    (root / "producers").mkdir()
    for name in ("srv", "cli"):
        public, _ = write_key_pair(name, root / "own")
        (root / "peers" / f"{name}.key").write_bytes(public.read_bytes())


def _pair(root: Path, name: str) -> Any:
    return load_key_pair(root / "own" / f"{name}.key_secret")


def _serve(variant: str, root: str, port_q: Any) -> None:
    async def main() -> None:
        ctx = zmq.Context()
        curve = variant.endswith("+curve")
        security = Security(
            curve=curve,
            ctx=ctx,
            key_pair=_pair(Path(root), "srv") if curve else None,
            peer_keys_dir=str(Path(root) / "peers"),
            producer_keys_dir=str(Path(root) / "producers"),
        )
        security.start()
        server: PeerServer
        if variant.startswith("loop"):
            server = LoopPeerServer(message_bytes_max=BYTES_MAX, curve=security.loop_peer_curve())
        else:
            server = ZmqPeerServer(
                ctx,
                message_bytes_max=BYTES_MAX,
                serve_curve=(lambda s: security.serve(s, DOMAIN_PEERS)) if curve else None,
            )
        addr = server.bind("tcp://127.0.0.1:0")

        def echo(identity: bytes, frame: bytes, sender: str) -> None:
            server.send(identity, frame)
            server.flush()

        server.start(echo, lambda: None)
        port_q.put(addr)
        await asyncio.sleep(3600)

    uvloop.run(main())


def _client(variant: str, root: Path) -> tuple[PeerClient, Any]:
    curve = variant.endswith("+curve")
    if variant.startswith("loop"):
        pc = None
        if curve:
            cli, srv = _pair(root, "cli"), _pair(root, "srv")
            pc = PeerCurve(
                z85.decode(cli.public),
                z85.decode(cli.secret),
                server_key=lambda addr: z85.decode(srv.public),
            )
        return LoopPeerClient(message_bytes_max=BYTES_MAX, curve=pc), None
    pool = SocketPool(zmq.Context.instance())
    if curve:
        cli, srv = _pair(root, "cli"), _pair(root, "srv")
        pool.set_curve(
            SocketKind.PEER,
            public=cli.public,
            secret=cli.secret,
            route=lambda addr: (addr, srv.public),
        )
    return ZmqPeerClient(pool), pool


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(variant: str, addr: str, root: Path, pid: int, trips: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    client, pool = _client(variant, root)
    waiting: list[asyncio.Future[None]] = []
    got = [0]
    want = [0]

    def on_replies(a: str, frames: list[bytes]) -> None:
        got[0] += len(frames)
        if got[0] >= want[0] and waiting and not waiting[0].done():
            waiting[0].set_result(None)

    client.start(on_replies)

    async def trip(k: int) -> None:
        waiting[:] = [loop.create_future()]
        want[0] = got[0] + k
        for _ in range(k):
            client.send(addr, FRAME)
        await waiting[0]

    for _ in range(300):  # connect, warm
        await trip(1)
    out: dict[str, float] = {}
    for k in (1, 16):
        rounds = trips // k
        rtts = []
        c0, s0 = time.process_time(), _proc_cpu_s(pid)
        for _ in range(rounds):
            t = time.perf_counter()
            await trip(k)
            rtts.append(time.perf_counter() - t)
        c1, s1 = time.process_time(), _proc_cpu_s(pid)
        n = rounds * k
        out[f"client_cpu_us_{k}"] = (c1 - c0) / n * 1e6
        out[f"server_cpu_us_{k}"] = (s1 - s0) / n * 1e6
        if k == 1:
            rtts.sort()
            out["p50_us"] = rtts[len(rtts) // 2] * 1e6
            out["p99_us"] = rtts[int(len(rtts) * 0.99)] * 1e6
    client.close()
    if pool is not None:
        pool.close_all()
    return out


def one(variant: str, root: Path, trips: int) -> dict[str, float]:
    port_q: Any = mp.Queue()
    server = mp.Process(target=_serve, args=(variant, str(root), port_q), daemon=True)
    server.start()
    try:
        addr = port_q.get(timeout=30)
        assert server.pid is not None
        return uvloop.run(_measure(variant, addr, root, server.pid, trips))
    finally:
        server.kill()
        server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trips", type=int, default=5000, help="round trips per window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gossipd-peer-hop-"))
    _keys(root)
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            print(f"round {r + 1}/{args.rounds}: {v}", file=sys.stderr, flush=True)
            rows[v].append(one(v, root, args.trips))
    medians = {
        v: {k: round(statistics.median(x[k] for x in rows[v]), 1) for k in rows[v][0]}
        for v in VARIANTS
    }
    for base in ("zmq", "zmq+curve"):
        loop_v = base.replace("zmq", "loop")
        medians[loop_v]["p50_ratio_vs_" + base] = round(
            medians[loop_v]["p50_us"] / medians[base]["p50_us"], 3
        )
    report = {"frame_bytes": len(FRAME), "trips": args.trips, "rounds": rows,
              "medians": medians, "load": os.getloadavg()}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'variant':<12} {'p50 us':>7} {'p99 us':>7} {'CPU us/trip c+s, 1':>19} {'16':>7}")
    for v, m in medians.items():
        print(
            f"{v:<12} {m['p50_us']:7.0f} {m['p99_us']:7.0f} "
            f"{m['client_cpu_us_1'] + m['server_cpu_us_1']:19.1f} "
            f"{m['client_cpu_us_16'] + m['server_cpu_us_16']:7.1f}"
        )


if __name__ == "__main__":
    main()
