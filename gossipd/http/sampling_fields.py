"""The sampling fields of an OpenAI request body, read as a task's params take them: the
floats, ``max_tokens``' default and cut, vLLM's readings of ``top_k`` 0 and ``seed`` -1,
structured output (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*``), ``logit_bias``, and vLLM's fields a task does not carry, taken only at the
values that ask nothing (docs/PROTOCOL.md "HTTP").  gossipd/http/openai_api.py walks the
body; this module reads its sampling fields."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gossipd.core.sampling import (
    MODEL_DEFAULT_TEMPERATURE,
    MODEL_DEFAULT_TOP_K,
    MODEL_DEFAULT_TOP_P,
)
from gossipd.http.badrequest import BadRequest

_json_encode = msgspec.json.Encoder().encode

MAX_TOKENS_MAX = 32768  # what a task's params carry (sampling.SamplingParams)


# The float sampling fields, taken as the task's params bound them.
FLOATS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)


# vLLM's older structured-output fields, to StructuredOutput's.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_OFF = ("disable_any_whitespace", "disable_additional_properties")  # false: nothing asked


def structured_form(doc: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """What the output is held to, from OpenAI's ``response_format`` or vLLM's
    ``structured_outputs`` / ``guided_*`` (one of them at most): (the request's field, a
    StructuredOutput's fields), which the task's params check; None: free text."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = doc.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequest("response_format: json_schema.schema must be a JSON Schema "
                                 "object", param="response_format")  # fmt: skip
            asked.append(("response_format", {"json": _json_encode(schema).decode()}))
        else:
            raise BadRequest(
                'response_format: {"type": "text"}, {"type": "json_object"} or {"type": '
                '"json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
    for name, key in _GUIDED.items():
        value = doc.get(name)
        if value is not None:
            asked.append((name, {key: _schema_text(value) if key == "json" else value}))
    form = doc.get("structured_outputs")
    if form is not None:
        # null, and false for vLLM's two options, ask nothing (clients send every key); an
        # object that names no form is refused, as vllm serve refuses it
        fields = (
            {k: v for k, v in form.items() if v is not None and (k not in _OFF or v is not False)}
            if isinstance(form, dict)
            else None
        )
        if fields is None or set(fields) - set(_STRUCTURED_KEYS):
            raise BadRequest(
                f"structured_outputs: an object of one of {', '.join(_STRUCTURED_KEYS)} "
                "(structural_tag and the whitespace options are not served here)",
                param="structured_outputs",
            )
        if "json" in fields:
            fields["json"] = _schema_text(fields["json"])
        asked.append(("structured_outputs", fields))
    if len(asked) > 1:
        raise BadRequest(
            f"{asked[0][0]} and {asked[1][0]}: one structured output at a time",
            param=asked[1][0],
        )
    return asked[0] if asked else None


def _schema_text(value: object) -> object:
    """A JSON Schema given as an object or as its JSON text: the text (else as given, for
    the params' check to refuse)."""
    if isinstance(value, dict):
        try:
            return _json_encode(value).decode()
        except RecursionError:
            return None  # (refused by the params' check: a schema is JSON text)
    return value


# vLLM's request fields that would change the answer and that a task does not carry, with
# the values that ask nothing beside null (vLLM's defaults, which clients send).  True is
# not 1 here: a value must be of its default's type.
_VLLM_UNSERVED: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "truncation_side": (),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "logprob_token_ids": ([],),
    "prompt_embeds": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "thinking_token_budget": (),
    "repetition_detection": (),
}
# The same for chats' template (the door renders it as `vllm serve` does by default).
# (add_special_tokens is served: openai_api.py reads it, the task carries it.)
_VLLM_UNSERVED_CHAT: dict[str, tuple[object, ...]] = {
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
}


def _asks_nothing(value: object, defaults: tuple[object, ...]) -> bool:
    return value is None or any(type(value) is type(d) and value == d for d in defaults)


