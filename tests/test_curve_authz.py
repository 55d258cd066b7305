"""Who may do what to a task under CURVE, with real daemons (docs/PROTOCOL.md, "Cancel" and
"Delivery"): only the producer key that submitted a task may cancel it, on the daemon it
entered and at the member it was forwarded to; a task is its key and its id, so another key
neither gets its cached Result nor has its own task absorbed into it: refused id_in_use
where both meet on one member (entry or owner), two tasks where they do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import zmq

from gossipd.core.messages import Cancel
from gossipd.core.peer_messages import encode_peer
from gossipd.core.ring import Ring
from gossipd.tools.launcher import DaemonProcess
from tests.helpers import wait_until
from tests.test_curve import CurveProducer, Keys, curve_daemon, metric

REFUSED_CANCELS = "gossipd_cancels_total{outcome=refused}"


def curve_pair(daemon_factory: Any, keys: Keys, *extra: str) -> tuple[DaemonProcess, DaemonProcess]:
    s0 = curve_daemon(daemon_factory, keys, "s0", *extra)
    s1 = curve_daemon(
        daemon_factory, keys, "s1", f'gossip.seeds=["s0@{s0.gossip_endpoint}"]', *extra
    )
    for d, other in ((s0, "s1"), (s1, "s0")):
        wait_until(
            lambda d=d, other=other: any(
                e.get("msg") == "member" and e.get("member") == other and e["event"] == "meta"
                for e in d.events()
            ),
            15,
            f"{d.name} sees {other}",
        )
    return s0, s1


def key_owned_by(node: str) -> str:
    ring = Ring({"s0": 1.0, "s1": 1.0})
    return next(k for k in (f"k{i}" for i in range(1000)) if ring.owner(k) == node)


def cancel(producer: CurveProducer, task_id: str, **fields: Any) -> None:
    producer.push.send(msgpack.packb({"v": 1, "t": 4, "id": task_id, **fields}))


# Echo tasks that run for about 4 s, or 20 s, unless cancelled.
SLOW = {"params": {"max_tokens": 200}, "stream": False}
SLOWER = {"params": {"max_tokens": 1000}, "stream": False}
SLOW_DAEMONS = ("engine.token_delay_s=0.02",)


def test_only_the_submitting_key_cancels_a_task_here_and_at_its_owner(
    daemon_factory: Any, tmp_path: Path
) -> None:
    keys = Keys(tmp_path, peers=["s0", "s1", "m2"], producers=["pa", "pb"])
    s0, s1 = curve_pair(daemon_factory, keys, *SLOW_DAEMONS)
    a = CurveProducer(s0.endpoint, keys.pair("pa"), keys.public("s0"))
    b = CurveProducer(s0.endpoint, keys.pair("pb"), keys.public("s0"))
    b_at_s1 = CurveProducer(s1.endpoint, keys.pair("pb"), keys.public("s1"))
    ctx = zmq.Context()
    try:
        a.send_task("here", key=key_owned_by("s0"), **SLOWER)
        a.send_task("there", key=key_owned_by("s1"), **SLOWER)
        wait_until(lambda: metric(s1, "gossipd_tasks_pending") == 1, 10, "s1 runs 'there'")
        wait_until(lambda: metric(s0, "gossipd_tasks_pending") == 1, 10, "s0 runs 'here'")
        # B at the entry daemon (s0 runs one, forwarded the other), B at the owner directly,
        # B's key claimed by a member on the rpc channel (as a forwarded Cancel), and a
        # Cancel that names A's key in its producer_key (the daemon's field: replaced).
        cancel(b, "here")
        cancel(b, "there")
        cancel(b, "here", producer_key=keys.public("pa").decode())
        cancel(b_at_s1, "there")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.curve_publickey, dealer.curve_secretkey = keys.pair("m2")
        dealer.curve_serverkey = keys.public("s1")
        dealer.connect(f"tcp://127.0.0.1:{s1.rpc_port}")
        dealer.send(encode_peer(Cancel(v=1, id="there", producer_key=keys.public("pb").decode())))
        wait_until(lambda: metric(s0, REFUSED_CANCELS) == 3, 5, "s0 refuses B's cancels")
        wait_until(lambda: metric(s1, REFUSED_CANCELS) == 2, 5, "s1 refuses B's cancels")
        assert a.drain() == [] and b.drain() == [] and b_at_s1.drain() == []
        assert metric(s0, "gossipd_tasks_pending") == 1 == metric(s1, "gossipd_tasks_pending")
        # A's own Cancels, both at the entry daemon: answered long before the 20 s run ends.
        cancel(a, "here")
        cancel(a, "there")
        results = {r["id"]: r for r in a.results(2, timeout_s=5.0)}
        assert sorted(results) == ["here", "there"]
        for task_id, node in (("here", "s0"), ("there", "s1")):
            assert results[task_id]["error"]["code"] == "cancelled"
            assert results[task_id]["node"] == node
        assert metric(s0, "gossipd_cancels_total{outcome=here}") == 1
        assert metric(s0, "gossipd_cancels_total{outcome=forwarded}") == 1
        assert metric(s1, "gossipd_cancels_total{outcome=here}") == 1
        assert b.drain() == [] and b_at_s1.drain() == []
    finally:
        for p in (a, b, b_at_s1):
            p.close()
        ctx.destroy(linger=0)


def test_a_task_id_is_its_producers_and_another_key_gets_id_in_use(
    daemon_factory: Any, tmp_path: Path
) -> None:
    keys = Keys(tmp_path, peers=["s0", "s1"], producers=["pa", "pb"])
    s0, s1 = curve_pair(daemon_factory, keys, *SLOW_DAEMONS)
    a = CurveProducer(s0.endpoint, keys.pair("pa"), keys.public("s0"))
    b = CurveProducer(s0.endpoint, keys.pair("pb"), keys.public("s0"))
    try:
        short = {"params": {"max_tokens": 2}}
        # Finished (cached) here and at the other owner.
        for task_id, owner in (("done-here", "s0"), ("done-there", "s1")):
            a.send_task(task_id, prompt="a's secret answer", key=key_owned_by(owner), **short)
        assert {r["id"] for r in a.results(2, timeout_s=10) if r["ok"]} == {
            "done-here",
            "done-there",
        }
        # Pending (running for 4 s) at the other owner.
        a.send_task("pending-there", key=key_owned_by("s1"), **SLOW)
        wait_until(lambda: metric(s1, "gossipd_tasks_pending") == 1, 10, "s1 runs it")
        for task_id, owner in (
            ("done-here", "s0"),
            ("done-there", "s1"),
            ("pending-there", "s1"),
        ):
            b.send_task(task_id, prompt="b's own task", key=key_owned_by(owner), **short)
        refused = {r["id"]: r for r in b.results(3, timeout_s=10)}
        assert sorted(refused) == ["done-here", "done-there", "pending-there"]
        for r in refused.values():
            assert not r["ok"] and r["error"]["code"] == "id_in_use", r
            assert "secret" not in r["text"]
        assert b.results(1, timeout_s=0.5) == []  # one answer each, no second from anywhere
        # A's resubmission of its own id still gets its cached Result; its pending task runs on.
        a.send_task("done-there", prompt="a's secret answer", key=key_owned_by("s1"), **short)
        again = {r["id"]: r for r in a.results(2, timeout_s=10)}
        assert again["done-there"]["ok"] and "secret" in again["done-there"]["text"]
        assert again["pending-there"]["ok"]
        # "pending-there" is refused at s0, which forwarded A's and answers for it until its
        # TaskDone; "done-there" at its owner s1 (s0 forgot A's once it was done).
        assert metric(s0, "gossipd_messages_refused_total{reason=id_in_use}") == 2
        assert metric(s1, "gossipd_messages_refused_total{reason=id_in_use}") == 1
    finally:
        a.close()
        b.close()


def test_the_same_id_from_two_keys_on_two_members_is_two_tasks_each_its_producers(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """docs/PROTOCOL.md "An id is its producer's": no member holds both tasks (A's entered
    and runs at s0, B's at s1), so both run; each producer gets its own Result only, and
    neither can cancel the other's, at either member."""
    keys = Keys(tmp_path, peers=["s0", "s1"], producers=["pa", "pb"])
    s0, s1 = curve_pair(daemon_factory, keys, *SLOW_DAEMONS)
    a = CurveProducer(s0.endpoint, keys.pair("pa"), keys.public("s0"))
    a_at_s1 = CurveProducer(s1.endpoint, keys.pair("pa"), keys.public("s1"))
    b = CurveProducer(s1.endpoint, keys.pair("pb"), keys.public("s1"))
    b_at_s0 = CurveProducer(s0.endpoint, keys.pair("pb"), keys.public("s0"))
    try:
        a.send_task("same", prompt="alpha", key=key_owned_by("s0"), **SLOW)
        b.send_task("same", prompt="beta", key=key_owned_by("s1"), **SLOW)
        wait_until(lambda: metric(s0, "gossipd_tasks_pending") == 1, 10, "s0 runs A's")
        wait_until(lambda: metric(s1, "gossipd_tasks_pending") == 1, 10, "s1 runs B's")
        # Each key's Cancel at the member running the other's task (at its own member the
        # id names its own task: that one it may cancel).
        cancel(b_at_s0, "same")
        cancel(a_at_s1, "same")
        wait_until(lambda: metric(s0, REFUSED_CANCELS) >= 1, 5, "s0 refuses B's cancel")
        wait_until(lambda: metric(s1, REFUSED_CANCELS) >= 1, 5, "s1 refuses A's cancel")
        got_a = a.results(1, timeout_s=15)
        got_b = b.results(1, timeout_s=15)
        assert len(got_a) == 1 and got_a[0]["ok"] and got_a[0]["node"] == "s0", got_a
        assert len(got_b) == 1 and got_b[0]["ok"] and got_b[0]["node"] == "s1", got_b
        assert set(got_a[0]["text"].split()) == {"alpha"}
        assert set(got_b[0]["text"].split()) == {"beta"}
        assert metric(s0, REFUSED_CANCELS) == 1 == metric(s1, REFUSED_CANCELS)
        assert metric(s0, "gossipd_cancels_total{outcome=here}") == 0
        assert metric(s1, "gossipd_cancels_total{outcome=here}") == 0
        # Nothing more anywhere: no cross delivery, no second answer.
        for p in (a, a_at_s1, b, b_at_s0):
            assert p.results(1, timeout_s=0.3) == []
    finally:
        for p in (a, a_at_s1, b, b_at_s0):
            p.close()


def test_an_entry_member_refuses_an_id_it_runs_or_forwards_for_another_key(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """Where both tasks meet on one member, the entry daemon included: A's task forwarded
    from s0 to s1 (s0 answers for it until its TaskDone), and A's task run at s0; B's task
    with the same id, entering at s0 and placed on the other member, gets id_in_use."""
    keys = Keys(tmp_path, peers=["s0", "s1"], producers=["pa", "pb"])
    s0, s1 = curve_pair(daemon_factory, keys, *SLOW_DAEMONS)
    a = CurveProducer(s0.endpoint, keys.pair("pa"), keys.public("s0"))
    b = CurveProducer(s0.endpoint, keys.pair("pb"), keys.public("s0"))
    try:
        a.send_task("forwarded", prompt="alpha", key=key_owned_by("s1"), **SLOW)
        a.send_task("run-here", prompt="alpha", key=key_owned_by("s0"), **SLOW)
        wait_until(lambda: metric(s1, "gossipd_tasks_pending") == 1, 10, "s1 runs one")
        wait_until(lambda: metric(s0, "gossipd_tasks_pending") == 1, 10, "s0 runs one")
        b.send_task("forwarded", prompt="beta", key=key_owned_by("s0"), params={"max_tokens": 2})
        b.send_task("run-here", prompt="beta", key=key_owned_by("s1"), params={"max_tokens": 2})
        refused = {r["id"]: r for r in b.results(2, timeout_s=10)}
        assert sorted(refused) == ["forwarded", "run-here"]
        for r in refused.values():
            assert not r["ok"] and r["error"]["code"] == "id_in_use", r
        assert metric(s0, "gossipd_messages_refused_total{reason=id_in_use}") == 2
        mine = {r["id"]: r for r in a.results(2, timeout_s=15)}
        assert sorted(mine) == ["forwarded", "run-here"]
        assert all(r["ok"] and set(r["text"].split()) == {"alpha"} for r in mine.values())
    finally:
        a.close()
        b.close()
