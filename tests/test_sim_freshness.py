"""`python -m simulations freshness` (issue 17): the load channel in virtual time."""

from __future__ import annotations

from simulations.freshness import FreshRun, run_freshness


def test_load_gossip_keeps_placement_state_fresh_within_its_byte_budget() -> None:
    report = run_freshness(FreshRun(nodes=32, seconds=3.0, warm_s=3.0, owner_check=False))
    assert report["never_share"] == 0.0
    assert report["staleness_p99_s"] is not None and report["staleness_p99_s"] < 1.0
    # The budget bounds the bytes whatever N is: (500 + header) x 20 messages a second.
    assert report["gossip_kbit_s_per_member"] <= 100.0
    assert report["gossip_messages_per_member_s"] <= 20.0


def test_without_gossip_only_the_owners_replies_tell_an_entry_point_their_load() -> None:
    silent = run_freshness(
        FreshRun(nodes=32, seconds=3.0, warm_s=3.0, gossip=False, owner_check=False)
    )
    assert silent["gossip_kbit_s_per_member"] == 0.0
    # Replies alone: members we sent to lately are known; at 20 tasks/s over 32 members
    # most were, but their state is as old as the last task sent there.
    assert 0.0 < float(silent["never_share"]) < 0.2  # type: ignore[arg-type]
    none = run_freshness(
        FreshRun(nodes=32, seconds=3.0, warm_s=3.0, gossip=False, replies=False, owner_check=False)
    )
    assert none["never_share"] > 0.95  # only decisions on itself know any load
    assert none["age_p50_s"] is None  # ``never`` is a miss: sorted last, no percentile


def test_the_owner_check_makes_every_decision_use_state_at_most_trust_s_old() -> None:
    """Without gossip and with few tasks per member (most owners unknown to the entry point):
    the view alone has no state for most decisions; with the owner check every decision uses
    the owner's current state or a record at most trust_s old, and meets a saturated owner's
    refusal about as often as owners are saturated."""
    base = {"nodes": 200, "seconds": 3.0, "warm_s": 2.0, "gossip": False, "tasks_per_member_s": 2.0}
    view = run_freshness(FreshRun(**base, owner_check=False))  # type: ignore[arg-type]
    assert view["never_share"] > 0.5 and view["age_p99_s"] is None
    checked = run_freshness(FreshRun(**base, saturated_share=0.1))  # type: ignore[arg-type]
    assert checked["never_share"] == 0.0
    assert checked["age_max_s"] is not None and checked["age_max_s"] <= 0.5  # trust_s
    assert checked["staleness_p99_s"] == 0.0 or checked["staleness_p99_s"] < 0.5
    assert 0.05 < checked["refusals_per_decision"] < 0.15  # type: ignore[operator]
    assert checked["owner_checked_share"] > 0.9  # type: ignore[operator]
