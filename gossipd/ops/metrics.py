"""Prometheus metrics, read from the components' ``statistics()`` at scrape time.

The hot path only bumps plain integers; this collector turns them into metric families when
Prometheus scrapes, so counting costs nothing measurable per task.
"""

from __future__ import annotations

import bisect
import hmac
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer

from gossipd.ops.logs import RateLimiter
from gossipd.security import is_loopback_host as is_loopback  # one rule for both

log = logging.getLogger("gossipd.ops.metrics")

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
            G,
            "gossipd_results_cached_bytes",
            "Bytes of the results kept (ingress.results_cache_bytes_max)",
            adm.cached_results_bytes,
        )
        yield _by(
            C,
            "gossipd_results_evicted",
            "Results forgotten for room, by the bound that forced it",
            "reason",
            [("count", adm.results_evicted_count), ("bytes", adm.results_evicted_bytes)],
        )
        yield _one(
            G,
            "gossipd_tasks_pending_bytes",
            "Bytes of the tasks queued or running (ingress.pending_bytes_max)",
            adm.pending_bytes,
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
            [
                ("undeliverable", rep.dropped_undeliverable),
                ("queue_full", rep.dropped_queue_full),
                ("queue_bytes", rep.dropped_queue_bytes),
            ],
        )
        yield _one(
            G,
            "gossipd_replies_queued_bytes",
            "Bytes of replies waiting for their address (ingress.reply_queue_bytes_max)",
            rep.queued_bytes,
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
            "Producer cancels by outcome (here, forwarded, unknown, refused: not from the task's producer key)",
            "outcome",
            sorted(ing.cancels.items()),
        )
        admin = s.get("admin")
        if admin is not None:
            admin_family = CounterMetricFamily(
                "gossipd_admin_requests",
                "Admin requests (StatusQuery, Drain) by kind and outcome (ok, refused, relayed)",
                labels=["kind", "outcome"],
            )
            for label, count in sorted(admin.items()):
                kind, _, outcome = label.partition(":")
                admin_family.add_metric([kind, outcome], count)
            yield admin_family
        gossip = s.get("gossip")
        if gossip is not None and gossip.core is not None:
            yield from _gossip_metrics(gossip)
        dispatcher = s.get("dispatcher")
        if dispatcher is not None:
            yield from _dispatch_metrics(dispatcher)
        load_gossip = s.get("load_gossip")
        if load_gossip is not None:
            yield from _load_gossip_metrics(load_gossip, dispatcher)
        budgets = s.get("budgets")
        if budgets is not None:
            yield from _budget_metrics(budgets)
        leadership = s.get("leadership")
        if leadership is not None:
            yield from _leadership_metrics(leadership.statistics())
        duties = s.get("leader_duties")
        if duties is not None:
            yield from _duty_metrics(duties.statistics())
        security = s.get("security")
        if security is not None and security.curve:
            yield from _security_metrics(security)
        hist = ing.latency
        latency = HistogramMetricFamily("gossipd_task_latency_seconds", "Receipt to final result")
        latency.add_metric([], hist.cumulative(), sum_value=hist.sum_s)
        yield latency


def _leadership_metrics(st: Any) -> Iterator[Metric]:
    """Leader election through etcd (gossipd/leader/), when etcd.endpoints is set."""
    yield _one(
        G,
        "gossipd_leader_term",
        "The highest leader token (term) this daemon has seen",
        st["term_token"],
    )
    yield _one(
        G, "gossipd_is_leader", "1 while this daemon is the leader, else 0", int(st["is_leader"])
    )
    yield _one(
        C, "gossipd_leader_elections", "Times this daemon was elected leader", st["elections"]
    )
    yield _by(
        C,
        "gossipd_leader_step_downs",
        "Times this daemon stopped leading, by reason (lease_expired, lease_lost, key_gone, resigned)",
        "reason",
        sorted(st["step_downs"].items()),
    )
    yield _by(
        C,
        "gossipd_directives_refused",
        "Leader directives refused (stale_token: below the highest token seen; superseded; conflict; kinds_full)",
        "reason",
        sorted(st["directives_refused"].items()),
    )
    yield _one(
        C,
        "gossipd_directives_admitted",
        "Leader directives applied here",
        st["directives_admitted"],
    )
    yield _one(
        C,
        "gossipd_etcd_errors",
        "etcd calls of the election that failed (etcd down, slow or refusing)",
        st["etcd_errors"],
    )


