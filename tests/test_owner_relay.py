"""Forward.relay at the owner's real ROUTER (docs/PROTOCOL.md, Relay): a member's own door's
replies go back on its latest connection, each before its task's TaskDone; a route that is
not the asking member's own is never relayed; a Result sent from the results cache as the
Forward is admitted is relayed on that Forward's connection; what cannot go on the
connection (too large, or the connection gone) goes to the route's socket."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from gossipd.config import FanoutConfig
from gossipd.core.admission import Verdict
from gossipd.core.lifecycle import Owned
from gossipd.core.messages import Chunk, Result, Task, encode
from gossipd.core.peer_messages import (
    Forward,
    ForwardReply,
    PeerBatch,
    Relay,
    TaskDone,
    decode_peer,
    encode_peer,
)
from gossipd.fanout.owner import OwnerEndpoint, zmq_peer_server
from gossipd.replysender import ReplySender
from gossipd.sockets import SocketPool
from gossipd.zmqloop import recv_batch

KEYS = {"entry": "E" * 40, "mallory": "M" * 40}  # each member's (stand-in) public key


class _Ingress:
    """A stand-in ingress: admits every task, or answers one it has done from its cache."""

    retry_after_ms = 200

    def __init__(self, replies: ReplySender) -> None:
        self.intake = self
        self.runner = self
        self.replies = replies
        self.done: dict[str, bytes] = {}  # the results cache: task id -> its Result

    def admit(self, task: Task, received_at: float, **_: object) -> Verdict:
        cached = self.done.get(task.id)
        if cached is not None:
            self.replies.send(task.route, cached)
            return Verdict.DUPLICATE_DONE
        return Verdict.ADMIT

    def when_replies_sent(self, route: str, callback: Callable[[], None]) -> None:
        self.replies.when_sent(route, callback)


def _items(sock: zmq.Socket) -> list[Any]:
    msg = decode_peer(sock.recv(zmq.NOBLOCK), bytes_max=1 << 22)
    return list(msg.items) if isinstance(msg, PeerBatch) else [msg]


async def _until(sock: zmq.Socket, want: Callable[[list[Any]], bool]) -> list[Any]:
    got: list[Any] = []
    deadline = asyncio.get_running_loop().time() + 5.0
    while not want(got):
        assert asyncio.get_running_loop().time() < deadline, f"only {got}"
        try:
            got += _items(sock)
        except zmq.Again:
            await asyncio.sleep(0.005)
    return got


def _drain(sock: zmq.Socket) -> list[Any]:
    got: list[Any] = []
    while True:
        try:
            got += _items(sock)
        except zmq.Again:
            return got


def _kind(item: Any) -> str:
    if type(item) is Relay:
        return type(decode_relayed(item.frame)).__name__
    return type(item).__name__


def decode_relayed(frame: bytes) -> Any:
    from gossipd.core.codec import decode_replies

    (reply,) = decode_replies(frame)
    return reply


def test_relays_go_on_the_members_own_connection_before_the_taskdone_and_nowhere_else(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    async def scenario() -> dict[str, Any]:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)  # the entry's door's reply socket
        door = f"ipc://{tmp_path}/door"
        pull.bind(door)
        replies = ReplySender(SocketPool(ctx), sockets_max=4, idle_s=60, timeout_s=2, queue_max=100)
        ingress = _Ingress(replies)
        config = FanoutConfig(
            rpc_bind=f"ipc://{tmp_path}/rpc", ack_delay_s=0.0, message_bytes_max=64 * 1024
        )
        owner = OwnerEndpoint(
            config,
            server=zmq_peer_server(config, ctx),
            node="owner",
            ingress=ingress,  # type: ignore[arg-type]
            send_to_member=lambda member, done: None,
            on_peer_done=lambda done: None,
            replies=replies,
            relay_allowed=lambda src, key: KEYS.get(src) == key,
        )
        endpoint = owner.bind()
        owner.start()
        dealers = []
        for _ in range(3):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealers.append(dealer)
        entry, entry_again, mallory = dealers
        out: dict[str, Any] = {}

        def task(task_id: str) -> Task:
            return Task(v=1, id=task_id, prompt="p", reply_to=door, producer_key=KEYS["entry"])

        def forward(req: int, t: Task, src: str = "entry") -> bytes:
            return encode_peer(Forward(req=req, src=src, task=t, remaining_ms=5000, relay=True))

        async with asyncio.TaskGroup() as tg:
            replies.start(tg)
            # 1. mallory asks to relay the entry's route: refused, the replies stay on the
            # route's socket.
            mallory.send(forward(1, task("m1"), src="mallory"))
            await _until(mallory, lambda got: any(type(i) is ForwardReply for i in got))
            replies.send(task("m1").route, encode(Result(id="m1", ok=True, text="x")))
            out["socket_1"] = await asyncio.wait_for(recv_batch(pull, 10), 5)
            # 2. the entry asks: its task's chunk and Result come back on its connection,
            # both before the TaskDone, in one message with the accept.
            t1 = task("t1")
            entry.send(forward(2, t1))
            await asyncio.sleep(0.05)  # the Forward is read (the accept waits for the flush)
            replies.send(t1.route, encode(Chunk(id="t1", seq=0, delta="a")))
            result = Result(id="t1", ok=True, text="a")
            replies.send(t1.route, encode(result))
            owned = Owned(t1, 0.0, False)
            owned.add_forwarder(next(i for i, n in owner.member_of.items() if n == "entry"))
            owner.task_finished(owned, result)
            got = await _until(entry, lambda got: any(type(i) is TaskDone for i in got))
            out["entry_2"] = [_kind(i) for i in got]
            # 2b. mallory asks again for the entry's route, now known as the entry's: refused
            # (under CURVE a member may name any producer_key; the route followed whoever
            # asked last), and the next reply to it still goes on the entry's connection.
            mallory.send(forward(4, task("m2"), src="mallory"))
            at_mallory = await _until(
                mallory, lambda got: any(type(i) is ForwardReply for i in got)
            )
            replies.send(t1.route, encode(Result(id="m2", ok=True, text="for the entry")))
            got = await _until(entry, lambda got: any(_kind(i) == "Result" for i in got))
            out["entry_2b"] = [decode_relayed(i.frame).id for i in got if type(i) is Relay]
            await asyncio.sleep(0.05)
            out["mallory_2b"] = [_kind(i) for i in at_mallory + _drain(mallory)]
            # 3. the same member on a new connection, its task answered from the cache as
            # the Forward is admitted: the Result comes on the new connection.
            ingress.done["t1"] = encode(result)
            entry_again.send(forward(3, t1))
            got = await _until(entry_again, lambda got: any(_kind(i) == "Result" for i in got))
            out["again_3"] = [_kind(i) for i in got]
            # 4. a Result too large for a peer message goes to the socket.
            big = Result(id="t2", ok=True, text="z" * (80 * 1024))
            replies.send(t1.route, encode(big))
            out["socket_4"] = await asyncio.wait_for(recv_batch(pull, 10), 5)
            # 5. the connection goes: what it refuses goes to the socket.
            entry_again.close()
            await asyncio.sleep(0.2)
            replies.send(t1.route, encode(Result(id="t3", ok=True, text="c")))
            out["socket_5"] = await asyncio.wait_for(recv_batch(pull, 10), 5)
            replies.stop()
        out["counters"] = owner.counters
        for sock in (entry, mallory, pull):
            sock.close(linger=0)
        owner.close()
        replies.close(linger_ms=0)
        ctx.term()
        return out

    out = asyncio.run(scenario())
    assert [decode_relayed(f).id for f in out["socket_1"]] == ["m1"]
    assert out["entry_2"] == ["ForwardReply", "Chunk", "Result", "TaskDone"]
    assert "Result" in out["again_3"]
    assert [decode_relayed(f).id for f in out["socket_4"]] == ["t2"]
    assert [decode_relayed(f).id for f in out["socket_5"]] == ["t3"]
    counters = out["counters"]
    assert out["entry_2b"] == ["m2"] and "Result" not in out["mallory_2b"]
    assert counters.relays_refused == 2
    assert counters.replies_relayed == 4  # the chunk, the Result, m2's, the cached Result
    assert counters.relays_by_socket == 2  # the large one, the one the gone link refused
