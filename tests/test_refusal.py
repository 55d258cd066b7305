"""Crash evidence from refused connections (core/refusal.py), on SwimNodes joined by the
lossless wire of test_swim_mechanisms: when checks are asked, what a refusal decides, the
stale-life and budget rules, and that a member declared dead while alive refutes.  Each test
names the rule of the module's head comment it checks.  The real-socket half (portcheck.py,
real daemons) is in tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import Alive, GossipOnly
from gossipd.core.membership import State
from gossipd.core.refusal import ACCEPTED, DEAD, OVER_BUDGET, STALE, PortCheck
from gossipd.core.swim_config import SwimConfig
from gossipd.membership.portcheck import connection_refused, tcp_target
from tests.test_swim_mechanisms import Wire, addr_of, hdr

NAMES = ["a", "b", "c", "d", "e", "f", "g"]


def states_of(wire: Wire, node: str) -> dict[str, State]:
    return {n: s.table.members[node].state for n, s in wire.nodes.items() if n != node}


def test_a_refusal_declares_the_member_dead_and_every_member_knows_at_once() -> None:
    """rules 1 and 4: a lost connection asks for a check; a refusal is a Dead, sent urgently."""
    wire = Wire(NAMES, seed=3)
    wire.run_until(2.0)
    wire.down.add("d")  # crashed: its port refuses
    a = wire.nodes["a"]
    a.connection_lost(wire.now, "d")
    checks = a.take_port_checks()
    assert checks == [PortCheck("d", addr_of("d"), 0)]
    assert a.take_port_checks() == [], "taken once"
    assert a.port_checked(wire.now, checks[0], refused=True) == DEAD
    assert a.table.members["d"].state is State.DEAD
    wire.flush_all()
    start = wire.now
    wire.run_until(
        start + 0.5, stop=lambda: all(s is State.DEAD for s in states_of(wire, "d").values())
    )
    assert wire.now - start <= 0.3, "the Dead is sent at once, then gossiped every 0.2 s"
    assert set(states_of(wire, "d").values()) == {State.DEAD}


def test_a_port_that_accepts_decides_nothing() -> None:
    """rule 2: a stalled process accepts connections: no evidence, SWIM goes on."""
    wire = Wire(NAMES, seed=3)
    wire.run_until(2.0)
    a = wire.nodes["a"]
    a.connection_lost(wire.now, "d")
    (check,) = a.take_port_checks()
    assert a.port_checked(wire.now, check, refused=False) == ACCEPTED
    assert a.table.members["d"].state is State.ALIVE
    assert a.refusals.verdicts[ACCEPTED] == 1


def test_checks_are_asked_once_per_member_per_probe_timeout_and_only_for_live_members() -> None:
    """rule 1."""
    wire = Wire(NAMES, seed=3)
    wire.run_until(2.0)
    a, timeout_s = wire.nodes["a"], wire.config.probe_timeout_s
    a.refusals.want(2.0, "d")
    a.refusals.want(2.0 + timeout_s / 2, "d")
    a.refusals.want(2.0, "e")
    a.refusals.want(2.0, "nobody")
    assert sorted(c.node for c in a.take_port_checks()) == ["d", "e"]
    a.refusals.want(2.0 + timeout_s, "d")
    assert [c.node for c in a.take_port_checks()] == ["d"]
    a.port_checked(2.0 + timeout_s, PortCheck("d", addr_of("d"), 0), refused=True)
    a.refusals.want(5.0, "d")  # dead now: no more checks
    assert a.take_port_checks() == []


def test_checks_are_off_when_crash_by_refusal_is_off() -> None:
    """rule 1."""
    wire = Wire(NAMES, config=SwimConfig.sim(crash_by_refusal=False), seed=3)
    wire.run_until(2.0)
    wire.nodes["a"].connection_lost(2.0, "d")
    assert wire.nodes["a"].take_port_checks() == []


def test_a_late_ack_asks_for_a_check_of_the_target() -> None:
    """probing rule 8: when a probe goes indirect, the target's port is checked."""
    wire = Wire(NAMES, seed=5)
    wire.run_until(1.0)
    wire.down.add("d")
    asked: list[tuple[str, str]] = []  # (asker, member to check)

    def taken() -> bool:
        for name, node in wire.nodes.items():
            asked.extend((name, c.node) for c in node.take_port_checks())
        return bool(asked)

    wire.run_until(4.0, stop=taken)
    assert len(asked) == 1
    asker, target = asked[0]
    assert target == "d"
    probe = wire.nodes[asker].prober.probe
    assert probe is not None and probe.target == "d" and probe.indirect_sent