def _duty_metrics(st: Any) -> Iterator[Metric]:
    """The leader's duties and their directives on this member (gossipd/leader/builtin.py)."""
    yield _one(
        C,
        "gossipd_seed_registry_writes",
        "Writes of the seeds in etcd by this daemon while it led (one per change of seeds)",
        st["seed_writes"],
    )
    yield _one(
        C,
        "gossipd_members_forgotten",
        "Members dropped from this daemon's table by the leader's forget directives",
        st["forgotten"],
    )
    yield _by(
        C,
        "gossipd_duty_directives_refused",
        "forget and drain directives not acted on (bad_body; before_start: a drain order older "
        "than this process; not_drained: leave or restart for a member not drained; refused: "
        "the drain itself was refused, e.g. while shutting down)",
        "reason",
        sorted(st["refused"].items()),
    )
    yield _by(
        C,
        "gossipd_drain_orders",
        "Rolling-drain orders addressed to this member and obeyed, by action (drain, leave, "
        "restart; the leader repeats an order until it is done, and each repeat counts)",
        "action",
        sorted(st["drain_orders"].items()),
    )


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


class MetricsGuard:
    """The bearer-token check in front of /metrics (empty token: none asked).  Runs in the
    HTTP server's threads; ``unauthorized`` is a plain int (one writer at a time under the
    GIL is enough for a counter read at scrape time)."""

    def __init__(self, token: str = "") -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self.unauthorized = 0
        self._log = RateLimiter(per_s=1.0, burst=5)

    def allows(self, authorization: str) -> bool:
        if not self._expected:
            return True
        if hmac.compare_digest(authorization.encode("latin-1", "replace"), self._expected):
            return True
        self.unauthorized += 1
        if self._log.allow():
            log.warning(
                "refused a metrics request without the bearer token",
                extra={"suppressed_since_last": self._log.suppressed},
            )
            self._log.suppressed = 0
        return False

    def collect(self) -> Iterator[Metric]:
        yield _one(
            C,
            "gossipd_metrics_unauthorized_requests",
            "Metrics requests refused with 401 (no or wrong bearer token)",
            self.unauthorized,
        )




