"""The path of a forwarded task, measured (scripts/path_files.py): two real daemons in this
process, tasks sent to one that the other owns.  No part on the path calls back into a part
that called it (issue 25: the core's Forwarder reached the shell through the placer and a
daemon closure), and the path runs through no more files, and makes no more calls, than ARCHITECTURE.md says.

The same for the HTTP door's two paths (``--door``): ``gossipd bench http``'s request, keyed
to run where it entered or at the other daemon."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "path_files.py"
# docs/ARCHITECTURE.md "The path of a forwarded task" (25 before issue 25, then 24; 25 again
# since core/sampling.py was split from core/messages.py, 26 since core/codec.py was: the
# same code in one more file each time).
PATH_FILES_MAX = 26
# Calls into gossipd's modules a forwarded task makes, over both daemons (the sum of
# path_files' calls_per_task): 110.1 at 607a358, 119.2 at a483671 (features added a call at
# a time, each within a timed benchmark's noise), 104.2 after they were taken back, 111.2
# once five of those trims were undone for one copy of each rule (46096ab).  A count, not a
# time: the same from run to run, so a drift shows here before a benchmark.
PATH_CALLS_MAX = 115
# The HTTP door's paths, over both daemons, measured at 16c8035 (the same in six runs, to
# 0.3): a request run where it entered, 26 files and 98.3 calls; one forwarded, 35 files
# and 171.0-171.4 calls.  At 18d0808 the forwarded one: 36 files (at the bound), 173.9
# calls.  Busy-polling's poke on each read (gossipd/busypoll.py; its turns are the loop's,
# off in the count) is one file more: 27 files and 101.3 calls local (1.0 of them the
# poke), 37 and 174.7 forwarded (1.3).  With a TaskDone standing for an accept still held
# (fanout/owner.py), the forwarded one: 37 files, 170.3 calls.  The bounds: the calls with
# the ZeroMQ bound's room (4%), and one file more.  core/codec.py split from core/messages.py
# is one file more on the forwarded one (38 files, 172.0 calls; the local one does not call
# it: 27 files).
DOOR_PATH_FILES_MAX = {"local": 28, "forwarded": 39}
# Modules run by the clock, not by requests, left out of the counts: the load record is
# sampled at most once an interval (when admits and finishes poke it), and SWIM probes on
# its own timer; on a slow run either reaches half a call a request, net of the idle rate,
# and counted as on the path (CI, 2026-12-06: core/loadstate and core/swim, 37 files).
CLOCK_DRIVEN = frozenset({"core/loadstate", "core/swim"})


def _counted(out: dict[str, Any]) -> tuple[list[str], float]:
    """The path's modules and its calls a task, the clock-driven ones left out."""
    path = [m for m in out["path"] if m not in CLOCK_DRIVEN]
    calls = sum(n for m, n in out["calls_per_task"].items() if m not in CLOCK_DRIVEN)
    return path, calls


DOOR_PATH_CALLS_MAX = {"local": 105, "forwarded": 178}
# The calls back up the door's paths make, each through a callback handed down on purpose:
# a connection's held bytes written at the turn's end (http/turnwrites.py); and on the
# owner, a finished task's TaskDone, which waits until the task's replies have left
# (OwnerEndpoint.task_finished asks Runner.when_replies_sent, whose ReplySender.when_sent
# calls OwnerEndpoint._results_left back).  A door's replies are relayed on the peer
# connection, so they have left at once and the callback runs inside the call; a ZeroMQ
# producer's leave later, from a socket's flush, so the ZeroMQ path shows no call back up.
DOOR_CALLBACKS = {
    "http/server.HttpConnection -> http/turnwrites.TurnWrites -> http/server.HttpConnection",
    "ingress/runner.Runner -> fanout/owner.OwnerEndpoint -> ingress/runner.Runner",
    "fanout/owner.OwnerEndpoint -> ingress/runner.Runner -> replysender.ReplySender"
    " -> fanout/owner.OwnerEndpoint",
}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("path_files", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_forwarded_task_calls_nothing_back_up_and_crosses_few_files() -> None:
    out = asyncio.run(_script().main(argparse.Namespace(tasks=100)))
    assert out["ok"] == 100, out  # every task forwarded to b and answered by b
    assert out["calls_back_up_per_task"] == {}, out["calls_back_up_per_task"]
    path, calls = _counted(out)
    assert len(path) <= PATH_FILES_MAX, out["path"]
    assert calls <= PATH_CALLS_MAX, out["calls_per_task"]
    # The path is the forwarded one: both sides of fan-out and the owner's runner.
    for module in ("fanout/forwarding", "fanout/owner", "core/forwarder", "ingress/runner"):
        assert module in out["path"], out["path"]


@pytest.mark.parametrize("door", ["local", "forwarded"])
def test_the_http_doors_paths_cross_few_files_and_make_few_calls(door: str) -> None:
    out = asyncio.run(_script().main(argparse.Namespace(tasks=100, door=door)))
    assert out["ok"] == 100, out  # every request answered 200 by the member its key names
    assert set(out["calls_back_up_per_task"]) <= DOOR_CALLBACKS, out["calls_back_up_per_task"]
    path, calls = _counted(out)
    assert len(path) <= DOOR_PATH_FILES_MAX[door], " ".join(out["path"])
    assert calls <= DOOR_PATH_CALLS_MAX[door], out["calls_per_task"]
    assert "http/server" in out["path"] and "ingress/runner" in out["path"], out["path"]
    assert ("fanout/peerlinks" in out["path"]) == (door == "forwarded"), out["path"]


def test_the_recorder_sees_a_call_back_up() -> None:
    """The check itself: A.go -> B.go -> A.back is one call back up (A re-entered)."""
    script = _script()
    recorder = script.Recorder()
    source = (
        "class A:\n"
        "    def go(self, b):\n"
        "        b.go(self)\n"
        "    def back(self):\n"
        "        pass\n"
        "class B:\n"
        "    def go(self, a):\n"
        "        a.back()\n"
    )
    fake = str(Path(script.ROOT) / "core" / "fake.py")
    namespace: dict[str, object] = {}
    exec(compile(source, fake, "exec"), namespace)
    import sys

    recorder.on = True
    sys.setprofile(recorder)
    try:
        namespace["A"]().go(namespace["B"]())  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    assert dict(recorder.back_up) == {"core/fake.A -> core/fake.B -> core/fake.A": 1}
