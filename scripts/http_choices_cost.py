"""One OpenAI request of several prompts against as many requests of one, on two daemons with
the echo engine (no token delay), through the first one's HTTP door with the official openai
client: wall time a batch and the daemons' CPU a prompt, rounds alternating, medians.

    .venv/bin/python scripts/http_choices_cost.py [--prompts 20] [--rounds 5] [--json]

What LangChain's OpenAI sends for a batch is the first (a list of prompts, batch_size 20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from simulations.cluster import Cluster
from tests.helpers import running


def _cpu_s(pids: list[int]) -> float:
    used = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        used += int(fields[11]) + int(fields[12])  # utime + stime
    return used / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=0.6, help="each way, each round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = [f"prompt number {i} with some words" for i in range(args.prompts)]
    cluster = Cluster(
        2,
        log_dir=tempfile.mkdtemp(prefix="choices-cost-"),
        extra_overrides=['http.bind="127.0.0.1:0"', "engine.token_delay_s=0",
                         f"http.choices_max={max(64, args.prompts)}"],
    )  # fmt: skip
    figures: dict[str, list[float]] = {k: [] for k in ("one", "each", "one_cpu", "each_cpu")}
    with running(cluster):
        pids = [d.proc.pid for d in cluster.daemons if d.proc is not None]
        client = openai.OpenAI(
            base_url=f"{cluster.daemons[0].http_url}/v1", api_key="none", max_retries=0
        )

        def one() -> None:
            client.completions.create(model="echo", prompt=prompts, max_tokens=16)

        def each() -> None:
            for prompt in prompts:
                client.completions.create(model="echo", prompt=prompt, max_tokens=16)

        for _ in range(10):
            one()
            each()
        for round_ in range(args.rounds):
            for way, call in (("one", one), ("each", each)) if round_ % 2 else (
                ("each", each), ("one", one)
            ):  # fmt: skip
                calls, cpu0, t0 = 0, _cpu_s(pids), time.perf_counter()
                while time.perf_counter() - t0 < args.window_s:
                    call()
                    calls += 1
                wall, cpu = time.perf_counter() - t0, _cpu_s(pids) - cpu0
                figures[way].append(wall / calls * 1e3)
                figures[way + "_cpu"].append(cpu / calls / len(prompts) * 1e6)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    report = {
        "prompts": args.prompts,
        "ms_a_batch": {"one_request": medians["one"], "a_request_each": medians["each"]},
        "daemons_cpu_us_a_prompt": {
            "one_request": medians["one_cpu"],
            "a_request_each": medians["each_cpu"],
        },
        "rounds": figures,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.prompts} prompts, medians of {args.rounds} rounds:")
    print(f"  one request of {args.prompts}: {medians['one']:.2f} ms, "
          f"{medians['one_cpu']:.1f} us of the daemons' CPU a prompt")  # fmt: skip
    print(f"  a request each, in turn: {medians['each']:.2f} ms, "
          f"{medians['each_cpu']:.1f} us a prompt")  # fmt: skip


if __name__ == "__main__":
    main()
