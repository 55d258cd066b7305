"""gossipd/http/answers.py's ordering of a stream: chunks written in seq order whatever order
they come in (an early one held until its gap fills, a copy dropped), each request answered
exactly once (hypothesis).  The exchange here records what the wire would write: the wire
itself is tested on real daemons (tests/test_http_door.py)."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
from hypothesis import given

from gossipd.clock import ManualClock
from gossipd.core.messages import Chunk, Result, TokenUsage, encode
from gossipd.http.answers import HELD_CHUNKS_MAX, Answers, Waiting
from gossipd.http.openai_api import Call, decode_call


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


def streaming(call: Call | None = None, task_id: str = "t1") -> tuple[Answers, RecordingExchange]:
    """Answers with one streamed request waiting (``call``, else a plain completion), task
    ``task_id``."""
    answers = Answers(
        node="n0", cancel=lambda _: None, stream_buffer_bytes_max=1 << 30,
        request_timeout_s=60, clock=ManualClock(),
    )  # fmt: skip
    if call is None:
        call = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)
    exchange = RecordingExchange()
    answers.wait(task_id, Waiting(exchange=exchange, call=call, response_id="c", created=1,  # type: ignore[arg-type]
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
    """At most HELD_CHUNKS_MAX chunks wait for a gap (PROTOCOL.md: "at most 256 held"); the
    one that would be the next goes on after the gap, and the Result adds nothing for the
    gap (its place in the text is unknown): the stream ends as usual."""
    answers, exchange = streaming()
    for seq in range(1, HELD_CHUNKS_MAX):  # seq 0 never comes
        answers.deliver(encode(Chunk(id="t1", seq=seq, delta=f"<{seq}>")))
    assert _texts(exchange) == []  # 255 held
    answers.deliver(encode(Chunk(id="t1", seq=HELD_CHUNKS_MAX, delta=f"<{HELD_CHUNKS_MAX}>")))
    assert _texts(exchange) == [f"<{i}>" for i in range(1, HELD_CHUNKS_MAX + 1)]
    whole = "<0>" + "".join(f"<{i}>" for i in range(1, HELD_CHUNKS_MAX + 1))
    answers.deliver(encode(Result(id="t1", ok=True, text=whole)))
    assert _texts(exchange) == [f"<{i}>" for i in range(1, HELD_CHUNKS_MAX + 1)]
    assert exchange.ended == 1 and len(answers) == 0


@given(st.lists(st.integers(0, 11), max_size=20))
def test_a_stream_spells_the_whole_text_whatever_chunks_were_lost_or_late(
    delivered: list[int],
) -> None:
    """Chunks dropped between members (a full queue) or still on their way by another path:
    the Result's text completes the stream, so the client reads exactly the answer."""
    answers, exchange = streaming()
    deltas = [f"<{i}>" for i in range(12)]
    for seq in delivered:  # some, in any order, some twice, some never
        answers.deliver(encode(Chunk(id="t1", seq=seq, delta=deltas[seq])))
    answers.deliver(encode(Result(id="t1", ok=True, text="".join(deltas), chunks=12)))
    assert "".join(_texts(exchange)) == "".join(deltas)
    assert exchange.ended == 1


