"""OpenAI's answers from gossipd's: a Result to the JSON answer, Chunks to the server-sent
events an OpenAI client parses (one choice, or several by index), an error to OpenAI's error
shape and status.  Pure functions, no IO: gossipd/http/answers.py calls them; the requests'
side is gossipd/http/openai_api.py.  docs/PROTOCOL.md "HTTP" documents both.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gossipd.core.messages import ErrorCode, ErrorInfo, TokenUsage
from gossipd.core.sampling import TokenLogprob
from gossipd.engines.base import CONTEXT_EXCEEDED_PREFIX
from gossipd.http.logprobs import chat_logprobs, completion_logprobs
from gossipd.http.openai_api import Call
from gossipd.http.tools import read_answer

_json_encode = msgspec.json.Encoder().encode

# An error code to (HTTP status, OpenAI error type).
STATUS_OF: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_VERSION: (400, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.OVER_BUDGET: (429, "rate_limit_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.SATURATED: (503, "server_error"),
    ErrorCode.CANCELLED: (499, "cancelled"),
    ErrorCode.ID_IN_USE: (409, "invalid_request_error"),
}


# The request's fields an owner's engine may name leading its refusal (engines/vllm.py:
# vLLM's own names for them, which are OpenAI's): the 400's ``param``.
ENGINE_NAMED_FIELDS = frozenset(
    {
        "logit_bias", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "stop",
        "seed", "temperature", "top_p", "top_k", "min_p", "n", "presence_penalty",
        "frequency_penalty", "repetition_penalty",
    }
)  # fmt: skip


def error_body(
    message: str, err_type: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    return _json_encode(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def error_of(error: ErrorInfo, *, chat: bool = False) -> tuple[int, bytes, list[tuple[str, str]]]:
    """A task's error as (status, body, headers): 429s and 503s with Retry-After."""
    status, err_type = STATUS_OF.get(error.code, (500, "server_error"))
    headers: list[tuple[str, str]] = []
    if error.retry_after_ms and status in (429, 503):
        headers = [
            ("retry-after", str(max(1, math.ceil(error.retry_after_ms / 1000)))),
            ("retry-after-ms", str(error.retry_after_ms)),
        ]
    code, param = error.code, None
    if code == ErrorCode.BAD_REQUEST:
        if error.message.startswith(CONTEXT_EXCEEDED_PREFIX):
            code, param = "context_length_exceeded", "messages" if chat else "prompt"  # OpenAI's
        else:  # an engine's refusal led by the request's field ("stop_token_ids: ...")
            field, colon, _ = error.message.partition(": ")
            param = field if colon and field in ENGINE_NAMED_FIELDS else None
    return status, error_body(error.message, err_type, param=param, code=code), headers


def usage_of(usage: TokenUsage | None) -> dict[str, int]:
    prompt = usage.prompt_tokens if usage is not None else 0
    completion = usage.completion_tokens if usage is not None else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(usage: TokenUsage | None) -> str:
    return usage.finish_reason if usage is not None and usage.finish_reason else "stop"


def whole_answer(
    call: Call,
    response_id: str,
    created: int,
    text: str,
    usage: TokenUsage | None,
    logprobs: list[TokenLogprob] | None = None,
    first_none: bool = False,
) -> bytes:
    """A non-streamed answer (``first_none``: its first token is an echoed prompt's first,
    which has no log probability)."""
    choice = _choice(call, 0, text, usage, logprobs, first_none)
    return _answer(call, response_id, created, [choice], usage_of(usage))


def choices_answer(
    call: Call,
    response_id: str,
    created: int,
    texts: list[str],
    usages: list[TokenUsage | None],
    logprobs: list[list[TokenLogprob] | None],
    first_none: list[bool] | None = None,
) -> bytes:
    """A non-streamed answer of several choices (``texts[i]`` is choice i)."""
    nones = first_none or [False] * len(texts)
    choices = [
        _choice(call, i, text, usage, entries, none)
        for i, (text, usage, entries, none) in enumerate(
            zip(texts, usages, logprobs, nones, strict=True)
        )
    ]
    return _answer(call, response_id, created, choices, total_usage(usages, call.n))


def _answer(
    call: Call,
    response_id: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, int],
) -> bytes:
    return _json_encode(
        {
            "id": response_id,
            "object": "chat.completion" if call.chat else "text_completion",
            "created": created,
            "model": call.model,
            "choices": choices,
            "usage": usage,
        }
    )


def total_usage(usages: list[TokenUsage | None], n: int) -> dict[str, int]:
    """A request's usage over its choices, as vLLM counts it: each prompt's tokens once
    (choice ``i * n``'s), every choice's completion tokens."""
    prompt = sum(u.prompt_tokens for u in usages[::n] if u is not None)
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _choice(
    call: Call,
    index: int,
    text: str,
    usage: TokenUsage | None,
    logprobs: list[TokenLogprob] | None = None,
    first_none: bool = False,
) -> dict[str, Any]:
    if logprobs is not None:
        return {
            **_choice(call, index, text, usage),
            "logprobs": chat_logprobs(logprobs)
            if call.chat
            else completion_logprobs(logprobs, first_none=first_none),
        }
    if call.chat:
        if call.tools is not None and call.tools.parses:
            read = read_answer(call.tools, text, finish_reason(usage))
            message: dict[str, Any] = {"role": "assistant", "content": read.content}
            if read.calls:
                message["tool_calls"] = read.calls
            return {"index": index, "message": message, "logprobs": None,
                    "finish_reason": read.finish_reason}  # fmt: skip
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(usage),
        }
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason(usage)}


