"""Leader election with real processes: real etcd (1 member, or 3 on loopback), N real daemons
(echo engine) electing a leader through it, a producer load running through everything, and a
fault schedule.  Figures come from the daemons' JSON logs (simulations/election_metrics.py).

    python -m simulations election --daemons 5 --ttl 2 --rounds 5 [--etcd 3] [--json]
    (the command line: simulations/election_cli.py)

Each round: SIGKILL the leader (restart it), SIGTERM the leader (a clean resign: it drains and
exits; restart it), cut the leader off from etcd (every daemon reaches etcd through its own TCP
proxy in this process, simulations/etcd_proxy.py; the cut holds until a TTL after the next
election, then heals), cut a follower off etcd for 2 TTLs (not with --quick), restart one etcd
member, and with --etcd 3 SIGKILL etcd's own leader member (restart it).  Between faults the
cluster is left alone for a quiet period: an election then is a needless failover.  After the
rounds: every etcd member stopped for --etcd-down-s (the data path must keep serving).
Producers resubmit a task with no answer (the client, docs/PROTOCOL.md) and keep the first
Result of an id; tasks_lost counts tasks sent with no ok Result at the end.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipd.tools.client import Client
from gossipd.tools.launcher import DaemonProcess
from gossipd.tools.progress import percentile
from simulations.cluster import Cluster
from simulations.election_metrics import (
    ELECTED,
    STEPPED_DOWN,
    Incarnation,
    elections,
    event_name,
    event_time,
    failover_s,
    leadership_intervals,
    new_terms,
    overlapping_terms,
    parse_log,
    token_regressions,
    unprovoked_elections,
)
from simulations.etcd_proxy import EtcdProxy


@dataclass
class ElectionRun:
    daemons: int = 5
    ttl_s: float = 2.0
    rounds: int = 5
    etcd_members: int = 1
    etcd_down_s: float = 30.0
    quiet_s: float = 5.0  # left alone after each fault has settled
    cut_follower: bool = True  # also cut a follower off etcd each round (no election expected)
    rate_per_s: float = 20.0  # producer load, tasks per second
    etcd_heartbeat_ms: int = 100  # etcd --heartbeat-interval (its default)
    etcd_election_ms: int = 1000  # etcd --election-timeout (its default)
    log_dir: str | None = None
    progress: bool = True


TASK_TOKENS = 4
TASK_S = 0.2  # the echo engine's time for one task

# --quick: short periods for tests (one round with 3 daemons fits in a minute).
QUICK: dict[str, Any] = {"etcd_down_s": 4.0, "quiet_s": 0.5, "cut_follower": False}


class _Tail:
    """One daemon process's leadership log lines, read as the file grows."""

    def __init__(self, daemon: DaemonProcess, offset: int) -> None:
        """``offset``: where this process's lines begin (a restarted daemon appends)."""
        self.daemon = daemon
        self.inc = Incarnation(node=daemon.name)
        self._offset = offset
        self._rest = b""
        self.finished = False  # read to its process's end: the file now holds its successor's

    def poll(self) -> None:
        if self.finished:
            return
        try:
            with self.daemon.log_path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data = self._rest + data
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        for entry in parse_log(data[:cut].decode(errors="replace")):
            if event_name(entry):
                self.inc.events.append(entry)

    @property
    def alive(self) -> bool:
        proc = self.daemon.proc
        return proc is not None and proc.poll() is None and self.inc.died_at is None

    def leading(self) -> int | None:
        """The token this process leads with now (per its log), None if it does not lead."""
        token = None
        for e in self.inc.events:
            name = event_name(e)
            if name == ELECTED:
                token = int(e["token"])
            elif name == STEPPED_DOWN:
                token = None
        return token


def _host_port(endpoint: str) -> tuple[str, int]:
    rest = endpoint.split("://", 1)[-1]
    host, port = rest.rsplit(":", 1)
    return host, int(port)


