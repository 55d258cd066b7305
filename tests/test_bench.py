"""The benchmark commands run and report comparable figures (no timing is asserted here:
performance lives in the benchmarks' output, not in pass/fail)."""

from __future__ import annotations

import json

from tests.helpers import gossipd_cli


def test_bench_ingress_json_reports_both_sides_and_their_ratio() -> None:
    proc = gossipd_cli(
        "bench", "ingress", "--json", "--tasks", "2000", "--repeats", "1", timeout_s=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    for side in ("raw_zmq", "daemon"):
        assert report[side]["ok"] == 2000
        assert report[side]["tasks_per_s"] > 0
        assert report[side]["p99_ms"] >= report[side]["p50_ms"] > 0
    ratio = report["daemon"]["tasks_per_s"] / report["raw_zmq"]["tasks_per_s"]
    assert abs(report["ratio_vs_raw_zmq"] - ratio) < 0.01