def test_an_answer_that_fails_to_be_written_is_a_500_with_the_request_id_and_counted(
    monkeypatch: Any,
) -> None:
    """A bug while a whole answer is made (docs/PROTOCOL.md: 500 "internal error", every
    answer counted by status, x-request-id echoed) answers 500 rather than cutting the
    connection; a Chunk that fails cancels its task (nobody waits for it now)."""
    import gossipd.http.answers as answers_module

    class Recording(RecordingExchange):
        streaming = False

        def __init__(self) -> None:
            super().__init__()
            self.answered: list[tuple[int, bytes, Any]] = []
            self.aborted = 0

        def respond(self, status: int, body: bytes, **kw: Any) -> None:
            self.done = True
            self.answered.append((status, body, kw.get("headers")))

        def abort(self) -> None:
            self.aborted += 1

    def broken(*_: object) -> bytes:
        raise RuntimeError("a bug")

    monkeypatch.setattr(answers_module, "whole_answer", broken)
    cancelled: list[str] = []
    answers = Answers(
        node="n0", cancel=cancelled.append, stream_buffer_bytes_max=1 << 20,
        request_timeout_s=60, clock=ManualClock(),
    )  # fmt: skip
    whole = decode_call(b'{"model": "m", "prompt": "p"}', chat=False)
    exchange = Recording()
    answers.wait("t1", Waiting(exchange=exchange, call=whole, response_id="c", created=1,  # type: ignore[arg-type]
                               deadline=1e9, request_id="r-9"))  # fmt: skip
    answers.deliver(encode(Result(id="t1", ok=True, text="x", node="n1")))
    [(status, body, headers)] = exchange.answered
    assert status == 500 and json.loads(body)["error"]["message"] == "internal error"
    assert ("x-request-id", "r-9") in headers and ("x-gossipd-member", "n1") in headers
    assert answers.counters.responses == {500: 1} and answers.counters.answer_failures == 1
    assert exchange.aborted == 0 and len(answers) == 0 and cancelled == []
    # A stream whose chunk fails: cut (its head went out), and its task cancelled.
    streamed = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)
    cut = Recording()
    answers.wait("t2", Waiting(exchange=cut, call=streamed, response_id="c", created=1,  # type: ignore[arg-type]
                               deadline=1e9, request_id=""))  # fmt: skip
    monkeypatch.setattr(answers_module.StreamWriter, "delta", broken)
    cut.streaming = True  # (start_stream is a no-op in the recording)
    answers.deliver(encode(Chunk(id="t2", seq=0, delta="a")))
    assert cut.aborted == 1 and cut.answered == [] and cancelled == ["t2"]


def test_a_request_whose_intake_raised_leaves_nothing_waiting() -> None:
    """A bug in the intake (it raised inside take) is answered 500 by the wire; the door
    keeps no Waiting for it, so no sweep later answers it or cancels a task never taken."""
    import pytest

    from gossipd.config import HttpConfig
    from gossipd.http.chat import ChatTemplate
    from gossipd.http.door import DoorLinks, HttpDoor
    from gossipd.http.exchange import Request

    cancelled: list[str] = []

    class BrokenIntake:
        def take(self, task: object, now: float, identity: str) -> None:
            raise RuntimeError("a bug in the intake")

        def handle_cancel(self, task_id: str, producer_key: str) -> None:
            cancelled.append(task_id)

    door = HttpDoor(
        HttpConfig(), intake=BrokenIntake(), node="n0", model="echo",  # type: ignore[arg-type]
        chat=ChatTemplate("{{ messages }}"), prompt_bytes_max=1 << 20, clock=ManualClock(),
        links=DoorLinks(cluster_models=lambda: {"echo": None}, not_ready=lambda: ""),
    )  # fmt: skip
    door.answers.reply_to = "tcp://127.0.0.1:9"  # (as bind sets it; nothing is sent)
    exchange = RecordingExchange()
    request = Request(
        method="POST", path="/v1/completions", headers={}, keep_alive=True,
        body=b'{"model": "echo", "prompt": "p"}',
    )  # fmt: skip
    with pytest.raises(RuntimeError):
        door.handle(request, exchange)  # type: ignore[arg-type]
    assert len(door.answers) == 0 and exchange.on_close is None
    assert door.answers.sweep(1e12) == 0 and cancelled == []


