"""A member's rpc link cut and healed: how long after the network is back a frame gets
through.  Runs itself in a network namespace of its own (``unshare --net``; root), the
event loop's peer client and server on its loopback, nftables dropping the server's port
both ways for ``--cut`` seconds while a frame is sent, then the heal and one frame more.
Prints one JSON line.  bench/README.md, "Cut links".

    .venv/bin/python scripts/cut_link.py [--cut 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gossipd.looppeer import LoopPeerClient, LoopPeerServer


def _cut(port: int) -> None:
    rules = (
        "table inet cut {\n  chain in {\n    type filter hook input priority 0;\n"
        f"    tcp sport {port} drop\n    tcp dport {port} drop\n  }}\n}}\n"
    )
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)


async def measure(cut_s: float) -> dict[str, object]:
    server = LoopPeerServer(message_bytes_max=1 << 16)
    addr = server.bind("tcp://127.0.0.1:0")
    server.start(lambda identity, frame, sender: server.send(identity, frame), lambda: None)
    got: list[bytes] = []
    client = LoopPeerClient(message_bytes_max=1 << 16)
    client.start(lambda a, frames: got.extend(frames))
    try:
        client.send(addr, b"before")
        while b"before" not in got:
            await asyncio.sleep(0.01)
        _cut(int(addr.rsplit(":", 1)[1]))
        client.send(addr, b"during")
        await asyncio.sleep(cut_s)
        subprocess.run(["nft", "delete", "table", "inet", "cut"], check=True)
        healed = time.monotonic()
        client.send(addr, b"after")
        while b"after" not in got and time.monotonic() - healed < 300:
            await asyncio.sleep(0.05)
        return {
            "cut_s": cut_s,
            "after_heal_s": round(time.monotonic() - healed, 2) if b"after" in got else None,
            "arrived": [frame.decode() for frame in got],
        }
    finally:
        client.close()
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cut", type=float, default=60.0)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inside:  # again, in a namespace of its own with its loopback up
        inner = f"ip link set lo up && exec {sys.executable} {__file__} --inside --cut {args.cut}"
        os.execvp("unshare", ["unshare", "--net", "sh", "-c", inner])
    print(json.dumps(asyncio.run(measure(args.cut))))


if __name__ == "__main__":
    main()
