"""One real daemon process on loopback, driven through real ZeroMQ sockets.

Covers the walking skeleton's promises: tasks run and answer, bad input of every kind is
refused with a reason and counted while the daemon keeps serving, duplicates run once,
overload and deadlines answer clearly.
"""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest

from gossipd.tools.launcher import free_tcp_port
from tests.helpers import RawProducer, scrape


@pytest.fixture
def producer_for():  # type: ignore[no-untyped-def]
    made: list[RawProducer] = []

    def make(daemon) -> RawProducer:  # type: ignore[no-untyped-def]
        p = RawProducer(daemon.endpoint)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def start_with_metrics(daemon_factory, *overrides: str):  # type: ignore[no-untyped-def]
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}", *overrides)
    daemon.metrics_port = port
    return daemon


def test_task_runs_and_result_carries_text_node_and_timings(daemon_factory, producer_for) -> None:
    daemon = daemon_factory()
    producer = producer_for(daemon)
    producer.send_task("a", prompt="one two three", params={"max_tokens": 5})
    (result,) = producer.results(1)
    assert result["ok"] is True and result["error"] is None
    assert result["text"] == "one two three one two"
    assert result["id"] == "a" and result["node"] and result["attempts"] == 1
    assert result["timings"]["total_ms"] >= result["timings"]["first_token_ms"] > 0


def test_stream_sends_ordered_chunks_then_the_result(daemon_factory, producer_for) -> None:
    daemon = daemon_factory("engine.token_delay_s=0.005")
    producer = producer_for(daemon)
    producer.send_task("s", prompt="alpha beta", params={"max_tokens": 7}, stream=True)
    replies = producer.replies(until=lambda r: any(x["t"] == 3 for x in r))
    chunks = [x for x in replies if x["t"] == 2]
    result = replies[-1]
    assert [c["seq"] for c in chunks] == list(range(7))
    assert (
        "".join(c["delta"] for c in chunks)
        == result["text"]
        == "alpha beta alpha beta alpha beta alpha"
    )
    assert result["chunks"] == 7


BAD_FRAMES = [
    ("not_msgpack", lambda rt: b"\xc1\xc1garbage", None),
    (
        "wrong_types",
        lambda rt: msgpack.packb({"v": 1, "t": 1, "id": "w", "prompt": 7, "reply_to": rt}),
        "bad_request",
    ),
    (
        "missing_field",
        lambda rt: msgpack.packb({"v": 1, "t": 1, "id": "m", "reply_to": rt}),
        "bad_request",
    ),
    (
        "bad_params",
        lambda rt: msgpack.packb(
            {
                "v": 1,
                "t": 1,
                "id": "p",
                "prompt": "x",
                "reply_to": rt,
                "params": {"temperature": -1},
            }
        ),
        "bad_request",
    ),
    (
        "unknown_version",
        lambda rt: msgpack.packb({"v": 7, "t": 1, "id": "v", "prompt": "x", "reply_to": rt}),
        "unsupported_version",
    ),
    (
        "bad_reply_to",
        lambda rt: msgpack.packb(
            {"v": 1, "t": 1, "id": "r", "prompt": "x", "reply_to": "smtp://x"}
        ),
        None,
    ),
    ("not_a_map", lambda rt: msgpack.packb(["v", 1]), None),
    (
        "oversized",
        lambda rt: msgpack.packb({"v": 1, "t": 1, "id": "o", "prompt": "x" * 5000, "reply_to": rt}),
        "bad_request",
    ),
]


