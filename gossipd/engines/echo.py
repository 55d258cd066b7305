"""The echo engine: deterministic output and a configurable per-token delay.

For tests and benchmarks of everything around the engine.  The output for a prompt is its
whitespace-separated words, cycled, one word per token, ``max_tokens`` tokens; the first token
has no leading space and the others have one.  With a zero delay no await happens, so the
engine costs almost nothing and benchmarks measure the daemon itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gossipd.engines.base import EngineStats, GenerateRequest


def echo_tokens(prompt: str, max_tokens: int) -> list[str]:
    words = prompt.split() or ["<empty>"]
    return [
        words[i % len(words)] if i == 0 else " " + words[i % len(words)] for i in range(max_tokens)
    ]


class EchoEngine:
    name = "echo"

    def __init__(self, *, token_delay_s: float = 0.0, model: str = "echo") -> None:
        self._token_delay_s = token_delay_s
        self.model = model  # the name it serves (engine.served_model_name, else "echo")
        self._running = 0
        self._tokens_total = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        self._running += 1
        usage = request.usage
        usage.prompt_tokens = len(request.prompt.split())  # a word a token, as it answers
        try:
            for token in echo_tokens(request.prompt, request.params.max_tokens):
                if self._token_delay_s > 0:
                    await asyncio.sleep(self._token_delay_s)
                self._tokens_total += 1
                usage.completion_tokens += 1
                yield token
            usage.finish_reason = "length"
        finally:
            self._running -= 1

    def healthy(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            running_requests=self._running,
            generated_tokens_total=self._tokens_total,
            unfinished_requests=self._running,
        )
