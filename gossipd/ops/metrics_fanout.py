"""The metric families of fan-out: load gossip, the owner's held Results, and the
dispatcher's forwarding and placement, read at scrape time (metrics_subsystems.py has the
other optional subsystems'); DaemonCollector (metrics.py) calls them when fan-out runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric

from gossipd.ops.metric_families import C, G, _by, _one


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


def _held_metrics(core: Any) -> Iterator[Metric]:
    """An owner's held Results (fanout/holding.py)."""
    c = core.counters
    yield _one(
        G,
        "gossipd_fanout_results_held",
        "Final Results held now: their task's forwarder is not alive in our view",
        len(core),
    )
    yield _one(
        G,
        "gossipd_fanout_results_held_bytes",
        "Bytes of the Results held now (fanout.held_results_bytes_max)",
        core.bytes,
    )
    yield _one(C, "gossipd_fanout_results_held_total", "Final Results held back", c.held)
    yield _one(
        C,
        "gossipd_fanout_results_dropped_migrated",
        "Held Results dropped: their forwarder had migrated the task (it is answered there)",
        c.dropped_migrated,
    )
    yield _by(
        C,
        "gossipd_fanout_results_held_sent",
        "Held Results sent, by why (confirmed, unknown to the forwarder, deadline, resubmitted, "
        "shutdown, the forwarder left)",
        "why",
        [
            ("confirmed", c.sent_confirmed),
            ("unknown", c.sent_unknown),
            ("deadline", c.sent_deadline),
            ("resubmitted", c.sent_resubmitted),
            ("shutdown", c.sent_shutdown),
            ("left", c.sent_left),
        ],
    )
    yield _one(
        C,
        "gossipd_fanout_results_not_held",
        "Results of forwarders not alive sent at once (no room in the budget, or past the deadline)",
        c.not_held,
    )
    yield _one(C, "gossipd_fanout_confirms_sent", "Confirm messages sent", c.confirms_sent)


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
            "gossipd_fanout_refused_stale",
            "Forwards dropped: from an earlier process of their sender (Forward.boot)",
            stats.refused_stale,
        ),
        (
            "gossipd_fanout_attempts_failed",
            "Forward attempts without a reply in time",
            stats.attempts_failed,
        ),
        ("gossipd_fanout_unavailable", "Tasks no member took", stats.unavailable),
        ("gossipd_fanout_migrated", "Tasks re-dispatched off a dead member", stats.migrated),
        (
            "gossipd_fanout_expired_not_migrated",
            "Tasks held by a dead member past their deadline: forgotten, not re-dispatched",
            stats.expired_not_migrated,
        ),
        (
            "gossipd_fanout_cancelled_not_migrated",
            "Tasks held by a dead member that their producer had cancelled: answered "
            "cancelled, not re-dispatched",
            stats.cancelled_not_migrated,
        ),
        ("gossipd_fanout_handed_off", "Queued tasks handed to others at drain", stats.handed_off),
        (
            "gossipd_fanout_moved",
            "Tasks we forwarded whose owner handed them over to another member (Moved): "
            "answered for there",
            stats.moved,
        ),
        ("gossipd_fanout_bad_peer_messages", "Undecodable peer messages", stats.bad_peer_messages),
        ("gossipd_fanout_hedged", "Forwards also sent to a second member", stats.hedged),
        ("gossipd_fanout_hedge_wins", "Hedged tasks the second member won", stats.hedge_wins),
        (
            "gossipd_fanout_resends_absorbed",
            "A producer's resends of a task on its way or run for us (same route): not sent",
            stats.resends_absorbed,
        ),
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
            "gossipd_fanout_replies_relayed",
            "Replies sent back on their forwarder's connection (Forward.relay: its HTTP door)",
            stats.replies_relayed,
        ),
        (
            "gossipd_fanout_accepts_in_done",
            "Accepts not sent: their task ended within fanout.ack_delay_s, and its TaskDone, "
            "which left in their stead, stands for them",
            stats.accepts_in_done,
        ),
        (
            "gossipd_fanout_relays_by_socket",
            "Replies to relay that went to their route's socket: too large for a peer message, "
            "or the forwarder's connection refused them",
            stats.relays_by_socket,
        ),
        (
            "gossipd_fanout_relays_refused",
            "Forward.relay refused: the route is not the sender's own (its CURVE key)",
            stats.relays_refused,
        ),
        (
            "gossipd_fanout_relayed_unroutable",
            "Relayed replies for a route not served here (dropped)",
            stats.relayed_unroutable,
        ),
        (
            "gossipd_fanout_withdrawn_by_peers",
            "Copies a forwarder withdrew from us before they finished",
            stats.withdrawn_by_peers,
        ),
        (
            "gossipd_fanout_replies_dropped",
            "Acks, TaskDones and relayed replies for forwarders our ROUTER refused (connection gone or full)",
            stats.replies_dropped,
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
        (
            "gossipd_fanout_peer_protocol_errors",
            "Peer connections closed for breaking ZMTP: greeting, handshake, box, nonce or "
            "frame size (fanout.peer_transport loop; refused keys count in auth_refused)",
            stats.peer_protocol_errors,
        ),
        (
            "gossipd_fanout_peer_connections_busy",
            "Peer connections the rpc server closed for its bounds: over 256 shaking hands, "
            "frames not complete past 16 x fanout.message_bytes_max, or part of a frame and "
            "no byte more for 30 s (loop channel)",
            stats.peer_connections_busy,
        ),
    ):
        yield _one(C, name, doc, value)
    yield _by(
        C,
        "gossipd_fanout_forgotten",
        "Forwarded tasks forgotten before their TaskDone, by why: the bound that made room "
        "(count: fanout.forwarded_max, bytes: fanout.forwarded_bytes_max), or expired (no "
        "TaskDone by the task's deadline and the producer's window after it)",
        "reason",
        [
            ("count", stats.forwarded_evicted_count),
            ("bytes", stats.forwarded_evicted_bytes),
            ("expired", stats.forwarded_expired),
        ],
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
