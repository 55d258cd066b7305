"""Token budgets on a real daemon: a runaway producer is answered over_budget (with a retry-after
hint) while a producer within its budget is served; the refusals are counted."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gossipd.tools.launcher import free_tcp_port
from simulations.cluster import Cluster
from tests.helpers import RawProducer, key_owned_by, running, scrape, wait_until

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


def test_a_resend_of_a_task_is_charged_once(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """PROTOCOL.md: a task is charged once when its entry point takes it, and a duplicate of
    a pending or finished task is never refused: resends of an id this daemon holds (here
    answered and cached) are answered from its cache and charged nothing, so a producer
    that resends does not spend its budget on them."""
    daemon = daemon_factory(*BUDGETS)
    producer = RawProducer(daemon.endpoint)
    try:
        # 12 tokens each against prefix:bad's burst of 50: four new tasks at most.
        producer.send_task("r1", prompt="x y z", key="bad:1", params={"max_tokens": 10})
        [first] = producer.results(1)
        assert first["ok"]
        for attempt in range(1, 21):
            producer.send_task("r1", prompt="x y z", key="bad:1", params={"max_tokens": 10},
                               attempt=attempt)  # fmt: skip
        resent = producer.results(20)
        producer.send_task("r2", prompt="x y z", key="bad:2", params={"max_tokens": 10})
        [fresh] = producer.results(1)
    finally:
        producer.close()
    assert len(resent) == 20 and all(r["ok"] and r["text"] == first["text"] for r in resent)
    assert fresh["ok"], fresh  # the budget was not spent on the resends


def test_a_resend_with_other_fields_is_answered_where_its_id_is_held(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A review's exploit: a producer in debt resent one cached id with new keys, prompts
    and max_tokens 4000; taken as a resend it was not charged, and its new key placed it
    on the other member, which ran it: a free run of 4000 tokens a send.  Now a resend of
    an id its entry point holds is answered there (the cached Result), wherever its key
    points."""
    cluster = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[*BUDGETS, "budgets.interval_s=0.5"],
    )
    with running(cluster):
        d0 = cluster.daemons[0]
        here, there = key_owned_by(cluster, "d00", "bad:"), key_owned_by(cluster, "d01", "bad:")
        producer = RawProducer(d0.endpoint)
        try:
            producer.send_task("x", prompt="x", key=here, params={"max_tokens": 60})
            [first] = producer.results(1)  # 61 tokens against a burst of 50: in debt
            assert first["ok"] and first["node"] == "d00", first
            for attempt in range(1, 6):
                producer.send_task("x", prompt=f"free work {attempt}", key=there,
                                   params={"max_tokens": 4000}, attempt=attempt)  # fmt: skip
            resent = producer.results(5)
            producer.send_task("fresh", prompt="x", key=here, params={"max_tokens": 10})
            [fresh] = producer.results(1)
        finally:
            producer.close()
    assert all(r["ok"] and r["node"] == "d00" and r["text"] == first["text"] for r in resent)
    assert not fresh["ok"] and fresh["error"]["code"] == "over_budget", fresh


def test_budgets_off_by_default_and_said_at_start_up(daemon_factory) -> None:
    daemon = daemon_factory()
    wait_until(
        lambda: any("token budgets: off" in e.get("msg", "") for e in daemon.events()),
        10,
        "the start-up line about budgets",
    )


def _budget_source(daemon) -> str:  # type: ignore[no-untyped-def]
    metrics = scrape(daemon.metrics_port)
    return next((k for k in metrics if k.startswith("gossipd_budget_source{")), "")


