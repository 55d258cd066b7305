"""The loop peer channel (looppeer.py, peerlink.py) under a member's key rotation, a peer that
PINGs and never reads, and strangers that never finish their handshake.  Real sockets on
loopback, real CURVE (a security review's reproductions, made tests)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils import z85

import gossipd.peerlink as peerlink
from gossipd.clock import SYSTEM_CLOCK
from gossipd.core.gossip_messages import GpuState
from gossipd.core.membership import Member, State
from gossipd.core.messages import Result, encode
from gossipd.http.answers import Answers
from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.security import DOMAIN_PEERS, Security, load_key_pair, node_of, write_key_pair
from gossipd.zmtp import PeerCurve, command, encode_metadata, frame_header, greeting
from tests.test_clock_steps import _service


def _curve_security(
    tmp_path: Path, names: tuple[str, ...], installed: dict[str, str]
) -> tuple[zmq.Context, Security, dict[str, tuple[Any, Path]]]:
    """Key pairs for ``names`` (each: its KeyPair and public key file); ``installed``: the
    peer key files (NODE -> the name whose public key it holds), the first name's pair
    serving.  A Security over them, in a new context (close both after)."""
    keys = {}
    for name in names:
        public, secret = write_key_pair(name, tmp_path / "own")
        keys[name] = (load_key_pair(secret), public)
    peers = tmp_path / "peers"
    peers.mkdir()
    (tmp_path / "producers").mkdir()
    for node, name in installed.items():
        (peers / f"{node}.key").write_bytes(keys[name][1].read_bytes())
    ctx = zmq.Context()
    security = Security(
        curve=True,
        ctx=ctx,
        key_pair=keys[names[0]][0],
        peer_keys_dir=str(peers),
        producer_keys_dir=str(tmp_path / "producers"),
    )
    return ctx, security, keys


def test_a_connection_made_with_a_members_replaced_key_is_refused_from_then_on(
    tmp_path: Path,
) -> None:
    """A member's key replaced (rotated after a compromise), or removed and issued anew:
    messages on a connection the old key had opened were still taken as that member's (the
    check was by node name); a new connection with the old key was refused already."""
    ctx, security, pairs = _curve_security(
        tmp_path, ("srv", "old", "new"), {"srv": "srv", "cli": "old"}
    )
    peers = tmp_path / "peers"
    verdicts: list[tuple[bytes, str, bool]] = []

    async def main() -> None:
        security.start()
        server = LoopPeerServer(message_bytes_max=1 << 20, curve=security.loop_peer_curve())
        addr = server.bind("tcp://127.0.0.1:0")

        def on_request(identity: bytes, frame: bytes, sender: str) -> None:
            # the owner's check of each item (fanout/owner.py _on_peer_frame)
            verdicts.append((frame, node_of(sender), security.peer_allowed(sender, "cli", "rpc")))

        server.start(on_request, lambda: None)
        old = pairs["old"][0]
        client = LoopPeerClient(
            message_bytes_max=1 << 20,
            curve=PeerCurve(
                z85.decode(old.public),
                z85.decode(old.secret),
                server_key=lambda a: z85.decode(pairs["srv"][0].public),
            ),
        )
        client.start(lambda a, f: None)

        async def sent(frame: bytes) -> None:
            n = len(verdicts) + 1
            client.send(addr, frame)
            for _ in range(250):
                if len(verdicts) >= n:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{frame!r} never arrived")

        try:
            await sent(b"before")
            (peers / "cli.key").write_bytes(pairs["new"][1].read_bytes())  # rotated
            assert security.reload(force=True)
            await sent(b"rotated")
            (peers / "cli.key").unlink()  # revoked...
            security.reload(force=True)
            await sent(b"revoked")
            (peers / "cli.key").write_bytes(pairs["new"][1].read_bytes())  # ...and issued anew
            security.reload(force=True)
            await sent(b"issued anew")
        finally:
            client.close()
            server.close()

    try:
        asyncio.run(main())
    finally:
        security.close()
        ctx.term()
    assert verdicts == [
        (b"before", "cli", True),
        (b"rotated", "cli", False),
        (b"revoked", "cli", False),
        (b"issued anew", "cli", False),
    ]
    assert security.counters.revoked_messages[DOMAIN_PEERS] == 3


def test_a_peer_that_pings_and_never_reads_gets_no_pong_past_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PINGs one a segment from a peer that reads nothing: each PONG went to the transport
    whatever it held unsent, past the connection's bound on unsent bytes (replies are
    refused there), and the server's memory grew without end.  Now a PING finds no PONG
    while more than PONG_UNSENT_MAX waits.  The server's kernel buffer is made small so
    that user space fills within the test."""
    made = peerlink.PeerLink.connection_made

    def small_buffer(self: peerlink.PeerLink, transport: Any) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, transport)

    monkeypatch.setattr(peerlink.PeerLink, "connection_made", small_buffer)
    pings = 40_000
    ping = command(b"PING", b"\x00\x00" + b"c" * 16)

    async def main() -> int:
        server = LoopPeerServer(message_bytes_max=1 << 20, curve=None)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        server.start(lambda i, f, s: None, lambda: None)
        done = threading.Event()
        attacker = socket.socket()
        attacker.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never reads

        def attack() -> None:
            attacker.connect(("127.0.0.1", port))
            ready = command(b"READY", encode_metadata({b"Socket-Type": b"DEALER"}))
            attacker.sendall(greeting(b"NULL", False) + ready)
            for i in range(pings):
                attacker.sendall(ping)
                if i % 4 == 0:
                    time.sleep(0)
            done.set()

        thread = threading.Thread(target=attack)
        thread.start()
        try:
            while not done.is_set():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            [link] = server._links.values()
            return link.unsent()
        finally:
            thread.join()
            attacker.close()
            server.close()

    unsent = asyncio.run(main())
    pong_bytes = len(ping)  # (a PONG is as long as its PING here: context echoed)
    assert pings * pong_bytes > 10 * peerlink.PONG_UNSENT_MAX  # (what it would have held)
    assert unsent <= peerlink.PONG_UNSENT_MAX + pong_bytes


