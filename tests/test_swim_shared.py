"""The simulator's converged start (sharedtable.py, MemberTable.bootstrap_shared): an Overlay
behaves as a plain dict under any operations, never writes the shared base, and a member that
starts from a shared table reaches the same states as one that applied N Alive updates; the
live ring kept in place equals the one rebuilt from the table."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import (
    Alive,
    Dead,
    Left,
    Suspect,
    Update,
    decode_gossip,
    encode_gossip,
    encode_record,
)
from gossipd.core.membership import LIVE_STATES, MemberTable, shared_base
from gossipd.core.sharedtable import Overlay, SharedRecords
from gossipd.core.swim_config import SwimConfig
from simulations.netsim import SimSwimNode, Simulation

KEYS = [f"k{i}" for i in range(8)]
ops = st.lists(
    st.tuples(st.sampled_from(["set", "del", "get"]), st.sampled_from(KEYS), st.integers(0, 9)),
    max_size=40,
)


@given(ops=ops, hidden=st.sets(st.sampled_from(KEYS)))
def test_an_overlay_is_a_dict_over_its_base(
    ops: list[tuple[str, str, int]], hidden: set[str]
) -> None:
    base = {k: i for i, k in enumerate(KEYS[:5])}
    frozen = dict(base)
    overlay = Overlay(base, hidden)
    model = {k: v for k, v in base.items() if k not in hidden}
    for op, key, value in ops:
        if op == "set":
            overlay[key] = value
            model[key] = value
        elif op == "del":
            if key in model:
                del overlay[key]
                del model[key]
            else:
                try:
                    del overlay[key]
                except KeyError:
                    pass
                else:
                    raise AssertionError(f"deleted absent {key}")
        assert overlay.get(key) == model.get(key)
        assert (key in overlay) == (key in model)
        if key in model:
            assert overlay[key] == model[key]
        assert overlay.shared(key) == (
            key in model
            and key in base
            and base[key] == model[key]
            and not dict.__contains__(overlay, key)
        )
    assert len(overlay) == len(model)
    assert sorted(overlay) == sorted(model) == sorted(overlay.keys())
    assert sorted(overlay.items()) == sorted(model.items())
    assert sorted(overlay.values()) == sorted(model.values())
    assert base == frozen, "the shared base is never written"


NAMES = [f"n{i}" for i in range(6)]
updates = st.lists(
    st.one_of(
        st.builds(
            lambda n, i: Alive(node=n, incarnation=i, addr=f"tcp://{n}:1"),
            st.sampled_from(NAMES[1:]),
            st.integers(0, 3),
        ),
        st.builds(
            lambda n, i, b: Suspect(node=n, incarnation=i, by=b),
            st.sampled_from(NAMES),
            st.integers(0, 3),
            st.sampled_from(NAMES),
        ),
        st.builds(
            lambda n, i, b: Dead(node=n, incarnation=i, by=b),
            st.sampled_from(NAMES),
            st.integers(0, 3),
            st.sampled_from(NAMES),
        ),
        st.builds(
            lambda n, i: Left(node=n, incarnation=i), st.sampled_from(NAMES), st.integers(0, 3)
        ),
    ),
    max_size=30,
)


def _state(table: MemberTable) -> tuple[object, ...]:
    members = sorted((n, m.state, m.incarnation, m.addr) for n, m in table.members.items())
    return (
        members,
        table.checksum(),
        table.live_count(),
        table.incarnation,
        sorted(table.suspects),
    )


@settings(max_examples=200)
@given(updates=updates, reap=st.booleans())
def test_a_shared_start_reaches_the_same_states_as_applying_n_alives(
    updates: list[Update], reap: bool
) -> None:
    pairs = [(n, f"tcp://{n}:1") for n in NAMES]
    base = shared_base(pairs, 0.0)
    shared = MemberTable(me="n0", addr="tcp://n0:1", now=0.0)
    shared.bootstrap_shared(base)
    plain = MemberTable(me="n0", addr="tcp://n0:1", now=0.0)
    for node, addr in pairs[1:]:
        plain.apply(Alive(node=node, incarnation=0, addr=addr), 0.0)
    ring = shared.live_ring()  # kept in place from now on
    for t, update in enumerate(updates):
        a, b = shared.apply(update, float(t)), plain.apply(update, float(t))
        assert a == b
        assert _state(shared) == _state(plain)
        rebuilt = sorted([n for n, m in plain.members.items() if m.state in LIVE_STATES] + ["n0"])
        assert shared.live_ring() == rebuilt
    if reap:
        shared.reap(1e9, dead_after_s=0.0, left_after_s=0.0)
        plain.reap(1e9, dead_after_s=0.0, left_after_s=0.0)
        assert _state(shared) == _state(plain)
    assert sorted(shared.records(), key=lambda r: r.node) == sorted(
        plain.records(), key=lambda r: r.node
    )
    assert all(m.incarnation == 0 and m.suspicion is None for m in base.members.values())
    assert base.ring == sorted(NAMES), "the shared ring is never written"
    assert ring is base.ring or ring is shared.live_ring()


def _sim_node(base: object, name: str) -> SimSwimNode:
    node = SimSwimNode(
        SwimConfig.sim(),
        node=name,
        addr=f"tcp://{name}:1",
        rng=random.Random(7),
        now=0.0,
    )
    node.bootstrap_shared(0.0, base)  # type: ignore[arg-type]
    return node


@settings(max_examples=200)
@given(sender_news=updates, receiver_news=updates, reap=st.booleans())
def test_a_push_pull_between_overlays_acts_as_one_of_all_records(
    sender_news: list[Update], receiver_news: list[Update], reap: bool
) -> None:
    """A push-pull between two tables sharing a base, in one page, travels as an object
    (SwimNode.send_page) and walks only the records that can differ (SharedRecords.differing):
    the receiver ends as if it had decoded the page's bytes and walked every record, sends the
    same and reports the same; the page's counted size is its encoded size, and its encoding
    is byte for byte the page a daemon builds from encoded records (PushPullEncoded)."""
    base = shared_base([(n, f"tcp://{n}:1") for n in NAMES], 0.0)
    sender = _sim_node(base, "n1")
    fast, slow = _sim_node(base, "n2"), _sim_node(base, "n2")
    for t, update in enumerate(sender_news):
        sender.apply(update, float(t))
    for t, update in enumerate(receiver_news):
        fast.apply(update, float(t))
        slow.apply(update, float(t))
    if reap:  # forgotten members: a shared record brings them back (they join again)
        fast.table.reap(1e9, dead_after_s=0.0, left_after_s=0.0)
        slow.table.reap(1e9, dead_after_s=0.0, left_after_s=0.0)
    sender.take_sent()
    sender.antientropy.push_pull(fast.addr, reply=True, now=0.0)
    [(_, msg, size)] = sender.take_sent()
    assert isinstance(msg.members, SharedRecords)
    data = encode_gossip(msg)
    raws = [encode_record(r) for r in msg.members]
    assert data == sender.antientropy._page(raws, reply=True, join=False, page=0, more=False)
    assert size == len(data)
    fast.take_sent(), slow.take_sent(), fast.take_events(), slow.take_events()
    t = float(len(receiver_news) + 1)
    fast.deliver(t, msg, size)
    slow.deliver(t, decode_gossip(data, bytes_max=len(data)), size)
    assert _state(fast.table) == _state(slow.table)
    assert fast.take_sent() == slow.take_sent()
    assert fast.take_events() == slow.take_events()


def test_the_simulator_starts_10000_members_in_o_n() -> None:
    """Shared start: 10,000 members know each other with one table of 10,000 entries (a
    member's own entries are only those it has heard news about)."""
    sim = Simulation(10_000, seed=1)
    first, last = sim.members[0].core.table, sim.members[-1].core.table
    assert first.live_count() == last.live_count() == 10_000
    assert first.members.base is last.members.base  # type: ignore[attr-defined]
    assert dict.__len__(first.members) == 0
    assert len(sim.checksums()) == 1
    rng = random.Random(1)
    node = sim.members[rng.randrange(10_000)].core
    assert node.live_ring() == sorted(m.name for m in sim.members)


def test_simtime_reports_the_cost_of_each_n(capsys) -> None:  # type: ignore[no-untyped-def]
    from simulations.__main__ import main

    assert main(["simtime", "--nodes", "20,40", "--seconds", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["nodes"] for r in rows] == [20, 40]
    assert all(r["cpu_s_per_simulated_s"] > 0 and r["startup_cpu_s"] >= 0 for r in rows)


def test_stalls_counts_runs_with_a_false_death(capsys) -> None:  # type: ignore[no-untyped-def]
    """A stall longer than every timer (8 s against a 4.8 s maximum) is a death."""
    from simulations.__main__ import main

    assert main(["stalls", "--seeds", "2", "--seconds", "12", "--stall-s", "8", "--loss", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runs_with_false_death"] == 2
