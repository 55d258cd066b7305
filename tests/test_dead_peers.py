"""Peers that vanish, and links that are cut and heal (gossipd/ops/tcpdefaults.py).

tests/vanished_peer.py runs in a network namespace of its own, where nftables drops
packets, with the bounds shortened (keepalive after 1 s idle, 2 probes 1 s apart;
unacknowledged data for 1 s closes; a connect waits 1 s):

- a producer that vanished without a FIN: the daemon only reads from a producer's PUSH (and
  from a member's gossip PUSH), so without keepalive nothing ever told it that such a
  connection was dead, and each stayed open for good;
- a member's rpc link cut while a frame was in flight: TCP retransmitted into it with its
  backoff for about 15 minutes, so after a cut of a minute the link came back about 40 s
  after the network did.  Now it is given up during the cut and made anew once the
  network is back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _in_own_namespace(mode: str) -> dict[str, Any]:
    problem = None
    if os.geteuid() != 0:
        problem = "namespaces need root"
    elif shutil.which("unshare") is None or shutil.which("ip") is None:
        problem = "unshare or ip is not installed"
    elif shutil.which("nft") is None:
        problem = "nft is not installed (apt-get install nftables)"
    else:  # root without CAP_SYS_ADMIN (a container), or a kernel without nf_tables
        probe = subprocess.run(["unshare", "--net", "nft", "list", "tables"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        if probe.returncode != 0:
            problem = f"a network namespace with nftables cannot be made here: {probe.stderr}"
    if problem is not None:
        if os.environ.get("GOSSIPD_REQUIRE_NETNS") == "1":
            pytest.fail(f"GOSSIPD_REQUIRE_NETNS=1 and {problem}")
        pytest.skip(problem)
    script = (
        f"ip link set lo up && exec {sys.executable} {ROOT / 'tests' / 'vanished_peer.py'} {mode}"
    )
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", script],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_a_connection_whose_producer_vanished_is_closed_by_either_pull() -> None:
    closed_after_s = _in_own_namespace("vanish")
    # 1 s idle, then a probe unanswered past the 1 s bound (null: still open after 20 s)
    for side in ("loop", "zmq"):
        assert closed_after_s[side] is not None, closed_after_s
        assert closed_after_s[side] < 15, closed_after_s


def test_a_cut_rpc_link_is_given_up_and_made_anew_once_the_network_is_back() -> None:
    outcome = _in_own_namespace("cut")
    for side in ("loop", "zmq"):  # fanout.peer_transport's two channels
        assert outcome[side]["given_up_in_cut"], outcome
        # a connect is tried at least every 1 s + 1 s (the timeout, the reconnect delay)
        back_s = outcome[side]["back_after_heal_s"]
        assert back_s is not None and back_s < 4, outcome
