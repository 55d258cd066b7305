"""Tool calling at the HTTP door (gossipd/http/tools.py; docs/PROTOCOL.md "HTTP"): the rules
a chat's tools, tool_choice and tool turns are held to, the Hermes calls read back from an
answer (hypothesis: every call written is read back, no text makes the reader raise), the
structured output that holds "required" and named calls, the answers whole and streamed.
Then two real daemons with the echo engine, through the official openai client: the echo of
a prompt that holds a call is an answer that makes one."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import openai
import pytest
from hypothesis import example, given

from gossipd.core.messages import TokenUsage
from gossipd.core.sampling import StructuredOutput
from gossipd.http.chat import PLAIN_TEMPLATE, ChatTemplate
from gossipd.http.openai_answers import StreamWriter, whole_answer
from gossipd.http.openai_api import BadRequest, decode_call
from gossipd.http.tools import ToolUse, content_part, hermes_calls, read_answer, structured_for
from simulations.cluster import Cluster
from tests.helpers import key_owned_by

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "weather?"}]


def _chat(**body: Any) -> Any:
    return decode_call(json.dumps({"model": "m", "messages": USER, **body}).encode(), chat=True)


# -- the rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": {"a": 1}}, "tools", "a list"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "functions only"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "1 to 256"),
        ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "tools", "true or false"),
        ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "tools", "JSON Schema"),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", '"required"'),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "no tool named 'x'",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "send one",
        ),
        ({"functions": [WEATHER["function"]]}, "functions", "send tools"),
        (
            {
                "tools": [
                    {"function": {"name": "f", "parameters": {"$defs": {"City": {"type": t}}}}}
                    for t in ("string", "integer")
                ],
                "tool_choice": "required",
            },
            "tools",
            "differs between tools",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages",
            "assistant",
        ),
    ],
)
def test_tools_that_break_a_rule_are_refused_naming_the_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        _chat(**body)
    assert refused.value.param == param and refused.value.status == 400
    assert says in refused.value.message


def test_completions_take_no_tools_and_empty_tools_ask_nothing() -> None:
    with pytest.raises(BadRequest) as refused:
        decode_call(b'{"model": "m", "prompt": "x", "tools": [{"type": "function"}]}', chat=False)
    assert refused.value.param == "tools"
    with pytest.raises(BadRequest) as refused:
        decode_call(b'{"model": "m", "prompt": "x", "tool_choice": "required"}', chat=False)
    assert refused.value.param == "tool_choice"
    assert _chat(tools=[], tool_choice="auto").tools is None
    assert _chat(tools=[WEATHER], tool_choice="none").tools == ToolUse([WEATHER], "none")


def test_required_and_named_hold_the_output_to_the_tools_as_vllm_builds_it() -> None:
    bare = {"type": "function", "function": {"name": "now"}}
    call = _chat(tools=[WEATHER, bare], tool_choice="required", parallel_tool_calls=False)
    assert call.tools.choice == "required" and not call.tools.parallel
    form = call.params.structured
    assert isinstance(form, StructuredOutput) and form.json is not None
    schema = json.loads(form.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"]["enum"] == ["get_weather"]
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = _chat(tools=[WEATHER, bare], tool_choice={"type": "function",
                  "function": {"name": "get_weather"}})  # fmt: skip
    assert json.loads(named.params.structured.json) == WEATHER["function"]["parameters"]
    assert _chat(tools=[WEATHER]).params.structured is None  # auto: the model writes
    assert structured_for(ToolUse([WEATHER], "none")) is None


def test_a_required_call_holds_each_tools_definitions_at_the_root() -> None:
    """A nested pydantic model's tool ($defs, "$ref": "#/$defs/X") under "required": its
    $defs go to the root, where the $ref points (as vLLM builds it)."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}}
    nested = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
        "$defs": {"Address": address}}}}  # fmt: skip
    schema = json.loads(
        _chat(tools=[WEATHER, nested], tool_choice="required").params.structured.json
    )
    assert schema["$defs"] == {"Address": address}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    # Names as vLLM takes them (MCP's "server:tool"), and a tool_choice without its type.
    mcp = {"type": "function", "function": {"name": "files:search"}}
    named = _chat(tools=[mcp], tool_choice={"function": {"name": "files:search"}})
    assert named.tools.choice == "named" and named.tools.name == "files:search"


