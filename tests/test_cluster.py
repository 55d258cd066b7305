"""Several real daemons on loopback gossiping over ZeroMQ, with real signals."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from gossipd.core.swim_config import SwimConfig
from gossipd.tools.launcher import DaemonProcess, free_tcp_port
from simulations.cluster import Cluster, ClusterRun, run_cluster
from tests.helpers import scrape, wait_until

FOREIGN = "gossipd_gossip_foreign_cluster_total"


def member_events(daemon: DaemonProcess, member: str, kind: str) -> list[dict]:  # type: ignore[type-arg]
    return [
        e
        for e in daemon.events()
        if e.get("msg") == "member" and e["member"] == member and e["event"] == kind
    ]


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    c = Cluster(4, log_dir=str(tmp_path), extra_overrides=['metrics.bind="127.0.0.1:0"'])
    c.start()
    yield c
    c.stop()


def test_daemons_join_through_seeds_and_see_each_others_gpu_state(cluster: Cluster) -> None:
    cluster.wait_converged(timeout_s=20)
    d0 = cluster.daemons[0]
    port = free_tcp_port()
    extra = DaemonProcess(
        name="d09",
        log_dir=cluster.log_dir,
        overrides=[
            "node.id=d09",
            f"gossip.seeds={json.dumps(cluster.seeds)}",
            "gossip.preset=local",
            f"metrics.bind=127.0.0.1:{port}",
            "gpu.memory_total_mb=81920",
        ],
    ).start()
    try:
        wait_until(
            lambda: scrape(port).get("gossipd_members{state=alive}") == 4, 15, "d09 to see all four"
        )
        wait_until(lambda: member_events(d0, "d09", "meta"), 10, "d09's GPU state to reach d00")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "gossipd_gossip_messages_sent_total" in text
        assert "gossipd_fanout_forwarded_total" in text and "gossipd_members" in text
    finally:
        extra.stop()
    wait_until(lambda: member_events(d0, "d09", "left"), 10, "d09's graceful leave")
    assert member_events(d0, "d09", "dead") == [], "a leave is not a failure"


def test_a_killed_daemon_is_known_dead_by_every_member_within_a_second(cluster: Cluster) -> None:
    """A SIGKILLed process's port refuses connections: the members whose connection to it
    dropped check its port and declare it dead at once (core/refusal.py), without waiting out
    the suspicion timeout; nobody else is accused.  Times are the daemons' own (the "at" of
    their events), so the test process's scheduling does not count."""
    cluster.wait_converged(timeout_s=20)
    victim = cluster.daemons[2]
    killed_at = time.time()
    victim.kill()
    others = [d for d in cluster.daemons if d is not victim]
    wait_until(
        lambda: all(member_events(d, "d02", "dead") for d in others),
        20,
        "everyone to declare d02 dead",
    )
    known_s = max(member_events(d, "d02", "dead")[0]["at"] for d in others) - killed_at
    assert known_s <= 1.0, f"every member knew after {known_s:.3f} s"
    refusals = [e for d in others for e in d.events() if e.get("msg") == "member port refused"]
    assert any(e["member"] == "d02" and e["verdict"] == "dead" for e in refusals), refusals
    for d in others:
        accused = {
            e["member"] for e in d.events() if e.get("msg") == "member" and e["event"] == "dead"
        }
        assert accused == {"d02"}, f"{d.name} declared {accused - {'d02'}} dead"