class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve_metrics(
    bind: str, collector: DaemonCollector, *, token: str = ""
) -> tuple[CollectorRegistry, int]:
    """Start the HTTP endpoint (a daemon thread); returns the registry and the bound port.
    With ``token``, a request without "Authorization: Bearer <token>" gets 401 (counted in
    ``gossipd_metrics_unauthorized_requests_total``).  A non-loopback address without a token
    is served, with a warning."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not token and not is_loopback(host):
        log.warning(
            "metrics are served on a non-loopback address without a bearer token: anyone who "
            "can reach it reads them; bind metrics.bind to 127.0.0.1 or set "
            "metrics.bearer_token_file",
            extra={"bind": bind},
        )
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    guard = MetricsGuard(token)
    registry.register(guard)  # type: ignore[arg-type]
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if guard.allows(environ.get("HTTP_AUTHORIZATION", "")):
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="gossipd"')],
        )
        return [b"401: send the header Authorization: Bearer <metrics.bearer_token_file>\n"]

    family = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(host, int(port), app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return registry, server.server_address[1]


def _budget_metrics(b: Any) -> Iterator[Metric]:
    """Token budgets (ingress/budgets.py); refusals are gossipd_messages_refused_total
    {reason="over_budget"}."""
    yield _one(G, "gossipd_budget_share", "The part of every token budget enforced here", b.share)
    yield _one(
        G,
        "gossipd_budget_cluster_tokens_per_s",
        "The cluster's token rate the budgets were computed from",
        b.cluster_tokens_per_s,
    )
    yield _by(
        G,
        "gossipd_budget_source",
        "Where the budgets come from (1 = this one)",
        "source",
        [(b.source, 1)],
    )
    yield _one(
        G, "gossipd_budget_producers", "Producers with a token bucket here", b.buckets.producers
    )
    yield _one(
        C,
        "gossipd_budget_tokens_admitted",
        "Tokens charged to admitted tasks",
        b.buckets.admitted_tokens,
    )
    yield _by(
        C,
        "gossipd_budget_directives",
        "Budgets directives from the leader, by outcome (applied, invalid: ignored)",
        "outcome",
        [("applied", b.directives_applied), ("invalid", b.directives_invalid)],
    )
    yield _one(
        C,
        "gossipd_budget_overflowed",
        "Tasks charged to the shared overflow bucket (budgets.producers_max reached)",
        b.buckets.overflowed,
    )


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
            "gossipd_gossip_push_pulls",
            "Push-pull exchanges we sent (each in pages: messages_sent type PushPull)",
            stats.push_pulls,
        ),
        (
            "gossipd_gossip_push_pulls_refused",
            "Push-pull exchanges not sent: one to that member in progress, or 8 in all",
            stats.push_pulls_refused,
        ),
        (
            "gossipd_gossip_sends_dropped",
            "Sends dropped at a full peer queue",
            gossip.dropped_sends,
        ),
    ):
        yield _one(C, name, doc, value)
    yield _by(
        C,
        "gossipd_gossip_port_checks",
        "Connects to a member's gossip port, by verdict: accepted (no evidence), dead (refused:"
        " declared dead), stale (refused, but it changed life), over_budget (refused, ignored)",
        "verdict",
        sorted(core.refusals.verdicts.items()),
    )
    yield _one(
        G, "gossipd_gossip_awareness", "Local health score (0 = healthy)", core.awareness.score
    )
    yield _one(
        G, "gossipd_gossip_checksum", "Checksum of the live member set", core.table.checksum()
    )


def _load_gossip_metrics(load_gossip: Any, dispatcher: Any) -> Iterator[Metric]:
    """Load records (issue 17): what load gossip costs, and how many members we know."""
    yield _one(
        C,
        "gossipd_load_gossip_sent_bytes",
        "Bytes of load-gossip messages sent (gossip.load_*)",
        load_gossip.sent_bytes,
    )
    yield _one(
        C,
        "gossipd_load_gossip_sent_messages",
        "Load-gossip messages sent",
        load_gossip.sent_messages,
    )
    yield _one(
        C,
        "gossipd_load_gossip_received_records",
        "Load records received on gossip messages",
        load_gossip.received_records,
    )
    if dispatcher is not None:
        yield _one(
            G,
            "gossipd_load_members_known",
            "Members whose load record this daemon holds",
            len(dispatcher.placer.load_view),
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
            "gossipd_fanout_refused_saturated",
            "Forwards asking if_free refused at once: our engine was saturated (owner check)",
            stats.refused_saturated,
        ),
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
            "gossipd_fanout_invalid_from_peers",
            "Forwards refused because the ingress would refuse their task (version, size)",
            stats.invalid_from_peers,
        ),
        (
            "gossipd_fanout_peer_links_closed",
            "Connections to addresses of no live member closed after fanout.peer_idle_close_s",
            stats.peer_links_closed,
        ),
    ):
        yield _one(C, name, doc, value)
    yield _by(
        C,
        "gossipd_fanout_forgotten",
        "Forwarded tasks forgotten for room before their TaskDone, by the bound that forced it",
        "reason",
        [("count", stats.forwarded_evicted_count), ("bytes", stats.forwarded_evicted_bytes)],
    )
    yield _one(
        G,
        "gossipd_fanout_forwarded_bytes",
        "Bytes of forwarded tasks remembered for migration (fanout.forwarded_bytes_max)",
        stats.forwarded_bytes,
    )
    ages = dispatcher.placer.state_ages
    age = HistogramMetricFamily(
        "gossipd_placement_state_age_seconds",
        "Age of the owner's load state each placement decision used (0: this daemon)",
    )
    age.add_metric([], ages.cumulative(), sum_value=ages.sum_s)
    yield age
    yield _one(
        C,
        "gossipd_placement_state_unknown",
        "Placement decisions on a member of which no load record was known (its Meta only)",
        ages.unknown,
    )
    yield _one(
        C,
        "gossipd_placement_state_owner_checked",
        "Placement decisions left to the owner's own check of its load (if_free: one hop old)",
        ages.owner_checked,
    )
    yield _one(
        C,
        "gossipd_fanout_loads_refused",
        "Load records on a peer reply that named another member than the replying owner",
        dispatcher.loads_refused,
    )
    yield _by(
        G,
        "gossipd_fanout_outstanding",
        "Forwarded tasks not reported done, by owner",
        "member",
        sorted(dispatcher.outstanding().items()),
    )


def scrape(port: int, host: str = "127.0.0.1", token: str = "") -> dict[str, float]:
    """A daemon's Prometheus samples as {"name{label=value,...}": value} (tests, benchmarks)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"http://{host}:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