def test_strangers_shaking_hands_do_not_spend_the_members_read_budget() -> None:
    """At the smallest fanout.message_bytes_max (4096: a 64 KiB budget for frames not
    complete yet), 16 connections that sent a greeting and most of a 4 KiB frame, and no
    key, filled the budget shared with the members: a member's frame that came in two
    reads then closed its connection as busy."""

    async def main() -> tuple[list[int], dict[str, int], int]:
        server = LoopPeerServer(message_bytes_max=4096, curve=None)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        got: list[int] = []
        server.start(lambda i, f, s: got.append(len(f)), lambda: None)
        loop = asyncio.get_running_loop()
        member = socket.socket()
        member.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(member, ("127.0.0.1", port))
        ready = command(b"READY", encode_metadata({b"Socket-Type": b"DEALER"}))
        await loop.sock_sendall(member, greeting(b"NULL", False) + ready)
        strangers = []
        try:
            for _ in range(16):
                s = socket.socket()
                strangers.append(s)
                await loop.sock_connect(s, ("127.0.0.1", port))
                partial = bytes((0x06,)) + (4096).to_bytes(8, "big") + b"x" * 4000
                await loop.sock_sendall(s, greeting(b"NULL", False) + partial)
            await asyncio.sleep(0.3)
            held = server.read_budget.held
            frame = frame_header(0, 3000) + b"y" * 3000
            await loop.sock_sendall(member, frame[:1500])
            await asyncio.sleep(0.1)
            await loop.sock_sendall(member, frame[1500:])
            for _ in range(100):
                if got:
                    break
                await asyncio.sleep(0.02)
            return got, dict(server.refused), held
        finally:
            for s in [*strangers, member]:
                s.close()
            server.close()

    got, refused, held = asyncio.run(main())
    assert got == [3000] and not refused.get("busy")
    assert held < 4096  # the strangers' 64,000 bytes not counted


