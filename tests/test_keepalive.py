"""A peer that vanishes without a FIN has its connection closed (TCP keepalive,
gossipd/ops/tcpdefaults.py): the daemon only reads from a producer's PUSH and a member's
gossip PUSH, so without keepalive nothing ever told it that such a connection was dead, and
each stayed open for good with its descriptor and state.  tests/vanished_peer.py runs in a
network namespace of its own, where nftables makes the producer vanish."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_connection_whose_producer_vanished_is_closed_by_either_pull() -> None:
    problem = None
    if os.geteuid() != 0:
        problem = "namespaces need root"
    elif shutil.which("unshare") is None or shutil.which("ip") is None:
        problem = "unshare or ip is not installed"
    elif shutil.which("nft") is None:
        problem = "nft is not installed (apt-get install nftables)"
    if problem is not None:
        if os.environ.get("GOSSIPD_REQUIRE_NETNS") == "1":
            pytest.fail(f"GOSSIPD_REQUIRE_NETNS=1 and {problem}")
        pytest.skip(problem)
    script = f"ip link set lo up && exec {sys.executable} {ROOT / 'tests' / 'vanished_peer.py'}"
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", script],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    closed_after_s = json.loads(done.stdout.strip().splitlines()[-1])
    # 1 s idle, then 2 probes 1 s apart: about 3 s (null: still open after 20 s)
    for side in ("loop", "zmq"):
        assert closed_after_s[side] is not None, closed_after_s
        assert closed_after_s[side] < 15, closed_after_s
