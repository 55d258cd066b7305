"""Host names in reply addresses (gossipd/hostnames.py): looked up off ZeroMQ's I/O thread,
so that a producer whose reply_to names a host that the resolver stalls on cannot freeze the
daemon's sockets (a review's reproduction: every answer, and gossip, held about 20 s)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from gossipd.hostnames import FAILED, HostNames, name_in, with_address
from gossipd.replysender import ReplySender
from gossipd.sockets import SocketPool

ROOT = Path(__file__).resolve().parents[1]


def test_which_reply_addresses_name_a_host() -> None:
    assert name_in("tcp://producer-7.example:5555") == ("producer-7.example", 5555)
    assert name_in("tcp://localhost:5 KEY") == ("localhost", 5)
    assert name_in("tcp://999.1.1.1:5") == ("999.1.1.1", 5)  # (no IPv4 address: a name)
    for address in ("tcp://10.0.0.1:5", "tcp://[::1]:5", "ipc:///tmp/x", "tcp://10.0.0.1:5 K"):
        assert name_in(address) is None
    assert with_address("tcp://h:7", "10.1.2.3") == "tcp://10.1.2.3:7"
    assert with_address("tcp://h:7", "fe80::1") == "tcp://[fe80::1]:7"


def _stalling_on(name: str, release: threading.Event) -> Callable[..., list[Any]]:
    """A resolver that stalls on ``name`` (until ``release``, then fails) and answers the
    others as the system's does: what a resolver that never answers does to that name."""

    def getaddrinfo(host: str, port: int, *args: Any) -> list[Any]:
        if host == name:
            release.wait(10)
            raise OSError("no answer")
        return socket.getaddrinfo(host, port, *args)

    return getaddrinfo


def _sender(names: HostNames) -> tuple[zmq.Context, ReplySender]:
    ctx = zmq.Context()
    return ctx, ReplySender(
        SocketPool(ctx), sockets_max=8, idle_s=60, timeout_s=0.5, queue_max=100, names=names
    )


def test_a_reply_to_a_host_name_goes_to_its_address_and_one_that_stalls_holds_nothing_else() -> (
    None
):
    """localhost resolves (/etc/hosts): its replies arrive, in order.  A name whose lookup
    stalls (a getaddrinfo that blocks: what a resolver that never answers does) holds its
    own replies only; a reply to an address leaves at once meanwhile; the stalled ones are
    dropped and counted at the timeout, and when_sent's callback runs then."""
    release = threading.Event()
    getaddrinfo = _stalling_on("stalled.example", release)

    names = HostNames(timeout_s=0.5, getaddrinfo=getaddrinfo)
    ctx, sender = _sender(names)
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    told: list[str] = []

    async def main() -> tuple[list[bytes], float]:
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            return await exchange()

    async def exchange() -> tuple[list[bytes], float]:
        sender.send(f"tcp://stalled.example:{port}", b"lost")
        sender.when_sent(f"tcp://stalled.example:{port}", lambda: told.append("stalled"))
        for i in range(3):
            sender.send(f"tcp://localhost:{port}", b"by-name-%d" % i)
        started = time.monotonic()
        sender.send(f"tcp://127.0.0.1:{port}", b"by-address")
        got: list[bytes] = []
        while len(got) < 4 and time.monotonic() - started < 5:
            try:
                got.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                await asyncio.sleep(0.01)
        took = time.monotonic() - started
        while not told and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        return got, took

    try:
        got, took = asyncio.run(main())
        stats = sender.statistics()
    finally:
        release.set()
        sender.close(linger_ms=0)
        pull.close(0)
        ctx.term()
    assert sorted(got) == [b"by-address", b"by-name-0", b"by-name-1", b"by-name-2"]
    assert [g for g in got if g.startswith(b"by-name")] == [
        b"by-name-0",
        b"by-name-1",
        b"by-name-2",
    ]
    assert took < 2.0
    assert told == ["stalled"]
    assert stats.dropped_undeliverable == 1 and stats.queued == 0 and stats.queued_bytes == 0
    assert names.address("stalled.example") == FAILED and names.failed == 1


