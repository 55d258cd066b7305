"""`gossipd up --demo --json`: a local cluster driven end to end, with the echo engine (fast).
The same run with vLLM is the README's first command (run by hand: about 3 minutes here)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest

from gossipd.tools.launcher import processes_in_group
from tests.helpers import gossipd_cli

pytestmark = pytest.mark.slow


def up_demo(
    tmp_path: Path, nodes: int, tasks: int, *more: str
) -> tuple[dict[str, Any], CompletedProcess[str]]:
    """`gossipd up --demo --json` with the echo engine: its summary (it exited 0) and the run."""
    done = gossipd_cli(
        "up",
        "--demo",
        "--json",
        "--engine",
        "echo",
        "--nodes",
        str(nodes),
        "--tasks",
        str(tasks),
        *more,
        "--log-dir",
        str(tmp_path),
        timeout_s=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def test_up_demo_kills_and_restarts_a_daemon_and_loses_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    summary, done = up_demo(tmp_path, 3, 200)
    assert summary["nodes"] == 3 and summary["engine"] == "echo"
    assert summary["tasks"] == summary["ok"] == 200
    assert summary["lost"] == 0 and summary["killed"] == 1 and summary["restarted"] == 1
    assert summary["answered_twice"] >= 0 and summary["stopped_clean"] is True
    assert sum(summary["served_by"].values()) == 200
    # The restarted daemon serves again after its restart (its keys come back to it).
    assert summary["served_by_phase"]["after the restart"].get(summary["victim"], 0) > 0
    assert "election off: no etcd" in done.stderr
    # Every daemon's OpenAI-compatible door answered chat completions, placed over members.
    http = summary["http"]
    assert http["requests"] == http["ok"] == 12 and sum(http["served_by"].values()) == 12
    assert set(http["served_by"]) <= {"gpu0", "gpu1", "gpu2"} and len(http["served_by"]) >= 2
    # No process is left of any daemon started (first starts and the restart).
    assert len(summary["pids"]) == 4
    for pid in summary["pids"]:
        assert not processes_in_group(pid), f"processes left in group {pid}"
    assert "leader: none (election off" in summary["final_status"]
    # Issue 24: every daemon in every phase (0 said, not left out), the streamed prompts
    # counted, and the status table's SERVED beside the Results, each daemon named.
    names = ["gpu0", "gpu1", "gpu2"]
    phases = summary["served_by_phase"]
    assert list(phases) == [
        "streamed prompts",
        "before the kill",
        "victim down",
        "after the restart",
    ]
    assert all(sorted(counts) == names for counts in phases.values()), phases
    assert sum(phases["streamed prompts"].values()) == 3
    assert summary["results_by_daemon"] == {
        n: summary["served_by"].get(n, 0) + phases["streamed prompts"][n] for n in names
    }
    since_start = summary["served_since_start"]
    assert sorted(since_start) == names and all(isinstance(v, int) for v in since_start.values())
    for n in names:
        if n != summary["victim"]:  # it ran what it sent, and maybe more (answered twice)
            assert since_start[n] >= summary["results_by_daemon"][n], summary


def test_up_with_etcd_elects_a_leader_that_status_names(tmp_path, etcd) -> None:  # type: ignore[no-untyped-def]
    summary, done = up_demo(tmp_path, 2, 60, "--etcd", ",".join(etcd.endpoints))
    assert summary["tasks"] == summary["ok"] == 60 and summary["lost"] == 0
    assert "election through etcd" in done.stderr
    # The asked daemon names the leader it follows and its term (the fencing token > 0).
    leader = re.search(r"leader: (gpu[01]) \(term (\d+)\)", summary["final_status"])
    assert leader is not None, summary["final_status"]
    assert int(leader.group(2)) > 0


def test_up_stops_every_daemon_on_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gossipd",
            "up",
            "--engine",
            "echo",
            "--nodes",
            "2",
            "--log-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:  # the live view starts once every daemon serves
            lines.append(line)
            if line.startswith("live status") or time.monotonic() > deadline:
                break
        assert any(line.startswith("live status") for line in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert "stopped: 2 daemons, no process left" in text
    pids = [int(p) for p in re.findall(r"serving on \S+ \(\d+ s, pid (\d+)\)", text)]
    assert len(pids) == 2
    for pid in pids:
        assert not processes_in_group(pid)


def test_up_says_which_daemons_are_still_starting_while_it_waits(tmp_path: Path) -> None:
    """Issue 24: vLLM's load (minutes on CPUs) printed nothing until "serving". A daemon held
    stopped (SIGSTOP) never serves: wait_ready says every heartbeat that it still starts."""
    import io

    from gossipd.tools.up import LocalCluster, Say

    cluster = LocalCluster(1, engine_overrides=["engine.kind=echo"], log_dir=tmp_path)
    daemon = cluster.daemons[0]
    cluster.launch(daemon)
    daemon.pause()
    out = io.StringIO()
    try:
        with pytest.raises(TimeoutError, match="gpu0 did not start"):
            cluster.wait_ready([daemon], 1.0, Say(out), heartbeat_s=0.3)
    finally:
        daemon.resume()
        cluster.stop(timeout_s=15)
    notes = [x for x in out.getvalue().splitlines() if "gpu0 still starting" in x]
    assert len(notes) >= 2, out.getvalue()
