"""The member table and its state rules: alive / suspect / dead / left (sans-IO).

Rules (an update is about one member and carries that member's incarnation):
1. A higher incarnation always wins over a lower one, whatever the states.
2. At an equal incarnation the order is alive < suspect < dead < left: suspect overrides alive,
   dead overrides alive and suspect, left overrides all.  Nothing overrides left but a higher
   incarnation (a member that comes back after leaving rejoins with a new incarnation).
3. Only the subject may refute: a member that hears it is suspect, dead (or left, when it has
   not left) takes incarnation max(own, heard) + 1 (at most ``INCARNATION_MAX``, the bound
   peers decode) and announces itself alive.  A member never declares itself dead.
4. A suspicion of the same incarnation by another member is a confirmation (Lifeguard); it
   is counted, not flooded: a confirmer tells the accuser directly.
5. Unknown members join only through an alive update; other news about them is ignored.
6. GPU metadata (Meta) is ordered by (incarnation, version): the incarnation its member had
   when it published it, then the member's own counter.  A higher pair replaces a lower one;
   metadata never changes membership state.  A member publishes its metadata again each time
   its incarnation rises, so its newest metadata always carries its newest incarnation.
7. From a push-pull, a member the sender thinks dead is only suspected here (memberlist's
   rule): it gets the chance to refute before anyone declares it dead on second-hand news.
8. A restart is a fresh start.  A restarted process counts its metadata versions from 0 and
   starts at incarnation 0; its previous life's state (status draining, old endpoints, a
   high version) must not outlive it:
   a. A member that rejoins after dead or left, or comes back alive at another address, with
      an incarnation above that of its stored metadata, loses that metadata: it has no GPU
      state here (placement passes it over) until it publishes at its new incarnation, and
      metadata of older incarnations stays ignored.
   b. A member that hears metadata about itself that it did not publish (a higher pair than
      its own latest, or the same pair with other content: its previous life's) takes
      incarnation max(own, heard) + 1, announces itself alive and publishes again, as for a
      refutation.  (News that it left or died, rule 3, does the same.)
9. Forgetting (the leader's ``forget`` directive, core/reaping.py): a member held suspect,
   dead or left at the named incarnation or below is removed from the table.  An alive
   member, or one at a higher incarnation, is kept.  A forgotten member is unknown again:
   it comes back through an alive update like any new member (rule 5), so one that returns
   (at any incarnation) is re-admitted normally.  A stale push-pull that brings a forgotten
   member back as suspect (rule 7) is undone by the leader's repeated forget.

Theory of operation: ``apply`` takes one update and returns an ``Outcome`` saying whether to
pass the update on, whether we must refute (and to whom directly), and the event to report.
The transitions are the table ``TRANSITIONS`` below; the docs and the tests read the same table.
Suspicion timers live here (one ``Suspicion`` per suspect); the SWIM node fires them.
"""

from __future__ import annotations

import bisect
import enum
import functools
import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gossipd.core.gossip_messages import (
    INCARNATION_MAX,
    Alive,
    Dead,
    GpuState,
    Left,
    MemberRecord,
    MemberUpdate,
    Meta,
    Suspect,
)
from gossipd.core.messages import UpdateKind
from gossipd.core.sharedtable import Overlay, SharedBase
from gossipd.core.suspicion import Suspicion


