"""The echo engine (gossipd/engines/echo.py): its answer is the prompt's words, cycled, one a
token, and a stop string ends it where the string begins, as vLLM stops (hypothesis, against
the whole text cut at the earliest stop)."""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from hypothesis import given

from gossipd.core.sampling import SamplingParams
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
    # As vLLM checks (check_stop_strings): after each token, the stop strings the text so
    # far holds; the first token that completes one ends the answer, cut where the one that
    # ends earliest begins (ties: the first in the list).
    for i in range(1, len(tokens) + 1):
        text = "".join(tokens[:i])
        found = [(at + len(s), n, at) for n, s in enumerate(stops) if (at := text.find(s)) >= 0]
        if found:
            assert "".join(deltas) == text[: min(found)[2]]
            assert request.usage.finish_reason == "stop"
            assert request.usage.completion_tokens == i
            break
    else:
        assert "".join(deltas) == whole and request.usage.finish_reason == "length"
        assert request.usage.completion_tokens == max_tokens
    assert all(deltas)  # (no empty delta: none is worth a chunk)


def test_of_stop_strings_completed_at_once_the_one_that_ends_first_wins() -> None:
    """As vLLM's check_stop_strings: "bc" ends before "a bcd" does, though it begins later."""
    request = GenerateRequest(
        request_id="t", prompt="a bcd", params=SamplingParams(max_tokens=4, stop=["a bcd", "bc"])
    )

    async def run() -> str:
        return "".join([delta async for delta in EchoEngine().generate(request)])

    assert asyncio.run(run()) == "a "


def test_a_tokens_text_in_its_log_probability_is_cut_to_what_the_wire_takes() -> None:
    """A word longer than LOGPROB_TOKEN_CHARS_MAX (a token to the echo engine): its entry's
    text is cut, so the Result carrying it decodes wherever it goes."""
    from gossipd.core.codec import decode_reply
    from gossipd.core.messages import Result, encode
    from gossipd.core.sampling import LOGPROB_TOKEN_CHARS_MAX

    request = GenerateRequest(
        request_id="t", prompt="w" * 1100, params=SamplingParams(max_tokens=1, logprobs=1),
        logprobs=[],
    )  # fmt: skip

    async def run() -> str:
        return "".join([delta async for delta in EchoEngine().generate(request)])

    text = asyncio.run(run())
    assert text == "w" * 1100 and request.logprobs is not None
    (entry,) = request.logprobs
    assert entry.token == "w" * LOGPROB_TOKEN_CHARS_MAX == entry.top[0][0]
    result = Result(id="t", ok=True, text=text, logprobs=request.logprobs)
    assert decode_reply(encode(result)) == result
