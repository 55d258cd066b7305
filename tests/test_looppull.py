"""``LoopPullServer`` (gossipd/looppull.py) against libzmq's PUSH on real loopback sockets:
what one loop turn hands over, stopping to accept while what was sent still arrives, and a
server that reads nothing more."""

from __future__ import annotations

import asyncio

import zmq

from gossipd.looppull import LoopPullServer
from tests.helpers import run_with_context, wait_until_async

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
