"""gossipd/http/openai_api.py and openai_answers.py alone: any body is a Call or a BadRequest
naming the field, never another exception; the stream framing is OpenAI's to the byte
(properties, hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings

from gossipd.core.messages import ErrorCode, ErrorInfo, TokenUsage
from gossipd.http.openai_answers import StreamWriter, error_of
from gossipd.http.openai_api import (
    BadRequest,
    _decode_call,
    decode_call,
)

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
        "presence_penalty",
        "min_tokens",
        "logprobs",
        "echo",
        "best_of",
        "logit_bias",
        "stop_token_ids",
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
    assert call.choices == (len(call.prompts) or len(call.token_prompts) or 1) * call.n >= 1
    assert call.params.prompt_token_ids is None or (call.prompt == "" and not call.prompts)


# Values near what clients send per field, (valid, not): the typed first pass must take a
# body exactly as the full rules do (the same Call, or the same refusal).
NEAR: dict[str, tuple[list[Any], list[Any]]] = {
    "model": (["m", "echo"], ["", 3, None]),
    "prompt": (["p", "", ["p", "q"], [1, 2]], [["p"], [[1], [-1]], None, 5, ["p", 1], []]),
    "messages": (
        [[{"role": "user", "content": "hi"}], [{"role": "u", "content": "", "name": "x"}]],
        [
            [{"role": "user", "content": None}],
            [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            [{"role": 3, "content": "hi"}],
            [],
            "hi",
            None,
        ],
    ),
    "max_tokens": ([1, 16, 32768], [0, -1, 40000, True, 2.0, None, "8"]),
    "max_completion_tokens": ([1, 8], [0, None, False]),
    "temperature": ([0, 0.5, 1, 2.5], [11.0, -1, None, "0.5", True]),
    "top_p": ([0.5, 1], [0, None, 2]),
    "top_k": ([-1, 5], [0, None, True]),
    "seed": ([0, 7], [-3, None, 1.5]),
    "n": ([1, 2], [0, None, True, 129]),
    "stream": ([True, False], [None, 1]),
    "stream_options": ([{"include_usage": True}, {}], [{"include_usage": 1}, {"x": 1}, None, 3]),
    "ignore_eos": ([True, False], [None, 1]),
    "user": (["u", ""], [None, 0, 3]),
    "stop": (["s", ["a", "b"]], [None, [""]]),
    "logprobs": ([None, False], [2]),
    "frequency_penalty": ([0, 0.5, -2], [2.5, None, True]),
    "repetition_penalty": ([1, 1.1], [0, None, "1"]),
    "min_p": ([0, 0.2], [-0.1, None]),
    "min_tokens": ([0, 2], [-1, None, 1.5, 40000]),
    "response_format": ([{"type": "json_object"}, {"type": "text"}], [{"type": "x"}, None]),
    "guided_regex": (["[a-z]+"], [3, None]),
}


@st.composite
def near_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """A body and whether it goes to chat: each field present 1 time in 3 (the model and the
    prompt or messages that the path takes 9 in 10), a valid value 6 times in 7."""
    chat = draw(st.booleans())
    usual = {"model", "messages" if chat else "prompt"}
    doc = {}
    for name, (valid, invalid) in NEAR.items():
        if draw(st.integers(0, 9)) < (9 if name in usual else 3):
            good = draw(st.integers(0, 6)) < 6
            doc[name] = draw(st.sampled_from(valid if good else invalid))
    return doc, chat


@settings(max_examples=800, deadline=None)
@given(near_bodies())
def test_the_typed_first_pass_takes_a_body_as_the_full_rules_do(
    case: tuple[dict[str, Any], bool],
) -> None:
    doc, chat = case
    body = json.dumps(doc).encode()
    try:
        expected: Any = _decode_call(body, chat=chat)
    except BadRequest as exc:
        expected = (exc.message, exc.param, exc.status)
    try:
        got: Any = decode_call(body, chat=chat)
    except BadRequest as exc:
        got = (exc.message, exc.param, exc.status)
    assert got == expected


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","prompt":"p","max_tokens":2,"max_tokens":3}',  # the last one counts
        b'{"model":"m","model":"","prompt":"p"}',
        b'{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":false,'
        b'"include_usage":true}}',
        b'{"model":"m","messages":[{"role":"user","content":"a","content":"b"}]}',
        b'{"model":"m","prompt":"p","max_tokens":1.0}',
        b'{"model":"m","prompt":"p","max_tokens":1e2}',
        b'{"model":"m","prompt":"p","seed":9223372036854775807}',
        b'{"model":"m","prompt":"p","seed":9223372036854775808}',
        b'{"model":"m","prompt":"p","seed":1' + b"0" * 40 + b"}",
        b'{"model":"m","prompt":"p","temperature":1e400}',
        b'{"model":"m","prompt":"p","top_p":1e-400}',
        b'{"model":"m","prompt":"p","temperature":-0.0}',
        b'{"model":"m","prompt":"\\ud800"}',
        b'{"model":"m","prompt":"p","user":false}',
        b'{"model":"m","prompt":"p","stream":false,"stream_options":{"include_usage":true}}',
        b'{"model":"m","prompt":"p","stream_options":{"include_usage":null}}',
        b'{"model":"m","prompt":"p","messages":[{"role":"user","content":"a"}]}',
        b'{"model":"m","messages":[{"role":"user","content":"a"}],"max_completion_tokens":2,'
        b'"max_tokens":"x"}',
    ],
)
def test_raw_json_edges_take_the_same_answer_on_both_passes(body: bytes) -> None:
    """What json.dumps never writes (duplicate keys, other spellings of numbers, lone
    surrogates): the typed pass and the full rules still agree, for both paths."""
    for chat in (False, True):
        try:
            expected: Any = _decode_call(body, chat=chat)
        except BadRequest as exc:
            expected = (exc.message, exc.param, exc.status)
        try:
            got: Any = decode_call(body, chat=chat)
        except BadRequest as exc:
            got = (exc.message, exc.param, exc.status)
        assert got == expected


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
    # A prompt of token ids is the task's params.prompt_token_ids; not integers, a 400.
    ids = decode_call(b'{"model": "m", "prompt": [1, 2, 3]}', chat=False)
    assert ids.params.prompt_token_ids == [1, 2, 3] and ids.prompt == ""
    with pytest.raises(BadRequest) as exc:
        decode_call(b'{"model": "m", "prompt": [[1, 2], [3, "x"]]}', chat=False)
    assert exc.value.param == "prompt" and "token ids" in exc.value.message


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage"),
    [
        ({"stream": None}, False, False),  # null: as absent
        ({"stream_options": "junk"}, False, False),  # ignored without a stream
        ({"stream": False, "stream_options": {"include_usage": True}}, False, False),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, True, True),
        ({"logprobs": False, "best_of": 1, "top_logprobs": None}, False, False),
        # what LangChain's OpenAI (completions) sends on every call
        (
            {
                "logit_bias": {},
                "frequency_penalty": 0,
                "presence_penalty": 0,
                "n": 1,
                "seed": None,
                "logprobs": None,
                "top_p": 1,
            },
            False,
            False,
        ),
        # what `vllm bench serve` sends, and other defaults clients send
        (
            {
                "repetition_penalty": 1.0,
                "min_tokens": 0,
                "min_p": 0.0,
                "stop_token_ids": [],
                "tools": [],
                "top_logprobs": 0,
                "response_format": {"type": "text"},
                "tool_choice": "none",
                "function_call": "auto",
                "functions": [],
                "guided_json": None,
            },
            False,
            False,
        ),
        # vLLM's defaults for fields a task does not carry (some clients send them all)
        (
            {
                "use_beam_search": False,
                "length_penalty": 1.0,
                "include_stop_str_in_output": False,
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
                "truncate_prompt_tokens": None,
                "allowed_token_ids": None,
                "bad_words": [],
                "prompt_logprobs": None,
                "return_tokens_as_token_ids": False,
                "add_special_tokens": True,
            },
            False,
            False,
        ),
    ],
)
def test_fields_that_ask_nothing_are_taken(
    fields: dict[str, Any], stream: bool, include_usage: bool
) -> None:
    call = decode_call(json.dumps({"model": "m", "prompt": "p", **fields}).encode(), chat=False)
    assert call.stream is stream and call.include_usage is include_usage


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", True), ("logprobs", 21), ("logprobs", -1), ("top_logprobs", 2), ("best_of", 2),
     ("best_of", True), ("stream", 1), ("stream_options", "junk"), ("logit_bias", {"1": 101}),
     ("logit_bias", {" 1": 5}), ("logit_bias", {"1": "5"}), ("logit_bias", [1]),
     ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {"4294967296": 1}),
     ("tools", [{"type": "function"}]), ("presence_penalty", 2.5), ("frequency_penalty", -3),
     ("repetition_penalty", 0), ("repetition_penalty", True), ("min_p", 1.1),
     ("min_tokens", 17), ("min_tokens", -1), ("stop_token_ids", [-1]),
     ("stop_token_ids", 2), ("stop_token_ids", [True]), ("stop_token_ids", list(range(257))),
     ("response_format", {"type": "xml"}), ("response_format", "json"),
     ("response_format", {"type": "json_schema", "json_schema": {}}),
     ("tool_choice", "required"), ("tool_choice", {"type": "function"}),
     ("function_call", {"name": "f"}), ("functions", [{"name": "f"}]),
     ("guided_json", "[1]"), ("guided_json", "{not json"), ("guided_choice", [""]),
     ("guided_choice", "a"), ("guided_regex", 5), ("guided_grammar", "x" * 65537),
     ("structured_outputs", {"structural_tag": "x"}), ("structured_outputs", {}),
     ("structured_outputs", {"regex": "a", "choice": ["b"]}),
     ("structured_outputs", {"regex": "a", "disable_any_whitespace": True}),
     ("guided_json", '{"a":' * 2999 + "{}" + "}" * 2999),
     ("guided_whitespace_pattern", " "), ("include_stop_str_in_output", True),
     ("skip_special_tokens", False), ("skip_special_tokens", 1), ("use_beam_search", True),
     ("length_penalty", 0.5), ("length_penalty", True), ("allowed_token_ids", [1]),
     ("bad_words", ["x"]), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 5),
     ("return_tokens_as_token_ids", True), ("add_special_tokens", 0),
     ("add_special_tokens", "false"),
     ("spaces_between_special_tokens", False), ("thinking_token_budget", 5)],
)  # fmt: skip
def test_fields_that_ask_what_is_not_served_are_a_bad_request_naming_them(
    field: str, value: Any
) -> None:
    body = {"model": "m", "prompt": "p", field: value}
    if field == "stream_options":
        body["stream"] = True
    with pytest.raises(BadRequest) as exc:
        decode_call(json.dumps(body).encode(), chat=False)
    assert exc.value.param == field


@pytest.mark.parametrize(
    ("fields", "form"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": {"type": "object"}}}},
            {"json": '{"type":"object"}'},
        ),
        ({"guided_json": {"type": "object"}}, {"json": '{"type":"object"}'}),
        ({"guided_json": '{"type": "object"}'}, {"json": '{"type": "object"}'}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"structured_outputs": {"choice": ["a"], "json": None}}, {"choice": ["a"]}),
        ({"response_format": {"type": "text"}, "guided_json": None}, None),
        # keys that ask nothing, as clients send every key
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": None,
                                    "structural_tag": None, "disable_any_whitespace": False}},
            {"regex": "a+"},
        ),
    ],
)  # fmt: skip
def test_structured_output_asked_any_way_reaches_the_tasks_params(
    fields: dict[str, Any], form: dict[str, Any] | None
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    structured = decode_call(json.dumps(body).encode(), chat=True).params.structured
    assert (msgspec.to_builtins(structured) if structured else None) == form


def test_two_structured_outputs_at_once_are_refused_naming_the_second() -> None:
    body = {"model": "m", "prompt": "x", "response_format": {"type": "json_object"},
            "guided_regex": "a"}  # fmt: skip
    with pytest.raises(BadRequest) as refused:
        decode_call(json.dumps(body).encode(), chat=False)
    assert refused.value.param == "guided_regex" and "one structured output" in str(refused.value)


def test_a_chat_asking_min_tokens_without_max_tokens_is_not_held_to_a_placeholder() -> None:
    # (the door replaces a chat's max_tokens default with http.chat_max_tokens_default)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": 300}'
    assert decode_call(body, chat=True).params.min_tokens == 300
    with pytest.raises(BadRequest) as refused:  # completions: OpenAI's default 16 stands
        decode_call(b'{"model": "m", "prompt": "x", "min_tokens": 300}', chat=False)
    assert refused.value.param == "min_tokens"
    with pytest.raises(BadRequest) as refused:  # past what any max_tokens may be
        decode_call(body.replace(b"300", b"40000"), chat=True)
    assert refused.value.param == "min_tokens"


@pytest.mark.parametrize("chat", [False, True])
def test_penalties_min_p_and_min_tokens_reach_the_tasks_params(chat: bool) -> None:
    asked = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
             "min_p": 0.1, "min_tokens": 3, "max_tokens": 8}  # fmt: skip
    body = {"model": "m", **asked}
    body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    params = decode_call(json.dumps(body).encode(), chat=chat).params
    assert {name: getattr(params, name) for name in asked} == asked
    # Left out: none (vLLM's defaults), and not written on the wire at all.
    plain = decode_call(b'{"model": "m", "prompt": "x"}', chat=False).params
    assert (plain.presence_penalty, plain.repetition_penalty, plain.min_tokens) == (0, 1, 0)
    assert b"penalty" not in msgspec.msgpack.encode(plain)


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
    # an engine's refusal of a prompt over the context: OpenAI's code and param
    from gossipd.engines.base import context_exceeded

    too_long = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(context_exceeded(512, 900, "")))
    for chat, param in ((True, "messages"), (False, "prompt")):
        status, body, _ = error_of(too_long, chat=chat)
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded"
        assert error["param"] == param and error["message"].startswith(
            "This model's maximum context length is 512 tokens"
        )


def test_json_nested_deeper_than_the_decoder_goes_is_a_bad_request() -> None:
    with pytest.raises(BadRequest) as exc:
        decode_call(b"[" * 200_000 + b"]" * 200_000, chat=False)
    assert exc.value.status == 400 and "nested" in exc.value.message


def test_a_chat_prompt_is_the_rendered_template_whole_its_bos_included() -> None:
    """The engine adds no special tokens to a chat's prompt (its params say so: the door's
    chat tests), so the BOS the template writes stays in it."""
    from gossipd.http.chat import ChatTemplate, TemplateFailed

    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}",
        bos_token="<s>",
    )
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    broken = ChatTemplate("{{ raise_me() }}")
    with pytest.raises(TemplateFailed):
        broken.render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("chat", [False, True])
def test_add_special_tokens_is_read_as_asked_and_none_when_not(chat: bool) -> None:
    """vLLM's add_special_tokens, on completions and chats: what the request says (the
    door applies it, or its default where it says nothing: tests/test_http_answers.py)."""
    asked: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "p"}
    )
    for value in (True, False, None):
        body = {"model": "m", **asked, "add_special_tokens": value}
        assert decode_call(json.dumps(body).encode(), chat=chat).special_tokens is value
    plain = decode_call(json.dumps({"model": "m", **asked}).encode(), chat=chat)
    assert plain.special_tokens is None


def test_only_a_models_own_template_is_taken_to_write_its_special_tokens(tmp_path: Path) -> None:
    """The plain template stands in for a model without one (and for an engine without a
    model directory) and writes no BOS: its chats are tokenized with the tokenizer's own."""
    from gossipd.http.chat import PLAIN_TEMPLATE, ChatTemplate, chat_template_for

    hi = [{"role": "user", "content": "hi"}]
    assert not chat_template_for("").own
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    plain = chat_template_for(str(tmp_path))
    assert not plain.own and plain.render(hi) == ChatTemplate(PLAIN_TEMPLATE).render(hi)
    config = {"bos_token": {"content": "<s>"}, "chat_template": "{{ bos_token }}x"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    own = chat_template_for(str(tmp_path))
    assert own.own and own.render(hi) == "<s>x"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")
    assert chat_template_for(str(tmp_path)).render(hi) == "[hi]"


def test_a_session_header_is_the_same_key_as_the_same_text_sent_as_user() -> None:
    """The wire reads header bytes as latin-1; the key is the client's UTF-8 text, as
    `user` would give it, its length counted in code points (256 kept, longer hashed)."""
    from gossipd.http.openai_api import header_text, placement_key

    for text in ("s-1", "séance-ü", "é" * 256, "é" * 257, "日本" * 200):
        on_the_wire = text.encode("utf-8").decode("latin-1")  # what server.py hands over
        assert placement_key(header_text(on_the_wire)) == placement_key(text)
    assert placement_key("é" * 256) == "é" * 256
    assert placement_key("é" * 257).startswith("h:")
    assert header_text("\xff\xfe") == "\ufffd\ufffd"  # not UTF-8: still one key


def test_values_vllm_reads_its_own_way_are_read_so() -> None:
    """top_k 0 is off and seed -1 none, as vLLM reads them; a max_tokens over what a task
    carries is cut to it, as vLLM cuts it to the context; the rest of their ranges stays a
    400 naming the field."""
    for fast in (True, False):  # the typed pass, and the full rules (an extra field)
        extra = "" if fast else ', "min_tokens": 0'
        body = '{"model": "m", "prompt": "p", "top_k": 0, "seed": -1, "max_tokens": 100000%s}'
        call = decode_call((body % extra).encode(), chat=False)
        assert call.params.top_k == -1 and call.params.seed is None
        assert call.params.max_tokens == 32768 and not call.max_tokens_default
    for field, value in (("seed", -2), ("max_tokens", 0), ("top_k", -2)):
        with pytest.raises(BadRequest) as exc:
            decode_call(
                json.dumps({"model": "m", "prompt": "p", field: value}).encode(), chat=False
            )
        assert exc.value.param == field
    assert decode_call(b'{"model": "m", "prompt": "p"}', chat=False).max_tokens_default


def test_a_message_keeps_its_name_for_the_template() -> None:
    from gossipd.http.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m.name }}: {{ m.content }}{% endfor %}")
    for content in ('"hi"', "null"):  # the typed pass; the full rules (content null)
        body = '{"model": "m", "messages": [{"role": "user", "content": %s, "name": "bo"}]}'
        call = decode_call((body % content).encode(), chat=True)
        assert call.messages is not None
        assert template.render(call.messages) == "bo: " + ("hi" if content == '"hi"' else "")
    with pytest.raises(BadRequest) as exc:
        decode_call(b'{"model": "m", "messages": [{"role": "u", "content": "", "name": 5}]}',
                    chat=True)  # fmt: skip
    assert exc.value.param == "messages" and "name" in exc.value.message


