"""Several real daemons on loopback gossiping over ZeroMQ, with real signals."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from gossipd.launcher import DaemonProcess, free_tcp_port
from simulations.cluster import Cluster
from tests.helpers import scrape


def wait_for(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def member_events(daemon: DaemonProcess, member: str, kind: str) -> list[dict]:  # type: ignore[type-arg]
    return [
        e
        for e in daemon.events()
        if e.get("msg") == "member" and e["member"] == member and e["event"] == kind
    ]


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    c = Cluster(4, log_dir=str(tmp_path))
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
        wait_for(
            lambda: scrape(port).get("gossipd_members{state=alive}") == 4, 15, "d09 to see all four"
        )
        wait_for(lambda: member_events(d0, "d09", "meta"), 10, "d09's GPU state to reach d00")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "gossipd_gossip_messages_sent_total" in text
        assert "gossipd_fanout_forwarded_total" in text and "gossipd_members" in text
    finally:
        extra.stop()
    wait_for(lambda: member_events(d0, "d09", "left"), 10, "d09's graceful leave")
    assert member_events(d0, "d09", "dead") == [], "a leave is not a failure"


def test_sigkill_is_detected_by_every_member(cluster: Cluster) -> None:
    cluster.wait_converged(timeout_s=20)
    victim = cluster.daemons[2]
    killed_at = time.time()
    victim.kill()
    others = [d for d in cluster.daemons if d is not victim]
    wait_for(
        lambda: all(member_events(d, "d02", "dead") for d in others),
        15,
        "everyone to declare d02 dead",
    )
    first = min(member_events(d, "d02", "dead")[0]["at"] for d in others) - killed_at
    assert 0 < first < 10


def test_a_daemon_stopped_for_2s_is_never_declared_dead(cluster: Cluster) -> None:
    cluster.wait_converged(timeout_s=20)
    staller = cluster.daemons[3]
    for _ in range(3):
        staller.pause()
        time.sleep(2.0)
        staller.resume()
        time.sleep(3.0)
    for d in cluster.daemons[:3]:
        assert member_events(d, "d03", "dead") == []
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
        time.sleep(3.0)
        assert scrape(port)["gossipd_members{state=alive}"] == 0
    finally:
        alien.stop()
    for d in cluster.daemons:
        assert not [e for e in d.events() if e.get("msg") == "member" and e["member"] == "alien"]
