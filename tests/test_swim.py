"""SWIM nodes over the virtual-time network: joins, failure detection, stalls, leaves, bad
input, partitions, determinism.  No sleeps, no sockets: the simulator drives the same core."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import Alive, GossipOnly, encode_gossip
from gossipd.core.membership import State
from gossipd.core.swim_config import SwimConfig
from simulations.netsim import NetworkModel, Simulation


def dead_events(sim: Simulation, node: str) -> list:  # type: ignore[type-arg]
    return [(o, e) for o, e in sim.trace.events if e.kind == "dead" and e.node == node]


def test_members_join_through_one_seed_and_converge() -> None:
    sim = Simulation(8, seed=11, join=True)
    sim.run_until(10.0)
    assert len(sim.checksums()) == 1
    assert all(m.core.table.live_count() == 8 for m in sim.members)


def test_a_crashed_member_is_declared_dead_by_everyone_and_nobody_else_is() -> None:
    sim = Simulation(8, seed=12)
    sim.run_until(3.0)
    sim.crash(3)
    sim.run_until(11.0)
    observers = {o for o, _ in dead_events(sim, "n0003")}
    assert observers == {m.name for m in sim.members if m.up}
    assert all(e.node == "n0003" for _, e in sim.trace.events if e.kind == "dead")
    assert all(m.core.table.members["n0003"].state is State.DEAD for m in sim.live())


def test_a_member_stalled_2s_is_never_declared_dead_and_does_not_accuse_others() -> None:
    sim = Simulation(8, seed=13)
    for start in range(2, 60, 10):
        sim.run_until(float(start))
        sim.pause(2, 2.0)
    sim.run_until(65.0)
    assert dead_events(sim, "n0002") == []
    accusations = [e for o, e in sim.trace.events if e.kind == "suspect" and e.by == "n0002"]
    assert accusations == [], "a member that was paused blames itself, not others"


def test_a_graceful_leave_is_left_not_dead() -> None:
    sim = Simulation(6, seed=14)
    sim.run_until(2.0)
    member = sim.members[4]
    member.core.leave(sim.now)
    sim._flush(member)
    sim.run_until(2.5)
    sim.crash(4)  # the process exits after announcing
    sim.run_until(15.0)
    assert dead_events(sim, "n0004") == []
    left_seen = {o for o, e in sim.trace.events if e.kind == "left" and e.node == "n0004"}
    assert left_seen == {m.name for m in sim.live()}


def test_foreign_cluster_and_malformed_messages_change_nothing() -> None:
    sim = Simulation(3, seed=15)
    core = sim.members[0].core
    before = core.table.checksum()
    foreign = GossipOnly(
        cluster="other",
        src="intruder",
        src_addr="tcp://1.2.3.4:1",
        updates=[Alive(node="intruder", incarnation=9, addr="tcp://1.2.3.4:1")],
    )
    core.receive(1.0, encode_gossip(foreign))
    for junk in (
        b"",
        b"\xc1",
        msgpack.packb({"t": 10, "v": 1}),
        msgpack.packb([1, 2]),
        b"\x91" * 10000,
    ):
        core.receive(1.0, junk)
    assert core.stats.foreign_cluster == 1 and core.stats.refused == 5
    assert core.table.checksum() == before and "intruder" not in core.table.members


def test_same_seed_same_trace_different_seed_different_trace() -> None:
    def trace(seed: int) -> list[tuple[str, str, str, float]]:
        sim = Simulation(6, seed=seed, network=NetworkModel(loss=0.2))
        sim.run_until(2.0)
        sim.crash(1)
        sim.run_until(12.0)
        return [(o, e.kind, e.node, round(e.at, 9)) for o, e in sim.trace.events]

    assert trace(5) == trace(5)
    assert trace(5) != trace(6)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), loss=st.floats(0.0, 0.3), split_s=st.floats(1.0, 40.0))
def test_views_converge_after_any_partition_heals(seed: int, loss: float, split_s: float) -> None:
    sim = Simulation(6, seed=seed, network=NetworkModel(loss=loss))
    sim.run_until(2.0)
    sim.partition([[0, 1, 2], [3, 4, 5]])
    sim.run_until(2.0 + split_s)
    sim.heal()
    sim.net.loss = 0.0  # "once the network heals"
    sim.run_until(2.0 + split_s + 30.0)
    assert len(sim.checksums()) == 1, f"seed {seed}"
    assert all(m.core.table.live_count() == 6 for m in sim.members)


def _objects_or_wire_run(
    wire: bool, join: bool, n: int = 40, config: SwimConfig | None = None
) -> tuple[object, ...]:
    sim = Simulation(
        n, seed=21, network=NetworkModel(loss=0.05), wire=wire, join=join, config=config
    )
    sim.run_until(12.0)
    sim.crash(3)
    sim.members[7].core.announce(sim.now)
    sim._schedule(sim.members[7])
    sim.run_until(45.0)
    sent = sum(m.core.stats.sent.get("PushPull", 0) for m in sim.members)
    refused = sum(m.core.stats.refused for m in sim.members)
    return sim.trace.events, sim.cost(), sim.trace.delivered, sim.checksums(), sent, refused


def test_messages_as_objects_give_the_trace_and_byte_counts_of_encoding_and_decoding() -> None:
    """The simulator hands the sender's message object to the receiver instead of bytes to
    decode (netsim.py): one seed gives the same events, messages and bytes either way."""
    for join in (False, True):
        objects, wire = _objects_or_wire_run(False, join), _objects_or_wire_run(True, join)
        assert objects == wire
        events, _, _, _, push_pulls, refused = objects
        assert push_pulls > 20 and refused == 0
        assert any(e.kind == "dead" for _, e in events)  # type: ignore[attr-defined]


def test_paged_push_pulls_as_objects_give_the_trace_of_encoding_and_decoding() -> None:
    """Tables larger than a page (120 members in 4 KiB pages): each page after the first
    leaves encoded and the simulator decodes it once (netsim.SimSwimNode.send_encoded); the
    same events, messages and bytes as bytes on the wire."""
    config = SwimConfig.sim(push_pull_page_bytes=4096)
    objects = _objects_or_wire_run(False, False, n=120, config=config)
    assert objects == _objects_or_wire_run(True, False, n=120, config=config)
    _, _, _, _, pages, refused = objects
    assert pages > 3 * 100 and refused == 0  # about 4 pages an exchange
