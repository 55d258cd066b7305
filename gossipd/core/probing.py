"""SWIM failure detection at one member: the probe schedule, ping / ping-req / ack / nack,
confirmation probes and the last-chance ping before a suspect is declared dead (sans-IO).

Owns: the probe sequence counter (one counter for every ping we originate or relay), the probe
in flight, the ping-reqs we relay for others, our confirmation probes, our last-chance pings,
the early-probe hints, and the next scheduled probe time.  It sends through its SwimNode and
changes membership only through ``SwimNode.apply`` (a Suspect, a Dead).

Rules:
1. At most one probe in flight.  Every probe interval (scaled by awareness) we ping one member;
   no ack within probe_timeout -> a second direct ping plus ping-req through
   ``indirect_probes`` peers (they relay, and nack when the target is silent to them too);
   no ack by probe_deadline -> we suspect it (and are a witness, see suspicion.py).
   Rule 1a: the helpers are members we do not suspect, as far as there are enough.
2. Targets follow a shared schedule: in round r = floor(now / probe_interval) the member at
   ring position p probes position p + 1 + (r mod (n - 1)).  With agreeing views every member
   is probed exactly once per round.  Without coordinated probing: a shuffled round robin.
   Rule 2a: with contain_suspicions, while some are suspect, the round's target is the first
   member from that position on that is neither us nor suspect (their holders ping them).
   Rule 2b: a probe that made a member newly suspect is followed by the next at once.
3. An early-probe hint (``probe_soon``) replaces the next scheduled target, at most once per
   member per probe interval; it is never a verdict by itself.
4. Buddy system: every ping to a suspect carries the suspicion, so the suspect learns it and
   refutes.
5. A member hearing a new suspicion probes the suspect (with probability
   confirm_probes / (n - 2) when suspicions are gossiped to all, 1 when they are contained
   and only the members the accuser chose hear it): no ack by probe_deadline -> it confirms.
6. Before declaring a suspect dead we ping it once ourselves (one last-chance ping per
   suspicion, probe_deadline before its timer fires), so a refutation we missed reaches us.
7. A timer that fires later than lateness_tolerance (we were paused) does not act: the probe
   is abandoned (awareness +1), the confirmation dropped, the suspicion timer pushed back, so
   that queued messages (a refutation?) get in first.
8. An ack that is late (the probe goes indirect) also asks for a check of the target's port
   (core/refusal.py): a refusal there means its process is gone.
9. Awareness: +1 when we miss our own schedule, when a probe fails and no helper even
   nacked, when a timer fires late; -1 for each probe acked.
9. Contained suspicions: while we hold a suspicion (accuser, confirmer or not), we ping the
   suspect every probe_timeout (scaled by awareness).  Only a few members hold one, and each
   ping that arrives makes a healthy suspect answer us and the accuser directly, so its
   refutation does not depend on one datagram.  Each ack matches nothing here.
10. A failed probe for which at least one helper nacked (so we hear in time) also makes
    suspect the helpers that neither acked nor nacked (at least SILENT_HELPERS_MIN, 1):
    they did not answer our ping-req either.  A member cut off with a few others suspects
    everyone beyond the cut in its first failed probes instead of one member per round
    (issue 24).  No nack at all: awareness rises instead (rule 9).
11. Each probe interval (not scaled by awareness), with probability heal_fanout / N (N: the
    members alive in our view, few on a cut-off side), we ping
    one member declared dead within the last DEAD_PING_S (30 s), carrying its death: after a
    partition heals, the two sides find each other within a round or two instead of at the
    next heal push-pull.  An ack to a ping from a member we hold dead carries its death, so
    that it refutes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipd.core.dissemination import MEMBER
from gossipd.core.gossip_messages import Ack, Dead, Left, Nack, Ping, PingReq, Suspect
from gossipd.core.membership import LIVE_STATES, State
from gossipd.core.suspicion import Suspicion

if TYPE_CHECKING:
    from gossipd.core.swim import SwimNode

# Rule 11: members declared dead this recently get a ping now and then (memberlist gossips to
# the dead for 30 s on a LAN), so that a healed partition is found within a round or two.
DEAD_PING_S = 30.0
# Rule 10 needs this many silent helpers.  1: under 10% loss at N=64 it about doubles the
# suspicions of healthy members (all refuted: 0 false deaths) and leaves crash detection as
# it was (320 crashes: p50 2.73 -> 2.80 s, p99 3.80 -> 3.86 s); 2 would spare the suspicions
# but lose the cut for the side beyond which only two members lie.
SILENT_HELPERS_MIN = 1
# probe_soon's memory of whom it probed early: past this many, those probed more than a probe
# interval ago are forgotten (it held every name ever probed early).
EARLY_PROBED_MAX = 64


@dataclass(slots=True)
class Probe:
    target: str
    seq: int
    started: float
    ack_deadline: float
    final_deadline: float
    indirect_sent: bool = False
    nacks: int = 0
    requested: int = 0
    helpers: tuple[str, ...] = ()  # the members asked to ping-req the target
    nacked: tuple[str, ...] = ()  # those of them that nacked


@dataclass(slots=True)
class Relay:
    origin_addr: str
    origin_seq: int
    nack_at: float


class Prober:
    def __init__(self, swim: SwimNode, now: float) -> None:
        self._swim = swim
        self.seq = 0
        self.probe: Probe | None = None
        self.relays: dict[int, Relay] = {}  # our seq -> the ping-req we relay
        self.confirming: dict[int, tuple[str, float]] = {}  # seq -> (suspect, deadline)
        # suspect -> the incarnation of the suspicion we have sent our last-chance ping for
        # (rule 6: one per suspicion).  Not a seq: that ping's ack matches nothing here and
        # counts only for the updates it carries (the suspect's refutation).  While a
        # suspect is absent or holds another incarnation, its deadline is the earlier
        # last-chance time (``verify_at``), not its suspicion deadline.
        self.verifying: dict[str, int] = {}
        # Contained suspicions (rule 9): suspect -> (incarnation, when we ping it next).
        self.repinging: dict[str, tuple[int, float]] = {}
        self.next_probe_at = now + swim.rng.random() * swim.config.probe_interval_s
        self._rr: list[str] = []
        self._early_target: str | None = None
        self._early_probed: dict[str, float] = {}
        self.next_dead_ping_at = now  # rule 11 (only while some member is dead)

    # -- timers --------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        swim, cfg = self._swim, self._swim.config
        late = cfg.lateness_tolerance_s
        probe = self.probe
        if probe is not None:
            if not probe.indirect_sent and now >= probe.ack_deadline:
                if now - probe.ack_deadline > late:
                    self._abandon_probe_late()
                else:
                    self._send_ping_reqs(probe, now)
            probe = self.probe
            if probe is not None and now >= probe.final_deadline:
                if now - probe.final_deadline > late:
                    self._abandon_probe_late()
                else:
                    self._probe_failed(probe, now)
        for seq, relay in list(self.relays.items()):
            if now >= relay.nack_at:
                del self.relays[seq]
                swim.send(relay.origin_addr, Nack(**swim.header([]), seq=relay.origin_seq))
        for seq, (target, deadline) in list(self.confirming.items()):
            if now >= deadline:
                del self.confirming[seq]
                member = swim.table.members.get(target)
                if member is not None and member.state is State.SUSPECT and now - deadline <= late:
                    swim.apply(
                        Suspect(node=target, incarnation=member.incarnation, by=swim.node), now
                    )
        self._fire_suspicions(now)
        if now >= self.next_dead_ping_at:
            # Not scaled by awareness: a member cut off from all has the highest score.
            self.next_dead_ping_at = now + cfg.probe_interval_s
            self._ping_the_dead(now)
        if now >= self.next_probe_at:
            if now - self.next_probe_at > late + cfg.probe_interval_s:
                swim.awareness.apply(+1)  # we missed our own schedule: we are the slow one
            self._start_probe(now)

    def next_deadline(self) -> float:
        """``min(deadlines())``, without building the list in the common case (no relays,
        confirmations or suspects): the simulator asks after every event."""
        at = self.next_probe_at
        if self._swim.table.dead and self.next_dead_ping_at < at:
            at = self.next_dead_ping_at
        probe = self.probe
        if probe is not None:
            due = probe.final_deadline if probe.indirect_sent else probe.ack_deadline
            if due < at:
                at = due
        if self.relays or self.confirming or self._swim.table.suspects:
            return min(at, *self.deadlines())
        return at

    def deadlines(self) -> list[float]:
        swim = self._swim
        deadlines = [self.next_probe_at]
        if swim.table.dead:
            deadlines.append(self.next_dead_ping_at)
        if self.probe is not None:
            deadlines.append(
                self.probe.final_deadline if self.probe.indirect_sent else self.probe.ack_deadline
            )
        deadlines.extend(r.nack_at for r in self.relays.values())
        deadlines.extend(d for _, d in self.confirming.values())
        can_confirm = self.can_confirm()
        for node in sorted(swim.table.suspects):
            suspicion = swim.table.members[node].suspicion
            if suspicion is not None:
                deadline = suspicion.deadline(can_confirm)
                if self.verifying.get(node) != suspicion.incarnation:
                    deadline = self.verify_at(deadline)
                deadlines.append(deadline)
                if swim.config.contain_suspicions:
                    deadlines.append(self._reping_at(node, suspicion))
        return deadlines

    def can_confirm(self) -> int:
        """The members that could confirm a suspicion: live, not suspect, not us
        (suspicion.py caps K with it)."""
        table = self._swim.table
        return table.live_count() - 1 - len(table.suspects)

    def _reping_at(self, node: str, suspicion: Suspicion) -> float:
        """When we ping ``node`` again while we hold this suspicion of it (rule 9)."""
        inc, at = self.repinging.get(node, (-1, 0.0))
        if inc != suspicion.incarnation:
            return suspicion.started_at + self._reping_interval_s()
        return at

    def _reping_interval_s(self) -> float:
        return self._swim.awareness.scale(self._swim.config.probe_timeout_s)

    def verify_at(self, deadline: float) -> float:
        """When to send the last-chance ping to a suspect whose timer fires at ``deadline``."""
        return deadline - self._swim.awareness.scale(self._swim.config.probe_deadline_s)

    def _fire_suspicions(self, now: float) -> None:
        swim = self._swim
        contain = swim.config.contain_suspicions
        for node in [n for n in self.repinging if n not in swim.table.suspects]:
            del self.repinging[node]
        # (a suspicion refuted, or a member gone, leaves nothing behind: these held every
        # name ever suspected or probed early)
        for node in [n for n in self.verifying if n not in swim.table.suspects]:
            del self.verifying[node]
        can_confirm = self.can_confirm()
        for node in sorted(swim.table.suspects):
            member = swim.table.members[node]
            suspicion = member.suspicion
            if suspicion is None:
                continue
            deadline = suspicion.deadline(can_confirm)
            if contain and now >= self._reping_at(node, suspicion):
                # Rule 9: each ping carries the suspicion; the suspect answers it directly.
                self.repinging[node] = (suspicion.incarnation, now + self._reping_interval_s())
                self.seq += 1
                self.ping(node, self.seq)
            if (
                now >= self.verify_at(deadline)
                and self.verifying.get(node) != suspicion.incarnation
            ):
                # Last chance: ping it ourselves (carrying the suspicion), so that a member
                # that refuted while we missed the news answers us before we declare it dead.
                self.verifying[node] = suspicion.incarnation
                self.seq += 1
                self.ping(node, self.seq)
                if deadline <= now:
                    # K shrank past the deadline: its answer still gets a probe timeout.
                    suspicion.started_at += now - deadline + swim.config.probe_timeout_s
                    continue
            if now < deadline:
                continue
            if now - deadline > swim.config.lateness_tolerance_s:
                # We were paused: let queued messages (a refutation?) in before deciding.
                suspicion.started_at += now - deadline
                continue
            self.verifying.pop(node, None)
            dead = swim.table.declare_dead(node, now)
            if dead is not None:
                swim.stats.declared_dead += 1
                swim.apply(dead, now)

    # -- probing -------------------------------------------------------------------------------

    def probe_soon(self, now: float, node: str) -> None:
        member = self._swim.table.members.get(node)
        if member is None or member.state not in LIVE_STATES:
            return
        if now - self._early_probed.get(node, -math.inf) < self._swim.config.probe_interval_s:
            return
        early = self._early_probed
        if len(early) >= EARLY_PROBED_MAX:  # forget those past their interval
            interval = self._swim.config.probe_interval_s
            for name in [n for n, at in early.items() if now - at >= interval]:
                del early[name]
        early[node] = now
        self._early_target = node
        if self.probe is None:
            self.next_probe_at = min(self.next_probe_at, now)

    def _choose_target(self, now: float) -> str | None:
        swim = self._swim
        ring = swim.live_ring()
        n = len(ring)
        if n < 2:
            return None
        if swim.config.coordinated_probing:
            rnd = int(now // swim.config.probe_interval_s)
            pos = bisect.bisect_left(ring, swim.node)
            first = (pos + 1 + rnd % (n - 1)) % n
            suspects = swim.table.suspects
            if suspects and swim.config.contain_suspicions:
                # Rule 2a: with contain_suspicions, a suspect is pinged by those who hold its
                # suspicion (rule 9): the round goes to the next member in ring order that is
                # not (issue 24).  Without it nobody else pings a suspect, so it stays in turn.
                for step in range(n):
                    candidate = ring[(first + step) % n]
                    if candidate == swim.node:
                        continue
                    if candidate not in suspects:
                        return candidate
            return ring[first]
        while self._rr:
            candidate = self._rr.pop()
            member = swim.table.members.get(candidate)
            if member is not None and member.state in LIVE_STATES:
                return candidate
        self._rr = [m for m in ring if m != swim.node]
        swim.rng.shuffle(self._rr)
        return self._rr.pop()

    def _ping_the_dead(self, now: float) -> None:
        """Rule 11: with probability heal_fanout / (members alive in our view), ping one
        member declared dead less than DEAD_PING_S ago.  The ping carries its death: if it is alive (the partition healed)
        it refutes at once, to us directly, and its ack tells us whether it holds us dead."""
        swim = self._swim
        table = swim.table
        if not table.dead:
            return
        recent = sorted(n for n in table.dead if now - table.members[n].state_since < DEAD_PING_S)
        if not recent or swim.rng.random() >= min(
            1.0, swim.config.heal_fanout / table.live_count()
        ):
            return
        self.seq += 1
        self.ping(swim.rng.choice(recent), self.seq)

    def _start_probe(self, now: float) -> None:
        swim, cfg = self._swim, self._swim.config
        self.next_probe_at = now + swim.awareness.scale(cfg.probe_interval_s)
        target = self._choose_target(now)
        early, self._early_target = self._early_target, None
        members = swim.table.members
        if early is not None and early in members and members[early].state in LIVE_STATES:
            target = early
        if target is None:
            return
        self.seq += 1
        swim.stats.probes += 1
        self.probe = Probe(
            target=target,
            seq=self.seq,
            started=now,
            ack_deadline=now + swim.awareness.scale(cfg.probe_timeout_s),
            final_deadline=now + swim.awareness.scale(cfg.probe_deadline_s),
        )
        self.ping(target, self.seq)

    def ping(self, target: str, seq: int) -> None:
        swim = self._swim
        member = swim.table.members[target]
        updates = swim.dissemination.piggyback(first=[(target, MEMBER), (swim.node, MEMBER)])
        # (Another update about the target, its Meta or an older Alive, does not count: the
        # suspect must hear the suspicion itself, or it never refutes.)
        if member.state is State.SUSPECT and not any(
            type(u) in (Suspect, Dead) and u.node == target  # type: ignore[union-attr]
            for u in updates
        ):
            # Buddy system: a suspect always learns it is suspected when we ping it, and by
            # whom first (so that its refutation goes straight to the accuser too).
            accuser = swim.node if member.suspicion is None else member.suspicion.accuser
            updates.insert(0, Suspect(node=target, incarnation=member.incarnation, by=accuser))
        elif member.state is State.DEAD and not any(
            type(u) is Dead and u.node == target for u in updates
        ):
            # Rule 11: a member we hold dead learns it, and refutes if it is alive.
            updates.insert(0, Dead(node=target, incarnation=member.incarnation, by=swim.node))
        swim.send(member.addr, Ping(**swim.header(updates), seq=seq, target=target))

    def _send_ping_reqs(self, probe: Probe, now: float) -> None:
        swim = self._swim
        probe.indirect_sent = True
        swim.refusals.want(now, probe.target)  # is it gone, or only slow? (core/refusal.py)
        target = swim.table.members.get(probe.target)
        if target is None:
            self.probe = None
            return
        k = swim.config.indirect_probes
        suspects = swim.table.suspects
        if suspects:
            # Rule 1a: members we do not suspect first (a suspect is likely unable to help).
            many = swim.table.live_count() - 1 - len(suspects) > k
            sample = swim.random_live_sample(
                k + 1 + len(suspects) if many else swim.table.live_count()
            )
            helpers = [n for n in sample if n != probe.target and n not in suspects]
            helpers += [n for n in sample if n != probe.target and n in suspects]
        else:
            helpers = [n for n in swim.random_live_sample(k + 1) if n != probe.target]
        helpers = helpers[:k]
        probe.requested = len(helpers)
        probe.helpers = tuple(helpers)
        # Also retry directly: one lost datagram should not cost a suspicion.
        self.ping(probe.target, probe.seq)
        for helper in helpers:
            req = PingReq(
                **swim.header([]), seq=probe.seq, target=probe.target, target_addr=target.addr
            )
            swim.send(swim.table.members[helper].addr, req)

    def _probe_failed(self, probe: Probe, now: float) -> None:
        swim = self._swim
        self.probe = None
        swim.stats.probes_failed += 1
        if probe.requested and not probe.nacks:
            # No helper answered either: suspect ourselves first.  One nack is enough to
            # show that we send and hear in time (a helper cut off with the target, or gone,
            # says nothing about us: issue 24).
            swim.awareness.apply(+1)
        suspects = [probe.target]
        silent = [h for h in probe.helpers if h not in probe.nacked]
        if probe.nacked and len(silent) >= SILENT_HELPERS_MIN:
            # Rule 10: a nack came, so we hear in time; helpers that neither acked nor
            # nacked did not answer us either: they are suspect too (we are cut off).
            suspects += silent
        fresh = False
        for node in suspects:
            member = swim.table.members.get(node)
            if member is not None and member.state in LIVE_STATES:
                fresh = fresh or member.state is State.ALIVE
                swim.apply(Suspect(node=node, incarnation=member.incarnation, by=swim.node), now)
        if fresh:
            # Rule 2b: a new suspicion: probe the next member (rule 2a) now, not next round.
            self.next_probe_at = min(self.next_probe_at, now)

    def _abandon_probe_late(self) -> None:
        self.probe = None
        self._swim.stats.probes_abandoned_late += 1
        self._swim.awareness.apply(+1)

    def maybe_confirm(self, suspect: str, now: float) -> None:
        """We just heard a new suspicion of ``suspect``: probe it ourselves, with probability
        confirm_probes / (n - 2) (rule 5)."""
        swim = self._swim
        n = swim.table.live_count()
        # Contained: only the members the accuser chose hear it (and push-pull readers).
        chance = swim.config.confirm_probes / max(1, n - 2)
        if not swim.config.contain_suspicions and swim.rng.random() >= min(1.0, chance):
            return
        self.seq += 1
        swim.stats.confirm_probes += 1
        self.confirming[self.seq] = (
            suspect,
            now + swim.awareness.scale(swim.config.probe_deadline_s),
        )
        self.ping(suspect, self.seq)

    # -- message handlers ----------------------------------------------------------------------

    def on_ping(self, msg: Ping, now: float) -> None:
        swim = self._swim
        if msg.target != swim.node:
            return  # meant for whoever had this address before us
        updates = swim.dissemination.piggyback(first=[(msg.src, MEMBER), (swim.node, MEMBER)])
        pinger = swim.table.members.get(msg.src)
        if pinger is not None and pinger.state is State.DEAD:
            # Rule 11: a member we hold dead pings us (a partition healed): it learns it
            # from our ack, and refutes.
            updates.insert(0, Dead(node=msg.src, incarnation=pinger.incarnation, by=swim.node))
        elif pinger is not None and pinger.state is State.LEFT:
            # ... or left (restarted since, at a lower incarnation, and the seeds reaped it):
            # refuted at once, not after a checksum-led push-pull seconds later.
            updates.insert(0, Left(node=msg.src, incarnation=pinger.incarnation))
        swim.send(
            msg.src_addr, Ack(**swim.header(updates), seq=msg.seq, checksum=swim.table.checksum())
        )

    def on_ack(self, msg: Ack, now: float) -> None:
        swim = self._swim
        relay = self.relays.pop(msg.seq, None)
        if relay is not None:
            swim.send(
                relay.origin_addr,
                Ack(**swim.header([]), seq=relay.origin_seq, checksum=msg.checksum),
            )
            return
        if self.confirming.pop(msg.seq, None) is not None:
            return
        probe = self.probe
        if probe is None or msg.seq != probe.seq:
            return
        self.probe = None
        swim.awareness.apply(-1)
        if msg.checksum and msg.src == probe.target:
            swim.antientropy.compare_checksum(msg.src, msg.checksum, now)

    def on_nack(self, msg: Nack, now: float) -> None:
        probe = self.probe
        if probe is not None and msg.seq == probe.seq:
            probe.nacks += 1
            if msg.src in probe.helpers and msg.src not in probe.nacked:
                probe.nacked = (*probe.nacked, msg.src)

    def on_ping_req(self, msg: PingReq, now: float) -> None:
        swim = self._swim
        if len(self.relays) >= swim.config.relays_max:
            return
        self.seq += 1
        # The nack leaves after our probe timeout scaled by our health, not the requester's
        # unscaled one (memberlist's): a helper in poor health then often nacks after the
        # requester's deadline and is suspected for it (rule 10), but measured in the fan-out
        # simulator's partition+crash runs the unscaled nack made requesters that hear nacks
        # suspect beyond a cut sooner: 6 to 10 tasks answered twice over 5 and 6 seeds, against
        # 0 to 3 (docs/MEMBERSHIP.md, "Helpers' nacks").
        self.relays[self.seq] = Relay(
            msg.src_addr, msg.seq, now + swim.awareness.scale(swim.config.probe_timeout_s)
        )
        swim.send(
            msg.target_addr,
            Ping(**swim.header(swim.dissemination.piggyback()), seq=self.seq, target=msg.target),
        )
