"""The peer channel contract (gossipd/peerchannel.py), one suite run against both
implementations: ``ZmqPeerClient`` / ``ZmqPeerServer`` on real loopback sockets under an
asyncio loop, ``LoopPeerClient`` / ``LoopPeerServer`` (gossipd/looppeer.py) on loopback with
and without CURVE, and ``SimPeerClient`` / ``SimPeerServer`` (simulations/peerchannel.py) on the
simulator's virtual-time network.

Invariants: a frame sent arrives once, with an identity that is the same for every frame of
one connection and differs between connections; replies to that identity reach the client
that sent, in order, and two clients' replies do not cross; a send to an address nobody
binds neither blocks nor raises and holds up nothing else; sends after close raise
TransportClosed; a burst arrives complete and in order when nothing is lost; a reply to an
identity whose connection has gone is refused at once and counted; an idle connection closes
unless kept, and the next send makes a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import uvloop
import zmq
from nacl.bindings import crypto_box_keypair

from gossipd.errors import TransportClosed
from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.peerchannel import PeerClient, PeerServer, ZmqPeerClient, ZmqPeerServer
from gossipd.security import DOMAIN_PEERS, Security, load_key_pair, node_of, write_key_pair
from gossipd.sockets import SocketKind, SocketPool
from gossipd.tools.launcher import free_tcp_port
from gossipd.zmtp import PeerCurve
from simulations.netsim import NetworkModel, SimNetwork
from simulations.peerchannel import SimPeerClient, SimPeerServer
from tests.helpers import run_with_context, wait_until_async

BURST = 1000
REPLY_BURST = 500  # within the ROUTER's default SNDHWM (1000): no loss configured
BYTES_MAX = 1 << 20


@dataclass
class Served:
    """A started server and what reached it: (identity, frame, sender), in arrival order."""

    server: PeerServer
    addr: str
    got: list[tuple[bytes, bytes, str]] = field(default_factory=list)
    malformed: list[None] = field(default_factory=list)

    def on_request(self, identity: bytes, frame: bytes, sender: str) -> None:
        self.got.append((identity, frame, sender))

    def frames(self) -> list[bytes]:
        return [frame for _, frame, _ in self.got]


@dataclass
class Connected:
    """A started client and what came back to it: (server address, frame)."""

    client: PeerClient
    got: list[tuple[str, bytes]] = field(default_factory=list)

    def on_replies(self, addr: str, frames: list[bytes]) -> None:
        self.got.extend((addr, frame) for frame in frames)

    def frames(self) -> list[bytes]:
        return [frame for _, frame in self.got]


class Net(Protocol):
    """What a contract test needs from one implementation's world."""

    def new_client(self, name: str) -> PeerClient: ...

    def new_server(self, name: str) -> PeerServer: ...

    def bind_addr(self) -> str: ...

    def nowhere(self) -> str: ...

    def sender_of(self, name: str) -> str: ...

    def now(self) -> float: ...

    async def wait_for(self, done: Callable[[], bool], what: str) -> None: ...

    def close(self) -> None: ...


class ZmqNet:
    """Each client is a node of its own: its own socket pool (one PEER user a pool)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.pools: list[SocketPool] = []
        self.closing: list[PeerClient | PeerServer] = []

    def new_client(self, name: str) -> PeerClient:
        pool = SocketPool(self.ctx)
        client = ZmqPeerClient(pool)
        self.pools.append(pool)
        self.closing.append(client)
        return client

    def new_server(self, name: str) -> PeerServer:
        server = ZmqPeerServer(self.ctx, message_bytes_max=BYTES_MAX)
        self.closing.append(server)
        return server

    def bind_addr(self) -> str:
        return "tcp://127.0.0.1:0"

    def nowhere(self) -> str:
        return f"tcp://127.0.0.1:{free_tcp_port()}"

    def sender_of(self, name: str) -> str:
        return ""  # no CURVE: nobody is authenticated

    def now(self) -> float:
        return time.monotonic()  # the socket pool's clock

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        await wait_until_async(done, 5.0, what)

    def close(self) -> None:
        for part in self.closing:
            part.close()
        for pool in self.pools:
            pool.close_all()


class LoopNet:
    """The loop's channel (gossipd/looppeer.py) on loopback, NULL or CURVE: under CURVE each
    client has a key pair of its own and the server knows each client's key by its name."""

    def __init__(self, curve: bool) -> None:
        self.curve = curve
        self.closing: list[PeerClient | PeerServer] = []
        self.server_public, self.server_secret = crypto_box_keypair()
        self.names: dict[bytes, str] = {}  # client key -> name

    def new_client(self, name: str) -> PeerClient:
        curve = None
        if self.curve:
            public, secret = crypto_box_keypair()
            self.names[public] = name
            curve = PeerCurve(public, secret, server_key=lambda addr: self.server_public)
        client = LoopPeerClient(message_bytes_max=BYTES_MAX, curve=curve)
        self.closing.append(client)
        return client

    def new_server(self, name: str) -> PeerServer:
        curve = None
        if self.curve:
            curve = PeerCurve(
                self.server_public,
                self.server_secret,
                authorize=lambda key, address: self.names.get(key),
            )
        server = LoopPeerServer(message_bytes_max=BYTES_MAX, curve=curve)
        self.closing.append(server)
        return server

    def bind_addr(self) -> str:
        return "tcp://127.0.0.1:0"

    def nowhere(self) -> str:
        return f"tcp://127.0.0.1:{free_tcp_port()}"

    def sender_of(self, name: str) -> str:
        return name if self.curve else ""

    def now(self) -> float:
        return time.monotonic()  # the client's clock

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        await wait_until_async(done, 5.0, what)

    def close(self) -> None:
        for part in self.closing:
            part.close()


