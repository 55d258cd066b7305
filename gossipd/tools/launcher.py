"""Start real daemon processes (for the demo, the benchmarks, tests and fault injection).

Each daemon runs `python -m gossipd run` with its JSON log in a file; ``start`` returns once
the daemon logged "serving".  Real processes, real signals: ``terminate`` is SIGTERM,
``kill`` is SIGKILL, ``pause``/``resume`` are SIGSTOP/SIGCONT.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_handed_out: set[int] = set()
_rng = random.Random()  # seeded from os.urandom: processes choosing at once do not agree
_PORTS_BELOW_EPHEMERAL = 10_000  # how far below the kernel's ephemeral range to choose


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_tcp_port() -> int:
    """A loopback port nobody listens on, never the same twice in this process (the kernel
    happily returns a port it just returned, and a daemon needs three distinct ones).

    Chosen below the kernel's ephemeral range: a daemon with vLLM binds its ports a minute
    after they are chosen (the engine starts first), and a port from the ephemeral range can
    be taken meanwhile as the source port of any outgoing connection on the machine."""
    low = _ephemeral_low()
    first = max(1024, low - _PORTS_BELOW_EPHEMERAL)
    for _ in range(200 if low - first >= 1000 else 0):
        port = _rng.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    while True:  # no room below the ephemeral range: let the kernel choose
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _port_set(overrides: Sequence[str], key: str) -> int | None:
    """The tcp port an override ``key=tcp://HOST:PORT`` sets; 0 when it sets another kind of
    address (or none); None when no override sets ``key``."""
    for item in overrides:
        if item.startswith(key):
            address = item[len(key) :].strip("\"'")
            port = address.rpartition(":")[2]
            return int(port) if address.startswith("tcp://") and port.isdigit() else 0
    return None


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON lines of a daemon's log (other lines, and a line cut short, skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class DaemonProcess:
    def __init__(
        self,
        *,
        overrides: Sequence[str] = (),
        config: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        port: int | None = None,
        name: str = "gossipd",
        new_session: bool = False,
    ) -> None:
        self.port = port or free_tcp_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.name = name
        self.gossip_port = free_tcp_port()
        self.gossip_endpoint = f"tcp://127.0.0.1:{self.gossip_port}"
        defaults = [f"ingress.bind={self.endpoint}"]
        self.rpc_port = free_tcp_port()
        # An override's own address is the one the daemon binds: its port is the one kept.
        gossip_set = _port_set(overrides, "gossip.bind=")
        rpc_set = _port_set(overrides, "fanout.rpc_bind=")
        if gossip_set is None:
            defaults.append(f"gossip.bind={self.gossip_endpoint}")
        elif gossip_set:
            self.gossip_port = gossip_set
            self.gossip_endpoint = f"tcp://127.0.0.1:{gossip_set}"
        if rpc_set is None:
            defaults.append(f"fanout.rpc_bind=tcp://127.0.0.1:{self.rpc_port}")
        elif rpc_set:
            self.rpc_port = rpc_set
        self._overrides = [*defaults, *overrides]
        self._config = config
        self._env = {**os.environ, **(env or {})}
        self.log_path = (
            Path(log_dir or tempfile.mkdtemp(prefix="gossipd-")) / f"{name}-{self.port}.log"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        # Its own session and process group: a terminal's Ctrl-C does not reach it, and
        # ``kill_group`` reaches its children too (vLLM's engine core process).
        self._new_session = new_session
        self._metrics_port = 0
        self._log_offset = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "gossipd", "run"]
        if self._config is not None:
            cmd += ["--config", str(self._config)]
        for item in self._overrides:
            cmd += ["--set", item]
        return cmd

    def start(self, timeout_s: float = 20.0) -> DaemonProcess:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process and return at once (several can then start-up side by side)."""
        # A restarted daemon appends to the same file: this object reads only its own lines.
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=self._log,
            env=self._env,
            start_new_session=self._new_session,
        )

    def wait_ready(self, timeout_s: float = 20.0) -> DaemonProcess:
        """Return once the daemon logged "serving"; raise if it exits or times out first."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}: {self.log_text()[-2000:]}"
                )
            if any(e.get("msg") == "serving" for e in self.events()):
                return self
            time.sleep(0.05)
        raise TimeoutError(
            f"{self.name} did not start within {timeout_s} s: {self.log_text()[-2000:]}"
        )

    def log_text(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines so far (other lines are skipped)."""
        return json_lines(self.log_text())

    @property
    def metrics_port(self) -> int:
        """The Prometheus port it serves on (metrics.bind, port 0 included), 0 if none."""
        if self._metrics_port:
            return self._metrics_port
        for event in self.events():
            if event.get("msg") == "serving":
                self._metrics_port = int(event.get("metrics_port") or 0)
                return self._metrics_port
        return 0

    @metrics_port.setter
    def metrics_port(self, port: int) -> None:
        self._metrics_port = port

    @property
    def http_url(self) -> str:
        """http://HOST:PORT of its HTTP door (http.bind, port 0 included), "" if none."""
        for event in self.events():
            if event.get("msg") == "serving" and event.get("http"):
                return f"http://{event['http']}"
        return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time.  Safe to call twice."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def group_left(self) -> list[int]:
        """Processes of its group still running (zombies not counted): only with
        ``new_session``, whose group id is the daemon's pid.  Linux (/proc)."""
        if self.proc is None or not self._new_session:
            return []
        return processes_in_group(self.proc.pid)

    def kill_group(self) -> None:
        """SIGKILL whatever is left of its process group (``new_session`` only)."""
        if self.proc is not None and self._new_session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def processes_in_group(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out
