"""What the bed measures while a scenario runs: each daemon's view of the member set, its
memory, and the leaders the daemons logged.

``Watcher`` runs one thread per host inside that host's namespace (setns), so a daemon's
``/metrics`` (``metrics.bind`` on its host's address) is read from its own host, cut off or
not; every ``interval_s`` it records, per daemon, ``gossipd_members{state}`` (members known,
not counting itself) and its RSS (``/proc/PID/status``; VmHWM for the peak of each life).
From those samples: when every daemon sees every other alive.  How long each side of a cut
took to see the other side gone comes from the daemons' own logged member events instead
(``cut_detection``), stamped when each daemon decided, without the samples' lag.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from simulations.hosts_deploy import Deployment, HostDeploy, metrics_port
from simulations.hosts_net import enter_netns
from simulations.hosts_units import Unit

_MEMBERS_RE = re.compile(r'^gossipd_members\{state="(\w+)"\}\s+([0-9.e+]+)', re.M)


def read_members(addr: str, port: int, timeout_s: float = 1.0, token: str = "") -> dict[str, int]:
    """``gossipd_members`` by state from a daemon's /metrics (run inside its host), with the
    bearer token where ``metrics.bearer_token_file`` asks one (OPERATIONS.md's node)."""
    request = urllib.request.Request(f"http://{addr}:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        text = answer.read().decode()
    return {state: int(float(value)) for state, value in _MEMBERS_RE.findall(text)}


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return 0, 0
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M))
    return int(found.get("VmRSS", 0)), int(found.get("VmHWM", 0))


def _metrics_token(hd: HostDeploy) -> str:
    """The host's metrics token (OPERATIONS.md step 5 makes one), "" where it has none."""
    try:
        return (hd.root / "etc/gossipd/metrics.token").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


@dataclass
class Sample:
    t: float  # monotonic
    node: str
    alive: int
    suspect: int
    dead: int


@dataclass
class Watcher:
    deployment: Deployment
    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    rss_max_kib: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Watcher:
        for hd in self.deployment.hosts:
            thread = threading.Thread(
                target=self._watch, args=(hd,), daemon=True, name=f"watch-{hd.node}"
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)

    def _watch(self, hd: HostDeploy) -> None:
        enter_netns(hd.host.netns)
        while not self._stop.wait(self.interval_s):
            for unit in hd.units:
                pid = unit.pid
                if pid is None or unit.paused:
                    continue
                _rss, hwm = rss_kib(pid)
                with self._lock:
                    self.rss_max_kib[unit.name] = max(self.rss_max_kib.get(unit.name, 0), hwm)
                try:
                    port = metrics_port(int(unit.instance))
                    counts = read_members(hd.host.addr, port, token=_metrics_token(hd))
                except (OSError, ValueError, http.client.HTTPException):
                    # Starting, or stopped (a daemon that stops mid-answer cuts it short:
                    # IncompleteRead, which once ended this thread in a rolling drain).
                    continue
                with self._lock:
                    self.samples.append(
                        Sample(
                            time.monotonic(),
                            unit.name,
                            counts.get("alive", 0),
                            counts.get("suspect", 0),
                            counts.get("dead", 0),
                        )
                    )

    def latest(self, after: float = 0.0) -> dict[str, Sample]:
        with self._lock:
            out: dict[str, Sample] = {}
            for s in self.samples:
                if s.t >= after:
                    out[s.node] = s
            return out

    def all_alive_since(self, t0: float, nodes: Sequence[str]) -> float | None:
        """The first time after t0 at which every node's latest sample (taken after t0)
        shows all the others alive; None if not yet."""
        want = len(nodes) - 1
        last: dict[str, int] = {}
        with self._lock:
            samples = [s for s in self.samples if s.t >= t0]
        for s in samples:
            last[s.node] = s.alive
            if len(last) == len(nodes) and all(last.get(n) == want for n in nodes):
                return s.t
        return None

    def wait_all_alive(
        self, nodes: Sequence[str], timeout_s: float, since: float | None = None
    ) -> float:
        """Seconds from ``since`` (default now) until every node sees all others alive."""
        t0 = time.monotonic() if since is None else since
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.deployment.supervise()
            t = self.all_alive_since(t0, nodes)
            if t is not None:
                return t - t0
            time.sleep(0.05)
        raise TimeoutError(
            f"not all {len(nodes)} members alive everywhere within {timeout_s} s: "
            f"{ {n: s.alive for n, s in self.latest(t0).items()} }"
        )


def member_events(unit: Unit, since_wall: float) -> list[tuple[float, str, str]]:
    """(ts, member, event) of the "member" lines ``unit`` logged at or after ``since_wall``
    (wall-clock seconds, the logs' ``ts``)."""
    try:
        text = unit.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        if '"msg": "member"' not in line and '"msg":"member"' not in line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        ts = event.get("ts")
        if isinstance(ts, (int, float)) and ts >= since_wall:
            out.append((float(ts), str(event.get("member")), str(event.get("event"))))
    return sorted(out)


_NOT_ALIVE = {"suspect", "dead", "left"}


def saw_all_gone(unit: Unit, t_cut_wall: float, others: Sequence[str]) -> float | None:
    """Seconds from the cut until ``unit`` first held every one of ``others`` not alive at
    once, from the member events it logged (each stamped when the daemon decided it, so no
    sampling lag); None if it never did."""
    gone: set[str] = set()
    for ts, member, event in member_events(unit, t_cut_wall):
        if member not in others:
            continue
        if event in _NOT_ALIVE:
            gone.add(member)
        elif event in ("alive", "joined"):
            gone.discard(member)
        if len(gone) == len(others):
            return ts - t_cut_wall
    return None


def cut_detection(t_cut_wall: float, cut: Sequence[Unit], rest: Sequence[Unit]) -> dict[str, Any]:
    """How long each side of a cut took to see the whole other side not alive (suspect or
    dead): the slowest daemon of each side, seconds; None where a daemon never saw it.  From
    the daemons' own logged member events: the watcher's /metrics samples would add up to
    its interval plus a scrape's latency on a loaded machine."""
    cut_names = [u.name for u in cut]
    rest_names = [u.name for u in rest]
    inside = [saw_all_gone(u, t_cut_wall, rest_names) for u in cut]
    outside = [saw_all_gone(u, t_cut_wall, cut_names) for u in rest]

    def slowest(times: list[float | None]) -> float | None:
        return None if not times or any(t is None for t in times) else round(max(times), 2)  # type: ignore[type-var]

    return {
        "cut_side_s": slowest(inside),
        "other_side_s": slowest(outside),
        "cut_side_each_s": [None if t is None else round(t, 2) for t in inside],
        "other_side_each_s": [None if t is None else round(t, 2) for t in outside],
    }


def leaders_per_term(units: Sequence[Unit]) -> dict[str, list[str]]:
    """Term (fencing token) -> the nodes that logged ``leader_elected`` for it."""
    terms: dict[str, set[str]] = {}
    for unit in units:
        try:
            text = unit.log_path.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            if '"leader_elected"' not in line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            terms.setdefault(str(event.get("token")), set()).add(str(event.get("node")))
    return {term: sorted(nodes) for term, nodes in sorted(terms.items())}


def log_count(units: Sequence[Unit], needle: str) -> dict[str, int]:
    """Lines containing ``needle`` per daemon log (e.g. rate-limited error lines)."""
    out = {}
    for unit in units:
        try:
            out[unit.name] = unit.log_path.read_text(errors="replace").count(needle)
        except FileNotFoundError:
            out[unit.name] = 0
    return out
