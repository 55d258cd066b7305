"""A request of several choices (completions' prompts x n): one task a choice, answered as
one (gossipd/http/answers.py's Choices; docs/PROTOCOL.md "HTTP").  Each choice's deltas carry
its index whatever order the members' replies interleave in, the answer or ``[DONE]`` goes
once every choice has its Result, the first error answers the request and cancels the
choices still out (hypothesis): the exchange records what the wire would write.  Then two
real daemons with the echo engine, through the official openai client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import openai
import pytest
from hypothesis import given

from gossipd.clock import ManualClock
from gossipd.core.messages import Chunk, ErrorCode, ErrorInfo, Result, TokenUsage
from gossipd.core.ring import Ring
from gossipd.http.answers import Answers, Choices, Waiting
from gossipd.http.openai_api import BadRequest, decode_call
from simulations.cluster import Cluster
from tests.helpers import running, scrape, wait_until
from tests.test_http_door import BUDGET_40_TOKENS_PER_S, _post

HTTP = 'http.bind="127.0.0.1:0"'
METRICS = 'metrics.bind="127.0.0.1:0"'


class RecordingExchange:
    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.answers: list[tuple[int, bytes, list[tuple[str, str]]]] = []
        self.ended = 0
        self.on_close: Any = None
        self.done = False
        self.streaming = False

    def start_stream(self, **_: object) -> None:
        self.streaming = True

    def write(self, data: bytes) -> int:
        self.events.append(data)
        return 0

    def end_stream(self) -> None:
        self.ended += 1

    def respond(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.answers.append((status, body, headers))
        self.ended += 1

    def abort(self) -> None:
        self.ended += 1


def _request(body: dict[str, Any]) -> tuple[Answers, RecordingExchange, Choices, list[str]]:
    """Answers with one request of several choices waiting, every task taken."""
    cancelled: list[str] = []
    answers = Answers(
        node="n0", cancel=cancelled.append, stream_buffer_bytes_max=1 << 30,
        request_timeout_s=60, clock=ManualClock(),
    )  # fmt: skip
    call = decode_call(json.dumps({"model": "m", **body}).encode(), chat="messages" in body)
    exchange = RecordingExchange()
    first = Waiting(exchange=exchange, call=call, response_id="cmpl-x", created=1,  # type: ignore[arg-type]
                    deadline=100.0, request_id="")  # fmt: skip
    choices = answers.wait_choices([f"t{i}" for i in range(call.choices)], first)
    choices.taken = call.choices
    return answers, exchange, choices, cancelled


def _events(exchange: RecordingExchange) -> list[Any]:
    out: list[Any] = []
    for raw in b"".join(exchange.events).split(b"\n\n"):
        if raw == b"data: [DONE]":
            out.append("[DONE]")
        elif raw.startswith(b"data: "):
            out.append(json.loads(raw[6:]))
    return out


_SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 3), st.booleans())


@given(_SHAPES, st.randoms(use_true_random=False))
def test_streamed_choices_carry_their_index_in_any_interleaving_and_end_once(
    shape: tuple[int, int, bool], rnd: Any
) -> None:
    prompts, n, chat = shape
    body: dict[str, Any] = {"n": n, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        assert prompts  # (chat has one prompt: its messages)
        prompts = 1
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [f"p{i}" for i in range(prompts)] if prompts > 1 else "p0"
    answers, exchange, choices, cancelled = _request(body)
    count = prompts * n
    texts = [f"<{i}:" + "x" * rnd.randint(0, 3) + ">" for i in range(count)]
    # Each choice's replies in its own order (a chunk a character, some twice), then its
    # Result; the choices interleaved at random.
    queues = []
    for i, text in enumerate(texts):
        chunks = [Chunk(id=f"t{i}", seq=s, delta=c, node=f"m{i % 2}") for s, c in enumerate(text)]
        chunks += rnd.sample(chunks, k=min(2, len(chunks)))
        usage = TokenUsage(prompt_tokens=10 + i // n, completion_tokens=len(text),
                           finish_reason="length")  # fmt: skip
        queues.append([*chunks, Result(id=f"t{i}", ok=True, text=text, usage=usage, node="m")])
    while any(queues):
        queue = rnd.choice([q for q in queues if q])
        answers.deliver_message(queue.pop(0))
    events = _events(exchange)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and exchange.ended == 1
    spelled = [""] * count
    finishes = [0] * count
    for event in events[:-2]:
        (choice,) = event["choices"]
        piece = choice["delta"].get("content", "") if chat else choice["text"]
        assert finishes[choice["index"]] == 0, "nothing of a choice after its finish"
        spelled[choice["index"]] += piece
        finishes[choice["index"]] += choice["finish_reason"] is not None
    assert spelled == texts and finishes == [1] * count
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": sum(10 + i for i in range(prompts)),  # each prompt once
        "completion_tokens": sum(len(t) for t in texts),
        "total_tokens": sum(10 + i for i in range(prompts)) + sum(len(t) for t in texts),
    }
    assert len(answers) == 0 and cancelled == [] and choices.ended


@given(st.permutations(list(range(6))))
def test_a_whole_answer_lists_its_choices_in_order_and_the_members_that_ran_them(
    order: list[int],
) -> None:
    answers, exchange, _, cancelled = _request({"prompt": ["a", "b", "c"], "n": 2})
    for i in order:
        usage = TokenUsage(prompt_tokens=5, completion_tokens=i + 1, finish_reason="stop")
        answers.deliver_message(
            Result(id=f"t{i}", ok=True, text=f"text {i}", usage=usage, node=f"m{i // 4}")
        )
    ((status, body, headers),) = exchange.answers
    doc = json.loads(body)
    assert status == 200 and [c["index"] for c in doc["choices"]] == list(range(6))
    assert [c["text"] for c in doc["choices"]] == [f"text {i}" for i in range(6)]
    # vLLM's count: prompt tokens once a prompt (3 x 5), every choice's completion tokens.
    assert doc["usage"] == {"prompt_tokens": 15, "completion_tokens": 21, "total_tokens": 36}
    assert ("x-gossipd-member", "m0,m1") in headers
    assert len(answers) == 0 and cancelled == []


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_error_answers_the_request_and_cancels_the_choices_still_out(
    stream: bool,
) -> None:
    answers, exchange, _, cancelled = _request({"prompt": "p", "n": 4, "stream": stream})
    answers.deliver_message(Chunk(id="t1", seq=0, delta="so far"))
    answers.deliver_message(Result(id="t0", ok=True, text="done", node="m"))
    error = ErrorInfo(code=ErrorCode.OVER_BUDGET, message="over", retry_after_ms=1500)
    answers.deliver_message(Result(id="t2", ok=False, error=error, node="m"))
    assert sorted(cancelled) == ["t1", "t3"]  # not the one that ended, nor the failed one
    answers.deliver_message(Result(id="t3", ok=True, text="late", node="m"))
    assert answers.counters.replies_unknown == 1 and len(answers) == 0
    assert exchange.ended == 1
    if stream:  # the stream had begun: its last event is the error
        events = _events(exchange)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "over_budget"
    else:
        ((status, body, headers),) = exchange.answers
        assert status == 429 and ("retry-after", "2") in headers
        assert json.loads(body)["error"]["code"] == "over_budget"


def test_a_client_gone_cancels_every_choice_taken_once() -> None:
    answers, exchange, choices, cancelled = _request({"prompt": ["a", "b"], "n": 2})
    assert len(answers) == 4 and answers.requests() == 1  # (gossipd_http_pending: requests)
    choices.taken = 3  # the fourth never went out
    answers.deliver_message(Result(id="t0", ok=True, text="done", node="m"))
    exchange.on_close()
    assert cancelled == ["t1", "t2"] and answers.counters.disconnect_cancels == 1
    exchange.on_close()  # (a second close: nothing more)
    assert cancelled == ["t1", "t2"] and len(answers) == 0


def test_past_the_deadline_the_request_gets_one_504_and_every_choice_is_cancelled() -> None:
    answers, exchange, _, cancelled = _request({"prompt": ["a", "b", "c"]})
    assert answers.sweep(99.0) == 0
    assert answers.sweep(101.0) == 1
    ((status, _, _),) = exchange.answers
    assert status == 504 and sorted(cancelled) == ["t0", "t1", "t2"]
    assert answers.counters.deadline_answers == 1 and len(answers) == 0


def test_an_intake_that_raises_mid_request_cancels_only_what_it_took() -> None:
    answers, exchange, choices, cancelled = _request({"prompt": "p", "n": 3})
    choices.taken = 2  # the second take raised
    answers.forget_choices(choices)
    assert cancelled == ["t0"] and len(answers) == 0 and exchange.on_close is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "p", "n": 0}, "n"),
        ({"prompt": "p", "n": 129}, "n"),
        ({"prompt": "p", "n": "2"}, "n"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[1, 2], ["a"]]}, "prompt"),  # (lists of token ids are prompts: ints only)
        ({"prompt": [[1]] * 2049}, "prompt"),
        ({"prompt": ["x"] * 2049}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_choices_asked_out_of_bounds_are_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        decode_call(json.dumps({"model": "m", **body}).encode(), chat=False)
    assert refused.value.param == param


def test_several_prompts_and_n_decode_to_their_choices() -> None:
    call = decode_call(b'{"model": "m", "prompt": ["a", "b"], "n": 3}', chat=False)
    assert call.prompts == ("a", "b") and call.n == 3 and call.choices == 6
    one = decode_call(b'{"model": "m", "prompt": ["a"]}', chat=False)
    assert one.prompt == "a" and one.prompts == () and one.choices == 1
    chat = decode_call(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}',
                       chat=True)  # fmt: skip
    assert chat.choices == 2


# -- on real daemons, through the official openai client ---------------------------------


@pytest.fixture
def pair(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[HTTP, METRICS, "engine.token_delay_s=0.05", "http.choices_max=8"],
    )
    with running(c):
        yield c


def test_several_prompts_and_n_run_a_task_a_choice_and_answer_as_one(pair: Cluster) -> None:
    entry, owner = pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    prompts = ["one two", "three four five", "six"]
    # What LangChain's OpenAI sends for a batch: a list of prompts (here with n=2).
    done = client.completions.create(model="echo", prompt=prompts, n=2, max_tokens=2)
    assert [c.index for c in done.choices] == list(range(6))
    alone = [client.completions.create(model="echo", prompt=p, max_tokens=2) for p in prompts]
    assert [c.text for c in done.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert done.usage is not None and done.usage.completion_tokens == 6 * 2
    assert done.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    # A session owned by the other member: every choice forwarded, streamed back by index.
    session = next(
        k for k in (f"s-{i}" for i in range(1000))
        if Ring({d.name: 1.0 for d in pair.daemons}).owner(k) == owner.name
    )  # fmt: skip
    before = scrape(owner.metrics_port).get("gossipd_fanout_accepted_from_peers_total", 0)
    raw = client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=3,
        stream=True, stream_options={"include_usage": True},
        extra_headers={"x-session-id": session},
    )  # fmt: skip
    assert raw.headers["x-gossipd-member"] == owner.name
    chunks = list(raw.parse())
    texts = ["", "", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == ["<|user|> hi <|assistant|>"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    after = scrape(owner.metrics_port)["gossipd_fanout_accepted_from_peers_total"]
    assert after - before == 3
    # Past http.choices_max: refused, saying what to do.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="echo", prompt=prompts, n=3, max_tokens=2)
    assert "http.choices_max" in refused.value.message
    # A client gone mid-stream: every choice is cancelled where it runs.
    stream = client.completions.create(
        model="echo", prompt=["long", "longer"], max_tokens=2000, stream=True,
        extra_headers={"x-session-id": session},
    )  # fmt: skip
    next(iter(stream))
    stream.close()
    wait_until(
        lambda: scrape(owner.metrics_port).get("gossipd_cancels_total{outcome=here}") == 2,
        10,
        "the owner to cancel both choices",
    )
    wait_until(
        lambda: scrape(owner.metrics_port)["gossipd_tasks_running"] == 0, 10, "the engine idle"
    )
    assert scrape(entry.metrics_port)["gossipd_http_cancels_total{why=disconnect}"] == 1


def test_token_budgets_charge_a_request_of_several_choices_once_all_or_none(
    daemon_factory: Any,
) -> None:
    """40 tokens/s and a 1 s burst: four choices of 3 + 30 tokens (132) are more than the
    burst.  Charged one by one, the third was refused on every retry (the first two admitted
    and cancelled each time, their charge kept); charged as one, the request runs whenever
    the bucket is not in debt, and waits as its Retry-After says when it is."""
    d = daemon_factory(HTTP, METRICS, *BUDGET_40_TOKENS_PER_S)
    body = {"model": "echo", "prompt": "budget me", "max_tokens": 30, "n": 4}
    status, _, answer = _post(f"{d.http_url}/v1/completions", body)
    assert status == 200 and len(json.loads(answer)["choices"]) == 4
    status, headers, answer = _post(f"{d.http_url}/v1/completions", body)
    error = json.loads(answer)["error"]
    assert status == 429 and error["code"] == "over_budget", answer
    assert "4 tasks of one request cost 132 tokens" in error["message"]
    assert int(headers["retry-after-ms"]) > 2000  # the whole debt: 92 tokens at 40/s
    client = openai.OpenAI(base_url=f"{d.http_url}/v1", api_key="none", max_retries=3)
    done = client.completions.create(model="echo", prompt="budget me", max_tokens=30, n=4)
    assert len(done.choices) == 4
    metrics = scrape(d.metrics_port)
    assert metrics["gossipd_http_pending"] == 0
    assert metrics.get("gossipd_cancels_total{outcome=here}", 0) == 0, "no choice ran for nobody"
