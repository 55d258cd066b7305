"""Push-pull in pages over real ZeroMQ sockets (two GossipServices on loopback): a member
table larger than the gossip message limit reaches a joiner, in pages, where one message
carrying it is refused by the receiver's socket, which closes the connection it came on
(counted: gossipd_gossip_connections_closed_total{reason="too_large"})."""

from __future__ import annotations

import asyncio
import random

import zmq

from gossipd.config import load_config
from gossipd.core.gossip_messages import Alive, GpuState, Meta, PushPull, encode_gossip
from gossipd.engines.echo import EchoEngine
from gossipd.membership.gossip import GossipService
from gossipd.sockets import SocketPool
from tests.helpers import run_with_context, wait_until_async

LIMIT_BYTES = 64 * 1024
MEMBERS = 120  # about 1.4 KB each with 256 prefixes: about 170 KB, 3 pages of 64 KiB


def service(ctx: zmq.Context, node: str, seeds: list[str]) -> GossipService:
    config = load_config(
        environ={},
        overrides=[
            "gossip.bind=tcp://127.0.0.1:0",
            f"gossip.seeds={seeds!r}",
            f"gossip.swim.message_bytes_max={LIMIT_BYTES}",
            # Nobody probes within the test: the made-up members stay alive everywhere.
            "gossip.swim.probe_interval_s=600",
            "gossip.swim.probe_deadline_s=1",
        ],
    )
    return GossipService(
        config,
        node=node,
        sockets=SocketPool(ctx),
        engine=EchoEngine(),
        ingress_endpoint="tcp://127.0.0.1:1",
        rng=random.Random(node),
    )


def fill(svc: GossipService) -> None:
    """MEMBERS made-up members, each with 256 prefix hashes."""
    assert svc.core is not None
    rng = random.Random(3)
    for i in range(MEMBERS):
        name = f"m{i:03d}"
        svc.core.table.apply(Alive(node=name, incarnation=0, addr=f"tcp://10.1.0.{i}:7946"), 0.0)
        gpu = GpuState(
            rpc=f"tcp://10.1.0.{i}:5558", prefixes=[rng.getrandbits(32) for _ in range(256)]
        )
        svc.core.table.apply(Meta(node=name, version=1, gpu=gpu), 0.0)


def test_a_table_over_the_message_limit_reaches_a_joiner_in_pages() -> None:
    async def main(ctx: zmq.Context) -> tuple[int, int, int, dict[str, int]]:
        a = service(ctx, "a", [])
        a_addr = a.bind()
        fill(a)
        b = service(ctx, "b", [a_addr])
        b.bind()
        tasks = [asyncio.get_running_loop().create_task(s.run_forever()) for s in (a, b)]
        try:
            assert b.core is not None and a.core is not None
            await wait_until_async(
                lambda: sum(len(m.prefixes) > 0 for m in b.core.table.members.values()) >= MEMBERS,
                10,
                "b to learn every member's GPU state",
            )
            learnt = b.core.table.members["m077"]
            expected = a.core.table.members["m077"]
            assert list(learnt.prefixes) == list(expected.prefixes)
            # A whole table in one message, as before: the receiver's socket refuses it.
            assert a.core is not None
            whole = encode_gossip(
                PushPull(**a.core.header([]), reply=False, members=a.core.table.records())
            )
            refused_before = b.core.stats.received.get("PushPull", 0)
            a.transport.send(b.advertise, whole)
            # The receiver closes the connection at the large one's head; a message the
            # sender had written behind it goes with that connection (libzmq does not send
            # it again), so the small one follows once the close is seen.
            await wait_until_async(
                lambda: b.transport.receive_refused.get("too_large"), 10, "the close"
            )
            a.transport.send(
                b.advertise, encode_gossip(PushPull(**a.core.header([]), reply=False, members=[]))
            )
            await wait_until_async(
                lambda: b.core.stats.received.get("PushPull", 0) > refused_before,
                10,
                "the small push-pull after the large one",
            )
            return (
                len(whole),
                b.core.stats.received.get("PushPull", 0) - refused_before,
                a.core.stats.push_pulls,
                dict(a.core.stats.sent),
            )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in (a, b):
                s.close()

    whole_bytes, received_after, exchanges, sent = run_with_context(main)
    assert whole_bytes > LIMIT_BYTES
    assert received_after == 1  # the large one never arrived; the small one did
    assert exchanges >= 1 and sent["PushPull"] >= 3  # the answer to b's join, in pages
