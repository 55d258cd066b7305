"""PeerLinks, the forwarder's DEALER sockets, against a real ROUTER on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import zmq
from hypothesis import given
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from gossipd.config import FanoutConfig
from gossipd.core.messages import Task
from gossipd.core.peer_messages import Forward, TaskDone
from gossipd.fanout.owner import peer_frames, peer_items
from gossipd.fanout.peerlinks import PeerLinks, zmq_peer_client
from gossipd.sockets import SocketKind, SocketPool
from gossipd.tools.launcher import free_tcp_port
from gossipd.zmtp import CURVE_OVERHEAD
from tests.helpers import run_with_context


def _forward(req: int) -> Forward:
    task = Task(v=1, id=f"t{req}", prompt="p", reply_to="tcp://127.0.0.1:1")
    return Forward(req=req, src="a", task=task, remaining_ms=1000)


def _links(config: FanoutConfig, pool: SocketPool) -> PeerLinks:
    return PeerLinks(config, channel=zmq_peer_client(config, pool), on_reply=lambda m, addr: None)


def test_PeerLinks_sends_a_turns_first_forward_at_once_under_light_load() -> None:
    """Under light load a turn's first forward leaves without waiting for the end of the
    turn (the hop's latency); the forwards that follow it in the same turn go as one
    PeerBatch, and after a busy turn the whole next turn is batched."""
    config = FanoutConfig()

    async def main(ctx: zmq.Context) -> tuple[list[int], int, list[int]]:
        router = ctx.socket(zmq.ROUTER)
        addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        links = _links(config, SocketPool(ctx))

        def reqs() -> list[int]:
            if not router.poll(2000):
                return []
            items = peer_items(router.recv_multipart()[1], config.message_bytes_max)
            return [item.req for item in items if isinstance(item, Forward)]

        try:
            for req in range(1, 5):  # one turn: no await in between
                links.send(addr, _forward(req))
            first = reqs()  # still inside the turn: the loop does not run
            before_turn_end = router.poll(100)
            await asyncio.sleep(0)  # the turn ends: the batch goes
            rest = reqs()
            # Under load (the last turn sent several) even a turn's first forward waits.
            links.send(addr, _forward(5))
            busy_before_turn_end = router.poll(100)
            await asyncio.sleep(0)  # the turn ends: the batch goes
            rest += [0, *reqs()]
            # That turn had one forward: light load again, the next one leaves at once.
            links.send(addr, _forward(6))
            rest += [0, *reqs()]
        finally:
            links.close()
        return first, before_turn_end + busy_before_turn_end, rest

    first, before_turn_end, rest = run_with_context(main)
    assert first == [1]
    assert before_turn_end == 0
    assert rest == [2, 3, 4, 0, 5, 0, 6]


@given(
    ids=st.lists(st.text("abcdefghij0123456789", min_size=1, max_size=60), min_size=1, max_size=80),
    bytes_max=st.integers(min_value=40, max_value=4000),
)
def test_peer_frames_split_under_the_limit_and_peer_items_give_back_every_item(
    ids: list[str], bytes_max: int
) -> None:
    """What the forwarder and the owner send each other: frames within the receiver's limit
    on the wire, CURVE's overhead included (unless one item alone is larger), decoding to the
    same items in the same order."""
    items = [TaskDone(id=i, node="n") for i in ids]
    frames = peer_frames(items, bytes_max)
    assert sum(count for _, count in frames) == len(items)
    assert all(len(frame) + CURVE_OVERHEAD <= bytes_max or count == 1 for frame, count in frames)
    decoded = [item for frame, _ in frames for item in peer_items(frame, 1 << 20)]
    assert decoded == items


def _retries_in(seconds: float, config: FanoutConfig) -> int:
    """Connect attempts PeerLinks makes in ``seconds`` to an address nobody listens on."""

    async def main(ctx: zmq.Context) -> int:
        pool = SocketPool(ctx)
        links = _links(config, pool)
        addr = f"tcp://127.0.0.1:{free_tcp_port()}"
        try:
            links.send(addr, _forward(1))
            sock = pool.get(SocketKind.PEER, addr)
            assert sock is not None
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
            retries = 0
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                if monitor.poll(int(left * 1000)):
                    recv_monitor_message(monitor)
                    retries += 1
            return retries
        finally:
            links.close()

    return run_with_context(main)


def test_a_dead_peer_is_retried_with_backoff_not_ten_times_a_second() -> None:
    """ZeroMQ retries a refused connection every 0.1 s forever by default: for a member that
    died and never comes back.  With the backoff (0.1 s doubling to 0.4 s here) the same two
    seconds see about a third of the attempts."""
    fast = _retries_in(2.0, FanoutConfig(peer_reconnect_max_s=0.1))
    backoff = _retries_in(2.0, FanoutConfig(peer_reconnect_max_s=0.4))
    assert fast >= 12, fast
    assert backoff <= 8, backoff


def test_idle_connections_to_non_members_are_closed() -> None:
    config = FanoutConfig(peer_idle_close_s=5.0)

    async def main(ctx: zmq.Context) -> tuple[int, int, int, int]:
        links = _links(config, SocketPool(ctx))
        member, gone = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2))
        try:
            links.send(member, _forward(1))
            links.send(gone, _forward(2))
            await asyncio.sleep(0)  # the turn ends: both forwards go
            now = time.monotonic()
            early = links.close_idle({member}, now + 1.0)  # not idle long enough yet
            late = links.close_idle({member}, now + 6.0)  # gone: closed; member: kept
            return early, late, len(links), links.counters.links_closed
        finally:
            links.close()

    early, late, left, closed = run_with_context(main)
    assert (early, late, left, closed) == (0, 1, 1, 1)


def test_a_send_to_an_address_the_channel_cannot_connect_to_is_a_dropped_send() -> None:
    """The loop's channel speaks tcp:// only and ZeroMQ refuses malformed endpoints; a
    member's advertised rpc address is checked as gossip is decoded, and this is the backstop:
    the send is counted as dropped (the ack timeout tries the next member) instead of raising
    out of the turn's flush, which lost every forward that turn carried."""
    from gossipd.looppeer import LoopPeerClient

    config = FanoutConfig()

    async def main(ctx: zmq.Context) -> list[int]:
        dropped = []
        for channel in (
            LoopPeerClient(message_bytes_max=config.message_bytes_max),
            zmq_peer_client(config, SocketPool(ctx)),
        ):
            links = PeerLinks(config, channel=channel, on_reply=lambda m, addr: None)
            channel.start(lambda addr, frames: None)
            links.send_alone("ipc:///tmp/gossipd-no-such.sock", _forward(1))
            links.send_alone("tcp://127.0.0.1:5\n", _forward(2))
            dropped.append(links.counters.sends_dropped)
            channel.close()
        return dropped

    assert run_with_context(main) == [2, 1]  # (ZeroMQ connects ipc:// lazily: not dropped)


def test_replies_naming_a_member_other_than_the_one_at_their_address_are_dropped() -> None:
    """On our connection to member a's address, a TaskDone, ForwardReply or ConfirmReply
    that names b is b's to send, not a's: dropped and counted (bad_peer_messages), as the
    rpc server drops a Forward whose src is not its key's node."""
    from gossipd.core.gossip_messages import Alive, GpuState, Meta
    from gossipd.core.membership import MemberTable
    from gossipd.core.peer_messages import ConfirmReply, ForwardReply

    with _built_dispatcher() as dispatcher:
        table = MemberTable(me=dispatcher.node, addr="tcp://10.0.0.9:1", now=0.0)
        for name in ("a", "b"):
            table.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:7946"), 0.0)
            gpu = GpuState(rpc=f"tcp://{name}:5558")
            table.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0), 0.0)
        dispatcher.placer.rebuild(table.members.values())
        spoken_for_b = [
            TaskDone(id="t1", node="b"),
            ForwardReply(req=1, node="b", accepted=True),
            ConfirmReply(node="b", migrated=["t1"]),
        ]
        dispatcher.on_peer_replies(spoken_for_b, "tcp://a:5558")
        assert dispatcher.replies_for_another == 3
        dispatcher.on_peer_replies(spoken_for_b, "tcp://b:5558")  # b's own: taken
        assert dispatcher.replies_for_another == 3
        assert dispatcher.statistics().bad_peer_messages == 3
        # In one batch, a's own reply does not vouch for the next naming b (nor for one
        # naming no member, which only a message built in-process can carry).
        mixed = [
            TaskDone(id="t4", node=""),
            TaskDone(id="t2", node="a"),
            TaskDone(id="t3", node="b"),
        ]
        dispatcher.on_peer_replies(mixed, "tcp://a:5558")
        assert dispatcher.replies_for_another == 5


