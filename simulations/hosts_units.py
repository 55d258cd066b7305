"""Running a rendered gossipd@.service as systemd would, on a bed host (there is no systemd as
PID 1 here, and the bed must not touch the machine's own /etc).

What the bed reads from the unit and applies (the rest is listed in ``NOT_APPLIED``):

- ``ExecStart=`` with ``%i`` expanded (``gossipd.ops.systemd.exec_start_argv``);
- ``Environment=`` (``%i``, ``%S`` = /var/lib, ``%C`` = /var/cache, ``%%``), then every
  ``EnvironmentFile=`` over it (systemd: a file's variables win over ``Environment=``), the
  unit's own lines first, then its drop-ins (``gossipd@.service.d/*.conf``, then
  ``gossipd@N.service.d/*.conf``, each directory in name order);
- ``Type=notify``: the instance is started when it sends READY=1 to its ``NOTIFY_SOCKET``
  (``WATCHDOG_USEC`` is set from ``WatchdogSec=`` and the pings are counted, not enforced);
- ``Restart=on-failure`` with ``RestartSec=``, ``StartLimitBurst=`` in
  ``StartLimitIntervalSec=``: an instance that exits non-zero, or dies of a signal other than
  SIGTERM/SIGINT/SIGHUP/SIGPIPE, is started again (the rolling drain's exit 75 relies on it);
- ``KillSignal=`` and ``TimeoutStopSec=`` for a stop.

The unit's absolute paths resolve to the host's own root directory: each instance runs as
``ip netns exec gsdbed-hN unshare --mount --uts --propagation private sh -c SCRIPT``, where
SCRIPT names the host ``hN`` (its own hostname, so `<hostname>-gpuN` ids differ) and
bind-mounts the host's ``etc/gossipd``, ``var/lib/gossipd``, ``var/cache/gossipd`` and
``opt/gossipd`` (a link to the virtual environment running the bed, as OPERATIONS.md links
/opt/gossipd to a version) onto ``/etc/gossipd``, ``/var/lib/gossipd``, ``/var/cache/gossipd``
and ``/opt/gossipd``, then execs ExecStart.  A mount point that does not exist is made inside
an overlay of its parent whose upper layer is the instance's scratch directory, so nothing on
the machine's own file system changes.  The mounts live in the instance's private mount
namespace; the process keeps its PID through every exec, so it is signalled by that PID.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gossipd.ops.systemd import exec_start_argv, read_env_file

# Paths of the unit resolved under the host's root directory (the bed's substitution).
HOST_PATHS = ("/etc/gossipd", "/var/lib/gossipd", "/var/cache/gossipd", "/opt/gossipd")
NOT_APPLIED = [
    "User=/Group= (the bed has no gossipd user: daemons run as root)",
    "the sandbox (ProtectSystem=, SystemCallFilter=, DeviceAllow=...: needs systemd)",
    "CPUAffinity=/NUMAPolicy= of numa.conf (the fake topology's CPUs are not this machine's)",
    "WatchdogSec= enforcement (WATCHDOG_USEC is set and pings counted; no restart on silence)",
    "StateDirectory=/CacheDirectory= creation by systemd (the bed makes them, 0750)",
]
CLEAN_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE}
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _expand(text: str, instance: str) -> str:
    text = text.replace("%%", "\0").replace("%i", instance)
    text = text.replace("%S", "/var/lib").replace("%C", "/var/cache")
    if "%" in text:
        raise ValueError(f"a specifier the bed does not expand: {text}")
    return text.replace("\0", "%")


@dataclass
class UnitSettings:
    """What one instance's unit (with its drop-ins) says, specifiers expanded."""

    argv: list[str]
    environment: dict[str, str]  # Environment= lines, in order
    environment_files: list[str]  # EnvironmentFile= paths (unit paths), in order
    restart: str = "no"
    restart_sec: float = 0.1
    start_limit_burst: int = 5
    start_limit_interval_s: float = 10.0
    kill_signal: int = signal.SIGTERM
    timeout_stop_s: float = 90.0
    watchdog_s: float = 0.0
    notify: bool = False


