"""The election simulator (simulations/election.py): its judgement on synthetic logs (overlaps
and token regressions must be caught), its etcd proxy's cut, and a quick real run: real etcd,
3 real daemons, the --quick fault schedule under load."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulations.election_metrics import (
    Incarnation,
    Interval,
    elections,
    failover_s,
    leadership_intervals,
    new_terms,
    overlapping_terms,
    overlaps,
    parse_log,
    token_regressions,
    unprovoked_elections,
)
from simulations.etcd_proxy import EtcdProxy


def elected(node: str, token: int, t: float) -> dict[str, object]:
    return {"msg": "leader_elected", "node": node, "token": token, "t_wall": t}


def stepped_down(node: str, token: int, t: float) -> dict[str, object]:
    return {
        "msg": "leader_stepped_down",
        "node": node,
        "token": token,
        "reason": "ttl",
        "t_wall": t,
    }


def observed(node: str, token: int, leader: str, t: float) -> dict[str, object]:
    return {"msg": "term_observed", "node": node, "token": token, "leader": leader, "t_wall": t}


def test_a_clean_handover_has_no_overlap_and_no_regression() -> None:
    incs = [
        Incarnation("a", [elected("a", 5, 1.0), stepped_down("a", 5, 3.0)]),
        Incarnation("b", [observed("b", 5, "a", 1.1), elected("b", 7, 3.5)]),
        Incarnation("c", [observed("c", 5, "a", 1.2), observed("c", 7, "b", 3.6)]),
    ]
    intervals = leadership_intervals(incs, end_wall=10.0)
    assert intervals == [Interval("a", 5, 1.0, 3.0), Interval("b", 7, 3.5, 10.0)]
    assert overlapping_terms(intervals) == []
    assert token_regressions(incs) == []


def test_a_leader_that_never_stepped_down_overlaps_its_successor() -> None:
    incs = [
        Incarnation("a", [elected("a", 5, 1.0)]),
        Incarnation("b", [elected("b", 7, 2.0), stepped_down("b", 7, 4.0)]),
    ]
    pairs = overlapping_terms(leadership_intervals(incs, end_wall=10.0))
    assert [(x.node, y.node) for x, y in pairs] == [("a", "b")]


def test_a_killed_leader_leads_until_its_death_only() -> None:
    killed = Incarnation("a", [elected("a", 5, 1.0)], died_at=2.0)
    successor = Incarnation("b", [elected("b", 7, 4.0)])
    assert overlapping_terms(leadership_intervals([killed, successor], 10.0)) == []
    # Killed after its successor was elected: an overlap, even of a millisecond.
    late = Incarnation("a", [elected("a", 5, 1.0)], died_at=4.001)
    assert len(overlapping_terms(leadership_intervals([late, successor], 10.0))) == 1


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0.0, 1.0), (1.0, 2.0), False),  # handed over at the same instant
        ((0.0, 1.0), (2.0, 3.0), False),
        ((0.0, 1.0), (0.999, 2.0), True),
        ((0.0, 2.0), (1.0, 1.0), True),  # a term of no length inside another
        ((0.0, 2.0), (2.0, 2.0), False),
    ],
)
def test_overlap_table(a: tuple[float, float], b: tuple[float, float], expected: bool) -> None:
    x, y = Interval("a", 1, *a), Interval("b", 2, *b)
    assert overlaps(x, y) is expected and overlaps(y, x) is expected


def test_the_same_leader_reconfirming_its_token_is_one_term() -> None:
    inc = Incarnation("a", [elected("a", 5, 1.0), elected("a", 5, 6.0), stepped_down("a", 5, 8.0)])
    assert leadership_intervals([inc], 10.0) == [Interval("a", 5, 1.0, 8.0)]
    # Intervals of one node never count as overlapping each other.
    again = Incarnation("a", [elected("a", 5, 1.0), elected("a", 9, 6.0)])
    assert overlapping_terms(leadership_intervals([again], 10.0)) == []


def test_a_step_down_logged_late_ends_the_term_when_the_lease_did() -> None:
    late = stepped_down("a", 5, 6.0) | {"lease_until_wall": 3.0}
    incs = [
        Incarnation("a", [elected("a", 5, 1.0), late]),
        Incarnation("b", [elected("b", 7, 4.0)]),
    ]
    assert leadership_intervals(incs, 10.0)[0] == Interval("a", 5, 1.0, 3.0)
    assert overlapping_terms(leadership_intervals(incs, 10.0)) == []
    # Read by the step-down's log time alone, the terms overlap.
    assert len(overlapping_terms(leadership_intervals(incs, 10.0, lease_until=False))) == 1


def test_a_lower_token_after_a_higher_one_is_a_regression() -> None:
    inc = Incarnation("c", [observed("c", 7, "b", 1.0), observed("c", 5, "a", 2.0)])
    problems = token_regressions([inc])
    assert len(problems) == 1 and "observed token 5 after 7" in problems[0]


def test_one_token_claimed_by_two_leaders_is_a_regression() -> None:
    incs = [
        Incarnation("a", [elected("a", 5, 1.0)]),
        Incarnation("b", [elected("b", 5, 2.0)]),
    ]
    problems = token_regressions(incs)
    assert len(problems) == 1 and "two leaders" in problems[0]
    gossiped = [
        Incarnation("a", [elected("a", 5, 1.0)]),
        Incarnation("c", [observed("c", 5, "b", 1.5)]),
    ]
    assert len(token_regressions(gossiped)) == 1


def test_a_restarted_daemon_starts_its_observations_afresh() -> None:
    before = Incarnation("c", [observed("c", 7, "b", 1.0)], died_at=2.0)
    after = Incarnation("c", [observed("c", 7, "b", 3.0), observed("c", 9, "a", 4.0)])
    assert token_regressions([before, after]) == []


def test_failover_and_unprovoked_elections() -> None:
    incs = [
        Incarnation("a", [elected("a", 5, 1.0)], died_at=10.0),
        Incarnation("b", [elected("b", 7, 12.5), elected("b", 9, 30.0)]),
    ]
    got = elections(incs)
    assert got == [(1.0, "a", 5), (12.5, "b", 7), (30.0, "b", 9)]
    assert failover_s(10.0, got) == pytest.approx(2.5)
    assert failover_s(31.0, got) is None
    assert unprovoked_elections(got, [(20.0, 35.0), (0.0, 0.5)]) == [(30.0, "b", 9)]


def test_a_leader_resuming_its_own_term_is_no_new_term() -> None:
    got = [(1.0, "a", 5), (4.0, "a", 5), (6.0, "b", 7), (9.0, "b", 7)]
    assert new_terms(got) == [(1.0, "a", 5), (6.0, "b", 7)]


def test_parse_log_reads_json_lines_and_skips_the_rest() -> None:
    lines = [
        json.dumps({"ts": 1.0, "msg": "serving"}),
        "Traceback (most recent call last):",
        json.dumps(elected("a", 3, 2.0)),
        '{"broken',
    ]
    entries = parse_log("\n".join(lines))
    assert [e["msg"] for e in entries] == ["serving", "leader_elected"]


times = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@given(st.lists(st.tuples(st.sampled_from("abc"), times, times), max_size=12))
def test_overlaps_match_a_brute_force_count(raw: list[tuple[str, float, float]]) -> None:
    intervals = [Interval(n, k, min(x, y), max(x, y)) for k, (n, x, y) in enumerate(raw)]
    expected = sum(
        1
        for i, a in enumerate(intervals)
        for b in intervals[i + 1 :]
        if a.node != b.node and overlaps(a, b)
    )
    assert len(overlapping_terms(intervals)) == expected


def test_a_cut_proxy_carries_nothing_until_healed() -> None:
    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        proxy = await EtcdProxy("127.0.0.1", port).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
            proxy.cut()
            writer.write(b"held")
            held = asyncio.ensure_future(reader.readexactly(4))
            # A new connection during the cut is accepted and carries nothing either.
            r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
            w2.write(b"new")
            fresh = asyncio.ensure_future(r2.readexactly(3))
            done, _ = await asyncio.wait({held, fresh}, timeout=0.5)
            assert not done, "bytes crossed a cut proxy"
            proxy.heal()
            assert await asyncio.wait_for(held, 5) == b"held"
            assert await asyncio.wait_for(fresh, 5) == b"new"
            writer.close()
            w2.close()
        finally:
            await proxy.close()
            server.close()

    asyncio.run(main())


def test_quick_election_run_keeps_one_leader_and_loses_no_task(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Real etcd, 3 real daemons, TTL 2 s, one round of the fault schedule (leader SIGKILL,
    SIGTERM resign, leader cut off from etcd, etcd restart, etcd stopped) under load."""
    from simulations.election import QUICK, ElectionRun, run_election
    from tests.etcd_cluster import etcd_binary

    etcd_binary()  # skip (or fail under GOSSIPD_REQUIRE_ETCD=1) without etcd
    report = run_election(
        ElectionRun(daemons=3, ttl_s=2.0, rounds=1, log_dir=str(tmp_path), progress=False, **QUICK)
    )
    print(json.dumps(report))
    assert report["overlapping_terms"] == 0, report["problems"]
    assert report["token_regressions"] == 0, report["problems"]
    assert report["tasks_sent"] > 0 and report["tasks_lost"] == 0, report["task_errors"]
    assert report["failover_kill_n"] == 1, "the leader's SIGKILL was followed by an election"
    assert report["failover_kill_p50_s"] < 2.0 + 2.0
    assert report["failover_resign_p50_s"] < 0.5
