"""gossipd/http/answers.py's ordering of a stream: chunks written in seq order whatever order
they come in (an early one held until its gap fills, a copy dropped), each request answered
exactly once (hypothesis).  The exchange here records what the wire would write: the wire
itself is tested on real daemons (tests/test_http_door.py)."""

from __future__ import annotations

import json

import hypothesis.strategies as st
from hypothesis import given

from gossipd.clock import ManualClock
from gossipd.core.messages import Chunk, Result, TokenUsage, encode
from gossipd.http.answers import HELD_CHUNKS_MAX, Answers, Waiting
from gossipd.http.openai_api import decode_call


class RecordingExchange:
    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.ended = 0
        self.on_close = None
        self.done = False

    def start_stream(self, **_: object) -> None:
        pass

    def write(self, data: bytes) -> int:
        self.events.append(data)
        return 0

    def end_stream(self) -> None:
        self.ended += 1

    def respond(self, status: int, body: bytes, **_: object) -> None:
        self.ended += 1


def _texts(exchange: RecordingExchange) -> list[str]:
    out = []
    for raw in b"".join(exchange.events).split(b"\n\n"):
        if raw.startswith(b"data: {") and b'"text"' in raw:
            text = json.loads(raw[6:])["choices"]
            if text and text[0]["text"]:
                out.append(text[0]["text"])
    return out


def _streaming() -> tuple[Answers, RecordingExchange]:
    """Answers with one streamed request waiting, task "t1"."""
    answers = Answers(
        node="n0", cancel=lambda _: None, stream_buffer_bytes_max=1 << 30,
        request_timeout_s=60, clock=ManualClock(),
    )  # fmt: skip
    call = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)
    exchange = RecordingExchange()
    answers.wait("t1", Waiting(exchange=exchange, call=call, response_id="c", created=1,  # type: ignore[arg-type]
                               deadline=1e9, request_id=""))  # fmt: skip
    return answers, exchange


@given(st.permutations(list(range(12))), st.lists(st.integers(0, 11), max_size=6))
def test_chunks_are_written_in_seq_order_copies_dropped_one_answer(
    order: list[int], copies: list[int]
) -> None:
    cancelled: list[str] = []
    answers = Answers(
        node="n0",
        cancel=cancelled.append,
        stream_buffer_bytes_max=1 << 20,
        request_timeout_s=60,
        clock=ManualClock(),
    )
    call = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)
    exchange = RecordingExchange()
    answers.wait(
        "t1",
        Waiting(
            exchange=exchange,  # type: ignore[arg-type]
            call=call,
            response_id="cmpl-x",
            created=1,
            deadline=1e9,
            request_id="",
        ),
    )
    for seq in [*order, *copies]:
        answers.deliver(encode(Chunk(id="t1", seq=seq, delta=f"<{seq}>")))
    usage = TokenUsage(completion_tokens=12, finish_reason="length")
    answers.deliver(encode(Result(id="t1", ok=True, text="", usage=usage)))
    answers.deliver(encode(Result(id="t1", ok=True, text="")))  # a second Result: unknown
    assert _texts(exchange) == [f"<{i}>" for i in range(12)]
    assert exchange.ended == 1 and len(answers) == 0 and cancelled == []
    assert answers.counters.replies_unknown == 1


def test_a_gap_that_never_fills_is_passed_once_enough_chunks_wait() -> None:
    answers, exchange = _streaming()
    for seq in range(1, HELD_CHUNKS_MAX + 2):  # seq 0 never comes
        answers.deliver(encode(Chunk(id="t1", seq=seq, delta=f"<{seq}>")))
    assert _texts(exchange) == [f"<{i}>" for i in range(1, HELD_CHUNKS_MAX + 2)]


@given(st.lists(st.integers(0, 11), max_size=20))
def test_a_stream_spells_the_whole_text_whatever_chunks_were_lost_or_late(
    delivered: list[int],
) -> None:
    """Chunks dropped between members (a full queue) or still on their way by another path:
    the Result's text completes the stream, so the client reads exactly the answer."""
    answers, exchange = _streaming()
    deltas = [f"<{i}>" for i in range(12)]
    for seq in delivered:  # some, in any order, some twice, some never
        answers.deliver(encode(Chunk(id="t1", seq=seq, delta=deltas[seq])))
    answers.deliver(encode(Result(id="t1", ok=True, text="".join(deltas), chunks=12)))
    assert "".join(_texts(exchange)) == "".join(deltas)
    assert exchange.ended == 1
