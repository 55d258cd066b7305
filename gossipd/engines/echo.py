"""The echo engine: deterministic output and a configurable per-token delay.

For tests and benchmarks of everything around the engine.  The output for a prompt is its
whitespace-separated words, cycled, one word per token, ``max_tokens`` tokens; the first token
has no leading space and the others have one.  A stop string ends it where it begins (left
out of the text, finish reason "stop"), as vLLM stops.  A prompt of token ids answers with
the ids as its words, and then ``stop_token_ids`` end it at the first such id (counted,
not shown, finish reason "stop"), as vLLM ends at a stop token.  With a zero delay no await happens, so the
engine costs almost nothing and benchmarks measure the daemon itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gossipd.core.sampling import LOGPROB_TOKEN_CHARS_MAX, TokenLogprob
from gossipd.engines.base import EngineStats, GenerateRequest, check_prompt_logprobs


def echo_tokens(prompt: str, max_tokens: int) -> list[str]:
    return _tokens(prompt.split(), max_tokens)


def _tokens(words: list[str], max_tokens: int) -> list[str]:
    """echo_tokens of a prompt split into ``words`` already."""
    words = words or ["<empty>"]
    return [
        words[i % len(words)] if i == 0 else " " + words[i % len(words)] for i in range(max_tokens)
    ]


def _first_stop(text: str, stops: tuple[str, ...] | list[str], new_from: int) -> int | None:
    """Where the stop string that ends earliest in ``text`` past ``new_from`` begins (the
    text before it was looked at already; ties: the first in ``stops``), as vLLM's
    check_stop_strings picks it."""
    found, best_end = None, len(text) + 1
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at >= 0 and at + len(stop) < best_end:
            found, best_end = at, at + len(stop)
    return found


class EchoEngine:
    name = "echo"

    def __init__(self, *, token_delay_s: float = 0.0, model: str = "echo") -> None:
        self._token_delay_s = token_delay_s
        self.model = model  # the name it serves (engine.served_model_name, else "echo")
        self._running = 0
        self._tokens_total = 0
        self._abandoned = False

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        self._running += 1
        usage = request.usage
        prompt = request.prompt
        if request.prompt_token_ids is not None:  # (its words: the ids, as decimal text)
            prompt = " ".join(map(str, request.prompt_token_ids))
        words = prompt.split()
        usage.prompt_tokens = len(words)  # a word a token, as it answers
        stop_ids = request.params.stop_token_ids  # (its words are ids only in an id prompt)
        stop_words = (
            frozenset(map(str, stop_ids))
            if stop_ids is not None and request.prompt_token_ids is not None
            else None
        )
        stop = request.params.stop
        # With stop strings, as vLLM stops: at the first, which the text leaves out; the
        # text's last characters that may begin one wait until they cannot.
        hold = max(map(len, stop)) - 1 if stop else 0
        text, sent = "", 0
        logprobs = request.logprobs  # (the engine is certain: each token's is 0, alone on top)
        top = request.params.logprobs or 0
        if request.prompt_logprobs is not None:  # the prompt's words, as tokens it is sure of
            check_prompt_logprobs(usage.prompt_tokens, request.params.prompt_logprobs or 0)
            ranked = bool(request.params.prompt_logprobs)
            for i, token in enumerate(echo_tokens(prompt, usage.prompt_tokens)):
                text_of = token[:LOGPROB_TOKEN_CHARS_MAX]
                tops = ((text_of, 0.0),) if ranked and i else ()
                request.prompt_logprobs.append(TokenLogprob(text_of, 0.0, tops))
        try:
            for token in _tokens(words, request.params.max_tokens):
                if self._token_delay_s > 0:
                    await asyncio.sleep(self._token_delay_s)
                self._tokens_total += 1
                usage.completion_tokens += 1
                if logprobs is not None:  # (a token's text in it at most so long: the wire's)
                    text_of = token[:LOGPROB_TOKEN_CHARS_MAX]
                    logprobs.append(TokenLogprob(text_of, 0.0, ((text_of, 0.0),) if top else ()))
                if stop_words is not None and token.lstrip() in stop_words:
                    if len(text) > sent:  # (what stop strings held back: none begins there)
                        yield text[sent:]
                    usage.finish_reason = "stop"
                    return
                if not stop:
                    yield token
                    continue
                looked = len(text)
                text += token
                cut = _first_stop(text, stop, looked)
                if cut is not None:
                    if cut > sent:
                        yield text[sent:cut]
                    usage.finish_reason = "stop"
                    return
                if len(text) - hold > sent:
                    yield text[sent : len(text) - hold]
                    sent = len(text) - hold
            if len(text) > sent:
                yield text[sent:]
            usage.finish_reason = "length"
        finally:
            self._running -= 1

    def healthy(self) -> bool:
        return not self._abandoned

    def stats(self) -> EngineStats:
        return EngineStats(
            running_requests=self._running,
            generated_tokens_total=self._tokens_total,
            unfinished_requests=self._running,
            steps_total=self._tokens_total,
        )

    def abandon(self, reason: str) -> None:
        self._abandoned = True  # (in the daemon's process: it never hangs without it)
