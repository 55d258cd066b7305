"""The rpc channel validates a forwarded task as the ingress validates a producer's: a raw
DEALER (plain pyzmq + msgpack) sends Forwards the ingress would refuse."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from gossipd.tools.launcher import free_tcp_port
from tests.helpers import RawProducer, scrape, wait_until


def _replies(dealer: zmq.Socket, n: int) -> list[dict[str, Any]]:
    """The first ``n`` ForwardReplies (TaskDones pass by)."""
    out: list[dict[str, Any]] = []
    while len(out) < n:
        assert dealer.poll(5000), f"no ForwardReply within 5 s ({len(out)} of {n})"
        msg = msgpack.unpackb(dealer.recv())
        out.extend(m for m in (msg["items"] if msg["t"] == 23 else [msg]) if m["t"] == 21)
    return out


def test_a_forward_the_ingress_would_refuse_is_refused_with_its_code_and_counted(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}", "ingress.message_bytes_max=4096")
    producer = RawProducer(daemon.endpoint)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{daemon.rpc_port}")
    try:

        def forward(req: int, task_id: str, **task: Any) -> None:
            body = {"v": 1, "t": 1, "id": task_id, "prompt": "a b", "reply_to": producer.reply_to}
            body.update(task)
            frame = {"v": 1, "t": 20, "req": req, "src": "mallory", "task": body}
            dealer.send(msgpack.packb({**frame, "remaining_ms": 5000, "attempt": 1}))

        forward(1, "v2", v=2)
        forward(2, "huge", prompt="x" * 8000)
        forward(3, "fine")
        replies = {r["req"]: r for r in _replies(dealer, 3)}
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
    finally:
        dealer.close()
        ctx.term()
        producer.close()
