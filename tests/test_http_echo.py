"""Completions' ``echo`` at the HTTP door (docs/PROTOCOL.md "HTTP"): each choice's text
begins with its prompt; with ``logprobs`` N its tokens begin with the prompt's (the task's
``params.prompt_logprobs``, the first prompt token's log probability null, as vLLM writes
it); with ``max_tokens`` 0 the prompt alone.  What lm-evaluation-harness's loglikelihood
tasks send.  Unit checks of the mapping, then two real daemons with the echo engine
(certain: every log probability 0) through the official openai client, local and
forwarded, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import openai
import pytest

from gossipd.core.budgets import task_bytes
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Chunk,
    ErrorCode,
    Result,
    Task,
    encode,
    error_result,
)
from gossipd.core.releases import PROMPT_LOGPROBS_FROM_VERSION
from gossipd.core.sampling import SamplingParams, TokenLogprob, release_asked
from gossipd.engines.base import GenerateRequest
from gossipd.engines.echo import EchoEngine
from gossipd.http.answers import HELD_CHUNKS_MAX
from gossipd.http.logprobs import completion_logprobs
from gossipd.http.openai_api import BadRequest, decode_call
from simulations.cluster import Cluster
from tests.helpers import key_owned_by
from tests.test_http_answers import streaming
from tests.test_http_logprobs import ENTRIES


def _call(chat: bool = False, **body: Any) -> Any:
    prompt = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    if "prompt" in body:
        prompt = {"prompt": body.pop("prompt")}
    return decode_call(json.dumps({"model": "m", **prompt, **body}).encode(), chat=chat)


def test_echo_asks_the_prompts_logprobs_with_the_generated_ones() -> None:
    call = _call(echo=True, logprobs=2, max_tokens=3)
    assert call.echo and not call.echo_only
    assert call.params.prompt_logprobs == 2 and call.params.logprobs == 2
    plain = _call(echo=True, max_tokens=3)
    assert plain.echo and plain.params.prompt_logprobs is None and plain.params.logprobs is None
    for absent in ({}, {"echo": False}, {"echo": None}):
        call = _call(logprobs=1, **absent)
        assert not call.echo and call.params.prompt_logprobs is None
    alone = _call(echo=True, max_tokens=0, logprobs=0)
    assert alone.echo_only and alone.params.max_tokens == 1  # (one generated, not shown)


@pytest.mark.parametrize(
    ("chat", "body", "param"),
    [
        (True, {"echo": True}, "echo"),
        (False, {"echo": "yes"}, "echo"),
        (False, {"max_tokens": 0}, "max_tokens"),  # (without echo: nothing to answer)
    ],
)
def test_echo_where_it_cannot_be_is_refused_naming_the_field(
    chat: bool, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        _call(chat, **body)
    assert refused.value.param == param and refused.value.status == 400


def test_the_first_prompt_token_has_no_logprob() -> None:
    shown = completion_logprobs(ENTRIES, 0, first_none=True)
    assert shown["token_logprobs"] == [None, -1.25]
    assert shown["top_logprobs"][0] is None and shown["text_offset"] == [0, 2]
    assert completion_logprobs(ENTRIES)["token_logprobs"] == [-0.5, -1.25]


def test_prompt_logprobs_need_release_0_3_4_and_are_counted_in_budgets() -> None:
    asked = SamplingParams(logprobs=1, prompt_logprobs=1)
    assert release_asked(asked) == PROMPT_LOGPROBS_FROM_VERSION == (0, 3, 4)

    def task(params: SamplingParams) -> Task:
        return Task(v=PROTOCOL_VERSION, id="t", prompt="word " * 100,
                    reply_to="tcp://127.0.0.1:9", params=params)  # fmt: skip

    plain, without, echoed = task(SamplingParams()), task(SamplingParams(logprobs=1)), task(asked)
    assert task_bytes(echoed) > task_bytes(without) > task_bytes(plain)
    assert b"prompt_logprobs" not in encode(without)  # (older members read it)


def test_the_echo_engine_scores_the_prompt_word_by_word() -> None:
    request = GenerateRequest(
        request_id="r", prompt="red green blue", params=SamplingParams(max_tokens=1,
        prompt_logprobs=1), prompt_logprobs=[],
    )  # fmt: skip

    async def run() -> list[str]:
        return [delta async for delta in EchoEngine().generate(request)]

    assert asyncio.run(run()) == ["red"]
    assert request.prompt_logprobs is not None
    assert [e.token for e in request.prompt_logprobs] == ["red", " green", " blue"]
    assert [e.top for e in request.prompt_logprobs] == [(), ((" green", 0.0),), ((" blue", 0.0),)]


# -- on real daemons, through the official openai client ---------------------------------


PROMPT = "red green blue"
TOKENS = ["red", " green", " blue", "red", " green"]  # the prompt's, then 2 generated


def test_echo_through_the_door_local_and_forwarded(echo_pair: Cluster) -> None:
    entry, owner = echo_pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    for where in (entry, owner):
        session = key_owned_by(echo_pair, where.name)
        headers = {"x-session-id": session}
        ask: dict[str, Any] = {"model": "echo", "prompt": PROMPT, "echo": True,
                               "extra_headers": headers}  # fmt: skip
        plain = client.completions.create(max_tokens=2, **ask).choices[0]
        assert plain.text == PROMPT + "red green" and plain.logprobs is None
        done = client.completions.create(max_tokens=2, logprobs=1, **ask).choices[0]
        assert done.text == PROMPT + "red green" and done.logprobs is not None
        assert done.logprobs.tokens == TOKENS
        assert done.logprobs.token_logprobs == [None, 0.0, 0.0, 0.0, 0.0]
        assert done.logprobs.top_logprobs is not None and done.logprobs.top_logprobs[0] is None
        assert done.logprobs.text_offset == [0, 3, 9, 14, 17]
        assert [done.text[o:o + len(t)] for o, t in
                zip(done.logprobs.text_offset, TOKENS, strict=True)] == TOKENS  # fmt: skip
        streamed = list(client.completions.create(max_tokens=2, logprobs=1, stream=True, **ask))
        pieces = [c.choices[0] for c in streamed if c.choices[0].text]
        assert "".join(p.text for p in pieces) == done.text
        assert pieces[0].text.startswith(PROMPT)  # (the prompt and the first delta: one event)
        shown = [p.logprobs for p in pieces if p.logprobs]
        assert [t for lp in shown for t in lp.tokens] == TOKENS
        assert [v for lp in shown for v in lp.token_logprobs] == done.logprobs.token_logprobs
        assert [o for lp in shown for o in lp.text_offset] == done.logprobs.text_offset
        # max_tokens 0: the prompt alone, scored (lm-eval's loglikelihood of a whole text).
        for stream in (False, True):
            if stream:
                events = list(client.completions.create(max_tokens=0, logprobs=0, stream=True,
                                                        **ask))  # fmt: skip
                text = "".join(e.choices[0].text for e in events if e.choices)
                tokens = [t for e in events if e.choices and e.choices[0].logprobs
                          for t in e.choices[0].logprobs.tokens]  # fmt: skip
            else:
                alone = client.completions.create(max_tokens=0, logprobs=0, **ask).choices[0]
                assert alone.logprobs is not None
                text, tokens = alone.text, alone.logprobs.tokens
            assert text == PROMPT and tokens == TOKENS[:3]
    several = client.completions.create(
        model="echo", prompt=["a b", "c"], echo=True, max_tokens=1, n=2, logprobs=0
    )  # fmt: skip
    assert [c.text for c in several.choices] == ["a ba", "a ba", "cc", "cc"]
    assert all(c.logprobs is not None and c.logprobs.token_logprobs[0] is None
               for c in several.choices)  # fmt: skip


def test_a_prompt_too_long_to_score_is_refused_saying_why(echo_pair: Cluster) -> None:
    """A prompt's entries past what a Result carries (over 32768, the top ones counted):
    its owner refuses it, 400 naming the bound.  Several prompts whose entries may pass
    ECHO_ENTRIES_MAX (a token a byte at most): the door refuses them.  It then serves on."""
    client = openai.OpenAI(base_url=f"{echo_pair.daemons[0].http_url}/v1", api_key="none",
                           max_retries=0)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        # (the echo engine is sure of each word: one top entry each, so 17,000 x 2)
        client.completions.create(model="echo", prompt="w " * 17_000, echo=True, logprobs=1,
                                  max_tokens=1)  # fmt: skip
    assert "32768" in refused.value.message and "prompt_logprobs" in refused.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="echo", prompt=["w " * 1500] * 5, echo=True,
                                  logprobs=20, max_tokens=1)  # fmt: skip
    assert too_many.value.body["param"] == "prompt"  # type: ignore[index]
    fine = client.completions.create(model="echo", prompt="w " * 1500, echo=True, logprobs=20,
                                     max_tokens=1)  # fmt: skip
    assert fine.choices[0].logprobs is not None
    assert len(fine.choices[0].logprobs.tokens) == 1501


# -- a stream's edge cases, on the door's answers alone -----------------------------------


def _events(exchange: Any) -> list[dict[str, Any]]:
    return [json.loads(raw[6:]) for raw in b"".join(exchange.events).split(b"\n\n")
            if raw.startswith(b"data: {")]  # fmt: skip


def _streamed(exchange: Any) -> tuple[str, list[str], list[float | None]]:
    """The text, tokens and token log probabilities a stream wrote, in order."""
    text, tokens, values = "", [], []
    for event in _events(exchange):
        for choice in event.get("choices", ()):  # (an error event has none)
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
    return text, tokens, values


PROMPT_ENTRIES = [TokenLogprob("red", 0.0), TokenLogprob(" green", -1.0, ((" green", -1.0),)),
                  TokenLogprob(" blue", -2.0, ((" blue", -2.0),))]  # fmt: skip


def test_a_lost_first_chunk_holds_the_echo_until_the_result_which_has_it_all() -> None:
    """Chunk 0 (the prompt's scores ride on it) never comes and the gap is skipped: nothing
    streams without them; the Result writes the prompt, its tokens and every generated one."""
    answers, exchange = streaming(_call(echo=True, logprobs=1, stream=True, prompt=PROMPT))
    sent = [Chunk(id="t1", seq=s, delta=f" w{s}", logprobs=[TokenLogprob(f" w{s}", -0.5)])
            for s in range(1, HELD_CHUNKS_MAX + 1)]  # fmt: skip
    for chunk in sent:
        answers.deliver_message(chunk)
    assert _streamed(exchange)[0] == ""  # (the gap was skipped: still nothing written)
    text = "w0" + "".join(c.delta for c in sent)
    generated = [TokenLogprob("w0", -0.5), *(e for c in sent for e in c.logprobs or [])]
    answers.deliver_message(Result(id="t1", ok=True, text=text, logprobs=generated,
                                   prompt_logprobs=PROMPT_ENTRIES))  # fmt: skip
    streamed, tokens, values = _streamed(exchange)
    assert streamed == PROMPT + text
    assert tokens == [e.token for e in PROMPT_ENTRIES] + [e.token for e in generated]
    assert values[:3] == [None, -1.0, -2.0] and values[3:] == [-0.5] * len(generated)


def test_a_streamed_echo_answered_without_chunks_and_an_error_before_it() -> None:
    answers, exchange = streaming(_call(echo=True, logprobs=0, stream=True, prompt=PROMPT))
    answers.deliver_message(Result(id="t1", ok=True, text="red", prompt_logprobs=PROMPT_ENTRIES,
                                   logprobs=[TokenLogprob("red", 0.0)]))  # fmt: skip
    assert _streamed(exchange) == (PROMPT + "red", [*TOKENS[:3], "red"], [None, -1.0, -2.0, 0.0])
    # An error after chunks behind a gap that was skipped (the stream began, the echo not
    # written): its last event says it, and no text that does not begin with the prompt.
    answers, exchange = streaming(_call(echo=True, stream=True, prompt=PROMPT))
    for seq in range(1, HELD_CHUNKS_MAX + 2):
        answers.deliver_message(Chunk(id="t1", seq=seq, delta=" green"))
    answers.deliver_message(error_result("t1", ErrorCode.ENGINE_ERROR, "it died"))
    events = _events(exchange)
    assert _streamed(exchange)[0] == "" and events and "error" in events[-1]


def test_an_empty_prompt_scores_nothing_and_nulls_no_generated_token(echo_pair: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{echo_pair.daemons[0].http_url}/v1", api_key="none",
                           max_retries=0)  # fmt: skip
    whole = client.completions.create(model="echo", prompt="", echo=True, logprobs=0,
                                      max_tokens=2).choices[0]  # fmt: skip
    assert whole.logprobs is not None and whole.logprobs.token_logprobs == [0.0, 0.0]
    events = list(client.completions.create(model="echo", prompt="", echo=True, logprobs=0,
                                            max_tokens=2, stream=True))  # fmt: skip
    values = [v for e in events if e.choices and e.choices[0].logprobs
              for v in e.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert values == [0.0, 0.0]
    # Several choices streamed, each its prompt first, its index kept.
    texts: dict[int, str] = {}
    for event in client.completions.create(
        model="echo", prompt=["a b", "c"], echo=True, max_tokens=1, n=2, logprobs=0, stream=True
    ):
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "a ba", 1: "a ba", 2: "cc", 3: "cc"}


def test_prompt_scores_ride_on_the_first_chunk_only() -> None:
    from gossipd.core.codec import decode_reply
    from gossipd.errors import RemoteProtocolError

    first = Chunk(id="t", seq=0, delta="x", prompt_logprobs=PROMPT_ENTRIES)
    assert decode_reply(encode(first)) == first
    later = msgpack.packb({"v": 1, "t": 2, "id": "t", "seq": 1, "delta": "x",
                           "prompt_logprobs": [["x", 0.0, []]]})  # fmt: skip
    with pytest.raises(RemoteProtocolError, match="first Chunk"):
        decode_reply(later)
