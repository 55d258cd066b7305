"""A producer written with the plain `msgpack` package and pyzmq, following docs/PROTOCOL.md
alone: no gossipd code touches these bytes (the daemon is started as a separate process)."""

from __future__ import annotations

import shutil
from pathlib import Path

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


def test_plain_msgpack_producer_with_curve(daemon_factory, tmp_path) -> None:
    """docs/PROTOCOL.md, "Security": keys made by zmq.auth, the producer's reply PULL served
    with its own key pair, its PUSH checking the daemon's key; nothing else from gossipd."""
    import zmq.auth

    for folder in ("secrets", "peers", "producers"):
        (tmp_path / folder).mkdir()
    daemon_public_file, daemon_secret_file = zmq.auth.create_certificates(
        str(tmp_path / "secrets"), "s0"
    )
    producer_public_file, producer_secret_file = zmq.auth.create_certificates(
        str(tmp_path / "secrets"), "producer"
    )
    # zmq.auth writes secrets under the umask (0644 here); the daemon refuses a secret
    # every user can read (PROTOCOL.md, "Key files"), as ssh does.
    Path(daemon_secret_file).chmod(0o600)
    shutil.copy(producer_public_file, tmp_path / "producers" / "producer.key")
    shutil.copy(daemon_public_file, tmp_path / "peers" / "s0.key")
    daemon = daemon_factory(
        "security.curve=true",
        f"security.secret_key_file={daemon_secret_file}",
        f"security.peer_keys_dir={tmp_path / 'peers'}",
        f"security.producer_keys_dir={tmp_path / 'producers'}",
        'node.id="s0"',
    )
    server_key, _ = zmq.auth.load_certificate(daemon_public_file)
    public, secret = zmq.auth.load_certificate(producer_secret_file)
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    replies.curve_server = True  # the daemon checks that we hold the submitting key
    replies.curve_publickey, replies.curve_secretkey = public, secret
    port = replies.bind_to_random_port("tcp://127.0.0.1")
    tasks = ctx.socket(zmq.PUSH)
    tasks.curve_publickey, tasks.curve_secretkey = public, secret
    tasks.curve_serverkey = server_key
    tasks.connect(daemon.endpoint)
    try:
        tasks.send(
            msgpack.packb(
                {
                    "v": 1,
                    "t": 1,
                    "id": "c-1",
                    "prompt": "red green",
                    "reply_to": f"tcp://127.0.0.1:{port}",
                    "params": {"max_tokens": 3},
                }
            )
        )
        assert replies.poll(10_000)
        result = msgpack.unpackb(replies.recv())
        # A Tasks frame: every item takes the key the frame came with, so its replies reach
        # this PULL (served with that key) too.
        batch = [
            {
                "v": 1,
                "t": 1,
                "id": f"c-{i}",
                "prompt": f"w{i}",
                "params": {"max_tokens": 1},
                "reply_to": f"tcp://127.0.0.1:{port}",
            }
            for i in (2, 3)
        ]
        tasks.send(msgpack.packb({"v": 1, "t": 6, "items": batch}))
        more = []
        while len(more) < 2 and replies.poll(10_000):
            more.append(msgpack.unpackb(replies.recv()))
    finally:
        tasks.close(linger=0)
        replies.close(linger=0)
        ctx.term()
    assert result["t"] == 3 and result["id"] == "c-1" and result["text"] == "red green red"
    assert sorted((m["id"], m["text"]) for m in more) == [("c-2", "w2"), ("c-3", "w3")]


def test_plain_msgpack_producer_asking_for_batched_replies(daemon_factory) -> None:
    """docs/PROTOCOL.md, "Replies": a producer that sets `batch_replies` reads each frame as
    one reply or as a Replies map (`t` = 5) of several; a burst of tasks gets every answer,
    some of them packed together, each reply in a Replies frame a plain Chunk/Result map.
    (A token delay: tasks that arrive together finish in one loop turn, so their Results
    leave together.)"""
    daemon = daemon_factory("engine.token_delay_s=0.05")
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    port = replies.bind_to_random_port("tcp://127.0.0.1")
    tasks = ctx.socket(zmq.PUSH)
    tasks.connect(daemon.endpoint)
    count = 300
    frames = 0
    got: list[dict[str, object]] = []
    try:
        for i in range(count):
            task = {"v": 1, "t": 1, "id": f"b-{i}", "prompt": f"w{i}", "batch_replies": True}
            task |= {"reply_to": f"tcp://127.0.0.1:{port}", "params": {"max_tokens": 1}}
            tasks.send(msgpack.packb(task))
        while len(got) < count and replies.poll(10_000):
            msg = msgpack.unpackb(replies.recv())
            frames += 1
            got += msg["items"] if msg["t"] == 5 else [msg]
    finally:
        tasks.close(linger=0)
        replies.close(linger=0)
        ctx.term()
    assert sorted(m["id"] for m in got) == sorted(f"b-{i}" for i in range(count))
    assert all(m["t"] == 3 and m["ok"] for m in got)
    assert frames < count  # some replies shared a frame


def test_plain_msgpack_producer_sends_several_tasks_in_one_Tasks_frame(daemon_factory) -> None:
    """docs/PROTOCOL.md, "Tasks": each item is taken and answered as a frame of its own (a bad
    item is refused alone, with its own bad_request Result); a Tasks item inside one is
    refused."""
    daemon = daemon_factory()
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    reply_to = f"tcp://127.0.0.1:{replies.bind_to_random_port('tcp://127.0.0.1')}"
    tasks = ctx.socket(zmq.PUSH)
    tasks.connect(daemon.endpoint)

    def task(i: int, **more: object) -> dict[str, object]:
        one = {"v": 1, "t": 1, "id": f"m-{i}", "prompt": f"w{i}", "params": {"max_tokens": 1}}
        return one | {"reply_to": reply_to} | more

    items = [task(0), task(1, params={"max_tokens": 0}), task(2)]
    nested = {"v": 1, "t": 6, "items": [task(3)]}
    got = []
    try:
        tasks.send(msgpack.packb({"v": 1, "t": 6, "items": [*items, nested]}))
        while len(got) < 3 and replies.poll(10_000):
            got.append(msgpack.unpackb(replies.recv()))
        extra = replies.poll(300)  # the nested task is not run
    finally:
        tasks.close(linger=0)
        replies.close(linger=0)
        ctx.term()
    results = {m["id"]: m for m in got}
    assert results["m-0"]["ok"] and results["m-0"]["text"] == "w0"
    assert results["m-2"]["ok"] and results["m-2"]["text"] == "w2"
    assert not results["m-1"]["ok"] and results["m-1"]["error"]["code"] == "bad_request"
    assert not extra
