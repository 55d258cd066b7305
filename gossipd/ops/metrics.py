"""Prometheus metrics, read from the components' ``statistics()`` at scrape time.

The hot path only bumps plain integers; this collector turns them into metric families when
Prometheus scrapes, so counting costs nothing measurable per task.  The optional subsystems'
families are in metrics_subsystems.py and metrics_fanout.py; the HTTP endpoint is
metrics_server.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from gossipd.core.replaycheck import OUTCOMES
from gossipd.ops.logs import HANDLER_FAILURES
from gossipd.ops.metric_families import C, G, _by, _one
from gossipd.ops.metrics_fanout import _dispatch_metrics, _held_metrics, _load_gossip_metrics
from gossipd.ops.metrics_subsystems import (
    _budget_metrics,
    _duty_metrics,
    _gossip_metrics,
    _http_metrics,
    _leadership_metrics,
    _security_metrics,
)


def handler_failures_metric() -> Metric:
    return _by(
        C,
        "gossipd_handler_failures",
        "Incoming messages whose handler raised (a bug: logged, rate limited; the reader "
        "goes on), by handler (this process)",
        "handler",
        sorted(HANDLER_FAILURES.items()),
    )


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
        yield _by(
            C,
            "gossipd_ingress_connections_closed",
            "Producers' connections the ingress closed (ingress.receiver loop), by reason: busy "
            "(over 256 shaking hands, 32 from one host, or frames not complete past 16 x 4 x "
            "ingress.message_bytes_max), stalled (part of a frame, no byte for 30 s), refused (a key ZAP refused: also in auth_refused), "
            "the rest ZMTP broken (greeting, socket_type, handshake, too_large, ...)",
            "reason",
            sorted(ing.connections_closed.items()),
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
        yield _one(
            C,
            "gossipd_tasks_not_handed_on",
            "Tasks answered engine_error, not handed to another member nor run again: engines "
            "or daemons died under them engine.deaths_per_task_max times (a query of death?)",
            ing.not_handed_on,
        )
        yield _one(C, "gossipd_task_duplicates", "Task ids seen again (absorbed)", adm.duplicates)
        yield _one(
            C,
            "gossipd_task_duplicates_answered_later",
            "Earlier sends of ids whose later send was answered: not answered again",
            adm.answered_later,
        )
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
        yield _by(
            C,
            "gossipd_reply_sockets_closed",
            "Reply sockets closed: evicted at ingress.reply_sockets_max, or idle",
            "reason",
            [("evicted", rep.sockets_evicted), ("idle", rep.sockets_closed_idle)],
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
            "gossipd_engine_steps",
            "Steps the engine made (vLLM: its core's output batches; echo: tokens). Flat while "
            "gossipd_engine_unfinished_requests is above 0: hung (engine.stall_timeout_s)",
            eng.steps_total,
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
                "Admin requests (StatusQuery, Drain) by kind and outcome (ok, refused, relayed, overloaded: over 50 a second)",
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
        holder = s.get("held_results")  # fanout/holding.py's ResultHolder
        if holder is not None:
            yield from _held_metrics(holder.core)
        door = s.get("http")
        if door is not None:
            yield from _http_metrics(door, s.get("model_cards"))
        replay = s.get("journal_replay")  # ingress/replay.py's JournalReplay
        if replay is not None:
            yield _by(
                C,
                "gossipd_journal_replayed_tasks",
                "Unfinished tasks read from the journal at start (journal.path set), by what "
                "became of them: run, "
                "past_deadline (answered deadline_exceeded), refused (answered), "
                "known_elsewhere (a member holds it: left to that copy), held_here (sent "
                "again meanwhile), left_for_next_start (the daemon began to stop first), "
                "withdrawn (a forwarded one its forwarder withdrew meanwhile), cancelled "
                "(its producer cancelled it meanwhile: answered cancelled)",
                "outcome",
                [(o, replay.outcomes[o]) for o in OUTCOMES],
            )
            journal = replay.journal
            yield _by(
                C,
                "gossipd_journal_errors",
                "Journal trouble, by kind: write (writes, syncs, compactions and closes the "
                "file system refused, e.g. a full disk: those tasks not durable), "
                "damaged_bytes (bytes mid-file that were no record, skipped at replay), "
                "unreadable_tasks (accepted tasks whose record did not decode at replay)",
                "kind",
                [
                    ("write", journal.write_errors),
                    ("damaged_bytes", journal.damaged_bytes),
                    ("unreadable_tasks", journal.unreadable_tasks),
                ],
            )
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
        poll = s.get("busy_poll")  # busypoll.py's BusyPollStatistics
        if poll is not None:
            yield _one(
                C,
                "gossipd_busy_polls",
                "Times the event loop began to poll after a read instead of sleeping "
                "(node.busy_poll_us)",
                poll.polls,
            )
            yield _one(
                C,
                "gossipd_busy_poll_seconds",
                "Time the event loop was kept from sleeping by polls (ended ones): the reads "
                "and requests it handled meanwhile included, and its CPU while it waited",
                poll.polled_s,
            )
            yield _one(
                C,
                "gossipd_busy_polls_declined",
                "Pressure readings (at most one a 0.1 s) that cut a poll short or held polls "
                "back: tasks had waited for a CPU more than node.busy_poll_cpu_pressure_max "
                "of the time since the last reading",
                poll.declined,
            )
        yield handler_failures_metric()
        hist = ing.latency
        latency = HistogramMetricFamily("gossipd_task_latency_seconds", "Receipt to final result")
        latency.add_metric([], hist.cumulative(), sum_value=hist.sum_s)
        yield latency
