"""Completions' prompts of token ids (OpenAI's list of integers, or list of such lists) at
the HTTP door (docs/PROTOCOL.md "HTTP"): each becomes a task's ``params.prompt_token_ids``
(release 0.3.4: in params, so that older members refuse it), run by its engine as the tokens given, placed by prefix on the ids; what
lm-evaluation-harness sends by default (``tokenized_requests``).  The mapping and its
bounds, then two real daemons with the echo engine (it answers with the ids as words)
through the official openai client, local and forwarded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import openai
import pytest

from gossipd.core.budgets import task_bytes
from gossipd.core.codec import decode_task
from gossipd.core.messages import PROTOCOL_VERSION, Task, encode, prefix_text
from gossipd.core.sampling import SamplingParams, release_asked
from gossipd.engines.base import GenerateRequest
from gossipd.engines.echo import EchoEngine
from gossipd.http.openai_api import BadRequest, decode_call
from simulations.cluster import Cluster
from tests.helpers import key_owned_by


def _call(prompt: Any, **body: Any) -> Any:
    return decode_call(json.dumps({"model": "m", "prompt": prompt, **body}).encode(), chat=False)


def test_token_id_prompts_become_the_tasks_ids() -> None:
    one = _call([5, 6, 7])
    assert one.token_prompts == ([5, 6, 7],) and one.prompt == "" and not one.several
    assert one.params.prompt_token_ids == [5, 6, 7]
    scored = _call([5, 6], echo=True, logprobs=0)  # (top 0 is asked: the ids' text comes)
    assert scored.echo and scored.params.prompt_logprobs == 0
    several = _call([[1, 2], [3]], n=2)
    assert several.token_prompts == ([1, 2], [3]) and several.choices == 4 and several.several
    assert _call("text").token_prompts == ()


@pytest.mark.parametrize(
    ("prompt", "body"),
    [
        ([], {}),
        ([1, -1], {}),
        ([1, 2**31], {}),
        ([1, "a"], {}),
        ([[1], []], {}),
        ([[1], [True]], {}),
        ([1.5], {}),
        ([1, 2], {"echo": True}),  # (echo of ids: only with logprobs, which give their text)
    ],
)
def test_token_ids_out_of_bounds_are_refused_naming_the_prompt(
    prompt: Any, body: dict[str, Any]
) -> None:
    with pytest.raises(BadRequest) as refused:
        _call(prompt, **body)
    assert refused.value.param in ("prompt", "echo") and refused.value.status == 400


def _task(**fields: Any) -> Task:
    return Task(v=PROTOCOL_VERSION, id="t", reply_to="tcp://127.0.0.1:9", **fields)


def test_a_task_carries_text_or_ids_and_only_0_3_4_reads_ids() -> None:
    ids = _task(prompt="", params=SamplingParams(prompt_token_ids=[5, 6, 7]))
    assert decode_task(encode(ids), bytes_max=1 << 20) == ids
    assert release_asked(ids.params) == (0, 3, 4) and release_asked(SamplingParams()) is None
    assert b"prompt_token_ids" not in encode(_task(prompt="a"))  # (older members read it)
    # In params, which refuse unknown keys (as members before 0.3.4 refuse this one): on
    # the Task, whose unknown keys are ignored, they would run an empty prompt.
    assert "prompt_token_ids" in msgspec.msgpack.decode(encode(ids))["params"]
    assert SamplingParams.__struct_config__.forbid_unknown_fields
    with pytest.raises(ValueError, match="one or the other"):
        _task(prompt="a", params=SamplingParams(prompt_token_ids=[1]))
    for bad in ([], [-1], [2**31]):
        raw = msgspec.msgpack.encode({"t": 1, "v": PROTOCOL_VERSION, "id": "t", "prompt": "",
                                      "reply_to": "tcp://127.0.0.1:9",
                                      "params": {"prompt_token_ids": bad}})  # fmt: skip
        with pytest.raises(Exception, match="prompt_token_ids"):
            decode_task(raw, bytes_max=1 << 20)
    # Placement by prefix reads the leading ids as text: a shared leading run, a shared
    # prefix; no more of them than the hashes read.
    assert prefix_text(ids, 1024) == "5,6,7," and prefix_text(_task(prompt="p"), 1024) == "p"
    long = _task(prompt="", params=SamplingParams(prompt_token_ids=list(range(100_000))))
    assert 1024 <= len(prefix_text(long, 1024)) < 4096
    assert task_bytes(long) > 3_000_000


def test_the_echo_engine_answers_ids_as_words() -> None:
    request = GenerateRequest(request_id="r", prompt="", params=_task(prompt="").params,
                              prompt_token_ids=[5, 6, 7])  # fmt: skip

    async def run() -> list[str]:
        return [delta async for delta in EchoEngine().generate(request)]

    assert "".join(asyncio.run(run())) == "5 6 7 5 6 7 5 6 7 5 6 7 5 6 7 5"
    assert request.usage.prompt_tokens == 3


def test_token_id_prompts_through_the_door_local_and_forwarded(echo_pair: Cluster) -> None:
    entry, owner = echo_pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    for where in (entry, owner):
        session = key_owned_by(echo_pair, where.name)
        headers = {"x-session-id": session}
        raw = client.completions.with_raw_response.create(
            model="echo", prompt=[5, 6, 7], max_tokens=2, extra_headers=headers
        )
        assert raw.headers["x-gossipd-member"] == where.name  # (local, then forwarded)
        done = raw.parse()
        assert done.choices[0].text == "5 6"
        assert done.usage is not None and done.usage.prompt_tokens == 3
        echoed = client.completions.create(
            model="echo",
            prompt=[5, 6, 7],
            max_tokens=1,
            echo=True,
            logprobs=0,
            extra_headers=headers,
        )
        choice = echoed.choices[0]
        assert choice.text == "5 6 75" and choice.logprobs is not None
        assert choice.logprobs.tokens == ["5", " 6", " 7", "5"]
        assert choice.logprobs.token_logprobs == [None, 0.0, 0.0, 0.0]
        streamed = list(
            client.completions.create(
                model="echo", prompt=[5, 6, 7], max_tokens=2, stream=True, extra_headers=headers
            )
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "5 6"
    several = client.completions.create(model="echo", prompt=[[1, 2], [3]], max_tokens=1, n=2)
    assert [c.text for c in several.choices] == ["1", "1", "3", "3"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="echo", prompt=[[1], []], max_tokens=1)
    assert refused.value.body["param"] == "prompt"  # type: ignore[index]
