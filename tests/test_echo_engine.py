"""The echo engine (gossipd/engines/echo.py): its answer is the prompt's words, cycled, one a
token, and a stop string ends it where the string begins, as vLLM stops (hypothesis, against
the whole text cut at the earliest stop)."""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from hypothesis import given

from gossipd.core.messages import SamplingParams
from gossipd.engines.base import GenerateRequest
from gossipd.engines.echo import EchoEngine, echo_tokens

_WORDS = st.lists(st.sampled_from(["a", "b", "ab", "ba", "c"]), min_size=1, max_size=5)
_STOPS = st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), max_size=3)


@given(_WORDS, _STOPS, st.integers(1, 12))
def test_the_answer_is_the_prompts_words_cut_at_the_earliest_stop(
    words: list[str], stops: list[str], max_tokens: int
) -> None:
    prompt = " ".join(words)
    request = GenerateRequest(
        request_id="t", prompt=prompt, params=SamplingParams(max_tokens=max_tokens, stop=stops)
    )

    async def run() -> list[str]:
        return [delta async for delta in EchoEngine().generate(request)]

    deltas = asyncio.run(run())
    tokens = echo_tokens(prompt, max_tokens)
    whole = "".join(tokens)
    # As vLLM checks: after each token, the stop strings the text so far holds; the first
    # token that completes one ends the answer, at the earliest of those it holds.
    for i in range(1, len(tokens) + 1):
        text = "".join(tokens[:i])
        found = [at for at in (text.find(s) for s in stops) if at >= 0]
        if found:
            assert "".join(deltas) == text[: min(found)]
            assert request.usage.finish_reason == "stop"
            assert request.usage.completion_tokens == i
            break
    else:
        assert "".join(deltas) == whole and request.usage.finish_reason == "length"
        assert request.usage.completion_tokens == max_tokens
    assert all(deltas)  # (no empty delta: none is worth a chunk)