def test_a_members_last_address_is_not_used_once_another_member_claims_it() -> None:
    """Member a gave b's name its own rpc address (a forged Meta), we forwarded to b there,
    then a had b declared dead (a forged Dead).  b's last address was used as it was: our
    TaskDones and Confirms for b went to a, and a's replies naming b were taken as b's.
    Now a member's last address counts only while no other member claims it."""
    from gossipd.core.gossip_messages import Alive, GpuState, Meta
    from gossipd.core.membership import MemberTable

    with _built_dispatcher() as dispatcher:
        table = MemberTable(me=dispatcher.node, addr="tcp://10.0.0.9:1", now=0.0)
        table.apply(Alive(node="a", incarnation=0, addr="tcp://a:7946"), 0.0)
        table.apply(Meta(node="a", version=1, gpu=GpuState(rpc="tcp://a:5558")), 0.0)
        dispatcher.placer.rebuild(table.members.values())  # (b: dead, not placed)
        dispatcher.forwarder._last_addr["b"] = "tcp://a:5558"  # where we last sent b's
        sent: list[tuple[str, object]] = []
        dispatcher._links.send = lambda addr, msg: sent.append((addr, msg))
        for claimant in ("a", None, "b"):  # a claims it; nobody does; b itself
            dispatcher._node_at = lambda addr, who=claimant: who
            before = dispatcher.replies_for_another
            dispatcher.on_peer_replies([TaskDone(id="t1", node="b")], "tcp://a:5558")
            taken = dispatcher.replies_for_another == before
            dispatcher.send_to_member("b", TaskDone(id="t2", node=dispatcher.node))
            assert taken == (claimant != "a"), claimant
            assert [addr for addr, _ in sent] == ([] if claimant == "a" else ["tcp://a:5558"])
            sent.clear()


