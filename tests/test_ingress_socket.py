"""The daemon's PULL sockets read by the loop (ingress.receiver and http.reply_receiver
"loop", the defaults) against what producers, strangers and owners send them, on a real
daemon: a connection that does not speak ZMTP, a socket that is not a PUSH, and a frame over
the socket's bound are each closed and counted by reason; a message of several frames is
refused (no task or reply is one); the daemon answers throughout, and a producer whose
connection was closed for its frame is served again once it reconnects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from gossipd.ops.scrape import scrape
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import (
    RawProducer,
    break_a_pulls_rules,
    closed_by_reason,
    keyed_tasks_answered_ok,
    wait_until,
)


def _counted(port: int, closed: str, refused: str) -> Callable[[], dict[str, float] | None]:
    """A look at the metrics: the closes by reason once the three that break_a_pulls_rules
    makes are counted in ``closed``, and the two-frame message in ``refused``."""

    def look() -> dict[str, float] | None:
        metrics = scrape(port)
        reasons = closed_by_reason(metrics, closed)
        want = ("greeting", "socket_type", "too_large")
        return reasons if all(reasons.get(r) for r in want) and metrics.get(refused) else None

    return look


def test_what_the_ingress_cannot_take_is_closed_counted_and_the_daemon_serves_on(
    daemon_factory: Any,
) -> None:
    metrics_port = free_tcp_port()
    daemon = daemon_factory(
        f"metrics.bind=127.0.0.1:{metrics_port}", "ingress.message_bytes_max=65536"
    )
    ctx = zmq.Context()
    socks = []
    producer = RawProducer(daemon.endpoint)
    try:
        socks = break_a_pulls_rules(ctx, daemon.endpoint, 4 * 65536 + 1)

        closed = "gossipd_ingress_connections_closed_total"
        refused = "gossipd_messages_refused_total{reason=multipart}"
        reasons = wait_until(
            _counted(metrics_port, closed, refused), 10, "three closes, the two-frame message"
        )
        assert reasons == {"greeting": 1, "socket_type": 1, "too_large": 1}
        assert keyed_tasks_answered_ok(producer, 20)
        # The PUSH whose frame was too large reconnects (libzmq does), and its next task runs.
        replies = ctx.socket(zmq.PULL)
        replies.setsockopt(zmq.LINGER, 0)
        reply_port = replies.bind_to_random_port("tcp://127.0.0.1")
        socks.append(replies)

        task = {"v": 1, "t": 1, "id": "again", "prompt": "hi",
                "reply_to": f"tcp://127.0.0.1:{reply_port}"}  # fmt: skip
        socks[2].send(msgpack.packb(task))
        assert replies.poll(10_000), "no answer to the reconnected producer"
        assert msgpack.unpackb(replies.recv())["id"] == "again"
        assert daemon.proc.poll() is None
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        producer.close()
    assert daemon.stop(timeout_s=15) == 0


def test_what_the_doors_reply_socket_cannot_take_is_closed_counted_and_the_door_serves_on(
    daemon_factory: Any,
) -> None:
    """The HTTP door's reply PULL (http.reply_receiver "loop", the default), where owners
    send its answers: the same rules as the ingress's, counted apart."""
    import httpx

    metrics_port, http_port = free_tcp_port(), free_tcp_port()
    daemon = daemon_factory(
        f"metrics.bind=127.0.0.1:{metrics_port}", f'http.bind="127.0.0.1:{http_port}"'
    )
    serving = next(e for e in daemon.events() if e.get("msg") == "serving")
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        socks = break_a_pulls_rules(ctx, serving["http_replies"], 64 * 1024 * 1024 + 64)

        closed = "gossipd_http_reply_connections_closed_total"
        refused = "gossipd_http_replies_invalid_total"
        reasons = wait_until(
            _counted(metrics_port, closed, refused), 20, "three closes, the two-frame message"
        )
        assert reasons == {"greeting": 1, "socket_type": 1, "too_large": 1}
        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions",
            json={"model": "echo", "prompt": "hello there", "max_tokens": 2},
            timeout=10,
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    assert daemon.stop(timeout_s=15) == 0
