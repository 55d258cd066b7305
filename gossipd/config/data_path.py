"""The sections of the request path: the ZeroMQ ingress, fan-out to peers, the journal,
producers' token budgets and the HTTP door."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gossipd.config.rules import (
    Positive,
    Seconds,
    Section,
    check_advertised,
    check_bind,
    check_hostport,
)
from gossipd.core.replaycheck import ANSWER_WAIT_S, JOIN_WAIT_S


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
        check_bind("bind", self.bind)
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
        check_bind("rpc_bind", self.rpc_bind)
        if self.rpc_advertise:
            check_bind("rpc_advertise", self.rpc_advertise)
            check_advertised("rpc_advertise", self.rpc_advertise)
        else:
            check_advertised("rpc_bind", self.rpc_bind, bind=True)
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
            check_hostport("bind", self.bind)
        if self.reply_bind:
            check_bind("reply_bind", self.reply_bind)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file: tls_cert_file and tls_key_file go together")
        if self.read_bytes_max < self.body_bytes_max:
            raise ValueError(
                f"read_bytes_max: {self.read_bytes_max} is under body_bytes_max "
                f"({self.body_bytes_max}): a lone request of the largest body must fit"
            )