def test_without_refusals_a_kill_waits_out_the_suspicion_floor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With crash_by_refusal off (and for a host that vanishes without a TCP reset), SWIM
    decides: the first declarer suspected the killed member for at least the suspicion floor
    (the time a stalled member has to refute).  How fast is the simulator's to measure
    (docs/MEMBERSHIP.md)."""
    c = Cluster(4, log_dir=str(tmp_path), extra_overrides=["gossip.swim.crash_by_refusal=false"])
    c.start()
    try:
        c.wait_converged(timeout_s=20)
        victim = c.daemons[2]
        killed_at = time.time()
        victim.kill()
        others = [d for d in c.daemons if d is not victim]
        wait_until(
            lambda: all(member_events(d, "d02", "dead") for d in others),
            20,
            "everyone to declare d02 dead",
        )
        first = min(others, key=lambda d: member_events(d, "d02", "dead")[0]["at"])
        declared_at = member_events(first, "d02", "dead")[0]["at"]
        suspected = [e["at"] for e in member_events(first, "d02", "suspect") if e["at"] > killed_at]
        assert suspected, f"{first.name} declared d02 dead without suspecting it first"
        floor_s = SwimConfig.local().suspicion_floor_s  # Cluster's preset
        assert declared_at - suspected[0] >= floor_s - 0.01, (suspected[0], declared_at)
        assert not [e for d in others for e in d.events() if e.get("msg") == "member port refused"]
    finally:
        c.stop()


def test_a_daemon_stopped_for_2s_is_never_declared_dead(cluster: Cluster) -> None:
    cluster.wait_converged(timeout_s=20)
    staller = cluster.daemons[3]
    for _ in range(3):  # the scenario itself: stopped 2 s in every 5
        staller.pause()
        time.sleep(2.0)  # the stall under test (SIGSTOP for this long)
        staller.resume()
        time.sleep(3.0)  # running between stalls: probed, and refuting any suspicion
    for d in cluster.daemons[:3]:
        assert member_events(d, "d03", "dead") == []
    # Its port was checked while it was stopped (late acks) and accepted: no evidence.
    checks = [scrape(d.metrics_port) for d in cluster.daemons[:3]]
    assert sum(m.get("gossipd_gossip_port_checks_total{verdict=accepted}", 0) for m in checks) >= 1
    assert sum(m.get("gossipd_gossip_port_checks_total{verdict=dead}", 0) for m in checks) == 0
    cluster.wait_converged(timeout_s=10)


def test_messages_from_another_cluster_are_ignored(cluster: Cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster.wait_converged(timeout_s=20)
    port = free_tcp_port()
    alien = DaemonProcess(
        name="alien",
        log_dir=tmp_path,
        overrides=[
            "node.id=alien",
            "node.cluster=other",
            f"gossip.seeds={json.dumps(cluster.seeds)}",
            f"metrics.bind=127.0.0.1:{port}",
        ],
    ).start()
    try:
        # Two rounds of its join attempts (one to each seed per round) reached the members,
        # which counted and ignored them; the alien heard nothing back.
        wait_until(
            lambda: (
                sum(scrape(d.metrics_port)[FOREIGN] for d in cluster.daemons)
                >= 2 * len(cluster.seeds)
            ),
            15,
            "the alien's join attempts to reach the members",
        )
        assert scrape(port)["gossipd_members{state=alive}"] == 0
    finally:
        alien.stop()
    for d in cluster.daemons:
        assert not [e for e in d.events() if e.get("msg") == "member" and e["member"] == "alien"]


def test_the_cluster_harness_measures_crashes_and_stalls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`python -m simulations cluster`, shortened: every kill known dead by every member,
    by refusal, well within a second; a member stopped 2 s out of every 4 never dead."""
    report = run_cluster(
        ClusterRun(
            nodes=4,
            dissemination_trials=1,
            crashes=2,
            stallers=1,
            stall_every_s=4.0,
            stall_period_s=8.0,
            detect_window_s=5.0,
            log_dir=str(tmp_path),
            progress=False,
        )
    )
    detection, stalls = report["detection"], report["stalls"]
    assert detection["all_members_know_s"]["n"] == 2, detection
    assert detection["all_members_know_s"]["max"] <= 1.0, detection
    assert detection["rounds_declared_by_refusal"] == 2, detection
    assert stalls["stalls"] >= 2 and stalls["declared_dead"] == 0, stalls
    assert stalls["port_refusals"] == 0, stalls


def test_a_killed_daemon_is_known_dead_at_once_under_curve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With CURVE on every socket the evidence is the same (the check is plain TCP, below the
    handshake): a kill is known dead by both others within a second, by refusal."""
    c = Cluster(3, log_dir=str(tmp_path), curve=True)
    c.start()
    try:
        c.wait_converged(timeout_s=20)
        victim = c.daemons[1]
        killed_at = time.time()
        victim.kill()
        others = [d for d in c.daemons if d is not victim]
        wait_until(
            lambda: all(member_events(d, "d01", "dead") for d in others),
            20,
            "both others to declare d01 dead",
        )
        known_s = max(member_events(d, "d01", "dead")[0]["at"] for d in others) - killed_at
        assert known_s <= 1.0, f"both knew after {known_s:.3f} s"
        refused = [e for d in others for e in d.events() if e.get("msg") == "member port refused"]
        assert any(e["verdict"] == "dead" for e in refused), refused
    finally:
        c.stop()
