"""Placement as one entry point sees the cluster: which member should run a task (sans-IO).

The pure rules are ``core/ring.py`` (the ring and bounded loads) and
``core/prefix.py``; this is the state they are applied to, kept from this daemon's inputs:
- membership events, each with the member's entry as it now stands (``member_event``): the
  serving members, their weights, models, rpc addresses, engine saturation and prefixes;
- members' load records (``on_load``: owners' replies, load gossip);
- our own state: serving or drained (``set_draining``), our engine's latest sample (read
  through ``own_sample``, at most every ``own_sample_every_s``), our weight and model (constructor);
- the loads this entry point has put on each member (``loads``/``local_ids``, kept by the
  forwarder, and their sum kept as they change when ``loads`` is a ``LoadCounts``);
- ``now``, passed to every decision (the age of a load record decides the owner check).
The daemon (``fanout/placement_feed.py`` feeds it) and the simulator drive this same class.
The forwarding itself (sending, acks, retries, migration) is ``core/forwarder.py``.

Costs per task do not grow with the cluster (issue 17; ``gossipd bench place``):
- the view is kept up to date member by member from membership events: a member's new GPU
  state (Meta) costs O(its own size); the ring is rebuilt only when the serving set or a
  weight changes, never for a load;
- the sums bounded loads need are O(1): in-flight tasks kept as the forwarder counts them
  (``LoadCounts.total``: no call back into the forwarder), serving weight a running total;
- a new key is scored against every member in one pass (``Ring``: compiled kernels from 64
  members on, once ``kernels(n)`` says they are loaded; NumPy before), a repeated key is a
  cache hit; ``order()`` (retries, migration, hand-off) is a partial selection of the first
  ``attempts_max`` members, not a sort of all; prefix holders are ranked among themselves.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gossipd.core import ring as rings
from gossipd.core.gossip_messages import CAPACITY_WEIGHT_MIN, LoadRecord
from gossipd.core.loadstate import LoadView
from gossipd.core.membership import LIVE_STATES, Member, MemberEvent
from gossipd.core.messages import Task, prefix_text
from gossipd.core.prefix import PrefixIndex, PrefixRecord, prefix_hashes, prefix_key
from gossipd.core.releases import NEWEST_PARAMS_VERSION, release_of
from gossipd.core.ring import Candidate, LoadCounts, Ring, bound, key_hash
from gossipd.core.sampling import release_asked


class PlacerConfig(Protocol):
    """The settings placement reads (``FanoutConfig`` has them all)."""

    @property
    def policy(self) -> str: ...
    @property
    def load_bound_c(self) -> float: ...
    @property
    def load_floor(self) -> int: ...
    @property
    def attempts_max(self) -> int: ...
    @property
    def owner_check(self) -> bool: ...
    @property
    def load_trust_s(self) -> float: ...
    @property
    def engine_waiting_saturated(self) -> int: ...
    @property
    def engine_kv_cache_saturated_ratio(self) -> float: ...
    @property
    def prefix_block_chars(self) -> int: ...
    @property
    def prefix_blocks_max(self) -> int: ...
    @property
    def prefix_summary_max(self) -> int: ...


class EngineSample(Protocol):
    """An engine's load as placement judges it (a gossiped GpuState or EngineStats)."""

    @property
    def waiting_requests(self) -> int: ...
    @property
    def kv_cache_usage_ratio(self) -> float: ...
    @property
    def queued_tokens(self) -> int: ...


def record_saturated(record: LoadRecord, config: PlacerConfig) -> bool:
    """Does this load record say its member's engine is saturated (passed over while
    another is not)?  The one rule, also for the load-freshness simulator."""
    return (
        record.waiting >= config.engine_waiting_saturated
        or record.kv_pct / 100.0 >= config.engine_kv_cache_saturated_ratio
    )


def _numpy_only(members: int) -> bool:
    return False


