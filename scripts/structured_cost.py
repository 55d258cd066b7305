"""What a structured output costs the engine that runs it, at the bounds the door takes
(docs/PROTOCOL.md: a schema up to 65536 code points nested up to 64, a regex up to 4096, a
grammar up to 65536, up to 256 choices of 256): one daemon with the vLLM engine on the tiny
model, its HTTP door, the official openai client.

For each form: the wall time of one request of 8 tokens held to it (its compile included:
vLLM compiles a form when its request is scheduled, and keeps it by its text, so each round
sends one made new: what a hostile client would do), against the same request free; and
the wall time of a free request sent 50 ms after another new one (does a form's compile
hold up the requests of others?).  Medians of the rounds; a form the engine refuses
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
    many = {"enum": [f"w{i:05d}" for i in range(6500)]}
    rules = "\n".join(f'r{i} ::= "x{i}" | r{i + 1}' for i in range(2500)) + '\nr2500 ::= "end"'
    forms: dict[str, dict[str, Any]] = {
        "json_small": {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "json_wide_1400_properties": {"guided_json": wide},
        "json_deep_60": {"guided_json": deep},
        "json_enum_6500": {"guided_json": many},
        "regex_small": {"guided_regex": "[0-9]{3}-[a-z]{2}"},
        "regex_nested_repeats": {"guided_regex": "((a{1,50}b){1,50}c){1,40}"},
        "regex_alternatives_400": {"guided_regex": "(" + "|".join(f"w{i:04d}" for i in range(400)) + ")"},
        "grammar_2500_rules": {"guided_grammar": "root ::= r0\n" + rules},
        "choice_256_of_256": {"guided_choice": [f"{i:03d}" + "z" * 253 for i in range(256)]},
    }  # fmt: skip
    bounds = {"guided_json": 65536, "guided_grammar": 65536, "guided_regex": 4096}
    for name, body in forms.items():  # (each within what the door takes)
        ((field, value),) = body.items()
        if field in bounds:
            text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
            assert len(text) <= bounds[field], (name, len(text))
    return forms


def _salted(extra: dict[str, Any], salt: int) -> dict[str, Any]:
    """``extra``'s form made unlike any before (vLLM keeps compiled forms by their text: a
    client sending a new one each time makes it compile each time)."""
    ((field, value),) = extra.items()
    if field == "guided_json":
        return {field: {"anyOf": [value, {"const": f"salt-{salt}"}]}}
    if field == "guided_grammar":
        return {field: value.replace("root ::= ", f'root ::= "s{salt}" | ', 1)}
    if field == "guided_regex":
        return {field: f"(s{salt}|{value})"}
    return {field: [*value[:-1], f"salt-{salt}"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="forms whose name holds this")
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
            if args.only not in form:
                continue
            alone, beside, outcomes = [], [], set()
            for r in range(args.rounds):
                took, outcome = request(_salted(extra, 2 * r))
                alone.append(took)
                outcomes.add(outcome)
                # A form like it, new too, and a free request 50 ms into its compile.
                worker = threading.Thread(target=request, args=(_salted(extra, 2 * r + 1),))
                worker.start()
                time.sleep(0.05)
                beside.append(request(None)[0])
                worker.join()
            out["forms"][form] = {
                "outcome": sorted(outcomes),
                "request_s": statistics.median(alone),
                "request_s_by_round": alone,
                "free_request_beside_s": statistics.median(beside),
            }
            if not args.json:
                row = out["forms"][form]
                print(f"{form:28s} {','.join(row['outcome']):8s} its request "
                      f"{row['request_s'] * 1e3:9.1f} ms (rounds: "
                      f"{', '.join(f'{t * 1e3:.0f}' for t in alone)})   a free one beside it "
                      f"{row['free_request_beside_s'] * 1e3:9.1f} ms", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"a free request alone: {out['free_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
