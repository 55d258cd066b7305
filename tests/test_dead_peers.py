"""Peers that vanish, and links that are cut and heal (gossipd/ops/tcpdefaults.py).

tests/vanished_peer.py runs in a network namespace of its own, where nftables drops
packets, with the bounds shortened (keepalive after 1 s idle, 2 probes 1 s apart;
unacknowledged data for 1 s closes; a connect waits 1 s):

- a producer that vanished without a FIN: the daemon only reads from a producer's PUSH (and
  from a member's gossip PUSH), so without keepalive nothing ever told it that such a
  connection was dead, and each stayed open for good;
- a member's rpc link cut while a frame was in flight: TCP retransmitted into it with its
  backoff, so after a cut of a minute the next try came 48 s after the network was back;
- a member whose loop stopped for seconds: its connection must hold;
- a connect to an unreachable member: retried every second or so, not on SYN backoff."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossipd.ops import tcpdefaults

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


def test_a_cut_rpc_link_holds_and_is_retried_within_a_second_of_the_heal() -> None:
    """TCP's backoff (doubling to 120 s) retried a 9 s cut's data 12.6 s in, 3.6 s after
    the heal (48 s after a 60 s cut); capped at 1 s, within a second.  The connection holds
    and what was written into the cut arrives (a cut over about 14 s closes it: TCP's 15
    retransmissions, 1 s apart)."""
    if not tcpdefaults.retransmit_cap_available():
        pytest.skip("this kernel has no TCP_RTO_MAX_MS (Linux 6.15): TCP's own backoff")
    outcome = _in_own_namespace("cut")
    assert outcome["same_connection"], outcome
    assert outcome["arrived"] == ["before", "during", "after"], outcome
    assert outcome["back_after_heal_s"] is not None and outcome["back_after_heal_s"] < 2.5


def test_a_member_whose_loop_stops_is_not_cut_off_and_gets_what_was_written() -> None:
    """A stopped member (SIGSTOP, swapping) still has its kernel answer, with a closed
    window once its buffers are full.  TCP_USER_TIMEOUT, tried for cut links, closed such a
    connection (Linux 5.11 and later) and lost the 8 MiB written to it: 0 of 64 frames."""
    outcome = _in_own_namespace("stall")
    assert outcome == {"arrived": 64, "same_connection": True}, outcome


def test_a_connect_to_an_unreachable_member_is_tried_again_every_second_or_so() -> None:
    """Its SYNs dropped for 20 s: on the kernel's own retries (1, 2, 4, 8, 16 s apart) the
    frame arrived 15.7 s after the port was reachable again; bounded to 1 s a try, the
    client's next try is at most about 2 s away."""
    outcome = _in_own_namespace("dial")
    assert outcome["arrived_after_heal_s"] is not None, outcome
    assert outcome["arrived_after_heal_s"] < 4, outcome