@pytest.mark.slow
def test_leader_sets_the_budgets_and_they_stay_while_etcd_is_down(etcd, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With etcd the leader's budgets directive reaches every daemon (the same cluster rate
    on all, each enforcing half); etcd stopped: the leader steps down, the budgets stay and
    the runaway is still refused."""
    cluster = Cluster(
        2,
        log_dir=str(tmp_path / "daemons"),
        extra_overrides=[
            f"etcd.endpoints={json.dumps(etcd.endpoints)}",
            "etcd.ttl_s=1.0",
            "etcd.request_timeout_s=0.5",
            'metrics.bind="127.0.0.1:0"',
            "budgets.interval_s=0.5",
            *BUDGETS,
        ],
    )
    cluster.start()
    try:
        cluster.wait_meta(20)
        daemons = cluster.daemons
        for d in daemons:
            # The leader's first budgets may predate the other's GPU state: 1 x 1000.
            wait_until(
                lambda d=d: (
                    _budget_source(d) == "gossipd_budget_source{source=leader}"
                    and scrape(d.metrics_port)["gossipd_budget_cluster_tokens_per_s"] == 2000.0
                ),
                20,
                f"{d.name} to apply the leader's budgets of 2 x 1 x 1000 tokens/s",
            )
            metrics = scrape(d.metrics_port)
            assert metrics["gossipd_budget_share"] == 0.5
            assert metrics["gossipd_budget_directives_total{outcome=applied}"] >= 1
        assert any("token budgets: set by the leader" in e.get("msg", "") for e in d.events())

        def runaway_refused(name: str) -> int:
            bad = RawProducer(daemons[1].endpoint)
            try:
                for i in range(30):  # 12 tokens each against 25 tokens/s here (burst 25)
                    bad.send_task(f"{name}{i}", prompt="x y z", key=f"bad:{i}",
                                  params={"max_tokens": 10})  # fmt: skip
                results = bad.results(30)
            finally:
                bad.close()
            assert len(results) == 30
            return sum(not r["ok"] and r["error"]["code"] == "over_budget" for r in results)

        assert runaway_refused("before") >= 25
        etcd.stop(0)
        wait_until(
            lambda: all(scrape(d.metrics_port).get("gossipd_is_leader") == 0 for d in daemons),
            10,
            "the leader to step down without etcd",
        )
        time.sleep(1.0)  # a few budgets.interval_s: nothing may recompute them locally now
        for d in daemons:
            assert _budget_source(d) == "gossipd_budget_source{source=leader}"
            assert scrape(d.metrics_port)["gossipd_budget_cluster_tokens_per_s"] == 2000.0
        assert runaway_refused("during") >= 25
    finally:
        cluster.stop()


@contextlib.contextmanager
def _curve_producers(  # type: ignore[no-untyped-def]
    daemon_factory, tmp_path, names: list[str], overrides: Callable[[Any], list[str]]
) -> Iterator[tuple[Any, list[Any]]]:
    """A CURVE daemon "s0" with budgets on and ``overrides(keys)``, and a producer for each
    of ``names`` (its own key pair): (keys, producers), closed after."""
    from tests.test_curve import CurveProducer, Keys, curve_daemon

    keys = Keys(tmp_path, peers=["s0"], producers=names)
    daemon = curve_daemon(daemon_factory, keys, "s0", "budgets.enabled=true", *overrides(keys))
    producers = [CurveProducer(daemon.endpoint, keys.pair(n), keys.public("s0")) for n in names]
    try:
        yield keys, producers
    finally:
        for producer in producers:
            producer.close()


def test_a_curve_producer_is_charged_by_its_key_whatever_its_task_keys(
    daemon_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Under CURVE the identity is the authenticated key: a producer blocked by key (budget 0)
    is refused even with a key prefix that has a budget; another key is served."""
    with _curve_producers(
        daemon_factory,
        tmp_path,
        ["blocked", "fine"],
        lambda keys: [
            f'budgets.tokens_per_s={{"curve:{keys.public("blocked").decode()}" = 0.0}}',
            'budgets.shares={"prefix:good" = 0.5}',
        ],
    ) as (keys, (blocked, fine)):
        blocked.send_task("b-1", key="good:1", params={"max_tokens": 2})
        fine.send_task("f-1", key="good:1", params={"max_tokens": 2})
        (refused,) = blocked.results(1, timeout_s=10)
        (served,) = fine.results(1, timeout_s=10)
    assert served["ok"]
    assert refused["error"]["code"] == "over_budget"
    assert f"curve:{keys.public('blocked').decode()}" in refused["error"]["message"]
    assert refused["error"]["retry_after_ms"] == 10_000  # a budget of 0: the longest hint


def test_an_id_in_use_refusal_is_not_charged_on_a_daemon_alone(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """PROTOCOL.md: a task refused id_in_use at the entry point is not charged.  A daemon
    without fan-out (no gossip.bind) checked the id only in admission, after the budget:
    each refusal spent the other key's tokens.  B (10 tokens/s, a burst of 100) sends A's
    id five times (20 tokens each), then five tasks of its own, which must still be served."""
    task = {"prompt": "x y z", "params": {"max_tokens": 18}}  # 1 + 18 + ... about 20 tokens
    with _curve_producers(
        daemon_factory,
        tmp_path,
        ["pa", "pb"],
        lambda keys: [
            'gossip.bind=""',
            f'budgets.tokens_per_s={{"curve:{keys.public("pb").decode()}" = 10.0}}',
            "budgets.burst_s=10.0",  # 100 tokens, refilled at 10 a second
        ],
    ) as (_keys, (a, b)):
        a.send_task("same", **task)
        assert [r["ok"] for r in a.results(1, timeout_s=10)] == [True]
        for _ in range(5):
            b.send_task("same", **task)
        refused = b.results(5, timeout_s=10)
        for i in range(5):
            b.send_task(f"b-own-{i}", **task)
        own = b.results(5, timeout_s=10)
    assert [r["error"]["code"] for r in refused] == ["id_in_use"] * 5
    # B's burst was not spent on the refusals: its own five fit it (charged, one was served)
    assert [r["ok"] for r in own] == [True] * 5, own