def test_connections_that_break_the_protocol_by_the_hundred_log_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each connection that broke the protocol logged a warning of its own: a stranger (no
    key needed) looping connect, junk, close wrote thousands of lines a second, and
    journald's rate limit then dropped the daemon's real ones.  Now the lines are bounded by
    log.refused_lines_per_s (the counters count all)."""

    async def main() -> dict[str, int]:
        server = LoopPeerServer(message_bytes_max=4096, curve=None, refused_lines_per_s=2.0)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        server.start(lambda i, f, s: None, lambda: None)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(100):
                s = socket.socket()
                await loop.sock_connect(s, ("127.0.0.1", port))
                await loop.sock_sendall(s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 40)
                s.close()
            for _ in range(200):
                if sum(server.refused.values()) >= 100:
                    break
                await asyncio.sleep(0.02)
            return dict(server.refused)
        finally:
            server.close()

    with caplog.at_level("WARNING", logger="gossipd.looppeer"):
        refused = asyncio.run(main())
    assert sum(refused.values()) == 100, refused
    lines = [r for r in caplog.records if r.getMessage() == "closed a peer connection"]
    assert 1 <= len(lines) <= 10 + 2  # the burst, and what 2 a second adds while it runs


def test_one_host_shaking_hands_by_the_hundred_leaves_room_for_the_members() -> None:
    """256 connections that never finish their handshake (no key needed: a greeting costs
    nothing) took every handshake slot a server has, for their 5 s each and again after: no
    member could open a connection to it.  Now one host gets 32 at once; a member from
    another address shakes hands and is heard, and the host gets its slots back as its
    connections end."""
    from gossipd.looppeer import HANDSHAKES_MAX, HANDSHAKES_PER_HOST_MAX

    async def main() -> tuple[list[bytes], int, list[bool]]:
        server = LoopPeerServer(message_bytes_max=4096, curve=None)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        got: list[bytes] = []
        server.start(lambda i, f, s: got.append(f), lambda: None)
        loop = asyncio.get_running_loop()
        strangers: list[socket.socket] = []

        async def member(source: str, text: bytes) -> socket.socket:
            sock = socket.socket()
            sock.bind((source, 0))
            await loop.sock_connect(sock, ("127.0.0.1", port))
            ready = command(b"READY", encode_metadata({b"Socket-Type": b"DEALER"}))
            await loop.sock_sendall(sock, greeting(b"NULL", False) + ready)
            await loop.sock_sendall(sock, frame_header(0, len(text)) + text)
            return sock

        async def heard(text: bytes) -> bool:
            for _ in range(150):
                if text in got:
                    return True
                await asyncio.sleep(0.02)
            return False

        try:
            for _ in range(HANDSHAKES_MAX):
                s = socket.socket()
                strangers.append(s)
                s.bind(("127.0.0.1", 0))
                await loop.sock_connect(s, ("127.0.0.1", port))
            for _ in range(100):
                if server.busy >= HANDSHAKES_MAX - HANDSHAKES_PER_HOST_MAX:
                    break
                await asyncio.sleep(0.02)
            busy = server.busy
            other = await member("127.0.0.2", b"from another host")
            ok = [await heard(b"from another host")]
            for s in strangers:  # their slots come back
                s.close()
            strangers.clear()
            await asyncio.sleep(0.2)
            same = await member("127.0.0.1", b"from the strangers' host")
            ok.append(await heard(b"from the strangers' host"))
            other.close()
            same.close()
            return got, busy, ok
        finally:
            for s in strangers:
                s.close()
            server.close()

    got, busy, ok = asyncio.run(main())
    assert busy == HANDSHAKES_MAX - HANDSHAKES_PER_HOST_MAX  # the rest refused at once
    assert ok == [True, True], got


def test_the_gossip_service_gives_an_address_two_live_members_claim_to_nobody() -> None:
    """Member m gossips Meta(b, rpc = m's own rpc address).  node_at, which names the key a
    connection to an address must prove, gave the first claimant in the table: b's
    Forwards then went to m keyed with m's key (the table's order decided which).  Now the
    address is nobody's while both claim it, and b's again once its own Meta wins."""
    ctx = zmq.Context()
    service = _service(ctx, "x", [], SYSTEM_CLOCK)

    async def case() -> None:  # (the transport reads on the running loop)
        service.bind()
        assert service.core is not None
        table = service.core.table
        for node, rpc in (("m", "tcp://10.0.0.1:7950"), ("b", "tcp://10.0.0.1:7950")):
            table.members[node] = Member(
                node=node,
                addr=f"tcp://10.0.0.{1 if node == 'm' else 2}:7946",
                incarnation=1,
                state=State.ALIVE,
                state_since=0.0,
                gpu=GpuState(rpc=rpc),
            )
        table.addr_changes += 1
        assert service.node_at("tcp://10.0.0.1:7950") is None
        assert service.addresses_ambiguous == 1
        assert service.node_at("tcp://10.0.0.2:7946") == "b"
        table.members["b"].gpu = GpuState(rpc="tcp://10.0.0.2:7950")
        table.addr_changes += 1
        assert service.node_at("tcp://10.0.0.1:7950") == "m"
        assert service.node_at("tcp://10.0.0.2:7950") == "b"

    try:
        asyncio.run(case())
    finally:
        service.transport.close()
        ctx.destroy(linger=0)


def test_a_peers_user_id_names_its_node_whatever_the_node_id_holds(tmp_path: Path) -> None:
    """A peer's User-Id is "NODE KEY".  Read at its first space, the node of "a b KEY" was
    "a": member "a b" could speak as "a", have "a"'s door replies relayed to it, and its
    own messages were all refused.  And a message naming the whole User-Id as its source is
    no node's."""
    names = ("srv", "a", "a b")
    ctx, security, pairs = _curve_security(tmp_path, names, {n: n for n in names})
    keys = {name: pair for name, (pair, _) in pairs.items()}
    try:
        assert security.peers is not None
        spaced = security.peers.user_id(keys["a b"].public)
        assert spaced is not None and node_of(spaced) == "a b"
        assert security.peer_allowed(spaced, "a b", "rpc")
        assert not security.peer_allowed(spaced, "a", "rpc")
        assert not security.peer_allowed(spaced, spaced, "rpc")
        assert security.is_peers_key("a b", keys["a b"].public.decode())
        assert not security.is_peers_key("a", keys["a b"].public.decode())
    finally:
        security.close()
        ctx.term()


