"""A producer written with the plain `msgpack` package and pyzmq, following docs/PROTOCOL.md
alone: no gossipd code touches these bytes (the daemon is started as a separate process)."""

from __future__ import annotations

import msgpack
import zmq


def test_plain_msgpack_producer_submits_streams_and_reads_results(daemon_factory) -> None:
    daemon = daemon_factory()
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    port = replies.bind_to_random_port("tcp://127.0.0.1")
    tasks = ctx.socket(zmq.PUSH)
    tasks.connect(daemon.endpoint)
    try:
        reply_to = f"tcp://127.0.0.1:{port}"
        tasks.send(
            msgpack.packb(
                {
                    "v": 1,
                    "t": 1,
                    "id": "p-1",
                    "prompt": "red green",
                    "reply_to": reply_to,
                    "params": {"max_tokens": 3},
                }
            )
        )
        tasks.send(
            msgpack.packb(
                {
                    "v": 1,
                    "t": 1,
                    "id": "p-2",
                    "prompt": "blue",
                    "reply_to": reply_to,
                    "stream": True,
                    "params": {"max_tokens": 2, "temperature": 0.0},
                }
            )
        )
        tasks.send(
            msgpack.packb(
                {
                    "v": 1,
                    "t": 1,
                    "id": "p-3",
                    "prompt": "x",
                    "reply_to": reply_to,
                    "params": {"max_tokens": 0},
                }
            )
        )
        got = []
        poller = zmq.Poller()
        poller.register(replies, zmq.POLLIN)
        while sum(m["t"] == 3 for m in got) < 3 and poller.poll(10_000):
            got.append(msgpack.unpackb(replies.recv()))
    finally:
        tasks.close(linger=0)
        replies.close(linger=0)
        ctx.term()
    results = {m["id"]: m for m in got if m["t"] == 3}
    chunks = [m for m in got if m["t"] == 2]
    assert all(m["v"] == 1 for m in got)
    assert results["p-1"]["ok"] and results["p-1"]["text"] == "red green red"
    assert results["p-2"]["text"] == "blue blue" and [c["seq"] for c in chunks] == [0, 1]
    assert [c["id"] for c in chunks] == ["p-2", "p-2"]
    error = results["p-3"]["error"]
    assert (
        results["p-3"]["ok"] is False
        and error["code"] == "bad_request"
        and "max_tokens" in error["message"]
    )
