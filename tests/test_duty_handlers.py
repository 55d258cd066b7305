"""The member side of the leader's duties, without etcd: what a daemon does with a `drain`
order (only its own, only one issued after it started, leave/restart only once drained) and
with a `forget` directive (bad bodies refused and counted)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gossipd.core.gossip_messages import Alive, Dead
from gossipd.core.membership import MemberTable
from gossipd.leader.builtin import BuiltinDuties
from gossipd.leader.reaping import FORGET
from gossipd.leader.rollout import DRAIN, EXIT_RESTART

ADDR = "tcp://127.0.0.1:1"


class FakeAdmin:
    def __init__(self) -> None:
        self.drained = False

    def set_drained(self, drain: bool) -> tuple[bool, str]:
        was, self.drained = self.drained, drain
        return True, "already draining" if was else "draining: ..."

    def status(self) -> str:
        return "draining" if self.drained else "serving"


class FakeLeadership:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.handlers: dict[str, Any] = {}
        self.duties = SimpleNamespace(register=lambda name, duty: self.names.append(name))
        self.directives = SimpleNamespace(
            subscribe=self.handlers.__setitem__, bad_body=0, handler_errors=0
        )


def build() -> tuple[BuiltinDuties, FakeLeadership, FakeAdmin, list[int], MemberTable]:
    table = MemberTable(me="me", addr=ADDR, now=0.0)
    gossip = SimpleNamespace(
        # (SwimNode.forget's event for a suspect is tests/test_reaping.py's: here the table's)
        core=SimpleNamespace(table=table, forget=table.forget),
        live_members=list,
        load=lambda: 0,
        now=lambda: 10.0,
    )
    config = SimpleNamespace(
        membership=SimpleNamespace(dead_reap_after_s=1.0), gossip=SimpleNamespace(seeds=[])
    )
    leadership, admin, stops = FakeLeadership(), FakeAdmin(), []
    duties = BuiltinDuties(
        config,  # type: ignore[arg-type]
        node="me",
        leadership=leadership,
        gossip=gossip,  # type: ignore[arg-type]
        admin=admin,  # type: ignore[arg-type]
        stop=stops.append,
    )
    duties.rollout._started_wall_s = 100.0
    return duties, leadership, admin, stops, table


def order(action: str, node: str = "me", at: float = 150.0) -> dict[str, Any]:
    return {"plan": "p", "node": node, "action": action, "issued_wall_s": at}


def test_the_duties_and_handlers_are_registered() -> None:
    _, leadership, *_ = build()
    assert leadership.names == ["seeds", "reaping", "rollout"]
    assert set(leadership.handlers) == {FORGET, DRAIN}


def test_a_drain_order_is_obeyed_only_by_its_member_and_only_in_this_life() -> None:
    duties, leadership, admin, stops, _ = build()
    on = leadership.handlers[DRAIN]
    on(None, order("drain", node="other"))
    on(None, order("restart", at=99.0))  # the previous life's order
    on(None, order("drain", at=99.0))
    assert not admin.drained and stops == []
    on(None, order("restart"))  # not drained: refused
    assert stops == []
    on(None, order("drain"))
    assert admin.drained
    on(None, order("restart"))
    on(None, order("restart"))  # once is enough
    assert stops == [EXIT_RESTART]
    on(None, {"plan": "p"})  # a body that is not an order
    st = duties.statistics()
    assert st["drain_orders"] == {"drain": 1, "restart": 1}
    assert st["refused"] == {"bad_body": 1, "before_start": 2, "not_drained": 1}


def test_a_leave_order_exits_0() -> None:
    _, leadership, admin, stops, _ = build()
    leadership.handlers[DRAIN](None, order("drain"))
    leadership.handlers[DRAIN](None, order("leave"))
    assert admin.drained and stops == [0]


def test_a_forget_directive_drops_the_named_dead_and_counts_bad_bodies() -> None:
    duties, leadership, _, _, table = build()
    table.apply(Alive(node="x", incarnation=2, addr=ADDR), 0.0)
    table.apply(Dead(node="x", incarnation=2, by="me"), 0.0)
    table.apply(Alive(node="y", incarnation=0, addr=ADDR), 0.0)
    on = leadership.handlers[FORGET]
    on(None, {"members": [["x", 2], ["y", 0]]})
    assert set(table.members) == {"y"}
    on(None, {"members": "x"})
    on(None, None)
    st = duties.statistics()
    assert st["forgotten"] == 1 and st["refused"]["bad_body"] == 2
    leadership.directives.bad_body = 3  # bodies that were no msgpack: the same label
    assert duties.statistics()["refused"]["bad_body"] == 5


def test_a_directive_body_nested_deeper_than_the_stack_is_a_bad_body_not_a_crash() -> None:
    """A body within the 64 KiB bound can nest 65,000 arrays deep: msgspec raises
    RecursionError, not DecodeError, and it escaped the gossip task (the daemon exited)."""
    from gossipd.core.gossip_messages import Directive
    from gossipd.leader.directives import Directives

    directives = Directives()
    handled: list[object] = []
    directives.subscribe("forget", lambda directive, body: handled.append(body))
    deep = Directive(leader="x", token=2**63 - 1, seq=0, kind="forget",
                     body=b"\x91" * 65_000 + b"\xc0")  # fmt: skip
    directives.deliver(deep)
    directives.deliver(Directive(leader="x", token=1, seq=1, kind="forget", body=b"\x90"))
    assert directives.bad_body == 1 and handled == [[]]