class SimNet:
    """Latency spread wide (sigma 1.5), so that frames on one path would overtake each other
    if the network did not keep them in order."""

    def __init__(self) -> None:
        self.network = SimNetwork(seed=5, model=NetworkModel(latency_sigma=1.5))

    def new_client(self, name: str) -> PeerClient:
        return SimPeerClient(self.network, name)

    def new_server(self, name: str) -> PeerServer:
        return SimPeerServer(self.network, name)

    def bind_addr(self) -> str:
        return ""

    def nowhere(self) -> str:
        return "sim://nobody/rpc"

    def sender_of(self, name: str) -> str:
        return name  # the network knows who sent

    def now(self) -> float:
        return self.network.now

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        self.network.run_until_idle()
        assert done(), f"the network went idle before {what}"

    def close(self) -> None:
        pass


def serve(net: Net, name: str) -> Served:
    server = net.new_server(name)
    served = Served(server, server.bind(net.bind_addr()))
    server.start(served.on_request, lambda: served.malformed.append(None))
    return served


def connect(net: Net, name: str) -> Connected:
    connected = Connected(net.new_client(name))
    connected.client.start(connected.on_replies)
    return connected


def reply(served: Served, identity: bytes, frames: list[bytes]) -> None:
    for frame in frames:
        assert served.server.send(identity, frame)
    served.server.flush()


Body = Callable[[Net], Coroutine[Any, Any, None]]


def _run(kind: str, body: Body) -> None:
    if kind == "zmq":

        async def main(ctx: zmq.Context) -> None:
            net = ZmqNet(ctx)
            try:
                await body(net)
            finally:
                net.close()

        run_with_context(main)
    elif kind.startswith("loop"):

        async def on_loop() -> None:
            net = LoopNet(curve=kind == "loop_curve")
            try:
                await body(net)
            finally:
                net.close()

        uvloop.run(on_loop())
    else:
        asyncio.run(body(SimNet()))