def test_an_item_no_owner_sends_or_of_another_version_is_refused_on_our_connections() -> None:
    """What an owner says back is a Relay, ForwardReply, TaskDone, ConfirmReply, ModelCard,
    Moved or ReplayKnown in version 1: a Forward, a Drain, or a TaskDone of version 2 on
    our connection went to the forwarder unchecked (the owner side refused them); now they
    are refused and counted (bad_peer_messages), and the forwarder never sees them."""
    from gossipd.core.messages import Drain

    seen: list[Any] = []
    with _built_dispatcher() as dispatcher:
        dispatcher.forwarder.on_reply = lambda msg, now: seen.append(msg)
        task = Task(v=1, id="t9", prompt="p", reply_to="tcp://127.0.0.1:9")
        dispatcher.on_peer_replies(
            [
                TaskDone(id="t1", node="n", v=2),
                Forward(req=1, src="n", task=task, remaining_ms=100),
                Drain(v=1, id="d", reply_to="tcp://127.0.0.1:9", node="me"),
                TaskDone(id="t2", node="n"),
            ]
        )
        assert dispatcher.replies_refused == 3
        assert dispatcher.statistics().bad_peer_messages == 3
    assert [m.id for m in seen] == ["t2"]


def test_a_reply_whose_handling_raises_leaves_its_batch_mates_handled_and_is_counted() -> None:
    """One read's replies are handled one by one: a bug in one (here the forwarder raising
    for t1) is logged and counted (gossipd_handler_failures_total), and the replies read with
    it are still handled (they lost their producers' answers before)."""
    from gossipd.ops.logs import HANDLER_FAILURES

    handled: list[str] = []

    def on_reply(msg: Any, now: float) -> None:
        if msg.id == "t1":
            raise RuntimeError("a forwarder's bug")
        handled.append(msg.id)

    with _built_dispatcher() as dispatcher:
        dispatcher.forwarder.on_reply = on_reply
        before = HANDLER_FAILURES["Dispatcher.on_peer_replies"]
        dispatcher.on_peer_replies([TaskDone(id=i, node="n") for i in ("t0", "t1", "t2")])
    assert handled == ["t0", "t2"]
    assert HANDLER_FAILURES["Dispatcher.on_peer_replies"] == before + 1


