"""`gossipd status`, `drain`, `undrain`, `--version` against real daemons (StatusQuery and Drain
on the ingress, docs/PROTOCOL.md "Admin")."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from typing import Any

import msgpack
import pytest

from gossipd import __version__
from gossipd.core.sampling import SamplingParams
from gossipd.tools.client import DEFAULT_REPLY_BIND, Client, ProducerKeys
from gossipd.tools.launcher import free_tcp_port
from simulations.cluster import Cluster
from tests.helpers import RawProducer, gossipd_cli, scrape, wait_until

pytestmark = pytest.mark.slow


def status_json(endpoint: str) -> dict[str, Any]:
    done = gossipd_cli("status", "--json", "-e", endpoint)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in status["members"]}


def send_keyed(
    endpoints: list[str],
    n: int,
    tag: str,
    *,
    curve: ProducerKeys | None = None,
    reply_bind: str = DEFAULT_REPLY_BIND,
) -> Counter[str]:
    """n keyed tasks pushed to every endpoint; which member served each (all must be ok)."""

    async def main() -> Counter[str]:
        async with Client(
            endpoints, resubmit_after_s=5.0, curve=curve, reply_bind=reply_bind
        ) as client:
            handles = [
                await client.submit(
                    f"{tag} {i}", key=f"{tag}-{i % 20}", params=SamplingParams(max_tokens=2)
                )
                for i in range(n)
            ]
            results = [await h.result() for h in handles]
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        return Counter(r.node for r in results)

    return asyncio.run(main())


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    c = Cluster(3, log_dir=str(tmp_path))
    c.start()
    c.wait_converged(timeout_s=20)
    c.wait_meta(timeout_s=20)
    yield c
    c.stop()


def test_status_lists_every_member_and_a_drained_one_gets_no_new_tasks(cluster: Cluster) -> None:
    endpoints = [d.endpoint for d in cluster.daemons]
    d0, d1 = cluster.daemons[0].endpoint, "d01"
    status = wait_until(
        lambda: (s := status_json(d0))["checksums_agree"] and s, 10, "checksum agreement"
    )
    by_node = rows(status)
    assert set(by_node) == {"d00", "d01", "d02"}
    for row in by_node.values():
        assert row["state"] == "alive" and row["status"] == "serving" and row["reachable"]
        assert row["engine"] == "echo" and set(row["load"]) >= {"pending", "running", "served"}
        assert "running_requests" in row["engine_load"]
        assert len(row["seen_as"]) == 2 and set(row["seen_as"].values()) == {"serving"}
    assert status["leader"] is None and status["term"] is None
    assert send_keyed(endpoints, 60, "before")["d01"] > 0, "d01 serves its keys before"

    # Drain d01 through d00 (relayed), see it draining in everyone's status.
    done = gossipd_cli("drain", "d01", "-e", d0)
    assert done.returncode == 0, done.stderr
    assert "d01: draining" in done.stdout

    def drained_everywhere() -> dict[str, Any] | None:
        s = status_json(d0)
        row = rows(s)[d1]
        seen = row["seen_as"]
        ok = row["status"] == "draining" and len(seen) == 2 and set(seen.values()) == {"draining"}
        return s if ok else None

    served_before = rows(wait_until(drained_everywhere, 10, "d01 draining in every view"))[d1][
        "load"
    ]["served"]
    served_by = send_keyed(endpoints, 90, "drained")
    assert served_by["d01"] == 0 and sum(served_by.values()) == 90
    after = rows(status_json(cluster.daemons[1].endpoint))[d1]
    assert after["load"]["served"] == served_before, "a drained member runs no new task"
    assert after["status"] == "draining" and after["drained"] is True

    # Back to serving: it takes its keys again.
    done = gossipd_cli("undrain", "d01", "-e", cluster.daemons[2].endpoint)
    assert done.returncode == 0 and "d01: serving" in done.stdout, done.stderr
    wait_until(
        lambda: set(rows(status_json(d0))[d1]["seen_as"].values()) == {"serving"},
        10,
        "d01 serving in every view",
    )
    assert send_keyed(endpoints, 60, "after")["d01"] > 0

    # Human-readable form; an unknown member is refused clearly.
    text = gossipd_cli("status", "-e", d0)
    assert text.returncode == 0 and "d01" in text.stdout and "checksum" in text.stdout
    bad = gossipd_cli("drain", "nobody", "-e", d0)
    assert bad.returncode == 1 and "no live member named 'nobody'" in bad.stderr


def test_drain_hands_the_queued_tasks_to_another_member(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One task at a time, 0.2 s each: tasks queue; a drain hands the queued ones to d00."""
    from gossipd.tools.admin import drain

    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=["ingress.concurrency_max=1", "engine.token_delay_s=0.05"],
    )
    try:
        c.start()
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        d01 = c.daemons[1].endpoint

        async def main() -> tuple[list[Any], str]:
            async with Client([d01], resubmit_after_s=30.0) as client:
                handles = [
                    await client.submit(f"q {i}", key=f"k{i}", params=SamplingParams(max_tokens=4))
                    for i in range(30)
                ]
                await asyncio.to_thread(
                    wait_until,
                    lambda: rows(status_json(d01))["d01"]["load"]["queued"] >= 5,
                    10,
                    "tasks queued at d01",
                )
                reply = await asyncio.to_thread(drain, d01, "d01")
                return [await h.result() for h in handles], reply.message

        results, message = asyncio.run(main())
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        handed = int(message.split(";")[1].split()[0])  # "...; N queued offered to them ..."
        assert handed >= 5, message
        by_node = Counter(r.node for r in results)
        assert by_node["d00"] >= handed, by_node
        logged = [e for e in c.daemons[1].events() if e.get("msg") == "drained by request"]
        assert logged and logged[0]["queued"] == handed
    finally:
        c.stop()


