"""The owner check (issue 17, docs/PROTOCOL.md "Fresh where placement looks"), at the owner's
real ROUTER: a Forward asking ``if_free`` is refused at once with ``saturated`` and the
owner's load while its engine is saturated, and never reaches admission; a plain Forward (or
one to an owner that is not saturated) is admitted as before."""

from __future__ import annotations

import asyncio

import zmq

from gossipd.config import FanoutConfig
from gossipd.core.admission import Verdict
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.messages import Task
from gossipd.core.peer_messages import Forward, ForwardReply, PeerBatch, decode_peer, encode_peer
from gossipd.fanout.owner import OwnerEndpoint, zmq_peer_server


class _Ingress:
    """A stand-in ingress whose intake admits every task (the owner calls ingress.intake)."""

    retry_after_ms = 200

    def __init__(self) -> None:
        self.admitted: list[str] = []
        self.intake = self

    def admit(self, task: Task, received_at: float, **_: object) -> Verdict:
        self.admitted.append(task.id)
        return Verdict.ADMIT


def _replies(data: bytes) -> list[ForwardReply]:
    msg = decode_peer(data, bytes_max=1 << 20)
    items = msg.items if isinstance(msg, PeerBatch) else [msg]
    return [m for m in items if isinstance(m, ForwardReply)]


def test_an_owner_refuses_if_free_forwards_while_saturated_with_its_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> tuple[list[ForwardReply], list[str], int]:
        ctx = zmq.Context()
        ingress = _Ingress()
        saturated = True
        record = LoadRecord("owner", 7, 0, 3, 12, 0, 40)
        config = FanoutConfig(rpc_bind=f"ipc://{tmp_path}/rpc", ack_delay_s=0.0)
        owner = OwnerEndpoint(
            config,
            server=zmq_peer_server(config, ctx),
            node="owner",
            ingress=ingress,  # type: ignore[arg-type]
            send_to_member=lambda member, done: None,
            on_peer_done=lambda done: None,
            saturated=lambda now: saturated,
            load_record=lambda: record,
        )
        endpoint = owner.bind()
        owner.start()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        replies: list[ForwardReply] = []
        try:
            for req, (if_free, now_saturated) in enumerate(
                [(True, True), (False, True), (True, False)], start=1
            ):
                saturated = now_saturated
                task = Task(v=1, id=f"t{req}", prompt="p", reply_to="tcp://127.0.0.1:9")
                forward = Forward(
                    req=req, src="entry", task=task, remaining_ms=5000, if_free=if_free
                )
                dealer.send(encode_peer(forward))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 5.0
                while len(replies) < req:
                    assert loop.time() < deadline, "no ForwardReply from the owner"
                    try:
                        replies.extend(_replies(dealer.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        await asyncio.sleep(0.005)
        finally:
            dealer.close()
            owner.close()
            ctx.term()
        return replies, ingress.admitted, owner.counters.refused_saturated

    replies, admitted, refused = asyncio.run(scenario())
    refusal, plain, free = replies
    assert refusal.req == 1 and not refusal.accepted and refusal.code == "saturated"
    assert refusal.load is not None and refusal.load.node == "owner" and refusal.load.waiting == 12
    assert plain.req == 2 and plain.accepted  # no if_free: admission alone decides
    assert free.req == 3 and free.accepted  # if_free, not saturated
    assert admitted == ["t2", "t3"] and refused == 1


def test_the_owner_reads_its_engine_itself_at_most_every_5_ms() -> None:
    """Not gossip's 1 s sample: the engine's own figures, one reading per burst, by the
    decisions' ``now`` (the placer core reads no clock)."""
    from gossipd.core.placer import Placer
    from gossipd.engines.base import EngineStats

    class _Engine:
        waiting = 0

        def stats(self) -> EngineStats:
            return EngineStats(waiting_requests=self.waiting)

    engine = _Engine()
    placer = Placer(
        FanoutConfig(engine_waiting_saturated=5),
        node="me",
        loads={},
        local_ids=set(),
        own_sample=engine.stats,
        own_sample_every_s=0.005,
    )
    assert placer.own_now(10.0).waiting_requests == 0  # type: ignore[union-attr]
    engine.waiting = 9
    assert not placer.own_engine_saturated(10.004)  # the same burst: the same reading
    assert placer.own_reads == 1
    assert placer.own_engine_saturated(10.006) and placer.own_reads == 2
