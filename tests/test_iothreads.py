"""ZeroMQ's I/O threads under SCHED_BATCH (node.zmq_io_batch): asked of libzmq only where
the kernel grants it, and what a running daemon's threads then have."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from gossipd import iothreads
from tests.helpers import RawProducer, wait_until


def _io_threads(pid: int) -> dict[int, int]:
    """ZeroMQ's I/O threads of process pid: thread id -> scheduling policy."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("ZMQbg/IO"):
            out[int(tid)] = os.sched_getscheduler(int(tid))
    return out


def test_a_context_asked_for_batch_starts_its_io_thread_under_it() -> None:
    before = set(_io_threads(os.getpid()))
    ctx = zmq.Context()
    try:
        assert iothreads.batch_io_threads(ctx)
        sock = ctx.socket(zmq.PUSH)  # the first socket starts the I/O thread
        started = wait_until(  # (it names itself once it runs: not at once on a busy host)
            lambda: {t: p for t, p in _io_threads(os.getpid()).items() if t not in before},
            10,
            "the I/O thread",
        )
        sock.close(0)  # (before asserting: term() waits for every socket)
        assert started and set(started.values()) == {os.SCHED_BATCH}
    finally:
        ctx.term()


_REFUSED = """
import os, sys, zmq
from pathlib import Path
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # whatever the parent had
def refuse(pid, policy, param):
    raise PermissionError(1, "Operation not permitted")
os.sched_setscheduler = refuse
from gossipd import iothreads
ctx = zmq.Context()
asked = iothreads.batch_io_threads(ctx)
sock = ctx.socket(zmq.PUSH)  # the first socket starts the I/O thread
import time
policies = set()
deadline = time.monotonic() + 10
while not policies and time.monotonic() < deadline:  # (it names itself once it runs)
    for tid in os.listdir("/proc/self/task"):
        if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("ZMQbg/IO"):
            policies.add(os.sched_getscheduler(int(tid)))
    time.sleep(0.01)
sock.close(0)
ctx.term()
print(asked, sorted(policies))
"""


def test_where_the_kernel_refuses_batch_libzmq_is_not_asked() -> None:
    # In a process of its own: this one's other contexts' threads are not in the count.
    out = subprocess.run(
        [sys.executable, "-c", _REFUSED], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    # not asked (libzmq would have aborted the process on the kernel's refusal): the
    # I/O thread keeps the default policy
    assert out == ["False", f"[{os.SCHED_OTHER}]"]


def test_a_real_time_daemon_does_not_ask_for_batch(monkeypatch: Any) -> None:
    # libzmq would ask BATCH at the inherited real-time priority, which the kernel refuses
    monkeypatch.setattr(iothreads.os, "sched_getscheduler", lambda pid: os.SCHED_FIFO)
    ctx = zmq.Context()
    try:
        assert not iothreads.batch_io_threads(ctx)
    finally:
        ctx.term()


@pytest.mark.parametrize(
    ("overrides", "policy"),
    [((), os.SCHED_BATCH), (("node.zmq_io_batch=false",), os.SCHED_OTHER)],
)
def test_a_daemons_io_thread_runs_under_the_policy_its_setting_says(
    daemon_factory: Any, overrides: tuple[str, ...], policy: int
) -> None:
    d = daemon_factory(*overrides)
    assert d.proc is not None
    # libzmq starts its I/O threads with the context's first socket: the daemon's PULLs are
    # the loop's (ingress.receiver, gossip.receiver), so its first answer's PUSH starts them.
    producer = RawProducer(d.endpoint)
    try:
        producer.send_task("t1")
        assert [r["ok"] for r in producer.results(1, timeout_s=10)] == [True]
    finally:
        producer.close()
    threads = wait_until(lambda: _io_threads(d.proc.pid), 10, "the daemon's I/O threads")
    assert set(threads.values()) == {policy}
