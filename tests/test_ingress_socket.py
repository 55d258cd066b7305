"""The ingress socket read by the loop (ingress.receiver "loop", the default) against what
producers and strangers send it, on a real daemon: a connection that does not speak ZMTP, a
socket that is not a PUSH, and a frame over 4 x ingress.message_bytes_max are each closed
and counted by reason; a message of several frames is refused (no task is one); the
daemon answers tasks throughout, and a producer whose connection was closed for its frame
is served again once it reconnects."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from gossipd.ops.scrape import scrape
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import RawProducer, break_a_pulls_rules, closed_by_reason, wait_until


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

        def counted() -> dict[str, float] | None:
            metrics = scrape(metrics_port)
            reasons = closed_by_reason(metrics, "gossipd_ingress_connections_closed_total")
            multipart = metrics.get("gossipd_messages_refused_total{reason=multipart}", 0)
            want = ("greeting", "socket_type", "too_large")
            return reasons if all(reasons.get(r) for r in want) and multipart else None

        reasons = wait_until(counted, 10, "three connections closed, the two-frame message refused")
        assert reasons == {"greeting": 1, "socket_type": 1, "too_large": 1}
        for i in range(20):
            producer.send_task(f"after-{i}", key=f"k{i}")
        results = producer.results(20, timeout_s=10)
        assert sorted(r["id"] for r in results if r["ok"]) == sorted(
            f"after-{i}" for i in range(20)
        )
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