_BODIES = [
    b'{"model": "m", "prompt": "p"}',
    b'{"model": "m", "prompt": "p", "max_tokens": 100000, "top_k": 0, "seed": -1}',
    b'{"model": "m", "prompt": "p", "max_tokens": 0}',
    b'{"model": "m", "prompt": "p", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 1}',
    b'{"model": "m", "prompt": "p", "top_k": -2}',
    b'{"model": "m", "prompt": "p", "seed": -2}',
    b'{"model": "m", "prompt": "p", "stream": true, "stream_options": {"include_usage": true}}',
    b'{"model": "m", "prompt": "p", "ignore_eos": true, "user": "u"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x", "name": "n"}], '
    b'"max_completion_tokens": 3, "max_tokens": 9}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40000}',
]


@pytest.mark.parametrize("body", _BODIES)
def test_the_typed_pass_takes_a_body_as_the_full_rules_take_it(body: bytes) -> None:
    """decode_call's fast pass (_usual_call) must agree with the field-by-field rules: the
    same Call, or both a 400 on the same field (the fast pass hands over: None)."""
    from gossipd.http.openai_api import _decode_call, _usual_call, _usual_decode

    chat = b"messages" in body
    fast = _usual_call(_usual_decode(body), chat)
    try:
        full = _decode_call(body, chat=chat)
    except BadRequest:
        assert fast is None
    else:
        assert fast is not None, "the typed pass handed over a body it should take"
        assert fast == full