def test_a_withdraw_on_a_new_connection_of_the_same_member_drops_its_copy() -> None:
    """A forwarder whose first connection dropped (its accept lost with it) withdraws, at
    its ack timeout, on a new connection: the copy was matched by connection, not by member,
    so the stalled owner kept running it beside the migrated one.  Another member's
    Withdraw still changes nothing."""
    from gossipd.core.peer_messages import Withdraw

    async def forwarded_then_withdrawn(owner: Any) -> tuple[bool, bool, bool]:
        task = Task(v=1, id="t0", prompt="p", reply_to="tcp://127.0.0.1:1")
        owner._on_forward(b"conn-1", Forward(req=1, src="f", task=task, remaining_ms=10_000))
        book = owner._ingress.intake.book
        held = book.get("t0") is not None
        owner._on_forward(b"conn-9", Withdraw(id="t0", node="other"))  # not its forwarder
        kept = book.get("t0") is not None and book.get("t0").stop is None
        owner._on_forward(b"conn-2", Withdraw(id="t0", node="f"))  # f, reconnected
        entry = book.get("t0")
        return held, kept, entry is None or entry.stop is not None

    with _built_dispatcher() as dispatcher:
        held, kept, dropped = asyncio.run(forwarded_then_withdrawn(dispatcher.owner))
    assert held and kept and dropped


def test_a_moved_is_taken_only_from_the_owner_server_and_the_handing_owner_forgets_its_own() -> (
    None
):
    """A Moved counts only as it comes to our owner server (its source checked against the
    sender's key there); one back on our own connection to a member is dropped and counted.
    The owner that handed a forwarded task over tells its forwarder and, every forwarder
    told, forgets its own ledger entry of the hand-off (else it would migrate the task a
    second time if the taker died while it is still up)."""
    from gossipd.core.gossip_messages import Alive, GpuState, Meta
    from gossipd.core.membership import MemberTable
    from gossipd.core.peer_messages import Moved

    async def scenario(dispatcher: Any) -> tuple[list[tuple[str, object]], bool]:
        table = MemberTable(me=dispatcher.node, addr="tcp://10.0.0.9:1", now=0.0)
        for name in ("f", "c"):
            table.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:7946"), 0.0)
            gpu = GpuState(rpc=f"tcp://127.0.0.1:{free_tcp_port()}", software_version="0.3.1")
            table.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0), 0.0)
        dispatcher.placer.rebuild(table.members.values())
        task = Task(v=1, id="t0", prompt="p", reply_to="tcp://127.0.0.1:1")
        dispatcher.owner._on_forward(
            b"conn-f", Forward(req=1, src="f", task=task, remaining_ms=9000)
        )
        dispatcher.forwarder.ledger.accepted(task, "c", 0.0)  # (our hand-off, taken by c)
        sent: list[tuple[str, object]] = []
        dispatcher._links.send_alone = lambda addr, msg: sent.append((addr, msg))
        dispatcher._tell_moved(task, "c")
        return sent, dispatcher.forwarder.ledger.get("t0") is None

    with _built_dispatcher() as dispatcher:
        sent, forgotten = asyncio.run(scenario(dispatcher))
        assert [m for _, m in sent] == [Moved(id="t0", node=dispatcher.node, to="c")]
        assert forgotten
        # As the forwarder: our entry for t1 under "o"; a Moved on our connection to a
        # member is no owner's word; one through our server is.
        t1 = Task(v=1, id="t1", prompt="p", reply_to="tcp://127.0.0.1:1")
        dispatcher.forwarder.ledger.accepted(t1, "o", 0.0)
        before = dispatcher.replies_for_another
        dispatcher.on_peer_replies([Moved(id="t1", node="o", to="nobody")], "tcp://m:5558")
        assert dispatcher.forwarder.ledger.get("t1").owner == "o"  # type: ignore[union-attr]
        assert dispatcher.replies_for_another == before + 1
        dispatcher.on_peer_replies([Moved(id="t1", node="o", to="c")], "")
        assert dispatcher.forwarder.ledger.get("t1").owner == "c"  # type: ignore[union-attr]