def read_unit(unit_dir: Path, instance: str) -> UnitSettings:
    """``unit_dir/gossipd@.service`` and its drop-ins for ``instance`` (e.g. "1")."""
    service = (unit_dir / "gossipd@.service").read_text()
    texts = [service]
    for drop_dir in (unit_dir / "gossipd@.service.d", unit_dir / f"gossipd@{instance}.service.d"):
        if drop_dir.is_dir():
            texts += [p.read_text() for p in sorted(drop_dir.glob("*.conf"))]
    settings = UnitSettings(
        argv=exec_start_argv(service, instance), environment={}, environment_files=[]
    )
    for text in texts:
        for raw in text.splitlines():
            key, sep, value = raw.strip().partition("=")
            if not sep or raw.startswith(("#", ";")):
                continue
            value = value.strip()
            if key == "Environment":
                for word in shlex.split(value):
                    name, _, val = word.partition("=")
                    settings.environment[name] = _expand(val, instance)
            elif key == "EnvironmentFile":
                settings.environment_files.append(_expand(value, instance))
            elif key == "Restart":
                settings.restart = value
            elif key == "RestartSec":
                settings.restart_sec = float(value.rstrip("s"))
            elif key == "StartLimitBurst":
                settings.start_limit_burst = int(value)
            elif key == "StartLimitIntervalSec":
                settings.start_limit_interval_s = float(value.rstrip("s"))
            elif key == "KillSignal":
                settings.kill_signal = int(getattr(signal, value))
            elif key == "TimeoutStopSec":
                settings.timeout_stop_s = float(value.rstrip("s"))
            elif key == "WatchdogSec":
                settings.watchdog_s = float(value.rstrip("s"))
            elif key == "Type":
                settings.notify = value == "notify"
    return settings


