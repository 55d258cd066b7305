"""The leader's duties with real etcd (TTL 2 s) and real daemons: a daemon that knows only the
etcd endpoints joins through the seeds the leader keeps there; reaping shrinks every
member's table; a rolling drain of 3 daemons under load loses nothing, and resumes when the
leader is killed between two steps (`gossipd cluster drain --rolling`, the real command)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import aetcd
import msgspec
import pytest

from gossipd.core import rollout
from gossipd.tools.admin import ask_status
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from simulations.cluster import Cluster
from simulations.stopping import SoakProducer
from tests.etcd_cluster import EtcdCluster
from tests.helpers import wait_until

TTL_S = 2.0
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def etcd_get(etcd: EtcdCluster, key: str) -> bytes | None:
    async def get() -> bytes | None:
        host, port = etcd.endpoints[0].rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            got = await client.get(key.encode())
            return None if got is None else got.value

    return asyncio.run(get())


def etcd_overrides(etcd: EtcdCluster, *more: str) -> list[str]:
    return [
        f"etcd.endpoints={json.dumps(etcd.endpoints)}",
        f"etcd.ttl_s={TTL_S}",
        "gossip.meta_publish_min_s=0.3",
        "gossip.meta_sample_s=0.2",
        *more,
    ]


def leader_of(daemons: list[DaemonProcess]) -> str | None:
    for d in daemons:
        if d.proc is None or d.proc.poll() is not None:
            continue
        last = [e for e in d.events() if e.get("msg") in ("leader_elected", "leader_stepped_down")]
        if last and last[-1]["msg"] == "leader_elected":
            return d.name
    return None


def table(daemon: DaemonProcess) -> set[str] | None:
    """The members in ``daemon``'s table (any state), from its own status report."""
    report = ask_status([daemon.endpoint], 2.0)[daemon.endpoint]
    return None if isinstance(report, str) else {m.node for m in report.members}


def states(daemon: DaemonProcess) -> dict[str, str]:
    report = ask_status([daemon.endpoint], 2.0)[daemon.endpoint]
    return {} if isinstance(report, str) else {m.node: m.state for m in report.members}


def live_in(daemon: DaemonProcess) -> set[str]:
    report = ask_status([daemon.endpoint], 2.0)[daemon.endpoint]
    if isinstance(report, str):
        return set()
    return {m.node for m in report.members if m.state in ("alive", "suspect")}


