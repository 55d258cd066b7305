"""SWIM + Lifeguard settings: one frozen dataclass, a paragraph per field, named presets.

Formulas (N = live members, including this one):
- retransmit limit = retransmit_mult * ceil(log10(N + 1))                      (broadcast.py)
- suspicion min    = max(suspicion_floor_s, suspicion_mult * log10(N + 1) * probe_interval_s)
                   (contain_suspicions: N = 1 here, so the floor: see MEMBERSHIP.md)
- suspicion max    = suspicion_max_mult * suspicion min                       (suspicion.py)
- push-pull period = push_pull_interval_s * (1 + max(0, ceil(log2(N) - log2(32))))
- push-pull pages   = ceil(table bytes / push_pull_page_bytes), one per push_pull_page_interval_s
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from typing import Annotated, Any, get_args, get_origin, get_type_hints

from msgspec import Meta

# Each field's type carries its bounds (msgspec.Meta).  The daemon's configuration
# (gossipd/config/node.py, key gossip.swim) validates overrides against these same types, and
# __post_init__ checks the same bounds for a SwimConfig built in code (the simulator).
Period = Annotated[float, Meta(gt=0.0, le=3600.0)]  # a period or a timeout: > 0, <= 1 hour
Delay = Annotated[float, Meta(ge=0.0, le=3600.0)]  # a tolerance or a minimum gap: >= 0
Reap = Annotated[float, Meta(ge=0.0, le=365 * 86400.0)]
Fanout = Annotated[int, Meta(ge=1, le=64)]  # a count of peers or of repeats


@dataclass(frozen=True, kw_only=True)
class SwimConfig:
    # Cluster name: messages of another cluster are dropped after the envelope is read.
    cluster: str = "default"
    # One probe of one member per interval.  Detection time scales with it; so does the
    # probe traffic (about 2 messages per member per interval: ping + ack).
    probe_interval_s: Period = 1.0
    # Direct ack wait before asking ``indirect_probes`` peers to ping-req.  Must exceed the
    # round-trip time with margin; scaled up by local health awareness.
    probe_timeout_s: Period = 0.2
    # From the probe's start: no ack by then (direct or relayed) makes the target suspect.
    probe_deadline_s: Period = 0.6
    # Peers asked to probe on our behalf (SWIM's k).  More: fewer false suspicions on lossy
    # links, more messages per failed probe.
    indirect_probes: Fanout = 3
    # Probe targets follow a schedule shared by all members (offset by the round number), so
    # each member is probed by about one member in every round, not by a random number of
    # them: a crashed member is noticed within one round instead of a geometric tail.
    coordinated_probing: bool = True
    # Lifeguard dynamic suspicion (see formulas above).  The floor protects members that stall
    # (GC, SIGSTOP, CPU starvation) for up to about floor + probe_deadline seconds.  With
    # contained suspicions the log N term is dropped (the minimum is the floor at every N).
    suspicion_mult: Annotated[float, Meta(gt=0.0, le=100.0)] = 0.8
    suspicion_floor_s: Period = 1.6
    suspicion_max_mult: Annotated[float, Meta(ge=1.0, le=100.0)] = 3.0
    # Independent confirmations that shrink the timeout to its minimum (Lifeguard's K).
    suspicion_k: Fanout = 3
    # On hearing a suspicion, probe the suspect with probability confirm_probes / (N - 2):
    # about this many members gather their own evidence (confirm, or carry the suspicion to
    # the suspect so that it refutes at once).  Contained (below): the accuser asks exactly
    # this many.  4: at 10% loss a confirmation needs two datagrams (0.81), so 3 asked bring
    # the K = 3 confirmations that shorten the timer only half the time (detection p99 at
    # N=1,000 near 5 s); 5 catch 2 s stalls at the floor under 20% loss (MEMBERSHIP.md).
    confirm_probes: Fanout = 4
    # Contained suspicions: a suspicion is not gossiped.  The accuser tells the suspect and
    # confirm_probes random members directly, and those probe the suspect (probability 1);
    # the suspect's refutation goes straight to the accuser and to whoever carried the news,
    # and rides only piggyback elsewhere (Alive.quiet); a death is gossiped as before.  Off:
    # every suspicion and refutation is gossiped to all (memberlist), which at a fixed loss
    # rate makes each member's message load grow with N (docs/MEMBERSHIP.md).
    contain_suspicions: bool = True
    # Urgent updates (membership changes) are also sent every gossip interval to
    # ``gossip_fanout`` random members while any is pending; others only ride piggyback.
    gossip_interval_s: Period = 0.2
    gossip_fanout: Fanout = 3
    retransmit_mult: Fanout = 4
    # Bytes of piggybacked updates per message (fits a 1500-byte MTU with headers).
    piggyback_bytes_max: Annotated[int, Meta(ge=256, le=1 << 20)] = 1200
    # Largest gossip message accepted (a push-pull page is at most push_pull_page_bytes).
    message_bytes_max: Annotated[int, Meta(ge=4096, le=1 << 30)] = 8 * 1024 * 1024
    # Anti-entropy: full-state exchange with one random member this often (scaled with N).
    push_pull_interval_s: Period = 30.0
    # A push-pull sends the member table in pages of at most this many bytes (and at most
    # message_bytes_max), one message each, the first at once and one more every
    # push_pull_page_interval_s: a table of 10,000 members with 256 prefixes each (about
    # 16 MB) never needs one huge message, and one exchange sends at most page_bytes /
    # page_interval_s (10 MiB/s by default).  A record larger than a page goes alone.
    push_pull_page_bytes: Annotated[int, Meta(ge=4096, le=1 << 30)] = 1024 * 1024
    push_pull_page_interval_s: Period = 0.1
    # Partition healing: this often, with probability heal_fanout / N, push-pull with one
    # random dead member (a partition of any length heals without an operator).
    heal_interval_s: Period = 5.0
    heal_fanout: Fanout = 3
    # Acks carry the live-set checksum; this many mismatches in a row (in the acks of our
    # probes, whoever sent them) trigger a push-pull with the last one's sender, at most once
    # per checksum_sync_s.
    checksum_mismatches_max: Annotated[int, Meta(ge=1, le=1000)] = 3
    checksum_sync_s: Delay = 5.0
    # Local health awareness: timeouts and the probe interval are multiplied by (score + 1),
    # score in 0 .. awareness_max - 1.
    awareness_max: Fanout = 8
    # Lateness that counts as having missed our own deadline (we were paused or starved).
    lateness_tolerance_s: Delay = 0.25
    # Crash detection by refused connections (core/refusal.py, docs/MEMBERSHIP.md): when our
    # connection to a member drops or its ack is late, the daemon connects to its gossip port;
    # a refusal (nothing listens there: the process is gone) declares it dead at once.  At most
    # refusal_burst such declarations, refilled at one per refusal_refill_s; beyond that
    # (our own network is more likely wrong) SWIM's suspicion judges as usual.
    crash_by_refusal: bool = True
    refusal_burst: Fanout = 3
    refusal_refill_s: Period = 5.0
    # Seeds are retried this often until a push-pull answer arrives.
    join_retry_s: Period = 1.0
    # Bounds.
    members_max: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000
    broadcast_queue_max: Annotated[int, Meta(ge=1, le=10_000_000)] = 20_000
    relays_max: Annotated[int, Meta(ge=0, le=1_000_000)] = 1024
    # Dead members are forgotten after this long; left members sooner.
    dead_reap_s: Reap = 24 * 3600.0
    left_reap_s: Reap = 300.0

    def __post_init__(self) -> None:
        for name, meta in field_bounds().items():
            _check_bound(name, getattr(self, name), meta)
        if not self.probe_timeout_s < self.probe_deadline_s:
            raise ValueError(
                f"probe_deadline_s: must be > probe_timeout_s ({self.probe_timeout_s}), "
                f"found {self.probe_deadline_s}"
            )
        if not self.probe_deadline_s <= self.probe_interval_s:
            raise ValueError(
                f"probe_interval_s: must be >= probe_deadline_s ({self.probe_deadline_s}), "
                f"found {self.probe_interval_s}"
            )
        if self.piggyback_bytes_max > self.message_bytes_max:
            raise ValueError(
                f"piggyback_bytes_max: must be <= message_bytes_max ({self.message_bytes_max}), "
                f"found {self.piggyback_bytes_max}"
            )

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


# The presets a daemon's configuration may name (gossip.preset); sim() is the simulator's.
PRESETS: dict[str, Callable[..., SwimConfig]] = {
    "lan": SwimConfig.lan,
    "wan": SwimConfig.wan,
    "local": SwimConfig.local,
}


@cache
def field_types(cls: type = SwimConfig) -> dict[str, Any]:
    """Each field's type, with its bounds (``Annotated[..., Meta(...)]``)."""
    return get_type_hints(cls, include_extras=True)


@cache
def field_bounds(cls: type = SwimConfig) -> dict[str, Meta]:
    out: dict[str, Meta] = {}
    for name, hint in field_types(cls).items():
        if get_origin(hint) is Annotated:
            out.update((name, m) for m in get_args(hint)[1:] if isinstance(m, Meta))
    return out


def _check_bound(name: str, value: float, meta: Meta) -> None:
    for bound, holds, op in (
        (meta.gt, lambda b: value > b, ">"),
        (meta.ge, lambda b: value >= b, ">="),
        (meta.lt, lambda b: value < b, "<"),
        (meta.le, lambda b: value <= b, "<="),
    ):
        if bound is not None and not holds(bound):
            raise ValueError(f"{name}: must be {op} {bound}, found {value}")