def mount_script(host_root: Path, scratch: Path, hostname: str) -> str:
    """The sh script that makes HOST_PATHS resolve under ``host_root`` and names the host
    ``hostname`` (its own UTS namespace: `<hostname>-gpuN` node ids differ), then execs "$@"."""
    lines = ["set -e", f"hostname {shlex.quote(hostname)}"]
    overlaid: set[str] = set()
    for n, target in enumerate(HOST_PATHS):
        source = host_root / target.lstrip("/")
        missing = Path(target)
        parent = missing.parent
        while not parent.exists():
            parent = parent.parent
        if not Path(target).exists() and str(parent) not in overlaid:
            if parent == Path("/"):
                raise RuntimeError(f"{target}: no parent directory to overlay")
            up, work = scratch / f"o{n}" / "up", scratch / f"o{n}" / "work"
            up.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            lines.append(
                f"mount -t overlay gsdbed -o lowerdir={parent},upperdir={up},workdir={work} "
                f"{parent}"
            )
            overlaid.add(str(parent))
        lines.append(f"mkdir -p {target}")
        lines.append(f"mount --bind {shlex.quote(str(source.resolve()))} {target}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def host_command(netns: str, host_root: Path, scratch: Path, argv: list[str]) -> list[str]:
    """``argv`` run in host ``netns`` with the host's paths mounted (see the module doc)."""
    if scratch.exists():
        shutil.rmtree(scratch)  # overlay layers must start empty
    scratch.mkdir(parents=True)
    script = mount_script(host_root, scratch, netns.removeprefix("gsdbed-"))
    return [
        "ip",
        "netns",
        "exec",
        netns,
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "gsdbed-unit",
        *argv,
    ]


@dataclass
class Unit:
    """One instance, ``gossipd@N`` on one host, supervised as systemd would."""

    name: str  # its node id, "h0-gpu1"
    host: str  # "h0"
    netns: str
    instance: str  # "1"
    host_root: Path
    unit_dir: Path  # the host's etc/systemd/system
    run_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)
    ready_at: float | None = None
    failed: str = ""  # why systemd would have given up on it
    exits: list[int] = field(default_factory=list)
    watchdog_pings: int = 0
    stopped_by_bed: bool = False
    paused: bool = False
    _notify: socket.socket | None = None
    _restart_at: float | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def host_file(self, unit_path: str) -> Path:
        """A path the unit names, as the host's root directory holds it."""
        if unit_path.startswith(HOST_PATHS):
            return self.host_root / unit_path.lstrip("/")
        return Path(unit_path)

    def environment(self, settings: UnitSettings, notify_path: str) -> dict[str, str]:
        env = {"PATH": BASE_PATH, "LANG": "C.UTF-8", "INVOCATION_ID": os.urandom(16).hex()}
        if os.environ.get("PYTHONPATH"):  # a source tree under test, ahead of the venv's copy
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update(settings.environment)
        for path in settings.environment_files:
            optional = path.startswith("-")
            file = self.host_file(path.lstrip("-"))
            if not file.exists():
                if optional:
                    continue
                raise FileNotFoundError(f"{self.name}: Failed to load environment files: {path}")
            env.update(read_env_file(file.read_text()))
        if settings.notify:
            env["NOTIFY_SOCKET"] = notify_path
        if settings.watchdog_s:
            env["WATCHDOG_USEC"] = str(int(settings.watchdog_s * 1e6))
        return env

    def start(self) -> None:
        """Start it now (as `systemctl start`): returns at once; ``wait_ready`` for READY=1."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        settings = read_unit(self.unit_dir, self.instance)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        notify_path = str(self.run_dir / f"notify-{self.instance}.sock")
        if self._notify is not None:
            self._notify.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(notify_path)
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(notify_path)
        self._notify.setblocking(False)
        env = self.environment(settings, notify_path)
        argv = host_command(
            self.netns, self.host_root, self.run_dir / f"mnt-{self.instance}", settings.argv
        )
        log = self.log_path.open("ab")
        log.write(f"-- gsdbed: starting {self.name}: {shlex.join(settings.argv)}\n".encode())
        log.flush()
        self.ready_at = None
        self.stopped_by_bed = False
        self.paused = False
        self._restart_at = None
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=log,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
        )
        log.close()
        self.starts.append(time.monotonic())

    def poll(self) -> None:
        """Read notifications; restart per Restart=on-failure.  Called by the supervisor."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        while self._notify is not None:
            try:
                message = self._notify.recv(4096).decode(errors="replace")
            except BlockingIOError:
                break
            for line in message.splitlines():
                if line == "READY=1" and self.ready_at is None:
                    self.ready_at = time.monotonic()
                elif line == "WATCHDOG=1":
                    self.watchdog_pings += 1
        if self.proc is None or self.proc.poll() is None or self.failed:
            return
        now = time.monotonic()
        if self._restart_at is None:
            code = self.proc.returncode
            self.exits.append(code)
            if self.stopped_by_bed or not _restarts(read_unit(self.unit_dir, self.instance), code):
                self._restart_at = float("inf")
                return
            settings = read_unit(self.unit_dir, self.instance)
            recent = [t for t in self.starts if now - t < settings.start_limit_interval_s]
            if len(recent) >= settings.start_limit_burst:
                self.failed = "start request repeated too quickly"
                return
            self._restart_at = now + settings.restart_sec
        if now >= self._restart_at:
            self._start()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            if self.ready_at is not None and self.pid is not None:
                return
            if self.failed:
                break
            time.sleep(0.05)
        raise RuntimeError(
            f"{self.name} not ready within {timeout_s} s "
            f"(exits {self.exits}, {self.failed or 'no READY=1'}): "
            f"{self.log_tail()}"
        )

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL: a crash (systemd restarts it, Restart=on-failure)."""
        self.signal(signal.SIGKILL)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def stop(self, wait: bool = True) -> None:
        """`systemctl stop`: KillSignal=, then SIGKILL after TimeoutStopSec=."""
        if self.proc is None or self.proc.poll() is not None:
            self.stopped_by_bed = True
            return
        settings = read_unit(self.unit_dir, self.instance)
        self.stopped_by_bed = True
        if self.paused:
            self.resume()
        self.signal(settings.kill_signal)
        if wait:
            self.wait_stopped(settings.timeout_stop_s)

    def wait_stopped(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self._notify is not None:
            self._notify.close()
            self._notify = None


def _restarts(settings: UnitSettings, code: int) -> bool:
    if settings.restart == "always":
        return True
    if settings.restart != "on-failure":
        return False
    if code < 0:
        return -code not in CLEAN_SIGNALS
    return code != 0
