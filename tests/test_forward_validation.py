"""The rpc channel validates a forwarded task as the ingress validates a producer's: a raw
DEALER (plain pyzmq + msgpack) sends Forwards the ingress would refuse, and a late copy of an
id that the owner has answered already."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from gossipd.tools.launcher import free_tcp_port
from tests.helpers import RawProducer, scrape, wait_until


@contextmanager
def _forwarding(daemon: Any) -> Iterator[tuple[RawProducer, zmq.Socket]]:
    """A producer to get the Results, and a raw DEALER on the daemon's rpc ROUTER."""
    producer = RawProducer(daemon.endpoint)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{daemon.rpc_port}")
    try:
        yield producer, dealer
    finally:
        dealer.close()
        ctx.term()
        producer.close()


def _replies(dealer: zmq.Socket, n: int, ids: dict[str, int]) -> list[dict[str, Any]]:
    """The answers to the first ``n`` Forwards, ``ids`` their task ids' reqs: ForwardReplies,
    and for an accept not sent (its task ended while the owner held it: docs/PROTOCOL.md,
    "The owner holds accepting ForwardReplies") the TaskDone that stands for it, as
    ``{"req", "accepted": True, "by": "TaskDone"}``."""
    out: list[dict[str, Any]] = []
    answered: set[int] = set()
    while len(out) < n:
        assert dealer.poll(5000), f"no answer within 5 s ({len(out)} of {n})"
        msg = msgpack.unpackb(dealer.recv())
        for m in msg["items"] if msg["t"] == 23 else [msg]:
            if m["t"] == 21:
                reply = m
            elif m["t"] == 22 and ids.get(m["id"]) not in answered:
                reply = {"req": ids[m["id"]], "accepted": True, "by": "TaskDone"}
            else:
                continue
            answered.add(reply["req"])
            out.append(reply)
    return out


def test_a_forward_the_ingress_would_refuse_is_refused_with_its_code_and_counted(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}", "ingress.message_bytes_max=4096")
    with _forwarding(daemon) as (producer, dealer):

        def forward(req: int, task_id: str, **task: Any) -> None:
            body = {"v": 1, "t": 1, "id": task_id, "prompt": "a b", "reply_to": producer.reply_to}
            body.update(task)
            frame = {"v": 1, "t": 20, "req": req, "src": "mallory", "task": body}
            dealer.send(msgpack.packb({**frame, "remaining_ms": 5000, "attempt": 1}))

        forward(1, "v2", v=2)
        forward(2, "huge", prompt="x" * 8000)
        forward(3, "fine")
        replies = {r["req"]: r for r in _replies(dealer, 3, {"v2": 1, "huge": 2, "fine": 3})}
        assert replies[1]["accepted"] is False and replies[1]["code"] == "unsupported_version"
        assert replies[2]["accepted"] is False and replies[2]["code"] == "bad_request"
        assert "4096" in replies[2]["message"]
        assert replies[3]["accepted"] is True
        # Only the valid one ran: the producer gets exactly its Result.
        results = producer.replies(quiet_s=1.0, timeout_s=5)
        assert [r["id"] for r in results if r["t"] == 3] == ["fine"]
        # A Cancel of another version inside a batch is refused and counted, as ingress does.
        cancel = {"v": 2, "t": 4, "id": "fine"}
        dealer.send(msgpack.packb({"v": 1, "t": 23, "items": [cancel]}))
        metrics = wait_until(
            lambda: (m := scrape(port))["gossipd_fanout_bad_peer_messages_total"] == 1 and m,
            5,
            "the Cancel v=2 counted",
        )
        assert metrics["gossipd_fanout_invalid_from_peers_total"] == 2
        assert metrics["gossipd_fanout_refused_to_peers_total"] == 2


def test_a_forward_from_an_earlier_process_of_its_sender_is_refused_and_not_run(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    """Forward.boot: the bed found a Forward that had waited 26 s in the kernel's copy of a
    SIGKILLed forwarder's connection (sent as a cut began) run by the owner after the heal,
    whose restarted forwarder then answered its Confirm "unknown": the task was answered a
    second time.  A Forward older than one its sender's later process sent is refused."""
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}")
    with _forwarding(daemon) as (producer, dealer):

        def forward(req: int, task_id: str, boot: int | None, src: str = "f1") -> None:
            body = {"v": 1, "t": 1, "id": task_id, "prompt": "a b", "reply_to": producer.reply_to}
            frame: dict[str, Any] = {"v": 1, "t": 20, "req": req, "src": src, "task": body}
            if boot is not None:
                frame["boot"] = boot
            dealer.send(msgpack.packb({**frame, "remaining_ms": 5000, "attempt": 1}))

        forward(1, "new", 2_000)  # the restarted process
        forward(2, "old", 1_000)  # the dead one's, late
        forward(3, "unsaid", None)  # a daemon that does not say (old version): taken
        forward(4, "other", 500, src="f2")  # another member's own processes
        ids = {"new": 1, "old": 2, "unsaid": 3, "other": 4}
        replies = {r["req"]: r for r in _replies(dealer, 4, ids)}
        assert replies[1]["accepted"] is True
        assert replies[2]["accepted"] is False and replies[2]["code"] == "unavailable"
        assert "earlier process" in replies[2]["message"]
        assert replies[3]["accepted"] is True and replies[4]["accepted"] is True
        results = producer.replies(quiet_s=1.0, timeout_s=5)
        assert sorted(r["id"] for r in results if r["t"] == 3) == ["new", "other", "unsaid"]
        metrics = scrape(port)
        assert metrics["gossipd_fanout_refused_stale_total"] == 1


