"""SWIM anti-entropy at one member: push-pull state sync, joining, healing partitions and
checksum-triggered sync (sans-IO).

Owns: whether we have joined, our seeds, the push-pull, heal and join schedules, and the run
of checksum mismatches.  It sends through its SwimNode and changes membership only through
``SwimNode.apply`` (each record merged by the member table's rules, membership.py rule 7).

Rules:
1. Push-pull: every push_pull_interval (times 1 + ceil(log2 n - log2 32) above 32 live
   members) we send our whole table to one random live member, asking for its table back.
   A push-pull that asks for a reply gets ours; a reply asks for none.
1a. Pages: a table is sent in pages (PushPull messages) of at most push_pull_page_bytes (or
   message_bytes_max, if less; a record larger than that goes alone in its page):
   our own record first, then every member in the table's order when the exchange started
   (a member gone since is skipped; one new since waits for the next exchange).  The first
   page leaves at once; one more page leaves every push_pull_page_interval until the last
   (``more`` false), which alone carries ``reply`` and ``join``: the receiver answers once it
   has applied our whole table, as it did a one-message table.  Pages are numbered from 0.
   The receiver applies each page as it arrives, as a whole table (nothing waits for the
   rest).  Between pages only the names of the table are kept; each page's records are
   encoded as it is built and kept by nobody.  At most STREAMS_MAX exchanges are sent at
   once, one per peer: another is not started (counted in stats.push_pulls_refused).
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

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from gossipd.core.gossip_messages import (
    Alive,
    MemberRecord,
    PushPull,
    PushPullEncoded,
    encode_gossip,
    encode_record,
)
from gossipd.core.sharedtable import Overlay, SharedRecords

if TYPE_CHECKING:
    from gossipd.core.swim import SwimNode


_NONE: dict[str, object] = {}
_EMPTY: frozenset[str] = frozenset()
# Push-pull exchanges sent at once (rule 1a): each holds its table's names (80 KB at 10,000).
STREAMS_MAX = 8
# A MessagePack array's header is 1 to 5 bytes: an envelope is measured with an empty one.
_ARRAY_HEADER_BYTES_MORE = 4


def _array_header_bytes(n: int) -> int:
    """The size of a MessagePack array's header for ``n`` items."""
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


