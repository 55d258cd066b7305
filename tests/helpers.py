"""Helpers shared by the real-process tests: a plain ZeroMQ producer, the metrics scraper, and
waiting on a condition (instead of sleeping for a guessed time)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import zmq

from gossipd.core.ring import Ring
from gossipd.ops.scrape import scrape  # noqa: F401  (re-exported for the tests)
from gossipd.tools.cpushares import cpu_share_overrides
from gossipd.tools.tinymodel import engine_overrides as tiny_engine_overrides

if TYPE_CHECKING:
    from simulations.cluster import Cluster

T = TypeVar("T")


def run_with_context(main: Callable[[zmq.Context], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(main(ctx))`` with a fresh ZeroMQ context, destroyed (linger 0) even when
    ``main`` fails, so a failing test fails instead of hanging in ``term()``."""
    ctx = zmq.Context()
    try:
        return asyncio.run(main(ctx))
    finally:
        ctx.destroy(linger=0)


POLL_S = 0.05  # how often wait_until looks again


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """Return ``predicate()``'s first truthy value, looking every POLL_S; fail the test naming
    ``what`` if ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)


async def wait_until_async(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """wait_until inside an event loop: the loop runs on between looks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(POLL_S)


class RawProducer:
    """A producer with plain pyzmq and msgpack: no gossipd code on the wire path."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.reply_to = f"tcp://127.0.0.1:{port}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(endpoint)

    def send_raw(self, frame: bytes) -> None:
        self.push.send(frame)

    def send_task(self, task_id: str, prompt: str = "hello world", **fields: Any) -> None:
        task = {"v": 1, "t": 1, "id": task_id, "prompt": prompt, "reply_to": self.reply_to}
        task.update(fields)
        self.push.send(msgpack.packb(task))

    def replies(
        self, *, until: Any = None, timeout_s: float = 10.0, quiet_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Collect replies until ``until(replies)`` is true, or ``quiet_s`` passes with nothing new,
        or ``timeout_s`` passes."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            if until is not None and until(out):
                break
            if quiet_s is not None and time.monotonic() - last > quiet_s:
                break
            if self.pull.poll(50):
                while True:
                    try:
                        out.append(msgpack.unpackb(self.pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                last = time.monotonic()
        return out

    def results(self, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        got = self.replies(until=lambda r: sum(x["t"] == 3 for x in r) >= n, timeout_s=timeout_s)
        return [x for x in got if x["t"] == 3]

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def engine_overrides(model_dir: Path) -> list[str]:
    """A daemon with a real vLLM engine on the tiny model, metrics on a free port."""
    return [*tiny_engine_overrides(model_dir), 'metrics.bind="127.0.0.1:0"']


def own_cores(daemons: int) -> Callable[[int], list[str]]:
    """``Cluster(overrides_for=...)`` for ``daemons`` vLLM daemons: each engine on its own
    cores, as `gossipd up` sets them (vLLM's "auto" puts them all on the same ones)."""
    overrides = cpu_share_overrides("vllm", daemons, gpus=0, environ={})
    return lambda i: overrides[i]


def gossipd_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `python -m gossipd ARGS` to completion, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "gossipd", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextlib.contextmanager
def running(cluster: Cluster, start_timeout_s: float = 60.0) -> Iterator[Cluster]:
    """``cluster`` started, converged, every member's GPU state known to every other; stopped
    afterwards, also when its start-up fails."""
    try:
        cluster.start(timeout_s=start_timeout_s)
        cluster.wait_converged(timeout_s=30)
        cluster.wait_meta(timeout_s=30)
        yield cluster
    finally:
        cluster.stop()


def key_owned_by(cluster: Cluster, member: str, prefix: str = "s-") -> str:
    """A placement key (``prefix`` and a number) that ``member`` owns on the cluster's ring
    of equal weights: a session that runs there, wherever its request enters."""
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    return next(k for k in (f"{prefix}{i}" for i in range(1000)) if ring.owner(k) == member)


@contextlib.contextmanager
def out_of_file_descriptors() -> Iterator[None]:
    """This process out of file descriptors for the block (real EMFILE): its limit lowered
    to what it holds plus a few, those few taken; all given back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass  # none left
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def break_a_pulls_rules(ctx: zmq.Context, endpoint: str, too_large: int) -> list[zmq.Socket]:
    """What a PULL the loop speaks (gossipd/looppull.py) must close or refuse, sent to
    ``endpoint``: a connection that does not speak ZMTP (checked: our greeting comes back),
    a DEALER (not a PUSH), a message of two frames, and a frame of ``too_large`` bytes (each
    of the last two on a PUSH of its own).  -> the sockets, for the caller to close; in the
    order DEALER, the two-frame PUSH, the large one's PUSH."""
    import socket

    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as junk:
        junk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
        junk.settimeout(5)
        assert junk.recv(4096).startswith(b"\xff")  # our greeting, then the close
    socks = []
    for kind in (zmq.DEALER, zmq.PUSH, zmq.PUSH):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    socks[0].send(b"not a pusher")
    socks[1].send_multipart([b"two", b"frames"])
    socks[2].send(b"x" * too_large)
    return socks


def closed_by_reason(metrics: dict[str, float], name: str) -> dict[str, float]:
    """``name{reason=R}`` -> {R: value}, of a scrape."""
    prefix = name + "{"
    return {
        k.split("reason=")[1].rstrip("}"): v for k, v in metrics.items() if k.startswith(prefix)
    }


def keyed_tasks_answered_ok(producer: RawProducer, n: int) -> bool:
    """Send ``n`` tasks with keys of their own (``after-I``, key ``kI``): is each answered ok
    within 10 s?"""
    for i in range(n):
        producer.send_task(f"after-{i}", key=f"k{i}")
    results = producer.results(n, timeout_s=10)
    return sorted(r["id"] for r in results if r["ok"]) == sorted(f"after-{i}" for i in range(n))


def push_until_held_back(push: zmq.Socket, frame: bytes, most: int = 0) -> int:
    """Send ``frame`` on ``push`` without blocking until sends stop going out for 1 s (its
    SNDHWM full and the TCP buffers behind it), or ``most`` went (0: no bound); -> how many
    went.  Blocking: run it in a thread of its own, with a context of its own."""
    sent, idle_since = 0, time.monotonic()
    while (not most or sent < most) and time.monotonic() - idle_since < 1.0:
        try:
            push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.01)
            continue
        sent += 1
        idle_since = time.monotonic()
    return sent
