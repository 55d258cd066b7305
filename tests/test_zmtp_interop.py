"""The loop peer channel (gossipd/looppeer.py) against libzmq itself, under CURVE with the
daemon's own Security (key directories, ZAP's decision and counters): a libzmq DEALER
reaches a LoopPeerServer and a LoopPeerClient reaches a libzmq ROUTER, which is what lets
daemons of the two transports (or two releases) forward to each other; a stranger's key
gets nothing through either way, a message of several parts and a connection that speaks
no ZMTP are counted, and the server keeps serving."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.peerchannel import ZmqPeerClient, ZmqPeerServer
from gossipd.security import (
    DOMAIN_PEERS,
    KeyPair,
    Security,
    load_key_pair,
    node_of,
    write_key_pair,
)
from gossipd.sockets import SocketKind, SocketPool
from gossipd.zmtp import PeerCurve
from tests.helpers import run_with_context, wait_until_async

BYTES_MAX = 1 << 20


def _keys(tmp_path: Path) -> dict[str, KeyPair]:
    """srv and cli have their public keys in peers/; stranger's is nowhere."""
    pairs = {}
    (tmp_path / "peers").mkdir()
    (tmp_path / "producers").mkdir()
    for name in ("srv", "cli", "stranger"):
        public, secret = write_key_pair(name, tmp_path / "own")
        pairs[name] = load_key_pair(secret)
        if name != "stranger":
            (tmp_path / "peers" / f"{name}.key").write_bytes(public.read_bytes())
    return pairs


def _security(ctx: zmq.Context, tmp_path: Path, pair: KeyPair, node_at: Any) -> Security:
    security = Security(
        curve=True,
        ctx=ctx,
        key_pair=pair,
        peer_keys_dir=str(tmp_path / "peers"),
        producer_keys_dir=str(tmp_path / "producers"),
        node_at=node_at,
    )
    security.start()
    return security


def _loop_curve(pair: KeyPair, server: KeyPair) -> PeerCurve:
    return PeerCurve(
        z85.decode(pair.public), z85.decode(pair.secret), server_key=lambda addr: z85.decode(
            server.public
        )
    )  # fmt: skip


def test_a_libzmq_DEALER_under_CURVE_reaches_a_LoopPeerServer_and_a_stranger_does_not(
    tmp_path: Path,
) -> None:
    keys = _keys(tmp_path)

    async def main(ctx: zmq.Context) -> dict[str, Any]:
        security = _security(ctx, tmp_path, keys["srv"], lambda addr: None)
        server = LoopPeerServer(message_bytes_max=BYTES_MAX, curve=security.loop_peer_curve())
        got: list[tuple[bytes, bytes, str]] = []
        malformed: list[None] = []
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append((i, f, s)), lambda: malformed.append(None))
        clients, pools = [], []
        for name in ("stranger", "cli"):
            pool = SocketPool(ctx)
            pool.set_curve(
                SocketKind.PEER,
                public=keys[name].public,
                secret=keys[name].secret,
                route=lambda a: (a, keys["srv"].public),
            )
            replies: list[bytes] = []
            client = ZmqPeerClient(pool)
            client.start(lambda a, frames, replies=replies: replies.extend(frames))
            clients.append((client, replies))
            pools.append(pool)
        (stranger, _), (cli, cli_replies) = clients
        raw = ctx.socket(zmq.DEALER)  # cli's key on a socket that sends several parts
        raw.curve_serverkey, raw.curve_publickey = keys["srv"].public, keys["cli"].public
        raw.curve_secretkey = keys["cli"].secret
        raw.setsockopt(zmq.LINGER, 0)
        try:
            stranger.send(addr, b"from a stranger")
            assert security.zap is not None
            await wait_until_async(
                lambda: security.zap.refused[(DOMAIN_PEERS, "unknown_key")], 5.0, "a refusal"
            )
            cli.send(addr, b"from cli")
            await wait_until_async(lambda: got, 5.0, "cli's frame")
            assert server.send(got[0][0], b"to cli")
            await wait_until_async(lambda: cli_replies, 5.0, "the reply")
            raw.connect(addr)
            raw.send_multipart([b"one", b"two"])
            await wait_until_async(lambda: malformed, 5.0, "the malformed message")
            # A connection that speaks no ZMTP is closed and counted; the server goes on.
            reader, writer = await asyncio.open_connection("127.0.0.1", int(addr.rsplit(":", 1)[1]))
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
            await asyncio.wait_for(reader.read(), 5.0)  # the server closes it
            writer.close()
            cli.send(addr, b"still served")
            await wait_until_async(lambda: len(got) == 2, 5.0, "the next frame")
            return {
                "got": [(f, s) for _, f, s in got],
                "replies": cli_replies,
                "refused": dict(server.refused),
                "admitted": security.zap.admitted[DOMAIN_PEERS],
            }
        finally:
            raw.close()
            for client, _ in clients:
                client.close()
            for pool in pools:
                pool.close_all()
            server.close()
            security.close()

    out = run_with_context(main)
    assert [(m, node_of(u)) for m, u in out["got"]] == [
        (b"from cli", "cli"),
        (b"still served", "cli"),
    ]
    assert out["replies"] == [b"to cli"]
    assert out["refused"].get("greeting") == 1
    assert out["admitted"] == 2  # cli through the pool, and the raw socket with cli's key