def test_a_past_call_goes_to_the_template_with_its_arguments_as_an_object() -> None:
    call = _chat(
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type":
             "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
        tools=[WEATHER],
    )  # fmt: skip
    assistant, tool = call.messages[1:]
    assert assistant["content"] == "" and assistant["tool_calls"] == [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]  # fmt: skip
    assert tool == {"role": "tool", "content": "rain", "tool_call_id": "c1"}
    prompt = ChatTemplate(PLAIN_TEMPLATE).render(call.messages, call.tools.tools)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert json.dumps(WEATHER["function"]) in prompt and "<|tool|>\nrain\n" in prompt
    # Arguments that are not an object's JSON (a call cut at max_tokens, sent back): {}, as
    # vLLM reads them, so that the conversation goes on.
    for cut in ('{"city": "Os', "[1, 2]", "42", ""):
        again = _chat(messages=[{"role": "assistant", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": cut}}]}])  # fmt: skip
        assert again.messages[0]["tool_calls"][0]["function"]["arguments"] == {}


_OLD_PLAIN = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": st.text(max_size=30)}),
    min_size=1, max_size=4,
)  # fmt: skip


@given(_MESSAGES)
def test_without_tools_the_plain_template_renders_as_before_tools(messages: list[Any]) -> None:
    assert ChatTemplate(PLAIN_TEMPLATE).render(messages) == ChatTemplate(_OLD_PLAIN).render(
        messages
    )


# -- reading an answer ---------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_CALLS = st.lists(
    st.tuples(st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True),
              st.dictionaries(st.text(max_size=6), _JSON, max_size=3)),
    min_size=1, max_size=3,
)  # fmt: skip


@given(st.text(max_size=40).filter(lambda t: "<tool_call>" not in t), _CALLS, st.booleans())
@example(" \n", [("a", {})], False)  # (blank before a call: no content; CI found it)
def test_every_hermes_call_written_is_read_back(
    before: str, calls: list[tuple[str, dict[str, Any]]], cut_last: bool
) -> None:
    text = before + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls
    )
    if cut_last:  # a model cut at max_tokens after its last call's JSON: still read
        text = text[: -len("</tool_call>\n")]
    found = hermes_calls(text)
    assert found is not None
    content, read = found
    assert content == (before if before.strip() else None)  # (blank before a call: none)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read] == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in read)
    assert len({c["id"] for c in read}) == len(read)


@given(st.text(max_size=200) | st.builds(lambda a, b: a + "<tool_call>" + b, st.text(), st.text()))
def test_no_text_makes_the_reader_raise_and_a_broken_call_leaves_the_text_as_content(
    text: str,
) -> None:
    read = read_answer(ToolUse([WEATHER], "auto"), text, "stop")
    if read.calls:
        assert read.finish_reason == "tool_calls"
    else:
        assert read.content == text and read.finish_reason == "stop"
    required = read_answer(ToolUse([WEATHER], "required"), text, "length")
    assert required.calls or required.content == text