def test_every_bad_input_is_refused_answered_when_possible_and_counted(
    daemon_factory, producer_for
) -> None:
    daemon = start_with_metrics(daemon_factory, "ingress.message_bytes_max=4096")
    producer = producer_for(daemon)
    for _name, make, _code in BAD_FRAMES:
        producer.send_raw(make(producer.reply_to))
    producer.send_task("good", params={"max_tokens": 2})
    answerable = [(name, code) for name, _, code in BAD_FRAMES if code]
    results = producer.results(len(answerable) + 1)
    by_id = {r["id"]: r for r in results}
    assert by_id["good"]["ok"] is True, "the daemon keeps serving after bad input"
    for name, code in answerable:
        task_id = {
            "wrong_types": "w",
            "missing_field": "m",
            "bad_params": "p",
            "unknown_version": "v",
            "oversized": "o",
        }[name]
        assert by_id[task_id]["ok"] is False
        assert by_id[task_id]["error"]["code"] == code, name
        assert by_id[task_id]["error"]["message"]
    assert "exceeds the limit of 4096 bytes" in by_id["o"]["error"]["message"]
    assert "temperature" in by_id["p"]["error"]["message"]
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_messages_refused_total{reason=bad_request}"] == 6
    assert metrics["gossipd_messages_refused_total{reason=oversized}"] == 1
    assert metrics["gossipd_messages_refused_total{reason=unsupported_version}"] == 1
    assert metrics["gossipd_messages_unanswerable_total"] == 3
    assert metrics["gossipd_task_results_total{outcome=ok}"] == 1
    warnings = [e for e in daemon.events() if e.get("msg") == "refused a message"]
    assert warnings and all("reason" in e and "hint" in e for e in warnings)


def test_frame_over_the_hard_ceiling_drops_only_that_connection(
    daemon_factory, producer_for
) -> None:
    daemon = daemon_factory("ingress.message_bytes_max=4096")
    attacker = producer_for(daemon)
    attacker.send_raw(b"\x00" * (4 * 4096 + 1))  # ZMQ_MAXMSGSIZE: zeromq drops this peer
    honest = producer_for(daemon)
    honest.send_task("after", params={"max_tokens": 1})
    (result,) = honest.results(1)
    assert result["ok"] is True


def test_reply_to_that_points_nowhere_is_dropped_counted_and_harmless(
    daemon_factory, producer_for
) -> None:
    daemon = start_with_metrics(daemon_factory, "ingress.reply_timeout_s=0.3")
    producer = producer_for(daemon)
    dead = f"tcp://127.0.0.1:{free_tcp_port()}"
    for i in range(5):
        producer.send_task(f"lost-{i}", reply_to=dead, params={"max_tokens": 1})
    producer.send_task("fine", params={"max_tokens": 1})
    (result,) = producer.results(1)
    assert result["id"] == "fine" and result["ok"]
    producer.replies(quiet_s=0.8)
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_replies_dropped_total{reason=undeliverable}"] == 5
    assert metrics["gossipd_task_results_total{outcome=ok}"] == 6


def test_garbage_flood_while_valid_tasks_flow(daemon_factory, producer_for) -> None:
    daemon = start_with_metrics(daemon_factory)
    flood = producer_for(daemon)
    producer = producer_for(daemon)
    garbage_count = 20_000

    def spray() -> None:
        rng = os.urandom(garbage_count * 8)
        for i in range(garbage_count):
            if i % 3 == 0:
                flood.send_raw(msgpack.packb({"v": 1, "t": 1, "id": f"g{i}", "prompt": i}))
            else:
                flood.send_raw(rng[i * 8 : i * 8 + 8])

    thread = threading.Thread(target=spray)
    thread.start()
    for i in range(2000):
        producer.send_task(f"v{i}", prompt=f"valid {i}", params={"max_tokens": 2})
    results = producer.results(2000, timeout_s=60)
    thread.join()
    assert len(results) == 2000
    assert all(r["ok"] and r["text"] == f"valid {r['id'][1:]}" for r in results)
    producer.replies(quiet_s=0.5)
    metrics = scrape(daemon.metrics_port)
    refused = sum(v for k, v in metrics.items() if k.startswith("gossipd_messages_refused_total"))
    assert refused == garbage_count
    assert metrics["gossipd_messages_received_total"] == garbage_count + 2000
    assert daemon.proc.poll() is None