KINDS = ["zmq", "sim", "loop", "loop_curve"]


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_a_frame_arrives_once_with_its_connections_identity(kind: str) -> None:
    async def body(net: Net) -> None:
        served = serve(net, "s")
        a, b = connect(net, "a"), connect(net, "b")
        assert a.client.send(served.addr, b"a1")
        await net.wait_for(lambda: len(served.got) == 1, "the first frame")
        assert a.client.send(served.addr, b"a2")
        assert b.client.send(served.addr, b"b1")
        await net.wait_for(lambda: len(served.got) >= 3, "three frames")
        # Markers after what came before on each connection: nothing else is on its way.
        a.client.send(served.addr, b"a-end")
        b.client.send(served.addr, b"b-end")
        await net.wait_for(lambda: len(served.got) >= 5, "the markers")
        by_frame = {frame: (identity, sender) for identity, frame, sender in served.got}
        assert sorted(served.frames()) == [b"a-end", b"a1", b"a2", b"b-end", b"b1"]
        assert by_frame[b"a1"][0] == by_frame[b"a2"][0] == by_frame[b"a-end"][0]
        assert by_frame[b"b1"][0] != by_frame[b"a1"][0]
        assert by_frame[b"a1"][1] == net.sender_of("a")
        assert by_frame[b"b1"][1] == net.sender_of("b")
        assert served.malformed == []

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_replies_reach_the_sending_client_in_order(kind: str) -> None:
    async def body(net: Net) -> None:
        served, a = serve(net, "s"), connect(net, "a")
        a.client.send(served.addr, b"request")
        await net.wait_for(lambda: bool(served.got), "the request")
        identity = served.got[0][0]
        replies = [b"reply %03d" % i for i in range(200)]
        reply(served, identity, replies)
        await net.wait_for(lambda: len(a.got) >= len(replies), "200 replies")
        assert a.got == [(served.addr, r) for r in replies]

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_two_clients_replies_do_not_cross(kind: str) -> None:
    async def body(net: Net) -> None:
        served = serve(net, "s")
        a, b = connect(net, "a"), connect(net, "b")
        a.client.send(served.addr, b"from a")
        b.client.send(served.addr, b"from b")
        await net.wait_for(lambda: len(served.got) == 2, "both requests")
        identity = {frame: identity for identity, frame, _ in served.got}
        for i in range(20):
            reply(served, identity[b"from a"], [b"to a %d" % i])
            reply(served, identity[b"from b"], [b"to b %d" % i])
        await net.wait_for(lambda: len(a.got) >= 20 and len(b.got) >= 20, "both clients")
        # A last reply to each after the rest: had one crossed, it has arrived by then.
        reply(served, identity[b"from a"], [b"end"])
        reply(served, identity[b"from b"], [b"end"])
        await net.wait_for(lambda: a.frames()[-1:] == b.frames()[-1:] == [b"end"], "the ends")
        assert a.frames() == [b"to a %d" % i for i in range(20)] + [b"end"]
        assert b.frames() == [b"to b %d" % i for i in range(20)] + [b"end"]

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_send_to_an_address_nobody_binds_neither_blocks_nor_raises(
    kind: str,
) -> None:
    async def body(net: Net) -> None:
        served, a = serve(net, "s"), connect(net, "a")
        nowhere = net.nowhere()
        started = time.monotonic()
        results = [a.client.send(nowhere, b"lost %d" % i) for i in range(100)]
        elapsed_s = time.monotonic() - started
        assert all(isinstance(r, bool) for r in results)
        assert elapsed_s < 0.5, f"100 sends to nowhere took {elapsed_s:.3f} s"
        # The dead address holds nothing up: the same client's frame to a live one arrives.
        assert a.client.send(served.addr, b"live")
        await net.wait_for(lambda: served.frames() == [b"live"], "the frame to the live server")

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_sends_and_bind_after_close_raise_TransportClosed(kind: str) -> None:
    async def body(net: Net) -> None:
        served, a = serve(net, "s"), connect(net, "a")
        assert a.client.send(served.addr, b"before")
        await net.wait_for(lambda: bool(served.got), "the frame")
        identity = served.got[0][0]
        a.client.close()
        a.client.close()  # closing again does nothing
        with pytest.raises(TransportClosed):
            a.client.send(served.addr, b"after")
        served.server.close()
        served.server.close()
        with pytest.raises(TransportClosed):
            served.server.send(identity, b"after")
        with pytest.raises(TransportClosed):
            served.server.bind(net.bind_addr())

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_bursts_arrive_complete_and_in_order(kind: str) -> None:
    async def body(net: Net) -> None:
        served, a = serve(net, "s"), connect(net, "a")
        assert a.client.send(served.addr, b"connect")
        await net.wait_for(lambda: served.frames() == [b"connect"], "the first frame")
        identity = served.got.pop()[0]
        frames = [b"burst %04d" % i for i in range(BURST)]
        assert all([a.client.send(served.addr, frame) for frame in frames])  # one loop turn
        await net.wait_for(lambda: len(served.got) >= BURST, f"{BURST} frames")
        assert served.frames() == frames
        assert {i for i, _, _ in served.got} == {identity}
        replies = [b"reply %04d" % i for i in range(REPLY_BURST)]
        reply(served, identity, replies)  # one loop turn
        await net.wait_for(lambda: len(a.got) >= REPLY_BURST, f"{REPLY_BURST} replies")
        assert a.frames() == replies

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_a_reply_to_a_connection_that_has_gone_is_dropped_and_counted(
    kind: str,
) -> None:
    async def body(net: Net) -> None:
        served, a, b = serve(net, "s"), connect(net, "a"), connect(net, "b")
        a.client.send(served.addr, b"from a")
        b.client.send(served.addr, b"from b")
        await net.wait_for(lambda: len(served.got) == 2, "both requests")
        identity = {frame: identity for identity, frame, _ in served.got}
        gone = identity[b"from a"]
        a.client.close()
        # ZeroMQ learns of the closed connection a moment later: until then a reply may
        # still be accepted (and lost).
        await net.wait_for(lambda: not served.server.send(gone, b"late"), "a refused reply")
        dropped = served.server.dropped
        started = time.monotonic()
        refused = [served.server.send(gone, b"late %d" % i) for i in range(100)]
        elapsed_s = time.monotonic() - started
        assert refused == [False] * 100 and served.server.dropped == dropped + 100
        assert elapsed_s < 0.5, f"100 refused replies took {elapsed_s:.3f} s"
        assert not served.server.send(b"never-a-connection", b"x")  # nor one never known
        # The other connection is untouched.
        reply(served, identity[b"from b"], [b"to b"])
        await net.wait_for(lambda: b.frames() == [b"to b"], "the reply to b")
        assert a.got == []

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_PeerChannel_close_idle_closes_unkept_idle_connections_and_a_send_reconnects(
    kind: str,
) -> None:
    async def body(net: Net) -> None:
        served, a = serve(net, "s"), connect(net, "a")
        a.client.send(served.addr, b"first")
        await net.wait_for(lambda: len(served.got) == 1, "the first frame")
        assert len(a.client) == 1
        assert a.client.close_idle(net.now(), 5.0, keep=lambda addr: False) == 0  # recent
        later = net.now() + 10.0
        assert a.client.close_idle(later, 5.0, keep=lambda addr: addr == served.addr) == 0
        assert a.client.close_idle(later, 5.0, keep=lambda addr: False) == 1
        assert len(a.client) == 0
        a.client.send(served.addr, b"again")
        await net.wait_for(lambda: len(served.got) == 2, "the frame on a new connection")
        (first, _, _), (again, _, _) = served.got
        assert first != again, "a new connection, a new identity"
        reply(served, again, [b"answer"])
        await net.wait_for(lambda: a.frames() == [b"answer"], "the reply on it")

    _run(kind, body)


