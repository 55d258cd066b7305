"""Gossip that names addresses no socket connects to, sent to a real daemon from outside.

Without CURVE anyone who reaches gossip.bind can send it; under CURVE any member can (a
misconfigured one).  One frame whose src_addr was "tcp://127.0.0.1:5\\n" or "garbage" made the
daemon's ack raise ZeroMQ's EINVAL inside its task group: the group ended, yet idle runner
workers swallowed its cancel, so the process stayed up answering nothing until SIGKILL.  Now
such gossip is refused at decode (counted in gossipd_gossip_refused_total), and the daemon
goes on serving and stops cleanly.
"""

from __future__ import annotations

from typing import Any

import zmq

from gossipd.core.gossip_messages import (
    Alive,
    GossipOnly,
    GpuState,
    MemberRecord,
    Meta,
    Ping,
    PingReq,
    PushPull,
    encode_gossip,
)
from gossipd.ops.scrape import scrape
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import (
    RawProducer,
    break_a_pulls_rules,
    closed_by_reason,
    keyed_tasks_answered_ok,
    wait_until,
)

BAD_ADDRS = ["tcp://127.0.0.1:5\n", "garbage-addr", "tcp://127.0.0.1:99999", "ipc:///tmp/a b"]
GOOD = "tcp://127.0.0.1:1"


def forged(node: str, bad: str) -> list[bytes]:
    """Every place a gossip message names an address, each with ``bad``."""
    gpu = GpuState(rpc=bad, ingress=bad, model="echo")
    record = MemberRecord(node="r", addr=bad, incarnation=1, state="alive")
    messages: list[Any] = [
        Ping(cluster="default", src="p", src_addr=bad, seq=1, target=node),
        GossipOnly(
            cluster="default",
            src="g",
            src_addr=GOOD,
            updates=[Alive(node="g", incarnation=1, addr=bad)],
        ),
        GossipOnly(
            cluster="default",
            src="m",
            src_addr=GOOD,
            updates=[Alive(node="m", incarnation=1, addr=GOOD), Meta(node="m", version=1, gpu=gpu)],
        ),
        PingReq(cluster="default", src="q", src_addr=GOOD, seq=2, target="x", target_addr=bad),
        PushPull(cluster="default", src="s", src_addr=GOOD, reply=True, members=[record]),
    ]
    return [encode_gossip(m) for m in messages]


def test_gossip_naming_unconnectable_addresses_is_refused_and_the_daemon_serves_on(
    daemon_factory: Any,
) -> None:
    metrics_port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{metrics_port}", name="victim")
    node = next(e["node"] for e in daemon.events() if e.get("msg") == "serving")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.gossip_endpoint)
    producer = RawProducer(daemon.endpoint)
    try:
        frames = [frame for bad in BAD_ADDRS for frame in forged(node, bad)]
        for frame in frames:
            sock.send(frame)
        refused = wait_until(
            lambda: (
                scrape(metrics_port).get("gossipd_gossip_refused_total", 0) >= len(frames) or None
            ),
            10,
            "the forged gossip refused",
        )
        assert refused
        metrics = scrape(metrics_port)
        assert metrics["gossipd_gossip_refused_total"] == len(frames)
        assert (
            metrics["gossipd_members{state=alive}"] == 0
        )  # none of them joined (self not counted)
        # Tasks after it are answered, through the probes and acks that follow.
        assert keyed_tasks_answered_ok(producer, 20)
        assert daemon.proc.poll() is None
        assert not [e for e in daemon.events() if e.get("level") == "error"]
    finally:
        sock.close(linger=0)
        ctx.term()
        producer.close()
    assert daemon.stop(timeout_s=15) == 0  # SIGTERM ends it: no SIGKILL needed


def test_what_the_membership_socket_cannot_take_is_closed_counted_and_the_daemon_serves_on(
    daemon_factory: Any,
) -> None:
    """gossip.receiver "loop" (the default): a connection that does not speak ZMTP, one whose
    socket type is not PUSH, and one that sends a frame over swim.message_bytes_max are each
    closed and counted by reason; a message of two frames is refused as gossip.  The daemon
    answers tasks throughout."""
    metrics_port = free_tcp_port()
    daemon = daemon_factory(
        f"metrics.bind=127.0.0.1:{metrics_port}",
        "gossip.swim={message_bytes_max = 65536}",
        name="victim",
    )
    ctx = zmq.Context()
    socks = []
    producer = RawProducer(daemon.endpoint)
    try:
        socks = break_a_pulls_rules(ctx, daemon.gossip_endpoint, 70_000)

        def closed() -> dict[str, float] | None:
            metrics = scrape(metrics_port)
            reasons = closed_by_reason(metrics, "gossipd_gossip_connections_closed_total")
            want = ("greeting", "socket_type", "too_large")
            refused = metrics.get("gossipd_gossip_refused_total", 0)
            return reasons if all(reasons.get(r) for r in want) and refused >= 1 else None

        reasons = wait_until(closed, 10, "three connections closed, the two-frame message refused")
        assert reasons == {
            "greeting": 1,
            "socket_type": 1,
            "too_large": 1,
        }
        assert scrape(metrics_port)["gossipd_gossip_refused_total"] == 1
        assert keyed_tasks_answered_ok(producer, 20)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        producer.close()
    assert daemon.stop(timeout_s=15) == 0
