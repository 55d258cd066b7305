"""Medians and ratios of a scripts/bench_paired.sh run: `python scripts/paired_summary.py
OUT/paired.jsonl [--json]`.  Throughput is the figure each bench reports (route: the
cluster's tasks/s at window 300; ingress: the daemon's tasks/s); the hop overhead is route's
added latency per forward hop at window 1."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def figures(report: dict) -> dict[str, float]:  # type: ignore[type-arg]
    if report["benchmark"] == "route":
        return {
            "route_tasks_per_s": report["cluster_tasks_per_s"],
            "route_hop_p50_ms": report["hop_overhead_ms"]["p50"],
            "route_hop_p99_ms": report["hop_overhead_ms"]["p99"],
        }
    return {"ingress_tasks_per_s": report["daemon"]["tasks_per_s"]}


def main(path: str, as_json: bool) -> None:
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    failed = 0
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["report"] is None:
            failed += 1
            continue
        for name, value in figures(row["report"]).items():
            runs[name][row["tree"]].append(value)
    out = {"failed_runs": failed}
    for name, by_tree in sorted(runs.items()):
        base, head = statistics.median(by_tree["base"]), statistics.median(by_tree["head"])
        out[name] = {
            "base_median": round(base, 3),
            "head_median": round(head, 3),
            "head_over_base": round(head / base, 3),
            "runs": {t: len(v) for t, v in by_tree.items()},
        }
    if as_json:
        print(json.dumps(out))
        return
    for name, row in out.items():
        print(f"{name}: {row}")


if __name__ == "__main__":
    main(sys.argv[1], "--json" in sys.argv)
