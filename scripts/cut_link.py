"""A member's rpc link cut and healed: how long after the network is back a frame gets
through.  ``tests/vanished_peer.py cut SECONDS`` (the measurement tests/test_dead_peers.py
makes with a 9 s cut), in a network namespace of its own (``unshare --net``; root): the
event loop's peer client and server on its loopback, nftables dropping the server's port
both ways for ``--cut`` seconds while a frame is sent, then the heal and one frame more.
Prints its JSON line: whether the connection held, the seconds from the heal until the last
frame came back, and which frames arrived.  bench/README.md, "Cut links".

    .venv/bin/python scripts/cut_link.py [--cut 60]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MEASURE = Path(__file__).resolve().parent.parent / "tests" / "vanished_peer.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cut", type=float, default=60.0)
    args = ap.parse_args()
    inner = f"ip link set lo up && exec {sys.executable} {MEASURE} cut {args.cut}"
    os.execvp("unshare", ["unshare", "--net", "sh", "-c", inner])


if __name__ == "__main__":
    main()
