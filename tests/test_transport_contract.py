"""The ``Transport`` contract (gossipd/datagrams.py), one suite run against both
implementations: ``ZmqTransport`` on real loopback sockets under an asyncio loop, and
``SimTransport`` on the simulator's virtual-time network.

Invariants: a frame sent arrives once; frames from one transport to one address arrive in
the order sent; a send never blocks or raises for an address nobody listens on (and does not
hold up frames to other addresses); a send after close raises TransportClosed; a receiver
gets only the frames sent to it; a burst within the send queue's bound arrives complete and
in order when nothing is lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import pytest
import zmq

from gossipd.datagrams import Transport, ZmqTransport
from gossipd.errors import TransportClosed
from gossipd.looppull import LoopPullServer
from gossipd.sockets import SocketPool
from gossipd.tools.launcher import free_tcp_port
from simulations.netsim import NetworkModel, SimNetwork
from tests.helpers import push_until_held_back, run_with_context, wait_until_async

BURST = 1000


class Net(Protocol):
    """What a contract test needs from one implementation's world."""

    def new_transport(self, name: str) -> Transport: ...

    def bind(self, transport: Transport, into: list[bytes]) -> str: ...

    def nowhere(self) -> str: ...

    async def wait_for(self, done: Callable[[], bool], what: str) -> None: ...

    def close(self) -> None: ...


class ZmqNet:
    """Each transport is a node of its own: its own socket pool on one context.  The send
    queue holds a burst (SNDHWM over gossip's 64): that is "no loss configured" here.
    ``loop``: the bound side is the loop's PULL (gossip.receiver "loop"), else libzmq's."""

    def __init__(self, ctx: zmq.Context, *, loop: bool = False) -> None:
        self.ctx = ctx
        self.loop = loop
        self.pools: list[SocketPool] = []
        self.transports: list[ZmqTransport] = []

    def new_transport(self, name: str) -> Transport:
        pool = SocketPool(self.ctx)
        transport = ZmqTransport(
            pool, options={zmq.SNDHWM: 2 * BURST}, receiver=loop_receiver() if self.loop else None
        )
        self.pools.append(pool)
        self.transports.append(transport)
        return transport

    def bind(self, transport: Transport, into: list[bytes]) -> str:
        return transport.bind("tcp://127.0.0.1:0", into.append)

    def nowhere(self) -> str:
        return f"tcp://127.0.0.1:{free_tcp_port()}"

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        await wait_until_async(done, 5.0, what)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        for pool in self.pools:
            pool.close_all()


class SimNet:
    """Latency spread wide (sigma 1.5), so that frames on one path would overtake each other
    if the network did not keep them in order."""

    def __init__(self) -> None:
        self.network = SimNetwork(seed=5, model=NetworkModel(latency_sigma=1.5))

    def new_transport(self, name: str) -> Transport:
        return self.network.new_transport(name)

    def bind(self, transport: Transport, into: list[bytes]) -> str:
        return transport.bind("", into.append)

    def nowhere(self) -> str:
        return "sim://nobody"

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        self.network.run_until_idle()
        assert done(), f"the network went idle before {what}"

    def close(self) -> None:
        pass


Body = Callable[[Net], Coroutine[Any, Any, None]]


def loop_receiver(message_bytes_max: int = 1 << 20) -> LoopPullServer:
    return LoopPullServer(message_bytes_max=message_bytes_max)


def _run(kind: str, body: Body) -> None:
    if kind in ("zmq", "zmq-loop"):

        async def main(ctx: zmq.Context) -> None:
            net = ZmqNet(ctx, loop=kind == "zmq-loop")
            try:
                await body(net)
            finally:
                net.close()

        run_with_context(main)
    else:
        sim = SimNet()
        asyncio.run(body(sim))


KINDS = ["zmq", "zmq-loop", "sim"]


