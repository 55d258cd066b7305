"""The fence (core/fencing.py) and leadership gossip in the SWIM core: terms spread to every
member within a few gossip rounds, directives are admitted only at the highest token seen,
stale ones are refused and counted.  Hypothesis for the fence's rules; the virtual-time
simulator for the spreading."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.fencing import KINDS_MAX, Fence
from gossipd.core.gossip_messages import (
    DIRECTIVE_BODY_BYTES_MAX,
    Directive,
    GossipOnly,
    PushPull,
    Term,
    decode_gossip,
    encode_gossip,
)
from simulations.netsim import Simulation


def directive(
    token: int, seq: int = 1, kind: str = "k", leader: str = "", body: bytes = b""
) -> Directive:
    return Directive(leader=leader or f"L{token}", token=token, seq=seq, kind=kind, body=body)


def test_a_higher_term_replaces_a_lower_one_and_not_the_reverse() -> None:
    fence = Fence()
    assert fence.term is None and fence.token == 0
    assert fence.observe(Term(leader="a", token=5))
    assert not fence.observe(Term(leader="b", token=3))
    assert not fence.observe(Term(leader="a", token=5))
    assert fence.term == Term(leader="a", token=5)
    assert not fence.observe(Term(leader="c", token=5)), "same token, other leader: conflict"
    assert fence.statistics().terms_conflicting == 1
    assert fence.observe(Term(leader="b", token=9))
    assert fence.token == 9


def test_a_stale_directive_is_refused_and_counted() -> None:
    fence = Fence()
    fence.observe(Term(leader="new", token=10))
    assert not fence.admit(directive(7, leader="old"))
    assert fence.statistics().refused["stale_token"] == 1
    assert fence.admit(directive(10, leader="new"))
    assert fence.statistics().directives_admitted == 1


def test_a_directive_raises_the_term_and_dedups_per_kind() -> None:
    fence = Fence()
    assert fence.admit(directive(4, seq=1, leader="a"))
    assert fence.term == Term(leader="a", token=4)
    assert not fence.admit(directive(4, seq=1, leader="a")), "duplicate"
    assert fence.statistics().directives_duplicate == 1
    assert fence.statistics().refused["stale_token"] == 0
    assert fence.admit(directive(4, seq=2, leader="a"))
    assert not fence.admit(directive(4, seq=1, leader="a")), "superseded"
    assert fence.statistics().refused["superseded"] == 1
    assert fence.admit(directive(4, seq=1, leader="a", kind="other")), "kinds are apart"
    assert not fence.admit(directive(4, seq=3, leader="z")), "same token, other leader"
    assert fence.statistics().refused["conflict"] == 1
    assert fence.newest("k") == (4, 2)


def test_kinds_are_bounded() -> None:
    fence = Fence(kinds_max=2)
    assert fence.admit(directive(1, kind="a", leader="L"))
    assert fence.admit(directive(1, kind="b", leader="L"))
    assert not fence.admit(directive(1, kind="c", leader="L"))
    assert fence.statistics().refused["kinds_full"] == 1
    assert fence.admit(directive(1, seq=2, kind="a", leader="L")), "a known kind still applies"
    assert KINDS_MAX >= 64


_ops = st.lists(
    st.tuples(
        st.booleans(),
        st.integers(1, 12),
        st.integers(0, 5),
        st.sampled_from(["a", "b"]),
        st.sampled_from(["x", "y"]),
    ),
    max_size=60,
)


@given(_ops)
def test_a_member_never_acts_on_a_lower_token_than_one_it_has_seen(ops: list) -> None:  # type: ignore[type-arg]
    """Whatever order terms and directives arrive in: every admitted directive's token is >=
    every token seen before it, the highest token never falls, and per kind the admitted
    (token, seq) strictly increase."""
    fence = Fence()
    seen_max = 0
    last: dict[str, tuple[int, int]] = {}
    for is_term, token, seq, kind, leader_suffix in ops:
        leader = f"L{token}{leader_suffix if token % 3 == 0 else ''}"
        if is_term:
            fence.observe(Term(leader=leader, token=token))
            seen_max = max(seen_max, token)
        else:
            d = Directive(leader=leader, token=token, seq=seq, kind=kind)
            if fence.admit(d):
                assert token >= seen_max
                assert (token, seq) > last.get(kind, (0, -1))
                last[kind] = (token, seq)
                seen_max = max(seen_max, token)
        assert fence.token == seen_max or (fence.token <= seen_max and fence.token > 0)
        assert fence.token == seen_max
    refused = sum(fence.statistics().refused.values())
    assert refused + fence.statistics().directives_admitted <= len(ops)


def test_term_and_directive_round_trip_and_bounds() -> None:
    body = msgspec.msgpack.encode({"n": 1})
    msg = GossipOnly(
        cluster="c",
        src="a",
        src_addr="tcp://127.0.0.1:1",
        updates=[Term(leader="a", token=3), directive(3, body=body, leader="a")],
    )
    assert decode_gossip(encode_gossip(msg), bytes_max=1 << 20) == msg
    pp = PushPull(
        cluster="c",
        src="a",
        src_addr="tcp://127.0.0.1:1",
        reply=False,
        members=[],
        term=Term(leader="a", token=3),
    )
    assert decode_gossip(encode_gossip(pp), bytes_max=1 << 20) == pp
    import pytest

    from gossipd.errors import RemoteProtocolError

    for bad in (
        directive(3, kind="k" * 33, leader="a"),
        directive(3, body=b"x" * (DIRECTIVE_BODY_BYTES_MAX + 1), leader="a"),
    ):
        data = encode_gossip(
            msg.__class__(cluster="c", src="a", src_addr="tcp://127.0.0.1:1", updates=[bad])
        )
        with pytest.raises(RemoteProtocolError):
            decode_gossip(data, bytes_max=1 << 20)
    zero = encode_gossip(
        GossipOnly(
            cluster="c", src="a", src_addr="tcp://127.0.0.1:1", updates=[Term(leader="a", token=0)]
        )
    )
    with pytest.raises(RemoteProtocolError):
        decode_gossip(zero, bytes_max=1 << 20)


# -- in the SWIM core, over the simulated network --------------------------------------------


def _drained(sim: Simulation) -> dict[str, list]:  # type: ignore[type-arg]
    return {m.name: m.core.take_leadership() for m in sim.members}


def test_a_term_reaches_every_member_within_a_few_gossip_rounds() -> None:
    sim = Simulation(16, seed=3)
    sim.run_until(2.0)
    leader = sim.members[5]
    term = Term(leader=leader.name, token=42)
    leader.core.publish_term(sim.now, term)
    sim._flush(leader)
    start = sim.now
    interval = sim.config.gossip_interval_s
    sim.run_until(start + 4 * interval)
    assert all(m.core.fence.term == term for m in sim.members)
    seen = _drained(sim)
    assert all(seen[m.name] == [term] for m in sim.members)
    # Re-announced: not news, so nobody passes it on again (only the leader's own push).
    leader.core.publish_term(sim.now, term)
    sim._flush(leader)
    sim.run_until(sim.now + 4 * interval)
    assert all(items == [] for items in _drained(sim).values())


def test_a_stale_leader_directive_is_refused_everywhere_and_counted() -> None:
    sim = Simulation(8, seed=4)
    sim.run_until(1.0)
    new, old = sim.members[1], sim.members[2]
    for _ in range(2):  # the leader re-announces its term every TTL
        new.core.publish_term(sim.now, Term(leader=new.name, token=20))
        sim._flush(new)
        sim.run_until(sim.now + 2.0)
    assert all(m.core.fence.token == 20 for m in sim.members)
    _drained(sim)
    assert not old.core.publish_directive(sim.now, directive(11, leader=old.name))
    # A stale directive that reaches the others anyway (e.g. forged, or from a partitioned
    # member that never heard the new term) is refused by each of them.
    for m in sim.members:
        if m is not old:
            m.core.receive(
                sim.now,
                encode_gossip(
                    GossipOnly(
                        cluster=sim.config.cluster,
                        src=old.name,
                        src_addr=old.addr,
                        updates=[directive(11, leader=old.name)],
                    )
                ),
            )
            assert m.core.fence.statistics().refused["stale_token"] == 1
    assert all(items == [] for items in _drained(sim).values())
    body = b"\x81\xa1n\x01"
    good = directive(20, seq=1, kind="budgets", leader=new.name, body=body)
    assert new.core.publish_directive(sim.now, good)
    sim._flush(new)
    sim.run_until(sim.now + 2.0)
    assert all(items == [good] for items in _drained(sim).values())


def test_a_large_directive_spreads_in_gossip_rounds() -> None:
    sim = Simulation(8, seed=5)
    sim.run_until(1.0)
    leader = sim.members[0]
    big = directive(3, kind="big", leader=leader.name, body=b"z" * 60_000)
    assert leader.core.publish_directive(sim.now, big)
    sim._flush(leader)
    sim.run_until(sim.now + 3.0)
    assert all(m.core.fence.newest("big") == (3, 1) for m in sim.members)


def test_a_joiner_learns_the_term_from_its_first_push_pull() -> None:
    sim = Simulation(4, seed=6, join=True)
    leader = sim.members[0]
    term = Term(leader=leader.name, token=7)
    leader.core.fence.observe(term)  # known at the seed, no longer being gossiped
    sim.run_until(3.0)
    assert all(m.core.fence.term == term for m in sim.members)
