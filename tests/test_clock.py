"""The shell's one clock (gossipd/clock.py): every part reads the time from the Clock the
daemon passes it, so a run can be driven by another clock."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import zmq

from gossipd.clock import SYSTEM_CLOCK, ManualClock
from gossipd.sockets import SocketKind, SocketPool

GOSSIPD = Path(__file__).resolve().parent.parent / "gossipd"
# The daemon's shell: every module outside the pure core (which takes the time as an input),
# the engines (adapters inside vLLM's own loop; they time their start-up for a log line) and
# the tools (benchmarks and CLIs, which time themselves).
SHELL_EXEMPT = ("core/", "engines/", "tools/", "clock.py")
READS_TIME = re.compile(r"\btime\.(time|monotonic|perf_counter)(_ns)?\(\)")


def test_no_shell_module_reads_the_time_but_through_its_clock() -> None:
    offenders = []
    for path in sorted(GOSSIPD.rglob("*.py")):
        rel = path.relative_to(GOSSIPD).as_posix()
        if rel.startswith(SHELL_EXEMPT):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if READS_TIME.search(line.split("#", 1)[0]):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


def test_a_manual_clock_moves_only_when_told_and_never_back() -> None:
    clock = ManualClock(monotonic=5.0, wall=100.0)
    assert (clock.monotonic(), clock.wall()) == (5.0, 100.0)
    clock.advance(2.5)
    assert (clock.monotonic(), clock.wall()) == (7.5, 102.5)
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_the_system_clock_is_the_process_clocks() -> None:
    import time

    before = time.monotonic()
    assert before <= SYSTEM_CLOCK.monotonic() <= time.monotonic()
    assert abs(SYSTEM_CLOCK.wall() - time.time()) < 1.0


def test_the_socket_pool_ages_sockets_on_its_clock() -> None:
    """Idle sockets are judged on the pool's clock: nothing is idle until that clock moves,
    however long the test takes, and everything is once it has moved past idle_s."""
    ctx = zmq.Context()
    clock = ManualClock()
    pool = SocketPool(ctx, clock=clock)
    closed: list[str] = []
    pool.register(SocketKind.GOSSIP, on_close=lambda addr, why: closed.append(addr))
    try:
        pool.open(SocketKind.GOSSIP, "tcp://127.0.0.1:1")
        pool.open(SocketKind.GOSSIP, "tcp://127.0.0.1:2")
        clock.advance(8.0)
        pool.touch(SocketKind.GOSSIP, "tcp://127.0.0.1:2")  # used at 8 s on the clock
        assert pool.close_idle(clock.monotonic(), SocketKind.GOSSIP, idle_s=5.0) == 1
        assert closed == ["tcp://127.0.0.1:1"]
        clock.advance(6.0)
        assert pool.close_idle(clock.monotonic(), SocketKind.GOSSIP, idle_s=5.0) == 1
        assert closed == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    finally:
        pool.close_all()
        ctx.term()
