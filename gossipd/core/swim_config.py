"""SWIM + Lifeguard settings: one frozen dataclass, a paragraph per field, named presets.

Formulas (N = live members, including this one):
- retransmit limit = retransmit_mult * ceil(log10(N + 1))                      (broadcast.py)
- suspicion min    = max(suspicion_floor_s, suspicion_mult * log10(N + 1) * probe_interval_s)
- suspicion max    = suspicion_max_mult * suspicion min                       (suspicion.py)
- push-pull period = push_pull_interval_s * (1 + max(0, ceil(log2(N) - log2(32))))
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class SwimConfig:
    # Cluster name: messages of another cluster are dropped after the envelope is read.
    cluster: str = "default"
    # One probe of one member per interval.  Detection time scales with it; so does the
    # probe traffic (about 2 messages per member per interval: ping + ack).
    probe_interval_s: float = 1.0
    # Direct ack wait before asking ``indirect_probes`` peers to ping-req.  Must exceed the
    # round-trip time with margin; scaled up by local health awareness.
    probe_timeout_s: float = 0.2
    # From the probe's start: no ack by then (direct or relayed) makes the target suspect.
    probe_deadline_s: float = 0.6
    # Peers asked to probe on our behalf (SWIM's k).  More: fewer false suspicions on lossy
    # links, more messages per failed probe.
    indirect_probes: int = 3
    # Probe targets follow a schedule shared by all members (offset by the round number), so
    # each member is probed by about one member in every round, not by a random number of
    # them: a crashed member is noticed within one round instead of a geometric tail.
    coordinated_probing: bool = True
    # Lifeguard dynamic suspicion (see formulas above).  The floor protects members that stall
    # (GC, SIGSTOP, CPU starvation) for up to about floor + probe_deadline seconds.
    suspicion_mult: float = 0.8
    suspicion_floor_s: float = 1.6
    suspicion_max_mult: float = 3.0
    # Independent confirmations that shrink the timeout to its minimum (Lifeguard's K).
    suspicion_k: int = 3
    # On hearing a suspicion, probe the suspect with probability confirm_probes / (N - 2):
    # about this many members gather their own evidence (confirm, or carry the suspicion to
    # the suspect so that it refutes at once).
    confirm_probes: int = 3
    # Urgent updates (membership changes) are also sent every gossip interval to
    # ``gossip_fanout`` random members while any is pending; others only ride piggyback.
    gossip_interval_s: float = 0.2
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    # Bytes of piggybacked updates per message (fits a 1500-byte MTU with headers).
    piggyback_bytes_max: int = 1200
    # Largest gossip message accepted (a push-pull carries the whole member table).
    message_bytes_max: int = 8 * 1024 * 1024
    # Anti-entropy: full-state exchange with one random member this often (scaled with N).
    push_pull_interval_s: float = 30.0
    # Partition healing: this often, with probability heal_fanout / N, push-pull with one
    # random dead member (a partition of any length heals without an operator).
    heal_interval_s: float = 5.0
    heal_fanout: int = 3
    # Acks carry the live-set checksum; this many mismatches in a row from one peer trigger a
    # push-pull with it, at most once per checksum_sync_s.
    checksum_mismatches_max: int = 3
    checksum_sync_s: float = 5.0
    # Local health awareness: timeouts and the probe interval are multiplied by (score + 1),
    # score in 0 .. awareness_max - 1.
    awareness_max: int = 8
    # Lateness that counts as having missed our own deadline (we were paused or starved).
    lateness_tolerance_s: float = 0.25
    # Seeds are retried this often until a push-pull answer arrives.
    join_retry_s: float = 1.0
    # Bounds.
    members_max: int = 10_000
    broadcast_queue_max: int = 20_000
    relays_max: int = 1024
    # Dead members are forgotten after this long; left members sooner.
    dead_reap_s: float = 24 * 3600.0
    left_reap_s: float = 300.0

    def __post_init__(self) -> None:
        positive = (
            "probe_interval_s",
            "probe_timeout_s",
            "probe_deadline_s",
            "gossip_interval_s",
            "push_pull_interval_s",
            "heal_interval_s",
            "join_retry_s",
            "suspicion_floor_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, found {getattr(self, name)}")
        if not self.probe_timeout_s < self.probe_deadline_s <= self.probe_interval_s:
            raise ValueError("need probe_timeout_s < probe_deadline_s <= probe_interval_s")
        if self.suspicion_max_mult < 1:
            raise ValueError("suspicion_max_mult must be >= 1")
        for name in (
            "indirect_probes",
            "gossip_fanout",
            "retransmit_mult",
            "suspicion_k",
            "confirm_probes",
            "heal_fanout",
            "awareness_max",
            "checksum_mismatches_max",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, found {getattr(self, name)}")
        if self.piggyback_bytes_max < 256:
            raise ValueError("piggyback_bytes_max must be >= 256")

    # Presets, with the reason for each.
    @classmethod
    def lan(cls, **overrides: object) -> SwimConfig:
        """A datacenter network: sub-millisecond RTT.  The defaults are for this."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def wan(cls, **overrides: object) -> SwimConfig:
        """Links across regions: RTT up to ~300 ms, more loss; slower, more patient."""
        base = {
            "probe_interval_s": 5.0,
            "probe_timeout_s": 1.5,
            "probe_deadline_s": 3.5,
            "suspicion_mult": 1.2,
            "suspicion_floor_s": 6.0,
            "gossip_interval_s": 0.5,
            "gossip_fanout": 4,
            "push_pull_interval_s": 60.0,
        }
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def local(cls, **overrides: object) -> SwimConfig:
        """Many daemons on one small machine (tests, demos): CPU contention delays replies, so
        probe timeouts are longer; everything else stays at LAN speed."""
        base = {"probe_timeout_s": 0.3, "probe_deadline_s": 0.8}
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def sim(cls, **overrides: object) -> SwimConfig:
        """The simulator: the LAN defaults, so simulated figures describe production."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