def test_a_refusal_of_another_life_or_address_is_stale() -> None:
    """rule 3: the member refuted, moved or died between the check and its answer."""
    wire = Wire(NAMES, seed=3)
    wire.run_until(2.0)
    a = wire.nodes["a"]
    old = PortCheck("d", addr_of("d"), 0)
    # It refuted (a new incarnation, same address).
    wire.inject(
        "a", GossipOnly(**hdr("d"), updates=[Alive(node="d", incarnation=1, addr=addr_of("d"))])
    )
    assert a.port_checked(wire.now, old, refused=True) == STALE
    # It moved (another address).
    moved = Alive(node="e", incarnation=1, addr="tcp://e2:7946")
    wire.inject("a", GossipOnly(**hdr("e"), updates=[moved]))
    assert a.port_checked(wire.now, PortCheck("e", addr_of("e"), 1), refused=True) == STALE
    # It is no longer live; an unknown member.
    first = PortCheck("f", addr_of("f"), 0)
    assert a.port_checked(wire.now, first, refused=True) == DEAD
    assert a.port_checked(wire.now, first, refused=True) == STALE
    assert a.port_checked(wire.now, PortCheck("zz", "tcp://zz:1", 0), refused=True) == STALE
    assert a.table.members["d"].state is State.ALIVE
    assert a.table.members["e"].state is State.ALIVE


def test_a_member_declared_dead_while_alive_refutes() -> None:
    """rule 4: a false refusal (a firewall's RST) costs a flap, not the member."""
    wire = Wire(NAMES, seed=3)
    wire.run_until(2.0)
    a = wire.nodes["a"]
    assert a.port_checked(2.0, PortCheck("d", addr_of("d"), 0), refused=True) == DEAD
    wire.flush_all()
    wire.run_until(
        8.0,
        stop=lambda: all(
            s.table.members["d"].state is State.ALIVE and s.table.members["d"].incarnation >= 1
            for n, s in wire.nodes.items()
            if n != "d"
        ),
    )
    assert wire.now < 4.0, "d heard of its death and refuted within a couple of rounds"
    assert wire.nodes["d"].table.incarnation >= 1


def test_the_budget_bounds_declarations_and_refills() -> None:
    """rule 5: refusal_burst at once, then one per refusal_refill_s."""
    config = SwimConfig.sim(refusal_burst=2, refusal_refill_s=4.0)
    wire = Wire(NAMES, config=config, seed=3)
    wire.run_until(2.0)
    a = wire.nodes["a"]
    verdicts = [
        a.port_checked(2.0, PortCheck(n, addr_of(n), 0), refused=True) for n in ["b", "c", "d"]
    ]
    assert verdicts == [DEAD, DEAD, OVER_BUDGET]
    assert a.table.members["d"].state is State.ALIVE
    assert a.port_checked(5.9, PortCheck("d", addr_of("d"), 0), refused=True) == OVER_BUDGET
    assert a.port_checked(6.0, PortCheck("d", addr_of("d"), 0), refused=True) == DEAD
    assert a.refusals.verdicts == {ACCEPTED: 0, DEAD: 3, STALE: 0, OVER_BUDGET: 2}


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=3.0), min_size=1, max_size=40),
    burst=st.integers(min_value=1, max_value=4),
    refill_s=st.floats(min_value=0.5, max_value=10.0),
)
def test_declarations_never_exceed_the_budget_in_any_window(
    gaps: list[float], burst: int, refill_s: float
) -> None:
    """rule 5 as a property: in any window [t0, t1], dead verdicts <= burst + (t1 - t0) / refill."""
    names = [f"m{i:02d}" for i in range(len(gaps) + 1)]
    config = SwimConfig.sim(refusal_burst=burst, refusal_refill_s=refill_s)
    wire = Wire(names, config=config, seed=1)
    me = wire.nodes["m00"]
    at, dead_at = 1.0, []
    for gap, name in zip(gaps, names[1:], strict=True):
        at += gap
        if me.port_checked(at, PortCheck(name, addr_of(name), 0), refused=True) == DEAD:
            dead_at.append(at)
            assert me.table.members[name].state is State.DEAD
        else:
            assert me.table.members[name].state is State.ALIVE
    for i, t0 in enumerate(dead_at):
        for j in range(i, len(dead_at)):
            assert j - i + 1 <= burst + (dead_at[j] - t0) / refill_s + 1e-9


# -- portcheck.py (the IO half): real sockets ---------------------------------------------


def test_tcp_target_takes_only_checkable_tcp_endpoints() -> None:
    assert tcp_target("tcp://127.0.0.1:7946") == ("127.0.0.1", 7946)
    assert tcp_target("tcp://[::1]:7946") == ("::1", 7946)
    assert tcp_target("tcp://gpu-07.example:7946") == ("gpu-07.example", 7946)
    for bad in (
        "ipc:///tmp/x",
        "tcp://0.0.0.0:7946",
        "tcp://*:7946",
        "tcp://[::]:1",
        "tcp://h:port",
        "tcp://h:0",
        "tcp://h",
        "inproc://x",
    ):
        assert tcp_target(bad) is None, bad


def test_connection_refused_only_when_nothing_listens() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # never accepted: a stalled process's socket looks like this
    port = listener.getsockname()[1]
    try:
        assert asyncio.run(connection_refused(f"tcp://127.0.0.1:{port}", 1.0)) is False
        assert asyncio.run(connection_refused(f"tcp://127.0.0.1:{port}", 1.0)) is False
    finally:
        listener.close()
    assert asyncio.run(connection_refused(f"tcp://127.0.0.1:{port}", 1.0)) is True
    assert asyncio.run(connection_refused("tcp://0.0.0.0:1", 1.0)) is False
    assert asyncio.run(connection_refused("tcp://no-such-host.invalid:1", 1.0)) is False
