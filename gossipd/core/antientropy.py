"""SWIM anti-entropy at one member: push-pull state sync, joining, healing partitions and
checksum-triggered sync (sans-IO).

Owns: whether we have joined, our seeds, the push-pull, heal and join schedules, and the run
of checksum mismatches.  It sends through its SwimNode and changes membership only through
``SwimNode.apply`` (each record merged by the member table's rules, membership.py rule 7).

Rules:
1. Push-pull: every push_pull_interval (times 1 + ceil(log2 n - log2 32) above 32 live
   members) we send our whole table to one random live member, asking for its table back.
   A push-pull that asks for a reply gets ours; a reply asks for none.
2. Join: until any push-pull reaches us, every join_retry we push-pull with every seed.
3. Heal: every heal_interval, while we know dead members, with probability
   min(1, heal_fanout / live) we push-pull with one of them (chosen at random): after a
   partition heals, the halves find each other even if each declared the other dead.
4. Checksum sync: each acked probe carries the target's live-set checksum.
   checksum_mismatches_max mismatches in a row (from any peers) mean our view has drifted:
   we push-pull with the last one, at most once per checksum_sync; a match resets the run.
5. Our own record in a push-pull carries our current GPU metadata.
6. A push-pull, like every message, carries our highest leader term (core/fencing.py): a
   joiner learns the leader with its first push-pull.
7. With contained suspicions, a push-pull record that only raises a live member's incarnation
   is passed on quietly (piggyback only, Alive.quiet); a member new to us, or back from dead
   or left, is gossiped in rounds as any join.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from gossipd.core.messages import Alive, MemberRecord, PushPull
from gossipd.core.sharedtable import Overlay, SharedRecords

if TYPE_CHECKING:
    from gossipd.core.swim import SwimNode


_NONE: dict[str, object] = {}
_EMPTY: frozenset[str] = frozenset()


class AntiEntropy:
    def __init__(self, swim: SwimNode, now: float, seeds: list[str]) -> None:
        self._swim = swim
        cfg = swim.config
        self.seeds = seeds
        self.joined = not seeds
        self.next_push_pull_at = now + swim.rng.random() * cfg.push_pull_interval_s
        self.next_heal_at = now + swim.rng.random() * cfg.heal_interval_s
        self.next_join_at = now
        self._mismatch_run = 0
        self._last_sync_at = -math.inf

    def bootstrap(self, now: float) -> None:
        """We start converged: joined, the first push-pull within one period."""
        self.joined = True
        self.next_push_pull_at = now + self._swim.rng.random() * self.push_pull_period()

    def set_seeds(self, seeds: list[str], now: float) -> None:
        """Seeds learnt after start-up (from etcd): while we know no live member, we are not
        joined and push-pull with them at once, then every join_retry (rule 2)."""
        self.seeds = [s for s in seeds if s != self._swim.table.addr]
        if self.seeds and self._swim.table.live_count() <= 1:
            self.joined = False
            self.next_join_at = now

    # -- timers --------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        swim, cfg = self._swim, self._swim.config
        if now >= self.next_push_pull_at:
            self.next_push_pull_at = now + self.push_pull_period()
            target = swim.random_live()
            if target is not None:
                self.push_pull(swim.table.members[target].addr, reply=True)
        if now >= self.next_heal_at:
            self.next_heal_at = now + cfg.heal_interval_s
            self._heal()
        if not self.joined and now >= self.next_join_at:
            self.next_join_at = now + cfg.join_retry_s
            for seed in self.seeds:
                self.push_pull(seed, reply=True, join=True)

    def next_deadline(self) -> float:
        """The next push-pull, heal, or (while not joined) join attempt."""
        at = min(self.next_push_pull_at, self.next_heal_at)
        if not self.joined and self.next_join_at < at:
            return self.next_join_at
        return at

    def push_pull_period(self) -> float:
        n = self._swim.table.live_count()
        scale = 1 + max(0, math.ceil(math.log2(max(n, 1)) - math.log2(32)))
        return self._swim.config.push_pull_interval_s * scale

    def _heal(self) -> None:
        swim = self._swim
        if not swim.table.dead:
            return
        if swim.rng.random() < min(1.0, swim.config.heal_fanout / swim.table.live_count()):
            node = swim.rng.choice(sorted(swim.table.dead))
            self.push_pull(swim.table.members[node].addr, reply=True)

    # -- push-pull -----------------------------------------------------------------------------

    def push_pull(self, addr: str, *, reply: bool, join: bool = False) -> None:
        swim = self._swim
        table = swim.table
        records = table.records()
        if swim.gpu is not None:
            records[0] = MemberRecord(
                node=swim.node,
                addr=swim.addr,
                incarnation=table.incarnation,
                state="alive",
                meta_version=swim.meta_version,
                gpu=swim.gpu,
                meta_incarnation=table.meta_incarnation,
            )
        swim.send(addr, PushPull(**swim.header([]), reply=reply, join=join, members=records))

    def on_push_pull(self, msg: PushPull, now: float) -> None:
        swim = self._swim
        self.joined = True
        table = swim.table
        members = table.members
        contain = swim.config.contain_suspicions
        # Lookups without a Python-level call per record: a simulated member's table is an
        # Overlay (own entries over a shared base, sharedtable.py); a daemon's a plain dict.
        own_get = dict.get.__get__(members)
        base_get, hidden = (
            (members.base.get, members.hidden)
            if isinstance(members, Overlay)
            else (_NONE.get, _EMPTY)
        )
        records = msg.members
        if (
            isinstance(records, SharedRecords)
            and isinstance(members, Overlay)
            and records.base.members is members.base
        ):
            # The simulator's push-pull between two Overlays of one base (sharedtable.py):
            # the shared records we show are known, so they would all take the fast path.
            records = records.differing(hidden)
        for record in records:
            # Fast path: most records say what we already know (a push-pull at N=10,000 carries
            # 10,000 of them; building updates for each would dominate the simulator's time).
            node = record.node
            known = own_get(node)
            if known is None and node not in hidden:
                known = base_get(node)
            if (
                known is not None
                and known.incarnation == record.incarnation
                and known.state._value_ == record.state
                and (known.meta_incarnation, known.meta_version)
                >= (record.meta_incarnation, record.meta_version)
            ) or (
                record.node == swim.node
                and record.incarnation <= table.incarnation
                and record.state == "alive"
                and not table.is_previous_life(
                    record.meta_incarnation, record.meta_version, record.gpu
                )
            ):
                continue
            for update in table.merge_record(record, msg.src):
                if contain and isinstance(update, Alive):
                    # Anti-entropy news of a live member's incarnation is not urgent (rule 6);
                    # a member we did not know, or knew dead, is still gossiped in rounds.
                    update = msgspec.structs.replace(update, quiet=True)
                swim.apply(update, now)
        if msg.reply:
            self.push_pull(msg.src_addr, reply=False)

    def compare_checksum(self, peer: str, checksum: int, now: float) -> None:
        """An acked probe of ``peer`` carried its live-set checksum (rule 4)."""
        swim = self._swim
        if checksum == swim.table.checksum():
            self._mismatch_run = 0
            return
        self._mismatch_run += 1
        if (
            self._mismatch_run >= swim.config.checksum_mismatches_max
            and now - self._last_sync_at >= swim.config.checksum_sync_s
        ):
            self._last_sync_at = now
            self._mismatch_run = 0
            swim.stats.checksum_syncs += 1
            self.push_pull(swim.table.members[peer].addr, reply=True)