def refuse_unserved(doc: dict[str, Any], chat: bool) -> None:
    """Fields vLLM serves and a task cannot carry: the values that ask nothing are taken
    (clients send them), any other is refused rather than ignored (the answer would not be
    what was asked)."""
    for table in (_VLLM_UNSERVED, _VLLM_UNSERVED_CHAT) if chat else (_VLLM_UNSERVED,):
        for name, defaults in table.items():
            if name in doc and not _asks_nothing(doc[name], defaults):
                shown = " or ".join(json.dumps(d) for d in (None, *defaults))
                raise BadRequest(f"{name}: not served by this server (only {shown}, which "
                                 "ask nothing)", param=name)  # fmt: skip
    # (A chat's tool_choice: decode_tools.)  With no tools, "auto" asks nothing.
    for name in ("function_call",) if chat else ("tool_choice", "function_call"):
        if doc.get(name) not in (None, "none", "auto"):
            where = "send tools and tool_choice" if chat else "tools are served on chats"
            raise BadRequest(f"{name}: not served by this server ({where})", param=name)
    if doc.get("functions") not in (None, []):
        raise BadRequest("functions: not served by this server (send tools: its successor)",
                         param="functions")  # fmt: skip
    if doc.get("guided_whitespace_pattern") is not None:
        raise BadRequest("guided_whitespace_pattern: not served by this server",
                         param="guided_whitespace_pattern")  # fmt: skip


def asks_nothing(value: object) -> bool:
    """Absent (None), null, false or empty (``{}``, ``[]``, ``""``): what clients send for a
    field they do not use, which a field the door does not serve takes."""
    return value is None or value is False or (type(value) in (dict, list, str) and not value)


def read_logit_bias(value: object) -> dict[int, object] | None:
    """OpenAI's ``logit_bias``, its keys (token ids, as JSON writes them: decimal text) read
    as integers; the biases are checked by the task's params (-100..100).  Absent, null,
    false or empty asks nothing (LangChain sends ``{}`` on every call)."""
    if value is None or value is False or value == {}:
        return None
    if not isinstance(value, dict):
        raise BadRequest("logit_bias: an object of token ids (as strings) to biases from -100 "
                         "to 100", param="logit_bias")  # fmt: skip
    bias: dict[int, object] = {}
    for key, amount in value.items():
        # ASCII digits only (int() would also take " 7", "+7", "7_0" and other scripts'),
        # without leading zeros (so that "5" and "05" are not one id given twice).
        if not (key.isascii() and key.isdigit()) or len(key) > 20 or key[0] == "0" != key:
            raise BadRequest(f"logit_bias: {key[:40]!r} is not a token id (a decimal "
                             "integer without leading zeros, as a string)",
                             param="logit_bias")  # fmt: skip
        bias[int(key)] = amount
    return bias


def left_out(temperature: object, top_p: object, top_k: object) -> int:
    """Task.model_defaults for the sampling fields a request left out (or sent null)."""
    return (
        (MODEL_DEFAULT_TEMPERATURE if temperature is None else 0)
        | (MODEL_DEFAULT_TOP_P if top_p is None else 0)
        | (MODEL_DEFAULT_TOP_K if top_k is None else 0)
    )


def max_tokens_taken(asked: int | None, default: int) -> int:
    """What a task carries: the default when not asked; more than a task may carry is cut
    to that (as vLLM cuts it to the context: the answer ends with finish_reason "length")."""
    if asked is None:
        return default
    return min(asked, MAX_TOKENS_MAX) if asked > 0 else asked  # (0, negative: refused)


def as_vllm_reads(name: str, value: int) -> int | None:
    """vLLM's readings a task cannot carry as they are: top_k 0 is off (-1), seed -1 none."""
    if name == "top_k" and value == 0:
        return -1
    if name == "seed" and value == -1:
        return None
    return value


def is_int(value: object, n: int) -> bool:
    """``value`` is the JSON integer ``n`` (not true, not n.0)."""
    return type(value) is int and value == n
