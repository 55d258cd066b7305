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


class DaemonCollector:
    """Exports the figures of a running daemon.  ``snapshot`` returns a dict of statistics."""

    def __init__(self, node: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._node = node
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        ing, adm, rep = s["ingress"], s["admission"], s["replies"]
        received = CounterMetricFamily(
            "gossipd_messages_received", "Messages read from the ingress socket"
        )
        received.add_metric([], ing.received)
        yield received
        refused = CounterMetricFamily(
            "gossipd_messages_refused", "Messages refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(ing.refused.items()):
            refused.add_metric([reason], n)
        yield refused
        unanswerable = CounterMetricFamily(
            "gossipd_messages_unanswerable", "Refused messages with no readable reply_to"
        )
        unanswerable.add_metric([], ing.unanswerable)
        yield unanswerable
        results = CounterMetricFamily(
            "gossipd_task_results", "Final results, by outcome", labels=["outcome"]
        )
        for outcome, n in sorted(ing.results.items()):
            results.add_metric([outcome], n)
        yield results
        dup = CounterMetricFamily("gossipd_task_duplicates", "Task ids seen again (absorbed)")
        dup.add_metric([], adm.duplicates)
        yield dup
        for name, doc, value in (
            ("gossipd_tasks_pending", "Tasks queued or running", adm.pending),
            ("gossipd_tasks_running", "Tasks on the engine", ing.running),
            ("gossipd_results_cached", "Results kept for duplicate ids", adm.cached_results),
            ("gossipd_reply_sockets_open", "Cached sockets to reply addresses", rep.sockets_open),
            ("gossipd_replies_queued", "Replies waiting for their address", rep.queued),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge
        dropped = CounterMetricFamily(
            "gossipd_replies_dropped", "Replies not delivered", labels=["reason"]
        )
        dropped.add_metric(["undeliverable"], rep.dropped_undeliverable)
        dropped.add_metric(["queue_full"], rep.dropped_queue_full)
        yield dropped
        sent = CounterMetricFamily("gossipd_replies_sent", "Replies handed to ZeroMQ")
        sent.add_metric([], rep.sent)
        yield sent
        eng = s["engine"]
        tokens = CounterMetricFamily(
            "gossipd_engine_generated_tokens", "Tokens the engine produced"
        )
        tokens.add_metric([], eng.generated_tokens_total)
        yield tokens
        for name, doc, value in (
            (
                "gossipd_engine_running_requests",
                "Requests running in the engine",
                eng.running_requests,
            ),
            (
                "gossipd_engine_waiting_requests",
                "Requests waiting in the engine",
                eng.waiting_requests,
            ),
            ("gossipd_engine_kv_cache_usage_ratio", "KV-cache use, 0..1", eng.kv_cache_usage_ratio),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge
        hist = ing.latency
        latency = HistogramMetricFamily("gossipd_task_latency_seconds", "Receipt to final result")
        latency.add_metric([], hist.cumulative(), sum_value=hist.sum_s)
        yield latency


def serve_metrics(bind: str, collector: DaemonCollector) -> tuple[CollectorRegistry, int]:
    """Start the HTTP endpoint (a daemon thread); returns the registry and the bound port."""
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    host, _, port = bind.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    return registry, server.server_address[1]
