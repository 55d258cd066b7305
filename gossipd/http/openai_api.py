"""OpenAI's HTTP API in gossipd's terms: a request body to a task's fields (a Call: one
prompt, or several choices).  The answers' side, a Result or Chunk to what an OpenAI client
parses, is gossipd/http/openai_answers.py.

Pure functions, no IO: the door (gossipd/http/door.py) calls them.  docs/PROTOCOL.md "HTTP"
documents every rule here; a request that breaks one is a ``BadRequest`` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gossipd.core.messages import (
    MODEL_DEFAULT_TEMPERATURE,
    MODEL_DEFAULT_TOP_K,
    MODEL_DEFAULT_TOP_P,
    PROMPT_TOKEN_IDS_MAX,
    TASK_KEY_CHARS_MAX,
    TOKEN_ID_MAX,
    SamplingParams,
)
from gossipd.http.badrequest import BadRequest
from gossipd.http.logprobs import decode_logprobs
from gossipd.http.tools import ToolError, ToolUse, decode_tools, structured_for, tool_turn

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode

COMPLETIONS_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
# Until the door sets it from the model's context (http.chat_max_tokens_default), or when
# that is not known: OpenAI's is "up to the context".
CHAT_MAX_TOKENS_DEFAULT = 256
STOP_MAX = 8
MAX_TOKENS_MAX = 32768  # what a task's params carry (messages.SamplingParams)
MESSAGES_MAX = 1024
N_MAX = 128  # choices per prompt (OpenAI's bound); the door's http.choices_max bounds them all
PROMPTS_MAX = 2048  # prompts in one completions request (OpenAI's bound)
SEED_END = 2**63  # a choice's seed is the request's + its index, modulo this (as vLLM's n)


class Call(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one request asks, decoded: the task's fields and how to answer.  (A struct: made
    per request, and a frozen dataclass's constructor costs 0.8 us.)"""

    chat: bool
    model: str
    prompt: str
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str
    # The request named no max_tokens: params carry the default, which the door may set
    # from the model (chat: up to its context).
    max_tokens_default: bool = False
    # The sampling fields the request left out, as Task.model_defaults bits (MODEL_DEFAULT_*):
    # their model's own defaults, where its engine has them.
    unset_sampling: int = 0
    # Several prompts (completions: a list of strings), in order; () for one (``prompt``).
    prompts: tuple[str, ...] = ()
    # Choices per prompt: choice ``i * n + j`` is prompt i's j-th (as vLLM numbers them).
    n: int = 1
    # A chat's tools (gossipd/http/tools.py); None: it gave none.
    tools: ToolUse | None = None
    # Completions' ``echo``: each choice's text begins with its prompt (and with logprobs,
    # its tokens begin with the prompt's: params.prompt_logprobs).  ``echo_only``: max_tokens
    # 0, the prompt alone (the task generates 1 token, which is not shown: as vLLM).
    echo: bool = False
    echo_only: bool = False
    # Completions' prompts of token ids (a list of integers, or several such lists), in
    # order, each a task's prompt_token_ids (``prompt`` is then ""); () for text prompts.
    token_prompts: tuple[list[int], ...] = ()
    # A request of several choices (several prompts, or n > 1): one task each.
    several: bool = False

    @property
    def choices(self) -> int:
        return (len(self.prompts) or len(self.token_prompts) or 1) * self.n


