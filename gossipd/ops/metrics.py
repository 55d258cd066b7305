"""Prometheus metrics, read from the components' ``statistics()`` at scrape time.

The hot path only bumps plain integers; this collector turns them into metric families when
Prometheus scrapes, so counting costs nothing measurable per task.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class LatencyHistogram:
    """Fixed buckets, cumulative at export; ``observe`` is one bisect."""

    __slots__ = ("buckets_s", "count", "counts", "sum_s")

    def __init__(self, buckets_s: Iterable[float] = LATENCY_BUCKETS_S) -> None:
        self.buckets_s = tuple(buckets_s)
        self.counts = [0] * (len(self.buckets_s) + 1)
        self.count = 0
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.count += 1
        self.sum_s += value_s

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets_s), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


def _one(family: type[Any], name: str, doc: str, value: float) -> Metric:
    """A family with one unlabelled sample."""
    metric = family(name, doc)
    metric.add_metric([], value)
    return metric  # type: ignore[no-any-return]


def _by(
    family: type[Any], name: str, doc: str, label: str, values: Iterable[tuple[str, float]]
) -> Metric:
    """A family with one sample per value of ``label``."""
    metric = family(name, doc, labels=[label])
    for key, value in values:
        metric.add_metric([key], value)
    return metric  # type: ignore[no-any-return]


C, G = CounterMetricFamily, GaugeMetricFamily


class DaemonCollector:
    """Exports the figures of a running daemon.  ``snapshot`` returns a dict of statistics."""

    def __init__(self, node: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._node = node
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        ing, adm, rep, eng = s["ingress"], s["admission"], s["replies"], s["engine"]
        yield _one(
            C, "gossipd_messages_received", "Messages read from the ingress socket", ing.received
        )
        yield _by(
            C,
            "gossipd_messages_refused",
            "Messages refused, by reason",
            "reason",
            sorted(ing.refused.items()),
        )
        yield _one(
            C,
            "gossipd_messages_unanswerable",
            "Refused messages with no readable reply_to",
            ing.unanswerable,
        )
        yield _by(
            C,
            "gossipd_task_results",
            "Final results, by outcome",
            "outcome",
            sorted(ing.results.items()),
        )
        yield _one(C, "gossipd_task_duplicates", "Task ids seen again (absorbed)", adm.duplicates)
        yield _one(G, "gossipd_tasks_pending", "Tasks queued or running", adm.pending)
        yield _one(G, "gossipd_tasks_running", "Tasks on the engine", ing.running)
        yield _one(
            G,
            "gossipd_task_service_seconds",
            "Smoothed time a worker holds a task that runs to its end (0 before the first)",
            ing.service_s,
        )
        yield _one(
            G,
            "gossipd_queue_wait_expected_seconds",
            "Expected queueing wait of a task arriving now (admission refuses beyond its bound)",
            ing.expected_wait_s,
        )
        yield _one(
            G, "gossipd_results_cached", "Results kept for duplicate ids", adm.cached_results
        )
        yield _one(
            G, "gossipd_reply_sockets_open", "Cached sockets to reply addresses", rep.sockets_open
        )
        yield _one(G, "gossipd_replies_queued", "Replies waiting for their address", rep.queued)
        yield _by(
            C,
            "gossipd_replies_dropped",
            "Replies not delivered",
            "reason",
            [("undeliverable", rep.dropped_undeliverable), ("queue_full", rep.dropped_queue_full)],
        )
        yield _one(C, "gossipd_replies_sent", "Replies handed to ZeroMQ", rep.sent)
        yield _one(
            C,
            "gossipd_engine_generated_tokens",
            "Tokens the engine produced",
            eng.generated_tokens_total,
        )
        yield _one(
            G,
            "gossipd_engine_running_requests",
            "Requests running in the engine",
            eng.running_requests,
        )
        yield _one(
            G,
            "gossipd_engine_waiting_requests",
            "Requests waiting in the engine",
            eng.waiting_requests,
        )
        yield _one(
            G, "gossipd_engine_kv_cache_usage_ratio", "KV-cache use, 0..1", eng.kv_cache_usage_ratio
        )
        yield _one(
            G,
            "gossipd_engine_unfinished_requests",
            "Requests the engine holds (running, waiting or being aborted)",
            eng.unfinished_requests,
        )
        yield _one(
            G, "gossipd_engine_queued_tokens", "Prompt tokens not yet run", eng.queued_tokens
        )
        yield _one(
            C,
            "gossipd_engine_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the engine's prefix cache",
            eng.prefix_cache_queries_total,
        )
        yield _one(
            C,
            "gossipd_engine_prefix_cache_hits_tokens",
            "Prompt tokens found in the engine's prefix cache",
            eng.prefix_cache_hits_total,
        )
        yield _by(
            C,
            "gossipd_cancels",
            "Producer cancels by outcome (here, forwarded, unknown)",
            "outcome",
            sorted(ing.cancels.items()),
        )
        gossip = s.get("gossip")
        if gossip is not None and gossip.core is not None:
            yield from _gossip_metrics(gossip)
        dispatcher = s.get("dispatcher")
        if dispatcher is not None:
            yield from _dispatch_metrics(dispatcher)
        security = s.get("security")
        if security is not None and security.curve:
            yield from _security_metrics(security)
        hist = ing.latency
        latency = HistogramMetricFamily("gossipd_task_latency_seconds", "Receipt to final result")
        latency.add_metric([], hist.cumulative(), sum_value=hist.sum_s)
        yield latency


def _security_metrics(security: Any) -> Iterator[Metric]:
    zap = security.zap
    refused = CounterMetricFamily(
        "gossipd_auth_refused",
        "CURVE connections refused by the ZAP handler, by domain and reason",
        labels=["domain", "reason"],
    )
    for (domain, reason), count in sorted(zap.refused.items()):
        refused.add_metric([domain, reason], count)
    yield refused
    yield _by(
        C,
        "gossipd_auth_admitted",
        "CURVE connections admitted by the ZAP handler, by domain",
        "domain",
        sorted(zap.admitted.items()),
    )
    yield _by(
        C,
        "gossipd_auth_revoked_messages",
        "Messages refused on a connection whose key was revoked since it opened",
        "domain",
        sorted(security.counters.revoked_messages.items()),
    )
    yield _by(
        C,
        "gossipd_peer_src_mismatch",
        "Peer messages refused: their source is not the node their key belongs to",
        "channel",
        sorted(security.counters.src_mismatch.items()),
    )
    yield _by(
        G,
        "gossipd_auth_keys",
        "Authorised public keys loaded, by directory",
        "domain",
        [("peers", len(security.peers.by_key)), ("producers", len(security.producers.by_key))],
    )


def serve_metrics(bind: str, collector: DaemonCollector) -> tuple[CollectorRegistry, int]:
    """Start the HTTP endpoint (a daemon thread); returns the registry and the bound port."""
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    host, _, port = bind.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    return registry, server.server_address[1]


def _gossip_metrics(gossip: Any) -> Iterator[Metric]:
    core = gossip.core
    counts: dict[str, int] = {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
    for m in core.table.members.values():
        counts[m.state.value] += 1
    yield _by(
        G, "gossipd_members", "Members known, by state (not counting us)", "state", counts.items()
    )
    stats = core.stats
    yield _by(
        C,
        "gossipd_gossip_messages_sent",
        "Membership messages sent",
        "type",
        sorted(stats.sent.items()),
    )
    yield _by(
        C,
        "gossipd_gossip_messages_received",
        "Membership messages received",
        "type",
        sorted(stats.received.items()),
    )
    for name, doc, value in (
        ("gossipd_gossip_bytes_sent", "Membership bytes sent", stats.sent_bytes),
        ("gossipd_gossip_bytes_received", "Membership bytes received", stats.received_bytes),
        ("gossipd_gossip_refused", "Undecodable membership messages", stats.refused),
        (
            "gossipd_gossip_foreign_cluster",
            "Messages of another cluster, ignored",
            stats.foreign_cluster,
        ),
        ("gossipd_gossip_probes", "Probes started", stats.probes),
        ("gossipd_gossip_probes_failed", "Probes that ended in a suspicion", stats.probes_failed),
        (
            "gossipd_gossip_refutations",
            "Times we refuted a suspicion of ourselves",
            stats.refutations,
        ),
        ("gossipd_gossip_declared_dead", "Members we declared dead", stats.declared_dead),
        (
            "gossipd_gossip_sends_dropped",
            "Sends dropped at a full peer queue",
            gossip.dropped_sends,
        ),
    ):
        yield _one(C, name, doc, value)
    yield _one(
        G, "gossipd_gossip_awareness", "Local health score (0 = healthy)", core.awareness.score
    )
    yield _one(
        G, "gossipd_gossip_checksum", "Checksum of the live member set", core.table.checksum()
    )


def _dispatch_metrics(dispatcher: Any) -> Iterator[Metric]:
    stats = dispatcher.statistics()
    for name, doc, value in (
        ("gossipd_fanout_local", "Tasks from our intake run here", stats.local),
        (
            "gossipd_fanout_forwarded",
            "Tasks forwarded and accepted by another member",
            stats.forwarded,
        ),
        (
            "gossipd_fanout_accepted_from_peers",
            "Forwarded tasks we accepted",
            stats.accepted_from_peers,
        ),
        ("gossipd_fanout_refused_to_peers", "Forwarded tasks we refused", stats.refused_to_peers),
        (
            "gossipd_fanout_attempts_failed",
            "Forward attempts without a reply in time",
            stats.attempts_failed,
        ),
        ("gossipd_fanout_unavailable", "Tasks no member took", stats.unavailable),
        ("gossipd_fanout_migrated", "Tasks re-dispatched off a dead member", stats.migrated),
        ("gossipd_fanout_handed_off", "Queued tasks handed to others at drain", stats.handed_off),
        ("gossipd_fanout_bad_peer_messages", "Undecodable peer messages", stats.bad_peer_messages),
        ("gossipd_fanout_hedged", "Forwards also sent to a second member", stats.hedged),
        ("gossipd_fanout_hedge_wins", "Hedged tasks the second member won", stats.hedge_wins),
        (
            "gossipd_fanout_hedges_over_budget",
            "Slow acks not hedged because fanout.hedge_budget was spent",
            stats.hedges_over_budget,
        ),
        (
            "gossipd_fanout_withdrawn",
            "Copies we withdrew (a hedge lost, no ack in time, or the member was declared dead)",
            stats.withdrawn,
        ),
        (
            "gossipd_fanout_withdrawn_by_peers",
            "Copies a forwarder withdrew from us before they finished",
            stats.withdrawn_by_peers,
        ),
        (
            "gossipd_fanout_peer_links_closed",
            "Connections to addresses of no live member closed after fanout.peer_idle_close_s",
            stats.peer_links_closed,
        ),
    ):
        yield _one(C, name, doc, value)
    yield _by(
        G,
        "gossipd_fanout_outstanding",
        "Forwarded tasks not reported done, by owner",
        "member",
        sorted(dispatcher.outstanding().items()),
    )


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """A daemon's Prometheus samples as {"name{label=value,...}": value} (tests, benchmarks)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{host}:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