def test_duplicate_ids_run_once_and_late_duplicates_get_the_cached_result(
    daemon_factory, producer_for
) -> None:
    daemon = start_with_metrics(daemon_factory, "engine.token_delay_s=0.02")
    producer = producer_for(daemon)
    for attempt in range(5):
        producer.send_task("dup", prompt="x y", params={"max_tokens": 10}, attempt=attempt)
    first = producer.results(1)
    assert len(first) == 1 and first[0]["ok"]
    assert producer.replies(quiet_s=0.3) == [], "absorbed duplicates get no extra answer"
    producer.send_task("dup", prompt="x y", params={"max_tokens": 10}, attempt=5)
    (again,) = producer.results(1)
    assert again == first[0]
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_task_duplicates_total"] == 5
    assert metrics["gossipd_engine_generated_tokens_total"] == 10, "the engine ran it once"
    assert metrics["gossipd_engine_steps_total"] == 10  # (the echo engine's: a token a step)


def test_a_producer_sending_an_answered_id_again_gets_the_cached_result_at_any_attempt(
    daemon_factory, producer_for
) -> None:
    """A producer that restarted sends its ids again from attempt 0: each send gets the cached
    Result, although a later attempt was answered (admission's rule 5 leaves out only
    earlier sends that entered the cluster before that answer: tests/
    test_forward_validation.py)."""
    daemon = start_with_metrics(daemon_factory)
    producer = producer_for(daemon)
    producer.send_task("again", prompt="x y", params={"max_tokens": 3}, attempt=2)
    (first,) = producer.results(1)
    assert first["ok"]
    for attempt in (1, 0):
        producer.send_task("again", prompt="x y", params={"max_tokens": 3}, attempt=attempt)
        (cached,) = producer.results(1)
        assert cached == first, f"attempt {attempt}"
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_task_duplicates_answered_later_total"] == 0
    assert metrics["gossipd_task_duplicates_total"] == 2
    assert metrics["gossipd_engine_generated_tokens_total"] == 3, "the engine ran it once"


def test_overload_answers_overloaded_with_a_retry_after_hint(daemon_factory, producer_for) -> None:
    daemon = daemon_factory(
        "ingress.pending_max=4",
        "ingress.concurrency_max=2",
        "ingress.retry_after_ms=150",
        "engine.token_delay_s=0.05",
    )
    producer = producer_for(daemon)
    for i in range(20):
        producer.send_task(f"o{i}", params={"max_tokens": 4})
    results = producer.results(20, timeout_s=20)
    overloaded = [r for r in results if not r["ok"]]
    assert len([r for r in results if r["ok"]]) >= 4
    assert overloaded and all(r["error"]["code"] == "overloaded" for r in overloaded)
    assert all(r["error"]["retry_after_ms"] == 150 for r in overloaded)


def test_overload_by_expected_wait_refuses_early_and_admitted_tasks_meet_their_deadline(
    daemon_factory, producer_for
) -> None:
    """2 workers, 5 tokens x 20 ms: 0.1 s a task, 20 tasks a second.  60 tasks with a 1 s
    deadline at once: about 12 fit in half their deadline, the rest are refused at once."""
    daemon = start_with_metrics(
        daemon_factory, "ingress.concurrency_max=2", "engine.token_delay_s=0.02"
    )
    producer = producer_for(daemon)
    for i in range(4):  # the service-time estimate needs finished tasks
        producer.send_task(f"warm{i}", params={"max_tokens": 5})
    assert all(r["ok"] for r in producer.results(4))
    sent_at = time.monotonic()
    for i in range(60):
        producer.send_task(f"b{i}", params={"max_tokens": 5}, timeout_ms=1000)
    answered_at: dict[str, float] = {}
    results: dict[str, dict] = {}

    def collect(replies: list) -> bool:  # type: ignore[type-arg]
        for r in replies[len(answered_at) :]:
            assert r["id"] not in results, f"a second Result for {r['id']}"
            answered_at[r["id"]], results[r["id"]] = time.monotonic() - sent_at, r
        return len(results) == 60

    producer.replies(until=collect, timeout_s=10)
    assert len(results) == 60, "every task gets a final Result"
    assert producer.replies(quiet_s=0.5) == [], "and only one"
    refused = [i for i, r in results.items() if not r["ok"]]
    admitted = [i for i, r in results.items() if r["ok"]]
    assert all(results[i]["error"]["code"] == "overloaded" for i in refused)
    assert 8 <= len(admitted) <= 20, len(admitted)
    assert all(answered_at[i] < 0.3 for i in refused), "refused well before the deadline"
    hints = [results[i]["error"]["retry_after_ms"] for i in refused]
    assert all(200 <= h <= 10_000 for h in hints) and max(hints) > 1000, hints
    assert all(answered_at[i] < 1.0 for i in admitted), "admitted tasks meet their deadline"
    metrics = scrape(daemon.metrics_port)
    key = "gossipd_messages_refused_total{reason=overloaded_expected_wait}"
    assert metrics[key] == len(refused)
    assert 0.09 < metrics["gossipd_task_service_seconds"] < 0.2


