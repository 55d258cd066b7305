"""SocketPool: per-kind options, the LRU bound, idle closing, and the close callback that
runs before every close (sockets connect to addresses nobody listens on: nothing is sent)."""

from __future__ import annotations

import time

import pytest
import zmq

from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.sockets import CloseReason, SocketKind, SocketPool
from tests.helpers import run_with_context, wait_until_async


def _addr(i: int) -> str:
    return f"tcp://127.0.0.1:{20000 + i}"


def _pool_with(
    ctx: zmq.Context, kind: SocketKind, closed: list[tuple[str, CloseReason]], **kwargs: object
) -> SocketPool:
    pool = SocketPool(ctx)
    pool.register(kind, on_close=lambda addr, reason: closed.append((addr, reason)), **kwargs)  # type: ignore[arg-type]
    return pool


# What each place set on its sockets before the pool (gossip.py, replysender.ReplySender,
# peerlinks.PeerLinks), written out by hand.
EXPECTED_OPTIONS = [
    (
        SocketKind.GOSSIP,
        {},
        zmq.PUSH,
        {
            zmq.SNDHWM: 64,
            zmq.LINGER: 0,
            zmq.RECONNECT_IVL: 100,
            zmq.RECONNECT_IVL_MAX: 2000,
            # A stalled connection is made anew after 2 s, a connect given up after 1 s
            # (issue 24: a healed member's datagrams waited on TCP's backoff for ~10 s).
            zmq.TCP_MAXRT: 2000,
            zmq.CONNECT_TIMEOUT: 1000,
        },
    ),
    (
        SocketKind.REPLY,
        {},
        zmq.PUSH,
        {zmq.IMMEDIATE: 1, zmq.SNDHWM: 256, zmq.RECONNECT_IVL: 100, zmq.LINGER: 0},
    ),
    (
        SocketKind.PEER,
        {zmq.MAXMSGSIZE: 4 * 1024 * 1024, zmq.RECONNECT_IVL_MAX: 1000},
        zmq.DEALER,
        {
            zmq.LINGER: 0,
            zmq.SNDHWM: 10_000,
            zmq.MAXMSGSIZE: 4 * 1024 * 1024,
            zmq.RECONNECT_IVL_MAX: 1000,
        },
    ),
]


@pytest.mark.parametrize(("kind", "added", "socket_type", "expected"), EXPECTED_OPTIONS)
def test_SocketPool_applies_each_kinds_options(
    kind: SocketKind, added: dict[int, int], socket_type: int, expected: dict[int, int]
) -> None:
    ctx = zmq.Context()
    try:
        pool = _pool_with(ctx, kind, [], options=added)
        sock = pool.open(kind, _addr(1))
        assert sock.getsockopt(zmq.TYPE) == socket_type
        assert {option: sock.getsockopt(option) for option in expected} == expected
        pool.close_all()
    finally:
        ctx.destroy(linger=0)


def test_SocketPool_evicts_the_least_recently_used_and_calls_back_before_closing() -> None:
    ctx = zmq.Context()
    closed: list[tuple[str, CloseReason]] = []
    open_at_callback: list[bool] = []
    try:
        pool = SocketPool(ctx)

        def on_close(addr: str, reason: CloseReason) -> None:
            closed.append((addr, reason))
            open_at_callback.append(not socks[addr].closed)

        pool.register(SocketKind.GOSSIP, on_close=on_close, sockets_max=3)
        socks = {_addr(i): pool.open(SocketKind.GOSSIP, _addr(i)) for i in range(3)}
        assert pool.touch(SocketKind.GOSSIP, _addr(0)) is socks[_addr(0)]  # 1 is now the LRU
        socks[_addr(3)] = pool.open(SocketKind.GOSSIP, _addr(3))
        assert closed == [(_addr(1), CloseReason.EVICTED)]
        assert open_at_callback == [True] and socks[_addr(1)].closed
        socks[_addr(4)] = pool.open(SocketKind.GOSSIP, _addr(4))
        assert closed[-1] == (_addr(2), CloseReason.EVICTED)
        stats = pool.statistics(SocketKind.GOSSIP)
        assert (stats.sockets_open, stats.opened, stats.evicted) == (3, 5, 2)
        assert pool.get(SocketKind.GOSSIP, _addr(1)) is None
        assert pool.touch(SocketKind.GOSSIP, _addr(1)) is None
        pool.close_all()
        assert sorted(a for a, r in closed if r is CloseReason.REQUESTED) == [
            _addr(0),
            _addr(3),
            _addr(4),
        ]
        with pytest.raises(TransportClosed):
            pool.open(SocketKind.GOSSIP, _addr(5))
    finally:
        ctx.destroy(linger=0)


