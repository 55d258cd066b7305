"""`gossipd bench http`: the run itself, briefly (direct and gossipd: CI installs no router),
and its pure parts (how the load is split, the figures and goals, a missing router)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gossipd.tools.bench.http import REFERENCE, _figures, _goals, plot, ratio_c16, round_ratios
from gossipd.tools.bench.http_peers import (
    ROUTERS,
    Window,
    cpu_s,
    pooled_percentile,
    routers_of,
    split_load,
)
from tests.helpers import gossipd_cli


def _wrk_or_skip() -> None:
    if shutil.which("wrk") is None:
        if os.environ.get("GOSSIPD_REQUIRE_WRK") == "1":
            pytest.fail("GOSSIPD_REQUIRE_WRK=1 and wrk is not installed (apt-get install wrk)")
        pytest.skip("wrk is not installed (apt-get install wrk)")


def test_bench_http_measures_gossipd_through_its_doors_beside_a_stub_alone() -> None:
    _wrk_or_skip()
    proc = gossipd_cli(
        "bench", "http", "--json", "--repeats", "1", "--seconds", "1",
        "--concurrency", "1,16", timeout_s=180,
    )  # fmt: skip
    # 1 (not 0) when the daemons did not serve HTTP: the report then says why.
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-2000:])
    report = json.loads(proc.stdout)
    assert report["not_measured"] == {}
    assert set(report["variants"]) == {"direct", "gossipd"}
    for name in ("direct", "gossipd"):
        for c in ("c1", "c16"):
            fig = report["variants"][name][c]
            assert fig["req_per_s"] > 0 and fig["requests"] > 0, (name, c, fig)
            assert fig["errors"] == 0, (name, c, fig)
            assert fig["p99_us"] >= fig["p50_us"] > 0, (name, c, fig)
    assert "gossipd" in report["added_p50_us_c1"]
    assert report["cpu_us_per_req"]["gossipd"]["c16"] > 0
    # Keyed by x-session-id over 2 daemons: about half are forwarded to the other.
    assert 0.25 <= report["gossipd_forwarded_fraction"] <= 0.75, report
    # No vllm-router measured: the headline ratio is null, not a crash.
    assert report["ratio_vs_vllm_router_c16"] is None
    assert report["ratio_vs_vllm_router_c16_rounds"] == []
    assert report["fair"] and all(isinstance(line, str) for line in report["fair"])
    # At c=1 each path alone, through the first door: its own keys (probed) kept apart.
    by_path = report["gossipd_c1_by_path"]
    assert set(by_path) == {"local", "forwarded"}, by_path
    for f in by_path.values():
        assert f["req_per_s"] > 0 and f["cpu_us_per_req"] > 0, by_path
        assert f["added_p50_us"] is not None, by_path
    # A forwarded request makes one more hop (to the owner and back) than a local one.
    assert by_path["forwarded"]["p50_us"] > by_path["local"]["p50_us"], by_path


def test_bench_http_without_wrk_says_how_to_get_it_before_starting_anything() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gossipd", "bench", "http"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert proc.returncode == 2
    assert "apt-get install wrk" in proc.stderr and "bench http 1/" not in proc.stderr


def test_a_missing_router_names_the_pip_command_that_installs_it(tmp_path: Path) -> None:
    why = ROUTERS[0].missing(tmp_path / "nowhere")
    assert why is not None and "pip install vllm-router" in why
    assert "python3 -m venv" in why


@pytest.mark.parametrize(
    ("peers", "names"),
    [
        ("all", ["vllm-router:round_robin", "vllm-router:consistent_hash",
                 "sglang-router:round_robin"]),
        ("routers", ["vllm-router:round_robin", "vllm-router:consistent_hash",
                     "sglang-router:round_robin"]),
        ("vllm-router", ["vllm-router:round_robin", "vllm-router:consistent_hash"]),
        ("sglang-router", ["sglang-router:round_robin"]),
    ],
)  # fmt: skip
def test_routers_of(peers: str, names: list[str]) -> None:
    assert [r.name for r in routers_of(peers)] == names


@pytest.mark.parametrize(
    ("entry_points", "connections", "split"),
    [
        (1, 1, [(1, 1)]),
        (1, 16, [(2, 16)]),
        (1, 64, [(2, 64)]),
        (2, 1, [(1, 1)]),  # one connection: the first door only
        (2, 16, [(1, 8), (1, 8)]),
        (2, 64, [(1, 32), (1, 32)]),
        (2, 5, [(1, 3), (1, 2)]),
        # An odd count on one wrk process: one thread (wrk gives each thread c // threads,
        # so 2 threads would open one connection fewer than asked).
        (1, 3, [(1, 3)]),
        (1, 17, [(1, 17)]),
    ],
)
def test_split_load(entry_points: int, connections: int, split: list[tuple[int, int]]) -> None:
    assert split_load(entry_points, connections) == split


def _w(req: int, p50: float, p99: float, cpu_s: float = 0.0) -> Window:
    return Window(requests=req, seconds=1.0, p50_us=p50, p99_us=p99, errors=0, cpu_s=cpu_s)


def test_figures_take_medians_and_pair_each_round_with_direct() -> None:
    windows = {
        "direct": {1: [_w(10_000, 70, 100), _w(12_000, 80, 120), _w(11_000, 60, 90)]},
        "gossipd": {
            1: [_w(5_000, 170, 300, 0.5), _w(6_000, 150, 320, 0.6), _w(4_000, 200, 310, 0.4)]
        },
    }
    figs = _figures(windows, [1])
    assert figs["direct"]["c1"]["req_per_s"] == 11_000
    assert figs["direct"]["c1"]["cpu_us_per_req"] is None
    g = figs["gossipd"]["c1"]
    assert g["req_per_s"] == 5_000 and g["p50_us"] == 170
    # Per round: 100, 70, 140 -> median 100 (not 170 - 70 from the medians, also 100 here);
    # p99: 200, 200, 220 -> 200.
    assert g["added_p50_us"] == 100 and g["added_p99_us"] == 200
    assert g["cpu_us_per_req"] == 100.0  # 0.5 s / 5,000, 0.6 / 6,000, 0.4 / 4,000


def test_goals_compare_gossipd_with_every_peer_measured() -> None:
    report = {
        "ratio_vs_vllm_router_c16": 1.6,
        "added_p50_us_c1": {"gossipd": 50.0, "vllm-router:round_robin": 90.0},
        "cpu_us_per_req": {
            "gossipd": {"c1": 40.0, "c16": 30.0},
            "vllm-router:round_robin": {"c1": 100.0, "c16": 29.0},
        },
    }
    goals = _goals(report)
    assert goals["ratio_vs_vllm_router_c16"]["met"] is True
    assert goals["added_p50_c1_below_every_peer"]["met"] is True
    assert goals["cpu_per_req_below_every_peer"]["met"] is False  # 30 vs 29 at c16
    alone = _goals(
        {"ratio_vs_vllm_router_c16": None, "added_p50_us_c1": {"gossipd": 5.0},
         "cpu_us_per_req": {"gossipd": {"c1": 1.0}}}
    )  # fmt: skip
    assert all(g["met"] is None for g in alone.values())


def test_round_ratios_pair_each_round_of_two_variants() -> None:
    mine = {"req_per_s_rounds": [13_000, 12_000, 12_900]}
    ref = {"req_per_s_rounds": [14_800, 13_900, 9_900]}
    # Round by round, not median over median: 0.878, 0.863, 1.303 (the medians give 0.928).
    assert round_ratios(mine, ref) == [0.878, 0.863, 1.303]
    assert round_ratios(mine, {"req_per_s_rounds": [0, 10_000]}) == [1.2]  # 0: no ratio
    assert round_ratios(None, ref) == [] and round_ratios(mine, None) == []


def test_the_headline_ratio_is_the_median_of_the_rounds_ratios() -> None:
    figures = {
        "gossipd": {"c16": {"req_per_s": 12_900, "req_per_s_rounds": [13_000, 12_000, 12_900]}},
        REFERENCE: {"c16": {"req_per_s": 13_900, "req_per_s_rounds": [14_800, 13_900, 9_900]}},
    }
    r = ratio_c16(figures)
    # Rounds 0.878, 0.863, 1.303: their median 0.878, where the medians give 0.928 (the
    # router's median from its second round, gossipd's from its third).
    assert r["ratio_vs_vllm_router_c16"] == 0.878
    assert r["ratio_vs_vllm_router_c16_rounds"] == [0.878, 0.863, 1.303]
    assert r["ratio_of_medians_vs_vllm_router_c16"] == 0.928
    assert ratio_c16({"gossipd": figures["gossipd"]}) == {
        "ratio_vs_vllm_router_c16": None,
        "ratio_vs_vllm_router_c16_rounds": [],
        "ratio_of_medians_vs_vllm_router_c16": None,
    }


def _wrk_figures(samples: list[int]) -> dict[str, object]:
    """What the bench's Lua prints of these latencies: wrk's percentile (nearest rank) at
    every 0.1%, and the count."""
    ordered = sorted(samples)

    def at(q: float) -> int:
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]

    return {
        "requests": len(ordered),
        "p50_us": at(50),
        "p99_us": at(99),
        "per_mille_us": [at(k / 10) for k in range(1, 1000)],
    }


def test_percentiles_of_two_wrk_processes_are_pooled_not_averaged() -> None:
    rng = random.Random(7)
    fast = [rng.randint(100, 200) for _ in range(1_000)]  # one entry point's answers
    slow = [rng.randint(300, 400) for _ in range(3_000)]  # the other's, three times as many
    figs = [_wrk_figures(fast), _wrk_figures(slow)]
    both = sorted(fast + slow)
    true_p50, true_p99 = both[len(both) // 2 - 1], both[math.ceil(0.99 * len(both)) - 1]
    p50, p99 = pooled_percentile(figs, 500), pooled_percentile(figs, 990)
    assert abs(p50 - true_p50) <= 2 and abs(p99 - true_p99) <= 2, (p50, true_p50, p99, true_p99)
    # the weighted mean of the two medians (0.25 x ~150 + 0.75 x ~350 = ~300) is no request's
    weighted = sum(f["requests"] * f["p50_us"] for f in figs) / len(both)  # type: ignore[operator]
    assert abs(weighted - true_p50) > 20
    # one process alone: wrk's own figures
    for f in figs:
        assert pooled_percentile([f], 500) == f["p50_us"]
        assert pooled_percentile([f], 990) == f["p99_us"]
    assert pooled_percentile([{"requests": 0, "per_mille_us": [0] * 999}], 500) == 0.0


def test_cpu_counts_a_child_that_ended_in_the_window_and_refuses_a_gone_process() -> None:
    before = cpu_s([os.getpid()])
    child = subprocess.run(  # about 0.3 s of CPU, then waited for (its CPU moves to us)
        [sys.executable, "-c", "import time\nt = time.process_time()\n"
         "while time.process_time() - t < 0.3: pass"],
        check=True,
    )  # fmt: skip
    assert child.returncode == 0
    assert cpu_s([os.getpid()]) - before >= 0.25
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match=f"process {gone.pid} ended"):
        cpu_s([gone.pid])


def test_the_plot_is_written_where_asked_with_each_paths_point(tmp_path: Path) -> None:
    fig = {"req_per_s": 1000.0}
    report = {
        "concurrency": [1, 16],
        "rounds": 1,
        "seconds_per_window": 1,
        "variants": {"direct": {"c1": fig, "c16": fig}, "gossipd": {"c1": fig, "c16": fig}},
        "gossipd_c1_by_path": {"local": {"req_per_s": 1500.0}, "forwarded": {"req_per_s": 500.0}},
    }
    out = tmp_path / "bench-http.png"
    plot(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "forwarded.png").exists() and sorted(tmp_path.iterdir()) == [out]
