"""OpenAI's ``logit_bias`` and vLLM's ``stop_token_ids`` at the HTTP door (docs/PROTOCOL.md
"HTTP"): each becomes the task's ``params.logit_bias`` / ``params.stop_token_ids`` (release
0.3.5: in params, written only when asked, so that older members refuse what they would
ignore), counted in the byte budgets.  The mapping and its bounds, the wire, then two real
daemons with the echo engine (which ignores both) through the official openai client, local
and forwarded.  What they do to a real model's tokens: tests/test_openai_client.py."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import msgspec
import openai
import pytest

from gossipd.core.budgets import LOGIT_BIAS_ENTRY_BYTES, TOKEN_ID_BYTES, task_bytes
from gossipd.core.codec import decode_task
from gossipd.core.messages import PROTOCOL_VERSION, Task, encode
from gossipd.core.sampling import LOGIT_BIAS_MAX, STOP_TOKEN_IDS_MAX, SamplingParams, release_asked
from gossipd.http.openai_api import BadRequest, decode_call
from simulations.cluster import Cluster
from tests.helpers import key_owned_by


def _call(chat: bool = False, **body: Any) -> Any:
    asked = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "p"}
    return decode_call(json.dumps({"model": "m", **asked, **body}).encode(), chat=chat)


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_and_stop_token_ids_become_the_tasks_params(chat: bool) -> None:
    call = _call(chat, logit_bias={"50256": -100, "7": 2.5}, stop_token_ids=[3, 9])
    assert call.params.logit_bias == {50256: -100.0, 7: 2.5}
    assert call.params.stop_token_ids == [3, 9]
    for nothing in ({}, None, False):  # (LangChain sends {} on every call; [] is a 400)
        assert _call(chat, logit_bias=nothing, stop_token_ids=[]).params == SamplingParams(
            max_tokens=_call(chat).params.max_tokens
        )
    several = _call(logit_bias={"1": 1}, prompt=["a", "b"], n=2)
    assert several.several and several.params.logit_bias == {1: 1.0}  # (each choice's task)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"5": 100.5}),
        ("logit_bias", {"5": -101}),
        ("logit_bias", {"5": None}),
        ("logit_bias", {"-5": 1}),
        ("logit_bias", {"5.0": 1}),
        ("logit_bias", {"05": 1}),  # ("5" and "05" would be one id given twice)
        ("logit_bias", {"\u0665": 1}),  # (an Arabic-Indic five: a digit, not ASCII)
        ("logit_bias", {"2147483648": 1}),
        ("logit_bias", {str(i): 1 for i in range(LOGIT_BIAS_MAX + 1)}),
        ("logit_bias", "5"),
        ("stop_token_ids", [2**31]),
        ("stop_token_ids", ["3"]),
        ("stop_token_ids", {"3": 1}),
        ("stop_token_ids", list(range(STOP_TOKEN_IDS_MAX + 1))),
    ],
)
def test_bad_values_are_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(BadRequest) as refused:
        _call(**{field: value})
    assert refused.value.param == field and refused.value.status == 400


def _task(params: SamplingParams) -> Task:
    return Task(v=PROTOCOL_VERSION, id="t", prompt="p", reply_to="tcp://127.0.0.1:9",
                params=params)  # fmt: skip


def test_the_wire_carries_them_in_params_and_only_0_3_5_reads_them() -> None:
    biased = _task(SamplingParams(logit_bias={5: -100.0, 2**31 - 1: 3.0}, stop_token_ids=[1]))
    assert decode_task(encode(biased), bytes_max=1 << 20) == biased
    raw = msgspec.msgpack.decode(encode(biased))["params"]
    assert raw["logit_bias"] == {5: -100.0, 2**31 - 1: 3.0}  # (msgpack integer keys)
    assert release_asked(biased.params) == (0, 3, 5)
    assert release_asked(SamplingParams(stop_token_ids=[1])) == (0, 3, 5)
    plain = encode(_task(SamplingParams()))
    assert b"logit_bias" not in plain and b"stop_token_ids" not in plain  # (older members)
    for bad in ({"logit_bias": {}}, {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: 200.0}},
                {"stop_token_ids": []}, {"stop_token_ids": [-1]}):  # fmt: skip
        frame = msgspec.msgpack.encode({"t": 1, "v": PROTOCOL_VERSION, "id": "t", "prompt": "p",
                                        "reply_to": "tcp://127.0.0.1:9", "params": bad})  # fmt: skip
        with pytest.raises(Exception, match=next(iter(bad))):
            decode_task(frame, bytes_max=1 << 20)


def test_budgets_count_them_close_to_what_they_take() -> None:
    """task_bytes' share for a full logit_bias and stop_token_ids is within 2x of what a
    task decoded from a frame holds for them (tracemalloc)."""
    bias = {100_000 + i: -1.5 - i % 90 for i in range(LOGIT_BIAS_MAX)}
    ids = list(range(100_000, 100_000 + STOP_TOKEN_IDS_MAX))
    plain = _task(SamplingParams())
    asking = _task(SamplingParams(logit_bias=bias, stop_token_ids=ids))
    counted = task_bytes(asking) - task_bytes(plain)
    assert counted >= LOGIT_BIAS_MAX * LOGIT_BIAS_ENTRY_BYTES + STOP_TOKEN_IDS_MAX * TOKEN_ID_BYTES
    frames = [encode(plain), encode(asking)]
    held = []
    for frame in frames:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        kept = [decode_task(frame, bytes_max=1 << 20) for _ in range(50)]
        held.append((tracemalloc.get_traced_memory()[0] - before) / len(kept))
        tracemalloc.stop()
    taken = held[1] - held[0]
    assert taken / 2 <= counted <= taken * 2, (counted, taken)


def test_a_tasks_fields_beside_its_prompt_fit_the_bounds_that_assume_them() -> None:
    """Every bounded field at its most (4-byte characters, a full logit_bias and
    stop_token_ids) encodes within TASK_FIXED_BYTES_MAX, which the owner's check of a
    forwarded task's size assumes, and within the room the HTTP door leaves beside a prompt."""
    from gossipd.core.codec import TASK_FIXED_BYTES_MAX
    from gossipd.http.wiring import PROMPT_ROOM_BYTES

    wide = "\U0001f600"  # (4 bytes in UTF-8)
    params = SamplingParams(
        max_tokens=32768, temperature=0.123456789, top_p=0.987654321, top_k=99_999,
        seed=2**63 - 1, stop=[wide * 64] * 8, ignore_eos=True, presence_penalty=-1.5,
        frequency_penalty=1.5, repetition_penalty=9.5, min_p=0.5, min_tokens=1, logprobs=0,
        prompt_logprobs=20,
        logit_bias={2**31 - 1 - i: -99.123456789 for i in range(LOGIT_BIAS_MAX)},
        stop_token_ids=[2**31 - 1 - i for i in range(STOP_TOKEN_IDS_MAX)],
    )  # fmt: skip
    task = Task(
        v=PROTOCOL_VERSION, id=wide * 128, key=wide * 256, prompt="", params=params,
        reply_to="ipc://" + "p" * 107, timeout_ms=3_600_000, stream=True, model=wide * 256,
        traceparent=wide * 128, attempt=1000, batch_replies=True,
        producer_key="Z" * 40, model_defaults=15,
    )  # fmt: skip
    size = len(encode(task))
    assert 11_000 < size < TASK_FIXED_BYTES_MAX <= PROMPT_ROOM_BYTES, size


