"""A host cut off and healed (issue 24): both sides see the cut, and heal, within bounds, in
the shape an operator runs (3 hosts x 2 daemons, one host cut), by property over seeds, cut
lengths and cuts; and the rules behind it one at a time (probing.py rules 2a, 2b, 9, 10, 11;
suspicion.py's cap on K).  The simulator drives the core; no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import Dead, Nack, Ping
from gossipd.core.membership import State
from gossipd.core.probing import DEAD_PING_S, Probe
from gossipd.core.suspicion import Suspicion, remaining_timeout_s
from gossipd.core.swim_config import SwimConfig
from simulations.netsim import NetworkModel, Simulation

HOSTS = [[0, 1], [2, 3], [4, 5]]


def _all_dead(sim: Simulation, observer: int, others: list[int]) -> bool:
    table = sim.members[observer].core.table.members
    return all(table[sim.members[j].name].state is State.DEAD for j in others)


def _cut_and_heal(seed: int, host: int, cut_s: float, loss: float) -> tuple[float, float, float]:
    """(the cut-off side's slowest member to hold every member beyond the cut dead, the
    other side's, all alive everywhere after the heal), in seconds."""
    sim = Simulation(6, seed=seed, config=SwimConfig.lan(), network=NetworkModel(loss=loss))
    t0 = 5.0 + seed % 997 / 997
    sim.run_until(t0)
    cut = HOSTS[host]
    rest = [i for i in range(6) if i not in cut]
    sim.partition([rest, cut])
    seen: dict[int, float] = {}
    t = t0
    while t < t0 + cut_s:
        t += 0.02
        sim.run_until(t)
        for i in range(6):
            if i not in seen and _all_dead(sim, i, cut if i in rest else rest):
                seen[i] = t - t0
    sim.heal()
    sim.net.loss = 0.0
    healed_at = t
    while not all(m.core.table.live_count() == 6 for m in sim.members):
        t += 0.02
        sim.run_until(t)
        assert t - healed_at < 30.0, f"seed {seed}: not healed 30 s after the heal"
    never = float("inf")
    return (
        max(seen.get(i, never) for i in cut),
        max(seen.get(i, never) for i in rest),
        t - healed_at,
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    host=st.integers(0, 2),
    cut_s=st.floats(8.0, 25.0),
    loss=st.sampled_from([0.0, 0.0, 0.05]),
)
def test_both_sides_see_a_cut_host_and_heal_within_bounds(
    seed: int, host: int, cut_s: float, loss: float
) -> None:
    """Before issue 24 the cut-off side often held some beyond the cut alive for the whole
    15 s (p50 9 s).  Now, without loss, both sides within 5 s (200 seeds: max 4.4 s and
    3.8 s), at 5% loss within 8 s (100 seeds: max 7.5 s); all alive within 5 s of the heal
    (max 2.7 s)."""
    cut_side, other_side, heal = _cut_and_heal(seed, host, cut_s, loss)
    bound = 5.0 if loss == 0.0 else 8.0
    assert cut_side <= bound and other_side <= bound, (seed, cut_side, other_side)
    assert heal <= 5.0, (seed, heal)


def test_the_cap_on_k_is_the_members_that_can_still_confirm() -> None:
    s = Suspicion(incarnation=0, started_at=10.0, by="me", k=3, min_s=1.6, max_s=4.8, witness=True)
    s.confirm("sibling")
    assert s.deadline() == pytest.approx(10.0 + remaining_timeout_s(1, 3, 1.6, 4.8))
    assert s.deadline(can_confirm=5) == s.deadline()
    assert s.deadline(can_confirm=1) == pytest.approx(11.6)  # one can confirm, and did
    assert s.deadline(can_confirm=0) == pytest.approx(11.6)
    heard = Suspicion(
        incarnation=0, started_at=10.0, by="x", k=3, min_s=1.6, max_s=4.8, witness=False
    )
    assert heard.deadline(can_confirm=0) == pytest.approx(14.8)  # a non-witness waits the max


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 8),
    confirmations=st.integers(0, 10),
    can_confirm=st.integers(-2, 12),
    lo=st.floats(0.1, 10.0),
    mult=st.floats(1.0, 5.0),
)
def test_a_capped_k_never_waits_longer_nor_less_than_the_minimum(
    k: int, confirmations: int, can_confirm: int, lo: float, mult: float
) -> None:
    s = Suspicion(
        incarnation=0, started_at=0.0, by="me", k=k, min_s=lo, max_s=lo * mult, witness=True
    )
    for i in range(confirmations):
        s.confirm(f"c{i}")
    capped, plain = s.deadline(can_confirm), s.deadline()
    assert lo - 1e-9 <= capped <= plain + 1e-9
    if can_confirm <= confirmations:
        assert capped == pytest.approx(lo)  # every member that could confirm has