HOLDER_RANKS_MAX = 4096  # prefix holder rankings remembered (then forgotten all at once)


@dataclass(slots=True)
class View:
    ring: Ring | None
    weights: dict[str, float]  # serving members (us included while we serve)
    addrs: dict[str, str]  # live members with an rpc address
    saturated: set[str]  # members whose engine is saturated (gossiped engine load)
    total_weight: float = 0.0


@dataclass(slots=True)
class _Info:
    """What placement needs of one live member's GPU state."""

    weight: float
    serving: bool
    model: str
    saturated: bool
    rpc: str
    release: str = ""  # its software_version (which peer messages it understands)


STATE_AGE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class StateAges:
    """How old the owner's load state was at each placement decision (fixed buckets)."""

    __slots__ = ("count", "counts", "owner_checked", "sum_s", "unknown")

    def __init__(self) -> None:
        self.counts = [0] * (len(STATE_AGE_BUCKETS_S) + 1)
        self.count = 0
        self.sum_s = 0.0
        self.unknown = 0  # decisions on a member of which we had no load record (Meta only)
        # Decisions whose owner checks its own load as the Forward reaches it (if_free: the
        # state used is one one-way hop old), having passed no member over on a record.
        self.owner_checked = 0

    def observe(self, age_s: float) -> None:
        self.counts[bisect.bisect_left(STATE_AGE_BUCKETS_S, age_s)] += 1
        self.count += 1
        self.sum_s += age_s

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for le, n in zip((*map(str, STATE_AGE_BUCKETS_S), "+Inf"), self.counts, strict=True):
            running += n
            out.append((le, running))
        return out


