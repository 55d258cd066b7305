"""Real daemons (issue 17): an owner's ForwardReply and TaskDone carry its load, and the
entry point's placer uses it: its decisions on that owner use state known from the replies
(the placer's state-age histogram), not the owner's Meta alone."""

from __future__ import annotations

import pytest

from gossipd.core.ring import Ring
from simulations.cluster import Cluster
from tests.helpers import RawProducer, scrape, wait_until


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    # Load gossip off: what the entry point knows of the owner's load came on its replies.
    # The owner check off: this is about the state the entry point itself holds.
    overrides = [
        'metrics.bind="127.0.0.1:0"',
        "gossip.load_interval_s=0",
        "fanout.owner_check=false",
    ]
    c = Cluster(2, log_dir=str(tmp_path / "c"), extra_overrides=overrides)
    c.start()
    try:
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        yield c
    finally:
        c.stop()


def test_an_owners_replies_carry_its_load_and_the_entry_points_placer_uses_it(cluster) -> None:  # type: ignore[no-untyped-def]
    entry = cluster.daemons[0]
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [k for k in (f"load-{i}" for i in range(200)) if ring.owner(k) == "d01"][:5]
    outstanding = "gossipd_fanout_outstanding{member=d01}"
    producer = RawProducer(entry.endpoint)
    try:
        for i, key in enumerate(keys):  # one at a time: each decision after the last reply
            producer.send_task(f"t{i}", "a b c", key=key, params={"max_tokens": 2})
            [result] = producer.results(1, timeout_s=10)
            assert result["ok"] and result["node"] == "d01", result
            # The Result reaches the producer before the owner's TaskDone reaches us: the next
            # decision is made once the TaskDone (and the load it carries) is in.
            wait_until(
                lambda: scrape(entry.metrics_port).get(outstanding, 0.0) == 0.0,
                timeout_s=5,
                what="d01's TaskDone at the entry point",
            )
    finally:
        producer.close()
    metrics: dict[str, float] = {}

    def decided_all() -> bool:
        metrics.update(scrape(entry.metrics_port))
        return metrics.get("gossipd_placement_state_age_seconds_count", 0.0) >= len(keys) - 1

    wait_until(decided_all, timeout_s=5, what="the entry point's placement decisions")
    # The first decision knew d01 by its Meta only; every later one by d01's own replies,
    # well under a second old (the previous task's TaskDone).
    assert metrics["gossipd_placement_state_unknown_total"] == 1.0
    assert metrics["gossipd_placement_state_age_seconds_count"] == len(keys) - 1
    assert metrics["gossipd_placement_state_age_seconds_bucket{le=1.0}"] == len(keys) - 1
    assert metrics["gossipd_fanout_loads_refused_total"] == 0.0


def test_load_gossip_tells_every_member_the_others_load_without_any_task(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = Cluster(3, log_dir=str(tmp_path / "g"), extra_overrides=['metrics.bind="127.0.0.1:0"'])
    c.start()
    try:
        c.wait_converged(timeout_s=20)

        def all_known() -> bool:
            return all(
                scrape(d.metrics_port).get("gossipd_load_members_known") == 2.0 for d in c.daemons
            )

        wait_until(all_known, timeout_s=5, what="every member holding the 2 others' load")
        m = scrape(c.daemons[0].metrics_port)
        assert m["gossipd_load_gossip_sent_messages_total"] > 0
        assert m["gossipd_load_gossip_received_records_total"] > 0
    finally:
        c.stop()


def test_with_the_owner_check_every_decision_on_a_member_is_left_to_its_own_check(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """fanout.owner_check (the default): the entry point's Forwards ask if_free, the owner
    (not saturated) admits them, and each decision is counted as owner-checked: the state
    it used is the owner's own, read as the Forward reached it."""
    overrides = ['metrics.bind="127.0.0.1:0"', "gossip.load_interval_s=0"]
    c = Cluster(2, log_dir=str(tmp_path / "c"), extra_overrides=overrides)
    c.start()
    try:
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        entry, owner = c.daemons
        ring = Ring({"d00": 1.0, "d01": 1.0})
        keys = [k for k in (f"chk-{i}" for i in range(200)) if ring.owner(k) == "d01"][:4]
        producer = RawProducer(entry.endpoint)
        try:
            for i, key in enumerate(keys):
                producer.send_task(f"c{i}", "a b c", key=key, params={"max_tokens": 2})
            results = producer.results(len(keys), timeout_s=10)
            assert all(r["ok"] and r["node"] == "d01" for r in results), results
        finally:
            producer.close()
        metrics = scrape(entry.metrics_port)
        assert metrics["gossipd_placement_state_owner_checked_total"] == len(keys)
        assert metrics["gossipd_placement_state_unknown_total"] == 0.0
        assert scrape(owner.metrics_port)["gossipd_fanout_refused_saturated_total"] == 0.0
    finally:
        c.stop()