@pytest.mark.parametrize("mode", ["reply", "seed"])
def test_a_daemon_answers_on_while_a_name_it_sends_to_stalls_its_resolver(
    tmp_path: Path, mode: str
) -> None:
    """The daemon itself, in a network and mount namespace whose resolver never answers
    (tests/stalled_resolver.py): a task with reply_to tcp://stalled.example:5555 ("reply";
    or "seed": the daemon's gossip seed is that name), then one to an address, whose answer
    must not wait for the name (about 20 s for a reply_to; 9-10 s for every task while a
    seed was named so, as gossip reconnected to it)."""
    problem = None
    if os.geteuid() != 0:
        problem = "namespaces need root"
    elif shutil.which("unshare") is None or shutil.which("ip") is None:
        problem = "unshare or ip is not installed"
    if problem is not None:
        if os.environ.get("GOSSIPD_REQUIRE_NETNS") == "1":
            pytest.fail(f"GOSSIPD_REQUIRE_NETNS=1 and {problem}")
        pytest.skip(problem)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:5 attempts:2\n")
    script = (
        f"ip link set lo up && mount --bind {resolv} /etc/resolv.conf && "
        f"exec {sys.executable} {ROOT / 'tests' / 'stalled_resolver.py'} {tmp_path / 'logs'} {mode}"
    )
    done = subprocess.run(
        ["unshare", "--net", "--mount", "sh", "-c", script],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["answered"] == ["to-an-address"], out
    assert out["answered_after_s"] < 2.0, out


def test_lookups_stay_bounded_within_one_turn_and_a_resolver_error_fails_at_once() -> None:
    """The bound was checked before a lookup's thread was counted, one turn later: a turn's
    1,024 refusals to 1,024 made-up names started 1,024 threads.  And a name that IDNA
    cannot encode (a label of 64 characters) raised UnicodeError in its thread: a
    traceback, and its replies waited out the timeout."""
    from gossipd.hostnames import LOOKUPS_MAX

    release = threading.Event()
    started: list[str] = []

    def getaddrinfo(host: str, port: int, *args: Any) -> list[Any]:
        started.append(host)
        if host.startswith("bad"):
            raise UnicodeError("label too long")
        release.wait(10)
        raise OSError("no answer")

    names = HostNames(timeout_s=2.0, getaddrinfo=getaddrinfo)

    async def main() -> tuple[list[str], float]:
        began = time.monotonic()
        bad = await names.look_up("bad" + "x" * 64, 1)
        quick = time.monotonic() - began
        burst = await asyncio.gather(*(names.look_up(f"h{i}.example", 1) for i in range(100)))
        return [bad, *burst], quick

    try:
        answers, quick = asyncio.run(main())
    finally:
        release.set()
    assert answers[0] == FAILED and quick < 1.0
    assert all(a == FAILED for a in answers)
    assert len(started) <= LOOKUPS_MAX + 1  # the bad one, then at most 16 at once
    assert names.refused >= 100 - LOOKUPS_MAX


def test_a_stop_drops_the_replies_waiting_for_a_stalled_lookup_at_once() -> None:
    """ReplySender.stop cancels the lookups: the daemon's task group waited for each stalled
    one (up to ingress.reply_timeout_s), out of the seconds a stop has."""
    release = threading.Event()

    def getaddrinfo(host: str, port: int, *args: Any) -> list[Any]:
        release.wait(10)
        raise OSError("no answer")

    ctx = zmq.Context()
    sender = ReplySender(
        SocketPool(ctx), sockets_max=8, idle_s=60, timeout_s=30.0, queue_max=100,
        names=HostNames(timeout_s=30.0, getaddrinfo=getaddrinfo),
    )  # fmt: skip
    told: list[bool] = []

    async def main() -> float:
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.send("tcp://stalled.example:5", b"r")
            sender.when_sent("tcp://stalled.example:5", lambda: told.append(True))
            await asyncio.sleep(0.05)
            began = time.monotonic()
            sender.stop()
        return time.monotonic() - began

    try:
        took = asyncio.run(main())
        stats = sender.statistics()
    finally:
        release.set()
        sender.close(linger_ms=0)
        ctx.term()
    assert took < 1.0 and told == [True]
    assert stats.dropped_undeliverable == 1 and stats.queued == 0 and stats.queued_bytes == 0


def test_gossip_datagrams_to_a_member_named_by_host_go_to_its_address_off_the_io_thread() -> None:
    """ZmqTransport (gossip's datagrams) connected a member's tcp://NAME:PORT as it was, so
    libzmq looked the name up in the I/O thread every socket shares.  Now the first send to
    a name starts its lookup here and is dropped (counted); once the name resolves, sends go
    to its address.  A name whose lookup stalls drops only its own datagrams: a send to an
    address meanwhile leaves at once."""
    from gossipd.datagrams import ZmqTransport

    release = threading.Event()
    getaddrinfo = _stalling_on("stalled.example", release)

    ctx = zmq.Context()
    names = HostNames(timeout_s=0.5, getaddrinfo=getaddrinfo)
    transport = ZmqTransport(SocketPool(ctx), names=names)
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")

    async def main() -> tuple[list[bool], list[bytes]]:
        accepted = [
            transport.send(f"tcp://stalled.example:{port}", b"lost"),
            transport.send(f"tcp://localhost:{port}", b"before-the-lookup"),
            transport.send(f"tcp://127.0.0.1:{port}", b"to-an-address"),
        ]
        got = [await asyncio.to_thread(pull.recv)]
        while names.address("localhost") is None:
            await asyncio.sleep(0.01)
        accepted.append(transport.send(f"tcp://localhost:{port}", b"by-name"))
        got.append(await asyncio.to_thread(pull.recv))
        while names.address("stalled.example") is None:  # (given up at the timeout)
            await asyncio.sleep(0.05)
        accepted.append(transport.send(f"tcp://stalled.example:{port}", b"failed"))
        return accepted, got

    try:
        accepted, got = asyncio.run(main())
    finally:
        release.set()
        transport.close()
        pull.close(0)
        ctx.term()
    assert accepted == [False, False, True, True, False]
    assert got == [b"to-an-address", b"by-name"]
    assert transport.unresolved == 3 and transport.dropped == 3
    assert names.address("stalled.example") == FAILED and names.failed == 1