class Placer:
    """Chooses the member for each task; keeps the loads this entry point counts."""

    def __init__(
        self,
        config: PlacerConfig,
        *,
        node: str,
        loads: dict[str, int],
        local_ids: set[str],
        weight: float = 1.0,
        model: str = "",
        own_sample: Callable[[], EngineSample | None] | None = None,
        own_sample_every_s: float = 0.0,
        kernels: Callable[[int], bool] = _numpy_only,
    ) -> None:
        self.config = config
        # Members' load records (owners' replies, load gossip; core/loadstate.py): once a
        # member has one, its engine saturation is read from its newest record, not from
        # its Meta; and the age of the owner's state each decision used is recorded.
        self.load_view = LoadView()
        self.state_ages = StateAges()
        self.node = node
        # Kept up to date by the forwarder (core/forwarder.py): per member, our forwarded
        # tasks not done yet; and the tasks from our intake that run here, unfinished.
        self.outstanding = loads
        self.local_ids = local_ids
        self.draining = False  # set_draining: while drained or stopping, no task stays here
        self.prefix_hits = 0  # keyless tasks placed on a member that holds their prefix
        # Prefix affinity (policy "prefix"): what we ran, and who holds which prefix.
        self.prefix_record = PrefixRecord()
        self.prefix_index = PrefixIndex()
        self._round_robin = 0
        self._info: dict[str, _Info] = {}
        self._view = View(None, {}, {}, set())
        self._ring_stale = True
        # Whether the ring is scored by compiled kernels: ``kernels(n)`` says if they are
        # there for n members (the shell loads them in a thread: seconds the first time);
        # a ring built without them is rebuilt once they are (the same owners either way).
        self._kernels = kernels
        self._awaiting_kernels = False
        self._weight = float(weight)
        self._model = model
        self._own: tuple[bool, bool] | None = None  # (serving, saturated) as last set
        # Our engine's own figures (``Engine.stats``: vLLM's change with each scheduler
        # step), read at most every ``own_sample_every_s`` by the decisions' ``now`` (5 ms
        # in the daemon: a burst of Forwards costs one reading), and judged once per
        # sample (a new object each time), so that a decision on ourselves uses our
        # current load, not gossip's 1 s sample.  None: none.
        self.own_sample = own_sample
        self.own_sample_every_s = own_sample_every_s
        self.own_reads = 0
        self._own_read_at = float("-inf")
        self._own_latest: EngineSample | None = None
        self._own_gpu: EngineSample | None = None
        self._own_gpu_saturated = False
        # The oldest record (or our own reading: 0) a member was passed over on as saturated
        # in the decision being made; -1: none (fanout.owner_check).
        self._passed_age_s = -1.0
        self._now = 0.0  # the decision being made's ``now``
        self._by_model: dict[str, set[str]] = {}  # model -> serving members naming it
        # Serving members of a release before NEWEST_PARAMS_VERSION (a rolling upgrade), and
        # their release ((0, 0, 0): unreadable): a task asking params a member's release does
        # not read is not placed on it (sampling.release_asked).  The lowest of them: a task
        # every one of them reads is placed as any (the ring, prefixes).
        self._older: dict[str, tuple[int, int, int]] = {}
        self._older_floor = NEWEST_PARAMS_VERSION
        # (prefix key, its holders) -> the serving holders in their order (place_by_prefix)
        self._holder_rank: dict[tuple[str, frozenset[str]], list[str]] = {}

    def set_draining(self, draining: bool) -> None:
        """Drained (an operator's Drain, or stopping): place every task on another member."""
        self.draining = draining

    def member_event(self, event: MemberEvent, member: Member | None) -> None:
        """A membership event, with the member's entry as it now stands (None: not in the
        table): its placement entry follows at once."""
        if event.kind in ("dead", "left"):
            self.load_view.forget(event.node)
        if event.node != self.node:
            self._refresh(event.node, member)

    def rebuild(self, members: Iterable[Member]) -> None:
        """Every member read again (no events to say which changed: at first, or in tests)."""
        for name in list(self._info):
            if name != self.node:
                self._drop(name)
        for m in members:
            if m.node != self.node:
                self._refresh(m.node, m)

    def on_load(self, record: LoadRecord, now: float) -> bool:
        """A member's load record (an owner's reply, load gossip): kept if newer than what
        we hold; the member's saturation follows it at once.  True if it was newer.  Only a
        member placement knows: records of other names (anyone's, without CURVE) would fill
        the view's bound for good, and a new member's next record comes within a load
        interval of its joining."""
        node = record.node
        if node == self.node or node not in self._info or self.load_view.offer(record, now) is None:
            return False
        if self._record_saturated(record):
            self._view.saturated.add(node)
        else:
            self._view.saturated.discard(node)
        return True

    def _record_saturated(self, record: LoadRecord) -> bool:
        return record_saturated(record, self.config)

    def _passed_over(self, member: str, saturated: set[str]) -> bool:
        """Is ``member`` passed over as saturated?  With the owner check, only on our own
        reading or on a record at most ``load_trust_s`` old: otherwise the member is tried
        and checks its own load as the Forward reaches it (``if_free``)."""
        if member not in saturated:
            return False
        cfg = self.config
        if not cfg.owner_check:
            return True
        if member == self.node:
            age_s = 0.0
        else:
            known = self.load_view.get(member)
            if known is None:
                return False
            age_s = max(0.0, self._now - known.sampled_at)
            if age_s > cfg.load_trust_s:
                return False
        self._passed_age_s = max(self._passed_age_s, age_s)
        return True

    def addr(self, member: str) -> str | None:
        """The member's rpc address, if it is a live member."""
        return self._view.addrs.get(member)

    def release(self, member: str) -> str:
        """The member's gossiped software_version ("" when unknown)."""
        info = self._info.get(member)
        return info.release if info is not None else ""

    def candidates(self) -> dict[str, Candidate]:
        """Every live member as a Candidate (O(N): for inspection and tests, not per task)."""
        view = self.view()
        out: dict[str, Candidate] = {}
        for name, info in self._info.items():
            out[name] = Candidate(
                name,
                load=self.load(name),
                weight=info.weight,
                status="serving" if info.serving else "draining",
                models=frozenset({info.model}) if info.model else frozenset(),
                saturated=name in view.saturated,
            )
        return out

    def engine_saturated(self, gpu: EngineSample) -> bool:
        """Is this engine load (gossiped, our own latest sample, or our engine's own figures:
        the owner check) saturated?"""
        cfg = self.config
        return (
            gpu.waiting_requests >= cfg.engine_waiting_saturated
            or gpu.kv_cache_usage_ratio >= cfg.engine_kv_cache_saturated_ratio
        )

    def own_engine_saturated(self, now: float) -> bool:
        """Is our engine saturated as it reads ``now`` (the owner check of a Forward that
        asks if_free)?  Never, without ``own_sample``."""
        # Read and judged here, in one call: up to twice a task (view()); own_now() too.
        own_sample = self.own_sample
        if own_sample is None:
            return False
        gpu = self._own_latest
        if gpu is None or now - self._own_read_at >= self.own_sample_every_s:
            gpu = self._own_latest = own_sample()
            self._own_read_at = now
            self.own_reads += 1
        if gpu is not self._own_gpu:  # a new object each sample: judged once, not per task
            self._own_gpu = gpu
            self._own_gpu_saturated = gpu is not None and self.engine_saturated(gpu)
        return self._own_gpu_saturated

    def own_now(self, now: float) -> EngineSample | None:
        """Our engine's figures, read at most ``own_sample_every_s`` before ``now``."""
        self.own_engine_saturated(now)  # reads them when older, judged once a sample
        return self._own_latest

    # -- the view, member by member --------------------------------------------------------

    def view(self) -> View:
        """Serving members, their ring, weights and rpc addresses: each member's entry is
        kept as its events come, the ring rebuilt when the serving set or a weight changes;
        nothing is rebuilt per task or for a load."""
        # Our own entry, read on every call (up to twice a task).
        if self.own_sample is not None:
            self.own_engine_saturated(self._now)
        own = (not self.draining, self._own_gpu_saturated)
        if own != self._own:
            self._own = own
            self._set(self.node, _Info(self._weight, own[0], self._model, own[1], ""))
        view = self._view
        if self._awaiting_kernels and self._kernels(len(view.weights)):
            self._ring_stale = True
        if self._ring_stale:
            self._ring_stale = False
            weights = view.weights
            n = len(weights)
            kernels = n >= rings.KERNEL_MIN and self._kernels(n)
            # Asked again on each decision until they are there (never with NumPy only).
            self._awaiting_kernels = (
                n >= rings.KERNEL_MIN and not kernels and self._kernels is not _numpy_only
            )
            view.ring = Ring(weights, kernels=kernels) if weights else None
            self._holder_rank.clear()
        return view

    def _refresh(self, name: str, m: Member | None) -> None:
        gpu = None if m is None or m.state not in LIVE_STATES else m.gpu
        # Suspects stay candidates: most are alive and refute; a dead one fails its forward
        # and the next member takes the task.
        if gpu is None or not gpu.rpc:
            self._drop(name)
            return
        known = self.load_view.get(name)
        info = _Info(
            max(gpu.capacity_weight, CAPACITY_WEIGHT_MIN) if gpu.capacity_weight else 1.0,
            gpu.status == "serving",
            gpu.model,
            self.engine_saturated(gpu) if known is None else self._record_saturated(known.record),
            gpu.rpc,
            gpu.software_version,
        )
        self._set(name, info)
        prefixes = getattr(m, "prefixes", None)
        self.prefix_index.set_member(name, gpu.prefixes if prefixes is None else prefixes)

    def _set(self, name: str, info: _Info) -> None:
        view = self._view
        old = self._info.get(name)
        self._info[name] = info
        if info.rpc:
            view.addrs[name] = info.rpc
        if info.saturated:
            view.saturated.add(name)
        else:
            view.saturated.discard(name)
        was = view.weights.get(name) if old is not None and old.serving else None
        now = info.weight if info.serving else None
        if was != now:
            self._ring_stale = True
            if was is not None:
                del view.weights[name]
                view.total_weight -= was
            if now is not None:
                view.weights[name] = now
                view.total_weight += now
        if old is not None:
            self._by_model.get(old.model, set()).discard(name)
        if info.serving:
            self._by_model.setdefault(info.model, set()).add(name)
        release = release_of(info.release) or (0, 0, 0)
        if info.serving and name != self.node and release < NEWEST_PARAMS_VERSION:
            if self._older.get(name) != release:
                self._older[name] = release
                self._older_floor = min(self._older.values())
        elif self._older.pop(name, None) is not None:
            self._older_floor = min(self._older.values(), default=NEWEST_PARAMS_VERSION)

    def _drop(self, name: str) -> None:
        view = self._view
        old = self._info.pop(name, None)
        view.addrs.pop(name, None)
        view.saturated.discard(name)
        if name in view.weights:
            view.total_weight -= view.weights.pop(name)
            self._ring_stale = True
        if old is not None:
            self._by_model.get(old.model, set()).discard(name)
        if self._older.pop(name, None) is not None:
            self._older_floor = min(self._older.values(), default=NEWEST_PARAMS_VERSION)
        self.prefix_index.set_member(name, ())

    # -- decisions -------------------------------------------------------------------------

    def load(self, member: str) -> int:
        return len(self.local_ids) if member == self.node else self.outstanding.get(member, 0)

    def total_load(self) -> int:
        """In-flight tasks this entry point counts against all members (bounded loads)."""
        loads = self.outstanding
        total = loads.total if isinstance(loads, LoadCounts) else sum(loads.values())
        return total + len(self.local_ids)

    def free(self, member: str, view: View, total: int) -> bool:
        """May ``member`` take one more task: its engine is not saturated and it is under its
        bounded-load ceiling for ``total`` (see core/ring.py, placement)."""
        if self._passed_over(member, view.saturated):
            return False
        cfg = self.config
        ceiling = bound(
            total, view.weights[member], view.total_weight, cfg.load_bound_c, cfg.load_floor
        )
        return self.load(member) < ceiling

    def order(
        self, task: Task, now: float, exclude: frozenset[str] = frozenset(), key: str = ""
    ) -> list[str]:
        """The members to try, best first: the first in ring order under its load bound (an
        unsaturated one first), then the others in ring order; at most ``attempts_max`` of
        them (the forwarder never tries more: the forwarder's ``tried`` filter leaves at
        least as many as it has attempts left), found by partial selection.  The same
        members as ``core/ring.place`` over every serving, eligible, not excluded
        candidate, with one difference: the total load the bounds scale with counts every
        task in flight from here, also on members that stopped serving (as ``owner_for``'s
        first check always did), where place() sums the pool's alone (a pass over N)."""
        self._now = now
        view = self.view()
        ring = view.ring
        if ring is None:
            return []
        model = task.model
        ineligible: set[str] = set()
        if model and not self._all_serve(model, view):
            # Members naming no model serve any; the others only theirs.  Only a mixed
            # cluster pays for the set of the others (O(members), not per task otherwise).
            by_model = self._by_model
            ineligible = set(view.weights).difference(by_model.get(model, ()), by_model.get("", ()))
        if self._older and (needed := self._unread(task)) is not None:
            # Members of an earlier release would refuse the task, and the whole frame it
            # goes in (other tasks' Cancels and Withdraws too): never theirs.  None left:
            # the task is refused unavailable (the forwarder says why).
            ineligible = ineligible | {n for n, r in self._older.items() if r < needed}
        skip = ineligible.union(exclude)
        pool_n = len(view.weights) - len(skip & view.weights.keys())
        if pool_n <= 0:
            return []
        # The pool's totals: everyone's, less the members left out (few, or the model case).
        total_load = self.total_load() - sum(self.load(n) for n in skip if n in view.weights)
        total_weight = view.total_weight - sum(view.weights[n] for n in skip if n in view.weights)
        cfg = self.config
        limit = max(1, cfg.attempts_max)
        kh = key_hash(key or task.key or task.id)
        n = limit + len(skip)
        while True:
            ranked = [ring.members[i] for i in ring.top(kh, min(n, len(ring)))]
            pool = [m for m in ranked if m not in skip]
            complete = n >= len(ring)
            chosen = self._first_under(pool, view, total_load, total_weight, complete)
            if chosen is not None or complete:
                break
            n *= 4  # the first ``n`` are all over their bound: look further
        if chosen is None:
            return pool[:limit]
        i = pool.index(chosen)
        return [chosen, *pool[:i], *pool[i + 1 :]][:limit]

    def _first_under(
        self, pool: Sequence[str], view: View, total: int, weight: float, complete: bool
    ) -> str | None:
        c, floor = self.config.load_bound_c, self.config.load_floor
        weights, saturated, first_under = view.weights, view.saturated, None
        for m in pool:  # in order, the bound worked out only as far as needed
            if self.load(m) < bound(total, weights[m], weight, c, floor):
                if not self._passed_over(m, saturated):
                    return m
                first_under = first_under or m
        if not complete:
            return None  # an unsaturated one may come further on: look there first
        return first_under

    def owner_for(self, task: Task, now: float) -> str | None:
        """The member that should run ``task`` (maybe this node); None when no live member
        serves the model it names; the age of the owner's load state it used is recorded
        (``state_ages``: our own is 0, a member's its newest record's, or unknown: Meta
        only)."""
        self._passed_age_s = -1.0
        self._now = now
        owner = self._owner_for(task)
        if owner is not None:
            # StateAges.observe inlined (once a task: no calls but the record's look-up).
            ages = self.state_ages
            passed_s = self._passed_age_s
            if passed_s >= 0.0:  # a member passed over on a record: the oldest state used
                ages.observe(passed_s)
            elif owner == self.node:
                ages.counts[0] += 1  # our own state: 0 s, the first bucket; the sum unchanged
                ages.count += 1
            elif self.config.owner_check:
                ages.owner_checked += 1  # the owner reads its own load as it admits
            else:
                known = self.load_view.get(owner)
                if known is None:
                    ages.unknown += 1
                else:
                    age_s = now - known.sampled_at  # Known.age_s
                    if age_s < 0.0:
                        age_s = 0.0
                    ages.counts[bisect.bisect_left(STATE_AGE_BUCKETS_S, age_s)] += 1
                    ages.count += 1
                    ages.sum_s += age_s
        return owner

    def _unread(self, task: Task) -> tuple[int, int, int] | None:
        """The release ``task``'s params need, where some older member's is below it;
        None: every member reads them."""
        needed = release_asked(task.params)
        return needed if needed is not None and self._older_floor < needed else None

    def _owner_for(self, task: Task) -> str | None:
        """The common case costs one ring lookup (cached for repeated keys) and one bound
        check; the preference order is computed only when the owner is over its bound."""
        view = self.view()
        ring = view.ring
        if (task.model and not self._all_serve(task.model, view)) or (
            self._older and self._unread(task) is not None
        ):
            # Only members serving the named model (and reading the task's params: a
            # rolling upgrade) qualify: the full placement, not the ring.
            order = self.order(task, self._now)
            if not order:
                return None
            owner = order[0]
        elif ring is None or (len(ring.members) == 1 and ring.members[0] == self.node):
            owner = self.node
        elif self.config.policy == "round_robin":
            self._round_robin = (self._round_robin + 1) % len(ring.members)
            owner = ring.members[self._round_robin]
        elif self.config.policy == "prefix" and not task.key:
            owner = self.place_by_prefix(task, view, ring)
        else:
            owner = ring.owner(task.key or task.id)
            # free(owner, view, total_load()), inlined (the common case: once a task)
            local = len(self.local_ids)
            loads = self.outstanding
            total = loads.total + local if type(loads) is LoadCounts else self.total_load()
            load = local if owner == self.node else loads.get(owner, 0)
            cfg = self.config
            if (
                owner in view.saturated and self._passed_over(owner, view.saturated)
            ) or load >= bound(
                total, view.weights[owner], view.total_weight, cfg.load_bound_c, cfg.load_floor
            ):
                order = self.order(task, self._now)
                owner = order[0] if order else self.node
        return owner

    def _all_serve(self, model: str, view: View) -> bool:
        """Does every serving member serve ``model`` (it names it, or names none)?  Then a
        task naming it is placed as any other (ring, bounds, prefixes): the common case of a
        cluster of one model, and every OpenAI request names one."""
        by_model = self._by_model
        named = by_model.get(model)
        unnamed = by_model.get("")
        n = (len(named) if named else 0) + (len(unnamed) if unnamed else 0)
        return bool(view.weights) and n >= len(view.weights)

    def place_by_prefix(self, task: Task, view: View, ring: Ring) -> str:
        """A keyless task: the member holding the longest known prefix of its prompt, under
        its load bound; else the ring owner of its first block (see core/prefix.py).  Holders
        are ranked among themselves (their rendezvous scores for the key), not in the order
        of the whole ring."""
        cfg = self.config
        chars = cfg.prefix_block_chars * cfg.prefix_blocks_max
        hashes = prefix_hashes(
            prefix_text(task, chars), cfg.prefix_block_chars, cfg.prefix_blocks_max
        )
        key = prefix_key(hashes) if hashes else task.id  # shorter than a block: by its id
        total = self.total_load()
        owner = ""
        for _depth, members in self.prefix_index.holders(hashes):
            ranked = self._holder_rank.get((key, members))
            if ranked is None:
                ranked = self._rank(ring, key, members, view)
            owner = next((m for m in ranked if self.free(m, view, total)), "")
            if owner:
                self.prefix_hits += 1
                break
        if not owner:
            owner = ring.owner(key)
            if not self.free(owner, view, total):
                order = self.order(task, self._now, key=key)
                owner = order[0] if order else self.node
        if hashes:
            self.prefix_index.placed(hashes, owner)
        return owner

    def _rank(self, ring: Ring, key: str, members: frozenset[str], view: View) -> list[str]:
        """The serving ones of ``members`` in their order for ``key`` (their rendezvous
        scores among themselves), remembered: a popular prefix's holders rank the same way
        for each of its tasks, until the ring changes (which forgets them all)."""
        held = [ring.index[m] for m in members if m in view.weights]
        if len(held) <= 1:
            ranked = [ring.members[i] for i in held]
        else:
            among = np.array(sorted(held), dtype=np.int64)
            ranked = [ring.members[i] for i in ring.top(key_hash(key), len(among), among)]
        if len(self._holder_rank) >= HOLDER_RANKS_MAX:
            self._holder_rank.clear()
        self._holder_rank[(key, members)] = ranked
        return ranked

    def record_prefix(self, task: Task) -> None:
        """Admitted here: count its prefix blocks for the summary we gossip."""
        cfg = self.config
        if cfg.policy == "prefix" and not task.key:
            self.prefix_record.add(
                prefix_hashes(
                    prefix_text(task, cfg.prefix_block_chars * cfg.prefix_blocks_max),
                    cfg.prefix_block_chars,
                    cfg.prefix_blocks_max,
                )
            )

    def prefix_summary(self) -> list[int]:
        return self.prefix_record.summary(self.config.prefix_summary_max)