@given(
    st.lists(st.sampled_from(["a", " ", "\n", "<", "<tool", "_call>", "<tool_call>", '{"name": "f"}',
                              "</tool_call>", "tool_call>", "<tool_c"]), max_size=12),
    st.randoms(use_true_random=False),
)  # fmt: skip
def test_what_streams_before_the_answer_is_read_is_a_prefix_of_its_content(
    pieces: list[str], rnd: Any
) -> None:
    """ "auto", streamed: the parts sent as content while the answer runs, however its text
    is cut into deltas, are a prefix of the content the whole answer reads as; the text
    held back is never more than a tag's start; without a call, everything goes."""
    text = "".join(pieces)
    cuts = sorted(rnd.sample(range(len(text) + 1), min(4, len(text) + 1)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    held, sent, calling = "", "", False
    for delta in deltas:
        if calling:
            continue
        part, held, calling = content_part(held, delta, bool(sent))
        sent += part
        assert len(held.lstrip()) < len("<tool_call>")  # (a blank start, a tag's start)
    read = read_answer(ToolUse([WEATHER], "auto"), text, "stop")
    assert (read.content or "").startswith(sent)
    if "<tool_call>" not in text:
        assert sent + held == text


def test_required_and_named_answers_become_calls() -> None:
    use = ToolUse([WEATHER], "required")
    read = read_answer(use, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop")
    assert read.content is None and read.finish_reason == "tool_calls"
    assert json.loads(read.calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    cut = read_answer(use, '[{"name": "get_weather", "param', "length")
    assert cut.calls == [] and cut.content == '[{"name": "get_weather", "param'
    assert read_answer(ToolUse([WEATHER], "named", "get_weather"), "", "length").calls == []
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    both = read_answer(ToolUse([WEATHER], "auto"), two, "stop")
    assert [c["function"]["name"] for c in both.calls] == ["a", "b"]
    assert both.calls[1]["function"]["arguments"] == "{}"  # (no arguments: none)
    one = read_answer(ToolUse([WEATHER], "auto", parallel=False), "\n " + two, "stop")
    assert [c["function"]["name"] for c in one.calls] == ["a"] and one.content is None
    named = read_answer(ToolUse([WEATHER], "named", "get_weather"), '{"city": "x"}', "stop")
    assert named.finish_reason == "stop"  # (OpenAI's, and vLLM's, for a named function)
    assert named.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "x"}'}


def test_the_answer_whole_and_streamed_carries_the_calls() -> None:
    call = _chat(tools=[WEATHER], stream=True, stream_options={"include_usage": True})
    text = (
        'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    usage = TokenUsage(prompt_tokens=3, completion_tokens=9, finish_reason="stop")
    body = json.loads(whole_answer(call, "chatcmpl-1", 1, text, usage))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    writer = StreamWriter(call, "chatcmpl-1", 1)
    assert writer.reads_calls
    raw = writer.read_choice(text, usage) + writer.end({"total_tokens": 12})
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    first, calls = (e["choices"][0]["delta"] for e in events[:2])
    assert first == {"role": "assistant", "content": "Let me look."}
    (streamed,) = calls.pop("tool_calls")
    assert calls == {} and streamed.pop("index") == 0 and streamed.pop("id").startswith("chatcmpl-")
    assert streamed == {k: v for k, v in choice["message"]["tool_calls"][0].items() if k != "id"}
    assert events[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[3]["choices"] == [] and raw.endswith(b"data: [DONE]\n\n")
    assert not StreamWriter(_chat(tools=[WEATHER], tool_choice="none"), "c", 1).reads_calls
    # Its first 4 characters streamed already: the rest of the content, then the calls.
    again = StreamWriter(call, "chatcmpl-1", 1).read_choice(text, usage, 0, 4)
    assert json.loads(again.split(b"\n\n")[0][6:])["choices"][0]["delta"]["content"] == "me look."


# -- on real daemons, through the official openai client ---------------------------------


def test_an_answer_that_writes_a_call_is_a_tool_call_local_and_forwarded(
    echo_pair: Cluster,
) -> None:
    """The echo engine answers the prompt's words: a user message that holds a Hermes call
    makes an answer that writes one, read back as the tool call, whole and streamed, on the
    entry and across the fan-out."""
    entry, owner = echo_pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    messages: Any = [
        {"role": "user", "content": '<tool_call>{"name":"get_weather","arguments":{"city":'
                                    '"Oslo"}}</tool_call>'},
    ]  # fmt: skip
    words = len(ChatTemplate(PLAIN_TEMPLATE).render(messages, [WEATHER]).split())
    for where in (entry, owner):
        session = key_owned_by(echo_pair, where.name)
        raw = client.chat.completions.with_raw_response.create(
            model="echo", messages=messages, tools=[WEATHER], max_tokens=words,
            extra_headers={"x-session-id": session},
        )  # fmt: skip
        assert raw.headers["x-gossipd-member"] == where.name
        (choice,) = raw.parse().choices
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or "").startswith("<|system|> Tools you may call")
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}
        stream = client.chat.completions.create(
            model="echo", messages=messages, tools=[WEATHER], max_tokens=words, stream=True,
            extra_headers={"x-session-id": session},
        )  # fmt: skip
        deltas = [c.choices[0] for c in stream]
        content = "".join(d.delta.content or "" for d in deltas)
        assert content == choice.message.content
        assert sum(1 for d in deltas if d.delta.content) > 3  # (streamed as the words came)
        (streamed,) = [t for d in deltas for t in d.delta.tool_calls or []]
        assert streamed.function.arguments == call.function.arguments
        assert deltas[-1].finish_reason == "tool_calls"
    # tool_choice "none": the same words are the answer's text, no call read from them.
    plain = client.chat.completions.create(
        model="echo", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=words
    ).choices[0]
    assert plain.message.tool_calls is None and "<tool_call>" in (plain.message.content or "")
    assert plain.finish_reason == "length"


def test_auto_streamed_past_a_gap_sends_no_content_twice() -> None:
    """A stream read for calls whose first chunk never came (HELD_CHUNKS_MAX waiting): what
    streamed is no prefix of the content, so none of the content is sent again at the end."""
    from gossipd.core.messages import Chunk, Result
    from gossipd.http.answers import HELD_CHUNKS_MAX
    from tests.test_http_answers import streaming

    answers, exchange = streaming(_chat(tools=[WEATHER], stream=True), "t")
    deltas = [f"w{i} " for i in range(HELD_CHUNKS_MAX + 1)]  # seq 0 never comes
    for seq in range(1, HELD_CHUNKS_MAX + 1):
        answers.deliver_message(Chunk(id="t", seq=seq, delta=deltas[seq]))
    usage = TokenUsage(completion_tokens=len(deltas), finish_reason="stop")
    answers.deliver_message(Result(id="t", ok=True, text="".join(deltas), usage=usage))
    events = [json.loads(raw[6:]) for raw in b"".join(exchange.events).split(b"\n\n")
              if raw.startswith(b"data: {")]  # fmt: skip
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content == "".join(deltas[1:])