def test_a_hand_off_that_ended_at_its_taker_is_told_to_its_forwarders_as_done() -> None:
    """A task forwarded to us by f, handed off (a drain) to c, which ran it at once: c's
    TaskDone stood for its accept.  f hears our TaskDone by name (it forgets the task), not
    a Moved: told the task runs at c, f would answer for it there until its window passed
    (c's TaskDone came to us) and run it again if c died meanwhile."""
    from gossipd.core.gossip_messages import Alive, GpuState, Meta
    from gossipd.core.membership import MemberTable

    async def scenario(dispatcher: Any) -> tuple[bool, list[Any], list[Any]]:
        table = MemberTable(me=dispatcher.node, addr="tcp://10.0.0.9:1", now=0.0)
        rpc = f"tcp://127.0.0.1:{free_tcp_port()}"
        table.apply(Alive(node="c", incarnation=0, addr="tcp://c:7946"), 0.0)
        gpu = GpuState(rpc=rpc, software_version="0.3.5")
        table.apply(Meta(node="c", version=1, gpu=gpu, incarnation=0), 0.0)
        dispatcher.placer.rebuild(table.members.values())
        task = Task(v=1, id="t0", prompt="p", reply_to="tcp://127.0.0.1:1")
        dispatcher.owner._on_forward(
            b"conn-f", Forward(req=1, src="f", task=task, remaining_ms=9000)
        )
        sent: list[tuple[str, object]] = []
        told: list[tuple[str, object]] = []
        dispatcher._links.send = lambda addr, msg: sent.append((addr, msg))
        dispatcher._links.send_alone = lambda addr, msg: told.append((addr, msg))
        dispatcher.send_to_member = lambda member, msg: told.append((member, msg))
        handing = asyncio.create_task(dispatcher.hand_off(task, dispatcher._clock.monotonic()))
        await asyncio.sleep(0)
        [(addr, _)] = [(a, m) for a, m in sent if isinstance(m, Forward)]
        assert addr == rpc
        dispatcher.on_peer_replies([TaskDone(id="t0", node="c")], addr)
        return await handing, told, list(dispatcher.forwarder.ledger.entries)

    with _built_dispatcher() as dispatcher:
        handed, told, ledgered = asyncio.run(scenario(dispatcher))
    assert handed
    assert told == [("f", TaskDone(id="t0", node=dispatcher.node))], "no Moved"
    assert ledgered == []


