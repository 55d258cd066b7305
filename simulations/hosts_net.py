"""The test bed's network: hosts as network namespaces on a bridge, and the faults done to them.

Every name starts with ``gsdbed-`` (namespaces ``gsdbed-h0``.. and ``gsdbed-prod``, the bridge
``gsdbed-br``, veth pairs ``gsdbed-vN`` on the bridge / ``gsdbed-eN`` in host N), every
address is in 10.213.47.0/24 (the bridge .1, host N .11+N, the producer .200), and the hosts
get no default route: nothing leaves the /24.  ``Net.create`` first removes what a crashed run
left with the same prefix (its processes, by the PIDs ``ip netns pids`` gives), and
``Net.destroy`` (called from ``finally`` and at exit) removes everything again.  A lock file
keeps two beds from tearing each other down.

Faults (../shared/facts/netns.md): a cut is the host's veth set down inside its namespace (the
host keeps its own address and loopback: its own daemons still see each other), healed by
setting it up; loss is an nftables table in the host's namespace dropping a share of packets
in and out (``nft`` must exist: ``loss_available`` says why not otherwise).  ``in_netns`` runs
a function in a thread that entered a host's namespace (setns), e.g. to read a daemon's
metrics from inside its host while that host is cut off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

PREFIX = "gsdbed-"
BRIDGE = f"{PREFIX}br"
SUBNET = "10.213.47"
BRIDGE_ADDR = f"{SUBNET}.1"
PRODUCER_ADDR = f"{SUBNET}.200"
LOCK_PATH = "/run/gsdbed.lock"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class BedUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`): the message says what is missing."""


def why_unavailable() -> str | None:
    """None when this process can make the bed; else what is missing."""
    if os.geteuid() != 0:
        return "the host test bed needs root (network namespaces, a bridge): run as root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the host test bed needs `{tool}` (apt-get install iproute2 util-linux mount)"
    return None


def loss_available() -> str | None:
    """None when nftables can drop packets here; else why not."""
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables): no packet loss"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # "h0".. or "prod"
    index: int  # 0.. for hosts, 200 for the producer
    addr: str

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def veth_outer(self) -> str:
        return f"{PREFIX}v{self.name}"

    @property
    def dev(self) -> str:  # inside the namespace
        return f"{PREFIX}e{self.name}"


def host_addr(index: int) -> str:
    return f"{SUBNET}.{11 + index}"


@dataclass
class Net:
    hosts: list[Host]
    producer: Host
    _lock_fd: int | None = None
    _created: bool = False
    _lossy: set[str] = field(default_factory=set)

    @classmethod
    def plan(cls, n_hosts: int) -> Net:
        if not 1 <= n_hosts <= 100:
            raise ValueError(f"--hosts: 1..100, found {n_hosts}")
        hosts = [Host(f"h{i}", i, host_addr(i)) for i in range(n_hosts)]
        return cls(hosts=hosts, producer=Host("prod", 200, PRODUCER_ADDR))

    @property
    def all_hosts(self) -> list[Host]:
        return [*self.hosts, self.producer]

    def create(self) -> Net:
        problem = why_unavailable()
        if problem is not None:
            raise BedUnavailable(problem)
        self._lock()
        remove_leftovers()
        self._created = True
        atexit.register(self.destroy)
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for host in self.all_hosts:
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth_outer, "type", "veth", "peer", "name", host.dev)
            _ip("link", "set", host.veth_outer, "master", BRIDGE)
            _ip("link", "set", host.veth_outer, "up")
            _ip("link", "set", host.dev, "netns", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            _ip("-n", host.netns, "link", "set", host.dev, "up")
        return self

    def _lock(self) -> None:
        fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BedUnavailable(
                f"another host test bed runs on this machine ({LOCK_PATH} is locked): wait for "
                "it to end"
            ) from None
        self._lock_fd = fd

    def destroy(self) -> None:
        """Remove the namespaces and links (processes in them stopped by PID).  Idempotent."""
        if self._created:
            self._created = False
            remove_leftovers()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- faults ---------------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        _ip("-n", host.netns, "link", "set", host.dev, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", host.netns, "link", "set", host.dev, "up")

    def loss_on(self, host: Host, percent: int) -> None:
        """Drop ``percent`` % of the packets entering and leaving ``host`` (nftables)."""
        if not 0 < percent < 100:
            raise ValueError(f"loss: 1..99 %, found {percent}")
        problem = loss_available()
        if problem is not None:
            raise BedUnavailable(problem)
        rules = (
            "table inet gsdbed_loss {\n"
            "  chain input { type filter hook input priority 0; policy accept;\n"
            f'    iifname "{host.dev}" numgen random mod 100 < {percent} counter drop\n  }}\n'
            "  chain output { type filter hook output priority 0; policy accept;\n"
            f'    oifname "{host.dev}" numgen random mod 100 < {percent} counter drop\n  }}\n'
            "}\n"
        )
        subprocess.run(
            ["ip", "netns", "exec", host.netns, "nft", "-f", "-"],
            input=rules,
            check=True,
            capture_output=True,
            text=True,
        )
        self._lossy.add(host.netns)

    def loss_dropped(self, host: Host) -> int:
        """Packets the loss table dropped so far (its counters)."""
        out = subprocess.run(
            ["ip", "netns", "exec", host.netns, "nft", "list", "table", "inet", "gsdbed_loss"],
            capture_output=True,
            text=True,
        ).stdout
        total = 0
        for word_before, word in zip(out.split(), out.split()[1:], strict=False):
            if word_before == "packets":
                total += int(word)
        return total

    def loss_off(self, host: Host) -> None:
        subprocess.run(
            ["ip", "netns", "exec", host.netns, "nft", "delete", "table", "inet", "gsdbed_loss"],
            capture_output=True,
        )
        self._lossy.discard(host.netns)


def remove_leftovers() -> list[str]:
    """Delete every ``gsdbed-`` namespace (SIGKILL of the processes in it, by PID) and link."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1:
            name = parts[1].split("@")[0]
            if name.startswith(PREFIX):
                _ip("link", "del", name, check=False)
                removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(netns: str) -> None:
    """Move the calling thread into namespace ``netns`` (setns; other threads stay put)."""
    with open(f"/run/netns/{netns}") as f:
        if _libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")


def in_netns(netns: str, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """``fn()`` run in a fresh thread inside ``netns``; its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(netns)
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"in-{netns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{netns}: no answer within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