def test_SocketPool_close_idle_closes_only_sockets_unused_for_idle_s_unless_kept() -> None:
    ctx = zmq.Context()
    closed: list[tuple[str, CloseReason]] = []
    try:
        pool = _pool_with(
            ctx, SocketKind.REPLY, closed, idle_s=10.0, keep=lambda addr: addr == _addr(2)
        )
        for i in range(3):
            pool.open(SocketKind.REPLY, _addr(i))
        now = time.monotonic()
        assert pool.close_idle(now + 5.0) == 0
        assert pool.close_idle(now + 11.0) == 2  # 2 is kept (its user still has a queue)
        assert sorted(closed) == [(_addr(0), CloseReason.IDLE), (_addr(1), CloseReason.IDLE)]
        # A kind without idle_s closes only on request, with the requester's rule.
        peer_closed: list[tuple[str, CloseReason]] = []
        pool.register(
            SocketKind.PEER, on_close=lambda addr, reason: peer_closed.append((addr, reason))
        )
        pool.open(SocketKind.PEER, _addr(7))
        assert pool.close_idle(now + 1e6) == 0 and peer_closed == []  # 2 still kept
        assert pool.close_idle(now + 1e6, SocketKind.PEER, idle_s=600.0) == 1
        assert peer_closed == [(_addr(7), CloseReason.IDLE)]
    finally:
        ctx.destroy(linger=0)


def test_SocketPool_sweep_closes_idle_sockets_on_the_loop() -> None:
    async def main(ctx: zmq.Context) -> list[tuple[str, CloseReason]]:
        closed: list[tuple[str, CloseReason]] = []
        pool = _pool_with(ctx, SocketKind.GOSSIP, closed, idle_s=0.2)
        pool.open(SocketKind.GOSSIP, _addr(1))
        pool.start()
        try:
            await wait_until_async(lambda: closed, 5.0, "the sweep")
        finally:
            pool.close_all()
        return closed

    assert run_with_context(main) == [(_addr(1), CloseReason.IDLE)]


def test_SocketPool_refuses_a_second_user_of_a_kind_and_a_second_socket_to_an_address() -> None:
    ctx = zmq.Context()
    try:
        pool = _pool_with(ctx, SocketKind.PEER, [])
        with pytest.raises(LocalProtocolError):
            pool.register(SocketKind.PEER, on_close=lambda addr, reason: None)
        pool.open(SocketKind.PEER, _addr(1))
        with pytest.raises(LocalProtocolError):
            pool.open(SocketKind.PEER, _addr(1))
        assert pool.close(SocketKind.PEER, _addr(1)) is True
        assert pool.close(SocketKind.PEER, _addr(1)) is False
        assert len(pool) == 0
    finally:
        ctx.destroy(linger=0)


def test_SocketPool_sweep_interval_follows_the_shortest_idle_s() -> None:
    ctx = zmq.Context()
    try:
        pool = SocketPool(ctx)
        assert pool.sweep_interval_s() == 10.0
        pool.register(SocketKind.GOSSIP, on_close=lambda a, r: None, idle_s=120.0)
        assert pool.sweep_interval_s() == 10.0  # 120 / 4 = 30, at most 10
        pool.register(SocketKind.REPLY, on_close=lambda a, r: None, idle_s=8.0)
        assert pool.sweep_interval_s() == 2.0
    finally:
        ctx.destroy(linger=0)
