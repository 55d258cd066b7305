"""The metric families of the daemon's optional subsystems, one function per subsystem
(leadership, leader duties, CURVE security, token budgets, SWIM gossip, the HTTP door; load
gossip, fan-out and placement are in metrics_fanout.py), each reading that subsystem's
statistics at scrape time; DaemonCollector (metrics.py) calls those whose subsystem runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from gossipd.ops.metric_families import C, G, _by, _one
from gossipd.security import DOMAIN_PEERS, DOMAIN_PRODUCERS


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
    yield _one(
        C,
        "gossipd_etcd_failovers",
        "Moves to the next etcd endpoint after the one in use stopped answering (unreachable, "
        "without a leader, or slower than etcd.request_timeout_s)",
        st["etcd_failovers"],
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
        "forget and drain directives not acted on (bad_body, also a body that is no msgpack; "
        "handler_error: a handler raised, logged; before_start: a drain order older "
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
        [
            (DOMAIN_PEERS, len(security.peers.by_key)),
            (DOMAIN_PRODUCERS, len(security.producers.by_key)),
        ],
    )


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
    yield _one(
        G,
        "gossipd_member_addresses_claimed_twice",
        "Addresses two members claim at once (at the last look): nobody's, no connection is "
        "made there; a member's forged news (PROTOCOL.md, threat model) or two daemons "
        "given one address",
        gossip.addresses_ambiguous,
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
        (
            "gossipd_gossip_refused",
            "Membership messages refused: undecodable (or of several ZeroMQ frames), or naming "
            "an address no socket connects to",
            stats.refused + gossip.transport.malformed,
        ),
        (
            "gossipd_gossip_members_refused_full",
            "New members not taken: the member table holds its bound (10,000)",
            core.table.refused_full,
        ),
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
            "Sends dropped at a full peer queue, or to a member's host name being looked up "
            "or that did not resolve (those also in gossipd_gossip_sends_unresolved)",
            gossip.dropped_sends,
        ),
        (
            "gossipd_gossip_sends_unresolved",
            "Sends dropped because the member's address names a host not looked up yet or "
            "that did not resolve lately (looked up off ZeroMQ's I/O thread: hostnames.py)",
            gossip.transport.unresolved,
        ),
        (
            "gossipd_gossip_sends_unkeyed",
            "Sends dropped under CURVE because no member we know (nor a named seed) has that "
            "address, so no key to expect there (also in gossipd_gossip_sends_dropped)",
            gossip.sends_unkeyed,
        ),
        (
            "gossipd_gossip_prefixes_cut",
            "Prefix hashes left out of our published GPU state so that it fits one message's "
            "piggyback (gossip.swim.piggyback_bytes_max): lower fanout.prefix_summary_max",
            stats.prefixes_cut,
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
    yield _by(
        C,
        "gossipd_gossip_connections_closed",
        "Connections to our membership socket it closed (gossip.receiver loop), by reason: "
        "busy (over 256 shaking hands, 32 from one host, or frames not complete past 16 x "
        "swim.message_bytes_max), stalled (part of a frame, no byte for 30 s), refused (a key ZAP refused: also in auth_refused), the rest "
        "ZMTP broken (greeting, handshake, box, nonce, frame size)",
        "reason",
        sorted(gossip.transport.receive_refused.items()),
    )
    yield _one(
        G, "gossipd_gossip_awareness", "Local health score (0 = healthy)", core.awareness.score
    )
    yield _one(
        G, "gossipd_gossip_checksum", "Checksum of the live member set", core.table.checksum()
    )


def _http_metrics(door: Any, cards: Any = None) -> Iterator[Metric]:
    """The OpenAI-compatible HTTP door (gossipd/http/), when http.bind is set; ``cards``:
    the members' model cards it lists (core/modelcards.py's ModelCards)."""
    c, a = door.limits.counters, door.answers.counters
    yield _one(C, "gossipd_http_connections", "HTTP connections opened", c.connections)
    yield _one(
        C,
        "gossipd_http_connections_refused",
        "HTTP connections closed at once: http.connections_max were open",
        c.connections_refused,
    )
    yield _one(
        C,
        "gossipd_http_connections_idle_closed",
        "HTTP connections closed idle, or with a request not read whole, after http.idle_timeout_s",
        c.idle_closed,
    )
    yield _one(
        G,
        "gossipd_http_connections_open",
        "HTTP connections open now (with TLS, from accept: handshakes included)",
        c.open_now,
    )
    yield _one(
        C,
        "gossipd_http_tls_handshakes_failed",
        "HTTP connections closed in their TLS handshake: refused, reset, or not done within "
        "http.idle_timeout_s",
        c.tls_failed,
    )
    yield _one(C, "gossipd_http_requests", "HTTP requests parsed", c.requests)
    yield _one(
        C,
        "gossipd_http_bad_requests",
        "HTTP requests unparseable or over a bound (body, headers, pipelining): answered, "
        "connection closed",
        c.bad_requests,
    )
    yield _one(
        G,
        "gossipd_http_read_bytes",
        "Request bodies read and not yet taken by the door, all connections (bounded by "
        "http.read_bytes_max: past it 503)",
        c.read_bytes,
    )
    yield _one(
        G,
        "gossipd_http_streams_open",
        "Streamed HTTP answers begun and not yet ended: each may hold its share of "
        "http.streams_unsent_bytes_max for a slow client",
        c.streams_open,
    )
    yield _one(
        G,
        "gossipd_http_answers_unsent_bytes",
        "Whole (not streamed) HTTP answers their clients do not read, bytes held, all "
        "connections (bounded by http.answers_unsent_bytes_max)",
        c.answers_unsent,
    )
    yield _one(
        C,
        "gossipd_http_answers_dropped",
        "Whole HTTP answers given up, their connections closed: they would have taken the "
        "answers clients do not read past http.answers_unsent_bytes_max",
        c.answers_dropped,
    )
    yield _one(
        C,
        "gossipd_http_bodies_dropped",
        "Requests whose API key is refused: their bodies read and not kept (each answered 401)",
        c.bodies_dropped,
    )
    yield _one(
        C,
        "gossipd_http_handler_errors",
        "HTTP requests whose handler raised (a bug: answered 500 server_error, logged with "
        "its traceback)",
        c.handler_errors,
    )
    yield _by(
        C,
        "gossipd_http_responses",
        "HTTP responses, by status (a stream counts as 200)",
        "status",
        sorted((str(k), v) for k, v in a.responses.items()),
    )
    yield _one(
        C, "gossipd_http_unauthorized", "Requests without a valid API key (401)", door.unauthorized
    )
    yield _by(
        C,
        "gossipd_http_cancels",
        "Requests whose tasks the door cancelled: client gone (disconnect), stream unread "
        "(slow_client: http.stream_buffer_bytes_max), no answer by the deadline (deadline)",
        "why",
        [
            ("disconnect", a.disconnect_cancels),
            ("slow_client", a.slow_client_cancels),
            ("deadline", a.deadline_answers),
        ],
    )
    yield _one(
        G,
        "gossipd_http_pending",
        "Requests waiting for their answer (one of several choices counted once)",
        door.answers.requests(),
    )
    yield _one(
        C,
        "gossipd_http_replies_unknown",
        "Answers for no waiting request (its client had gone)",
        a.replies_unknown,
    )
    yield _one(
        C,
        "gossipd_http_replies_invalid",
        "Undecodable frames on the door's reply socket",
        a.replies_invalid,
    )
    yield _by(
        C,
        "gossipd_http_reply_connections_closed",
        "Owners' connections the door's reply socket closed (http.reply_receiver loop), by "
        "reason: busy and stalled (its bounds, as the ingress's), refused (a key ZAP refused: also in "
        "auth_refused), the rest ZMTP broken (greeting, socket_type, too_large, ...)",
        "reason",
        sorted(door.answers.connections_closed.items()),
    )
    yield _one(
        C,
        "gossipd_http_answer_failures",
        "Answers that raised as they were written (a bug: logged; answered 500, or a stream cut)",
        a.answer_failures,
    )
    if door.keys is not None:
        yield _one(G, "gossipd_http_api_keys", "API keys loaded", len(door.keys))
    if cards is not None:
        yield _by(
            C,
            "gossipd_model_cards",
            "Members asked for their model's max_model_len (ModelQuery, asked), their answers "
            "taken (answered), and answers nobody asked for (refused)",
            "outcome",
            [("asked", cards.asked), ("answered", cards.answered), ("refused", cards.refused)],
        )
