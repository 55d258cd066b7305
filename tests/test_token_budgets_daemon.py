"""Token budgets on a real daemon: a runaway producer is answered over_budget (with a retry-after
hint) while a producer within its budget is served; the refusals are counted."""

from __future__ import annotations

from gossipd.tools.launcher import free_tcp_port
from tests.helpers import RawProducer, scrape, wait_until

BUDGETS = [
    "budgets.enabled=true",
    "budgets.tokens_per_s_per_capacity=1000",
    'budgets.shares={"prefix:good" = 0.5, "prefix:bad" = 0.05}',  # 500 and 50 tokens/s
    "budgets.burst_s=1.0",
]


def test_runaway_producer_gets_over_budget_while_the_other_is_served(daemon_factory) -> None:
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}", *BUDGETS)
    daemon.metrics_port = port
    good, bad = RawProducer(daemon.endpoint), RawProducer(daemon.endpoint)
    try:
        # Each task costs ceil(5 / 4) + 10 = 12 tokens: the runaway's burst (50) admits 5 at
        # once; the well-behaved one sends 20 (240 tokens, within its 500).
        for i in range(40):
            bad.send_task(f"bad{i}", prompt="x y z", key=f"bad:{i}", params={"max_tokens": 10})
            if i % 2 == 0:
                good.send_task(
                    f"good{i}", prompt="x y z", key=f"good:{i}", params={"max_tokens": 10}
                )
        good_results = good.results(20)
        bad_results = bad.results(40)
    finally:
        good.close()
        bad.close()
    assert len(good_results) == 20 and all(r["ok"] for r in good_results)
    refused = [r for r in bad_results if not r["ok"]]
    assert 4 <= sum(r["ok"] for r in bad_results) <= 8  # its burst, and what refilled meanwhile
    assert len(refused) >= 30
    for r in refused:
        assert r["error"]["code"] == "over_budget"
        assert 1 <= r["error"]["retry_after_ms"] <= 10_000
        assert "prefix:bad" in r["error"]["message"]
    metrics = wait_until(
        lambda: (
            (m := scrape(daemon.metrics_port)).get(
                "gossipd_messages_refused_total{reason=over_budget}"
            )
            and m
        ),
        10,
        "the over_budget counter",
    )
    assert metrics["gossipd_messages_refused_total{reason=over_budget}"] == len(refused)
    assert metrics["gossipd_budget_share"] == 1.0
    assert any("token budgets: computed here" in e.get("msg", "") for e in daemon.events())


def test_budgets_off_by_default_and_said_at_start_up(daemon_factory) -> None:
    daemon = daemon_factory()
    wait_until(
        lambda: any("token budgets: off" in e.get("msg", "") for e in daemon.events()),
        10,
        "the start-up line about budgets",
    )
