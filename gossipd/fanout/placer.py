"""Placement as one entry point sees the cluster: which member should run a task.

The pure rules live in ``core/`` (the ring, bounded loads, prefix summaries); this module
feeds them this daemon's view: the serving members and their weights from gossip, the loads
this entry point has put on each (what it forwarded and has not seen finish, and what it kept),
engine saturation from gossiped engine load, and the prefixes members hold.  The forwarding
itself (sending, acks, retries, migration) is ``core/forwarder.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossipd.config import FanoutConfig
from gossipd.core.messages import GpuState, Task
from gossipd.core.placement import Candidate, bound, place
from gossipd.core.prefix import PrefixIndex, PrefixRecord, prefix_hashes, prefix_key
from gossipd.core.ring import Ring
from gossipd.ingress.service import Ingress
from gossipd.membership.gossip import GossipService


@dataclass(slots=True)
class View:
    key: object
    ring: Ring | None
    weights: dict[str, float]
    addrs: dict[str, str]
    saturated: frozenset[str]  # members whose engine is saturated (gossiped engine load)

    @property
    def total_weight(self) -> float:
        return sum(self.weights.values())


class Placer:
    """Chooses the member for each task; keeps the loads this entry point counts."""

    def __init__(
        self,
        config: FanoutConfig,
        *,
        node: str,
        ingress: Ingress,
        gossip: GossipService,
        loads: dict[str, int],
        local_ids: set[str],
    ) -> None:
        self.config = config
        self.node = node
        self._ingress = ingress
        self._gossip = gossip
        # Kept up to date by the forwarder (core/forwarder.py): per member, our forwarded
        # tasks not done yet; and the tasks from our intake that run here, unfinished.
        self.outstanding = loads
        self.local_ids = local_ids
        self.draining = False
        self.prefix_hits = 0  # keyless tasks placed on a member that holds their prefix
        # Prefix affinity (policy "prefix"): what we ran, and who holds which prefix.
        self.prefix_record = PrefixRecord()
        self.prefix_index = PrefixIndex()
        self._round_robin = 0
        self._cached_view: View | None = None

    def addr(self, member: str) -> str | None:
        """The member's rpc address, if it is a live member."""
        return self.view().addrs.get(member)

    def candidates(self) -> dict[str, Candidate]:
        out: dict[str, Candidate] = {}
        for m in self._gossip.live_members():
            gpu = m.gpu
            # Suspects stay candidates: most are alive and refute; a dead one fails its
            # forward and the next member takes the task.
            if gpu is None or not gpu.rpc:
                continue
            # Bounded loads compare loads measured one way: what this entry point has sent each
            # member and not yet seen finish (HAProxy's approach).  The gossiped in-flight count
            # is older and counts other entry points' work; it is exported, not mixed in here.
            load = self.outstanding.get(m.node, 0)
            out[m.node] = Candidate(
                m.node,
                load=load,
                weight=gpu.capacity_weight or 1.0,
                status=gpu.status,
                models=frozenset({gpu.model}) if gpu.model else frozenset(),
                saturated=self._saturated(gpu),
            )
        # Our own load as this entry point sees it: the tasks we kept from our own intake, so
        # that every load in the comparison is measured the same way (HAProxy's approach).
        own_model = self._ingress.model
        out[self.node] = Candidate(
            self.node,
            saturated=self._own_saturated(),
            models=frozenset({own_model}) if own_model else frozenset(),
            load=len(self.local_ids),
            weight=self._gossip.config.gpu.capacity_weight,
            status=self._own_status(),
        )
        return out

    def _saturated(self, gpu: GpuState) -> bool:
        """Is this engine load (gossiped, or our own latest sample) saturated?"""
        cfg = self.config
        return (
            gpu.waiting_requests >= cfg.engine_waiting_saturated
            or gpu.kv_cache_usage_ratio >= cfg.engine_kv_cache_saturated_ratio
        )

    def _own_saturated(self) -> bool:
        own = self._gossip.last_gpu_state
        return own is not None and self._saturated(own)

    def _own_status(self) -> str:
        shutting_down = self.draining or self._ingress.admission.shutting_down
        return "draining" if shutting_down else "serving"

    def order(self, task: Task, exclude: frozenset[str] = frozenset(), key: str = "") -> list[str]:
        cands = {n: c for n, c in self.candidates().items() if n not in exclude}
        # The view's ring is the serving set's; place() builds another only when the candidates
        # differ (an exclusion, a model filter).
        return place(
            key or task.key or task.id,
            cands,
            ring=self.view().ring,
            c=self.config.load_bound_c,
            floor=self.config.load_floor,
            model=task.model,
        )

    def view(self) -> View:
        """Serving members, their ring, weights and rpc addresses; rebuilt only when the
        member table or our own status changes, not per task."""
        core = self._gossip.core
        assert core is not None
        key = (core.table.version, self._own_status(), self._own_saturated())
        if self._cached_view is None or self._cached_view.key != key:
            cands = self.candidates()
            serving = {n: c for n, c in cands.items() if c.status == "serving"}
            addrs = {
                m.node: m.gpu.rpc
                for m in self._gossip.live_members()
                if m.gpu is not None and m.gpu.rpc
            }
            self.prefix_index.set_summaries(
                {
                    m.node: m.gpu.prefixes
                    for m in self._gossip.live_members()
                    if m.gpu is not None and m.gpu.prefixes
                }
            )
            self._cached_view = View(
                key,
                Ring({n: c.weight for n, c in serving.items()}) if serving else None,
                {n: c.weight for n, c in serving.items()},
                addrs,
                frozenset(n for n, c in serving.items() if c.saturated),
            )
        return self._cached_view

    def load(self, member: str) -> int:
        return len(self.local_ids) if member == self.node else self.outstanding.get(member, 0)

    def owner_for(self, task: Task) -> str | None:
        """The member that should run ``task`` (maybe this node); None when no live member
        serves the model it names.  The common case costs one ring lookup (cached for
        repeated keys) and one bound check; the full preference order is computed only when
        the owner is over its bound."""
        view = self.view()
        ring = view.ring
        if task.model:
            # Only members serving the named model qualify: the full placement, not the ring.
            order = self.order(task)
            if not order:
                return None
            owner = order[0]
        elif ring is None or (len(ring) == 1 and ring.members[0] == self.node):
            owner = self.node
        elif self.config.policy == "round_robin":
            self._round_robin = (self._round_robin + 1) % len(ring.members)
            owner = ring.members[self._round_robin]
        elif self.config.policy == "prefix" and not task.key:
            owner = self.place_by_prefix(task, view, ring)
        else:
            owner = ring.owner(task.key or task.id)
            if not self.free(owner, view, self.total_load()):
                order = self.order(task)
                owner = order[0] if order else self.node
        return owner

    def total_load(self) -> int:
        """In-flight tasks this entry point counts against all members (bounded loads)."""
        return sum(self.outstanding.values()) + len(self.local_ids)

    def free(self, member: str, view: View, total: int) -> bool:
        """May ``member`` take one more task: its engine is not saturated and it is under its
        bounded-load ceiling for ``total`` (see core/placement.py)."""
        if member in view.saturated:
            return False
        cfg = self.config
        ceiling = bound(
            total, view.weights[member], view.total_weight, cfg.load_bound_c, cfg.load_floor
        )
        return self.load(member) < ceiling

    def place_by_prefix(self, task: Task, view: View, ring: Ring) -> str:
        """A keyless task: the member holding the longest known prefix of its prompt, under
        its load bound; else the ring owner of its first block (see core/prefix.py)."""
        cfg = self.config
        hashes = prefix_hashes(task.prompt, cfg.prefix_block_chars, cfg.prefix_blocks_max)
        key = prefix_key(hashes) if hashes else task.id  # shorter than a block: by its id
        total = self.total_load()
        ring_order: list[str] = []  # the key's full ring order, computed only if needed
        owner = ""
        for _depth, members in self.prefix_index.holders(hashes):
            held = [m for m in members if m in view.weights]
            if len(held) > 1:
                ring_order = ring_order or ring.successors(key)
                held.sort(key=ring_order.index)
            owner = next((m for m in held if self.free(m, view, total)), "")
            if owner:
                self.prefix_hits += 1
                break
        if not owner:
            owner = ring.owner(key)
            if not self.free(owner, view, total):
                order = self.order(task, key=key)
                owner = order[0] if order else self.node
        if hashes:
            self.prefix_index.placed(hashes, owner)
        return owner

    def record_prefix(self, task: Task) -> None:
        """Admitted here: count its prefix blocks for the summary we gossip."""
        cfg = self.config
        if cfg.policy == "prefix" and not task.key:
            self.prefix_record.add(
                prefix_hashes(task.prompt, cfg.prefix_block_chars, cfg.prefix_blocks_max)
            )

    def prefix_summary(self) -> list[int]:
        return self.prefix_record.summary(self.config.prefix_summary_max)
