"""PeerLinks, the forwarder's DEALER sockets, against a real ROUTER on loopback."""

from __future__ import annotations

import asyncio

import zmq

from gossipd.config import FanoutConfig
from gossipd.core.messages import Forward, Task
from gossipd.dispatch import DispatchStatistics
from gossipd.peerlinks import PeerLinks
from gossipd.rpc import peer_items


def _forward(req: int) -> Forward:
    task = Task(v=1, id=f"t{req}", prompt="p", reply_to="tcp://127.0.0.1:1")
    return Forward(req=req, src="a", task=task, remaining_ms=1000)


def test_PeerLinks_sends_a_turns_first_forward_at_once_under_light_load() -> None:
    """Under light load a turn's first forward leaves without waiting for the end of the
    turn (the hop's latency); the forwards that follow it in the same turn go as one
    PeerBatch, and after a busy turn the whole next turn is batched."""
    config = FanoutConfig()

    async def main(ctx: zmq.Context) -> tuple[list[int], int, list[int]]:
        router = ctx.socket(zmq.ROUTER)
        addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        links = PeerLinks(config, ctx=ctx, stats=DispatchStatistics(), on_reply=lambda m: None)

        def reqs() -> list[int]:
            if not router.poll(2000):
                return []
            items = peer_items(router.recv_multipart()[1], config.message_bytes_max)
            return [item.req for item in items if isinstance(item, Forward)]

        try:
            async with asyncio.TaskGroup() as tg:
                links.start(tg)
                for req in range(1, 5):  # one turn: no await in between
                    links.send(addr, _forward(req))
                first = reqs()  # still inside the turn: the loop does not run
                before_turn_end = router.poll(100)
                await asyncio.sleep(0)  # the turn ends: the batch goes
                rest = reqs()
                # Under load (the last turn sent several) even a turn's first forward waits.
                links.send(addr, _forward(5))
                busy_before_turn_end = router.poll(100)
                await asyncio.sleep(0)
                rest += [0, *reqs()]
                # That turn had one forward: light load again, the next one leaves at once.
                links.send(addr, _forward(6))
                rest += [0, *reqs()]
                links.stop()
        finally:
            links.close()
        return first, before_turn_end + busy_before_turn_end, rest

    ctx = zmq.Context()
    try:
        first, before_turn_end, rest = asyncio.run(main(ctx))
    finally:
        ctx.destroy(linger=0)
    assert first == [1]
    assert before_turn_end == 0
    assert rest == [2, 3, 4, 0, 5, 0, 6]