def _sim_cut(seed: int = 3) -> Simulation:
    sim = Simulation(6, seed=seed, config=SwimConfig.lan())
    sim.run_until(5.0)
    sim.partition([[0, 1, 2, 3], [4, 5]])
    return sim


def test_a_silent_helper_of_a_failed_probe_that_others_nacked_is_suspect() -> None:
    """Rule 10, and rule 9's refinement: one nack shows we hear in time."""
    sim = _sim_cut()
    prober = sim.members[5].core.prober
    probe = Probe(target="n0000", seq=999, started=5.0, ack_deadline=5.2, final_deadline=5.6)
    probe.helpers, probe.requested, probe.indirect_sent = ("n0001", "n0004", "n0002"), 3, True
    prober.probe = probe
    core = sim.members[5].core
    core.receive_message(5.3, Nack(**sim.members[4].core.header([]), seq=999), 100)
    assert probe.nacked == ("n0004",)
    before = core.awareness.score
    prober.tick(5.6)
    table = core.table.members
    assert [table[n].state for n in ("n0000", "n0001", "n0002", "n0004")] == [
        State.SUSPECT,
        State.SUSPECT,
        State.SUSPECT,
        State.ALIVE,
    ]
    assert core.awareness.score == before  # a nack came: not our fault
    # Rules 2b and 2a: the next probe at once, of a member not suspect.
    assert prober.probe is not None and prober.probe.started == 5.6
    assert prober.probe.target in ("n0003", "n0004")


def test_a_failed_probe_no_helper_nacked_blames_only_us_and_the_target() -> None:
    sim = _sim_cut()
    core = sim.members[5].core
    prober = core.prober
    probe = Probe(target="n0000", seq=999, started=5.0, ack_deadline=5.2, final_deadline=5.6)
    probe.helpers, probe.requested, probe.indirect_sent = ("n0001", "n0002", "n0003"), 3, True
    prober.probe = probe
    before = core.awareness.score
    prober.tick(5.6)
    table = core.table.members
    assert table["n0000"].state is State.SUSPECT
    assert table["n0001"].state is State.ALIVE and table["n0002"].state is State.ALIVE
    assert core.awareness.score == before + 1


def test_the_recently_dead_are_pinged_with_their_death_and_the_dead_are_told() -> None:
    """Rule 11: pings to members dead less than DEAD_PING_S ago carry their death; an ack to
    a ping from a member we hold dead carries its death."""
    sent: list[tuple[str, object]] = []
    # The pings the majority side sends to the cut-off members, 15 to 25 s after they died.
    sim2 = _sim_cut(seed=4)
    sim2.run_until(20.0)
    for m in sim2.members[:4]:
        m.core.take_sent()  # type: ignore[attr-defined]
    for m in sim2.members[:4]:
        core = m.core
        original = core.send

        def send(addr: str, msg: object, core=core, original=original) -> None:  # type: ignore[no-untyped-def]
            sent.append((addr, msg))
            original(addr, msg)

        core.send = send  # type: ignore[method-assign]
    sim2.run_until(30.0)
    assert sim2.members[0].core.table.members["n0004"].state is State.DEAD
    dead_addr = {sim2.members[4].addr, sim2.members[5].addr}
    to_dead = [m for a, m in sent if a in dead_addr and isinstance(m, Ping)]
    assert to_dead, "the recently dead are pinged"
    assert all(any(isinstance(u, Dead) and u.node == m.target for u in m.updates) for m in to_dead)
    # Past DEAD_PING_S they are not.
    sent.clear()
    sim2.run_until(20.0 + DEAD_PING_S + 10.0)
    sent.clear()
    sim2.run_until(20.0 + DEAD_PING_S + 20.0)
    assert not [m for a, m in sent if a in dead_addr and isinstance(m, Ping)]
    # An ack to a dead member's ping tells it.
    me = sim2.members[0].core
    ping = Ping(**sim2.members[4].core.header([]), seq=7, target="n0000")
    me.take_sent()  # type: ignore[attr-defined]
    me.receive_message(sim2.now, ping, 100)
    acks = [msg for _, msg, _ in me.take_sent()]  # type: ignore[attr-defined]
    assert any(isinstance(u, Dead) and u.node == "n0004" for u in acks[0].updates)
