"""lm-evaluation-harness's loglikelihood requests through gossipd's door, against `vllm serve`
on the same engine and model: do its scores come out the same?

lm-eval's `local-completions` model scores each choice of a multiple-choice task with one
completions request (`echo` true, `logprobs` 1, `max_tokens` 1) and reads the choice's
tokens' log probabilities from the answer's `logprobs` (from its context's length on).
This runs one small task of our own (40 questions, 4 choices each, written here: no
download) with lm-eval against

- `vllm serve` on the tiny model (`python -m vllm.entrypoints.openai.api_server`), and
- two gossipd daemons with the vLLM engine on the same model, lm-eval calling the first
  (keyless requests placed by prefix over both: some forwarded),

then compares every choice's log likelihood between the two (and the task's accuracy).
lm-eval lives in a venv of its own (its pins are not ours):

    python3 -m venv ~/.cache/gossipd/lmeval-venv
    ~/.cache/gossipd/lmeval-venv/bin/pip install "lm-eval[api,hf]"
    .venv/bin/python scripts/lm_eval_check.py [--json] [--lm-eval PATH] [--limit N]

Prompts go as token ids (lm-eval's default, `tokenized_requests=True`), or as text with
`--text-prompts`; either way lm-eval tokenizes them itself with the model's tokenizer to
find each context's length.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.tools.bench.openai import (
    SERVED_NAME,
    _start_gossipd,
    _start_vllm_serve,
    _wait_models,
)

TASK = "gossipd_tiny_mc"
COLORS = ["red", "green", "blue", "yellow", "black", "white", "purple", "orange"]
THINGS = ["sky", "grass", "sea", "sun", "night", "snow", "plum", "carrot", "fox", "stone"]


def _write_task(root: Path, questions: int) -> None:
    """A multiple-choice task lm-eval reads from local JSON (no Hugging Face download)."""
    docs = []
    for i in range(questions):
        thing = THINGS[i % len(THINGS)]
        choices = [COLORS[(i + k) % len(COLORS)] for k in range(4)]
        docs.append({"question": f"Question {i}: what colour is the {thing}?",
                     "choices": choices, "answer": i % 4})  # fmt: skip
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nAnswer:"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )


def _run_lm_eval(
    lm_eval: str, url: str, model: Path, tasks: Path, out: Path, limit: int, tokenized: bool
) -> Any:
    args = ",".join([
        f"model={SERVED_NAME}", f"base_url={url}/v1/completions", f"tokenizer={model}",
        "tokenizer_backend=huggingface", f"tokenized_requests={tokenized}", "num_concurrent=1",
        "max_retries=1",
    ])  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [lm_eval, "run", "--model", "local-completions", "--model_args", args, "--include_path",
         str(tasks), "--tasks", TASK, "--limit", str(limit), "--log_samples", "--output_path",
         str(out), "--batch_size", "1"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed against {url}:\n{done.stderr[-3000:]}")
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    results = sorted(out.rglob("results_*.json"))
    if not samples or not results:
        raise SystemExit(f"lm_eval wrote no samples under {out}:\n{done.stdout[-2000:]}")
    scores = {}
    for line in samples[-1].read_text().splitlines():
        sample = json.loads(line)
        # resps: per choice [[loglikelihood, is_greedy]]
        scores[sample["doc_id"]] = [float(r[0][0]) for r in sample["resps"]]  # (logged as text)
    acc = json.loads(results[-1].read_text())["results"][TASK]["acc,none"]
    return {"acc": acc, "scores": scores, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--limit", type=int, default=40, help="questions (4 requests each)")
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument(
        "--text-prompts",
        action="store_true",
        help="send text (tokenized_requests=False), not lm-eval's default token ids",
    )
    parser.add_argument(
        "--lm-eval", default=str(Path.home() / ".cache/gossipd/lmeval-venv/bin/lm_eval")
    )
    args = parser.parse_args()
    model = Path(args.model).resolve()
    if not Path(args.lm_eval).exists():
        raise SystemExit(
            f"no lm_eval at {args.lm_eval}: install it as this script's docstring says"
        )
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as tmp:
        root = Path(tmp)
        (root / "task").mkdir()
        _write_task(root / "task", args.limit)
        report: dict[str, Any] = {
            "task": TASK,
            "questions": args.limit,
            "prompts": "text" if args.text_prompts else "token ids",
        }
        vllm = _start_vllm_serve(model, root)
        try:
            _wait_models(vllm.url, 240, "vllm serve", vllm.exited)
            report["vllm-serve"] = _run_lm_eval(args.lm_eval, vllm.url, model, root / "task",
                                                root / "out-vllm", args.limit,
                                                not args.text_prompts)  # fmt: skip
        finally:
            vllm.stop()
        server, cluster = _start_gossipd("gossipd-2", 2, model, root)
        try:
            for d in cluster.daemons:
                d.wait_ready(600)
            cluster.wait_converged(timeout_s=60)
            cluster.wait_meta(timeout_s=60)
            url = cluster.daemons[0].http_url  # (known once it serves)
            _wait_models(url, 60, "gossipd")
            report["gossipd-2"] = _run_lm_eval(args.lm_eval, url, model, root / "task",
                                               root / "out-gossipd", args.limit,
                                               not args.text_prompts)  # fmt: skip
        finally:
            server.stop()
    ours, theirs = report["gossipd-2"]["scores"], report["vllm-serve"]["scores"]
    diffs = [abs(a - b) for doc in theirs for a, b in zip(ours[doc], theirs[doc], strict=True)]
    report["choices_compared"] = len(diffs)
    report["max_abs_loglikelihood_diff"] = max(diffs)
    report["same_acc"] = report["gossipd-2"]["acc"] == report["vllm-serve"]["acc"]
    for side in ("vllm-serve", "gossipd-2"):
        report[side]["scores"] = {k: v for k, v in list(report[side]["scores"].items())[:3]}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"acc: vllm serve {report['vllm-serve']['acc']:.3f}, gossipd "
              f"{report['gossipd-2']['acc']:.3f}; {len(diffs)} choices' log likelihoods, "
              f"largest difference {max(diffs):.2e}")  # fmt: skip
    if max(diffs) > 1e-3 or not report["same_acc"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