def test_a_LoopPeerClient_under_CURVE_reaches_a_libzmq_ROUTER_and_a_stranger_does_not(
    tmp_path: Path,
) -> None:
    keys = _keys(tmp_path)

    async def main(ctx: zmq.Context) -> dict[str, Any]:
        security = _security(ctx, tmp_path, keys["srv"], lambda addr: None)
        server = ZmqPeerServer(
            ctx,
            message_bytes_max=BYTES_MAX,
            serve_curve=lambda sock: security.serve(sock, DOMAIN_PEERS),
        )
        got: list[tuple[bytes, bytes, str]] = []
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append((i, f, s)), lambda: None)
        clients = {}
        for name in ("stranger", "cli"):
            replies: list[bytes] = []
            client = LoopPeerClient(
                message_bytes_max=BYTES_MAX, curve=_loop_curve(keys[name], keys["srv"])
            )
            client.start(lambda a, frames, replies=replies: replies.extend(frames))
            clients[name] = (client, replies)
        try:
            clients["stranger"][0].send(addr, b"from a stranger")
            assert security.zap is not None
            await wait_until_async(
                lambda: security.zap.refused[(DOMAIN_PEERS, "unknown_key")], 5.0, "a refusal"
            )
            cli, cli_replies = clients["cli"]
            big = bytes(range(256)) * 1000
            cli.send(addr, b"from cli")
            cli.send(addr, big)
            await wait_until_async(lambda: len(got) == 2, 5.0, "cli's frames")
            for reply in (b"to cli", big):
                assert server.send(got[0][0], reply)
            server.flush()
            await wait_until_async(lambda: len(cli_replies) == 2, 5.0, "the replies")
            return {
                "got": [(f, s) for _, f, s in got],
                "replies": cli_replies,
                "stranger_failed": clients["stranger"][0].failed,
                "big": big,
            }
        finally:
            for client, _ in clients.values():
                client.close()
            server.close()
            security.close()

    out = run_with_context(main)
    assert [(m, node_of(u)) for m, u in out["got"]] == [(b"from cli", "cli"), (out["big"], "cli")]
    assert out["replies"] == [b"to cli", out["big"]]
    assert out["stranger_failed"].get("refused", 0) >= 1  # libzmq's ERROR reached it


def test_a_LoopPeerClient_with_the_wrong_server_key_sends_nothing(tmp_path: Path) -> None:
    """A server that cannot open HELLO (it does not hold the key the client was given)
    gets no frame: the client's queue is never written to it."""
    keys = _keys(tmp_path)

    async def main() -> tuple[list[bytes], dict[str, int]]:
        got: list[bytes] = []
        server = LoopPeerServer(
            message_bytes_max=BYTES_MAX,
            curve=PeerCurve(
                z85.decode(keys["stranger"].public),
                z85.decode(keys["stranger"].secret),
                authorize=lambda key, address: "cli",
            ),
        )
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        client = LoopPeerClient(
            message_bytes_max=BYTES_MAX, curve=_loop_curve(keys["cli"], keys["srv"])
        )
        client.start(lambda a, frames: None)
        try:
            client.send(addr, b"secret")
            await wait_until_async(lambda: server.refused, 5.0, "the refused handshake")
            await asyncio.sleep(0.2)
            return got, dict(server.refused)
        finally:
            client.close()
            server.close()

    got, refused = asyncio.run(main())
    assert got == [] and refused == {"crypto": refused["crypto"]}


def test_bind_gives_the_resolved_endpoint_and_a_taken_port_fails() -> None:
    server = LoopPeerServer(message_bytes_max=BYTES_MAX)
    addr = server.bind("tcp://127.0.0.1:0")
    port = int(addr.rsplit(":", 1)[1])
    assert addr == f"tcp://127.0.0.1:{port}" and port > 0
    other = LoopPeerServer(message_bytes_max=BYTES_MAX)
    try:
        other.bind(addr)
        raise AssertionError("a second bind to a taken port succeeded")
    except OSError:
        pass
    finally:
        server.close()
        other.close()
    probe = socket.socket()
    probe.bind(("127.0.0.1", port))  # closed: the port is free again
    probe.close()