def test_the_http_doors_reply_socket_refuses_a_member_whose_key_was_replaced(
    tmp_path: Path,
) -> None:
    """The door's reply PULL (CURVE, the members' domain) read every frame that came: a
    member key removed or replaced went on delivering Results on a connection it had open,
    though PROTOCOL.md says such messages are refused.  It reads each frame's User-Id now.
    Results for no waiting request are counted as unknown: that is how a frame read shows."""
    ctx, security, keys = _curve_security(
        tmp_path, ("door", "owner", "owner-new"), {"door": "door", "owner": "owner"}
    )
    peers = tmp_path / "peers"
    answers = Answers(
        node="door",
        cancel=lambda task_id: None,
        stream_buffer_bytes_max=1 << 20,
        request_timeout_s=10.0,
        clock=SYSTEM_CLOCK,
    )

    async def main() -> tuple[int, int]:
        security.start()
        reply_to = answers.bind(
            ctx,
            "tcp://127.0.0.1:*",
            lambda sock: security.serve(sock, DOMAIN_PEERS),
            security.peer_key_allowed,
        )
        answers.start_receiving()
        owner = ctx.socket(zmq.PUSH)
        owner.setsockopt(zmq.LINGER, 0)
        owner.curve_publickey = keys["owner"][0].public
        owner.curve_secretkey = keys["owner"][0].secret
        owner.curve_serverkey = keys["door"][0].public
        owner.connect(reply_to)
        try:
            owner.send(encode(Result(id="gone-1", ok=True, text="a")))
            for _ in range(250):
                if answers.counters.replies_unknown:
                    break
                await asyncio.sleep(0.02)
            before = answers.counters.replies_unknown
            (peers / "owner.key").write_bytes(keys["owner-new"][1].read_bytes())  # replaced
            assert security.reload(force=True)
            owner.send(encode(Result(id="gone-2", ok=True, text="b")))
            for _ in range(50):
                if security.counters.revoked_messages[DOMAIN_PEERS]:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            return before, answers.counters.replies_unknown
        finally:
            owner.close()
            answers.close()

    try:
        before, after = asyncio.run(main())
    finally:
        security.close()
        ctx.term()
    assert before == 1 and after == 1  # read while the key stood, refused once replaced
    assert security.counters.revoked_messages[DOMAIN_PEERS] == 1


def test_a_disconnect_hint_goes_to_the_live_member_at_the_address_not_a_dead_old_name() -> None:
    """A daemon renamed and restarted on the same port: the old name, dead, stays in the
    table (24 h), listed first.  The hint of a dropped connection to that address went to
    the dead name, and the live member got no early probe."""
    ctx = zmq.Context()
    service = _service(ctx, "x", [], SYSTEM_CLOCK)

    async def case() -> None:
        service.bind()
        assert service.core is not None
        members = service.core.table.members
        for node, state in (("old-name", State.DEAD), ("new-name", State.ALIVE)):
            members[node] = Member(node=node, addr="tcp://10.0.0.1:7946", incarnation=1,
                                   state=state, state_since=0.0)  # fmt: skip
        probed: list[str] = []
        service.core.connection_lost = lambda now, node: probed.append(node)  # type: ignore[method-assign]
        service._on_disconnect("tcp://10.0.0.1:7946")
        assert probed == ["new-name"] and service.disconnect_hints == 1

    try:
        asyncio.run(case())
    finally:
        service.transport.close()
        ctx.destroy(linger=0)
