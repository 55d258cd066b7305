"""ReplySender and the readiness helpers, on real ZeroMQ sockets in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

import gossipd.zmqloop as zmqloop
from gossipd.core.codec import decode_replies
from gossipd.core.messages import Chunk, Result, encode
from gossipd.ops.logs import RateLimiter
from gossipd.replysender import ReplySender
from gossipd.sockets import SocketKind, SocketPool
from gossipd.tools.launcher import free_tcp_port
from gossipd.zmqloop import SocketReader, kick, recv_batch, wait_events
from tests.helpers import run_with_context, wait_until_async


def _sender(ctx: zmq.Context, pool: SocketPool | None = None, **overrides: float) -> ReplySender:
    opts = {"sockets_max": 2, "idle_s": 60.0, "timeout_s": 0.3, "queue_max": 100}
    opts.update(overrides)
    return ReplySender(pool if pool is not None else SocketPool(ctx), **opts)  # type: ignore[arg-type]


def test_ReplySender_delivers_in_order_and_bounds_cached_sockets() -> None:
    async def main() -> tuple[list[list[bytes]], int]:
        ctx = zmq.Context()
        pulls, endpoints = [], []
        for _ in range(3):
            pull = ctx.socket(zmq.PULL)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            pulls.append(pull)
            endpoints.append(f"tcp://127.0.0.1:{port}")
        sender = _sender(ctx)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            for i in range(50):
                for endpoint in endpoints[:2]:
                    sender.send(endpoint, str(i).encode())
            got = []
            for pull in pulls[:2]:
                frames: list[bytes] = []
                while len(frames) < 50:
                    frames += await asyncio.wait_for(recv_batch(pull, 100), 5)
                got.append(frames)
            sender.send(endpoints[2], b"third")  # evicts the least recently used socket
            third = await asyncio.wait_for(recv_batch(pulls[2], 10), 5)
            got.append(third)
            sender.stop()
        evicted = sender.statistics().sockets_evicted
        sender.close()
        for pull in pulls:
            pull.close(linger=0)
        ctx.term()
        return got, evicted

    got, evicted = asyncio.run(main())
    expected = [str(i).encode() for i in range(50)]
    assert got[0] == expected and got[1] == expected and got[2] == [b"third"]
    assert evicted == 1


def test_ReplySender_drops_and_counts_replies_to_an_address_that_never_answers() -> None:
    async def main() -> tuple[int, int]:
        ctx = zmq.Context()
        sender = _sender(ctx, timeout_s=0.2)
        dead = f"tcp://127.0.0.1:{free_tcp_port()}"
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            for _ in range(7):
                sender.send(dead, b"x")
            await wait_until_async(
                lambda: sender.statistics().dropped_undeliverable == 7, 5, "the 0.2 s timeout"
            )
            sender.stop()
        stats = sender.statistics()
        sender.close()
        ctx.term()
        return stats.dropped_undeliverable, stats.sockets_open

    dropped, open_sockets = asyncio.run(main())
    assert dropped == 7 and open_sockets == 0


def test_ReplySender_closes_idle_sockets() -> None:
    async def main() -> int:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        pool = SocketPool(ctx)
        sender = ReplySender(pool, sockets_max=2, idle_s=0.2, timeout_s=0.3, queue_max=100)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            pool.start()  # the sweep that closes idle sockets
            sender.send(f"tcp://127.0.0.1:{port}", b"hi")
            await asyncio.wait_for(recv_batch(pull, 1), 5)
            await wait_until_async(
                lambda: sender.statistics().sockets_closed_idle == 1, 5, "the idle close"
            )
            sender.stop()
            pool.stop()
        closed = sender.statistics().sockets_closed_idle
        sender.close()
        pull.close(linger=0)
        ctx.term()
        return closed

    assert asyncio.run(main()) == 1


def test_wait_events_times_out_on_a_silent_socket() -> None:
    async def main() -> bool:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind_to_random_port("tcp://127.0.0.1")
        try:
            return await wait_events(pull, zmq.POLLIN, timeout_s=0.1)
        finally:
            pull.close(linger=0)
            ctx.term()

    assert asyncio.run(main()) is False


def test_SocketReader_receives_lone_messages_and_backlogs_with_no_missed_wake_up(
    monkeypatch: object,
) -> None:
    """A reader driven by the fd's edge-triggered signal must see every message: lone ones,
    a backlog in bounded batches, and one that arrives after a send on the reader's own
    socket (which may use the fd's signal; kick() looks again).  The periodic recheck is
    pushed out to 60 s, so a missed wake-up would time out here instead of being papered
    over by it.  A handler that raises does not stop the reader."""
    monkeypatch.setattr(zmqloop, "RECHECK_S", 60.0)  # type: ignore[attr-defined]
    monkeypatch.setattr(zmqloop, "READER_RECHECK_S", 60.0)  # type: ignore[attr-defined]

    async def main() -> tuple[list[list[list[bytes]]], list[bytes], int]:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        batches: list[list[list[bytes]]] = []
        arrived = asyncio.Event()

        def on_messages(messages: list[list[bytes]]) -> None:
            batches.append(messages)
            arrived.set()
            if messages[0][1] == b"raise":
                raise RuntimeError("a handler's bug")

        async def count(n: int) -> None:
            """Wait until ``n`` messages have come in all."""
            while sum(len(b) for b in batches) < n:
                arrived.clear()
                await asyncio.wait_for(arrived.wait(), 5)

        reader = SocketReader(router, router.recv_multipart, 4, on_messages)
        try:
            for i in range(5):  # lone messages, each sent while the reader waits
                dealer.send(b"lone-%d" % i)
                await count(i + 1)
            for i in range(10):  # a backlog: batches of at most 4
                dealer.send(b"backlog-%d" % i)
            await count(15)
            identity = batches[0][0][0]
            for i in range(5):
                # A message comes in while the loop is blocked, then the reader's socket
                # sends: the send takes the fd's signal, and only kick() makes the reader look.
                dealer.send(b"after-send-%d" % i)
                assert router.poll(5000)  # it is in the router's queue (a blocking wait)
                router.send_multipart([identity, b"reply-%d" % i])
                kick(router)
                await count(16 + i)
            dealer.send(b"raise")
            await count(21)
            dealer.send(b"after-raise")
            await count(22)
            replies = [dealer.recv() for _ in range(5)]
            failures = reader.handler_failures
        finally:
            reader.close()
            router.close(linger=0)
            dealer.close(linger=0)
            ctx.term()
        return batches, replies, failures

    batches, replies, failures = asyncio.run(main())
    payloads = [parts[1] for batch in batches for parts in batch]
    assert payloads == (
        [b"lone-%d" % i for i in range(5)]
        + [b"backlog-%d" % i for i in range(10)]
        + [b"after-send-%d" % i for i in range(5)]
        + [b"raise", b"after-raise"]
    )
    assert all(len(batch) == 1 for batch in batches[:5])
    assert all(1 <= len(batch) <= 4 for batch in batches)
    assert max(len(batch) for batch in batches[5:-7]) == 4  # the backlog came in full batches
    assert replies == [b"reply-%d" % i for i in range(5)]
    assert failures == 1


def test_RateLimiter_allows_burst_then_rate() -> None:
    now = [0.0]
    limiter = RateLimiter(per_s=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(5)] == [True, True, True, False, False]
    assert limiter.suppressed == 2
    now[0] = 0.5
    assert limiter.allow() is True and limiter.allow() is False
    # What a line allowed next says: the 3 denials so far; counting then starts again.
    assert limiter.take_suppressed() == 3 and limiter.suppressed == 0


def _messages(pull: zmq.Socket, n: int) -> list[bytes]:
    """The next ``n`` messages (blocking, 2 s each), asserting that each is one frame."""
    got = []
    for _ in range(n):
        if not pull.poll(2000):
            break
        message = pull.recv_multipart()
        assert len(message) == 1, f"a multipart message of {len(message)} parts"
        got.append(message[0])
    return got


def test_ReplySender_sends_a_turns_first_reply_at_once_under_light_load() -> None:
    """Under light load a turn's first reply does not wait for the end of the turn (latency);
    the replies that follow it in the same turn leave together at the turn's end, each its own
    one-frame message (docs/PROTOCOL.md: "Each message is one ZeroMQ frame"), and after a
    busy turn the whole next turn is batched."""

    async def main(ctx: zmq.Context) -> tuple[list[bytes], int, list[bytes]]:
        pull = ctx.socket(zmq.PULL)
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        sender = _sender(ctx)
        try:
            async with asyncio.TaskGroup() as tg:
                sender.start(tg)
                sender.send(endpoint, b"warm")  # connects (IMMEDIATE: live links only)
                assert await asyncio.wait_for(recv_batch(pull, 10), 5) == [b"warm"]
                for i in range(5):  # one turn: no await in between
                    sender.send(endpoint, str(i).encode())
                # Still inside the turn (blocking waits; the loop does not run).
                first = _messages(pull, 1)
                before_turn_end = pull.poll(100)
                await asyncio.sleep(0)  # the turn ends: the batch goes
                rest = _messages(pull, 4)
                # Under load (the last turn sent several) even a turn's first reply waits.
                sender.send(endpoint, b"5")
                busy_before_turn_end = pull.poll(100)
                await asyncio.sleep(0)  # the turn ends: the batch goes
                rest.append(b"|")
                rest += _messages(pull, 1)
                # That turn had one reply: light load again, the next one leaves at once.
                sender.send(endpoint, b"6")
                rest.append(b"|")
                rest += _messages(pull, 1)
                extra = pull.poll(100)
                sender.stop()
        finally:
            sender.close(linger_ms=0)
        return first, before_turn_end + busy_before_turn_end + extra, rest

    first, before_turn_end, rest = run_with_context(main)
    assert first == [b"0"]
    assert before_turn_end == 0
    assert rest == [b"1", b"2", b"3", b"4", b"|", b"5", b"|", b"6"]


def test_free_tcp_port_chooses_distinct_bindable_ports_below_the_ephemeral_range() -> None:
    """A daemon with vLLM binds its ports a minute after the harness chose them; outgoing
    connections take their source ports from the ephemeral range, so ports come from below."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_tcp_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(1024 <= port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ReplySender_when_sent_calls_back_only_once_the_address_holds_nothing() -> None:
    """``when_sent`` (the owner's TaskDone waits on it for the task's Result): at once when the
    reply went out at once; after the turn's end sent the batch; after a queue held for an
    address nobody listened on yet drained; and after replies were dropped."""

    async def main(ctx: zmq.Context) -> dict[str, object]:
        pull = ctx.socket(zmq.PULL)
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        late_port = free_tcp_port()
        late = f"tcp://127.0.0.1:{late_port}"
        dead = f"tcp://127.0.0.1:{free_tcp_port()}"
        sender = _sender(ctx, timeout_s=1.0)
        seen: dict[str, object] = {}

        def note(name: str) -> Callable[[], None]:
            # What had been handed to ZeroMQ when the callback ran.
            return lambda: seen.setdefault(name, sender.statistics().sent)

        try:
            async with asyncio.TaskGroup() as tg:
                sender.start(tg)
                sender.send(endpoint, b"warm")
                assert await asyncio.wait_for(recv_batch(pull, 10), 5) == [b"warm"]
                sender.send(endpoint, b"a")  # light load: leaves at once
                sender.when_sent(endpoint, note("at_once"))
                sender.send(endpoint, b"b")  # batched for the turn's end
                sender.when_sent(endpoint, note("batch"))
                seen["batch_before_turn_end"] = "batch" in seen
                await asyncio.sleep(0)
                # Both, in order (in one read or two: ZeroMQ's I/O thread may not have
                # delivered b when a is read).
                got_ab = await asyncio.wait_for(recv_batch(pull, 10), 5)
                if len(got_ab) < 2:
                    got_ab += await asyncio.wait_for(recv_batch(pull, 10), 5)
                assert got_ab == [b"a", b"b"]
                sender.send(late, b"held")  # nobody listens yet: queued
                sender.when_sent(late, note("late"))
                sender.send(dead, b"lost")  # nobody ever listens: dropped after 1 s
                sender.when_sent(dead, note("dead"))
                await asyncio.sleep(0.2)
                seen["late_before_bind"] = "late" in seen
                late_pull = ctx.socket(zmq.PULL)
                late_pull.bind(late)
                got = await asyncio.wait_for(recv_batch(late_pull, 10), 5)
                while "dead" not in seen:
                    await asyncio.sleep(0.05)
                seen["late_got"] = got
                late_pull.close(linger=0)
                sender.stop()
        finally:
            sender.close(linger_ms=0)
        seen["dropped"] = sender.statistics().dropped_undeliverable
        return seen

    seen = run_with_context(main)
    assert seen["at_once"] == 2  # warm, a
    assert seen["batch_before_turn_end"] is False and seen["batch"] == 3
    assert seen["late_before_bind"] is False and seen["late"] == 4
    assert seen["late_got"] == [b"held"]
    assert seen["dead"] == 4 and seen["dropped"] == 1


def test_ReplySender_packs_a_turns_replies_to_an_address_into_one_Replies_frame() -> None:
    """``pack=True`` replies that leave together arrive as Replies frames, in the order they
    were sent among the unpacked replies of the same turn (a packed run is cut where an
    unpacked reply comes between), each its own one-frame message; the turn's first reply
    under light load still leaves alone at once; ``sent`` counts replies, not frames."""

    async def main() -> tuple[list[bytes], int]:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        sender = _sender(ctx)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.send(endpoint, b"connect")  # (queued until the connection is up)
            assert await asyncio.wait_for(recv_batch(pull, 10), 5) == [b"connect"]
            await asyncio.sleep(0.01)  # a quiet turn: the next turn's first reply goes at once
            replies = [encode(Result(id=f"t{i}", ok=True, text=str(i))) for i in range(40)]
            for frame in replies[:20]:
                sender.send(endpoint, frame, True)
            sender.send(endpoint, b"unpacked")
            for frame in replies[20:]:
                sender.send(endpoint, frame, True)
            await asyncio.sleep(0)  # the turn ends: the batch goes
            got = _messages(pull, 4)
            sender.stop()
        sent = sender.statistics().sent
        sender.close()
        pull.close(linger=0)
        ctx.term()
        return got, sent

    got, sent = asyncio.run(main())
    lone, before, unpacked, after = got
    assert decode_replies(lone) == [Result(id="t0", ok=True, text="0")]
    assert [r.id for r in decode_replies(before)] == [f"t{i}" for i in range(1, 20)]
    assert unpacked == b"unpacked"
    assert [r.id for r in decode_replies(after)] == [f"t{i}" for i in range(20, 40)]
    assert sent == 42


def test_ReplySender_keeps_packing_replies_that_wait_for_a_slow_address() -> None:
    """Replies that cannot leave at once (the address not yet connected: a producer slow to
    read looks the same) wait in its queue still packed, as Replies frames in order, and
    ``sent`` counts the replies; what comes while they wait goes behind them, packed too."""

    async def main() -> tuple[list[bytes], int, int]:
        ctx = zmq.Context()
        port = free_tcp_port()
        endpoint = f"tcp://127.0.0.1:{port}"
        sender = _sender(ctx, timeout_s=5.0)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            replies = [encode(Result(id=f"t{i}", ok=True, text=str(i))) for i in range(30)]
            for frame in replies[:10]:  # nobody listens yet: all of it waits
                sender.send(endpoint, frame, True)
            await asyncio.sleep(0)
            for frame in replies[10:20]:  # behind the queue, in the next turn
                sender.send(endpoint, frame, True)
            sender.send(endpoint, b"unpacked")
            for frame in replies[20:]:
                sender.send(endpoint, frame, True)
            await asyncio.sleep(0)
            queued = sender.statistics().queued
            pull = ctx.socket(zmq.PULL)
            pull.bind(endpoint)
            await sender.flush(5.0)
            got = _messages(pull, 5)
            sender.stop()
        sent = sender.statistics().sent
        sender.close()
        pull.close(linger=0)
        ctx.term()
        return got, sent, queued

    got, sent, queued = asyncio.run(main())
    assert queued == 31
    # The turn's first reply tried to leave at once (light load) and waits alone; the rest
    # of that turn, and the next turn's run, wait as Replies frames.
    cut = got.index(b"unpacked")
    before, after = got[:cut], got[cut + 1 :]
    assert [r.id for frame in before for r in decode_replies(frame)] == [f"t{i}" for i in range(20)]
    assert [len(decode_replies(frame)) for frame in before] == [1, 9, 10]
    assert [[r.id for r in decode_replies(frame)] for frame in after] == [
        [f"t{i}" for i in range(20, 30)]
    ]
    assert sent == 31


def test_ReplySender_relays_a_forwarders_route_and_never_a_route_served_here() -> None:
    """Replies to a relayed route (Forward.relay) go to its relay, in order, with no socket
    opened; None gives the route back to the socket; a route served here (the HTTP door's)
    stays its own, and only such a route takes a relayed reply (deliver_here)."""

    async def main() -> None:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        sender = _sender(ctx)
        door: list[bytes] = []
        relayed: list[bytes] = []
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.deliver_locally("tcp://127.0.0.1:1", door.append)
            sender.relay("tcp://127.0.0.1:1", relayed.append)  # ours: not taken
            sender.relay(endpoint, relayed.append)
            for i in range(3):
                sender.send(endpoint, b"r%d" % i)
            sender.send("tcp://127.0.0.1:1", b"d")
            assert relayed == [b"r0", b"r1", b"r2"] and door == [b"d"]
            assert sender.statistics().sockets_open == 0
            assert list(sender.local_routes) == ["tcp://127.0.0.1:1"]
            assert sender.deliver_here("tcp://127.0.0.1:1", b"x") and door == [b"d", b"x"]
            assert not sender.deliver_here(endpoint, b"y")  # not served here
            sender.relay(endpoint, None)
            sender.send(endpoint, b"s")
            assert await asyncio.wait_for(recv_batch(pull, 10), 5) == [b"s"]
            sender.stop()
        sender.close()
        pull.close(linger=0)
        ctx.term()

    asyncio.run(main())


def test_ReplySender_hands_a_message_to_a_route_served_here_unencoded() -> None:
    """send_message: a route served here with a message taker gets the Chunk or Result
    itself, in order with the frames sent to it; one served here with frames only (also
    after a taker is taken back) gets the message encoded; any other route gets its frame by
    socket."""

    async def main() -> None:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        sender = _sender(ctx)
        door: list[object] = []  # frames and messages, in the order they came
        frames_only: list[bytes] = []
        chunk = Chunk(id="t1", seq=0, delta="a", node="n")
        result = Result(id="t1", ok=True, text="a", node="n")
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.deliver_locally("tcp://127.0.0.1:1", door.append, door.append)
            sender.deliver_locally("tcp://127.0.0.1:2", frames_only.append, door.append)
            sender.deliver_locally("tcp://127.0.0.1:2", frames_only.append)  # frames only now
            sender.send_message("tcp://127.0.0.1:1", chunk)
            sender.send("tcp://127.0.0.1:1", b"f")
            sender.send_message("tcp://127.0.0.1:1", result)
            assert door == [chunk, b"f", result]
            assert door[2] is result  # the object itself: nothing encoded
            sender.send_message("tcp://127.0.0.1:2", result)
            assert [decode_replies(f) for f in frames_only] == [[result]]
            sender.send_message(endpoint, result)
            assert [decode_replies(f) for f in await asyncio.wait_for(recv_batch(pull, 1), 5)] == [
                [result]
            ]
            sender.stop()
        sender.close()
        pull.close(linger=0)
        ctx.term()

    asyncio.run(main())


def test_an_address_zeromq_refuses_drops_the_reply_counted_and_the_sender_goes_on() -> None:
    """Defence behind messages.endpoint_problem: an address that passed it but that
    ZeroMQ's connect refuses (as "...:5\\n" did, when the check ended in $) costs that reply,
    counted, and neither raises into the runner (which would end the daemon) nor leaks a
    socket; the next reply to a good address goes."""

    async def main() -> tuple[int, int, list[bytes]]:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        sender = _sender(ctx)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.send("tcp://127.0.0.1:5\n", b"lost")
            sender.send(f"tcp://127.0.0.1:{port}", b"kept")
            got = await asyncio.wait_for(recv_batch(pull, 10), 5)
            sender.stop()
        stats = sender.statistics()
        sender.close()
        pull.close(linger=0)
        ctx.term()  # returns: no socket of the refused address left open
        return stats.dropped_undeliverable, stats.sockets_open, got

    dropped, sockets_open, got = asyncio.run(main())
    assert dropped == 1 and got == [b"kept"] and sockets_open == 1


def test_ReplySender_tries_an_address_whose_producer_has_gone_less_and_less_often() -> None:
    """Each `gossipd submit` or client run binds a reply port of its own and goes: its
    socket stays (ingress.reply_idle_s) and libzmq connects again and again.  Every 100 ms,
    1,000 of them cost an idle daemon a fifth of a core; backing off (to 2 s at the default
    reply_timeout_s of 5 s), a few tries in 3 s.  Counted by libzmq itself: each
    socket's monitor, EVENT_CONNECT_RETRIED."""
    producers, window_s = 10, 3.0

    async def main(ctx: zmq.Context) -> list[int]:
        pool = SocketPool(ctx)
        sender = _sender(ctx, pool, sockets_max=producers, timeout_s=5.0)
        monitors = []
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            for _ in range(producers):
                pull = ctx.socket(zmq.PULL)
                endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
                sender.send(endpoint, b"result")
                assert await asyncio.wait_for(recv_batch(pull, 1), 5) == [b"result"]
                sock = pool.get(SocketKind.REPLY, endpoint)
                assert sock is not None
                monitors.append(sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED))
                pull.close(linger=0)  # the producer is gone; its port refuses
            await asyncio.sleep(window_s)  # (the window is what is measured)
            retries = []
            for monitor in monitors:
                n = 0
                while monitor.poll(0):
                    monitor.recv_multipart()
                    n += 1
                retries.append(n)
            sender.stop()
        sender.close()
        return retries

    retries = run_with_context(main)
    # Every 100 ms is about 30 each in 3 s; backing off, 100 ms, 200, 400, 800, 1600, ...
    assert all(1 <= n <= 8 for n in retries), retries


def test_ReplySender_reaches_a_producer_back_at_the_same_address() -> None:
    """The back-off does not give up: a producer that restarts on its fixed reply port
    2 s after it went gets the replies sent meanwhile (they wait up to timeout_s)."""

    async def main(ctx: zmq.Context) -> list[bytes]:
        sender = _sender(ctx, timeout_s=5.0)
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            pull = ctx.socket(zmq.PULL)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
            sender.send(endpoint, b"first")
            assert await asyncio.wait_for(recv_batch(pull, 1), 5) == [b"first"]
            pull.close(linger=0)  # gone...
            await asyncio.sleep(0.5)
            sender.send(endpoint, b"while it was gone")
            await asyncio.sleep(1.5)
            back = ctx.socket(zmq.PULL)  # ... and back, at the same address
            back.bind(endpoint)
            got = await asyncio.wait_for(recv_batch(back, 1), 5)
            back.close(linger=0)
            sender.stop()
        sender.close()
        return got

    assert run_with_context(main) == [b"while it was gone"]
