"""Log probabilities at the HTTP door: what a request asks (completions' ``logprobs`` N, a
chat's ``logprobs`` and ``top_logprobs``: the task's ``params.logprobs``) and the answer's
``logprobs`` in OpenAI's two shapes, from the TokenLogprobs the engine gave.  Pure functions,
no IO: gossipd/http/openai_api.py decodes with them, openai_answers.py answers with them.
docs/PROTOCOL.md "HTTP" documents both.
"""

from __future__ import annotations

from typing import Any

from gossipd.core.sampling import LOGPROBS_TOP_MAX, TokenLogprob
from gossipd.http.badrequest import BadRequest


def decode_logprobs(doc: dict[str, Any], chat: bool) -> int | None:
    """The task's params.logprobs: completions' ``logprobs`` (an integer: the most likely
    tokens a token, with the chosen one's), a chat's ``logprobs`` (true) and
    ``top_logprobs``; None: not asked (absent, null, false; a chat's top_logprobs 0)."""
    asked = doc.get("logprobs")
    top = doc.get("top_logprobs")
    if chat:
        if asked is not None and not isinstance(asked, bool):
            raise BadRequest("logprobs: true or false", param="logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
            raise BadRequest("top_logprobs: an integer", param="top_logprobs")
        if top is not None and not 0 <= top <= LOGPROBS_TOP_MAX:  # (before any arithmetic)
            raise BadRequest(f"top_logprobs: 0 to {LOGPROBS_TOP_MAX}", param="top_logprobs")
        if not asked:
            if top:  # (0 asks nothing: clients send it)
                raise BadRequest("top_logprobs: needs logprobs true", param="top_logprobs")
            return None
        return top or 0
    if top is not None and not (type(top) is int and top == 0):  # (false and 0.0 are not 0)
        raise BadRequest("top_logprobs: chats only; completions ask logprobs N",
                         param="top_logprobs")  # fmt: skip
    if asked is None or asked is False:
        return None
    if not isinstance(asked, int) or isinstance(asked, bool):
        raise BadRequest("logprobs: an integer (the most likely tokens a token)",
                         param="logprobs")  # fmt: skip
    if not 0 <= asked <= LOGPROBS_TOP_MAX:
        raise BadRequest(f"logprobs: 0 to {LOGPROBS_TOP_MAX}", param="logprobs")
    return asked


def completion_logprobs(
    entries: list[TokenLogprob], offset: int = 0, first_none: bool = False
) -> dict[str, Any]:
    """A completion's ``logprobs`` (OpenAI's legacy shape, as vLLM writes it): each token,
    its log probability, the chosen and most likely tokens with theirs, and where each
    token's text begins in the choice's text (from ``offset``).  ``first_none``: the first
    entry is an echoed prompt's first token, which has no log probability (null, as vLLM)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    token_logprobs: list[float | None] = [e.logprob for e in entries]
    top_logprobs: list[dict[str, float] | None] = [
        {e.token: e.logprob, **dict(e.top)} for e in entries
    ]
    if first_none and entries:
        token_logprobs[0] = top_logprobs[0] = None
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat's ``logprobs``: ``content``, each token with its log probability, its UTF-8
    bytes and ``top_logprobs`` (the most likely tokens with theirs)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}
                    for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }
