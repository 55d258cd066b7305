"""Contained suspicions (swim_config.contain_suspicions, docs/MEMBERSHIP.md): a suspicion is
told to the suspect and to confirm_probes members only, its refutation rides piggyback, and
so each member's message load and the suspicions it hears stay flat as N grows under loss."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import Alive, GossipOnly, Ping, Suspect
from gossipd.core.membership import State
from gossipd.core.swim_config import SwimConfig
from simulations.__main__ import main
from simulations.netsim import NetworkModel, Simulation
from tests.test_swim_mechanisms import Wire, addr_of


def _suspicion_of_x(wire: Wire) -> tuple[str, float]:
    """Crash x until someone suspects it; then x comes back.  (accuser, time)."""
    wire.run_until(1.0)
    wire.down.add("x")

    def suspected() -> bool:
        return any(
            n.table.members["x"].state is State.SUSPECT
            for name, n in wire.nodes.items()
            if name != "x"
        )

    wire.run_until(6.0, stop=suspected)
    accuser = next(
        name
        for name, n in sorted(wire.nodes.items())
        if name != "x" and n.table.members["x"].state is State.SUSPECT
    )
    wire.down.discard("x")
    return accuser, wire.now


def test_a_contained_suspicion_reaches_the_suspect_and_the_confirmers_only() -> None:
    names = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "x"]
    wire = Wire(names, seed=3)
    accuser, t0 = _suspicion_of_x(wire)
    k = wire.config.confirm_probes
    told = [
        (dst, msg)
        for at, who, dst, msg in wire.sent
        if who == accuser and at >= t0 and isinstance(msg, GossipOnly)
        if any(isinstance(u, Suspect) and u.node == "x" for u in msg.updates)
    ]
    assert len(told) == k + 1 and told[0][0] == addr_of("x")
    confirmers = {dst.removeprefix("tcp://").removesuffix(":7946") for dst, _ in told[1:]}
    wire.run_until(t0 + 10.0)
    knew = {
        name
        for at, who, _, msg in wire.sent
        if at >= t0 and who != "x"
        for u in msg.updates
        if isinstance(u, Suspect) and u.node == "x"
        for name in [who]
    }
    assert knew <= {accuser} | confirmers, "only those told pass a suspicion on"
    # Every Suspect on the wire goes to the suspect, to a confirmer, or back to the accuser.
    for at, who, dst, msg in wire.sent:
        if at >= t0 and any(isinstance(u, Suspect) and u.node == "x" for u in msg.updates):
            assert dst in {addr_of(n) for n in {"x", accuser} | confirmers}, (who, dst, msg)
    refutations = [
        (dst, u)
        for at, who, dst, msg in wire.sent
        if who == "x" and at >= t0
        for u in msg.updates
        if isinstance(u, Alive) and u.node == "x" and u.incarnation == 1
    ]
    assert refutations and all(u.quiet for _, u in refutations)
    assert addr_of(accuser) in {dst for dst, _ in refutations}, "straight to the accuser"
    # No gossip round carries the quiet refutation: only direct answers are GossipOnly.
    rounds = [
        msg
        for at, who, dst, msg in wire.sent
        if at >= t0 and who not in ("x", accuser) and isinstance(msg, GossipOnly)
        if any(isinstance(u, Alive) and u.node == "x" for u in msg.updates)
    ]
    assert rounds == []
    # Yet every member learns x's new incarnation (piggyback), and nobody declares it dead.
    for name, node in wire.nodes.items():
        if name != "x":
            assert (node.table.members["x"].state, node.table.members["x"].incarnation) == (
                State.ALIVE,
                1,
            ), name
    assert all(n.stats.declared_dead == 0 for n in wire.nodes.values())


def test_gossiped_suspicions_reach_everyone_for_contrast() -> None:
    """The same fault with contain_suspicions off: members other than the accuser, its
    confirmers and the suspect pass the suspicion on (what made the load grow with N)."""
    names = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "x"]
    wire = Wire(names, seed=3, config=SwimConfig.sim(contain_suspicions=False))
    accuser, t0 = _suspicion_of_x(wire)
    wire.run_until(t0 + 2.0)
    carriers = {
        who
        for at, who, _, msg in wire.sent
        if at >= t0 and who not in ("x", accuser) and not isinstance(msg, Ping)
        for u in msg.updates
        if isinstance(u, Suspect) and u.node == "x"
    }
    assert len(carriers) > SwimConfig.sim().confirm_probes


def _load(n: int, contain: bool, seconds: float = 30.0) -> tuple[float, float]:
    """(messages per member per probe period, suspicion events per member per minute) in a
    steady window at 10% loss."""
    config = SwimConfig.sim(contain_suspicions=contain)
    sim = Simulation(n, seed=5, config=config, network=NetworkModel(loss=0.1))
    sim.run_until(5.0)
    m0, _ = sim.cost()
    e0 = len(sim.trace.events)
    sim.run_until(5.0 + seconds)
    m1, _ = sim.cost()
    suspicions = sum(1 for _, e in sim.trace.events[e0:] if e.kind == "suspect")
    period = config.probe_interval_s
    return (m1 - m0) / n / seconds * period, suspicions / n / (seconds / 60)


def test_per_member_load_is_flat_in_n_at_10pct_loss_only_when_contained() -> None:
    small, big = _load(32, True), _load(256, True)
    assert big[0] <= 1.2 * small[0], (small, big)
    assert small[0] < 5.0 and big[1] < 2.0, (small, big)
    gossiped_small, gossiped_big = _load(32, False), _load(256, False)
    assert gossiped_big[0] > 1.4 * gossiped_small[0], (gossiped_small, gossiped_big)
    assert gossiped_big[1] > 5 * big[1], (big, gossiped_big)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), loss=st.sampled_from([0.05, 0.1, 0.2]))
def test_contained_suspicions_declare_no_healthy_member_dead_and_views_converge(
    seed: int, loss: float
) -> None:
    """Under loss no healthy member is declared dead, and once the loss stops every view
    agrees (quiet refutations reach everyone by piggyback and push-pull)."""
    sim = Simulation(20, seed=seed, network=NetworkModel(loss=loss))
    sim.run_until(40.0)
    sim.net.loss = 0.0
    sim.run_until(100.0)
    assert [e for _, e in sim.trace.events if e.kind == "dead"] == []
    assert len(sim.checksums()) == 1


def test_the_swim_scenario_takes_config_overrides_and_reports_rates(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["swim", "--nodes", "12", "--loss", "0.1", "--quiet", "--json"]
    args += ["--crash-trials", "1", "--dissemination-trials", "1"]
    assert main([*args, "--swim", "contain_suspicions=false", "--swim", "confirm_probes=2"]) == 0
    report = json.loads(capsys.readouterr().out)
    fp = report["false_positives"]
    assert fp["suspicion_events_per_member_min"] >= fp["accusations_per_member_min"] >= 0
    with pytest.raises(SystemExit, match="no_such_field"):
        main([*args, "--swim", "no_such_field=1"])