def test_a_cancel_taken_while_the_drain_hands_its_task_off_reaches_the_new_member(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """d00 runs A (4 s) and queues B; d01 joins and is paused (SIGSTOP) so that the accept
    of B's hand-off comes late; d00 is drained and B cancelled meanwhile.  d00 took the
    Cancel ("here") and released B once d01 accepted it: d01 ran B to the end and answered
    ok.  Now the Cancel follows B to d01, which answers cancelled."""
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[
            "engine.token_delay_s=0.2",
            "ingress.concurrency_max=1",
            "fanout.ack_timeout_s=3.0",
            'metrics.bind="127.0.0.1:0"',
        ],
    )
    d0, d1 = c.daemons
    producer = None
    try:
        d0.start()
        producer = RawProducer(d0.endpoint)
        producer.send_task("A", prompt="a", params={"max_tokens": 20})  # runs ~4 s on d00
        producer.send_task("B", prompt="b", params={"max_tokens": 5})  # queued behind A
        d1.start()
        c.wait_meta(30)
        d1.pause()
        drain = {"v": 1, "t": 32, "id": "drain-1", "reply_to": producer.reply_to}
        producer.push.send(msgpack.packb({**drain, "node": "d00", "drain": True}))
        # Its reply leaves as the hand-off begins (B's Forward sent, d01 paused)
        got = producer.replies(until=lambda r: any(x["t"] == 33 for x in r), timeout_s=10)
        [reply] = [x for x in got if x["t"] == 33]
        assert reply["ok"], reply
        producer.push.send(msgpack.packb({"v": 1, "t": 4, "id": "B"}))  # the producer cancels B
        wait_until(lambda: _cancels_here(d0.metrics_port) >= 1, 10, "d00 took the Cancel")
        d1.resume()
        got = producer.replies(until=lambda r: sum(x["t"] == 3 for x in r) >= 2, timeout_s=20)
        results = {x["id"]: x for x in got if x["t"] == 3}
        assert results["A"]["ok"]
        b = results["B"]
        assert not b["ok"] and b["error"]["code"] == "cancelled" and b["node"] == "d01", b
    finally:
        if producer is not None:
            producer.close()
        c.stop()


def _cancels_here(metrics_port: int) -> float:
    return scrape(metrics_port).get("gossipd_cancels_total{outcome=here}", 0.0)