def test_what_a_request_leaves_out_is_left_to_its_models_own_defaults() -> None:
    """As `vllm serve` reads a request: the fields it leaves out take the model's own
    defaults, wherever the task runs (Task.model_defaults, applied by the owner's engine);
    what it names stands.  A chat without max_tokens is also bounded by the model's."""
    from gossipd.config import HttpConfig
    from gossipd.core.sampling import MODEL_DEFAULT_MAX_TOKENS as MAX
    from gossipd.core.sampling import MODEL_DEFAULT_TEMPERATURE as TEMP
    from gossipd.core.sampling import MODEL_DEFAULT_TOP_K as TOP_K
    from gossipd.core.sampling import MODEL_DEFAULT_TOP_P as TOP_P
    from gossipd.http.chat import PLAIN_TEMPLATE, ChatTemplate
    from gossipd.http.door import DoorLinks, HttpDoor
    from gossipd.http.exchange import Request

    taken: list[Any] = []

    class RecordingIntake:
        def take(self, task: Any, now: float, identity: str) -> None:
            taken.append(task)

        def handle_cancel(self, task_id: str, producer_key: str) -> None:
            pass

    door = HttpDoor(
        HttpConfig(), intake=RecordingIntake(), node="n0", model="echo",  # type: ignore[arg-type]
        chat=ChatTemplate("{{ messages }}"), prompt_bytes_max=1 << 20, clock=ManualClock(),
        links=DoorLinks(cluster_models=lambda: {"echo": None, "other": 512},
                        not_ready=lambda: ""),
    )  # fmt: skip
    door.answers.reply_to = "tcp://127.0.0.1:9"  # (as bind sets it; nothing is sent)
    chat = '{"model": "other", "messages": [{"role": "user", "content": "x"}], '
    for path, body, bits in (
        ("/v1/completions", '{"model": "other", "prompt": "p"}', TEMP | TOP_P | TOP_K),
        ("/v1/completions", '{"model": "other", "prompt": "p", "temperature": 0}', TOP_P | TOP_K),
        ("/v1/completions", '{"model": "echo", "prompt": "p", "top_k": null, "top_p": 1}',
         TEMP | TOP_K),
        # (the full rules' pass: an extra field)
        ("/v1/completions", '{"model": "echo", "prompt": "p", "min_p": 0, "top_k": 0}',
         TEMP | TOP_P),
        ("/v1/chat/completions", chat + '"temperature": 1, "top_p": 1, "top_k": 5}', MAX),
        ("/v1/chat/completions", chat + '"max_tokens": 9}', TEMP | TOP_P | TOP_K),
    ):  # fmt: skip
        request = Request(method="POST", path=path, headers={}, keep_alive=True,
                          body=body.encode())  # fmt: skip
        exchange = RecordingExchange()
        door.handle(request, exchange)  # type: ignore[arg-type]
        assert exchange.ended == 0, body  # taken, not refused
        assert taken[-1].model_defaults == bits, body
    assert taken[-2].params.max_tokens == 512  # (the door's default, within the context)
    # A chat's template wrote the special tokens it wants: its engine is to add none.
    assert [t.params.add_special_tokens for t in taken] == [True] * 4 + [False] * 2
    # What a request asks stands (vLLM's add_special_tokens), on either path.
    for path, body, wanted in (
        ("/v1/completions", '{"model": "other", "prompt": "p", "add_special_tokens": false}',
         False),
        ("/v1/chat/completions", chat + '"add_special_tokens": true}', True),
        ("/v1/chat/completions", chat + '"add_special_tokens": null}', False),
    ):  # fmt: skip
        request = Request(method="POST", path=path, headers={}, keep_alive=True,
                          body=body.encode())  # fmt: skip
        door.handle(request, RecordingExchange())  # type: ignore[arg-type]
        assert taken[-1].params.add_special_tokens is wanted, body
    # Not where the plain template stands in for a model's own (it writes none).
    door._chat = ChatTemplate(PLAIN_TEMPLATE, own=False)
    request = Request(method="POST", path="/v1/chat/completions", headers={}, keep_alive=True,
                      body=(chat + '"max_tokens": 9}').encode())  # fmt: skip
    door.handle(request, RecordingExchange())  # type: ignore[arg-type]
    assert taken[-1].params.add_special_tokens and len(taken) == 10


