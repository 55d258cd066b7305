"""A stream's end by an error (docs/PROTOCOL.md "An error after the stream began is one
last event"; "Chunks are written in seq order: one that arrives early is held until the gap
fills"), from a review of the door's answers (2026-12-06): the event carried the task's raw
code with no param, where the same error before any token says context_length_exceeded and
names the prompt; and it wrote the chunks held behind a gap still open (text with a hole)."""

from __future__ import annotations

import json

from gossipd.clock import ManualClock
from gossipd.core.messages import Chunk, ErrorCode, ErrorInfo, Result
from gossipd.http.answers import HELD_CHUNKS_MAX, Answers, Waiting
from gossipd.http.openai_answers import error_of
from gossipd.http.openai_api import decode_call
from tests.test_http_choices import RecordingExchange, _events

TOO_LONG = ErrorInfo(
    code=ErrorCode.BAD_REQUEST,
    message="This model's maximum context length is 512 tokens. However, your prompt is 900 "
    "tokens long",
)


def test_a_prompt_too_long_after_the_stream_began_says_so_as_the_400_does() -> None:
    answers = Answers(node="n0", cancel=lambda _: None, stream_buffer_bytes_max=1 << 30,
                      request_timeout_s=60, clock=ManualClock())  # fmt: skip
    call = decode_call(
        json.dumps({"model": "m", "prompt": ["short", "long " * 900], "stream": True}).encode(),
        chat=False,
    )
    exchange = RecordingExchange()
    first = Waiting(exchange=exchange, call=call, response_id="cmpl-x", created=1,  # type: ignore[arg-type]
                    deadline=100.0, request_id="")  # fmt: skip
    choices = answers.wait_choices(["t0", "t1"], first)
    choices.taken = 2
    answers.deliver_message(Chunk(id="t0", seq=0, delta="short", node="m"))
    answers.deliver_message(Result(id="t1", ok=False, error=TOO_LONG, node="m"))
    events = _events(exchange)
    assert events[-1] == "[DONE]"
    streamed = events[-2]["error"]
    _, body, _ = error_of(TOO_LONG)
    whole = json.loads(body)["error"]
    assert whole["code"] == "context_length_exceeded" and whole["param"] == "prompt"
    assert (streamed["code"], streamed["param"]) == (whole["code"], whole["param"]), streamed


def _one_stream() -> tuple[Answers, RecordingExchange]:
    """Answers with one streamed request waiting, for task t1."""
    answers = Answers(node="n0", cancel=lambda _: None, stream_buffer_bytes_max=1 << 30,
                      request_timeout_s=60, clock=ManualClock())  # fmt: skip
    call = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)
    exchange = RecordingExchange()
    answers.wait("t1", Waiting(exchange=exchange, call=call, response_id="c", created=1,  # type: ignore[arg-type]
                               deadline=1e9, request_id=""))  # fmt: skip
    return answers, exchange


def _texts(exchange: RecordingExchange) -> list[str]:
    """The text of each choice's delta the stream wrote, in order."""
    return [
        choice["text"]
        for event in _events(exchange)
        if isinstance(event, dict) and "choices" in event
        for choice in event["choices"]
    ]


def test_an_error_does_not_write_a_chunk_held_behind_a_gap_still_open() -> None:
    answers, exchange = _one_stream()
    answers.deliver_message(Chunk(id="t1", seq=0, delta="<0>"))
    answers.deliver_message(Chunk(id="t1", seq=2, delta="<2>"))  # <1> still on its way
    error = ErrorInfo(code=ErrorCode.DEADLINE_EXCEEDED, message="late")
    answers.deliver_message(Result(id="t1", ok=False, error=error))
    texts = _texts(exchange)
    assert exchange.ended == 1
    assert texts == ["<0>"], f"text after a hole: {texts}"


def test_after_a_gap_given_up_an_error_still_writes_nothing_held_behind_a_new_one() -> None:
    """Past 256 held the stream goes on after a gap (the skipped chunks' text is missing);
    a chunk held later waits behind a new gap, still open at the error: not written."""
    answers, exchange = _one_stream()
    answers.deliver_message(Chunk(id="t1", seq=0, delta="<0>"))
    for seq in range(2, 2 + HELD_CHUNKS_MAX):  # <1> never comes: given up at the bound
        answers.deliver_message(Chunk(id="t1", seq=seq, delta=f"<{seq}>"))
    after = 2 + HELD_CHUNKS_MAX
    answers.deliver_message(Chunk(id="t1", seq=after + 1, delta="<late>"))  # behind <after>
    error = ErrorInfo(code=ErrorCode.DEADLINE_EXCEEDED, message="late")
    answers.deliver_message(Result(id="t1", ok=False, error=error))
    texts = _texts(exchange)
    assert texts == ["<0>", *(f"<{s}>" for s in range(2, after))], texts[-3:]
    assert exchange.ended == 1
