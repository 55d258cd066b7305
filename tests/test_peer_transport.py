"""``fanout.peer_transport`` in real daemons and the loop client's own rules.

- Two daemons under CURVE, one on libzmq's channel ("zmq") and one on the loop's ("loop"),
  forward to each other through their HTTP doors: the wire is the same, so a rolling
  upgrade that mixes them loses nothing.
- A connection to the rpc port that speaks no ZMTP is closed and counted
  (``gossipd_fanout_peer_protocol_errors_total``) and the daemon goes on forwarding.
- LoopPeerClient: no connection while the member's key is unknown; ``close_rekeyed``
  reconnects once it is known or changed; a connection not yet up holds at most
  ``queue_max`` frames; one closed while it connects sends nothing.
- LoopPeerServer: at most HANDSHAKES_MAX connections shake hands at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from typing import Any

import pytest
from nacl.bindings import crypto_box_keypair

from gossipd import looppeer
from gossipd.core.ring import Ring
from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.ops import tcpdefaults
from gossipd.ops.scrape import scrape
from gossipd.tools.bench.http_peers import wait_serving
from gossipd.tools.launcher import free_tcp_port
from gossipd.zmtp import PeerCurve
from simulations.cluster import Cluster
from tests.helpers import wait_until, wait_until_async

BODY = json.dumps({"model": "echo", "prompt": "hello world", "max_tokens": 2}).encode()


def _complete(url: str, key: str) -> tuple[int, str]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=BODY,
        headers={"Content-Type": "application/json", "x-session-id": key},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.headers.get("x-gossipd-member", "")


def test_a_zmq_daemon_and_a_loop_daemon_forward_to_each_other_under_CURVE(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ports = [free_tcp_port() for _ in range(2)]
    transports = ["zmq", "loop"]
    cluster = Cluster(
        2,
        log_dir=str(tmp_path),
        curve=True,
        extra_overrides=['engine.kind="echo"', 'journal.path=""', 'metrics.bind="127.0.0.1:0"'],
        overrides_for=lambda i: [
            f'http.bind="127.0.0.1:{ports[i]}"',
            f'fanout.peer_transport="{transports[i]}"',
        ],
    )
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [f"k{i}" for i in range(40)]
    served: list[tuple[int, str, str]] = []  # (door, key's owner, member that ran it)
    try:
        cluster.start(timeout_s=60)
        cluster.wait_converged(30)
        cluster.wait_meta(30)
        for url in urls:
            wait_serving(url, 30, headers={"x-session-id": "warm"})
        for door, url in enumerate(urls):
            for key in keys:
                status, member = _complete(url, key)
                assert status == 200
                served.append((door, ring.owner(key), member))
        # Each door forwarded some of its requests, and each ran where its key said.
        assert all(member == owner for _, owner, member in served), served
        for door in (0, 1):
            owners = {owner for d, owner, _ in served if d == door}
            assert owners == {"d00", "d01"}, f"door {door} served keys of {owners} only"
        forwarded = sum(
            scrape(d.metrics_port).get("gossipd_fanout_forwarded_total", 0.0)
            for d in cluster.daemons
        )
        assert forwarded >= sum(1 for d, owner, _ in served if owner != f"d{d:02d}")
    finally:
        cluster.stop()


def test_a_connection_that_speaks_no_ZMTP_is_counted_and_the_daemon_keeps_forwarding(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    port = free_tcp_port()
    cluster = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=['engine.kind="echo"', 'journal.path=""', 'metrics.bind="127.0.0.1:0"'],
        overrides_for=lambda i: [f'http.bind="127.0.0.1:{port}"'] if i == 0 else [],
    )
    url = f"http://127.0.0.1:{port}"
    ring = Ring({"d00": 1.0, "d01": 1.0})
    key = next(k for k in (f"k{i}" for i in range(100)) if ring.owner(k) == "d01")
    try:
        cluster.start(timeout_s=60)
        cluster.wait_converged(30)
        cluster.wait_meta(30)
        owner = cluster.daemons[1]
        rpc_port = Cluster._port_of(owner, "fanout.rpc_bind")
        with socket.create_connection(("127.0.0.1", rpc_port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
            s.settimeout(5)
            while s.recv(4096):  # until the daemon closes it
                pass
        metric = "gossipd_fanout_peer_protocol_errors_total"
        wait_until(lambda: scrape(owner.metrics_port).get(metric, 0) >= 1, 10, metric)
        wait_serving(url, 30, headers={"x-session-id": key})
        assert _complete(url, key) == (200, "d01")
    finally:
        cluster.stop()


def test_LoopPeerClient_waits_for_a_key_and_reconnects_when_close_rekeyed_finds_it() -> None:
    server_public, server_secret = crypto_box_keypair()
    client_public, client_secret = crypto_box_keypair()
    known: dict[str, bytes] = {}

    async def main() -> None:
        got: list[bytes] = []
        server = LoopPeerServer(
            message_bytes_max=1 << 16,
            curve=PeerCurve(server_public, server_secret, authorize=lambda key, a: "cli"),
        )
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        client = LoopPeerClient(
            message_bytes_max=1 << 16,
            curve=PeerCurve(client_public, client_secret, server_key=known.get),
        )
        client.start(lambda a, frames: None)
        try:
            assert client.send(addr, b"before the key")  # queued: no key, no connection
            await asyncio.sleep(0.3)
            assert got == [] and client.unknown_keys == 1
            assert client.close_rekeyed(unknown_only=True) == 0  # still unknown: kept
            known[addr] = server_public
            assert client.close_rekeyed(unknown_only=True) == 1  # found: closed (and what
            assert client.send(addr, b"with the key")  # it held with it), a new one made
            await wait_until_async(lambda: got == [b"with the key"], 5.0, "the frame")
            assert client.close_rekeyed(unknown_only=True) == 0  # opened with a known key
            known[addr] = crypto_box_keypair()[0]  # the member's key replaced
            assert client.close_rekeyed() == 1
            assert client.send(addr, b"to the old key")  # the server cannot open HELLO
            await wait_until_async(lambda: server.refused.get("crypto"), 5.0, "a refusal")
            assert got == [b"with the key"]
        finally:
            client.close()
            server.close()

    asyncio.run(main())


def test_LoopPeerClient_holds_at_most_queue_max_frames_for_a_connection_not_up() -> None:
    async def main() -> tuple[list[bool], int]:
        client = LoopPeerClient(message_bytes_max=1 << 16, queue_max=5)
        client.start(lambda a, frames: None)
        try:
            nowhere = f"tcp://127.0.0.1:{free_tcp_port()}"
            return [client.send(nowhere, b"f%d" % i) for i in range(7)], client.dropped
        finally:
            client.close()

    sent, dropped = asyncio.run(main())
    assert sent == [True] * 5 + [False] * 2 and dropped == 2


def test_a_client_closed_while_it_connects_sends_nothing_and_leaves_no_connection() -> None:
    async def main() -> tuple[list[bytes], int]:
        got: list[bytes] = []
        server = LoopPeerServer(message_bytes_max=1 << 16)
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        client = LoopPeerClient(message_bytes_max=1 << 16)
        client.start(lambda a, frames: None)
        try:
            client.send(addr, b"queued before the close")
            client.close()  # the connect is still in flight
            probe = LoopPeerClient(message_bytes_max=1 << 16)
            probe.start(lambda a, frames: None)
            probe.send(addr, b"a later client's")  # a marker: it arrives after anything sent
            await wait_until_async(lambda: got, 5.0, "the later client's frame")
            probe.close()
            await asyncio.sleep(0.1)
            # Nothing left of the closed client: no connection up, none half made.
            return got, len(server._links) + len(server._shaking)
        finally:
            server.close()

    got, links = asyncio.run(main())
    assert got == [b"a later client's"] and links == 0


def test_a_server_lets_at_most_HANDSHAKES_MAX_connections_shake_hands_at_once(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(looppeer, "HANDSHAKES_MAX", 2)

    async def main() -> tuple[dict[str, int], bytes]:
        server = LoopPeerServer(message_bytes_max=1 << 16)
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: None, lambda: None)
        port = int(addr.rsplit(":", 1)[1])
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            rest = await asyncio.wait_for(reader.read(), 5.0)  # closed at once: b""
            return dict(server.refused), rest
        finally:
            for _, w in [*held, (reader, writer)]:
                w.close()
            server.close()

    refused, rest = asyncio.run(main())
    assert refused == {"busy": 1} and rest == b""


async def _null_handshake(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A DEALER's ZMTP NULL handshake with the server, over a raw connection."""
    from gossipd.zmtp import ZmtpConnection

    zmtp = ZmtpConnection(
        as_server=False, socket_type=b"DEALER", peer_types=(b"ROUTER",), frame_bytes_max=1 << 20
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(zmtp.data_to_send())
    while not zmtp.ready:
        zmtp.receive(await asyncio.wait_for(reader.read(4096), 5.0))
        writer.write(zmtp.data_to_send())
    await writer.drain()
    return reader, writer


def test_a_servers_connections_hold_a_bounded_number_of_bytes_of_unfinished_frames() -> None:
    """Each connection may hold up to a frame's bound of a frame not complete yet; together
    they hold at most the server's read budget.  The connection that goes over is closed
    (busy), and the budget comes back as connections close or finish their frames."""
    from gossipd.zmtp import frame_header

    async def main() -> tuple[list[bytes], int, int, dict[str, int], int]:
        got: list[bytes] = []
        server = LoopPeerServer(message_bytes_max=1 << 20, read_bytes_max=100_000)
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        port = int(addr.rsplit(":", 1)[1])
        conns = [await _null_handshake(port) for _ in range(3)]
        budget = server.read_budget
        try:
            first, second, third = conns
            first[1].write(frame_header(0, 60_000) + b"a" * 50_000)  # 50,009 bytes held
            await wait_until_async(lambda: budget.held > 50_000, 5.0, "the first held")
            for _, writer in (second, third):  # each would take the total over 100,000
                writer.write(frame_header(0, 60_000) + b"b" * 50_000)
            for reader, _ in (second, third):
                assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed
            held_after = budget.held
            first[1].write(b"a" * 10_000)  # the first's frame completes: delivered
            await wait_until_async(lambda: got, 5.0, "the first's frame")
            assert server.busy == 2  # (what gossipd_fanout_peer_connections_busy_total reads)
            return got, held_after, budget.held, dict(server.refused), budget.over
        finally:
            for _, writer in conns:
                writer.close()
            server.close()

    got, held_after, held_end, refused, over = asyncio.run(main())
    assert [len(f) for f in got] == [60_000]
    assert held_after == 50_009 and held_end == 0
    assert refused == {"busy": 2} and over == 2


def test_past_the_read_budget_the_connection_holding_the_most_is_closed_not_the_reader() -> None:
    """A client that parks most of a frame (one that never completes) must not get the
    other connections closed: when a read takes the total past the budget, the one holding
    the most goes, and the reader's frame completes."""
    from gossipd.zmtp import frame_header

    async def main() -> tuple[list[int], dict[str, int], bytes]:
        got: list[bytes] = []
        server = LoopPeerServer(message_bytes_max=1 << 20, read_bytes_max=100_000)
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        port = int(addr.rsplit(":", 1)[1])
        parker, member = [await _null_handshake(port) for _ in range(2)]
        budget = server.read_budget
        try:
            parker[1].write(frame_header(0, 200_000) + b"p" * 90_000)
            await wait_until_async(lambda: budget.held > 90_000, 5.0, "the parked bytes")
            member[1].write(frame_header(0, 30_000) + b"m" * 20_000)  # total past 100,000
            parked_end = await asyncio.wait_for(parker[0].read(), 5.0)  # closed
            member[1].write(b"m" * 10_000)
            await wait_until_async(lambda: got, 5.0, "the member's frame")
            return [len(f) for f in got], dict(server.refused), parked_end
        finally:
            for _, writer in (parker, member):
                writer.close()
            server.close()

    got, refused, parked_end = asyncio.run(main())
    assert got == [30_000] and refused == {"busy": 1} and parked_end == b""


def test_a_connection_that_holds_part_of_a_frame_and_sends_nothing_more_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slowloris: part of a frame, then silence, would hold its bytes of the read budget
    for ever.  Past PARTIAL_FRAME_IDLE_S without a byte it is closed ("stalled", counted
    with the server's bounds); one that trickles its frame in slowly is not."""
    from gossipd import peerlink
    from gossipd.zmtp import frame_header

    monkeypatch.setattr(peerlink, "PARTIAL_FRAME_IDLE_S", 0.3)

    async def main() -> tuple[bytes, list[int], dict[str, int], int, int]:
        got: list[bytes] = []
        server = LoopPeerServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(lambda i, f, s: got.append(f), lambda: None)
        port = int(addr.rsplit(":", 1)[1])
        silent, slow = [await _null_handshake(port) for _ in range(2)]
        try:
            silent[1].write(frame_header(0, 1000) + b"s" * 500)
            slow[1].write(frame_header(0, 1000))
            for _ in range(10):  # 1 s in all, a byte each 0.1 s: never 0.3 s without one
                await asyncio.sleep(0.1)
                slow[1].write(b"t" * 50)
            silent_end = await asyncio.wait_for(silent[0].read(), 5.0)
            slow[1].write(b"t" * 500)
            await wait_until_async(lambda: got, 5.0, "the slow frame")
            return (
                silent_end,
                [len(f) for f in got],
                dict(server.refused),
                server.busy,
                (server.read_budget.held),
            )
        finally:
            for _, writer in (silent, slow):
                writer.close()
            server.close()

    silent_end, got, refused, busy, held = asyncio.run(main())
    assert silent_end == b"" and got == [1000]
    assert refused == {"stalled": 1} and busy == 1 and held == 0


def test_a_peer_handler_that_raises_is_counted_by_name_and_exported_and_the_rest_go_on() -> None:
    """A bug in the handler of one frame (either side) is logged and counted in
    ``gossipd_handler_failures_total{handler}``; the connection and the frames after it go on."""
    from gossipd.ops.logs import HANDLER_FAILURES
    from gossipd.ops.metrics import handler_failures_metric

    class Owner:
        def __init__(self) -> None:
            self.got: list[bytes] = []

        def on_request(self, identity: bytes, frame: bytes, sender: str) -> None:
            if frame == b"bad":
                raise RuntimeError("an owner's bug")
            self.got.append(frame)
            server.send(identity, b"re:" + frame)

    class Forwarder:
        def __init__(self) -> None:
            self.got: list[bytes] = []

        def on_replies(self, addr: str, frames: list[bytes]) -> None:
            for frame in frames:
                if frame == b"re:also-bad":
                    raise RuntimeError("a forwarder's bug")
                self.got.append(frame)

    owner, forwarder = Owner(), Forwarder()
    server = LoopPeerServer(message_bytes_max=1 << 16)
    before = HANDLER_FAILURES.copy()

    async def main() -> None:
        addr = server.bind("tcp://127.0.0.1:0")
        server.start(owner.on_request, lambda: None)
        client = LoopPeerClient(message_bytes_max=1 << 16)
        client.start(forwarder.on_replies)
        try:
            for frame in (b"one", b"bad", b"two"):
                assert client.send(addr, frame)
            await wait_until_async(lambda: forwarder.got == [b"re:one", b"re:two"], 5.0, "two")
            assert client.send(addr, b"also-bad")
            # (a reply read is handed over whole: what came in the same read is the
            # handler's to lose, so the next frame goes once the failure is counted)
            await wait_until_async(
                lambda: HANDLER_FAILURES["Forwarder.on_replies"] > before["Forwarder.on_replies"],
                5.0,
                "the forwarder's failure",
            )
            assert client.send(addr, b"three")
            await wait_until_async(lambda: b"re:three" in forwarder.got, 5.0, "the third")
        finally:
            client.close()
            server.close()

    asyncio.run(main())
    assert owner.got == [b"one", b"two", b"also-bad", b"three"]
    assert forwarder.got == [b"re:one", b"re:two", b"re:three"]
    grown = HANDLER_FAILURES - before
    assert grown == {"Owner.on_request": 1, "Forwarder.on_replies": 1}
    samples = {s.labels["handler"]: s.value for s in handler_failures_metric().samples
               if s.name.endswith("_total")}  # fmt: skip
    assert samples["Owner.on_request"] >= 1 and samples["Forwarder.on_replies"] >= 1


def test_LoopPeerClient_bounds_the_connect_and_not_the_lookup_of_a_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connect not answered within tcpdefaults.CONNECT_TIMEOUT_S is given up (after a
    cut, SYN retransmissions 1, 2, 4 ... s apart kept a healed member unreachable), but a
    member named by host is looked up for as long as its resolver takes: a lookup slower
    than the bound, bounded with it, would never connect.  The slow resolver is a stand-in
    (the loop's getaddrinfo, delayed): no DNS server runs here."""
    monkeypatch.setattr(tcpdefaults, "CONNECT_TIMEOUT_S", 0.2)

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        resolve = loop.getaddrinfo

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.5)
            return await resolve(*args, **kwargs)

        loop.getaddrinfo = slow  # type: ignore[method-assign]
        server = LoopPeerServer(message_bytes_max=1 << 16)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        server.start(lambda identity, frame, sender: server.send(identity, frame), lambda: None)
        got: list[bytes] = []
        client = LoopPeerClient(message_bytes_max=1 << 16)
        client.start(lambda addr, frames: got.extend(frames))
        try:
            # localhost may name ::1 first, where nothing listens: the next address is tried
            client.send(f"tcp://localhost:{port}", b"by name")
            await wait_until_async(lambda: got, 10.0, "the echo through a slow lookup")
            return got
        finally:
            client.close()
            server.close()

    assert asyncio.run(main()) == [b"by name"]
