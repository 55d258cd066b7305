"""What a structured output costs the engine that runs it, at the bounds the door takes
(docs/PROTOCOL.md: a schema up to 65536 code points nested up to 64, a regex up to 4096, a
grammar up to 65536, up to 256 choices of 256): one daemon with the vLLM engine on the tiny
model, its HTTP door, the official openai client.

For each form: the wall time of one request of 8 tokens held to it (its compile included:
vLLM compiles a form when its request is scheduled), against the same request free; and the
wall time of a free request sent 50 ms after it, against one sent alone (does a form's
compile hold up the requests of others?).  Medians of the rounds; a form the engine refuses
counts its refusal's time.

    .venv/bin/python scripts/structured_cost.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from gossipd.tools.tinymodel import engine_overrides, make_tiny
from simulations.cluster import Cluster
from tests.helpers import running


def _forms() -> dict[str, dict[str, Any]]:
    """Each as the request's extra body: small ones, then the largest the door takes."""
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(1400)},
        "required": [f"p{i}" for i in range(1400)],
    }
    deep: dict[str, Any] = {"type": "integer"}
    for i in range(60):
        deep = {"type": "object", "properties": {f"k{i}": deep}, "required": [f"k{i}"]}
    many = {"enum": [f"w{i:05d}" for i in range(7000)]}
    rules = "\n".join(f'r{i} ::= "x{i}" | r{i + 1}' for i in range(3000)) + '\nr3000 ::= "end"'
    forms: dict[str, dict[str, Any]] = {
        "json_small": {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "json_wide_1400_properties": {"guided_json": wide},
        "json_deep_60": {"guided_json": deep},
        "json_enum_7000": {"guided_json": many},
        "regex_small": {"guided_regex": "[0-9]{3}-[a-z]{2}"},
        "regex_nested_repeats": {"guided_regex": "((a{1,50}b){1,50}c){1,40}"},
        "regex_alternatives_400": {"guided_regex": "(" + "|".join(f"w{i:04d}" for i in range(400)) + ")"},
        "grammar_3000_rules": {"guided_grammar": "root ::= r0\n" + rules},
        "choice_256_of_256": {"guided_choice": [f"{i:03d}" + "z" * 253 for i in range(256)]},
    }  # fmt: skip
    for name, body in forms.items():
        size = len(json.dumps(next(iter(body.values()))))
        assert size <= 70_000, (name, size)
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = make_tiny(Path(tempfile.mkdtemp(prefix="structured-cost-")) / "tiny", seed=0)
    cluster = Cluster(
        1,
        log_dir=tempfile.mkdtemp(prefix="structured-cost-logs-"),
        extra_overrides=['http.bind="127.0.0.1:0"', "http.request_timeout_s=300",
                         *engine_overrides(model)],
    )  # fmt: skip
    out: dict[str, Any] = {"rounds": args.rounds, "forms": {}}
    with running(cluster, start_timeout_s=180):
        client = openai.OpenAI(
            base_url=f"{cluster.daemons[0].http_url}/v1", api_key="none", max_retries=0,
            timeout=300,
        )  # fmt: skip
        name = client.models.list().data[0].id

        def request(extra: dict[str, Any] | None) -> tuple[float, str]:
            start = time.perf_counter()
            try:
                client.completions.create(
                    model=name, prompt="tell me", max_tokens=8, extra_body=extra or {},
                    temperature=0,
                )  # fmt: skip
                outcome = "ok"
            except openai.APIStatusError as exc:
                outcome = f"{exc.status_code}"
            return time.perf_counter() - start, outcome

        request(None)  # (warm)
        free = [request(None)[0] for _ in range(5)]
        out["free_s"] = statistics.median(free)
        for form, extra in _forms().items():
            alone, beside, outcomes = [], [], set()
            for _ in range(args.rounds):
                took, outcome = request(extra)
                alone.append(took)
                outcomes.add(outcome)
                # The same form again, and a free request 50 ms into it.
                worker = threading.Thread(target=request, args=(extra,))
                worker.start()
                time.sleep(0.05)
                beside.append(request(None)[0])
                worker.join()
            out["forms"][form] = {
                "outcome": sorted(outcomes),
                "request_s": statistics.median(alone),
                "free_request_beside_s": statistics.median(beside),
            }
            if not args.json:
                row = out["forms"][form]
                print(f"{form:28s} {','.join(row['outcome']):8s} its request "
                      f"{row['request_s'] * 1e3:9.1f} ms   a free one beside it "
                      f"{row['free_request_beside_s'] * 1e3:9.1f} ms", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"a free request alone: {out['free_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