class State(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


LIVE_STATES = frozenset({State.ALIVE, State.SUSPECT})


@dataclass(slots=True)
class Member:
    node: str
    addr: str
    incarnation: int
    state: State
    state_since: float
    meta_version: int = 0
    gpu: GpuState | None = None
    suspicion: Suspicion | None = None
    meta_incarnation: int = 0  # the incarnation ``gpu`` was published at (rule 6)
    # ``gpu.prefixes``, compact (4 bytes a hash where a list of ints costs 40): ``gpu`` is
    # kept without them.  10,000 members with 256 each: 10 MB instead of 100.
    prefixes: array[int] | tuple[()] = ()

    def record(self) -> MemberRecord:
        gpu = self.gpu
        if gpu is not None and self.prefixes:
            gpu = msgspec.structs.replace(gpu, prefixes=self.prefixes.tolist())
        return MemberRecord(
            node=self.node,
            addr=self.addr,
            incarnation=self.incarnation,
            state=self.state._value_,
            meta_version=self.meta_version,
            gpu=gpu,
            meta_incarnation=self.meta_incarnation,
        )

    def set_gpu(self, gpu: GpuState | None) -> None:
        """Store GPU state, its prefix hashes apart and compact."""
        if gpu is not None and gpu.prefixes:
            self.prefixes = array("I", gpu.prefixes)
            gpu = msgspec.structs.replace(gpu, prefixes=[])
        else:
            self.prefixes = ()
        self.gpu = gpu


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """What changed.  kind: joined, suspect, alive (refuted or newer incarnation), dead, left,
    meta; for ourselves: refuted (we were suspected/declared dead and answered)."""

    kind: str
    node: str
    incarnation: int
    at: float
    by: str = ""


@dataclass(slots=True)
class Outcome:
    changed: bool = False
    rebroadcast: bool = False  # pass the update on
    urgent: bool = True  # membership news (vs. metadata)
    refute_to: str | None = None  # we refuted: also tell this member directly
    refuted: bool = False
    stale_about_me: bool = False  # someone still believes an older suspicion/death of ours
    confirm_probe: str | None = None  # a new suspicion heard from another member
    confirm_to: str | None = None  # we confirmed a suspicion: tell its accuser directly
    leave_again: bool = False  # leaving, we heard an Alive of ours above our Left
    event: MemberEvent | None = None


class MemberTable:
    def __init__(self, *, me: str, addr: str, now: float, incarnation: int = 0) -> None:
        self.me = me
        self.addr = addr
        self.incarnation = incarnation
        self.leaving = False
        # Our own metadata: the latest we published, and its (incarnation, version) (rule 6).
        self.gpu: GpuState | None = None
        self.meta_incarnation = 0
        self.meta_version = 0
        self.members: dict[str, Member] = {}
        self._ring: list[str] | None = None  # sorted live names, us included (built lazily)
        self._ring_shared = False  # _ring is a SharedBase's: copy before changing it
        self._base: SharedBase | None = None  # set by bootstrap_shared
        self.live_version = 0  # bumped on every change of state or incarnation
        self.set_version = 0  # bumped only when the live set itself changes
        self.addr_changes = 0  # bumped when a member's address or rpc address changes
        self._xor = 0  # XOR of _contribution() over live members other than us
        self._live_n = 0
        self._meta_changes = 0
        # Suspicion settings, refreshed by the SWIM node as the cluster size changes.
        self.suspicion_k = 3
        self.suspicion_min_s = 1.0
        self.suspicion_max_s = 3.0
        self.members_max = 10_000
        self.refused_full = 0
        # Members by state (alive members are not tracked: that set is the big one).
        self._by_state: dict[State, set[str]] = {st: set() for st in State if st is not State.ALIVE}
        self.suspects = self._by_state[State.SUSPECT]
        self.dead = self._by_state[State.DEAD]
        self.left = self._by_state[State.LEFT]

    # -- queries ---------------------------------------------------------------------------

    def live_count(self) -> int:
        """Live members, ourselves included."""
        return 1 + self._live_n

    def live_ring(self) -> list[str]:
        """The sorted names of the live members, us included (kept up to date in place: a
        change of the live set costs one bisect, not a rebuild).  Do not modify it."""
        if self._ring is None:
            ring = [n for n, m in self.members.items() if m.state in LIVE_STATES]
            ring.append(self.me)
            ring.sort()
            self._ring = ring
        return self._ring

    def _ring_change(self, node: str, live: bool) -> None:
        ring = self._ring
        if ring is None:
            return
        if self._ring_shared:
            ring = self._ring = list(ring)
            self._ring_shared = False
        i = bisect.bisect_left(ring, node)
        present = i < len(ring) and ring[i] == node
        if live and not present:
            ring.insert(i, node)
        elif not live and present:
            del ring[i]

    def bootstrap_shared(self, base: SharedBase) -> None:
        """Start knowing ``base``'s members (all alive at incarnation 0), sharing its entries
        and its ring copy-on-write (sharedtable.py; for the simulator: N members start with
        O(N) memory and time in all, not O(N^2))."""
        if self.members:
            raise ValueError("bootstrap_shared: the table must be empty")
        members = Overlay(base.members, {self.me})
        self.members = members
        self._xor = base.xor
        if self.me in base.members:
            self._xor ^= _contribution(self.me, 0)
        self._live_n = len(members)
        if self.me in base.members:
            self._ring, self._ring_shared = base.ring, True
        else:
            self._ring, self._ring_shared = sorted([*base.ring, self.me]), False
        self._base = base
        self.set_version += 1
        self.live_version += 1

    def checksum(self) -> int:
        """A 63-bit digest of the live set (names and incarnations, ourselves included): the
        XOR of one hash per live member, kept up to date in O(1) per change."""
        return (self._xor ^ _contribution(self.me, self.incarnation)) >> 1

    def publish_meta(self, gpu: GpuState) -> Meta:
        """Our new GPU state as the Meta update to gossip: the next version, at our current
        incarnation (rule 6)."""
        self.meta_version += 1
        self.meta_incarnation = self.incarnation
        self.gpu = gpu
        return Meta(node=self.me, version=self.meta_version, gpu=gpu, incarnation=self.incarnation)

    def is_previous_life(self, incarnation: int, version: int, gpu: GpuState | None) -> bool:
        """Is this metadata about us one we did not publish (rule 8b)?"""
        if gpu is None or version <= 0:
            return False
        heard, own = (incarnation, version), (self.meta_incarnation, self.meta_version)
        return heard > own or (heard == own and gpu != self.gpu)

    def records(self) -> list[MemberRecord]:
        """Our whole table as push-pull records, built on each call and kept by nobody (a
        push-pull encodes its records page by page instead: core/antientropy.py)."""
        own = MemberRecord(
            node=self.me, addr=self.addr, incarnation=self.incarnation, state="alive"
        )
        return [own, *(m.record() for m in self.members.values())]

    @property
    def shared_base(self) -> SharedBase | None:
        """The simulator's shared table under ours (bootstrap_shared), or None."""
        return self._base

    @property
    def addresses_version(self) -> tuple[int, int, int]:
        """Changes whenever the member an address belongs to may have (core/addresses.py):
        a join or a liveness flip (set_version), a member gone (the count), an address or
        an rpc address changed.  Not with every Meta: those come by the thousand a second
        at 10,000 members, and the index would be rebuilt for each."""
        return (self.set_version, self.addr_changes, len(self.members))

    @property
    def version(self) -> tuple[int, int, int]:
        """Changes whenever anything a push-pull carries changes."""
        return (self.live_version, self._meta_changes, len(self.members))

    # -- the rules -------------------------------------------------------------------------

    def apply(self, update: MemberUpdate, now: float) -> Outcome:
        kind = _KIND[type(update)]
        if update.node == self.me:
            return self._about_me(update, now)
        members = self.members
        member = members.get(update.node)
        state = None if member is None else member.state
        handler = TRANSITIONS.get((state, kind))
        if handler is None:
            return Outcome()
        if member is not None and isinstance(members, Overlay) and members.shared(update.node):
            member = members[update.node] = _copy(member)  # copy-on-write (sharedtable.py)
        return handler(self, member, update, now)

    def _about_me(self, update: MemberUpdate, now: float) -> Outcome:
        heard = update.incarnation
        if isinstance(update, Meta):
            # Rule 8b: metadata of ours we never published is our previous life's.
            if self.leaving or not self.is_previous_life(heard, update.version, update.gpu):
                return Outcome()
        elif isinstance(update, Alive):
            if heard <= self.incarnation:
                return Outcome()
            if self.leaving:
                # An Alive of ours above our Left (a previous life's, or forged) would undo
                # the leave at every peer, and our exit would then read as a death: we leave
                # again above it (SwimNode gossips the new Left), and refute nothing.
                self.incarnation = min(heard + 1, INCARNATION_MAX)
                self.live_version += 1
                return Outcome(changed=True, leave_again=True)
        elif self.leaving:
            return Outcome()
        elif heard < self.incarnation:
            # Stale news about us: whoever carries it missed our refutation; tell them again
            # (and the accuser it names).
            return Outcome(stale_about_me=True, refute_to=getattr(update, "by", None))
        # Never past the bound peers decode (a forged incarnation at it would otherwise make
        # every message of ours undecodable): news at the bound cannot be refuted.
        self.incarnation = min(max(self.incarnation, heard) + 1, INCARNATION_MAX)
        self.live_version += 1
        by = getattr(update, "by", None)
        return Outcome(
            changed=True,
            refuted=True,
            refute_to=by,
            event=MemberEvent("refuted", self.me, self.incarnation, now, by or ""),
        )

    def _join(self, member: Member | None, update: Alive, now: float) -> Outcome:
        if len(self.members) >= self.members_max:
            self.refused_full += 1
            return Outcome()
        self.members[update.node] = Member(
            update.node, update.addr, update.incarnation, State.ALIVE, now
        )
        self._xor ^= _contribution(update.node, update.incarnation)
        self._live_n += 1
        self._ring_change(update.node, True)
        self.set_version += 1
        self.live_version += 1
        return Outcome(
            changed=True,
            rebroadcast=True,
            event=MemberEvent("joined", update.node, update.incarnation, now),
        )

    def _alive(self, member: Member | None, update: Alive, now: float) -> Outcome:
        assert member is not None
        if update.incarnation <= member.incarnation:
            return Outcome()
        was = member.state
        moved = member.addr != update.addr
        member.addr = update.addr
        if moved:
            self.addr_changes += 1
        if (was in (State.DEAD, State.LEFT) or moved) and (
            member.meta_incarnation < update.incarnation
        ):
            # Rule 8a: a new life; its metadata comes again at this incarnation.
            if member.gpu is not None:
                self.addr_changes += 1  # (its rpc address goes with it)
            member.set_gpu(None)
            member.meta_incarnation, member.meta_version = update.incarnation, 0
            self._meta_changes += 1
        self._set_state(member, State.ALIVE, now, update.incarnation)
        kind = "joined" if was in (State.DEAD, State.LEFT) else "alive"
        return Outcome(
            changed=True,
            rebroadcast=True,
            event=MemberEvent(kind, member.node, member.incarnation, now),
        )

    def _suspect(self, member: Member | None, update: Suspect, now: float) -> Outcome:
        assert member is not None
        if update.incarnation < member.incarnation:
            return Outcome()
        if member.state is State.SUSPECT and update.incarnation == member.incarnation:
            assert member.suspicion is not None
            if update.by == self.me:
                member.suspicion.witness = True
            new = member.suspicion.confirm(update.by)
            # Rule 4: a confirmation counts here.  It is not flooded (that would cost a whole
            # broadcast per confirmer); our own goes straight to the accuser, whose timer it
            # shortens, and the accuser's Dead, if it comes to that, reaches everyone.
            accuser = member.suspicion.accuser
            send_to = accuser if new and update.by == self.me and accuser != self.me else None
            return Outcome(changed=new, confirm_to=send_to)
        self._set_state(member, State.SUSPECT, now, update.incarnation)
        member.suspicion = Suspicion(
            incarnation=update.incarnation,
            started_at=now,
            by=update.by,
            k=self.suspicion_k,
            min_s=self.suspicion_min_s,
            max_s=self.suspicion_max_s,
            witness=update.by == self.me,
        )
        return Outcome(
            changed=True,
            rebroadcast=True,
            confirm_probe=None if update.by == self.me else member.node,
            event=MemberEvent("suspect", member.node, member.incarnation, now, update.by),
        )

    def _dead(self, member: Member | None, update: Dead, now: float) -> Outcome:
        return self._down(member, update.incarnation, now, State.DEAD, "dead", update.by)

    def _left(self, member: Member | None, update: Left, now: float) -> Outcome:
        return self._down(member, update.incarnation, now, State.LEFT, "left", "")

    def _down(
        self, member: Member | None, incarnation: int, now: float, state: State, kind: str, by: str
    ) -> Outcome:
        """Dead or left, unless the news is older than what we know."""
        assert member is not None
        if incarnation < member.incarnation:
            return Outcome()
        self._set_state(member, state, now, incarnation)
        return Outcome(
            changed=True,
            rebroadcast=True,
            event=MemberEvent(kind, member.node, member.incarnation, now, by),
        )

    def _meta(self, member: Member | None, update: Meta, now: float) -> Outcome:
        assert member is not None
        if update.version < 1 or (update.incarnation, update.version) <= (
            member.meta_incarnation,
            member.meta_version,
        ):
            return Outcome()  # (a member counts versions from 1: 0 is no state it published)
        member.meta_incarnation, member.meta_version = update.incarnation, update.version
        old, new = member.gpu, update.gpu
        if (old.rpc if old is not None else "") != (new.rpc if new is not None else ""):
            self.addr_changes += 1
        member.set_gpu(update.gpu)
        self._meta_changes += 1
        return Outcome(
            changed=True,
            rebroadcast=True,
            urgent=False,
            event=MemberEvent("meta", member.node, member.incarnation, now),
        )

    def _set_state(self, member: Member, state: State, now: float, incarnation: int) -> None:
        """The one place a known member's state or incarnation changes (keeps the live count,
        the checksum and the per-state indexes in step, in O(1))."""
        was_live = member.state is State.ALIVE or member.state is State.SUSPECT
        is_live = state is State.ALIVE or state is State.SUSPECT
        if was_live:
            self._xor ^= _contribution(member.node, member.incarnation)
        if is_live:
            self._xor ^= _contribution(member.node, incarnation)
        if was_live != is_live:
            self._live_n += 1 if is_live else -1
            self._ring_change(member.node, is_live)
            self.set_version += 1
        if state is not State.SUSPECT:
            member.suspicion = None
        if member.state is not State.ALIVE:
            self._by_state[member.state].discard(member.node)
        if state is not State.ALIVE:
            self._by_state[state].add(member.node)
        member.incarnation = incarnation
        member.state = state
        member.state_since = now
        self.live_version += 1

    def declare_dead(self, node: str, now: float) -> Dead | None:
        """Our suspicion timer for ``node`` fired: the Dead update to apply and send."""
        member = self.members.get(node)
        if member is None or member.state is not State.SUSPECT:
            return None
        return Dead(node=node, incarnation=member.incarnation, by=self.me)

    def merge_record(self, record: MemberRecord, sender: str) -> list[MemberUpdate]:
        """The updates a push-pull record stands for (rule 7: dead becomes suspect).  None
        for a dead member we do not know (memberlist ignores it): one we reaped would
        otherwise join again as alive, with its old GPU state, and be gossiped so to members
        that had reaped it too, its reap clock started over.  (A suspect one is live, not
        reaped: learned, as suspect.)"""
        out: list[MemberUpdate] = []
        if record.state == "dead" and record.node not in self.members and record.node != self.me:
            return out  # (our own previous life's record is news to refute: rule 8)
        if record.state == "alive":
            out.append(Alive(node=record.node, incarnation=record.incarnation, addr=record.addr))
        elif record.state in ("suspect", "dead"):
            out.append(Alive(node=record.node, incarnation=record.incarnation, addr=record.addr))
            out.append(Suspect(node=record.node, incarnation=record.incarnation, by=sender))
        else:
            out.append(Left(node=record.node, incarnation=record.incarnation))
        if record.gpu is not None and record.meta_version > 0:
            out.append(
                Meta(
                    node=record.node,
                    version=record.meta_version,
                    gpu=record.gpu,
                    incarnation=record.meta_incarnation,
                )
            )
        return out

    def reap(self, now: float, *, dead_after_s: float, left_after_s: float) -> list[str]:
        gone = [n for n in self.dead if now - self.members[n].state_since >= dead_after_s]
        gone += [n for n in self.left if now - self.members[n].state_since >= left_after_s]
        for node in sorted(gone):
            self._by_state[self.members[node].state].discard(node)
            del self.members[node]
        if gone:
            self.live_version += 1
        return gone

    def forget(self, node: str, incarnation: int, now: float) -> bool:
        """The leader's ``forget`` directive (rule 9): drop ``node`` if we hold it suspect,
        dead or left at ``incarnation`` or below.  True if it was dropped."""
        member = self.members.get(node)
        if member is None or member.state is State.ALIVE or member.incarnation > incarnation:
            return False
        if member.state is State.SUSPECT:  # a stale push-pull brought it back: dead first
            self._set_state(member, State.DEAD, now, member.incarnation)
        self._by_state[member.state].discard(node)
        del self.members[node]
        self.live_version += 1
        return True


def shared_base(members: list[tuple[str, str]], now: float) -> SharedBase:
    """The converged table of these (node, addr) members, all alive at incarnation 0, for
    ``MemberTable.bootstrap_shared`` (the simulator's start)."""
    entries = {node: Member(node, addr, 0, State.ALIVE, now) for node, addr in members}
    xor = 0
    for node in entries:
        xor ^= _contribution(node, 0)
    return SharedBase(entries, xor)


def _copy(m: Member) -> Member:
    return Member(
        m.node,
        m.addr,
        m.incarnation,
        m.state,
        m.state_since,
        m.meta_version,
        m.gpu,
        m.suspicion,
        m.meta_incarnation,
    )


@functools.lru_cache(maxsize=1 << 16)
def _contribution(node: str, incarnation: int) -> int:
    digest = hashlib.blake2b(f"{node}:{incarnation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


_KIND: dict[type, UpdateKind] = {
    Alive: UpdateKind.ALIVE,
    Suspect: UpdateKind.SUSPECT,
    Dead: UpdateKind.DEAD,
    Left: UpdateKind.LEFT,
    Meta: UpdateKind.META,
}


_Handler = Callable[[MemberTable, Member | None, MemberUpdate, float], Outcome]

# (current state, or None for an unknown member; update kind) -> handler.  A missing pair means
# "ignore": e.g. a suspicion of a member we never heard of, or anything but alive after dead.
TRANSITIONS: dict[tuple[State | None, UpdateKind], _Handler] = {
    (None, UpdateKind.ALIVE): MemberTable._join,  # type: ignore[dict-item]
    **{(s, UpdateKind.ALIVE): MemberTable._alive for s in State},  # type: ignore[misc]
    (State.ALIVE, UpdateKind.SUSPECT): MemberTable._suspect,  # type: ignore[dict-item]
    (State.SUSPECT, UpdateKind.SUSPECT): MemberTable._suspect,  # type: ignore[dict-item]
    (State.ALIVE, UpdateKind.DEAD): MemberTable._dead,  # type: ignore[dict-item]
    (State.SUSPECT, UpdateKind.DEAD): MemberTable._dead,  # type: ignore[dict-item]
    (State.ALIVE, UpdateKind.LEFT): MemberTable._left,  # type: ignore[dict-item]
    (State.SUSPECT, UpdateKind.LEFT): MemberTable._left,  # type: ignore[dict-item]
    (State.DEAD, UpdateKind.LEFT): MemberTable._left,  # type: ignore[dict-item]
    **{(s, UpdateKind.META): MemberTable._meta for s in State},  # type: ignore[misc]
}