# The usual request, decoded straight into typed fields (one pass in C: 0.7 us against 2.7
# for the dict walk below).  Only what the full rules accept unchanged is taken here: any
# other field, type or value falls through to ``_decode_call``, which says what is wrong.
class _Message(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    role: str
    content: str
    name: str | None = None


class _StreamOptions(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    include_usage: bool = False


class _Usual(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    model: str
    prompt: str | None = None
    messages: list[_Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None


_usual_decode = msgspec.json.Decoder(_Usual).decode
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")


def decode_call(body: bytes, *, chat: bool) -> Call:
    """A /v1/completions (``chat`` false) or /v1/chat/completions body."""
    try:
        usual = _usual_decode(body)
    except (msgspec.DecodeError, RecursionError):
        return _decode_call(body, chat=chat)
    call = _usual_call(usual, chat)
    return call if call is not None else _decode_call(body, chat=chat)


def _usual_call(doc: _Usual, chat: bool) -> Call | None:
    """``doc`` as the full rules would take it, or None where they may say otherwise."""
    if not doc.model or doc.n not in (None, 1):
        return None
    messages: list[dict[str, Any]] | None = None
    prompt = ""
    if chat:
        if doc.prompt is not None or not doc.messages or len(doc.messages) > MESSAGES_MAX:
            return None
        messages = [
            {"role": m.role, "content": m.content}
            if m.name is None
            else {"role": m.role, "content": m.content, "name": m.name}
            for m in doc.messages
        ]
        max_tokens = doc.max_completion_tokens
        if max_tokens is None:
            max_tokens = doc.max_tokens
        # (A placeholder the door replaces: not below what min_tokens asks.)
        default_max = min(max(CHAT_MAX_TOKENS_DEFAULT, doc.min_tokens or 0), MAX_TOKENS_MAX)
    else:
        if doc.prompt is None or doc.messages is not None:
            return None
        prompt = doc.prompt
        max_tokens = doc.max_tokens
        default_max = COMPLETIONS_MAX_TOKENS_DEFAULT
    fields: dict[str, Any] = {"max_tokens": _max_tokens(max_tokens, default_max)}
    if doc.temperature is not None:
        fields["temperature"] = doc.temperature
    if doc.top_p is not None:
        fields["top_p"] = doc.top_p
    if doc.seed is not None:
        fields["seed"] = _as_vllm_reads("seed", doc.seed)
    if doc.top_k is not None:
        fields["top_k"] = _as_vllm_reads("top_k", doc.top_k)
    if doc.ignore_eos is not None:
        fields["ignore_eos"] = doc.ignore_eos
    if not (
        doc.presence_penalty is None
        and doc.frequency_penalty is None
        and doc.repetition_penalty is None
        and doc.min_p is None
        and doc.min_tokens is None
    ):  # (rare: no loop for the usual request)
        for name in _PENALTIES:
            value = getattr(doc, name)
            if value is not None:
                fields[name] = value
    try:
        params = msgspec.convert(fields, SamplingParams)
    except (msgspec.ValidationError, ValueError):
        return None  # the full rules name the parameter
    options = doc.stream_options
    return Call(
        chat=chat,
        model=doc.model,
        prompt=prompt,
        messages=messages,
        params=params,
        stream=doc.stream,
        include_usage=options is not None and options.include_usage and doc.stream,
        user=doc.user or "",
        max_tokens_default=max_tokens is None,
        unset_sampling=_left_out(doc.temperature, doc.top_p, doc.top_k),
    )


def _decode_call(body: bytes, *, chat: bool) -> Call:
    """Every rule, walked field by field: what ``decode_call``'s typed pass did not take."""
    try:
        doc = _json_decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    model = _str(doc, "model", required=True)
    messages: list[dict[str, Any]] | None = None
    prompt = ""
    tools: ToolUse | None = None
    if chat:
        messages = _messages(doc.get("messages"))
        try:
            tools = decode_tools(doc)
        except ToolError as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        max_tokens = _int(doc, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int(doc, "max_tokens")
        # (A placeholder the door replaces: not below what min_tokens asks.)
        default_max = min(
            max(CHAT_MAX_TOKENS_DEFAULT, _int(doc, "min_tokens") or 0), MAX_TOKENS_MAX
        )
    prompts: tuple[str, ...] = ()
    token_prompts: tuple[list[int], ...] = ()
    if not chat:
        taken = _prompt(doc.get("prompt"))
        if isinstance(taken, str):
            prompt = taken
        elif isinstance(taken[0], list):
            token_prompts = taken
        else:
            prompts = taken
        max_tokens = _int(doc, "max_tokens")
        default_max = COMPLETIONS_MAX_TOKENS_DEFAULT
    n = _int(doc, "n")
    if n is None:
        n = 1
    if not 1 <= n <= N_MAX:
        raise BadRequest(f"n: from 1 to {N_MAX} choices", param="n")
    for name in ("best_of", "suffix", "tools"):
        if name == "tools" and chat:
            continue  # (decode_tools took them)
        value = doc.get(name)
        # Absent, null, false or empty asks nothing; best_of also 1.
        if not (
            value is None
            or value is False
            or (type(value) in (dict, list, str) and not value)
            or (name == "best_of" and _is_int(value, 1))
        ):
            raise BadRequest(f"{name}: not supported by this server", param=name)
    echo = doc.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest("echo: true or false", param="echo")
    if echo and chat:
        raise BadRequest("echo: completions only (POST /v1/completions)", param="echo")
    echo_only = bool(echo) and max_tokens == 0
    if echo_only:
        max_tokens = 1  # (generated and not shown: vLLM's way to score a prompt alone)
    logprobs = decode_logprobs(doc, chat)
    if echo and token_prompts and logprobs is None:
        raise BadRequest(
            "echo: with a prompt of token ids, only with logprobs (the prompt's text is then "
            "its tokens'; this server keeps no tokenizer to write it otherwise)",
            param="echo",
        )
    if logprobs is not None and tools is not None and tools.parses:
        raise BadRequest("logprobs: not served with tools read for calls (tool_choice other "
                         'than "none")', param="logprobs")  # fmt: skip
    _refuse_unserved_sampling(doc, chat)
    stop = doc.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest("stop: a string or a list of non-empty strings", param="stop")
    fields: dict[str, Any] = {"max_tokens": _max_tokens(max_tokens, default_max)}
    for name in _FLOATS:
        value = doc.get(name)
        if value is not None:
            fields[name] = value
    for name in ("seed", "top_k"):
        value = _int(doc, name)
        if value is not None:
            fields[name] = _as_vllm_reads(name, value)
    min_tokens = _int(doc, "min_tokens")
    if min_tokens is not None:
        fields["min_tokens"] = min_tokens
    if stop:
        if len(stop) > STOP_MAX:
            raise BadRequest(f"stop: at most {STOP_MAX} strings", param="stop")
        fields["stop"] = stop
    if doc.get("ignore_eos") is not None:
        fields["ignore_eos"] = doc.get("ignore_eos")
    if (bias := _logit_bias(doc.get("logit_bias"))) is not None:
        fields["logit_bias"] = bias
    if (stop_ids := doc.get("stop_token_ids")) not in (None, []):
        if not isinstance(stop_ids, list):
            raise BadRequest("stop_token_ids: a list of token ids", param="stop_token_ids")
        fields["stop_token_ids"] = stop_ids  # (each an id: the params' check)
    if len(token_prompts) == 1:  # (several: each choice's task its own, at the door)
        fields["prompt_token_ids"] = token_prompts[0]
    if logprobs is not None:
        fields["logprobs"] = logprobs
        if echo:
            fields["prompt_logprobs"] = logprobs
    structured_from = ""
    if (structured := _structured(doc)) is not None:
        structured_from, fields["structured"] = structured
    try:
        held = structured_for(tools) if tools is not None else None
    except ToolError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    if held is not None:
        if structured is not None:
            raise BadRequest(
                f"{structured_from} and tool_choice (required, or a function named): both "
                "hold the output to a form; send one",
                param=structured_from,
            )
        structured_from, fields["structured"] = "tools", held
    try:
        params = msgspec.convert(fields, SamplingParams)
    except (msgspec.ValidationError, ValueError) as exc:
        text = str(exc)
        param = text.split("`$.", 1)[1].split("`", 1)[0] if "`$." in text else None
        if param is None:  # a rule of __post_init__: its message starts with the field
            first = text.split(" ", 1)[0]
            param = first if first in SamplingParams.__struct_fields__ else None
        else:
            param = param.split("[", 1)[0]  # the field, as OpenAI names it: "stop", not "stop[0]"
        if param is not None and param.startswith("structured"):
            param = structured_from  # (the request's name for it)
        if param == "max_tokens" and chat:
            param = "max_completion_tokens" if "max_completion_tokens" in doc else "max_tokens"
        if param == "logprobs" and chat and doc.get("top_logprobs"):
            param = "top_logprobs"
        raise BadRequest(
            f"{param or 'parameters'}: {text.split(' - at ')[0]}", param=param
        ) from None
    stream = doc.get("stream")
    if stream is None:  # null: as absent (some clients send every field)
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream: true or false", param="stream")
    options = doc.get("stream_options")
    include_usage = False
    if options is not None and stream:  # without a stream: ignored (PROTOCOL.md)
        if not isinstance(options, dict):
            raise BadRequest("stream_options: an object", param="stream_options")
        asked = options.get("include_usage")
        if asked is not None and not isinstance(asked, bool):  # "false" is not false
            raise BadRequest(
                "stream_options.include_usage: true or false", param="stream_options.include_usage"
            )
        include_usage = asked is True  # null: as absent
    user = doc.get("user") or ""
    if not isinstance(user, str):
        raise BadRequest("user: a string", param="user")
    return Call(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        params=params,
        stream=stream,
        include_usage=include_usage and stream,
        user=user,
        max_tokens_default=max_tokens is None,
        unset_sampling=_left_out(doc.get("temperature"), doc.get("top_p"), doc.get("top_k")),
        prompts=prompts,
        n=n,
        echo=bool(echo),
        echo_only=echo_only,
        token_prompts=token_prompts,
        several=n > 1 or bool(prompts) or len(token_prompts) > 1,
        tools=tools,
    )


# The float sampling fields, taken as the task's params bound them.
_FLOATS = (
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


def _structured(doc: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
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
        # null, and false for vLLM's two options, ask nothing (clients send every key)
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
# The same for chats' template (the door renders it as `vllm serve` does by default) and
# for tokenization: completions' text is tokenized with the model's special tokens (a BOS),
# a chat's rendered text without (its template writes them).
_VLLM_UNSERVED_CHAT: dict[str, tuple[object, ...]] = {
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "add_special_tokens": (False,),
}
_VLLM_UNSERVED_COMPLETIONS: dict[str, tuple[object, ...]] = {"add_special_tokens": (True,)}


def _asks_nothing(value: object, defaults: tuple[object, ...]) -> bool:
    return value is None or any(type(value) is type(d) and value == d for d in defaults)


def _refuse_unserved_sampling(doc: dict[str, Any], chat: bool) -> None:
    """Fields vLLM serves and a task cannot carry: the values that ask nothing are taken
    (clients send them), any other is refused rather than ignored (the answer would not be
    what was asked)."""
    for table in (_VLLM_UNSERVED, _VLLM_UNSERVED_CHAT if chat else _VLLM_UNSERVED_COMPLETIONS):
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


def _logit_bias(value: object) -> dict[int, object] | None:
    """OpenAI's ``logit_bias``, its keys (token ids, as JSON writes them: decimal text) read
    as integers; the biases are checked by the task's params (-100..100).  Absent, null,
    false or empty asks nothing (LangChain sends ``{}`` on every call)."""
    if value is None or value is False or (type(value) in (dict, list, str) and not value):
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


def _left_out(temperature: object, top_p: object, top_k: object) -> int:
    """Task.model_defaults for the sampling fields a request left out (or sent null)."""
    return (
        (MODEL_DEFAULT_TEMPERATURE if temperature is None else 0)
        | (MODEL_DEFAULT_TOP_P if top_p is None else 0)
        | (MODEL_DEFAULT_TOP_K if top_k is None else 0)
    )


def _max_tokens(asked: int | None, default: int) -> int:
    """What a task carries: the default when not asked; more than a task may carry is cut
    to that (as vLLM cuts it to the context: the answer ends with finish_reason "length")."""
    if asked is None:
        return default
    return min(asked, MAX_TOKENS_MAX) if asked > 0 else asked  # (0, negative: refused)


def _as_vllm_reads(name: str, value: int) -> int | None:
    """vLLM's readings a task cannot carry as they are: top_k 0 is off (-1), seed -1 none."""
    if name == "top_k" and value == 0:
        return -1
    if name == "seed" and value == -1:
        return None
    return value


def _is_int(value: object, n: int) -> bool:
    """``value`` is the JSON integer ``n`` (not true, not n.0)."""
    return type(value) is int and value == n


def header_text(value: str) -> str:
    """A header value as its client wrote it: HTTP carries bytes, which the wire reads as
    latin-1; a session id is the client's UTF-8 (so that it is the same key as the same
    text sent as ``user``, and its length is counted in code points)."""
    if value.isascii():
        return value
    return value.encode("latin-1").decode("utf-8", "replace")


def placement_key(session: str) -> str:
    """A session id as a task key: as given when it fits, else its hash (same id, same key)."""
    if len(session) <= TASK_KEY_CHARS_MAX:
        return session
    import hashlib

    return "h:" + hashlib.sha256(session.encode()).hexdigest()


def _str(doc: dict[str, Any], name: str, *, required: bool = False) -> str:
    value = doc.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name}: a non-empty string is required", param=name)
    return value


def _int(doc: dict[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name}: an integer", param=name)
    return value


def _prompt(value: Any) -> str | tuple[str, ...] | tuple[list[int], ...]:
    """One prompt, or several (a list of strings: one choice each, in order); or prompts of
    token ids (a list of integers, or a list of such lists), as OpenAI's completions take
    them."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return (_token_ids(value, ""),)
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) > PROMPTS_MAX:
            raise BadRequest(f"prompt: at most {PROMPTS_MAX} prompts", param="prompt")
        return tuple(_token_ids(v, f"[{i}]") for i, v in enumerate(value))
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if len(value) > PROMPTS_MAX:
            raise BadRequest(f"prompt: at most {PROMPTS_MAX} prompts", param="prompt")
        return tuple(value)
    raise BadRequest(
        "prompt: a string, a list of strings, a list of token ids (integers) or a list of such "
        "lists is required",
        param="prompt",
    )


def _token_ids(value: list[Any], where: str) -> list[int]:
    """A prompt of token ids: 1 to PROMPT_TOKEN_IDS_MAX integers, each 0..TOKEN_ID_MAX (the
    model's vocabulary bounds them further: its engine refuses an id it does not have)."""
    if not value or not all(type(v) is int and 0 <= v <= TOKEN_ID_MAX for v in value):
        raise BadRequest(
            f"prompt{where}: token ids are integers from 0 to {TOKEN_ID_MAX}, at least one",
            param="prompt",
        )
    if len(value) > PROMPT_TOKEN_IDS_MAX:
        raise BadRequest(f"prompt{where}: at most {PROMPT_TOKEN_IDS_MAX} token ids", param="prompt")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: a non-empty list is required", param="messages")
    if len(value) > MESSAGES_MAX:
        raise BadRequest(f"messages: at most {MESSAGES_MAX}", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}]: an object with a role", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise BadRequest(
                        f"messages[{i}].content: only text parts are served here",
                        param="messages",
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: a string", param="messages")
        rendered: dict[str, Any] = {"role": message["role"], "content": content}
        if "tool_calls" in message or "tool_call_id" in message:
            try:
                tool_turn(i, message, rendered)
            except ToolError as exc:
                raise BadRequest(str(exc), param=exc.param) from None
        name = message.get("name")
        if name is not None:  # the template's to use (vLLM passes it on too)
            if not isinstance(name, str):
                raise BadRequest(f"messages[{i}].name: a string", param="messages")
            rendered["name"] = name
        out.append(rendered)
    return out
