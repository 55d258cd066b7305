"""Daemon lifecycle with real processes and real signals: SIGTERM drains without losing a
task silently, sd_notify speaks to a real unix datagram socket."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import RawProducer


def test_sigterm_with_500_tasks_in_flight_answers_every_one(daemon_factory) -> None:
    # 64 workers, 0.2 s per task: 500 tasks need ~1.6 s; a 0.5 s grace leaves many unfinished.
    daemon = daemon_factory(
        "engine.token_delay_s=0.01",
        "ingress.concurrency_max=64",
        "lifecycle.shutdown_grace_s=0.5",
    )
    producer = RawProducer(daemon.endpoint)
    try:
        for i in range(500):
            producer.send_task(f"t{i}", params={"max_tokens": 20})
        first = producer.results(1, timeout_s=10)
        assert first, "tasks were running before the signal"
        daemon.terminate()
        rest = producer.replies(
            until=lambda r: len(first) + sum(x["t"] == 3 for x in r) >= 500, timeout_s=20
        )
        assert daemon.wait(20) == 0
        # Anything sent after the daemon began stopping is answered too.
        results = first + [r for r in rest + producer.replies(quiet_s=0.5) if r["t"] == 3]
    finally:
        producer.close()
    ids = [r["id"] for r in results]
    assert sorted(ids) == sorted(f"t{i}" for i in range(500)), "each task gets exactly one result"
    outcomes = {("ok" if r["ok"] else r["error"]["code"]) for r in results}
    assert outcomes <= {"ok", "shutting_down"}
    assert sum(r["ok"] for r in results) > 0
    assert sum(not r["ok"] for r in results) > 0, "the grace period was too short to finish all"
    events = [e["msg"] for e in daemon.events()]
    assert events.index("shutting down") < events.index("drained") < events.index("stopped")


def test_sigint_stops_cleanly_too(daemon_factory) -> None:
    daemon = daemon_factory()
    daemon.signal(signal.SIGINT)
    assert daemon.wait(10) == 0


def test_sd_notify_ready_watchdog_stopping_over_a_real_socket(
    daemon_factory, tmp_path: Path
) -> None:
    path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(5)
    try:
        daemon = daemon_factory(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        seen: list[str] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and seen.count("WATCHDOG=1") < 2:
            seen.append(listener.recv(4096).decode())
        assert any(m.startswith("READY=1") for m in seen)
        assert "STATUS=serving on tcp://127.0.0.1:" in next(
            m for m in seen if m.startswith("READY=1")
        )
        assert seen.count("WATCHDOG=1") >= 2
        daemon.terminate()
        rest = []
        while "STOPPING=1" not in rest:
            rest.append(listener.recv(4096).decode())
        assert daemon.wait(10) == 0
    finally:
        listener.close()


@pytest.mark.parametrize("value", ["", "abc"])
def test_notifier_without_systemd_does_nothing(value: str) -> None:
    from gossipd.ops.notify import Notifier

    n = Notifier({"NOTIFY_SOCKET": value} if value == "" else {"WATCHDOG_USEC": value})
    n.ready()
    assert not n.enabled and n.sent == 0 and n.watchdog_interval_s is None


def test_a_fatal_signal_leaves_the_daemons_python_stacks_in_its_log(daemon_factory) -> None:
    """SIGBUS (an I/O error under the journal, which replay reads mapped) or SIGSEGV ended
    the daemon with no line in its log: systemd restarted it into the same crash, and
    nothing said where.  faulthandler now writes every thread's stack to stderr first."""
    daemon = daemon_factory()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGBUS)
    assert daemon.proc.wait(timeout=20) == -signal.SIGBUS
    text = daemon.log_path.read_text(errors="replace")
    assert "Fatal Python error: Bus error" in text and "Current thread" in text