async def _quiesce(net: Net, sender: Transport, *targets: tuple[str, list[bytes]]) -> None:
    """Send a marker to each target after what came before and wait for them all: frames sent
    earlier on those paths have arrived by then (per-path order)."""
    for addr, _ in targets:
        sender.send(addr, b"marker")
    await net.wait_for(lambda: all(got[-1:] == [b"marker"] for _, got in targets), "markers")
    for _, got in targets:
        got.pop()


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_a_frame_sent_arrives_once(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b = net.new_transport("a"), net.new_transport("b")
        got: list[bytes] = []
        addr = net.bind(b, got)
        assert a.send(addr, b"hello") is True
        await net.wait_for(lambda: bool(got), "the frame")
        await _quiesce(net, a, (addr, got))
        assert got == [b"hello"]

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_keeps_the_order_of_frames_to_one_address(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b = net.new_transport("a"), net.new_transport("b")
        got: list[bytes] = []
        addr = net.bind(b, got)
        frames = [b"%d" % i for i in range(200)]
        for frame in frames:
            assert a.send(addr, frame)
        await net.wait_for(lambda: len(got) >= len(frames), "200 frames")
        assert got == frames

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_send_to_an_address_nobody_listens_on_neither_blocks_nor_raises(
    kind: str,
) -> None:
    async def body(net: Net) -> None:
        a, b = net.new_transport("a"), net.new_transport("b")
        got: list[bytes] = []
        addr = net.bind(b, got)
        nowhere = net.nowhere()
        started = time.monotonic()
        results = [a.send(nowhere, b"lost %d" % i) for i in range(100)]
        elapsed_s = time.monotonic() - started
        assert all(isinstance(r, bool) for r in results)
        assert elapsed_s < 0.5, f"100 sends to nowhere took {elapsed_s:.3f} s"
        # The dead address holds nothing up: a frame to a live one still arrives.
        assert a.send(addr, b"live")
        await net.wait_for(lambda: got == [b"live"], "the frame to the live address")

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_send_and_bind_after_close_raise_TransportClosed(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b = net.new_transport("a"), net.new_transport("b")
        addr = net.bind(b, [])
        assert a.send(addr, b"before")
        a.close()
        a.close()  # closing again does nothing
        with pytest.raises(TransportClosed):
            a.send(addr, b"after")
        with pytest.raises(TransportClosed):
            net.bind(a, [])

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_two_receivers_each_get_only_their_frames(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b, c = (net.new_transport(n) for n in "abc")
        got_b: list[bytes] = []
        got_c: list[bytes] = []
        addr_b, addr_c = net.bind(b, got_b), net.bind(c, got_c)
        assert addr_b != addr_c
        for i in range(20):
            a.send(addr_b, b"b%d" % i)
            a.send(addr_c, b"c%d" % i)
        await net.wait_for(lambda: len(got_b) >= 20 and len(got_c) >= 20, "both receivers")
        await _quiesce(net, a, (addr_b, got_b), (addr_c, got_c))
        assert got_b == [b"b%d" % i for i in range(20)]
        assert got_c == [b"c%d" % i for i in range(20)]

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_a_burst_of_1000_frames_arrives_complete_and_in_order(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b = net.new_transport("a"), net.new_transport("b")
        got: list[bytes] = []
        addr = net.bind(b, got)
        assert a.send(addr, b"connect")
        await net.wait_for(lambda: got == [b"connect"], "the first frame")
        got.clear()
        frames = [b"burst %04d" % i for i in range(BURST)]
        accepted = [a.send(addr, frame) for frame in frames]  # one loop turn
        assert all(accepted)
        await net.wait_for(lambda: len(got) >= BURST, f"{BURST} frames")
        assert got == frames

    _run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_Transport_a_receiver_that_closed_gets_nothing_more(kind: str) -> None:
    async def body(net: Net) -> None:
        a, b, c = (net.new_transport(n) for n in "abc")
        got_b: list[bytes] = []
        got_c: list[bytes] = []
        addr_b, addr_c = net.bind(b, got_b), net.bind(c, got_c)
        a.send(addr_b, b"first")
        await net.wait_for(lambda: got_b == [b"first"], "the first frame")
        b.close()
        a.send(addr_b, b"after close")  # accepted or not, never delivered
        a.send(addr_c, b"to c")
        await net.wait_for(lambda: got_c == [b"to c"], "the frame to c")
        assert got_b == [b"first"]

    _run(kind, body)


# -- the simulated network beyond the contract ---------------------------------------------


def _lossy_run(seed: int) -> tuple[list[bytes], int]:
    network = SimNetwork(seed=seed, model=NetworkModel(loss=0.3, latency_sigma=1.5))
    a, b = network.new_transport("a"), network.new_transport("b")
    got: list[bytes] = []
    addr = b.bind("", got.append)
    for i in range(500):
        a.send(addr, b"%03d" % i)
    network.run_until_idle()
    return got, network.lost


def test_SimNetwork_loses_frames_from_its_seed_and_keeps_the_rest_in_order() -> None:
    got, lost = _lossy_run(1)
    assert 100 < lost < 200 and len(got) + lost == 500
    assert got == sorted(got)  # in order, with gaps
    assert _lossy_run(1) == (got, lost), "the same seed gives the same run"
    assert _lossy_run(2)[0] != got, "another seed another"


def test_SimNetwork_partition_loses_frames_between_groups_until_healed() -> None:
    network = SimNetwork(seed=3)
    a, b, c = (network.new_transport(n) for n in "abc")
    got_b: list[bytes] = []
    got_c: list[bytes] = []
    addr_b, addr_c = b.bind("", got_b.append), c.bind("", got_c.append)
    network.partition([["a", "b"], ["c"]])
    a.send(addr_b, b"same side")
    a.send(addr_c, b"across")
    network.run_until_idle()
    assert (got_b, got_c) == ([b"same side"], [])
    network.heal()
    a.send(addr_c, b"healed")
    network.run_until_idle()
    assert got_c == [b"healed"]


def test_SimNetwork_refuses_sends_beyond_inflight_max() -> None:
    network = SimNetwork(seed=4, inflight_max=3)
    a, b = network.new_transport("a"), network.new_transport("b")
    got: list[bytes] = []
    addr = b.bind("", got.append)
    assert [a.send(addr, b"%d" % i) for i in range(5)] == [True, True, True, False, False]
    network.run_until_idle()
    assert got == [b"0", b"1", b"2"] and network.dropped_full == 2
    assert a.send(addr, b"again")  # the path drained


# -- ZeroMQ only -----------------------------------------------------------------------------


def test_ZmqTransport_reports_a_dropped_connection_and_counts_full_queue_drops() -> None:
    """A peer whose socket closes (as a killed process's would) is reported through
    on_disconnect, the hint gossip turns into an early probe.  With gossip's SNDHWM of 64, a
    burst to a peer that is not there fills the queue: send returns False and counts it."""

    async def main(ctx: zmq.Context) -> tuple[list[str], str, int, int]:
        lost: list[str] = []
        pool = SocketPool(ctx)
        a = ZmqTransport(pool, on_disconnect=lost.append)
        b = ZmqTransport(SocketPool(ctx))
        got: list[bytes] = []
        addr = b.bind("tcp://127.0.0.1:0", got.append)
        try:
            a.send(addr, b"hello")
            await wait_until_async(lambda: got == [b"hello"], 5, "the frame")
            b.close()  # its connection drops
            await wait_until_async(lambda: lost, 5, "the disconnect hint")
            nowhere = f"tcp://127.0.0.1:{free_tcp_port()}"
            accepted = sum(a.send(nowhere, b"x") for _ in range(100))
            return lost, addr, accepted, a.dropped
        finally:
            a.close()
            pool.close_all()

    lost, addr, accepted, dropped = run_with_context(main)
    assert lost[0] == addr
    assert accepted == 64 and dropped == 36


def test_ZmqTransport_send_to_an_address_ZeroMQ_refuses_is_a_dropped_send() -> None:
    """Gossip refuses such addresses as it decodes them; behind that, a send to one returns
    False and counts it (it raised ZMQError inside the daemon's task group)."""

    async def main(ctx: zmq.Context) -> tuple[list[bool], int, int]:
        pool = SocketPool(ctx)
        a = ZmqTransport(pool, on_disconnect=lambda addr: None)
        try:
            sent = [a.send(addr, b"x") for addr in ("tcp://127.0.0.1:5\n", "garbage-addr")]
            return sent, a.dropped, a.sent
        finally:
            a.close()
            pool.close_all()

    assert run_with_context(main) == ([False, False], 2, 0)


def _flood_while_stalled(receiver: LoopPullServer | None) -> tuple[int, int]:
    """A sender on a context and thread of its own pushes 64 KiB frames (SNDHWM 10) to a
    transport whose loop is stalled, until sends stop going out; -> (frames it got out, frames
    the transport handed over once the loop ran again)."""
    size, most = 64 * 1024, 2000

    async def main(ctx: zmq.Context) -> tuple[int, int]:
        got: list[bytes] = []
        transport = ZmqTransport(SocketPool(ctx), receiver=receiver)
        addr = transport.bind("tcp://127.0.0.1:0", got.append)
        sent: list[int] = []
        sender_ctx = zmq.Context()
        push = sender_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 10)
        push.setsockopt(zmq.LINGER, 0)

        def send_until_held_back() -> None:
            sent.append(push_until_held_back(push, b"x" * size, most))

        try:
            push.connect(addr)
            push.send(b"first")
            await wait_until_async(lambda: got == [b"first"], 5, "the connection")
            got.clear()
            sender = threading.Thread(target=send_until_held_back)
            sender.start()
            sender.join(30)  # the loop stalls here: nothing of ours reads meanwhile
            await wait_until_async(lambda: len(got) == sent[0], 10, "every frame sent")
            return sent[0], len(got)
        finally:
            push.close()
            sender_ctx.term()
            transport.close()

    return run_with_context(main)


def test_the_loop_receiver_holds_a_sender_back_while_its_loop_stalls_instead_of_queueing() -> None:
    """libzmq's PULL reads on in its I/O thread while the loop is busy, up to RCVHWM (10,000)
    frames a connection whatever their size: 625 MiB of these.  The loop's PULL reads only
    when the loop runs, so a stalled daemon holds what the kernel's socket buffers hold, and
    the sender's own queue fills instead (SNDHWM: its sends are refused).  Nothing is lost:
    every frame that went out arrives once the loop runs again."""
    sent, got = _flood_while_stalled(loop_receiver())
    assert sent == got
    # What the kernel may buffer on this host (the sender's and our socket buffers' most),
    # and the sender's SNDHWM of 10 frames with some to spare.
    kernel = sum(
        int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        for name in ("tcp_rmem", "tcp_wmem")
    )
    assert sent * 64 * 1024 <= kernel + 2 * 1024 * 1024, f"{sent} frames of 64 KiB went out"
