"""Field rules of docs/PROTOCOL.md's HTTP mapping that a review found the door did not keep:
each request here was taken (or refused naming another field) before, and now gets what the
document says (gossipd/http/openai_api.py, sampling_fields.py, logprobs.py,
openai_answers.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gossipd.core.messages import ErrorCode, ErrorInfo
from gossipd.core.sampling import LOGPROB_ENTRIES_MAX
from gossipd.engines.vllm import _refused
from gossipd.http.openai_answers import error_of
from gossipd.http.openai_api import BadRequest, decode_call

CHAT = [{"role": "user", "content": "hi"}]


def _call(doc: dict[str, Any], *, chat: bool) -> Any:
    return decode_call(json.dumps({"model": "m", **doc}).encode(), chat=chat)


def _refusal(doc: dict[str, Any], *, chat: bool) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        _call(doc, chat=chat)
    return refused.value


@pytest.mark.parametrize("part", [{"type": "text", "text": None}, {"type": "text", "text": 5},
                                  {"type": "text"}])  # fmt: skip
def test_a_text_part_without_a_string_is_refused_not_rendered_as_none(part: Any) -> None:
    refused = _refusal({"messages": [{"role": "user", "content": [part]}]}, chat=True)
    assert refused.param == "messages" and "string" in refused.message


def test_text_parts_are_joined_with_a_newline_as_vllm_joins_them() -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    call = _call({"messages": [{"role": "user", "content": parts}]}, chat=True)
    assert call.messages[0]["content"] == "Hello\nWorld"


def test_a_chat_whose_min_tokens_its_log_probabilities_cannot_hold_names_min_tokens() -> None:
    most = LOGPROB_ENTRIES_MAX // 21
    asked = {"messages": CHAT, "logprobs": True, "top_logprobs": 20}
    refused = _refusal({**asked, "min_tokens": most + 1}, chat=True)
    assert refused.param == "min_tokens" and f"({most} at most" in refused.message
    taken = _call({**asked, "min_tokens": most}, chat=True)  # (the door cuts the default)
    assert taken.params.min_tokens == most and taken.params.max_tokens == most
    assert _call({**asked, "min_tokens": 300}, chat=True).params.max_tokens >= 300


def test_max_tokens_is_checked_also_where_max_completion_tokens_wins() -> None:
    refused = _refusal({"messages": CHAT, "max_completion_tokens": 5, "max_tokens": "x"},
                       chat=True)  # fmt: skip
    assert refused.param == "max_tokens"
    both = _call({"messages": CHAT, "max_completion_tokens": 5, "max_tokens": 9}, chat=True)
    assert both.params.max_tokens == 5
    for losing in (0, -5):  # (the typed first pass took -5, the full rules 0)
        refused = _refusal({"messages": CHAT, "max_completion_tokens": 10, "max_tokens": losing},
                           chat=True)  # fmt: skip
        assert refused.param == "max_tokens"


@pytest.mark.parametrize("user", [False, 0, [], {}, 5])
def test_user_is_a_string_or_null(user: Any) -> None:
    for chat, doc in ((False, {"prompt": "p"}), (True, {"messages": CHAT})):
        assert _refusal({**doc, "user": user}, chat=chat).param == "user"
        assert _call({**doc, "user": None}, chat=chat).user == ""
        assert _call({**doc, "user": "u1"}, chat=chat).user == "u1"


@pytest.mark.parametrize("top", [False, 0.0, True, 1])
def test_completions_take_top_logprobs_only_as_the_integer_0(top: Any) -> None:
    assert _refusal({"prompt": "p", "top_logprobs": top}, chat=False).param == "top_logprobs"


def test_completions_take_top_logprobs_0_and_null_as_nothing() -> None:
    for top in (0, None):
        assert _call({"prompt": "p", "top_logprobs": top}, chat=False).params.logprobs is None


@pytest.mark.parametrize("tools", [False, {}, "", [{"type": "function"}]])
def test_completions_take_tools_only_as_empty_list_or_null(tools: Any) -> None:
    assert _refusal({"prompt": "p", "tools": tools}, chat=False).param == "tools"


@pytest.mark.parametrize("bias", [[], ""])
def test_logit_bias_empty_forms_are_the_documented_ones(bias: Any) -> None:
    assert _refusal({"prompt": "p", "logit_bias": bias}, chat=False).param == "logit_bias"
    for nothing in (None, False, {}):
        assert _call({"prompt": "p", "logit_bias": nothing}, chat=False).params.logit_bias is None
    assert _call({"prompt": "p", "tools": []}, chat=False).params.max_tokens == 16


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        ({"structured_outputs": {"json": None, "regex": None, "choice": None, "grammar": None,
                                 "json_object": None, "disable_any_whitespace": False}},
         "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)  # fmt: skip
def test_structured_outputs_naming_no_form_are_refused_as_vllm_serve_refuses_them(
    doc: dict[str, Any], param: str
) -> None:
    """(vLLM's StructuredOutputsParams: "none are specified"; the review read the doc's
    "a null value asks nothing" as taking these, which vllm serve does not.)"""
    assert _refusal({"prompt": "p", **doc}, chat=False).param == param


def test_structured_outputs_take_the_one_form_beside_null_ones() -> None:
    doc = {"structured_outputs": {"json": None, "regex": "a+", "disable_any_whitespace": False}}
    assert _call({"prompt": "p", **doc}, chat=False).params.structured.regex == "a+"
    refused = _refusal({"prompt": "p", "structured_outputs": {"disable_any_whitespace": True}},
                       chat=False)  # fmt: skip
    assert refused.param == "structured_outputs"


class _Named(ValueError):
    """vLLM's VLLMValidationError's shape: a message and the parameter it refused."""

    def __init__(self, message: str, parameter: str | None) -> None:
        super().__init__(message)
        self.parameter = parameter


def test_an_engines_refusal_names_the_field_vllm_names() -> None:
    named = _refused(
        _Named("token_id(s) [99] in stop_token_ids contain out-of-vocab", "stop_token_ids")
    )
    assert str(named).startswith("stop_token_ids: token_id(s) [99]")
    assert str(_refused(_Named("bad", None), "refused by vLLM: ")) == "refused by vLLM: bad"
    too_long = "This model's maximum context length is 512 tokens. However, your prompt ..."
    kept = _refused(_Named(too_long, "input_tokens"))  # (vLLM names a field here too)
    assert str(kept) == too_long  # OpenAI's words, as clients match them
    status, body, _ = error_of(ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(kept)))
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    for message, param in (
        (str(named), "stop_token_ids"),
        ("logit_bias: token_id(s) [99] in logit_bias contain out-of-vocab", "logit_bias"),
        ("sampling parameters refused by vLLM: bad", None),
        ("prompt_token_ids: not a field the door names", None),
    ):
        error = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=message)
        status, body, _ = error_of(error)
        assert status == 400 and json.loads(body)["error"]["param"] == param, message