def test_deadline_exceeded_stops_the_engine_work(daemon_factory, producer_for) -> None:
    daemon = start_with_metrics(daemon_factory, "engine.token_delay_s=0.05")
    producer = producer_for(daemon)
    producer.send_task("late", params={"max_tokens": 200}, timeout_ms=300)
    (result,) = producer.results(1)
    assert result["error"]["code"] == "deadline_exceeded"
    assert "300 ms" in result["error"]["message"]
    producer.replies(quiet_s=0.3)
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_engine_generated_tokens_total"] < 12, "generation was aborted"
    assert metrics["gossipd_engine_running_requests"] == 0


def test_cancel_stops_a_running_and_a_queued_task_and_ignores_unknown_ids(
    daemon_factory, producer_for
) -> None:  # type: ignore[no-untyped-def]
    daemon = start_with_metrics(
        daemon_factory, "engine.token_delay_s=0.05", "ingress.concurrency_max=1"
    )
    producer = producer_for(daemon)
    producer.send_task("running", params={"max_tokens": 200}, stream=True)
    producer.send_task("queued", params={"max_tokens": 200})  # waits: one worker only
    producer.replies(until=lambda r: any(x["t"] == 2 for x in r))  # "running" has started
    for task_id in ("running", "queued", "never-seen"):
        producer.send_raw(msgpack.packb({"v": 1, "t": 4, "id": task_id}))
    results = {r["id"]: r for r in producer.results(2)}
    assert {r["error"]["code"] for r in results.values()} == {"cancelled"}
    producer.replies(quiet_s=0.3)
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_engine_generated_tokens_total"] < 12, "generation was aborted"
    assert metrics["gossipd_engine_running_requests"] == 0
    assert metrics["gossipd_cancels_total{outcome=here}"] == 2
    assert metrics["gossipd_cancels_total{outcome=unknown}"] == 1
    # The daemon keeps serving, and the cancelled id keeps its one answer.
    producer.send_task("after", params={"max_tokens": 2})
    producer.send_task("running", params={"max_tokens": 2})
    again = {r["id"]: r for r in producer.results(2)}
    assert again["after"]["ok"] and again["running"]["error"]["code"] == "cancelled"


@pytest.mark.parametrize("alone", [True, False])
def test_a_daemon_alone_refuses_a_model_it_does_not_serve(daemon_factory, alone: bool) -> None:  # type: ignore[no-untyped-def]
    """PROTOCOL.md's Task.model: the model to run. A daemon without membership
    (gossip.bind empty: no members to route to) answers a task for another model
    `unavailable`, as a cluster where no member serves it does (placement, the other
    case here); it ran it on its own engine before. Its own model's and model-less run."""
    port = free_tcp_port()
    overrides = [f"metrics.bind=127.0.0.1:{port}"] + (['gossip.bind=""'] if alone else [])
    daemon = daemon_factory(*overrides)
    producer = RawProducer(daemon.endpoint)
    try:
        producer.send_task("other", model="llama-70b")
        producer.send_task("mine", model="echo")
        producer.send_task("any")
        results = {r["id"]: r for r in producer.results(3)}
    finally:
        producer.close()
    assert not results["other"]["ok"]
    assert results["other"]["error"]["code"] == "unavailable"
    assert "llama-70b" in results["other"]["error"]["message"]
    assert results["mine"]["ok"] and results["any"]["ok"]
    if alone:
        assert scrape(port)["gossipd_messages_refused_total{reason=unavailable}"] == 1
