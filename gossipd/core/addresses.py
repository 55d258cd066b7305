"""Which member serves an address: the one whose key a connection to it must prove.

Under CURVE a daemon connecting to an address (a member's gossip or rpc address) asks the
server there to prove the key of the member at that address (security.py).  Members say
their own addresses in gossip, and any member may claim any address.  Rules:

1. An address belongs to the member that claims it (its gossip ``addr`` or its GpuState's
   ``rpc``), live members (alive, suspect) before dead and left ones: a restarted host's new
   member takes its address from the dead entry of its old one.
2. An address that two members claim at the same rank (two live ones, or no live one and two
   dead) belongs to nobody: no connection proves a key there.  Before, the first claimant
   in the table won, so a member that gossiped another member's address as its own had
   the traffic meant for that member sent to it, over a connection keyed with its own key,
   and its replies taken as the other member's.  Now the claim costs the claimed member its
   connections (a member can refuse service anyway) and wins the claimant nothing.

The index is rebuilt only when the table's ``addresses_version`` moves (a join, a liveness
flip, a member gone, an address or rpc address changed; not every Meta, which at 10,000
members come by the thousand a second): a lookup is then a dict read, and a rebuild (about
5 ms at 10,000 members) follows the membership's changes, not its load news.
"""

from __future__ import annotations

from collections.abc import Iterable

from gossipd.core.membership import LIVE_STATES, Member

AMBIGUOUS = ""  # an address claimed by two members at the same rank (rule 2)


def index_addresses(members: Iterable[Member]) -> dict[str, str]:
    """Each claimed address -> its member's node, or AMBIGUOUS."""
    ranked: dict[str, tuple[bool, str]] = {}  # address -> (claimed by a live member, node)
    for member in members:
        live = member.state in LIVE_STATES
        gpu = member.gpu
        for addr in (member.addr, gpu.rpc if gpu is not None else ""):
            if not addr:
                continue
            held = ranked.get(addr)
            if held is None or (live and not held[0]):
                ranked[addr] = (live, member.node)
            elif held[0] == live and held[1] != member.node:
                ranked[addr] = (live, AMBIGUOUS)
    return {addr: node for addr, (_, node) in ranked.items()}


class AddressIndex:
    """``index_addresses`` of a table, rebuilt when its version moves."""

    def __init__(self) -> None:
        self._version: object = None
        self._index: dict[str, str] = {}
        self.ambiguous = 0  # addresses claimed twice, at the last rebuild

    def lookup(self, members: dict[str, Member], version: object, addr: str) -> str | None:
        """The node at ``addr`` (None: nobody claims it); AMBIGUOUS: claimed twice."""
        if version != self._version:
            self._index = index_addresses(members.values())
            self._version = version
            self.ambiguous = sum(1 for node in self._index.values() if node == AMBIGUOUS)
        return self._index.get(addr)
