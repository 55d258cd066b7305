"""``LoopPullServer`` (gossipd/looppull.py) against libzmq's PUSH on real loopback sockets:
what one loop turn hands over, stopping to accept while what was sent still arrives, and a
server that reads nothing more."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from gossipd.looppull import LoopPullServer, loop_binds
from tests.helpers import push_until_held_back, run_with_context, wait_until_async

FRAME = 64 * 1024


def _push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(addr)
    return push


def test_a_burst_is_handed_over_one_read_a_connection_a_turn_and_all_of_it_arrives() -> None:
    """100 frames of 64 KiB sent at once: each loop turn hands over what one read of the
    connection completed (256 KiB at most, and the frame it finished), not the burst, so the
    work the frames make runs in between; every frame arrives."""

    async def main(ctx: zmq.Context) -> dict[int, int]:
        loop = asyncio.get_running_loop()
        turn = [0]

        def tick() -> None:  # once a loop turn
            turn[0] += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        per_turn: dict[int, int] = {}
        server = LoopPullServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")

        def on_frames(frames: list[bytes], sender: str) -> None:
            per_turn[turn[0]] = per_turn.get(turn[0], 0) + sum(map(len, frames))

        server.receive(on_frames, lambda: None)
        push = _push(ctx, addr)
        try:
            for _ in range(100):
                push.send(b"x" * FRAME)
            await wait_until_async(lambda: sum(per_turn.values()) == 100 * FRAME, 10, "all")
            return per_turn
        finally:
            push.close()
            server.close()

    per_turn = run_with_context(main)
    assert max(per_turn.values()) <= 256 * 1024 + FRAME, per_turn
    assert len(per_turn) >= 100 * FRAME // (256 * 1024 + FRAME)


def test_stop_accepting_ends_the_connections_and_what_was_sent_before_still_arrives() -> None:
    """The ingress's unbind at a stop: libzmq's PUSH takes our FIN for a dropped connection
    (its monitor says so) and what it sent before arrives; a new connection is closed."""

    async def main(ctx: zmq.Context) -> tuple[int, bool, int]:
        got: list[bytes] = []
        server = LoopPullServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")
        server.receive(lambda frames, sender: got.extend(frames), lambda: None)
        push = _push(ctx, addr)
        monitor = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        late = ctx.socket(zmq.PUSH)
        late.setsockopt(zmq.LINGER, 0)
        try:
            push.send(b"first")
            await wait_until_async(lambda: got == [b"first"], 5, "the connection")
            for i in range(500):
                push.send(b"%d" % i)
            server.stop_accepting()
            await wait_until_async(lambda: len(got) == 501, 5, "what was sent before")
            dropped = await asyncio.to_thread(monitor.poll, 5000)
            late.connect(addr)
            late.send(b"after")
            await asyncio.sleep(0.3)
            return len(got), bool(dropped), got.count(b"after")
        finally:
            push.disable_monitor()
            monitor.close()
            push.close()
            late.close()
            server.close()

    received, dropped, after = run_with_context(main)
    assert received == 501 and dropped and after == 0


def test_a_server_that_pauses_reading_hands_over_nothing_more() -> None:
    async def main(ctx: zmq.Context) -> list[bytes]:
        got: list[bytes] = []
        server = LoopPullServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")
        server.receive(lambda frames, sender: got.extend(frames), lambda: None)
        push = _push(ctx, addr)
        try:
            push.send(b"before")
            await wait_until_async(lambda: got == [b"before"], 5, "the connection")
            server.pause_reading()
            push.send(b"after")
            await asyncio.sleep(0.3)
            return got
        finally:
            push.close()
            server.close()

    assert run_with_context(main) == [b"before"]


def test_what_a_stalled_server_had_not_read_is_read_before_its_connections_end() -> None:
    """A stop under load: the loop stalls while a sender fills the TCP buffers, then the
    server, which reads slowly (10 ms of work a read), stops accepting.  It reads on until the sender, told by our FIN, closes: every
    frame that left the sender's queue is handed over (at most its SNDHWM of 10 and what
    its encoder held wait in libzmq for a reconnect), not only what one turn read."""

    async def main(ctx: zmq.Context) -> tuple[bool, int, int]:
        got: list[bytes] = []
        server = LoopPullServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")

        def handle(frames: list[bytes], sender: str) -> None:
            got.extend(frames)
            time.sleep(0.01)  # the work a read's tasks make: a busy daemon reads slowly

        server.receive(handle, lambda: None)
        sender_ctx = zmq.Context()
        push = _push(sender_ctx, addr)
        push.setsockopt(zmq.SNDHWM, 10)
        sent: list[int] = []

        def send_until_held_back() -> None:
            sent.append(push_until_held_back(push, b"x" * FRAME))

        try:
            push.send(b"x" * FRAME)
            await wait_until_async(lambda: len(got) == 1, 5, "the connection")
            got.clear()
            sender = threading.Thread(target=send_until_held_back)
            sender.start()
            sender.join(30)  # the loop stalls here: the TCP buffers fill
            server.stop_accepting()
            ended = await server.ended(5.0)
            return ended, sent[0], len(got)
        finally:
            push.close()
            sender_ctx.term()
            server.close()

    ended, sent, got = run_with_context(main)
    assert ended and sent > 20, (ended, sent)
    assert sent - 12 <= got <= sent, (sent, got)


@pytest.mark.parametrize(
    ("addr", "loop"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://*:5557", True),
        ("tcp://[::1]:5557", True),
        ("tcp://0.0.0.0:0", True),
        ("tcp://127.0.0.1:*", True),  # libzmq's "any free port": the loop's port 0
        ("tcp://eth0:5557", False),  # a network interface's name
        ("tcp://localhost:5557", False),
        ("ipc:///tmp/gossipd.sock", False),
    ],
)
def test_the_loop_binds_an_ip_address_and_a_port_and_leaves_names_and_ipc_to_libzmq(
    addr: str, loop: bool
) -> None:
    assert loop_binds(addr) is loop


def test_a_connection_still_shaking_hands_when_the_server_stops_accepting_is_closed() -> None:
    """It has sent no frame yet, so nothing is lost, and it gets no chance to send one that
    would then wait unread (libzmq's unbind dropped it the same)."""
    from gossipd.zmtp import greeting

    async def main() -> tuple[bytes, bool]:
        server = LoopPullServer(message_bytes_max=1 << 20)
        addr = server.bind("tcp://127.0.0.1:0")
        server.receive(lambda frames, sender: None, lambda: None)
        reader, writer = await asyncio.open_connection("127.0.0.1", int(addr.rsplit(":", 1)[1]))
        try:
            writer.write(greeting(b"NULL", as_server=False))  # and no READY: still shaking
            ours = await asyncio.wait_for(reader.readexactly(64), 5.0)
            server.stop_accepting()
            await asyncio.wait_for(reader.read(), 5.0)  # (our READY, then the end)
            return ours[:1], await server.ended(1.0)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) == (b"\xff", True)
