"""One SWIM + Lifeguard member, sans-IO: the node that composes the mechanisms.

Inputs: ``receive(now, data)`` for each datagram, ``tick(now)`` when ``next_deadline()`` is
due, ``leave(now)``, ``set_gpu(now, gpu)``.  Outputs: ``take_outbox()`` -> [(addr, bytes)],
``take_events()`` -> [MemberEvent].  Time and randomness come from the caller (``now`` and the
``rng`` given to the constructor); nothing here reads a clock or the global random module.

One mechanism per file, as in memberlist:
- membership.py: the member table and its state rules (alive / suspect / dead / left).
- probing.py: failure detection: the probe schedule, ping / ping-req / ack / nack,
  confirmation probes, the last-chance ping, suspicion timers firing.
- dissemination.py: gossip: piggyback on every message, gossip rounds (broadcast.py queue).
- antientropy.py: push-pull, join through seeds, healing partitions, checksum sync.
- refusal.py: a refused connection to a member's port as evidence of its crash.
- suspicion.py and awareness.py: Lifeguard's timeout math and local health score.

This file owns what they share: the outbox and the events, the member table, awareness and
statistics, the peer sampling over the live ring, message dispatch, and ``apply``, the one way
an update changes the table (it refutes news about us, re-gossips what changed, and starts a
confirmation probe when the table asks for one).  ``tick`` runs the mechanisms' timers in a
fixed order: probing, gossip, anti-entropy, then reaping; the order is part of the trace.

Theory of operation: we probe one member per round and suspect it when neither it nor the
peers we ask answer; a suspicion becomes a death when its Lifeguard timer fires, unless the
suspect refutes (every ping to a suspect tells it, and it answers the accuser directly).
Updates ride piggyback on every message and membership changes are also pushed in gossip
rounds; push-pull repairs whatever gossip missed.  We slow down instead of accusing when we
are the slow one (awareness.py), and a timer that fires late (we were paused) gives incoming
messages a chance before it acts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gossipd.core.antientropy import AntiEntropy
from gossipd.core.awareness import Awareness
from gossipd.core.dissemination import Dissemination
from gossipd.core.fencing import Fence
from gossipd.core.gossip_messages import (
    INCARNATION_MAX,
    Ack,
    Alive,
    Dead,
    Directive,
    GossipHeader,
    GossipMessage,
    GossipOnly,
    GpuState,
    Left,
    LoadRecord,
    Meta,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Suspect,
    Term,
    Update,
    decode_gossip,
    encode_gossip,
    encode_update,
)
from gossipd.core.membership import MemberEvent, MemberTable, Outcome, State
from gossipd.core.probing import Prober
from gossipd.core.refusal import PortCheck, RefusalDetector
from gossipd.core.sharedtable import SharedBase
from gossipd.core.suspicion import suspicion_min_s
from gossipd.core.swim_config import SwimConfig
from gossipd.errors import RemoteProtocolError

REAP_INTERVAL_S = 10.0  # how often dead and left members past their reap age are forgotten


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
    # Push-pull exchanges we started sending (core/antientropy.py; their pages count as
    # PushPull in ``sent``), and those not started: one to that member was in progress, or
    # antientropy.STREAMS_MAX were.
    push_pulls: int = 0
    push_pulls_refused: int = 0
    # Prefix hashes left out of our published GPU state so that its Meta fits piggyback
    # (``SwimNode._fitting``): a prefix_summary_max too large for the names and addresses.
    prefixes_cut: int = 0


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
        on_loads: Callable[[list[LoadRecord]], None] | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.addr = addr
        self.rng = rng
        self.table = MemberTable(me=node, addr=addr, now=now, incarnation=incarnation)
        self.table.members_max = config.members_max
        self.awareness = Awareness(config.awareness_max)
        self.stats = SwimStatistics()
        self._outbox: list[tuple[str, bytes]] = []
        self._events: list[MemberEvent] = []
        # Leadership (issue 15): the highest term seen and the directives it admits.
        self.fence = Fence()
        self._leadership: list[Term | Directive] = []
        self._current_src = ""  # while applying a message's updates: who carried them
        self._next_reap_at = now + REAP_INTERVAL_S
        # Each mechanism draws its first timer's phase from rng here, in this order.
        self.dissemination = Dissemination(self, now)
        self.prober = Prober(self, now)
        self.antientropy = AntiEntropy(self, now, [s for s in seeds if s != addr])
        self.refusals = RefusalDetector(self, now)
        # Takes the load records a message carried (membership/loadgossip.py).
        self.on_loads = on_loads
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            Ping: self.prober.on_ping,
            Ack: self.prober.on_ack,
            Nack: self.prober.on_nack,
            PingReq: self.prober.on_ping_req,
            PushPull: self.antientropy.on_push_pull,
            GossipOnly: _on_gossip,
        }
        self._refresh_suspicion_bounds()
        self.dissemination.push(Alive(node=node, incarnation=incarnation, addr=addr), urgent=True)

    def bootstrap_shared(self, now: float, base: SharedBase) -> None:
        """``bootstrap`` from a table shared with other simulated members, copy-on-write
        (membership.shared_base, sharedtable.py): the simulator's O(N) start."""
        self.table.bootstrap_shared(base)
        self._refresh_suspicion_bounds()
        self.antientropy.bootstrap(now)
        self.dissemination.forget()

    def bootstrap(self, now: float, members: list[tuple[str, str]]) -> None:
        """Start with these (node, addr) members known alive, as if already converged (for the
        simulator and tests; a real daemon joins through seeds)."""
        for node, addr in members:
            if node != self.node:
                self.table.apply(Alive(node=node, incarnation=0, addr=addr), now)
        self._refresh_suspicion_bounds()
        self.antientropy.bootstrap(now)
        self.dissemination.forget()

    # -- inputs ------------------------------------------------------------------------------

    def receive(self, now: float, data: bytes) -> None:
        try:
            msg = decode_gossip(data, bytes_max=self.config.message_bytes_max)
        except RemoteProtocolError:
            self.stats.refused += 1
            return
        self.receive_message(now, msg, len(data))

    def receive_message(self, now: float, msg: GossipMessage, size_bytes: int) -> None:
        """A message already decoded and validated, of ``size_bytes`` on the wire (``receive``;
        the simulator hands over the sender's own message object, see simulations/netsim.py)."""
        if msg.cluster != self.config.cluster:
            self.stats.foreign_cluster += 1
            return
        name = type(msg).__name__
        self.stats.received[name] = self.stats.received.get(name, 0) + 1
        self.stats.received_bytes += size_bytes
        self._current_src = msg.src_addr
        for update in msg.updates:
            self.apply(update, now)
        if msg.loads and self.on_loads is not None:  # load records (core/loadstate.py)
            self.on_loads(msg.loads)
        if msg.term is not None:
            self.apply(msg.term, now)
        self._current_src = ""
        self._handlers[type(msg)](msg, now)

    def tick(self, now: float) -> None:
        self.prober.tick(now)
        self.dissemination.tick(now)
        self.antientropy.tick(now)
        if now >= self._next_reap_at:
            self._next_reap_at = now + REAP_INTERVAL_S
            cfg = self.config
            self.table.reap(now, dead_after_s=cfg.dead_reap_s, left_after_s=cfg.left_reap_s)

    def next_deadline(self) -> float:
        # Asked after every input (the simulator: after every event), so no lists built here.
        return min(
            self._next_reap_at,
            self.prober.next_deadline(),
            self.dissemination.next_deadline(),
            self.antientropy.next_deadline(),
        )

    def leave(self, now: float) -> None:
        """Announce a graceful leave (not a failure); keep ticking a few gossip intervals."""
        self.table.leaving = True
        self.dissemination.push(
            Left(node=self.node, incarnation=self.table.incarnation), urgent=True
        )
        for target in self.random_live_sample(2 * self.config.gossip_fanout):
            self.dissemination.send_gossip_to(target)

    @property
    def gpu(self) -> GpuState | None:
        """Our latest published GPU state."""
        return self.table.gpu

    @property
    def meta_version(self) -> int:
        """The version of our latest published GPU state (its incarnation: table.meta_incarnation)."""
        return self.table.meta_version

    def set_gpu(self, now: float, gpu: GpuState) -> None:
        """Publish new GPU state (its own version counter, at our incarnation; rides piggyback)."""
        self.dissemination.push(self.table.publish_meta(self._fitting(gpu)), urgent=False)

    def _fitting(self, gpu: GpuState) -> GpuState:
        """``gpu`` with its prefix summary cut (least seen last: cut first) until its Meta
        fits ``piggyback_bytes_max``: a larger Meta never rides piggyback and, being not
        urgent, no gossip round carries it, so its news (a drain, a new rpc address) waited
        for push-pull (tens of seconds: 256 prefixes made a 1,663-byte Meta)."""
        budget = self.config.piggyback_bytes_max
        table = self.table
        while True:
            meta = Meta(node=self.node, version=table.meta_version + 1, gpu=gpu,
                        incarnation=table.incarnation)  # fmt: skip
            excess = len(encode_update(meta)) - budget
            if excess <= 0 or not gpu.prefixes:
                return gpu
            self.stats.prefixes_cut += min(len(gpu.prefixes), excess // 5 + 1)
            gpu = msgspec.structs.replace(
                gpu, prefixes=gpu.prefixes[: max(0, len(gpu.prefixes) - (excess // 5 + 1))]
            )

    def _republish_gpu(self) -> None:
        """Our incarnation rose: publish our GPU state again at the new one (membership rule 6),
        so that it outranks whatever a previous life of ours published."""
        if self.table.gpu is not None:
            self.dissemination.push(self.table.publish_meta(self.table.gpu), urgent=False)

    def probe_soon(self, now: float, node: str) -> None:
        """A hint (e.g. its TCP connection dropped): probe ``node`` now, out of schedule.
        Never a verdict by itself; at most one early probe per member per probe interval."""
        self.prober.probe_soon(now, node)

    def connection_lost(self, now: float, node: str) -> None:
        """Our connection to ``node`` dropped (its socket monitor): probe it now and check
        whether its port refuses connections (``take_port_checks``).  A hint, not a verdict."""
        self.prober.probe_soon(now, node)
        self.refusals.want(now, node)

    def take_port_checks(self) -> list[PortCheck]:
        """The members whose gossip port the driver should try to connect to, then report
        with ``port_checked`` (core/refusal.py)."""
        return self.refusals.take()

    def port_checked(self, now: float, check: PortCheck, *, refused: bool) -> str:
        """What a connect to ``check.addr`` found: ``refused`` only for a refusal (nothing
        listening); returns the verdict (refusal.VERDICTS).  A refusal of the life that was
        checked declares it dead at once, within the refusal budget."""
        return self.refusals.checked(now, check, refused=refused)

    def announce(self, now: float) -> None:
        """Re-announce ourselves with a new incarnation (e.g. our address changed)."""
        self.table.incarnation = min(self.table.incarnation + 1, INCARNATION_MAX)
        self.table.live_version += 1
        self.dissemination.push(
            Alive(node=self.node, incarnation=self.table.incarnation, addr=self.addr), urgent=True
        )
        self._republish_gpu()

    # -- outputs -----------------------------------------------------------------------------

    def take_outbox(self) -> list[tuple[str, bytes]]:
        out, self._outbox = self._outbox, []
        return out

    def take_events(self) -> list[MemberEvent]:
        out, self._events = self._events, []
        return out

    def take_leadership(self) -> list[Term | Directive]:
        """Terms that raised our highest term and directives admitted, in order."""
        out, self._leadership = self._leadership, []
        return out

    # -- leadership ----------------------------------------------------------------------------

    def publish_term(self, now: float, term: Term) -> None:
        """We lead: announce (again) our term, urgent, whether or not it is news here."""
        self.apply(term, now)
        self.dissemination.push(term, urgent=True)

    def publish_directive(self, now: float, directive: Directive) -> bool:
        """We lead: apply ``directive`` here and gossip it (False: our fence refused it)."""
        return self.apply(directive, now).changed

    def _apply_leadership(self, update: Term | Directive, now: float) -> Outcome:
        """A term is passed on only when it raised ours; a directive only when admitted."""
        fence = self.fence
        if isinstance(update, Term):
            if not fence.observe(update):
                return Outcome()
            self._leadership.append(update)
        else:
            before = fence.term
            if not fence.admit(update):
                return Outcome()
            if fence.term is not before and fence.term is not None:
                self._leadership.append(fence.term)
            self._leadership.append(update)
        self.dissemination.push(update, urgent=True)
        return Outcome(changed=True, rebroadcast=True)

    def forget(self, node: str, incarnation: int, now: float) -> bool:
        """The leader's forget directive (MemberTable.forget, rule 9), applied here.  A member
        forgotten while suspect (a stale push-pull had brought it back) is reported dead
        first: our listeners heard it joined or suspect, and drop it only on a death."""
        member = self.table.members.get(node)
        suspect = member is not None and member.state is State.SUSPECT
        if not self.table.forget(node, incarnation, now):
            return False
        if suspect:
            assert member is not None
            self._events.append(MemberEvent("dead", node, member.incarnation, now))
        return True

    @property
    def joined(self) -> bool:
        return self.antientropy.joined

    # -- shared by the mechanisms (not for drivers) ------------------------------------------

    def apply(self, update: Update, now: float) -> Outcome:
        """Apply one update to the table and act on its outcome: report the event, refute
        news about us (directly to the accuser and the carrier too), re-gossip what changed,
        start a confirmation probe, tell the accuser we confirm."""
        if isinstance(update, Term | Directive):
            return self._apply_leadership(update, now)
        outcome = self.table.apply(update, now)
        if outcome.event is not None:
            self._events.append(outcome.event)
        if outcome.leave_again:
            self.dissemination.push(
                Left(node=self.node, incarnation=self.table.incarnation), urgent=True
            )
            return outcome
        contain = self.config.contain_suspicions
        if outcome.refuted or outcome.stale_about_me:
            # A refutation of a (contained) suspicion is quiet: those who know of the
            # suspicion hear it directly; everyone else only needs our new incarnation,
            # which rides piggyback.  A refutation of a death is gossiped in rounds.
            quiet = contain and isinstance(update, Suspect)
            alive = Alive(
                node=self.node, incarnation=self.table.incarnation, addr=self.addr, quiet=quiet
            )
            # Tell the accuser and whoever carried the news directly; gossip does the rest.
            direct = {self._current_src} - {""}
            accuser = self.table.members.get(outcome.refute_to or "")
            if accuser is not None:
                direct.add(accuser.addr)
            if outcome.refuted:
                self.stats.refutations += 1
                self.awareness.apply(+1)
                self.dissemination.push(alive, urgent=not quiet)
                self._republish_gpu()
            for addr in sorted(direct):
                self.send(addr, GossipOnly(**self.header([alive])))
            return outcome
        if outcome.rebroadcast and not (contain and isinstance(update, Suspect)):
            # A quiet Alive that only raises an incarnation rides piggyback; one that brings
            # a member back (joined) is news for everyone.
            quiet = isinstance(update, Alive) and update.quiet
            kind = outcome.event.kind if outcome.event is not None else ""
            urgent = outcome.urgent and not (quiet and kind == "alive")
            self.dissemination.push(update, urgent=urgent)
        if outcome.changed and isinstance(update, Suspect | Dead | Left | Alive):
            self._refresh_suspicion_bounds()
        if isinstance(update, Suspect) and outcome.event is not None and update.by == self.node:
            self.stats.suspicions_raised += 1
            if contain:
                self._tell_suspicion(update)
        if outcome.confirm_probe is not None:
            self.prober.maybe_confirm(outcome.confirm_probe, now)
        if outcome.confirm_to is not None:
            accuser = self.table.members.get(outcome.confirm_to)
            if accuser is not None:
                self.send(accuser.addr, GossipOnly(**self.header([update])))
        return outcome

    def _tell_suspicion(self, suspect: Suspect) -> None:
        """A contained suspicion we raised: tell the suspect (so that it refutes at once) and
        ``confirm_probes`` random members (who probe it: confirm, or carry it to the suspect)."""
        member = self.table.members[suspect.node]
        sample = self.random_live_sample(self.config.confirm_probes + 1)
        confirmers = [n for n in sample if n != suspect.node][: self.config.confirm_probes]
        for addr in [member.addr, *(self.table.members[n].addr for n in confirmers)]:
            self.send(addr, GossipOnly(**self.header([suspect])))

    def header(self, updates: list[Update]) -> GossipHeader:
        """The fields every gossip message starts with, carrying ``updates``."""
        return {
            "cluster": self.config.cluster,
            "src": self.node,
            "src_addr": self.addr,
            "updates": updates,
            "term": self.fence.term,
        }

    def send(self, addr: str, msg: GossipMessage) -> None:
        data = encode_gossip(msg)
        self.count_sent(msg, len(data))
        self._outbox.append((addr, data))

    def count_sent(self, msg: GossipMessage, size_bytes: int) -> None:
        self.count_sent_as(type(msg).__name__, size_bytes)

    def count_sent_as(self, name: str, size_bytes: int) -> None:
        sent = self.stats.sent
        sent[name] = sent.get(name, 0) + 1
        self.stats.sent_bytes += size_bytes

    def send_encoded(self, addr: str, name: str, data: bytes) -> None:
        """Send a message already encoded (a push-pull page), counted as ``name``."""
        self.count_sent_as(name, len(data))
        self._outbox.append((addr, data))

    def send_page(self, addr: str, msg: PushPull, size_bytes: int) -> None:
        """Send a push-pull page built of record objects whose encoded size (``size_bytes``)
        is already known: a simulated member's shared table (antientropy.py).  Here it is
        encoded; the simulator's node hands the object over instead (simulations/netsim.py)."""
        self.send(addr, msg)

    def live_ring(self) -> list[str]:
        """The sorted names of the live members, us included (kept by the table)."""
        return self.table.live_ring()

    def random_live(self) -> str | None:
        sample = self.random_live_sample(1)
        return sample[0] if sample else None

    def random_live_sample(self, k: int) -> list[str]:
        """Up to ``k`` distinct live members other than us, drawn from ``rng``."""
        ring = self.live_ring()
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

    def _refresh_suspicion_bounds(self) -> None:
        cfg = self.config
        n = self.table.live_count()
        # Lifeguard scales the minimum with log N because a gossiped suspicion and its gossiped
        # refutation must cross the whole cluster; a contained one's refutation goes straight
        # to the few who hold it, so the minimum is the floor at every N (MEMBERSHIP.md).
        scale_n = 1 if cfg.contain_suspicions else n
        lo = suspicion_min_s(
            cfg.suspicion_mult, scale_n, cfg.probe_interval_s, cfg.suspicion_floor_s
        )
        self.table.suspicion_min_s = lo
        self.table.suspicion_max_s = lo * cfg.suspicion_max_mult
        self.table.suspicion_k = max(0, min(cfg.suspicion_k, n - 2))


def _on_gossip(msg: GossipOnly, now: float) -> None:
    return None  # its updates are already applied