# -- the simulated channel beyond the contract ---------------------------------------------


def test_SimPeerChannel_a_partition_loses_frames_both_ways_until_healed() -> None:
    network = SimNetwork(seed=3)
    served = Served(SimPeerServer(network, "s"), "")
    served.addr = served.server.bind("")
    served.server.start(served.on_request, lambda: None)
    a = Connected(SimPeerClient(network, "a"))
    a.client.start(a.on_replies)
    a.client.send(served.addr, b"before")
    network.run_until_idle()
    identity = served.got[0][0]
    network.partition([["a"], ["s"]])
    assert a.client.send(served.addr, b"across")  # accepted, then lost
    assert served.server.send(identity, b"back across")
    network.run_until_idle()
    assert (served.frames(), a.got) == ([b"before"], [])
    network.heal()
    a.client.send(served.addr, b"healed")
    served.server.send(identity, b"back healed")
    network.run_until_idle()
    assert served.frames() == [b"before", b"healed"]
    assert a.frames() == [b"back healed"]


def test_SimPeerServer_holds_frames_until_started() -> None:
    network = SimNetwork(seed=4)
    server = SimPeerServer(network, "s")
    addr = server.bind("")
    a = Connected(SimPeerClient(network, "a"))
    a.client.start(a.on_replies)
    a.client.send(addr, b"early")
    network.run_until_idle()
    got: list[bytes] = []
    server.start(lambda identity, frame, sender: got.append(frame), lambda: None)
    assert got == [b"early"]


# -- ZeroMQ only -----------------------------------------------------------------------------


def test_ZmqPeerServer_counts_a_message_of_several_parts_as_malformed() -> None:
    async def main(ctx: zmq.Context) -> tuple[list[None], list[bytes]]:
        server = ZmqPeerServer(ctx, message_bytes_max=BYTES_MAX)
        served = Served(server, server.bind("tcp://127.0.0.1:0"))
        server.start(served.on_request, lambda: served.malformed.append(None))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(served.addr)
        try:
            dealer.send_multipart([b"one", b"two"])
            dealer.send(b"whole")
            await wait_until_async(lambda: served.got, 5.0, "the one-part message")
            return served.malformed, served.frames()
        finally:
            dealer.close()
            server.close()

    malformed, frames = run_with_context(main)
    assert malformed == [None] and frames == [b"whole"]


