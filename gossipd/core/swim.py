"""One SWIM + Lifeguard member, sans-IO: probing, gossip, anti-entropy, join and leave.

Inputs: ``receive(now, data)`` for each datagram, ``tick(now)`` when ``next_deadline()`` is
due, ``leave(now)``, ``set_gpu(now, gpu)``.  Outputs: ``take_outbox()`` -> [(addr, bytes)],
``take_events()`` -> [MemberEvent].  Time and randomness come from the caller (``now`` and the
``rng`` given to the constructor); nothing here reads a clock or the global random module.

Theory of operation:
- Every probe interval we probe one member: ping; no ack within probe_timeout -> ping-req
  through ``indirect_probes`` peers (they relay, and nack if the target is silent to them too);
  no ack by probe_deadline -> we suspect it (and we are a witness, see suspicion.py).
- Targets follow a shared schedule: in round r = floor(now / probe_interval) the member at
  ring position p probes position p + 1 + (r mod (n - 1)).  With agreeing views every member
  is probed exactly once per round.
- A member hearing a new suspicion probes the suspect with probability confirm_probes/(n - 2):
  on failure it confirms (shrinking the witnesses' timers), on success its ping has carried
  the suspicion to the suspect, which refutes at once (directly to the accuser too).
- Updates ride piggyback on every message (updates about the recipient and about us first);
  membership changes are also pushed every gossip interval to gossip_fanout members.
- We slow down instead of accusing when we are the slow one (awareness.py), and a timer that
  fires late (we were paused) gives incoming messages a chance before it acts.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from gossipd.core.awareness import Awareness
from gossipd.core.broadcast import BroadcastQueue
from gossipd.core.membership import LIVE_STATES, MemberEvent, MemberTable, Outcome, State
from gossipd.core.messages import (
    Ack,
    Alive,
    Dead,
    GossipMessage,
    GossipOnly,
    GpuState,
    Left,
    MemberRecord,
    Meta,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Suspect,
    Update,
    decode_gossip,
    encode_gossip,
    encode_update,
)
from gossipd.core.suspicion import suspicion_min_s
from gossipd.core.swim_config import SwimConfig
from gossipd.errors import RemoteProtocolError

MEMBER, META = 0, 1  # broadcast-queue families: one membership and one metadata item per node


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    started: float
    ack_deadline: float
    final_deadline: float
    indirect_sent: bool = False
    nacks: int = 0
    requested: int = 0


@dataclass(slots=True)
class _Relay:
    origin_addr: str
    origin_seq: int
    nack_at: float


@dataclass(slots=True)
class SwimStatistics:
    sent: dict[str, int] = field(default_factory=dict)
    sent_bytes: int = 0
    received: dict[str, int] = field(default_factory=dict)
    received_bytes: int = 0
    refused: int = 0
    foreign_cluster: int = 0
    probes: int = 0
    probes_failed: int = 0
    probes_abandoned_late: int = 0
    suspicions_raised: int = 0
    refutations: int = 0
    declared_dead: int = 0
    confirm_probes: int = 0
    checksum_syncs: int = 0


class SwimNode:
    def __init__(
        self,
        config: SwimConfig,
        *,
        node: str,
        addr: str,
        rng: random.Random,
        now: float,
        seeds: list[str] | tuple[str, ...] = (),
        incarnation: int = 0,
    ) -> None:
        self.config = config
        self.node = node
        self.addr = addr
        self.rng = rng
        self.table = MemberTable(me=node, addr=addr, now=now, incarnation=incarnation)
        self.table.members_max = config.members_max
        self.awareness = Awareness(config.awareness_max)
        self.broadcasts = BroadcastQueue(
            retransmit_mult=config.retransmit_mult, items_max=config.broadcast_queue_max
        )
        self.stats = SwimStatistics()
        self._outbox: list[tuple[str, bytes]] = []
        self._events: list[MemberEvent] = []
        self._seq = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._confirming: dict[int, tuple[str, float]] = {}
        self._last_sync_at = -math.inf
        self._seeds = [s for s in seeds if s != addr]
        self._joined = not self._seeds
        phase = rng.random()
        self._next_probe_at = now + phase * config.probe_interval_s
        self._next_gossip_at = now
        self._next_push_pull_at = now + rng.random() * config.push_pull_interval_s
        self._next_heal_at = now + rng.random() * config.heal_interval_s
        self._next_join_at = now
        self._next_reap_at = now + 10.0
        self._ring: tuple[int, list[str]] = (-1, [])
        self._rr: list[str] = []
        self._meta_version = 0
        self._gpu: GpuState | None = None
        self._current_src = ""
        # suspect -> the incarnation of the suspicion we have sent our last-chance ping for
        # (one such ping per suspicion).  Not a seq: that ping's ack matches nothing here and
        # counts only for the updates it carries (the suspect's refutation).  While a
        # suspect is absent or holds another incarnation, its deadline is the earlier
        # last-chance time (``_verify_at``), not its suspicion deadline.
        self._verifying: dict[str, int] = {}
        self._mismatch_run = 0
        self._early_target: str | None = None
        self._early_probed: dict[str, float] = {}
        self._refresh_suspicion_bounds()
        self._push(Alive(node=node, incarnation=incarnation, addr=addr), urgent=True)

    def bootstrap(self, now: float, members: list[tuple[str, str]]) -> None:
        """Start with these (node, addr) members known alive, as if already converged (for the
        simulator and tests; a real daemon joins through seeds)."""
        for node, addr in members:
            if node != self.node:
                self.table.apply(Alive(node=node, incarnation=0, addr=addr), now)
        self._joined = True
        self._refresh_suspicion_bounds()
        self._next_push_pull_at = now + self.rng.random() * self._push_pull_period()
        self.broadcasts = BroadcastQueue(
            retransmit_mult=self.config.retransmit_mult, items_max=self.config.broadcast_queue_max
        )

    # -- inputs ------------------------------------------------------------------------------

    def receive(self, now: float, data: bytes) -> None:
        try:
            msg = decode_gossip(data, bytes_max=self.config.message_bytes_max)
        except RemoteProtocolError:
            self.stats.refused += 1
            return
        if msg.cluster != self.config.cluster:
            self.stats.foreign_cluster += 1
            return
        name = type(msg).__name__
        self.stats.received[name] = self.stats.received.get(name, 0) + 1
        self.stats.received_bytes += len(data)
        self._current_src = msg.src_addr
        for update in msg.updates:
            self._apply(update, now)
        self._current_src = ""
        handler = _HANDLERS[type(msg)]
        handler(self, msg, now)

    def tick(self, now: float) -> None:
        cfg = self.config
        late = cfg.lateness_tolerance_s
        probe = self._probe
        if probe is not None:
            if not probe.indirect_sent and now >= probe.ack_deadline:
                if now - probe.ack_deadline > late:
                    self._abandon_probe_late()
                else:
                    self._send_ping_reqs(probe, now)
            probe = self._probe
            if probe is not None and now >= probe.final_deadline:
                if now - probe.final_deadline > late:
                    self._abandon_probe_late()
                else:
                    self._probe_failed(probe, now)
        for seq, relay in list(self._relays.items()):
            if now >= relay.nack_at:
                del self._relays[seq]
                self._send(relay.origin_addr, Nack(**self._hdr([]), seq=relay.origin_seq))
        for seq, (target, deadline) in list(self._confirming.items()):
            if now >= deadline:
                del self._confirming[seq]
                member = self.table.members.get(target)
                if member is not None and member.state is State.SUSPECT and now - deadline <= late:
                    self._apply(
                        Suspect(node=target, incarnation=member.incarnation, by=self.node), now
                    )
        self._fire_suspicions(now)
        if now >= self._next_probe_at:
            if now - self._next_probe_at > late + cfg.probe_interval_s:
                self.awareness.apply(+1)  # we missed our own schedule: we are the slow one
            self._start_probe(now)
        if self.broadcasts.urgent_pending and now >= self._next_gossip_at:
            self._gossip(now)
        if now >= self._next_push_pull_at:
            self._next_push_pull_at = now + self._push_pull_period()
            target = self._random_live()
            if target is not None:
                self._push_pull(self.table.members[target].addr, reply=True)
        if now >= self._next_heal_at:
            self._next_heal_at = now + cfg.heal_interval_s
            self._heal()
        if not self._joined and now >= self._next_join_at:
            self._next_join_at = now + cfg.join_retry_s
            for seed in self._seeds:
                self._push_pull(seed, reply=True, join=True)
        if now >= self._next_reap_at:
            self._next_reap_at = now + 10.0
            self.table.reap(now, dead_after_s=cfg.dead_reap_s, left_after_s=cfg.left_reap_s)

    def next_deadline(self) -> float:
        deadlines = [
            self._next_probe_at,
            self._next_push_pull_at,
            self._next_heal_at,
            self._next_reap_at,
        ]
        if self._probe is not None:
            deadlines.append(
                self._probe.final_deadline
                if self._probe.indirect_sent
                else self._probe.ack_deadline
            )
        if self.broadcasts.urgent_pending:
            deadlines.append(self._next_gossip_at)
        if not self._joined:
            deadlines.append(self._next_join_at)
        deadlines.extend(r.nack_at for r in self._relays.values())
        deadlines.extend(d for _, d in self._confirming.values())
        for node in sorted(self.table.suspects):
            suspicion = self.table.members[node].suspicion
            if suspicion is not None:
                deadline = suspicion.deadline()
                if self._verifying.get(node) != suspicion.incarnation:
                    deadline = self._verify_at(deadline)
                deadlines.append(deadline)
        return min(deadlines)

    def leave(self, now: float) -> None:
        """Announce a graceful leave (not a failure); keep ticking a few gossip intervals."""
        self.table.leaving = True
        self._push(Left(node=self.node, incarnation=self.table.incarnation), urgent=True)
        for target in self._random_live_sample(2 * self.config.gossip_fanout):
            self._send_gossip_to(target)

    def set_gpu(self, now: float, gpu: GpuState) -> None:
        """Publish new GPU state (its own version counter; rides piggyback)."""
        self._meta_version += 1
        self._gpu = gpu
        self._push(Meta(node=self.node, version=self._meta_version, gpu=gpu), urgent=False)

    def probe_soon(self, now: float, node: str) -> None:
        """A hint (e.g. its TCP connection dropped): probe ``node`` now, out of schedule.
        Never a verdict by itself; at most one early probe per member per probe interval."""
        member = self.table.members.get(node)
        if member is None or member.state not in LIVE_STATES:
            return
        if now - self._early_probed.get(node, -math.inf) < self.config.probe_interval_s:
            return
        self._early_probed[node] = now
        self._early_target = node
        if self._probe is None:
            self._next_probe_at = min(self._next_probe_at, now)

    def announce(self, now: float) -> None:
        """Re-announce ourselves with a new incarnation (e.g. our address changed)."""
        self.table.incarnation += 1
        self.table.live_version += 1
        self._push(
            Alive(node=self.node, incarnation=self.table.incarnation, addr=self.addr), urgent=True
        )

    # -- outputs -----------------------------------------------------------------------------

    def take_outbox(self) -> list[tuple[str, bytes]]:
        out, self._outbox = self._outbox, []
        return out

    def take_events(self) -> list[MemberEvent]:
        out, self._events = self._events, []
        return out

    @property
    def joined(self) -> bool:
        return self._joined

    # -- updates -----------------------------------------------------------------------------

    def _apply(self, update: Update, now: float) -> Outcome:
        outcome = self.table.apply(update, now)
        if outcome.event is not None:
            self._events.append(outcome.event)
        if outcome.refuted or outcome.stale_about_me:
            alive = Alive(node=self.node, incarnation=self.table.incarnation, addr=self.addr)
            # Tell the accuser and whoever carried the news directly; gossip does the rest.
            direct = {self._current_src} - {""}
            accuser = self.table.members.get(outcome.refute_to or "")
            if accuser is not None:
                direct.add(accuser.addr)
            if outcome.refuted:
                self.stats.refutations += 1
                self.awareness.apply(+1)
                self._push(alive, urgent=True)
            for addr in sorted(direct):
                self._send(addr, GossipOnly(**self._hdr([alive])))
            return outcome
        if outcome.rebroadcast:
            self._push(update, urgent=outcome.urgent)
        if outcome.changed and isinstance(update, Suspect | Dead | Left | Alive):
            self._refresh_suspicion_bounds()
        if isinstance(update, Suspect) and outcome.event is not None and update.by == self.node:
            self.stats.suspicions_raised += 1
        if outcome.confirm_probe is not None:
            self._maybe_confirm(outcome.confirm_probe, now)
        if outcome.confirm_to is not None:
            accuser = self.table.members.get(outcome.confirm_to)
            if accuser is not None:
                self._send(accuser.addr, GossipOnly(**self._hdr([update])))
        return outcome

    def _push(self, update: Update, *, urgent: bool) -> None:
        family = META if isinstance(update, Meta) else MEMBER
        self.broadcasts.push(
            (update.node, family), update, len(encode_update(update)), urgent=urgent
        )

    def _refresh_suspicion_bounds(self) -> None:
        cfg = self.config
        n = self.table.live_count()
        lo = suspicion_min_s(cfg.suspicion_mult, n, cfg.probe_interval_s, cfg.suspicion_floor_s)
        self.table.suspicion_min_s = lo
        self.table.suspicion_max_s = lo * cfg.suspicion_max_mult
        self.table.suspicion_k = max(0, min(cfg.suspicion_k, n - 2))

    def _verify_at(self, deadline: float) -> float:
        return deadline - self.awareness.scale(self.config.probe_deadline_s)

    def _fire_suspicions(self, now: float) -> None:
        for node in sorted(self.table.suspects):
            member = self.table.members[node]
            suspicion = member.suspicion
            if suspicion is None:
                continue
            if (
                now >= self._verify_at(suspicion.deadline())
                and self._verifying.get(node) != suspicion.incarnation
            ):
                # Last chance: ping it ourselves (carrying the suspicion), so that a member
                # that refuted while we missed the news answers us before we declare it dead.
                self._verifying[node] = suspicion.incarnation
                self._seq += 1
                self._ping(node, self._seq)
            if now < suspicion.deadline():
                continue
            if now - suspicion.deadline() > self.config.lateness_tolerance_s:
                # We were paused: let queued messages (a refutation?) in before deciding.
                suspicion.started_at += now - suspicion.deadline()
                continue
            self._verifying.pop(node, None)
            dead = self.table.declare_dead(node, now)
            if dead is not None:
                self.stats.declared_dead += 1
                self._apply(dead, now)

    # -- probing -----------------------------------------------------------------------------

    def _live_ring(self) -> list[str]:
        version = self.table.set_version
        if self._ring[0] != version:
            ring = [n for n, m in self.table.members.items() if m.state in LIVE_STATES]
            ring.append(self.node)
            ring.sort()
            self._ring = (version, ring)
        return self._ring[1]

    def _choose_target(self, now: float) -> str | None:
        ring = self._live_ring()
        n = len(ring)
        if n < 2:
            return None
        if self.config.coordinated_probing:
            rnd = int(now // self.config.probe_interval_s)
            pos = bisect.bisect_left(ring, self.node)
            return ring[(pos + 1 + rnd % (n - 1)) % n]
        while self._rr:
            candidate = self._rr.pop()
            member = self.table.members.get(candidate)
            if member is not None and member.state in LIVE_STATES:
                return candidate
        self._rr = [m for m in ring if m != self.node]
        self.rng.shuffle(self._rr)
        return self._rr.pop()

    def _start_probe(self, now: float) -> None:
        cfg = self.config
        self._next_probe_at = now + self.awareness.scale(cfg.probe_interval_s)
        target = self._choose_target(now)
        early, self._early_target = self._early_target, None
        if (
            early is not None
            and early in self.table.members
            and self.table.members[early].state in LIVE_STATES
        ):
            target = early
        if target is None:
            return
        self._seq += 1
        self.stats.probes += 1
        self._probe = _Probe(
            target=target,
            seq=self._seq,
            started=now,
            ack_deadline=now + self.awareness.scale(cfg.probe_timeout_s),
            final_deadline=now + self.awareness.scale(cfg.probe_deadline_s),
        )
        self._ping(target, self._seq)

    def _ping(self, target: str, seq: int) -> None:
        member = self.table.members[target]
        updates = self._piggyback(first=[(target, MEMBER), (self.node, MEMBER)])
        if member.state is State.SUSPECT and not any(u.node == target for u in updates):
            # Buddy system: a suspect always learns it is suspected when we ping it.
            updates.insert(0, Suspect(node=target, incarnation=member.incarnation, by=self.node))
        self._send(member.addr, Ping(**self._hdr(updates), seq=seq, target=target))

    def _send_ping_reqs(self, probe: _Probe, now: float) -> None:
        probe.indirect_sent = True
        target = self.table.members.get(probe.target)
        if target is None:
            self._probe = None
            return
        helpers = [
            n
            for n in self._random_live_sample(self.config.indirect_probes + 1)
            if n != probe.target
        ]
        helpers = helpers[: self.config.indirect_probes]
        probe.requested = len(helpers)
        # Also retry directly: one lost datagram should not cost a suspicion.
        self._ping(probe.target, probe.seq)
        for helper in helpers:
            req = PingReq(
                **self._hdr([]), seq=probe.seq, target=probe.target, target_addr=target.addr
            )
            self._send(self.table.members[helper].addr, req)

    def _probe_failed(self, probe: _Probe, now: float) -> None:
        self._probe = None
        self.stats.probes_failed += 1
        if probe.nacks < probe.requested:
            self.awareness.apply(+1)  # helpers did not answer either: suspect ourselves first
        member = self.table.members.get(probe.target)
        if member is not None and member.state in LIVE_STATES:
            self._apply(
                Suspect(node=probe.target, incarnation=member.incarnation, by=self.node), now
            )

    def _abandon_probe_late(self) -> None:
        self._probe = None
        self.stats.probes_abandoned_late += 1
        self.awareness.apply(+1)

    def _maybe_confirm(self, suspect: str, now: float) -> None:
        n = self.table.live_count()
        if self.rng.random() >= min(1.0, self.config.confirm_probes / max(1, n - 2)):
            return
        self._seq += 1
        self.stats.confirm_probes += 1
        self._confirming[self._seq] = (
            suspect,
            now + self.awareness.scale(self.config.probe_deadline_s),
        )
        self._ping(suspect, self._seq)

    # -- message handlers ----------------------------------------------------------------------

    def _on_ping(self, msg: Ping, now: float) -> None:
        if msg.target != self.node:
            return  # meant for whoever had this address before us
        updates = self._piggyback(first=[(msg.src, MEMBER), (self.node, MEMBER)])
        self._send(
            msg.src_addr, Ack(**self._hdr(updates), seq=msg.seq, checksum=self.table.checksum())
        )

    def _on_ack(self, msg: Ack, now: float) -> None:
        relay = self._relays.pop(msg.seq, None)
        if relay is not None:
            self._send(
                relay.origin_addr, Ack(**self._hdr([]), seq=relay.origin_seq, checksum=msg.checksum)
            )
            return
        if self._confirming.pop(msg.seq, None) is not None:
            return
        probe = self._probe
        if probe is None or msg.seq != probe.seq:
            return
        self._probe = None
        self.awareness.apply(-1)
        if msg.checksum and msg.src == probe.target:
            self._compare_checksum(msg.src, msg.checksum, now)

    def _on_nack(self, msg: Nack, now: float) -> None:
        if self._probe is not None and msg.seq == self._probe.seq:
            self._probe.nacks += 1

    def _on_ping_req(self, msg: PingReq, now: float) -> None:
        if len(self._relays) >= self.config.relays_max:
            return
        self._seq += 1
        self._relays[self._seq] = _Relay(
            msg.src_addr, msg.seq, now + self.awareness.scale(self.config.probe_timeout_s)
        )
        self._send(
            msg.target_addr, Ping(**self._hdr(self._piggyback()), seq=self._seq, target=msg.target)
        )

    def _on_push_pull(self, msg: PushPull, now: float) -> None:
        self._joined = True
        members = self.table.members
        for record in msg.members:
            # Fast path: most records say what we already know (a push-pull at N=2,000 carries
            # 2,000 of them; building updates for each would dominate the simulator's time).
            known = members.get(record.node)
            if (
                known is not None
                and known.incarnation == record.incarnation
                and known.state._value_ == record.state
                and known.meta_version >= record.meta_version
            ) or (
                record.node == self.node
                and record.incarnation <= self.table.incarnation
                and record.state == "alive"
            ):
                continue
            for update in self.table.merge_record(record, msg.src):
                self._apply(update, now)
        if msg.reply:
            self._push_pull(msg.src_addr, reply=False)

    def _on_gossip(self, msg: GossipOnly, now: float) -> None:
        return None  # its updates are already applied

    # -- sending -------------------------------------------------------------------------------

    def _hdr(self, updates: list[Update]) -> dict[str, object]:
        return {
            "cluster": self.config.cluster,
            "src": self.node,
            "src_addr": self.addr,
            "updates": updates,
        }

    def _piggyback(self, first: list[tuple[str, int]] | None = None) -> list[Update]:
        return self.broadcasts.select(
            self.config.piggyback_bytes_max, self.table.live_count(), first or ()
        )

    def _send(self, addr: str, msg: GossipMessage) -> None:
        data = encode_gossip(msg)
        name = type(msg).__name__
        self.stats.sent[name] = self.stats.sent.get(name, 0) + 1
        self.stats.sent_bytes += len(data)
        self._outbox.append((addr, data))

    def _send_gossip_to(self, target: str) -> None:
        updates = self._piggyback(first=[(target, MEMBER), (self.node, MEMBER)])
        if updates:
            self._send(self.table.members[target].addr, GossipOnly(**self._hdr(updates)))

    def _gossip(self, now: float) -> None:
        self._next_gossip_at = now + self.config.gossip_interval_s
        for target in self._random_live_sample(self.config.gossip_fanout):
            self._send_gossip_to(target)

    def _push_pull(self, addr: str, *, reply: bool, join: bool = False) -> None:
        records = self.table.records()
        if self._gpu is not None:
            records[0] = MemberRecord(
                node=self.node,
                addr=self.addr,
                incarnation=self.table.incarnation,
                state="alive",
                meta_version=self._meta_version,
                gpu=self._gpu,
            )
        self._send(addr, PushPull(**self._hdr([]), reply=reply, join=join, members=records))

    def _push_pull_period(self) -> float:
        n = self.table.live_count()
        scale = 1 + max(0, math.ceil(math.log2(max(n, 1)) - math.log2(32)))
        return self.config.push_pull_interval_s * scale

    def _heal(self) -> None:
        if not self.table.dead:
            return
        if self.rng.random() < min(1.0, self.config.heal_fanout / self.table.live_count()):
            node = self.rng.choice(sorted(self.table.dead))
            self._push_pull(self.table.members[node].addr, reply=True)

    def _compare_checksum(self, peer: str, checksum: int, now: float) -> None:
        """Consecutive probe acks whose live-set checksum differs from ours (from any peers)
        mean our view has drifted: reconcile with a push-pull, rate-limited."""
        if checksum == self.table.checksum():
            self._mismatch_run = 0
            return
        self._mismatch_run += 1
        if (
            self._mismatch_run >= self.config.checksum_mismatches_max
            and now - self._last_sync_at >= self.config.checksum_sync_s
        ):
            self._last_sync_at = now
            self._mismatch_run = 0
            self.stats.checksum_syncs += 1
            self._push_pull(self.table.members[peer].addr, reply=True)

    def _random_live(self) -> str | None:
        sample = self._random_live_sample(1)
        return sample[0] if sample else None

    def _random_live_sample(self, k: int) -> list[str]:
        ring = self._live_ring()
        others = len(ring) - 1
        if others <= 0:
            return []
        if k >= others:
            out = [n for n in ring if n != self.node]
            self.rng.shuffle(out)
            return out
        chosen: set[str] = set()
        while len(chosen) < k:
            candidate = ring[self.rng.randrange(len(ring))]
            if candidate != self.node:
                chosen.add(candidate)
        return sorted(chosen)


_HANDLERS = {
    Ping: SwimNode._on_ping,
    Ack: SwimNode._on_ack,
    Nack: SwimNode._on_nack,
    PingReq: SwimNode._on_ping_req,
    PushPull: SwimNode._on_push_pull,
    GossipOnly: SwimNode._on_gossip,
}
