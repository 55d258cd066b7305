"""A producer in another language: tests/js_producer/producer.mjs (Node, zeromq.js 6 with its
own libzmq, @msgpack/msgpack), written from docs/PROTOCOL.md alone, against real daemons,
plain and with CURVE (issue 27).  It reads each ZeroMQ message as one frame and fails on a
multipart one; it checks mixed lone and packed tasks, streaming, Replies frames, refusals,
Cancels packed with their tasks, a StatusQuery, and that every id is answered exactly once.

Needs ``node`` and ``npm ci`` in tests/js_producer (.ci/run does both): skipped without them,
except under GOSSIPD_REQUIRE_NODE=1 (CI), where that fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gossipd.security import write_key_pair

HERE = Path(__file__).parent / "js_producer"
TASKS = 2000


def _node() -> str:
    node = shutil.which("node")
    missing = []
    if node is None:
        missing.append("`node` is not on PATH (apt-get install -y nodejs npm)")
    for module in ("zeromq", "@msgpack/msgpack"):
        if not (HERE / "node_modules" / module / "package.json").exists():
            missing.append(f"{module} is not installed (cd tests/js_producer && npm ci)")
    if missing:
        message = "the JavaScript producer cannot run: " + "; ".join(missing)
        if os.environ.get("GOSSIPD_REQUIRE_NODE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    assert node is not None
    return node


def _run(node: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [node, str(HERE / "producer.mjs"), *args],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _report(node: str, config: dict[str, Any]) -> dict[str, Any]:
    proc = _run(node, "run", json.dumps(config))
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report from the JS producer (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(lines[-1])
    assert report["ok"] and proc.returncode == 0, json.dumps(report, indent=1)[:6000]
    print(json.dumps(report))  # shown with -s or on failure
    return report


def _assert_complete(report: dict[str, Any], curve: bool) -> None:
    assert report["curve"] is curve
    assert report["expected"]["mixed"] == TASKS + 2  # + the 128-emoji id, + one beside a bad item
    assert report["expected"]["cancel"] == 20 and report["expected"]["refusal"] >= 11
    assert report["answered_exactly_as_expected"] == report["ids"]
    assert report["multipart_messages"] == 0
    assert report["tasks_frames"] > 20 and report["lone_frames"] > 20  # packed and not
    assert report["chunks"] > 0  # streamed
    assert report["replies_frames"] > 0 and report["replies_items"] >= 2 * report["replies_frames"]


def _assert_status(report: dict[str, Any]) -> None:
    """The StatusReport as the JS producer decoded it: a serving daemon, its checksum a 64-bit
    unsigned integer, read as a BigInt where a JS number would lose digits (above 2^53)."""
    status = report["status"]
    assert status is not None and status["status"] == "serving" and status["node"], status
    checksum = int(status["checksum"])
    assert 0 <= checksum < 2**64, status
    assert status["checksum_type"] == "bigint" if checksum > 2**53 else status["checksum_type"]


def test_js_producer_against_a_plain_daemon(daemon_factory: Any) -> None:
    node = _node()
    daemon = daemon_factory()
    report = _report(node, {"endpoint": daemon.endpoint, "tasks": TASKS, "status": True})
    _assert_complete(report, curve=False)
    _assert_status(report)


def test_js_producer_with_curve_and_its_own_minimal_key_file(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The producer writes its key files itself, one line each (PROTOCOL.md, "Key files");
    the daemon's public key it reads from the file pyzmq wrote."""
    node = _node()
    secrets, peers, producers = tmp_path / "secrets", tmp_path / "peers", tmp_path / "producers"
    peers.mkdir()
    producers.mkdir()
    daemon_public, _ = write_key_pair("s0", secrets)
    (peers / "s0.key").write_bytes(daemon_public.read_bytes())
    made = _run(node, "keygen", str(tmp_path / "js"), "js")
    assert made.returncode == 0, made.stderr
    minimal = (tmp_path / "js" / "js.key").read_text()
    assert minimal == f'public-key = "{json.loads(made.stdout)["public_key"]}"\n'
    (producers / "js.key").write_text(minimal)
    daemon = daemon_factory(
        "security.curve=true",
        f"security.secret_key_file={secrets / 's0.key_secret'}",
        f"security.peer_keys_dir={peers}",
        f"security.producer_keys_dir={producers}",
        'node.id="s0"',
        'gossip.preset="local"',
    )
    # A StatusQuery too: under CURVE its StatusReport comes back over the producer's own
    # CURVE reply socket, as a Task's replies do (PROTOCOL.md, admin messages under CURVE).
    key_file = str(tmp_path / "js" / "js.key_secret")
    curve = {"server_key_file": str(daemon_public), "key_file": key_file}
    config = {"endpoint": daemon.endpoint, "tasks": TASKS, "curve": curve, "status": True}
    report = _report(node, config)
    _assert_complete(report, curve=True)
    _assert_status(report)
