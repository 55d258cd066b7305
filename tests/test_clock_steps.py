"""A step of the host's wall clock (NTP setting it, a VM resumed) while a daemon runs: the
SWIM core's time is the wall clock at start advanced by the monotonic clock
(GossipService.now), so failure detection goes on as before.  Two GossipServices on real
ZeroMQ sockets on loopback; member "a"'s clock is stepped forward, then back, and "c" hangs
(its loop no longer answers, its port still open: no refusal to tell), which "a" must find
out by its probes alone."""

from __future__ import annotations

import asyncio
import random
import time

import zmq

from gossipd.config import load_config
from gossipd.core.membership import State
from gossipd.engines.echo import EchoEngine
from gossipd.membership.gossip import GossipService
from gossipd.sockets import SocketPool
from tests.helpers import run_with_context, wait_until_async


class SteppedClock:
    """The process's clocks, the wall clock offset by ``step_s`` (as a host's clock after
    a step); the monotonic clock never steps."""

    def __init__(self) -> None:
        self.step_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time() + self.step_s


def _service(ctx: zmq.Context, node: str, seeds: list[str], clock: SteppedClock) -> GossipService:
    config = load_config(
        environ={},
        overrides=["gossip.bind=tcp://127.0.0.1:0", f"gossip.seeds={seeds!r}"],
    )
    return GossipService(
        config,
        node=node,
        sockets=SocketPool(ctx),
        engine=EchoEngine(),
        ingress_endpoint="tcp://127.0.0.1:1",
        rng=random.Random(node),
        clock=clock,
    )


def test_a_wall_clock_step_neither_stops_failure_detection_nor_fires_it() -> None:
    async def main(ctx: zmq.Context) -> tuple[float, float]:
        clock = SteppedClock()
        a = _service(ctx, "a", [], clock)
        a_addr = a.bind()
        c = _service(ctx, "c", [a_addr], SteppedClock())
        c.bind()
        loop = asyncio.get_running_loop()
        runs = {s: loop.create_task(s.run_forever()) for s in (a, c)}
        try:
            assert a.core is not None
            table = a.core.table.members
            await wait_until_async(lambda: "c" in table, 10, "a to learn c")
            # Set forward ten minutes: every timer of the old clock was late at once.
            clock.step_s = 600.0
            await asyncio.sleep(3.0)  # three probe rounds
            assert table["c"].state is State.ALIVE
            # Set back twenty minutes: the old clock's timers were all twenty minutes away.
            clock.step_s = -600.0
            assert a.core.next_deadline() - a.now() < 2  # (a probe round at most)
            runs[c].cancel()  # c hangs: it reads datagrams, it answers none
            hung = time.monotonic()
            await wait_until_async(lambda: table["c"].state is State.DEAD, 20, "a to find c dead")
            return time.monotonic() - hung, a.now() - time.time()
        finally:
            for task in runs.values():
                task.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)
            for s in (a, c):
                s.close()

    took_s, off_s = run_with_context(main)
    assert took_s < 15  # (about a probe round, the deadline and the suspicion: 3-6 s)
    assert abs(off_s) < 1  # a's SWIM time is still the wall clock it started with


def test_membership_time_follows_the_monotonic_clock_from_the_wall_clock_at_start() -> None:
    class Clocks:
        mono, wall_s = 50.0, 1_700_000_000.0

        def monotonic(self) -> float:
            return self.mono

        def wall(self) -> float:
            return self.wall_s

    clocks = Clocks()
    ctx = zmq.Context()
    try:
        service = _service(ctx, "a", [], clocks)  # type: ignore[arg-type]
        assert service.now() == 1_700_000_000.0
        clocks.mono += 2.5
        clocks.wall_s -= 600.0  # stepped back
        assert service.now() == 1_700_000_002.5
        clocks.wall_s += 1_200.0  # stepped forward
        assert service.now() == 1_700_000_002.5
    finally:
        ctx.destroy(linger=0)