def test_the_echo_engine_ends_an_id_prompt_at_a_stop_token() -> None:
    import asyncio

    from gossipd.engines.base import GenerateRequest
    from gossipd.engines.echo import EchoEngine

    def run(prompt: str, ids: list[int] | None, **asked: Any) -> tuple[str, Any]:
        request = GenerateRequest(request_id="r", prompt=prompt, prompt_token_ids=ids,
                                  params=SamplingParams(max_tokens=6, **asked))  # fmt: skip

        async def answer() -> str:
            return "".join([delta async for delta in EchoEngine().generate(request)])

        return asyncio.run(answer()), request.usage

    text, usage = run("", [5, 6, 7], stop_token_ids=[7])
    assert text == "5 6" and usage.finish_reason == "stop" and usage.completion_tokens == 3
    text, usage = run("", [5, 6, 7], stop_token_ids=[7], stop=[" 7"])  # (the id comes first)
    assert text == "5 6" and usage.finish_reason == "stop"
    text, usage = run("", [5, 6], stop_token_ids=[5])
    assert text == "" and usage.completion_tokens == 1
    text, usage = run("5 6 7", None, stop_token_ids=[7])  # (a text prompt's words: no ids)
    assert text == "5 6 7 5 6 7" and usage.finish_reason == "length"


def test_they_travel_through_the_door_local_and_forwarded(echo_pair: Cluster) -> None:
    """The echo engine ends an id prompt's answer at a stop id (its words are the ids), so
    the answer shows stop_token_ids reached the engine, local and forwarded; it ignores
    logit_bias, which a member that did not read it would have refused (unknown params)."""
    entry, owner = echo_pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    for where in (entry, owner):
        headers = {"x-session-id": key_owned_by(echo_pair, where.name)}
        raw = client.completions.with_raw_response.create(
            model="echo", prompt=[5, 6, 7], max_tokens=5, logit_bias={"5": -100},
            extra_body={"stop_token_ids": [7]}, extra_headers=headers,
        )  # fmt: skip
        assert raw.headers["x-gossipd-member"] == where.name  # (local, then forwarded)
        done = raw.parse().choices[0]
        assert done.text == "5 6" and done.finish_reason == "stop"
        several = client.completions.create(
            model="echo", prompt=[[5, 6, 7], [7, 8]], max_tokens=5, n=2,
            extra_body={"stop_token_ids": [7]}, extra_headers=headers,
        )  # fmt: skip
        assert [c.text for c in several.choices] == ["5 6", "5 6", "", ""]
        chat = client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            logit_bias={"5": 10}, extra_body={"stop_token_ids": [7]}, extra_headers=headers,
        )  # fmt: skip
        assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="echo", prompt="a", logit_bias={"5": 101})
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]
