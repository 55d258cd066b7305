"""gossipd/http/openai_api.py alone: any body is a Call or a BadRequest naming the field, never
another exception; the stream framing is OpenAI's to the byte (properties, hypothesis)."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from gossipd.core.messages import ErrorCode, ErrorInfo, TokenUsage
from gossipd.http.openai_api import BadRequest, StreamWriter, decode_call, error_of

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "user",
        "ignore_eos",
        "logprobs",
        "echo",
        "best_of",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(FIELDS, JSON, max_size=8), st.booleans())
def test_any_body_is_a_call_or_a_bad_request_naming_its_field(
    doc: dict[str, Any], chat: bool
) -> None:
    try:
        call = decode_call(json.dumps(doc).encode(), chat=chat)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        assert exc.param is None or exc.param in doc or exc.param in ("model", "prompt", "messages")
        return
    assert call.model == doc["model"] and call.chat is chat
    assert 1 <= call.params.max_tokens <= 32768
    assert call.include_usage <= call.stream


@given(st.binary(max_size=64))
def test_bytes_that_are_not_a_json_object_are_a_bad_request(body: bytes) -> None:
    try:
        decode_call(body, chat=False)
    except BadRequest:
        return
    raise AssertionError("a Call from a body without a model")


def test_a_valid_body_maps_onto_the_task_fields() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "temperature": 0,
        "stop": "END",
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
    }
    call = decode_call(json.dumps(body).encode(), chat=True)
    assert call.messages == [{"role": "user", "content": "hi"}]
    assert call.params.max_tokens == 7 and call.params.temperature == 0.0
    assert call.params.stop == ["END"] and call.params.seed == 3
    assert call.stream and call.include_usage and call.user == "u1"
    with pytest.raises(BadRequest) as exc:
        decode_call(b'{"model": "m", "prompt": [1, 2, 3]}', chat=False)
    assert exc.value.param == "prompt" and "token ids" in exc.value.message


@given(st.lists(st.text(max_size=6), min_size=1, max_size=5), st.booleans(), st.booleans())
def test_a_stream_is_server_sent_events_in_openai_framing(
    deltas: list[str], chat: bool, include_usage: bool
) -> None:
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": include_usage}}
    body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    call = decode_call(json.dumps(body).encode(), chat=chat)
    writer = StreamWriter(call, "cmpl-1", 1700000000)
    usage = TokenUsage(prompt_tokens=3, completion_tokens=len(deltas), finish_reason="length")
    raw = b"".join(writer.delta(d) for d in deltas) + writer.finish(usage)
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    docs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert {d["id"] for d in docs} == {"cmpl-1"} and {d["created"] for d in docs} == {1700000000}
    pieces = docs[: len(deltas)]
    if chat:
        assert pieces[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(p["choices"][0]["delta"]["content"] for p in pieces)
    else:
        text = "".join(p["choices"][0]["text"] for p in pieces)
    assert text == "".join(deltas)
    assert docs[len(deltas)]["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert all("usage" in d for d in docs)
        assert docs[-1]["choices"] == [] and docs[-1]["usage"]["total_tokens"] == 3 + len(deltas)
    else:
        assert len(docs) == len(deltas) + 1 and all("usage" not in d for d in docs)


def test_errors_map_to_openai_statuses_with_retry_after() -> None:
    status, body, headers = error_of(
        ErrorInfo(code=ErrorCode.OVERLOADED, message="busy", retry_after_ms=1500)
    )
    assert status == 429 and dict(headers) == {"retry-after": "2", "retry-after-ms": "1500"}
    assert json.loads(body) == {
        "error": {
            "message": "busy",
            "type": "rate_limit_error",
            "param": None,
            "code": "overloaded",
        }
    }
    assert error_of(ErrorInfo(code=ErrorCode.DEADLINE_EXCEEDED, message="late"))[0] == 504
    assert error_of(ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="x"))[0] == 500
    assert error_of(ErrorInfo(code="something_new", message="x"))[0] == 500


def test_json_nested_deeper_than_the_decoder_goes_is_a_bad_request() -> None:
    with pytest.raises(BadRequest) as exc:
        decode_call(b"[" * 200_000 + b"]" * 200_000, chat=False)
    assert exc.value.status == 400 and "nested" in exc.value.message


def test_a_bos_the_template_writes_is_not_doubled_by_the_engine() -> None:
    from gossipd.http.chat import ChatTemplate, TemplateFailed

    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}",
        bos_token="<s>",
    )
    assert template.render([{"role": "user", "content": "hi"}]) == "[user] hi"
    broken = ChatTemplate("{{ raise_me() }}")
    with pytest.raises(TemplateFailed):
        broken.render([{"role": "user", "content": "hi"}])