def test_templates_render_as_hugging_face_renders_them() -> None:
    from gossipd.http.chat import ChatTemplate, TemplateBroken, TemplateFailed

    hi = [{"role": "user", "content": "<hi> é"}, {"role": "user", "content": "stop here"}]
    looping = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    assert looping.render(hi) == '{"role": "user", "content": "<hi> é"}4'
    refusing = ChatTemplate("{{ raise_exception('roles must alternate user/assistant') }}")
    with pytest.raises(TemplateFailed) as failed:
        refusing.render(hi)
    assert "roles must alternate user/assistant" in str(failed.value)
    hf = ChatTemplate(
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% endfor %}{% if tools is not none %}TOOLS{% endif %}"
        "{{ messages[0] | tojson(ensure_ascii=True) }}"
    )
    assert hf.render(hi[:1]) == '<hi> é{"role": "user", "content": "<hi> \\u00e9"}'
    broken = ChatTemplate("{% for m in messages %}")  # never closed: does not parse
    assert "does not parse" in broken.broken
    with pytest.raises(TemplateBroken):
        broken.render(hi)


@pytest.mark.parametrize(
    ("field", "taken", "refused"),
    [
        ("add_generation_prompt", True, False),
        ("continue_final_message", False, True),
        ("chat_template", None, "{{ messages }}"),
        ("chat_template_kwargs", {}, {"enable_thinking": False}),
    ],
)
def test_a_chats_template_fields_are_taken_at_what_the_door_does_else_refused(
    field: str, taken: Any, refused: Any
) -> None:
    def body(value: Any) -> bytes:
        return json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
        ).encode()

    assert decode_call(body(taken), chat=True).chat
    with pytest.raises(BadRequest) as exc:
        decode_call(body(refused), chat=True)
    assert exc.value.param == field and field in exc.value.message