@dataclass(slots=True)
class _Stream:
    """A push-pull exchange whose later pages are still to send (rule 1a)."""

    addr: str
    names: list[str]  # the table's node ids when the exchange started, in its order
    pos: int  # the next of ``names`` to send
    page: int  # the next page's number
    reply: bool  # the last page asks for the receiver's table
    join: bool


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
        self._streams: list[_Stream] = []
        self.next_page_at = math.inf  # the next page of the exchanges in progress

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
                self.push_pull(swim.table.members[target].addr, reply=True, now=now)
        if now >= self.next_heal_at:
            self.next_heal_at = now + cfg.heal_interval_s
            self._heal(now)
        if not self.joined and now >= self.next_join_at:
            self.next_join_at = now + cfg.join_retry_s
            for seed in self.seeds:
                self.push_pull(seed, reply=True, join=True, now=now)
        if now >= self.next_page_at:
            self._send_next_pages(now)

    def next_deadline(self) -> float:
        """The next push-pull, heal, page of an exchange in progress (inf when none), or
        (while not joined) join attempt."""
        at = min(self.next_push_pull_at, self.next_heal_at, self.next_page_at)
        if not self.joined and self.next_join_at < at:
            return self.next_join_at
        return at

    def push_pull_period(self) -> float:
        n = self._swim.table.live_count()
        scale = 1 + max(0, math.ceil(math.log2(max(n, 1)) - math.log2(32)))
        return self._swim.config.push_pull_interval_s * scale

    def _heal(self, now: float) -> None:
        swim = self._swim
        if not swim.table.dead:
            return
        if swim.rng.random() < min(1.0, swim.config.heal_fanout / swim.table.live_count()):
            node = swim.rng.choice(sorted(swim.table.dead))
            self.push_pull(swim.table.members[node].addr, reply=True, now=now)

    # -- push-pull -----------------------------------------------------------------------------

    def push_pull(self, addr: str, *, reply: bool, now: float, join: bool = False) -> None:
        """Send our table to ``addr`` in pages (rules 1, 1a): the first now, the rest paced."""
        swim = self._swim
        streams = self._streams
        if len(streams) >= STREAMS_MAX or any(s.addr == addr for s in streams):
            swim.stats.push_pulls_refused += 1
            return
        swim.stats.push_pulls += 1
        members = swim.table.members
        budget = self._page_budget(reply=reply, join=join, page=0)
        own = self._own_record()
        if self._send_shared_table(addr, own, budget, reply=reply, join=join):
            return
        page = [encode_record(own)]
        used = len(page[0])
        stream = None
        for pos, raw in enumerate(self._raws_in_order()):
            if used + len(raw) > budget:
                # More than one page: keep only the names, in the same order (rule 1a).
                stream = _Stream(
                    addr=addr, names=list(members), pos=pos, page=1, reply=reply, join=join
                )
                if not streams:
                    self.next_page_at = now + swim.config.push_pull_page_interval_s
                streams.append(stream)
                break
            page.append(raw)
            used += len(raw)
        if stream is None:
            self._send_page(addr, page, reply=reply, join=join, page=0, more=False)
        else:
            self._send_page(addr, page, reply=False, join=False, page=0, more=True)

    def _own_record(self) -> MemberRecord:
        """Our record, with our current GPU metadata (rule 5)."""
        swim, table = self._swim, self._swim.table
        if swim.gpu is None:
            return MemberRecord(
                node=swim.node, addr=swim.addr, incarnation=table.incarnation, state="alive"
            )
        return MemberRecord(
            node=swim.node,
            addr=swim.addr,
            incarnation=table.incarnation,
            state="alive",
            meta_version=swim.meta_version,
            gpu=swim.gpu,
            meta_incarnation=table.meta_incarnation,
        )

    def _send_shared_table(
        self, addr: str, own: MemberRecord, budget: int, *, reply: bool, join: bool
    ) -> bool:
        """A simulated member's whole table as one page when it fits in ``budget`` bytes (the
        common case, sized without a step per record; False: a daemon's table, or too large).
        Its records are objects (SharedRecords: the shared ones its base's), sent with their
        encoded size through ``SwimNode.send_page``: the same bytes as a PushPullEncoded of
        the same records, which the simulator need not encode or decode (simulations/netsim.py)."""
        swim = self._swim
        table = swim.table
        members, base = table.members, table.shared_base
        if not isinstance(members, Overlay) or base is None:
            return False
        raws = base.raws()
        mine = [own, *(m.record() for m in dict.values(members))]
        hidden = members.hidden
        size = base.raws_bytes - sum(len(raws[n]) for n in hidden)
        size += sum(len(encode_record(r)) for r in mine)
        if size > budget:
            return False
        records = SharedRecords(mine, base, frozenset(hidden))
        # The envelope with an empty array (a 1-byte header), then the array's real header.
        envelope = len(self._page([], reply=reply, join=join, page=0, more=False))
        size += envelope - 1 + _array_header_bytes(len(records))
        msg = PushPull(**swim.header([]), reply=reply, join=join, members=records)
        swim.send_page(addr, msg, size)
        return True

    def _raws_in_order(self) -> Iterator[msgspec.Raw]:
        """Every member's encoded record, in the order of ``list(table.members)``; a
        simulated member's shared entries' records are encoded once for all (sharedtable.py)."""
        table = self._swim.table
        members, base = table.members, table.shared_base
        if isinstance(members, Overlay) and base is not None:
            hidden = members.hidden
            return itertools.chain(
                (encode_record(m.record()) for m in dict.values(members)),
                (raw for node, raw in base.raws().items() if node not in hidden),
            )
        return (encode_record(m.record()) for m in members.values())

    def _raw_of(self, node: str) -> msgspec.Raw | None:
        """One member's encoded record (None: no longer in our table)."""
        table = self._swim.table
        members, base = table.members, table.shared_base
        member = members.get(node)
        if member is None:
            return None
        if base is not None and isinstance(members, Overlay) and members.shared(node):
            return base.raws()[node]
        return encode_record(member.record())

    def _send_next_pages(self, now: float) -> None:
        """One more page of each exchange in progress (rule 1a)."""
        for stream in self._streams:
            budget = self._page_budget(reply=False, join=False, page=stream.page)
            names, i = stream.names, stream.pos
            page: list[msgspec.Raw] = []
            used = 0
            while i < len(names):
                raw = self._raw_of(names[i])
                if raw is not None:
                    if used + len(raw) > budget and page:
                        break
                    page.append(raw)
                    used += len(raw)
                i += 1
            stream.pos = i
            if i < len(names):
                self._send_page(
                    stream.addr, page, reply=False, join=False, page=stream.page, more=True
                )
            else:
                reply, join = stream.reply, stream.join
                self._send_page(
                    stream.addr, page, reply=reply, join=join, page=stream.page, more=False
                )
            stream.page += 1
        self._streams = [s for s in self._streams if s.pos < len(s.names)]
        self.next_page_at = (
            now + self._swim.config.push_pull_page_interval_s if self._streams else math.inf
        )

    def _page_budget(self, *, reply: bool, join: bool, page: int) -> int:
        """The bytes a page's records may take: push_pull_page_bytes (or message_bytes_max,
        if less) less the page's envelope."""
        cfg = self._swim.config
        envelope = self._page([], reply=reply, join=join, page=page, more=True)
        page_bytes = min(cfg.push_pull_page_bytes, cfg.message_bytes_max)
        return page_bytes - len(envelope) - _ARRAY_HEADER_BYTES_MORE

    def _page(
        self, raws: list[msgspec.Raw], *, reply: bool, join: bool, page: int, more: bool
    ) -> bytes:
        header = self._swim.header([])
        return encode_gossip(
            PushPullEncoded(**header, reply=reply, join=join, members=raws, page=page, more=more)
        )

    def _send_page(
        self, addr: str, raws: list[msgspec.Raw], *, reply: bool, join: bool, page: int, more: bool
    ) -> None:
        data = self._page(raws, reply=reply, join=join, page=page, more=more)
        self._swim.send_encoded(addr, "PushPull", data)

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
            self.push_pull(msg.src_addr, reply=False, now=now)

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
            member = swim.table.members.get(peer)
            if member is None:  # forgotten while its probe was out (a forget, a reap)
                return
            self._last_sync_at = now
            self._mismatch_run = 0
            swim.stats.checksum_syncs += 1
            self.push_pull(member.addr, reply=True, now=now)
