"""OpenAI's HTTP API in gossipd's terms: a request body to a task's fields (a Call: one
prompt, or several choices).  The answers' side, a Result or Chunk to what an OpenAI client
parses, is gossipd/http/openai_answers.py; the sampling fields' readers (structured
output, logit_bias, vLLM's fields a task does not carry) are gossipd/http/sampling_fields.py.

Pure functions, no IO: the door (gossipd/http/door.py) calls them.  docs/PROTOCOL.md "HTTP"
documents every rule here; a request that breaks one is a ``BadRequest`` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gossipd.core.messages import TASK_KEY_CHARS_MAX
from gossipd.core.sampling import (
    LOGPROB_ENTRIES_MAX,
    PROMPT_TOKEN_IDS_MAX,
    TOKEN_ID_MAX,
    SamplingParams,
)
from gossipd.http.badrequest import BadRequest
from gossipd.http.logprobs import decode_logprobs
from gossipd.http.sampling_fields import (
    FLOATS,
    MAX_TOKENS_MAX,
    as_vllm_reads,
    asks_nothing,
    is_int,
    left_out,
    max_tokens_taken,
    read_logit_bias,
    refuse_unserved,
    structured_form,
)
from gossipd.http.tools import ToolError, ToolUse, decode_tools, structured_for, tool_turn

_json_decode = msgspec.json.Decoder().decode

COMPLETIONS_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
# Until the door sets it from the model's context (http.chat_max_tokens_default), or when
# that is not known: OpenAI's is "up to the context".
CHAT_MAX_TOKENS_DEFAULT = 256
STOP_MAX = 8
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
    # vLLM's add_special_tokens as asked; None: not asked (the door's default: true on
    # completions, false on a chat through the model's own template).
    special_tokens: bool | None = None

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
# SamplingParams the typed pass made, by their fields (in the order it sets them): emptied
# when full, so distinct requests cost a conversion each, never memory.
_PARAMS_MADE: dict[tuple[tuple[str, Any], ...], SamplingParams] = {}
_PARAMS_MADE_MAX = 1024
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
        elif doc.max_tokens is not None and doc.max_tokens < 1:
            return None  # (the one that loses is checked too: the full rules name it)
        # (A placeholder the door replaces: not below what min_tokens asks.)
        default_max = min(max(CHAT_MAX_TOKENS_DEFAULT, doc.min_tokens or 0), MAX_TOKENS_MAX)
    else:
        if doc.prompt is None or doc.messages is not None:
            return None
        prompt = doc.prompt
        max_tokens = doc.max_tokens
        default_max = COMPLETIONS_MAX_TOKENS_DEFAULT
    fields: dict[str, Any] = {"max_tokens": max_tokens_taken(max_tokens, default_max)}
    if doc.temperature is not None:
        fields["temperature"] = doc.temperature
    if doc.top_p is not None:
        fields["top_p"] = doc.top_p
    if doc.seed is not None:
        fields["seed"] = as_vllm_reads("seed", doc.seed)
    if doc.top_k is not None:
        fields["top_k"] = as_vllm_reads("top_k", doc.top_k)
    if doc.ignore_eos is not None:
        fields["ignore_eos"] = doc.ignore_eos
    plain = True  # no penalty asked
    if not (
        doc.presence_penalty is None
        and doc.frequency_penalty is None
        and doc.repetition_penalty is None
        and doc.min_p is None
        and doc.min_tokens is None
    ):  # (rare: no loop for the usual request)
        plain = False
        for name in _PENALTIES:
            value = getattr(doc, name)
            if value is not None:
                fields[name] = value
    # The usual request's params (no seed, no penalty) repeat: taken from the ones made
    # for the same fields before (SamplingParams is frozen), not converted and checked anew.
    # Shared by the requests that ask the same: nobody may change their lists in place.
    # (Not a zero temperature: -0.0 is a key equal to 0.0's, and its params would be 0.0's.)
    key = tuple(fields.items()) if plain and doc.seed is None and doc.temperature != 0.0 else None
    params = _PARAMS_MADE.get(key) if key is not None else None
    if params is None:
        try:
            params = msgspec.convert(fields, SamplingParams)
        except (msgspec.ValidationError, ValueError):
            return None  # the full rules name the parameter
        if key is not None:
            if len(_PARAMS_MADE) >= _PARAMS_MADE_MAX:
                _PARAMS_MADE.clear()
            _PARAMS_MADE[key] = params
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
        unset_sampling=left_out(doc.temperature, doc.top_p, doc.top_k),
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
        named_max_tokens = _int(doc, "max_tokens")  # (read, so checked, also when it loses)
        if max_tokens is None:
            max_tokens = named_max_tokens
        elif named_max_tokens is not None and named_max_tokens < 1:
            raise BadRequest("max_tokens: at least 1 (max_completion_tokens wins; both are "
                             "checked)", param="max_tokens")  # fmt: skip
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
    for name in ("best_of", "suffix"):
        value = doc.get(name)
        if not (asks_nothing(value) or (name == "best_of" and is_int(value, 1))):
            raise BadRequest(f"{name}: not supported by this server", param=name)
    if not chat and doc.get("tools") not in (None, []):  # (a chat's: decode_tools took them)
        raise BadRequest("tools: served on chats only (POST /v1/chat/completions)",
                         param="tools")  # fmt: skip
    echo = doc.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest("echo: true or false", param="echo")
    if echo and chat:
        raise BadRequest("echo: completions only (POST /v1/completions)", param="echo")
    echo_only = bool(echo) and max_tokens == 0
    if echo_only:
        max_tokens = 1  # (generated and not shown: vLLM's way to score a prompt alone)
    logprobs = decode_logprobs(doc, chat)
    if chat and max_tokens is None and logprobs is not None:
        # The placeholder within what the log probabilities may take (the door cuts the
        # chat's default to it): a min_tokens above that is the field to name.
        most = LOGPROB_ENTRIES_MAX // (logprobs + 1)
        if (asked_min := _int(doc, "min_tokens") or 0) > most:
            raise BadRequest(
                f"min_tokens ({asked_min}) is more than this chat's max_tokens "
                f"({most} at most: what its log probabilities may take): send max_tokens",
                param="min_tokens",
            )
        default_max = min(default_max, most)
    if echo and token_prompts and logprobs is None:
        raise BadRequest(
            "echo: with a prompt of token ids, only with logprobs (the prompt's text is then "
            "its tokens'; this server keeps no tokenizer to write it otherwise)",
            param="echo",
        )
    if logprobs is not None and tools is not None and tools.parses:
        raise BadRequest("logprobs: not served with tools read for calls (tool_choice other "
                         'than "none")', param="logprobs")  # fmt: skip
    refuse_unserved(doc, chat)
    stop = doc.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest("stop: a string or a list of non-empty strings", param="stop")
    fields: dict[str, Any] = {"max_tokens": max_tokens_taken(max_tokens, default_max)}
    for name in FLOATS:
        value = doc.get(name)
        if value is not None:
            fields[name] = value
    for name in ("seed", "top_k"):
        value = _int(doc, name)
        if value is not None:
            fields[name] = as_vllm_reads(name, value)
    min_tokens = _int(doc, "min_tokens")
    if min_tokens is not None:
        fields["min_tokens"] = min_tokens
    if stop:
        if len(stop) > STOP_MAX:
            raise BadRequest(f"stop: at most {STOP_MAX} strings", param="stop")
        fields["stop"] = stop
    if doc.get("ignore_eos") is not None:
        fields["ignore_eos"] = doc.get("ignore_eos")
    if (bias := read_logit_bias(doc.get("logit_bias"))) is not None:
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
    if (structured := structured_form(doc)) is not None:
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
    user = doc.get("user")
    if user is None:  # (null: as absent)
        user = ""
    if not isinstance(user, str):
        raise BadRequest("user: a string", param="user")
    special_tokens = doc.get("add_special_tokens")
    if special_tokens is not None and not isinstance(special_tokens, bool):
        raise BadRequest("add_special_tokens: true or false", param="add_special_tokens")
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
        unset_sampling=left_out(doc.get("temperature"), doc.get("top_p"), doc.get("top_k")),
        prompts=prompts,
        n=n,
        echo=bool(echo),
        echo_only=echo_only,
        token_prompts=token_prompts,
        several=n > 1 or bool(prompts) or len(token_prompts) > 1,
        tools=tools,
        special_tokens=special_tokens,
    )


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
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest(f"messages[{i}].content: a text part's text is a string",
                                     param="messages")  # fmt: skip
                texts.append(text)
            content = "\n".join(texts)  # (as vLLM joins them for a template of strings)
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