def test_the_reply_socket_drops_a_frame_over_its_bound_and_keeps_reading() -> None:
    """A reply over REPLY_FRAME_BYTES_MAX closes its sender's connection unread (ZMQ
    MAXMSGSIZE): one message cannot take the door's memory.  What comes after, from that
    sender reconnected or another, is read (here: garbage, counted as invalid)."""
    import asyncio

    import zmq

    from gossipd.core.codec import REPLY_FRAME_BYTES_MAX

    async def main() -> int:
        ctx = zmq.Context()
        answers = Answers(
            node="n0", cancel=lambda _: None, stream_buffer_bytes_max=1 << 20,
            request_timeout_s=60, clock=ManualClock(),
        )  # fmt: skip
        endpoint = answers.bind(ctx, "tcp://127.0.0.1:*", None)
        answers.start_receiving()
        big, other = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        try:
            for sock in (big, other):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
            big.send(b"\x00" * (REPLY_FRAME_BYTES_MAX + 1))
            other.send(b"not a reply")

            async def invalid(n: int) -> None:
                while answers.counters.replies_invalid < n:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(invalid(1), 10)
            big.send(b"not a reply either")  # after the drop, on its new connection
            await asyncio.wait_for(invalid(2), 10)
            return answers.counters.replies_invalid
        finally:
            answers.close()
            ctx.destroy(linger=0)

    assert asyncio.run(main()) == 2


def test_a_stream_past_its_share_of_all_streams_unsent_bytes_is_cancelled() -> None:
    """Answers waiting for slow clients were bounded per stream only (4 MiB x 4096
    connections: 16 GiB).  Each open stream may now hold its share of
    http.streams_unsent_bytes_max when that is under its own bound."""
    streamed = decode_call(b'{"model": "m", "prompt": "p", "stream": true}', chat=False)

    class Unsent(RecordingExchange):
        def __init__(self, unsent: int) -> None:
            super().__init__()
            self.unsent = unsent
            self.aborted = 0

        def write(self, data: bytes) -> int:
            super().write(data)
            return self.unsent

        def abort(self) -> None:
            self.aborted += 1

    def run(unsent: int, streams_open: int) -> tuple[int, list[str]]:
        cancelled: list[str] = []
        answers = Answers(
            node="n0", cancel=cancelled.append, stream_buffer_bytes_max=4 << 20,
            request_timeout_s=60, clock=ManualClock(),
            streams_unsent_bytes_max=1 << 20, streams_open=lambda: streams_open,
        )  # fmt: skip
        exchange = Unsent(unsent)
        answers.wait("t", Waiting(exchange=exchange, call=streamed, response_id="c",  # type: ignore[arg-type]
                                  created=1, deadline=1e9, request_id=""))  # fmt: skip
        answers.deliver(encode(Chunk(id="t", seq=0, delta="a")))
        return answers.counters.slow_client_cancels, cancelled

    assert run(300 << 10, streams_open=4) == (1, ["t"])  # over 1 MiB / 4 = 256 KiB
    assert run(200 << 10, streams_open=4) == (0, [])
    assert run(900 << 10, streams_open=1) == (0, [])  # alone: the whole 1 MiB
    assert run(5 << 20, streams_open=1) == (1, ["t"])  # its own bound still holds


def test_a_failure_answering_one_late_request_leaves_the_sweep_and_the_others() -> None:
    """The sweep runs in the daemon's task group: an exception out of one request's 504
    (a bug in the cancel it makes) ended the group, and the daemon exited 1."""
    clock = ManualClock()
    cancelled: list[str] = []

    def cancel(task_id: str) -> None:
        if task_id == "bad":
            raise RuntimeError("a bug")
        cancelled.append(task_id)

    answers = Answers(
        node="n0", cancel=cancel, stream_buffer_bytes_max=1 << 20, request_timeout_s=1,
        clock=clock,
    )  # fmt: skip
    call = decode_call(b'{"model": "m", "prompt": "p"}', chat=False)
    exchanges = {}
    for task_id in ("bad", "good"):
        exchanges[task_id] = exchange = RecordingExchange()
        exchange.abort = lambda e=exchange: setattr(e, "done", True)  # type: ignore[attr-defined]
        answers.wait(task_id, Waiting(exchange=exchange, call=call, response_id="c", created=1,  # type: ignore[arg-type]
                                      deadline=5.0, request_id=""))  # fmt: skip
    assert answers.sweep(10.0) == 1
    assert cancelled == ["good"] and exchanges["good"].ended == 1
    assert answers.counters.answer_failures == 1 and len(answers) == 0
