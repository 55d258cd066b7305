"""What the core Placer (core/placer.py) cannot read for itself, fed from the daemon's IO:
each membership event with the member's entry from the gossip table, and the ring's compiled
kernels, loaded in a thread."""

from __future__ import annotations

import threading

from gossipd.core import hrw
from gossipd.core.membership import MemberEvent
from gossipd.core.placer import Placer
from gossipd.membership.gossip import GossipService


class PlacementFeed:
    """Hands the placer every membership event with the member as the table now holds it."""

    def __init__(self, placer: Placer, gossip: GossipService) -> None:
        self._placer = placer
        self._gossip = gossip
        gossip.listeners.append(self.member_event)

    def member_event(self, event: MemberEvent) -> None:
        core = self._gossip.core
        member = None if core is None else core.table.members.get(event.node)
        self._placer.member_event(event, member)


class KernelLoader:
    """``kernels(n)`` for the Placer: True once the ring's compiled kernels are loaded in this
    process; the first call starts loading them in a thread (seconds the first time on a
    host: not on the event loop).  Rings built meanwhile use NumPy (the same owners)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def __call__(self, members: int) -> bool:
        if hrw.loaded():
            return True
        if self._thread is None:
            self._thread = threading.Thread(
                target=hrw.load, name="gossipd-ring-kernels", daemon=True
            )
            self._thread.start()
        return False