def test_a_daemon_with_only_the_etcd_endpoints_joins_through_the_seeds_in_etcd(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    cluster = Cluster(2, log_dir=str(tmp_path), extra_overrides=etcd_overrides(etcd))
    cluster.start()
    joiner = DaemonProcess(
        name="d02",
        log_dir=tmp_path,
        overrides=["node.id=d02", "gossip.preset=local", *etcd_overrides(etcd)],
    )
    try:
        cluster.wait_converged(timeout_s=20)

        def seeds() -> list[str]:
            value = etcd_get(etcd, "/gossipd/default/seeds")
            return [] if value is None else json.loads(value)["seeds"]

        published = wait_until(lambda: len(seeds()) == 2 and seeds(), 15, "both in the seeds")
        assert {s.split("@")[0] for s in published} == {"d00", "d01"}
        gossip = {f"tcp://127.0.0.1:{Cluster._port_of(d, 'gossip.bind')}" for d in cluster.daemons}
        assert {s.split("@")[1] for s in published} == gossip
        joiner.start()
        everyone = {"d00", "d01", "d02"}
        for d in [*cluster.daemons, joiner]:
            wait_until(lambda d=d: live_in(d) == everyone - {d.name}, 15, f"{d.name} sees all")
        assert any(e.get("msg") == "joining through seeds from etcd" for e in joiner.events())
        # The leader now lists the joiner too (three seeds at most).
        wait_until(
            lambda: (
                len(json.loads(etcd_get(etcd, "/gossipd/default/seeds") or b"{}")["seeds"]) == 3
            ),
            10,
            "three seeds",
        )
    finally:
        joiner.stop(timeout_s=10)
        cluster.stop()


def test_reaping_makes_every_member_forget_a_dead_one(etcd: EtcdCluster, tmp_path: Path) -> None:
    cluster = Cluster(
        4,
        log_dir=str(tmp_path),
        extra_overrides=etcd_overrides(etcd, "membership.dead_reap_after_s=1.0"),
    )
    cluster.start()
    try:
        cluster.wait_converged(timeout_s=20)
        wait_until(lambda: leader_of(cluster.daemons), 15, "a leader")
        victim = next(d for d in cluster.daemons if d.name != leader_of(cluster.daemons))
        rest = [d for d in cluster.daemons if d is not victim]
        for d in rest:
            everyone = {x.name for x in cluster.daemons} - {d.name}
            wait_until(lambda d=d, e=everyone: table(d) == e, 10, f"{d.name}'s full table")
        victim.kill()
        victim.wait(10)
        # Each table first holds it dead, then no more: 3 members -> 2 everywhere.
        for d in rest:
            try:
                wait_until(
                    lambda d=d: table(d) == {x.name for x in rest} - {d.name},
                    20,
                    f"{d.name} to forget {victim.name}",
                )
            except AssertionError as exc:
                lines = [
                    f"{x.name}: {states(x)} {[e for e in x.events() if e.get('msg') == 'forget']}"
                    for x in rest
                ]
                raise AssertionError(f"{exc}; tables: {lines}") from None
        for d in rest:  # by the leader's forget directive (local reaping: after 24 h)
            assert any(
                e.get("msg") == "forgotten" and victim.name in e["members"] for e in d.events()
            ), d.name
        for d in rest:  # and it stays forgotten (no push-pull brings it back)
            assert victim.name not in (table(d) or set())
    finally:
        cluster.stop()


class Supervisor:
    """systemd's Restart=on-failure, for the test: a daemon that exits non-zero (told to
    restart: 75, or SIGKILLed) is started again under its name and ports."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.restarts: list[tuple[str, int | None]] = []
        self.exits_at: list[float] = []  # when each restart by order was seen (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, d in enumerate(self.cluster.daemons):
                code = d.proc.poll() if d.proc is not None else None
                if code is not None and code != 0:
                    self.restarts.append((d.name, code))
                    if code == 75:  # told to restart (a drain's), not killed
                        self.exits_at.append(time.monotonic())
                    try:
                        self.cluster.restart(i)
                    except Exception as exc:
                        self.errors.append(f"{d.name}: {exc}")
            self._stop.wait(0.05)


def run_cli(etcd: EtcdCluster, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gossipd",
            "cluster",
            "drain",
            "--etcd",
            ",".join(etcd.endpoints),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def progress(etcd: EtcdCluster) -> rollout.Progress | None:
    value = etcd_get(etcd, "/gossipd/default/drain/progress")
    return None if value is None else msgspec.json.decode(value, type=rollout.Progress)


def test_rolling_drain_of_3_daemons_under_load_loses_nothing_and_survives_a_leader_kill(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    cluster = Cluster(3, log_dir=str(tmp_path), extra_overrides=etcd_overrides(etcd))
    cluster.start()
    producer: SoakProducer | None = None
    cli: subprocess.Popen[str] | None = None
    try:
        cluster.wait_converged(timeout_s=20)
        cluster.wait_meta(timeout_s=20)
        first_leader = wait_until(lambda: leader_of(cluster.daemons), 15, "a leader")
        producer = SoakProducer(
            [d.endpoint for d in cluster.daemons], immediate=True, resubmit_s=3.0
        )
        with Supervisor(cluster) as supervisor:
            cli = run_cli(etcd, "--rolling", "--step-timeout", "30")
            t0 = time.monotonic()
            n = 0
            killed, killed_at = "", 0.0
            rate_per_s = 150.0
            while cli.poll() is None and time.monotonic() - t0 < 75:
                now = time.monotonic()
                while n < int((now - t0) * rate_per_s):
                    n += 1
                    producer.send_new(f"r{n}", f"session-{n % 97}", now)
                producer.poll(0.005)
                if not killed:
                    p = progress(etcd) if n % 30 == 0 else None
                    if p is not None and p.index == 1 and p.status == "running":
                        # Between steps: the first member is back; kill the leader.
                        leader = leader_of(cluster.daemons)
                        assert leader is not None and first_leader == p.order[-1], (leader, p)
                        victim = next(d for d in cluster.daemons if d.name == leader)
                        victim.kill()
                        killed, killed_at = leader, time.monotonic()
            output = cli.communicate(timeout=5)[0] if cli.poll() is not None else ""
            assert cli.returncode == 0, output
            deadline = time.monotonic() + 8
            while producer.outstanding() and time.monotonic() < deadline:
                producer.poll(0.05)
            assert not supervisor.errors, supervisor.errors
        print(output)
        final = progress(etcd)
        assert final is not None and final.status == "done", final
        assert killed, "the leader was killed between two steps"
        assert len(final.order) == 3 and final.index == 3
        assert sum("restarted and serving again" in s for s in final.steps) == 3, final.steps
        new_leaders = {
            e["node"]
            for d in cluster.daemons
            for e in d.events()
            if e.get("msg") == "leader_elected"
        }
        assert new_leaders - {killed}, "another daemon led after the kill and resumed the plan"
        restarted = [name for name, code in supervisor.restarts if code == 75]
        assert sorted(restarted) == sorted(final.order), supervisor.restarts
        tasks = list(producer.tasks.values())
        ok = [t for t in tasks if t.done_at and t.code == "ok"]
        print(
            f"rolling drain: {len(tasks)} tasks sent, {len(ok)} ok, answers {producer.answers}, "
            f"timer resubmissions {sum(t.timer_resends for t in tasks)}, "
            f"restarts {supervisor.restarts}"
        )
        assert len(ok) == len(tasks), f"lost {len(tasks) - len(ok)} of {len(tasks)}"
        # The drains cost nothing: only tasks written as a member's connection dropped (the
        # SIGKILLed leader as it died; at most a few in the instant a drained member exits to
        # restart: docs/PROTOCOL.md, "lost in transit") waited for the producer's
        # resubmission timer.
        exits = [killed_at, *supervisor.exits_at]
        timer = sorted(t.first_sent for t in tasks if t.timer_resends)
        near = [min(exits, key=lambda x: abs(x - t)) for t in timer]
        assert all(abs(t - x) <= 1.0 for t, x in zip(timer, near, strict=True)), (
            f"timer resends, s from the kill: {[round(t - killed_at, 3) for t in timer]}, "
            f"exits at {[round(x - killed_at, 3) for x in exits]}"
        )
        drain_exits = [x for x in near if x != killed_at]
        assert all(drain_exits.count(x) <= 3 for x in drain_exits), "more than in an instant"
        assert "[1/3]" in output and "done: 3 members done" in output
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
        if producer is not None:
            producer.close()
        cluster.stop()


def test_cluster_drain_hands_one_plan_at_a_time_and_cancel_drops_it(etcd: EtcdCluster) -> None:
    """No daemon: nobody takes the plan; the command says so and gives up after --timeout;
    a second plan is refused while the first runs; --cancel drops it."""
    cli = run_cli(etcd, "d07", "--timeout", "0.5")
    out = cli.communicate(timeout=20)[0]
    assert cli.returncode == 1 and "handed to the leader" in out and "gave up following" in out
    plan = rollout.plan_decoder.decode(etcd_get(etcd, "/gossipd/default/drain/plan") or b"")
    assert (plan.mode, plan.nodes) == ("drain", ["d07"])
    cli = run_cli(etcd, "--rolling")
    out = cli.communicate(timeout=20)[0]
    assert cli.returncode == 1 and f"drain plan {plan.id} (drain) is still running" in out
    cli = run_cli(etcd, "--cancel")
    out = cli.communicate(timeout=20)[0]
    assert cli.returncode == 0 and f"drain plan {plan.id} dropped" in out
    assert etcd_get(etcd, "/gossipd/default/drain/plan") is None
    cli = run_cli(etcd, "--rolling", "d01")
    assert cli.communicate(timeout=20)[0] and cli.returncode == 2


def test_cluster_drain_of_a_named_member_drains_it_and_it_leaves(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    cluster = Cluster(3, log_dir=str(tmp_path), extra_overrides=etcd_overrides(etcd))
    cluster.start()
    try:
        cluster.wait_converged(timeout_s=20)
        wait_until(lambda: leader_of(cluster.daemons), 15, "a leader")
        cli = run_cli(etcd, "d01", "--step-timeout", "20")
        out = cli.communicate(timeout=45)[0]
        assert cli.returncode == 0, out
        assert "d01: drained and left" in out and "done: 1 members done" in out
        d01 = cluster.daemons[1]
        assert d01.wait(10) == 0, "it left: exit 0, nothing restarts it"
        assert any(e.get("msg") == "leave ordered by the leader" for e in d01.events())
        for d in (cluster.daemons[0], cluster.daemons[2]):
            wait_until(lambda d=d: "d01" not in live_in(d), 10, f"{d.name} to see d01 gone")
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "no etcd endpoints: pass --etcd"),
        (["--etcd", "127.0.0.1:1"], "etcd at 127.0.0.1:1 did not answer"),
        (["--etcd", "no port"], "expected HOST:PORT"),
    ],
)
def test_cluster_drain_without_a_usable_etcd_says_what_to_do(args: list[str], says: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gossipd", "cluster", "drain", "d01", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr


def test_a_daemon_whose_configured_seeds_are_all_down_joins_through_the_seeds_in_etcd(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """docs/OPERATIONS.md: gossip.seeds and etcd's seeds work together; a daemon that knows
    no live member joins through etcd's.  Its only configured seed never answers (as a
    seed that died before its gossip introduced the members that had joined through it):
    it finds the cluster through etcd (with gossip.seeds set, it never read them before)."""
    cluster = Cluster(2, log_dir=str(tmp_path), extra_overrides=etcd_overrides(etcd))
    cluster.start()
    nobody = f"tcp://127.0.0.1:{free_tcp_port()}"  # no member there, ever
    joiner = DaemonProcess(
        name="d02",
        log_dir=tmp_path,
        overrides=[
            "node.id=d02",
            "gossip.preset=local",
            f'gossip.seeds=["{nobody}"]',
            *etcd_overrides(etcd),
        ],
    )
    try:
        cluster.wait_converged(timeout_s=20)
        wait_until(
            lambda: (
                len(json.loads(etcd_get(etcd, "/gossipd/default/seeds") or b"{}").get("seeds", []))
                == 2
            ),
            15,
            "both in the seeds",
        )
        joiner.start()
        everyone = {"d00", "d01", "d02"}
        for d in [*cluster.daemons, joiner]:
            wait_until(lambda d=d: live_in(d) == everyone - {d.name}, 15, f"{d.name} sees all")
        assert any(e.get("msg") == "joining through seeds from etcd" for e in joiner.events())
    finally:
        joiner.stop(timeout_s=10)
        cluster.stop()