def test_ZmqPeerServer_under_CURVE_gives_the_senders_key_node_and_refuses_unknown_keys(
    tmp_path: Path,
) -> None:
    """The owner's peer_allowed needs the node a frame's key belongs to (User-Id, from the
    ZAP handler): here a client with ``cli``'s key is ``cli``; one whose key is in no
    directory never gets a frame through."""
    _, server_secret = write_key_pair("srv", tmp_path / "own")
    _, client_secret = write_key_pair("cli", tmp_path / "own")
    _, stranger_secret = write_key_pair("stranger", tmp_path / "own")
    (tmp_path / "peers").mkdir()
    (tmp_path / "producers").mkdir()
    (tmp_path / "peers" / "cli.key").write_bytes((tmp_path / "own" / "cli.key").read_bytes())
    server_keys = load_key_pair(server_secret)

    async def main(ctx: zmq.Context) -> tuple[list[tuple[bytes, bytes, str]], list[bytes]]:
        security = Security(
            curve=True,
            ctx=ctx,
            key_pair=server_keys,
            peer_keys_dir=str(tmp_path / "peers"),
            producer_keys_dir=str(tmp_path / "producers"),
        )
        security.start()
        server = ZmqPeerServer(
            ctx,
            message_bytes_max=BYTES_MAX,
            serve_curve=lambda sock: security.serve(sock, DOMAIN_PEERS),
        )
        served = Served(server, server.bind("tcp://127.0.0.1:0"))
        server.start(served.on_request, lambda: None)
        pools, clients = [], []
        for secret in (client_secret, stranger_secret):
            keys = load_key_pair(secret)
            pool = SocketPool(ctx)
            pool.set_curve(
                SocketKind.PEER,
                public=keys.public,
                secret=keys.secret,
                route=lambda addr: (addr, server_keys.public),
            )
            connected = Connected(ZmqPeerClient(pool))
            connected.client.start(connected.on_replies)
            pools.append(pool)
            clients.append(connected)
        cli, stranger = clients
        try:
            stranger.client.send(served.addr, b"from a stranger")
            assert security.zap is not None
            await wait_until_async(lambda: sum(security.zap.refused.values()), 5.0, "a refusal")
            cli.client.send(served.addr, b"from cli")
            await wait_until_async(lambda: served.got, 5.0, "cli's frame")
            reply(served, served.got[0][0], [b"to cli"])
            await wait_until_async(lambda: cli.got, 5.0, "the reply")
            return served.got, cli.frames()
        finally:
            for connected in clients:
                connected.client.close()
            for pool in pools:
                pool.close_all()
            server.close()
            security.close()

    got, replies = run_with_context(main)
    assert [(frame, node_of(sender)) for _, frame, sender in got] == [(b"from cli", "cli")]
    assert replies == [b"to cli"]


class _Buggy(Served):
    def on_request(self, identity: bytes, frame: bytes, sender: str) -> None:
        if frame.startswith(b"bug"):
            raise RuntimeError("the server's handler has a bug")
        super().on_request(identity, frame, sender)


@pytest.mark.parametrize("kind", ["zmq", "loop", "loop_curve"])
def test_PeerServer_a_frame_whose_handler_raises_leaves_the_frames_read_with_it_handled(
    kind: str,
) -> None:
    """A bug in the handler of one frame is counted (gossipd_handler_failures_total) and the
    frames after it, in the same burst, still reach the handler (the simulator raises: it
    is there to find such bugs)."""
    from gossipd.ops.logs import HANDLER_FAILURES

    before = sum(HANDLER_FAILURES.values())

    async def body(net: Net) -> None:
        server = net.new_server("s")
        served = _Buggy(server, server.bind(net.bind_addr()))
        server.start(served.on_request, lambda: served.malformed.append(None))
        a = connect(net, "a")
        assert a.client.send(served.addr, b"connect")
        await net.wait_for(lambda: served.frames() == [b"connect"], "the first frame")
        frames = [b"bug" if i % 10 == 3 else b"f%03d" % i for i in range(100)]
        assert all([a.client.send(served.addr, frame) for frame in frames])  # one turn
        await net.wait_for(lambda: len(served.got) >= 91, "the 90 good frames")
        assert served.frames()[1:] == [f for f in frames if f != b"bug"]

    _run(kind, body)
    assert sum(HANDLER_FAILURES.values()) - before == 10
