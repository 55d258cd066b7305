"""Hedged forwards with real daemons: a stalled owner costs the hedge delay, not the ack
timeout, and the losing copy is withdrawn so the producer gets exactly one Result."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from gossipd.core.ring import Ring
from simulations.cluster import Cluster
from tests.helpers import RawProducer, scrape

ACK_TIMEOUT_S = 2.0


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    c = Cluster(
        3,
        log_dir=str(tmp_path),
        extra_overrides=[
            "fanout.hedge=true",  # with the default budget: a burst of 10, then 10% of forwards
            f"fanout.ack_timeout_s={ACK_TIMEOUT_S}",
            "engine.token_delay_s=0.05",  # 4 tokens: a task runs 200 ms, like a short LLM call
            'metrics.bind="127.0.0.1:0"',
        ],
    )
    c.start()
    c.wait_converged(timeout_s=20)
    c.wait_meta(timeout_s=20)
    yield c
    c.stop()


def _metric(daemon, name: str) -> float:  # type: ignore[no-untyped-def]
    return scrape(daemon.metrics_port).get(name, 0.0)


def _warm_up(producer: RawProducer) -> None:
    """Forwards with normal acks: hedging waits for an estimate of the usual ack time."""
    warm = [f"w{i}" for i in range(150)]
    for i, task_id in enumerate(warm):
        producer.send_task(task_id, "a b c d", key=f"warm-{i}", params={"max_tokens": 1})
    assert all(r["ok"] for r in producer.results(len(warm), timeout_s=30))


def _keys_of(cluster: Cluster, member: str, n: int) -> list[str]:
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    return [k for k in (f"h-{i}" for i in range(40 * n)) if ring.owner(k) == member][:n]


def _send_while_stopped(
    producer: RawProducer,
    stalled,
    keys: list[str],
    tokens: int,  # type: ignore[no-untyped-def]
) -> tuple[list[dict[str, object]], dict[str, float], list[dict[str, object]]]:
    """Stop ``stalled``, send one task per key, collect a Result for each, resume it; then
    whatever else arrives in the next seconds.  Returns (results, latency by id, late)."""
    stalled.pause()
    try:
        sent_at = {}
        for i, key in enumerate(keys):
            sent_at[f"t{i}"] = time.monotonic()
            producer.send_task(f"t{i}", "a b c d", key=key, params={"max_tokens": tokens})
        got = producer.results(len(keys), timeout_s=30)
        latency = {str(r["id"]): time.monotonic() - sent_at[str(r["id"])] for r in got}
    finally:
        stalled.resume()
    # Resumed, the stalled owner reads each Forward and then its Withdraw: nothing more
    # reaches the producer.
    return got, latency, producer.replies(timeout_s=3.0, quiet_s=1.5)


def test_a_stalled_owner_is_hedged_and_its_copy_withdrawn(cluster: Cluster) -> None:
    entry, stalled, spare = cluster.daemons
    producer = RawProducer(entry.endpoint)
    try:
        _warm_up(producer)
        assert _metric(entry, "gossipd_fanout_hedged_total") == 0, "no hedge while acks are normal"

        keys = _keys_of(cluster, stalled.name, 10)  # the burst the budget allows at once
        got, latency, late = _send_while_stopped(producer, stalled, keys, tokens=4)
    finally:
        producer.close()

    assert len(got) == len(latency) == len(keys)
    assert all(r["ok"] and r["node"] == spare.name for r in got), got[:3]
    # Without hedging each would wait the 2 s ack timeout first.
    assert max(latency.values()) < ACK_TIMEOUT_S / 2, sorted(latency.values())[-3:]
    results = Counter(r["id"] for r in [*got, *late] if r["t"] == 3)
    assert all(n == 1 for n in results.values()), "exactly one Result per task"
    assert not [r for r in late if r["t"] == 2], "the withdrawn copies streamed nothing"
    assert _metric(entry, "gossipd_fanout_hedged_total") == len(keys)
    assert _metric(entry, "gossipd_fanout_hedge_wins_total") == len(keys)
    assert _metric(stalled, "gossipd_fanout_withdrawn_by_peers_total") == len(keys)
    assert _metric(stalled, "gossipd_task_results_total{outcome=withdrawn}") == len(keys)
    assert _metric(stalled, "gossipd_tasks_pending") == 0


def test_hedges_stay_within_the_budget(cluster: Cluster) -> None:
    entry, stalled, _spare = cluster.daemons
    producer = RawProducer(entry.endpoint)
    try:
        _warm_up(producer)
        keys = _keys_of(cluster, stalled.name, 30)
        got, _, _ = _send_while_stopped(producer, stalled, keys, tokens=4)
    finally:
        producer.close()
    assert len(got) == len(keys) and all(r["ok"] for r in got)
    hedged = _metric(entry, "gossipd_fanout_hedged_total")
    over = _metric(entry, "gossipd_fanout_hedges_over_budget_total")
    # A burst of 10 (the 30 forwards' own credit comes after): the rest waited for the ack
    # timeout instead.
    assert 10 <= hedged <= 12, hedged
    assert hedged + over == len(keys)


def test_a_forward_that_timed_out_is_withdrawn_so_a_resumed_owner_adds_no_result(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Without hedging too: the forwarder gives up on a silent owner after the ack timeout
    and sends the task to the next member; the owner, resumed, must not answer it as well."""
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=["fanout.ack_timeout_s=0.3", 'metrics.bind="127.0.0.1:0"'],
    )
    c.start()
    try:
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        entry, stalled = c.daemons
        producer = RawProducer(entry.endpoint)
        try:
            keys = _keys_of(c, stalled.name, 10)
            got, _, late = _send_while_stopped(producer, stalled, keys, tokens=2)
        finally:
            producer.close()
        assert len(got) == len(keys) and all(r["ok"] and r["node"] == entry.name for r in got)
        assert not [r for r in late if r["t"] == 3], "the resumed owner answered again"
        assert _metric(stalled, "gossipd_fanout_withdrawn_by_peers_total") == len(keys)
    finally:
        c.stop()