def test_a_migrated_earlier_send_of_an_id_answered_at_a_later_send_is_accepted_not_answered(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    """Admission's rule 5 on the owner's side: a forwarder migrates the producer's earlier
    send to an owner that has answered a later one.  The forwarder gets its TaskDone, which
    stands for the accept (it can forget the task); the producer gets no second Result.  A send that
    entered the cluster after the answer (its Forward's remaining_ms is its whole timeout)
    gets the cached Result."""
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}")
    with _forwarding(daemon) as (producer, dealer):
        task = {"v": 1, "t": 1, "id": "mig", "prompt": "a b", "reply_to": producer.reply_to}

        def migrate(req: int, attempt: int, remaining_ms: int) -> dict[int, dict[str, Any]]:
            """A Forward of send ``attempt`` (30 s timeout, ``remaining_ms`` of it left):
            its TaskDone, which stands for its accept (the owner held the accept for
            fanout.ack_delay_s and the task, done already, ended meanwhile), by type."""
            body = {**task, "attempt": attempt, "timeout_ms": 30_000}
            frame = {"v": 1, "t": 20, "req": req, "src": "d-other", "task": body}
            dealer.send(msgpack.packb({**frame, "remaining_ms": remaining_ms, "attempt": 1}))
            kinds: dict[int, dict[str, Any]] = {}
            while 22 not in kinds:
                assert dealer.poll(5000), f"no TaskDone within 5 s: {kinds}"
                msg = msgpack.unpackb(dealer.recv())
                kinds.update((m["t"], m) for m in (msg["items"] if msg["t"] == 23 else [msg]))
            if 21 in kinds:  # (sent only if the loop stalled past the hold: not the rule)
                assert kinds[21]["accepted"] is True and kinds[21]["req"] == req
            assert kinds[22]["id"] == "mig"
            return kinds

        producer.send_task("mig", prompt="a b", attempt=2)  # runs: its Result goes out
        (first,) = producer.results(1)
        assert first["ok"]
        migrate(1, attempt=1, remaining_ms=5_000)  # entered 25 s ago: before the answer
        assert producer.replies(quiet_s=0.5) == [], "no second Result"
        producer.send_task("mig", prompt="a b", attempt=3)  # answered from the cache
        assert producer.results(1) == [first]
        migrate(2, attempt=2, remaining_ms=5_000)  # below send 3, which the cache answered
        assert producer.replies(quiet_s=0.5) == [], "no second Result"
        migrate(3, attempt=1, remaining_ms=30_000)  # entered now, after the answers
        assert producer.results(1) == [first]
        metrics = scrape(port)
        assert metrics["gossipd_task_duplicates_answered_later_total"] == 2


def _answers_to(dealer: zmq.Socket, task_id: str) -> list[dict[str, Any]]:
    """Every ForwardReply and TaskDone that comes back until ``task_id``'s TaskDone, in order."""
    seen: list[dict[str, Any]] = []
    while not any(m["t"] == 22 and m["id"] == task_id for m in seen):
        assert dealer.poll(5000), f"no TaskDone for {task_id} within 5 s: {seen}"
        msg = msgpack.unpackb(dealer.recv())
        seen += [m for m in (msg["items"] if msg["t"] == 23 else [msg]) if m["t"] in (21, 22)]
    return seen


def test_a_task_that_ends_while_its_accept_is_held_is_answered_by_its_TaskDone_alone(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    """The owner holds an accept up to fanout.ack_delay_s (0.5 s here, so that a loaded
    machine's stall cannot send it first): a task that ends meanwhile has only its TaskDone
    sent, carrying the load the accept would have carried, and counted.  A task that runs
    longer than the hold has its accept sent (with the load), then its TaskDone."""
    port = free_tcp_port()
    daemon = daemon_factory(
        f"metrics.bind=127.0.0.1:{port}", "fanout.ack_timeout_s=5", "fanout.ack_delay_s=0.5"
    )
    slow = daemon_factory(
        f"metrics.bind=127.0.0.1:{free_tcp_port()}",
        "fanout.ack_timeout_s=5",
        "fanout.ack_delay_s=0.05",
        "engine.token_delay_s=0.5",
        name="slow",
    )
    for owner, task_id, held in ((daemon, "quick", False), (slow, "slow", True)):
        with _forwarding(owner) as (producer, dealer):
            body = {"v": 1, "t": 1, "id": task_id, "prompt": "a b", "reply_to": producer.reply_to}
            body["params"] = {"max_tokens": 1}  # (the slow engine: one 0.5 s token)
            frame = {"v": 1, "t": 20, "req": 7, "src": "d-other", "task": body}
            dealer.send(msgpack.packb({**frame, "remaining_ms": 5000, "attempt": 1}))
            seen = _answers_to(dealer, task_id)
            if not held:  # nor after it: the hold (0.5 s) passes without an accept
                assert not dealer.poll(800), "an accept after the TaskDone that stood for it"
            (result,) = producer.results(1)
            assert result["ok"] and result["id"] == task_id
        if held:
            accept, done = seen
            assert accept["t"] == 21 and accept["req"] == 7 and accept["accepted"] is True
            assert accept["load"] is not None
        else:
            (done,) = seen  # no accept: the TaskDone stands for it
            assert done["load"] is not None, "the load the accept would have carried"
        assert done["t"] == 22 and done["id"] == task_id
    assert scrape(port)["gossipd_fanout_accepts_in_done_total"] == 1
