"""`gossipd up --demo --json`: a local cluster driven end to end, with the echo engine (fast).
The same run with vLLM is the README's first command (run by hand: about 3 minutes here)."""

from __future__ import annotations

import json

import pytest

from gossipd.tools.launcher import processes_in_group
from tests.helpers import gossipd_cli

pytestmark = pytest.mark.slow


def test_up_demo_kills_and_restarts_a_daemon_and_loses_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = gossipd_cli(
        "up",
        "--demo",
        "--json",
        "--engine",
        "echo",
        "--nodes",
        "3",
        "--tasks",
        "200",
        "--log-dir",
        str(tmp_path),
        timeout_s=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["nodes"] == 3 and summary["engine"] == "echo"
    assert summary["tasks"] == summary["ok"] == 200
    assert summary["lost"] == 0 and summary["killed"] == 1 and summary["restarted"] == 1
    assert summary["answered_twice"] >= 0 and summary["stopped_clean"] is True
    assert sum(summary["served_by"].values()) == 200
    # The restarted daemon serves again after its restart (its keys come back to it).
    assert summary["served_by_phase"]["after the restart"].get(summary["victim"], 0) > 0
    assert "election off: no etcd" in done.stderr
    # No process is left of any daemon started (first starts and the restart).
    assert len(summary["pids"]) == 4
    for pid in summary["pids"]:
        assert not processes_in_group(pid), f"processes left in group {pid}"