def test_an_item_whose_handling_raises_leaves_the_rest_of_its_batch_handled() -> None:
    """The owner's server reads a PeerBatch item by item: one item's bug is counted
    (gossipd_handler_failures_total) and the items after it are still handled."""
    from gossipd.core.peer_messages import PeerBatch, Withdraw, encode_peer
    from gossipd.ops.logs import HANDLER_FAILURES

    seen: list[str] = []

    def on_forward(identity: bytes, msg: Any) -> None:
        if msg.id == "bad":
            raise RuntimeError("a bug in the owner")
        seen.append(msg.id)

    with _built_dispatcher() as dispatcher:
        owner = dispatcher.owner
        owner._on_forward = on_forward
        before = HANDLER_FAILURES["OwnerEndpoint.on_peer_item"]
        items = [Withdraw(id=i, node="f") for i in ("a", "bad", "b")]
        owner._on_peer_frame(b"conn", encode_peer(PeerBatch(items=items)), "")
    assert seen == ["a", "b"]
    assert HANDLER_FAILURES["OwnerEndpoint.on_peer_item"] == before + 1


def test_the_owner_remembers_a_bounded_number_of_forwarders_connections() -> None:
    """A Forward's src is its sender's word without CURVE: one src per Forward grew the
    owner's map of members' latest connections without end.  It holds LINKS_MAX at most,
    the newest kept."""
    from gossipd.fanout.owner import LINKS_MAX

    async def forwards(owner: Any) -> dict[str, bytes]:
        for i in range(LINKS_MAX + 500):
            task = Task(v=1, id=f"t{i}", prompt="p", reply_to="tcp://127.0.0.1:1")
            forward = Forward(req=i, src=f"src-{i}", task=task, remaining_ms=1000)
            owner._on_forward(f"conn-{i}".encode(), forward)
        # Read within the turn: its replies leave at the turn's end, and a reply to an
        # identity with no connection (these) drops that member's entry.
        return dict(owner._link_of)

    with _built_dispatcher() as dispatcher:
        links = asyncio.run(forwards(dispatcher.owner))
    assert len(links) == LINKS_MAX
    assert links[f"src-{LINKS_MAX + 499}"] == f"conn-{LINKS_MAX + 499}".encode()
    assert "src-0" not in links


@contextlib.contextmanager
def _built_dispatcher() -> Iterator[Any]:
    """The fan-out dispatcher of a daemon that is built, not run (no socket bound)."""
    from gossipd.config import load_config
    from gossipd.daemon import Daemon

    config = load_config(
        environ={},
        overrides=[f'gossip.bind="tcp://127.0.0.1:{free_tcp_port()}"',
                   f'fanout.rpc_bind="tcp://127.0.0.1:{free_tcp_port()}"',
                   'ingress.bind="tcp://127.0.0.1:0"', 'journal.path=""', 'metrics.bind=""'],
    )  # fmt: skip
    daemon = Daemon(config)
    dispatcher = daemon._build_fanout("tcp://127.0.0.1:1").dispatcher
    try:
        yield dispatcher
    finally:
        dispatcher.close()
        daemon._ctx.destroy(linger=0)


def test_a_task_frame_whose_handling_raises_leaves_the_frames_read_with_it_handled() -> None:
    """The ingress reads a batch of task frames at once: a bug in one frame's handling is
    counted (gossipd_handler_failures_total) and the others are still handled."""
    from gossipd.config import load_config
    from gossipd.daemon import Daemon
    from gossipd.ops.logs import HANDLER_FAILURES

    config = load_config(
        environ={},
        overrides=['ingress.bind="tcp://127.0.0.1:0"', 'journal.path=""', 'metrics.bind=""'],
    )
    daemon = Daemon(config)
    handled: list[bytes] = []

    def handle_frame(frame: bytes, now: float, producer_key: str = "") -> None:
        if frame == b"bug":
            raise RuntimeError("a bug in the ingress")
        handled.append(frame)

    try:
        daemon.ingress.handle_frame = handle_frame  # type: ignore[method-assign]
        before = HANDLER_FAILURES["Ingress.handle_frame"]
        daemon.ingress._on_frames([b"one", b"bug", b"two"])
    finally:
        daemon._ctx.destroy(linger=0)
    assert handled == [b"one", b"two"]
    assert HANDLER_FAILURES["Ingress.handle_frame"] == before + 1