class StreamWriter:
    """The server-sent events of one streamed answer, in OpenAI's exact framing: each event
    ``data: {json}\\n\\n``, one ``id`` and ``created`` for all, a last chunk with the finish
    reason, with include_usage a usage chunk with empty ``choices``, then ``data: [DONE]``."""

    __slots__ = ("_chat", "_head", "_include_usage", "_offsets", "_roles_sent", "_tools",
                 "reads_calls")  # fmt: skip

    def __init__(self, call: Call, response_id: str, created: int) -> None:
        kind = "chat.completion.chunk" if call.chat else "text_completion"
        # Every event starts with the same fields: encoded once.
        self._head = b'data: {"id":%s,"object":"%s","created":%d,"model":%s,' % (
            _json_encode(response_id),
            kind.encode(),
            created,
            _json_encode(call.model),
        )
        self._chat = call.chat
        self._include_usage = call.include_usage
        self._roles_sent: set[int] = set()  # the choices whose first delta went (chat)
        self._offsets: dict[int, int] = {}  # completions' logprobs: each choice's text so far
        self._tools = call.tools if call.tools is not None and call.tools.parses else None
        # Each choice's text is read for tool calls at its Result (``read_choice``); before
        # it, only what cannot begin a call is streamed (answers.py: tools.content_part).
        self.reads_calls = self._tools is not None

    def read_choice(
        self, text: str, usage: TokenUsage | None, index: int = 0, streamed: int | None = 0
    ) -> bytes:
        """Choice ``index``'s end, read for tool calls: the rest of its content after the
        ``streamed`` characters already sent (None: none of it, what streamed was not its
        start), its calls (one delta, each call whole), its finish reason."""
        assert self._tools is not None
        read = read_answer(self._tools, text, finish_reason(usage))
        rest = read.content[streamed:] if read.content and streamed is not None else ""
        out = self.delta(rest, index) if rest else b""
        if read.calls:
            role = b"" if index in self._roles_sent else b'"role":"assistant",'
            self._roles_sent.add(index)
            calls = _json_encode([{"index": k, **call} for k, call in enumerate(read.calls)])
            out += self._event(
                b'[{"index":%d,"delta":{%s"tool_calls":%s},"logprobs":null,'
                b'"finish_reason":null}]' % (index, role, calls)
            )
        return out + self.finish_choice(usage, index, read.finish_reason)

    def _event(self, choices: bytes, usage: bytes = b"") -> bytes:
        tail = (
            b',"usage":%s' % usage if usage else (b',"usage":null' if self._include_usage else b"")
        )
        return b'%s"choices":%s%s}\n\n' % (self._head, choices, tail)

    def delta(
        self,
        text: str,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        first_none: bool = False,
    ) -> bytes:
        """Choice ``index``'s next text (and its tokens' log probabilities, when asked;
        ``first_none``: the first is an echoed prompt's first token, which has none)."""
        body = _json_encode(text)
        lp = b"null" if logprobs is None else self._logprobs(logprobs, index, first_none)
        if self._chat:
            if index not in self._roles_sent:
                self._roles_sent.add(index)
                return self._event(
                    b'[{"index":%d,"delta":{"role":"assistant","content":%s},'
                    b'"logprobs":%s,"finish_reason":null}]' % (index, body, lp)
                )
            return self._event(
                b'[{"index":%d,"delta":{"content":%s},"logprobs":%s,"finish_reason":null}]'
                % (index, body, lp)
            )
        return self._event(
            b'[{"index":%d,"text":%s,"logprobs":%s,"finish_reason":null}]' % (index, body, lp)
        )

    def _logprobs(self, entries: list[TokenLogprob], index: int, first_none: bool) -> bytes:
        if self._chat:
            return _json_encode(chat_logprobs(entries))
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(e.token) for e in entries)
        return _json_encode(completion_logprobs(entries, offset, first_none))

    def finish(self, usage: TokenUsage | None) -> bytes:
        """The one choice's last event, then the stream's end."""
        return self.finish_choice(usage, 0) + self.end(usage_of(usage))

    def finish_choice(
        self, usage: TokenUsage | None, index: int, reason_read: str | None = None
    ) -> bytes:
        """Choice ``index``'s last event: its finish reason (``reason_read``: as tool calls
        read it)."""
        reason = _json_encode(reason_read or finish_reason(usage))
        if self._chat:
            delta = b'{"role":"assistant","content":""}' if index not in self._roles_sent else b"{}"
            return self._event(
                b'[{"index":%d,"delta":%s,"logprobs":null,"finish_reason":%s}]'
                % (index, delta, reason)
            )
        return self._event(
            b'[{"index":%d,"text":"","logprobs":null,"finish_reason":%s}]' % (index, reason)
        )

    def end(self, usage: dict[str, int]) -> bytes:
        """After every choice's last event: the usage chunk (include_usage), ``[DONE]``."""
        if self._include_usage:
            return self._event(b"[]", _json_encode(usage)) + b"data: [DONE]\n\n"
        return b"data: [DONE]\n\n"

    def error(self, error: ErrorInfo) -> bytes:
        """An error after the stream began: a last event with an ``error`` object, the same
        object (``type``, ``param``, ``code``) as the answer before any token would carry
        (a prompt too long: ``context_length_exceeded``, naming ``prompt`` or ``messages``)."""
        _, body, _ = error_of(error, chat=self._chat)
        return b"data: " + body + b"\n\ndata: [DONE]\n\n"
