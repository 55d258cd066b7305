"""Leader election with real etcd and real daemons (TTL 2 s): one leader, known by every
member through gossip; SIGKILL of the leader -> a new leader with a higher token within TTL +
1 s; a clean shutdown resigns (the next one leads within 0.5 s); etcd stopped -> the leader
steps down within the TTL and leads again once etcd is back; no etcd -> said once, no leader.
Failover times are measured from the daemons' JSON logs (t_wall), as the election simulator
does, and printed (pytest -s)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gossipd.tools.launcher import DaemonProcess
from simulations.cluster import Cluster
from tests.etcd_cluster import EtcdCluster
from tests.helpers import RawProducer, gossipd_cli, scrape, wait_until

TTL_S = 2.0

pytestmark = pytest.mark.slow


def _events(daemon: DaemonProcess, msg: str) -> list[dict[str, Any]]:
    return [e for e in daemon.events() if e.get("msg") == msg]


def _leaders(daemons: list[DaemonProcess]) -> dict[str, int]:
    """node -> token of every daemon whose last election event is leader_elected."""
    out = {}
    for d in daemons:
        last = [e for e in d.events() if e.get("msg") in ("leader_elected", "leader_stepped_down")]
        if last and last[-1]["msg"] == "leader_elected":
            out[last[-1]["node"]] = last[-1]["token"]
    return out


def _knows(daemon: DaemonProcess, leader: str, token: int) -> dict[str, Any] | None:
    seen = [e for e in _events(daemon, "term_observed") if e["token"] == token]
    return seen[0] if seen and seen[0]["leader"] == leader else None


def _story(daemons: list[DaemonProcess]) -> str:
    """Every daemon's election events in order: what a failed wait shows (a rare flake in CI,
    "the new term known" not within 5 s, left no trace of its cause)."""
    kinds = ("leader_elected", "leader_stepped_down", "term_observed")
    lines = [
        f"{e.get('t_wall', 0):.3f} {d.name}: {e['msg']} "
        f"{ {k: e[k] for k in ('leader', 'token', 'reason') if k in e} }"
        for d in daemons
        for e in d.events()
        if e.get("msg") in kinds
    ]
    return "\n".join(sorted(lines))


def _cluster(n: int, etcd: EtcdCluster, tmp_path: Any) -> Cluster:
    return Cluster(
        n,
        log_dir=str(tmp_path / "daemons"),
        extra_overrides=[
            f"etcd.endpoints={json.dumps(etcd.endpoints)}",
            f"etcd.ttl_s={TTL_S}",
            'metrics.bind="127.0.0.1:0"',
        ],
    )


def test_one_leader_known_to_all_then_kill_and_resign_failovers(
    etcd: EtcdCluster, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster(3, etcd, tmp_path)
    cluster.start()
    try:
        daemons = cluster.daemons
        leaders = wait_until(lambda: _leaders(daemons), 15, "a leader")
        assert len(leaders) == 1
        ((leader, token),) = leaders.items()
        by_name = {d.name: d for d in daemons}
        elected = _events(by_name[leader], "leader_elected")[-1]
        known = wait_until(
            lambda: (
                all(_knows(d, leader, token) for d in daemons)
                and [_knows(d, leader, token) for d in daemons]
            ),
            10,
            "every daemon to know the term",
        )
        spread_s = max(k["t_wall"] for k in known) - elected["t_wall"]  # type: ignore[union-attr]
        # The first election happens while the daemons are still joining each other.
        print(f"term known by all 3 daemons {spread_s * 1000:.0f} ms after the first election")
        assert spread_s < 3.0
        wait_until(
            lambda: scrape(by_name[leader].metrics_port).get("gossipd_is_leader") == 1, 5, "metric"
        )
        other = next(d for d in daemons if d.name != leader)
        metrics = scrape(other.metrics_port)
        assert metrics["gossipd_is_leader"] == 0 and metrics["gossipd_leader_term"] == token

        # Every member knows every other before the leader dies: the survivors' gossip
        # carries the next term to each other.  (Killed 0.4 s after start, the seed leader
        # left two members that had not met through it yet, and the new term no one to
        # reach: a CI run, once, whose logs showed each survivor with the dead seed alone.)
        cluster.wait_converged(30)
        # SIGKILL of the leader: a new leader, higher token, within TTL + 1 s.
        survivors = [d for d in daemons if d.name != leader]
        killed_at = time.time()
        by_name[leader].kill()
        new = wait_until(lambda: _leaders(survivors), TTL_S + 5, "a new leader after the kill")
        ((leader2, token2),) = new.items()
        failover_kill_s = _events(by_name[leader2], "leader_elected")[-1]["t_wall"] - killed_at
        print(f"failover after SIGKILL of the leader: {failover_kill_s:.3f} s (TTL {TTL_S} s)")
        assert token2 > token
        assert failover_kill_s <= TTL_S + 1.0
        try:
            known2 = wait_until(
                lambda: (
                    all(_knows(d, leader2, token2) for d in survivors)
                    and [_knows(d, leader2, token2) for d in survivors]
                ),
                5,
                "the new term known",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the election events:\n{_story(daemons)}") from None
        elected2 = _events(by_name[leader2], "leader_elected")[-1]["t_wall"]
        spread2_s = max(k["t_wall"] for k in known2) - elected2  # type: ignore[union-attr]
        print(f"new term known by both survivors {spread2_s * 1000:.0f} ms after the election")
        assert spread2_s < 0.5, "within a gossip round or two (0.2 s each)"

        # A clean shutdown resigns: the next leader within 0.5 s.
        last = next(d for d in survivors if d.name != leader2)
        by_name[leader2].terminate()
        third = wait_until(lambda: _leaders([last]), 5, "a leader after the resign")
        resigned = [
            e for e in _events(by_name[leader2], "leader_stepped_down") if e["reason"] == "resigned"
        ]
        assert resigned, "a clean shutdown resigns"
        failover_resign_s = _events(last, "leader_elected")[-1]["t_wall"] - resigned[-1]["t_wall"]
        print(f"failover after a clean resign: {failover_resign_s * 1000:.1f} ms")
        assert third[last.name] > token2
        assert failover_resign_s < 0.5
        assert by_name[leader2].wait(15) == 0
    finally:
        cluster.stop()


def test_etcd_down_leader_steps_down_within_ttl_and_returns(etcd: EtcdCluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster(2, etcd, tmp_path)
    cluster.start()
    try:
        daemons = cluster.daemons
        leaders = wait_until(lambda: _leaders(daemons), 15, "a leader")
        ((leader, token),) = leaders.items()
        d = next(x for x in daemons if x.name == leader)
        stopped_at = time.time()
        etcd.stop(0)
        wait_until(lambda: not _leaders(daemons), TTL_S + 3, "the leader to step down")
        down = _events(d, "leader_stepped_down")[-1]
        step_down_s = down["t_wall"] - stopped_at
        print(f"etcd stopped: the leader stepped down after {step_down_s:.3f} s ({down['reason']})")
        assert down["reason"] == "lease_expired"
        assert step_down_s <= TTL_S
        # The data path goes on without etcd: tasks sent to either daemon are answered.
        producer = RawProducer(daemons[0].endpoint)
        try:
            for i in range(20):
                producer.send_task(f"t{i}", prompt=f"no etcd {i}")
            results = producer.results(20, timeout_s=10)
        finally:
            producer.close()
        assert len(results) == 20 and all(r.get("error") is None for r in results)
        etcd.start(0)
        back_at = time.time()
        etcd.wait_healthy()
        again = wait_until(lambda: _leaders(daemons), 10, "a leader again after etcd is back")
        back_s = (
            max(_events(x, "leader_elected")[-1]["t_wall"] for x in daemons if x.name in again)
            - back_at
        )
        print(f"leader again {back_s:.3f} s after etcd was started again (token {again})")
        assert next(iter(again.values())) >= token
        # The follower's watch on its predecessor died with etcd's connection; it watches
        # again, so a SIGKILL of the leader now still fails over within TTL + 1 s.
        ((leader3, _),) = again.items()
        survivor = next(x for x in daemons if x.name != leader3)
        killed_at = time.time()
        next(x for x in daemons if x.name == leader3).kill()
        wait_until(lambda: _leaders([survivor]), TTL_S + 5, "a leader after the kill")
        failover_s = _events(survivor, "leader_elected")[-1]["t_wall"] - killed_at
        print(f"failover after SIGKILL, after the etcd restart: {failover_s:.3f} s")
        assert failover_s <= TTL_S + 1.0
    finally:
        cluster.stop()


def test_no_etcd_configured_is_said_once_and_nothing_leads(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory('metrics.bind="127.0.0.1:0"')
    lines = [e for e in daemon.events() if "no etcd configured" in str(e.get("msg", ""))]
    assert len(lines) == 1
    assert "gossipd_is_leader" not in scrape(daemon.metrics_port)


def test_drain_resigns_and_undrain_campaigns_again(etcd: EtcdCluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster(2, etcd, tmp_path)
    cluster.start()
    try:
        daemons = cluster.daemons
        ((leader, token),) = wait_until(lambda: _leaders(daemons), 15, "a leader").items()
        by_name = {d.name: d for d in daemons}
        other = next(d for d in daemons if d.name != leader)
        done = gossipd_cli("drain", leader, "-e", by_name[leader].endpoint)
        assert done.returncode == 0, done.stderr
        ((leader2, token2),) = wait_until(lambda: _leaders([other]), 5, "the other to lead").items()
        resigned = _events(by_name[leader], "leader_stepped_down")[-1]
        assert resigned["reason"] == "resigned" and token2 > token
        print(
            "failover after a drain: "
            f"{(_events(other, 'leader_elected')[-1]['t_wall'] - resigned['t_wall']) * 1000:.1f} ms"
        )
        assert gossipd_cli("undrain", leader, "-e", by_name[leader].endpoint).returncode == 0
        # Campaigning again: when the current leader drains, the undrained one takes over.
        time.sleep(0.5)
        assert gossipd_cli("drain", leader2, "-e", other.endpoint).returncode == 0
        back = wait_until(lambda: _leaders([by_name[leader]]), 5, "the undrained one to lead")
        assert back[leader] > token2
    finally:
        cluster.stop()


def test_a_leader_paused_past_its_lease_is_replaced_without_overlap(
    etcd: EtcdCluster, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP the leader until the other daemon leads (about a TTL), with a higher token; the
    paused one, resumed, steps down, and its lease had ended (lease_until_wall) before the
    new leader was elected; it then knows the new term."""
    cluster = _cluster(2, etcd, tmp_path)
    cluster.start()
    try:
        daemons = cluster.daemons
        ((leader, token),) = wait_until(lambda: _leaders(daemons), 15, "a leader").items()
        old = next(d for d in daemons if d.name == leader)
        other = next(d for d in daemons if d.name != leader)
        old.pause()
        try:
            ((leader2, token2),) = wait_until(
                lambda: _leaders([other]), TTL_S + 5, "the other to lead"
            ).items()
        finally:
            old.resume()
        assert token2 > token
        down = wait_until(
            lambda: [e for e in _events(old, "leader_stepped_down") if e["token"] == token],
            5,
            "the resumed leader to step down",
        )[-1]
        elected = _events(other, "leader_elected")[-1]["t_wall"]
        print(
            f"paused leader: lease ended {elected - down['lease_until_wall']:.3f} s before the "
            f"new leader was elected; it logged its step-down {down['t_wall'] - elected:.3f} s after"
        )
        assert down["lease_until_wall"] <= elected, "no overlap"
        wait_until(lambda: _knows(old, leader2, token2), 5, "the new term at the old leader")
    finally:
        cluster.stop()
