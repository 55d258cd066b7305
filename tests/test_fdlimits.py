"""The daemon's ZeroMQ context and open-files limit, sized for its socket pool's bounds
(gossipd/ops/fdlimits.py): libzmq's default context held 1,023 sockets, which gossip's
sockets and their monitors filled at about 340 members."""

from __future__ import annotations

import resource
import subprocess
import sys

import zmq

from gossipd.config import load_config
from gossipd.membership.gossip import PEER_SOCKETS_MAX
from gossipd.ops.fdlimits import size_context, sockets_wanted


def test_the_daemons_context_holds_every_socket_its_pool_may_open() -> None:
    from gossipd.daemon import Daemon

    config = load_config(
        environ={},
        overrides=['ingress.bind="tcp://127.0.0.1:0"', 'gossip.bind=""', 'journal.path=""',
                   'metrics.bind=""'],
    )  # fmt: skip
    daemon = Daemon(config)
    try:
        held = daemon._ctx.get(zmq.MAX_SOCKETS)
    finally:
        daemon._ctx.destroy(linger=0)
    assert held >= 2 * PEER_SOCKETS_MAX + config.ingress.reply_sockets_max > 1023


def test_a_sized_context_opens_past_the_default_1023_sockets() -> None:
    """2,000 PUSH sockets, each connected (as gossip's are, to members that may not be up):
    EMFILE at the 1,024th in a default context."""
    ctx = zmq.Context()
    size_context(ctx, sockets_wanted(gossip_sockets_max=PEER_SOCKETS_MAX, reply_sockets_max=1))
    sockets = []
    try:
        for i in range(2000):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{1 + i % 60000}")
            sockets.append(sock)
        assert len(sockets) == 2000
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def test_the_open_files_soft_limit_is_raised_toward_the_hard_one() -> None:
    """In a child process whose soft limit starts at 1,024: the daemon's start raises it."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    code = (
        f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, {hard}));"
        "from gossipd.ops.fdlimits import raise_open_files;"
        "print(raise_open_files(4096, at_least=1)[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == (4096 if hard == resource.RLIM_INFINITY else min(4096, hard))


def test_the_low_limit_warning_is_a_json_log_line_naming_the_daemon(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The daemon's constructor warns (here: a hard open-files limit of 512); logging was set
    up after it, so the warning came out as Python's bare last-resort text, without level,
    node or fields (OPERATIONS.md: one JSON object per line)."""
    import json
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipd", "run", "--bind", "tcp://127.0.0.1:0", "--set", 'gossip.bind=""',
         "--set", 'node.id="fd-test"'],
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512)),
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if '"serving"' in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    warned = [line for line in lines if "open-files limit may be too low" in line]
    assert len(warned) == 1, lines
    record = json.loads(warned[0])
    assert record["level"] == "warning" and record["node"] == "fd-test"
    assert record["hard"] == 512