class ElectionHarness:
    def __init__(self, run: ElectionRun) -> None:
        self.run = run
        self.log_dir = Path(run.log_dir or tempfile.mkdtemp(prefix="gossipd-election-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.tails: list[_Tail] = []  # every incarnation, in start order
        self.current: list[_Tail] = []  # the live incarnation of each daemon index
        self.proxies: list[list[EtcdProxy]] = []  # [daemon][etcd member]
        self.faults: list[dict[str, Any]] = []
        self.quiet: list[tuple[float, float]] = []
        self.failovers: dict[str, list[float]] = {"kill": [], "resign": [], "cut": []}
        self.missing: Counter[str] = Counter()
        self.sent: set[str] = set()
        self.ok: set[str] = set()
        self.errors: Counter[str] = Counter()
        self.extra: dict[str, Any] = {}

    # -- output -------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.run.progress:
            print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    # -- processes ----------------------------------------------------------------------------
    def _start_etcd(self) -> None:
        from tests.etcd_cluster import EtcdCluster  # the etcd fixture of the election tests

        self.etcd = EtcdCluster(
            self.run.etcd_members,
            self.log_dir,
            heartbeat_ms=self.run.etcd_heartbeat_ms,
            election_ms=self.run.etcd_election_ms,
        ).start_all()

    def _overrides(self, i: int) -> list[str]:
        endpoints = json.dumps([p.endpoint for p in self.proxies[i]])
        # (etcd.request_timeout_s is at most half the TTL: 1 s by default, less below 2 s)
        timeout_s = min(1.0, self.run.ttl_s / 2)
        return [
            f"etcd.endpoints={endpoints}",
            f"etcd.ttl_s={self.run.ttl_s}",
            f"etcd.request_timeout_s={timeout_s}",
        ]

    async def _start(self) -> None:
        await asyncio.to_thread(self._start_etcd)
        self.say(f"etcd up: {self.run.etcd_members} member(s) at {self.etcd.endpoints}")
        targets = [_host_port(e) for e in self.etcd.endpoints]
        for _ in range(self.run.daemons):
            self.proxies.append([await EtcdProxy(h, p).start() for h, p in targets])
        self.cluster = Cluster(
            self.run.daemons,
            log_dir=str(self.log_dir),
            extra_overrides=[
                # A task takes about TASK_S: a killed daemon takes some tasks with it.
                f"engine.token_delay_s={TASK_S / TASK_TOKENS}",
                "lifecycle.shutdown_grace_s=3",
            ],
            overrides_for=self._overrides,
        )
        for d in self.cluster.daemons:
            tail = _Tail(d, 0)
            self.tails.append(tail)
            self.current.append(tail)
        await asyncio.to_thread(self.cluster.start)
        await asyncio.to_thread(self.cluster.wait_converged, 60)
        self.say(f"{self.run.daemons} daemons up and converged")

    def _poll(self) -> None:
        for t in self.tails:
            t.poll()

    def leader(self) -> int | None:
        """Index of the live daemon that leads now (highest token if several claim it)."""
        self._poll()
        best: tuple[int, int] | None = None
        for i, tail in enumerate(self.current):
            token = tail.leading() if tail.alive else None
            if token is not None and (best is None or token > best[0]):
                best = (token, i)
        return None if best is None else best[1]

    async def wait_leader(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            index = self.leader()
            if index is not None:
                return index
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no leader within {timeout_s} s (logs in {self.log_dir})")

    async def wait_election(self, after_wall: float, timeout_s: float) -> float | None:
        """Seconds from ``after_wall`` to the first leader_elected after it (None: none)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._poll()
            got = failover_s(after_wall, elections(t.inc for t in self.tails))
            if got is not None:
                return got
            await asyncio.sleep(0.05)
        return None

    async def restart(self, i: int) -> None:
        old = self.current[i]
        await asyncio.to_thread(old.daemon.wait, 30)
        old.poll()
        old.finished = True
        if old.inc.died_at is None:
            old.inc.died_at = time.time()
        new = await asyncio.to_thread(self.cluster.restart, i)
        tail = _Tail(new, new._log_offset)  # it appends to the old process's file
        self.tails.append(tail)
        self.current[i] = tail

    # -- faults -------------------------------------------------------------------------------
    def _fault(self, kind: str, target: str) -> float:
        now = time.time()
        self.faults.append(
            {
                "kind": kind,
                "target": target,
                "t_s": round(time.monotonic() - self.t0, 2),
                "t_wall": now,
            }
        )
        return now

    async def _settle(self) -> None:
        """Wait for a leader and one TTL more (late effects of the fault), then stay quiet."""
        await self.wait_leader(max(30.0, 10 * self.run.ttl_s))
        await asyncio.sleep(self.run.ttl_s + 1.0)
        start = time.time()
        await asyncio.sleep(self.run.quiet_s)
        self.quiet.append((start, time.time()))

    async def _failover(self, kind: str, at: float) -> float | None:
        got = await self.wait_election(at, max(30.0, 10 * self.run.ttl_s))
        if got is None:
            self.missing[kind] += 1
        else:
            self.failovers[kind].append(got)
        return got

    async def kill_leader(self) -> None:
        i = await self.wait_leader(30)
        victim = self.current[i]
        at = self._fault("leader SIGKILL", victim.daemon.name)
        victim.daemon.kill()
        victim.inc.died_at = at
        got = await self._failover("kill", at)
        self.say(f"SIGKILL leader {victim.daemon.name}: next leader after {_fmt(got)}")
        await self.restart(i)

    async def resign_leader(self) -> None:
        i = await self.wait_leader(30)
        victim = self.current[i]
        at = self._fault("leader SIGTERM", victim.daemon.name)
        victim.daemon.terminate()
        got = await self._failover("resign", at)
        self.say(f"SIGTERM leader {victim.daemon.name}: next leader after {_fmt(got)}")
        await self.restart(i)

    async def cut_leader(self) -> None:
        i = await self.wait_leader(30)
        name = self.current[i].daemon.name
        at = self._fault("leader cut off from etcd", name)
        for p in self.proxies[i]:
            p.cut()
        got = await self._failover("cut", at)
        down = await self._wait_stepped_down(i, at)
        self.extra.setdefault("cut_stepdown_s", []).append(None if down is None else round(down, 3))
        if down is not None and got is not None:  # how long nobody led: the safety margin
            self.extra.setdefault("cut_margin_s", []).append(round(got - down, 3))
        self.say(
            f"cut {name} off etcd: stepped down after {_fmt(down)}, next leader after {_fmt(got)}"
        )
        await asyncio.sleep(self.run.ttl_s)
        for p in self.proxies[i]:
            p.heal()

    async def cut_follower(self) -> None:
        """Cut a follower off etcd for 2 TTLs: its candidate key expires, nobody's term should
        change (elections after it are counted under its fault kind)."""
        leader = await self.wait_leader(30)
        i = (leader + 1) % len(self.current)
        name = self.current[i].daemon.name
        at = self._fault("follower cut off from etcd", name)
        for p in self.proxies[i]:
            p.cut()
        await asyncio.sleep(2 * self.run.ttl_s)
        for p in self.proxies[i]:
            p.heal()
        self._poll()
        changed = [e for e in elections(t.inc for t in self.tails) if e[0] >= at]
        self.say(
            f"cut follower {name} off etcd for {2 * self.run.ttl_s} s: {len(changed)} elections"
        )

    async def _wait_stepped_down(self, i: int, at: float) -> float | None:
        deadline = time.monotonic() + 3 * self.run.ttl_s + 2.0
        while time.monotonic() < deadline:
            got = self._stepped_down_after(i, at)
            if got is not None:
                return got
            await asyncio.sleep(0.05)
        return None

    def _stepped_down_after(self, i: int, at: float) -> float | None:
        self._poll()
        for e in self.current[i].inc.events:
            if event_name(e) == STEPPED_DOWN and event_time(e) >= at:
                return event_time(e) - at
        return None

    def _etcdctl(self, *args: str) -> Any:
        """etcdctl's JSON answer (-w json) on every member, None if it failed."""
        out = subprocess.run(
            ["etcdctl", f"--endpoints={','.join(self.etcd.endpoints)}", *args, "-w", "json"],
            capture_output=True,
            text=True,
            env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            timeout=10,
        )
        try:
            return json.loads(out.stdout)
        except json.JSONDecodeError:
            return None

    def _granted_ttls(self) -> list[int]:
        """The TTLs etcd granted the daemons' leases (it raises a TTL below its minimum)."""
        leases = (self._etcdctl("lease", "list") or {}).get("leases") or []
        out = []
        for lease in leases:
            answer = self._etcdctl("lease", "timetolive", format(int(lease["id"]), "x"))
            if answer is not None:
                out.append(int(answer["granted-ttl"]))
        return sorted(out)

    def _etcd_leader_member(self) -> int:
        """Index of etcd's own raft leader among the members (etcdctl endpoint status)."""
        statuses = self._etcdctl("endpoint", "status") or []
        for k, s in enumerate(statuses):
            header = s["Status"]["header"]
            if header["member_id"] == s["Status"]["leader"]:
                return k
        return 0

    async def restart_etcd_member(self, j: int) -> None:
        at = self._fault("etcd restart", f"member {j}")
        await asyncio.to_thread(self.etcd.stop, j)
        await asyncio.to_thread(self.etcd.start, j)
        await asyncio.to_thread(self.etcd.wait_healthy)
        self.say(f"etcd member {j} restarted in {time.time() - at:.2f} s")

    async def kill_etcd_leader(self) -> None:
        j = await asyncio.to_thread(self._etcd_leader_member)
        at = self._fault("etcd member SIGKILL", f"member {j} (etcd's leader)")
        await asyncio.to_thread(self.etcd.kill, j)
        await asyncio.sleep(self.run.ttl_s + 1.0)
        await asyncio.to_thread(self.etcd.start, j)
        await asyncio.to_thread(self.etcd.wait_healthy)
        self.say(
            f"etcd member {j} (its leader) SIGKILLed, restarted after {time.time() - at:.2f} s"
        )

    async def etcd_down(self) -> None:
        before = self.leader()
        at = self._fault("etcd stopped", f"all {self.run.etcd_members} member(s)")
        for j in range(self.run.etcd_members):
            await asyncio.to_thread(self.etcd.stop, j)
        sent_before = len(self.sent)
        await asyncio.sleep(self.run.etcd_down_s)
        down = None if before is None else self._stepped_down_after(before, at)
        self.extra["etcd_down_stepdown_s"] = None if down is None else round(down, 3)
        self.extra["etcd_down_tasks_sent"] = len(self.sent) - sent_before
        back = time.time()
        for j in range(self.run.etcd_members):
            await asyncio.to_thread(self.etcd.start, j)
        await asyncio.to_thread(self.etcd.wait_healthy)
        etcd_back = time.time()
        got = await self.wait_election(back, max(30.0, 10 * self.run.ttl_s))
        self.extra["etcd_back_s"] = round(etcd_back - back, 3)
        self.extra["etcd_back_leader_s"] = None if got is None else round(got, 3)
        self.say(
            f"etcd stopped {self.run.etcd_down_s} s: leader stepped down after "
            f"{_fmt(down)}; etcd back after {etcd_back - back:.2f} s, "
            f"leader again {_fmt(got)} after starting etcd"
        )

    # -- load ---------------------------------------------------------------------------------
    async def _load(self, stop: asyncio.Event) -> None:
        endpoints = [d.endpoint for d in self.cluster.daemons]
        waiters: set[asyncio.Task[None]] = set()
        async with Client(endpoints, resubmit_after_s=2.0, outstanding_max=5000) as client:

            async def wait(handle) -> None:  # type: ignore[no-untyped-def]
                result = await handle.result()
                if result.ok:
                    self.ok.add(handle.id)
                else:
                    self.errors[result.error.code] += 1

            period_s = 1.0 / self.run.rate_per_s
            n = 0
            while not stop.is_set():
                handle = await client.submit(
                    f"task {n}", key=f"key-{n % 97}", max_tokens=TASK_TOKENS, timeout_s=120
                )
                self.sent.add(handle.id)
                task = asyncio.ensure_future(wait(handle))
                waiters.add(task)
                task.add_done_callback(waiters.discard)
                n += 1
                await asyncio.sleep(period_s)
            self.say(f"load stopped after {n} tasks; waiting for {len(waiters)} results")
            await asyncio.gather(*list(waiters))
            self.extra["client"] = {
                k: getattr(client.statistics(), k)
                for k in ("resubmitted", "retried", "duplicate_results")
            }

    # -- the run ------------------------------------------------------------------------------
    async def main(self) -> dict[str, Any]:
        try:
            await self._start()
            await self.wait_leader(max(30.0, 10 * self.run.ttl_s))
            granted = await asyncio.to_thread(self._granted_ttls)
            self.extra["etcd_granted_ttl_s"] = sorted(set(granted))
            self.say(f"leader elected; etcd granted lease TTLs {sorted(set(granted))} s")
            stop = asyncio.Event()
            load = asyncio.ensure_future(self._load(stop))
            await self._settle()
            for r in range(self.run.rounds):
                self.say(f"round {r + 1}/{self.run.rounds}")
                await self.kill_leader()
                await self._settle()
                await self.resign_leader()
                await self._settle()
                await self.cut_leader()
                await self._settle()
                if self.run.cut_follower:
                    await self.cut_follower()
                    await self._settle()
                await self.restart_etcd_member(r % self.run.etcd_members)
                await self._settle()
                if self.run.etcd_members >= 3:
                    await self.kill_etcd_leader()
                    await self._settle()
            if self.run.etcd_down_s > 0:
                await self.etcd_down()
                await self._settle()
            stop.set()
            await load
            return self.report()
        finally:
            await asyncio.to_thread(self._stop)
            for proxies in self.proxies:  # (their listening sockets and pumps)
                for proxy in proxies:
                    await proxy.close()

    def _stop(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.stop()
        etcd = getattr(self, "etcd", None)
        if etcd is not None:
            etcd.close()

    def report(self) -> dict[str, Any]:
        self._poll()
        end = time.time()
        incs = [t.inc for t in self.tails]
        intervals = leadership_intervals(incs, end)
        overlaps = overlapping_terms(intervals)
        # The same, ending each term at its step-down's log line alone (stricter).
        logged = overlapping_terms(leadership_intervals(incs, end, lease_until=False))
        regressions = token_regressions(incs)
        elected = elections(incs)
        unprovoked = unprovoked_elections(elected, self.quiet)
        # Elections each kind of fault was followed by, until the quiet period after it.
        quiet_starts = sorted(a for a, _ in self.quiet)
        caused: Counter[str] = Counter()
        changed: Counter[str] = Counter()
        fresh = new_terms(elected)
        for f in self.faults:
            until = next((a for a in quiet_starts if a > f["t_wall"]), end)
            caused[f["kind"]] += sum(1 for e in elected if f["t_wall"] <= e[0] < until)
            changed[f["kind"]] += sum(1 for e in fresh if f["t_wall"] <= e[0] < until)
        out: dict[str, Any] = {
            "daemons": self.run.daemons,
            "ttl_s": self.run.ttl_s,
            "rounds": self.run.rounds,
            "etcd_members": self.run.etcd_members,
            "etcd_heartbeat_ms": self.run.etcd_heartbeat_ms,
            "etcd_election_ms": self.run.etcd_election_ms,
        }
        for kind, values in self.failovers.items():
            s = sorted(values)
            out[f"failover_{kind}_p50_s"] = round(percentile(s, 50), 3) if s else None
            out[f"failover_{kind}_p99_s"] = round(percentile(s, 99), 3) if s else None
            out[f"failover_{kind}_n"] = len(s)
            out[f"failover_{kind}_missing"] = self.missing[kind]
        out.update(
            {
                "overlapping_terms": len(overlaps),
                "overlapping_terms_by_log_time": len(logged),
                "token_regressions": len(regressions),
                "tasks_sent": len(self.sent),
                "tasks_ok": len(self.ok & self.sent),
                "tasks_lost": len(self.sent - self.ok),
                "task_errors": dict(self.errors),
                "elections": len(elected),
                "terms": len(intervals),
                "unprovoked_elections": len(unprovoked),
                "elections_after_fault": dict(caused),
                "new_terms_after_fault": dict(changed),
                "quiet_s": round(sum(b - a for a, b in self.quiet), 1),
                **self.extra,
                "problems": [
                    f"overlap: {a.node} token {a.token} [{a.start:.3f}, {a.end:.3f}] and "
                    f"{b.node} token {b.token} [{b.start:.3f}, {b.end:.3f}]"
                    for a, b in overlaps[:10]
                ]
                + regressions[:10],
                "faults": self.faults,
                "elapsed_s": round(time.monotonic() - self.t0, 1),
                "log_dir": str(self.log_dir),
            }
        )
        return out


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f} s"


def run_election(run: ElectionRun) -> dict[str, Any]:
    return asyncio.run(ElectionHarness(run).main())
