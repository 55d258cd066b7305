"""`python -m simulations freshness` (issue 17): the load channel in virtual time."""

from __future__ import annotations

from simulations.freshness import FreshRun, run_freshness


def test_load_gossip_keeps_placement_state_fresh_within_its_byte_budget() -> None:
    report = run_freshness(FreshRun(nodes=32, seconds=3.0, warm_s=3.0))
    assert report["never_share"] == 0.0
    assert report["staleness_p99_s"] is not None and report["staleness_p99_s"] < 1.0
    # The budget bounds the bytes whatever N is: (500 + header) x 20 messages a second.
    assert report["gossip_kbit_s_per_member"] <= 100.0
    assert report["gossip_messages_per_member_s"] <= 20.0


def test_without_gossip_only_the_owners_replies_tell_an_entry_point_their_load() -> None:
    silent = run_freshness(FreshRun(nodes=32, seconds=3.0, warm_s=3.0, gossip=False))
    assert silent["gossip_kbit_s_per_member"] == 0.0
    # Replies alone: members we sent to lately are known; at 20 tasks/s over 32 members
    # most were, but their state is as old as the last task sent there.
    assert 0.0 < float(silent["never_share"]) < 0.2  # type: ignore[arg-type]
    none = run_freshness(FreshRun(nodes=32, seconds=3.0, warm_s=3.0, gossip=False, replies=False))
    assert none["never_share"] > 0.95  # only decisions on itself know any load
