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


def test_bench_hedge_json_reports_both_modes_with_nothing_lost() -> None:
    proc = gossipd_cli(
        "bench", "hedge", "--json", "--rate", "100", "--seconds", "2.5", "--stall-ms", "800",
        timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    off, on = report["runs"]
    assert (off["hedge"], on["hedge"]) == (False, True)
    for run in (off, on):
        assert run["tasks"] == 250 and run["lost"] == 0 and run["answered"] == 250
        assert run["sent_to_stalled_owner_during_stall"]["n"] > 0
    assert off["fanout"]["hedged"] == 0 and on["fanout"]["hedged"] > 0
    ratio = (
        on["sent_to_stalled_owner_during_stall"]["p50_ms"]
        / off["sent_to_stalled_owner_during_stall"]["p50_ms"]
    )
    assert abs(report["during_stall_p50_ratio_on_vs_off"] - ratio) < 0.01
