"""core/addresses.py: which member an address belongs to, the key a connection there must
prove.  A property against the rules written out plainly, and the gossip service's lookup."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.addresses import AMBIGUOUS, AddressIndex, index_addresses
from gossipd.core.gossip_messages import Alive, Dead, GpuState, Meta
from gossipd.core.membership import LIVE_STATES, Member, MemberTable, State

_ADDRS = [f"tcp://10.0.0.{i}:7000" for i in range(4)]
_members = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.sampled_from(_ADDRS),
        st.one_of(st.none(), st.sampled_from(_ADDRS)),
        st.sampled_from(list(State)),
    ),
    max_size=8,
    unique_by=lambda m: m[0],
)


def _member(node: str, addr: str, rpc: str | None, state: State) -> Member:
    gpu = None if rpc is None else GpuState(rpc=rpc)
    return Member(node=node, addr=addr, incarnation=1, state=state, state_since=0.0, gpu=gpu)


@given(_members)
def test_an_address_is_its_claimants_live_ones_first_and_nobodys_when_two_tie(
    rows: list[tuple[str, str, str | None, State]],
) -> None:
    members = [_member(*row) for row in rows]
    index = index_addresses(members)
    for addr in _ADDRS:
        claims = {
            m.node: m.state in LIVE_STATES for m in members if addr in (m.addr, m.gpu and m.gpu.rpc)
        }
        live = {node for node, is_live in claims.items() if is_live}
        rank = live or set(claims)
        if not rank:
            assert addr not in index
        elif len(rank) == 1:
            assert index[addr] == next(iter(rank))
        else:
            assert index[addr] == AMBIGUOUS


def test_a_forger_that_gives_its_own_address_to_another_member_gets_nobodys_traffic() -> None:
    """Member m gossips Meta(b, rpc = m's address).  The first claimant in the table won
    before: b's Forwards went to m, keyed with m's key, and m answered as b.  Now the address
    is nobody's (no connection proves a key there) until the claim goes."""
    m = _member("m", "tcp://10.0.0.1:7946", "tcp://10.0.0.1:7950", State.ALIVE)
    b = _member("b", "tcp://10.0.0.2:7946", "tcp://10.0.0.1:7950", State.ALIVE)  # forged rpc
    index = AddressIndex()
    members = {"m": m, "b": b}
    assert index.lookup(members, 1, "tcp://10.0.0.1:7950") == AMBIGUOUS
    assert index.lookup(members, 1, "tcp://10.0.0.2:7946") == "b" and index.ambiguous == 1
    b.gpu = GpuState(rpc="tcp://10.0.0.2:7950")  # b's own Meta wins again
    assert index.lookup(members, 1, "tcp://10.0.0.1:7950") == AMBIGUOUS  # (cached: version 1)
    assert index.lookup(members, 2, "tcp://10.0.0.1:7950") == "m" and index.ambiguous == 0


def test_a_restarted_hosts_new_member_takes_the_address_of_its_dead_one() -> None:
    old = _member("old", "tcp://10.0.0.3:7946", None, State.DEAD)
    new = _member("new", "tcp://10.0.0.3:7946", None, State.ALIVE)
    gone = _member("gone", "tcp://10.0.0.4:7946", None, State.LEFT)
    again = _member("again", "tcp://10.0.0.4:7946", None, State.DEAD)
    index = index_addresses([old, new, gone, again])
    assert index["tcp://10.0.0.3:7946"] == "new"
    assert index["tcp://10.0.0.4:7946"] == AMBIGUOUS  # (two dead ones: nobody's)


def test_the_tables_addresses_version_moves_with_addresses_not_with_load_news() -> None:
    """The index follows MemberTable.addresses_version: a Meta that changes only load moves
    the table's version (thousands a second at 10,000 members: the index was rebuilt for
    nearly every lookup, 5 ms each) but not its addresses_version; a new rpc address, a
    moved member, a join and a death do."""
    t = MemberTable(me="me", addr="tcp://10.0.0.9:7946", now=0.0)
    t.apply(Alive(node="x", incarnation=1, addr="tcp://10.0.0.1:7946"), 0.0)
    seen = t.addresses_version
    t.apply(Meta(node="x", version=1, gpu=GpuState(rpc="tcp://10.0.0.1:7950")), 1.0)
    assert t.addresses_version != seen  # an rpc address
    seen, loads = t.addresses_version, t.version
    t.apply(
        Meta(node="x", version=2, gpu=GpuState(rpc="tcp://10.0.0.1:7950", running_requests=3)), 2.0
    )
    assert t.version != loads and t.addresses_version == seen  # load news only
    t.apply(Alive(node="x", incarnation=2, addr="tcp://10.0.0.2:7946"), 3.0)
    assert t.addresses_version != seen  # moved
    seen = t.addresses_version
    t.apply(Alive(node="y", incarnation=1, addr="tcp://10.0.0.3:7946"), 4.0)
    assert t.addresses_version != seen  # a join
    seen = t.addresses_version
    t.apply(Dead(node="y", incarnation=1, by="me"), 5.0)
    assert t.addresses_version != seen  # no longer live: its address ranks lower
