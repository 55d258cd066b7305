"""Log probabilities at the HTTP door (docs/PROTOCOL.md "HTTP"): completions' ``logprobs``
N, a chat's ``logprobs`` and ``top_logprobs`` to the task's ``params.logprobs``, bounded by
what a Result may carry; the answers in OpenAI's two shapes, whole and streamed (the
tokens' text offsets running on across deltas).  Then two real daemons with the echo engine
(certain: each token's log probability 0), through the official openai client, the tasks
run on the entry and forwarded."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gossipd.core.messages import TokenUsage
from gossipd.core.sampling import TokenLogprob
from gossipd.http.logprobs import chat_logprobs, completion_logprobs
from gossipd.http.openai_answers import StreamWriter
from gossipd.http.openai_api import BadRequest, decode_call
from simulations.cluster import Cluster
from tests.helpers import key_owned_by


def _call(chat: bool, **body: Any) -> Any:
    prompt = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    return decode_call(json.dumps({"model": "m", **prompt, **body}).encode(), chat=chat)


def test_logprobs_asked_become_the_tasks_params() -> None:
    assert _call(False, logprobs=3).params.logprobs == 3
    assert _call(False, logprobs=0).params.logprobs == 0
    assert _call(False, logprobs=None).params.logprobs is None
    assert _call(False, logprobs=False).params.logprobs is None
    assert _call(True, logprobs=True).params.logprobs == 0
    assert _call(True, logprobs=True, top_logprobs=5).params.logprobs == 5
    assert _call(True, logprobs=False, top_logprobs=0).params.logprobs is None
    assert _call(True).params.logprobs is None


@pytest.mark.parametrize(
    ("chat", "body", "param"),
    [
        (True, {"top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": 1}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        # Negative: refused before any arithmetic (-1 divided by zero there: a 500; -2 named
        # min_tokens), with and without logprobs true.
        (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        (True, {"top_logprobs": -1}, "top_logprobs"),
        (False, {"logprobs": -1}, "logprobs"),
        (False, {"logprobs": 21}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 20, "max_tokens": 4096}, "top_logprobs"),
        (False, {"logprobs": 20, "max_tokens": 1561}, "logprobs"),
        (True, {"logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}]},
         "logprobs"),
    ],
)  # fmt: skip
def test_logprobs_out_of_bounds_are_refused_naming_the_field(
    chat: bool, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        _call(chat, **body)
    assert refused.value.param == param and refused.value.status == 400


ENTRIES = [
    TokenLogprob("Hé", -0.5, (("Hé", -0.5), (" x", -1.5))),
    TokenLogprob(" there", -1.25, ((" here", -0.75), (" there", -1.25))),
]


def test_the_two_shapes_of_logprobs() -> None:
    assert completion_logprobs(ENTRIES, 4) == {
        "tokens": ["Hé", " there"],
        "token_logprobs": [-0.5, -1.25],
        "top_logprobs": [{"Hé": -0.5, " x": -1.5}, {" there": -1.25, " here": -0.75}],
        "text_offset": [4, 6],
    }
    (first, second) = chat_logprobs(ENTRIES)["content"]
    assert first["bytes"] == list("Hé".encode()) and first["logprob"] == -0.5
    assert [t["token"] for t in second["top_logprobs"]] == [" here", " there"]


def test_streamed_deltas_carry_their_tokens_and_offsets_run_on() -> None:
    call = _call(False, logprobs=1, stream=True)
    writer = StreamWriter(call, "cmpl-1", 1)
    events = [writer.delta("Hé", 0, ENTRIES[:1]), writer.delta(" there", 0, ENTRIES[1:])]
    events.append(writer.finish(TokenUsage(completion_tokens=2, finish_reason="length")))
    decoded = [json.loads(e.split(b"\n\n")[0][6:]) for e in events]
    assert [d["choices"][0]["logprobs"]["text_offset"] for d in decoded[:2]] == [[0], [2]]
    assert decoded[2]["choices"][0]["logprobs"] is None  # (the finish event: no token)
    chat = StreamWriter(_call(True, logprobs=True, stream=True), "c", 1)
    event = json.loads(chat.delta("Hé", 0, ENTRIES[:1])[6:-2])
    assert event["choices"][0]["logprobs"]["content"][0]["token"] == "Hé"
    assert json.loads(chat.delta("x")[6:-2])["choices"][0]["logprobs"] is None


# -- on real daemons, through the official openai client ---------------------------------


def test_logprobs_through_the_door_local_and_forwarded(echo_pair: Cluster) -> None:
    entry, owner = echo_pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    for where in (entry, owner):
        session = key_owned_by(echo_pair, where.name)
        headers = {"x-session-id": session}
        done = client.completions.create(
            model="echo", prompt="red green blue", max_tokens=5, logprobs=2,
            extra_headers=headers,
        ).choices[0]  # fmt: skip
        assert done.logprobs is not None and done.text == "red green blue red green"
        assert done.logprobs.tokens == ["red", " green", " blue", " red", " green"]
        assert done.logprobs.token_logprobs == [0.0] * 5
        assert done.logprobs.text_offset == [0, 3, 9, 14, 18]
        assert done.logprobs.top_logprobs == [{t: 0.0} for t in done.logprobs.tokens]
        streamed = list(
            client.completions.create(
                model="echo", prompt="red green blue", max_tokens=5, logprobs=2, stream=True,
                extra_headers=headers,
            )
        )  # fmt: skip
        pieces = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
        assert [t for p in pieces for t in p.tokens] == done.logprobs.tokens
        assert [o for p in pieces for o in p.text_offset] == done.logprobs.text_offset
        chat = client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            logprobs=True, top_logprobs=1, extra_headers=headers,
        ).choices[0]  # fmt: skip
        assert chat.logprobs is not None and chat.logprobs.content is not None
        assert "".join(t.token for t in chat.logprobs.content) == chat.message.content
        assert all(t.top_logprobs[0].token == t.token for t in chat.logprobs.content)
        plain = client.completions.create(
            model="echo", prompt="red", max_tokens=2, extra_headers=headers
        ).choices[0]
        assert plain.logprobs is None
    # A chat naming no max_tokens, asking 20 top tokens: its default is cut to what a
    # Result may carry (32768 entries: 1560 tokens), not refused.
    long = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a"}], logprobs=True,
        top_logprobs=20,
    )  # fmt: skip
    assert long.usage is not None and long.usage.completion_tokens == 32768 // 21
    # Over a request's choices too: the door holds every choice's to answer.
    two = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a"}], logprobs=True,
        top_logprobs=20, n=2,
    )  # fmt: skip
    assert two.usage is not None and two.usage.completion_tokens == 2 * (32768 // 42)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="echo", prompt="a", n=2, logprobs=20, max_tokens=1000)
    assert refused.value.body["param"] == "n"  # type: ignore[index]


def test_every_tokens_entry_streams_once_also_past_a_gap() -> None:
    """Chunks out of order, a gap that never fills (HELD_CHUNKS_MAX waiting), chunks held at
    the Result: each token's entry goes once, in order, with its text."""
    from gossipd.core.messages import Chunk, Result
    from gossipd.http.answers import HELD_CHUNKS_MAX
    from tests.test_http_answers import streaming

    answers, exchange = streaming(_call(False, logprobs=0, stream=True), "t")

    def chunk(seq: int) -> Chunk:
        return Chunk(id="t", seq=seq, delta=f"<{seq}>", logprobs=[TokenLogprob(f"<{seq}>", -1.0)])

    sent = [chunk(seq) for seq in range(1, HELD_CHUNKS_MAX + 1)]  # seq 0 never comes
    sent.append(chunk(HELD_CHUNKS_MAX + 2))  # another gap: held when the Result comes
    for each in sent:
        answers.deliver_message(each)
    text = "".join(c.delta for c in sent)
    every = [e for c in sent for e in c.logprobs or []]
    answers.deliver_message(Result(id="t", ok=True, text=text, logprobs=every))
    events = [json.loads(raw[6:]) for raw in b"".join(exchange.events).split(b"\n\n")
              if raw.startswith(b"data: {")]  # fmt: skip
    pieces = [e["choices"][0] for e in events if e["choices"][0]["text"]]
    assert [p["logprobs"]["tokens"] for p in pieces] == [[c.delta] for c in sent]