def test_malformed_and_unknown_admin_messages_are_refused_and_counted(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{free_tcp_port()}")
    producer = RawProducer(daemon.endpoint)
    try:
        rt = producer.reply_to
        producer.send_raw(msgpack.packb({"v": 1, "t": 32, "id": "nonode", "reply_to": rt}))
        producer.send_raw(msgpack.packb({"v": 1, "t": 77, "id": "unknown", "reply_to": rt}))
        producer.send_raw(msgpack.packb({"v": 1, "t": 30, "id": "ok", "reply_to": rt}))
        got = {r["id"]: r for r in producer.replies(until=lambda r: len(r) >= 3)}
    finally:
        producer.close()
    assert got["nonode"]["t"] == 3 and got["nonode"]["error"]["code"] == "bad_request"
    assert "invalid Drain" in got["nonode"]["error"]["message"]
    assert "unknown message type t=77" in got["unknown"]["error"]["message"]
    assert got["ok"]["t"] == 31 and got["ok"]["status"] == "serving"  # a StatusReport
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_messages_refused_total{reason=bad_admin}"] == 1
    assert metrics["gossipd_messages_refused_total{reason=unknown_type}"] == 1
    assert metrics["gossipd_admin_requests_total{kind=status,outcome=ok}"] == 1


def test_a_lone_daemon_reports_itself_and_refuses_a_drain(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory('gossip.bind=""', 'node.id="solo"')
    status = status_json(daemon.endpoint)
    assert [r["node"] for r in status["members"]] == ["solo"]
    assert status["gossip"] is False and status["checksums_agree"] is True
    done = gossipd_cli("drain", "solo", "-e", daemon.endpoint)
    assert done.returncode == 1 and "draining needs membership (gossip.bind)" in done.stderr


def test_status_fails_fast_naming_the_endpoint_when_nothing_listens() -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = time.monotonic()
    done = gossipd_cli("status", "-e", endpoint, "--timeout", "1")
    assert done.returncode == 1
    assert f"nothing listens at {endpoint}" in done.stderr
    assert time.monotonic() - started < 10  # 1 s of waiting plus the interpreter's start


def test_version() -> None:
    done = gossipd_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"gossipd {__version__}"


def test_a_flood_of_status_queries_in_tasks_frames_is_answered_up_to_the_burst(
    daemon_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Admin requests bypass admission: one 1 MiB Tasks frame of StatusQueries asked for
    some 26,900 reports (about 1 GB built in one loop turn; a frame holds at most 1,024
    items now).  Past the burst each is answered overloaded with retry_after_ms, counted;
    the daemon answers tasks and status after."""
    from gossipd.admin import ADMIN_REQUESTS_BURST

    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{free_tcp_port()}")
    producer = RawProducer(daemon.endpoint)
    flood = 2_000
    try:
        rt = producer.reply_to
        items = [{"v": 1, "t": 30, "id": f"q{i}", "reply_to": rt} for i in range(flood)]
        for first in range(0, flood, 1000):  # (a Tasks frame holds at most 1,024 items)
            frame_items = items[first : first + 1000]
            producer.send_raw(msgpack.packb({"v": 1, "t": 6, "items": frame_items}))
        got = producer.replies(until=lambda r: len(r) >= flood, timeout_s=20)
        reports = [r for r in got if r["t"] == 31]
        refused = [r for r in got if r["t"] == 3]
        assert len(got) == flood
        assert ADMIN_REQUESTS_BURST <= len(reports) < ADMIN_REQUESTS_BURST + 20
        assert {r["error"]["code"] for r in refused} == {"overloaded"}
        assert all(r["error"]["retry_after_ms"] > 0 for r in refused)
        producer.send_task("after")
        assert [r["ok"] for r in producer.results(1)] == [True]
    finally:
        producer.close()
    metrics = scrape(daemon.metrics_port)
    assert metrics["gossipd_admin_requests_total{kind=status,outcome=overloaded}"] == len(refused)
    assert status_json(daemon.endpoint)["members"]  # the tool's next ask is answered


def test_a_drain_from_the_peer_channel_is_never_relayed_again(cluster: Cluster) -> None:
    """A Drain that reaches a member on the rpc channel was relayed once already, whatever
    its relayed field says (docs/PROTOCOL.md: relayed once): naming a third member, it is
    refused with the reason, not passed on (it was, and that member drained)."""
    import zmq

    from gossipd.core.messages import Drain
    from gossipd.core.peer_messages import encode_peer

    d0, d1, d2 = cluster.daemons
    producer = RawProducer(d0.endpoint)  # (for its reply socket)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{d1.rpc_port}")
    try:
        drain = Drain(v=1, id="again", reply_to=producer.reply_to, node="d02", relayed=False)
        dealer.send(encode_peer(drain))
        (reply,) = producer.replies(until=lambda r: len(r) >= 1, timeout_s=10)
        assert reply["t"] == 33 and reply["ok"] is False
        assert "not relayed again" in reply["message"] and reply["node"] == "d01"
        assert rows(status_json(d2.endpoint))["d02"]["status"] == "serving"
    finally:
        dealer.close(linger=0)
        ctx.term()
        producer.close()


def test_status_output_writes_what_daemons_report_as_escapes_not_terminal_codes() -> None:
    """Node names are any 128 characters and, without CURVE, anyone gossips them: a member
    named to clear the screen and forge a row did so in `gossipd status`'s table."""
    from gossipd.tools.admin import format_status, printable

    evil = "\x1b[2J\x1b[31mowned\nFAKE-ROW alive"
    row = {
        "node": evil, "state": "alive", "status": "serving", "engine": "echo", "model": "m",
        "gpu_index": 0, "seen_as": {"d00": "serving"}, "load": {}, "engine_load": {},
    }  # fmt: skip
    status = {"members": [row], "members_live": 1, "checksums": ["1"], "checksums_agree": True,
              "leader": None, "election": "off"}  # fmt: skip
    text = format_status(status)
    assert "\x1b" not in text and len(text.splitlines()) == 3  # header, the row, checksum
    assert "\\x1b[2J\\x1b[31mowned\\nFAKE-ROW alive" in text
    assert printable("héllo d01") == "héllo d01"  # printable text as it is


def test_the_status_tools_context_holds_a_socket_for_every_member_of_a_large_cluster() -> None:
    """`gossipd status` asks every live member at once, a PUSH each: libzmq's default of
    1,023 sockets ended it in a traceback at about 1,020 members."""
    import zmq

    from gossipd.ops.fdlimits import MEMBERS_MAX
    from gossipd.tools.admin import _Asker

    asker = _Asker(reply_bind="tcp://127.0.0.1:*")
    try:
        assert asker._ctx.get(zmq.MAX_SOCKETS) > MEMBERS_MAX
    finally:
        asker.close()


def test_one_member_address_no_socket_connects_to_does_not_sink_the_whole_status(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    """ask_status refused the whole list for one bad address (the status printed nothing
    but that); now that endpoint gets its reason and the others are asked."""
    from gossipd.core.admin_messages import StatusReport
    from gossipd.tools.admin import ask_status

    daemon = daemon_factory()
    bad = "tcp://bad host:1"
    got = ask_status([bad, daemon.endpoint], 5.0)
    assert isinstance(got[daemon.endpoint], StatusReport)
    assert isinstance(got[bad], str) and "is not tcp://HOST:PORT" in got[bad]


def test_a_stop_during_a_drains_hand_off_answers_every_task_and_ends_in_its_grace(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """`gossipd drain` hands the queue to one background task that offers it one task at a
    time.  A SIGTERM while it did found no queue to offer or refuse: the tasks it still held
    went past the grace unanswered, and the stop then waited for it for ever (its offer's
    answer never came once the dispatcher stopped).  Now the hand-off ends at the stop, its
    tasks back in the queue, offered within the grace or answered shutting_down."""
    from gossipd.tools.admin import drain

    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[
            "ingress.concurrency_max=1",
            "engine.token_delay_s=0.05",
            "lifecycle.shutdown_grace_s=0.5",
        ],
    )
    producer: RawProducer | None = None
    try:
        c.start()
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        d01 = c.daemons[1]
        producer = RawProducer(d01.endpoint)
        ids = [f"q{i}" for i in range(1500)]
        for i, task_id in enumerate(ids):
            producer.send_task(task_id, f"q {i}", key=f"k{i}", params={"max_tokens": 4})
        wait_until(
            lambda: rows(status_json(d01.endpoint))["d01"]["load"]["queued"] >= 300,
            20,
            "a deep queue at d01",
        )
        d00 = c.daemons[0]
        d00.signal(signal.SIGSTOP)  # its answers to the offers wait: the hand-off is slow
        try:
            drain(d01.endpoint, "d01")
            d01.signal(signal.SIGTERM)  # while the hand-off offers the queue one by one
            assert d01.wait(20) == 0
        finally:
            d00.signal(signal.SIGCONT)
        got = producer.replies(
            until=lambda r: {x["id"] for x in r if x["t"] == 3} >= set(ids), timeout_s=60
        )
        answered = {x["id"] for x in got if x["t"] == 3}
        assert answered == set(ids), len(set(ids) - answered)
        codes = Counter(x["error"]["code"] for x in got if x["t"] == 3 and not x["ok"])
        # (d00, one task at a time, runs out the deadline of many it was handed)
        assert set(codes) <= {"shutting_down", "deadline_exceeded"}, codes
    finally:
        if producer is not None:
            producer.close()
        c.stop()
