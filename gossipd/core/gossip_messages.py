"""Membership (SWIM + Lifeguard) messages between daemons, and their codec.

What one daemon's gossip PUSH socket sends to another's PULL on ``gossip.bind`` (best effort):
Ping, Ack, Nack, PingReq, PushPull (anti-entropy, in pages) and GossipOnly, each carrying
piggybacked updates (Alive, Suspect, Dead, Left, Meta, Term, Directive) and load records.
``docs/PROTOCOL.md``, "Between daemons" / "Membership (SWIM)", documents the fields.  The
producer protocol and what every message shares (``MsgType``, ``UpdateKind``, the version
check) are in ``core/messages.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

import msgspec

from gossipd.core.messages import (
    ENDPOINT_CHARS_MAX,
    PROTOCOL_VERSION,
    Endpoint,
    ErrorCode,
    MsgType,
    UpdateKind,
    decode_between_daemons,
    endpoint_problem,
)
from gossipd.errors import RemoteProtocolError

_encoder = msgspec.msgpack.Encoder()


# --- Membership (SWIM + Lifeguard) -------------------------------------------------------
# Every gossip message names its cluster, its sender and the sender's gossip endpoint, and may
# carry piggybacked updates.  A message of another cluster is dropped unread beyond that.

NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
# A member's incarnation never goes past this (a refutation of news at the bound stays at it).
INCARNATION_MAX = 2**53
Incarnation = Annotated[int, msgspec.Meta(ge=0, le=INCARNATION_MAX)]
ClusterName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
SmallText = Annotated[str, msgspec.Meta(max_length=128)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# A member's relative capacity on the ring.  The floor keeps every weight, and the running
# sum of them that placement's bound divides by, away from 0: 1e-300 beside 1.0 summed to
# 1.0 and, that 1.0 removed, to 0.0 (a ZeroDivisionError in placement from one Meta).
CAPACITY_WEIGHT_MIN = 1e-3
CAPACITY_WEIGHT_MAX = 1e6


class GpuState(msgspec.Struct, frozen=True, kw_only=True):
    """What a daemon tells the cluster about its GPU and load (bounded, versioned by Meta).

    Keys it does not know are ignored (docs/PROTOCOL.md "Adding a field to GpuState"):
    daemons before 0.2.0 refused them, and with them the whole gossip message, so a field
    can be added only by a later release, in clusters whose members all run 0.2.0 or later."""

    gpu_index: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0
    ingress: Annotated[str, msgspec.Meta(max_length=ENDPOINT_CHARS_MAX)] = ""
    model: SmallText = ""
    memory_free_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    memory_total_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    utilization_pct: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    running_requests: Annotated[int, msgspec.Meta(ge=0)] = 0
    waiting_requests: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_cache_usage_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # 0: the default, 1.0.  Placement reads a weight below CAPACITY_WEIGHT_MIN as that.
    capacity_weight: Annotated[float, msgspec.Meta(ge=0.0, le=CAPACITY_WEIGHT_MAX)] = 1.0
    # Where peers forward tasks to this daemon (its ROUTER socket).
    rpc: Annotated[str, msgspec.Meta(max_length=ENDPOINT_CHARS_MAX)] = ""
    # In-flight tasks (queued + running) here: the load that bounded-load placement uses.
    inflight: Annotated[int, msgspec.Meta(ge=0)] = 0
    status: Literal["serving", "draining", "unhealthy"] = "serving"
    software_version: SmallText = ""
    # Prompt-prefix hashes this daemon's engine has run more than once (core/prefix.py).
    prefixes: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=2**32)]], msgspec.Meta(max_length=256)
    ] = msgspec.field(default_factory=list)
    queued_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


# A load record's counts' bounds (a figure past one makes the whole message invalid: a
# member cuts its own to them, core/loadstate.py).
LOAD_COUNT_MAX = 2**31
QUEUED_TOKENS_MAX = 2**40


class LoadRecord(msgspec.Struct, frozen=True, array_like=True):
    """A member's engine load, small and frequent, apart from its Meta (issue 17): a
    MessagePack array [node, seq, age_ms, inflight, waiting, queued_tokens, kv_pct] of about
    20 bytes.  ``seq`` grows with every sample the member takes (across restarts too: it
    starts from the wall clock in milliseconds); ``age_ms`` is how old the sample was when
    the message left (each relay adds the time it held it), so a receiver knows the sample's
    age without synchronised clocks (core/loadstate.py)."""

    node: NodeId
    seq: Seq
    age_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)] = 0
    inflight: Annotated[int, msgspec.Meta(ge=0, le=LOAD_COUNT_MAX)] = 0
    waiting: Annotated[int, msgspec.Meta(ge=0, le=LOAD_COUNT_MAX)] = 0
    queued_tokens: Annotated[int, msgspec.Meta(ge=0, le=QUEUED_TOKENS_MAX)] = 0
    kv_pct: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0


LOAD_RECORDS_MAX = 1024  # load records in one gossip message


class Alive(msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.ALIVE)):
    node: NodeId
    incarnation: Incarnation
    addr: Endpoint
    # A refutation of a contained suspicion (docs/MEMBERSHIP.md): passed on piggyback only,
    # never in dedicated gossip rounds (absent from older peers: False).
    quiet: bool = False


class Suspect(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.SUSPECT)
):
    node: NodeId
    incarnation: Incarnation
    by: NodeId  # who suspects: counts as an independent confirmation (Lifeguard)


class Dead(msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.DEAD)):
    node: NodeId
    incarnation: Incarnation
    by: NodeId


class Left(msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.LEFT)):
    node: NodeId
    incarnation: Incarnation


class Meta(msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.META)):
    """A member's GPU state, ordered by (incarnation, version): the incarnation the member had
    when it published it, then its own counter (which a restarted process starts again)."""

    node: NodeId
    version: Seq  # the node's own counter
    gpu: GpuState
    incarnation: Incarnation = 0  # the publisher's incarnation (absent from older peers: 0)


# Leadership (issue 15): the fencing token is the leader's etcd campaign key's create_revision.
Token = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
DIRECTIVE_KIND_CHARS_MAX = 32
DIRECTIVE_BODY_BYTES_MAX = 64 * 1024


class Term(msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.TERM)):
    """Who leads, with its fencing token.  Members keep the highest token they have seen."""

    leader: NodeId
    token: Token


class Directive(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="k", tag=int(UpdateKind.DIRECTIVE)
):
    """A fenced leader order: applied only at a token >= the highest seen (core/fencing.py).
    ``body`` is msgpack; for one ``kind`` only the newest (token, seq) applies."""

    leader: NodeId
    token: Token
    seq: Seq
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=DIRECTIVE_KIND_CHARS_MAX)]
    body: Annotated[bytes, msgspec.Meta(max_length=DIRECTIVE_BODY_BYTES_MAX)] = b""


Update = Alive | Suspect | Dead | Left | Meta | Term | Directive
# What the member table applies (a Term or Directive goes to the fence: core/swim.py).
MemberUpdate = Alive | Suspect | Dead | Left | Meta
Updates = Annotated[list[Update], msgspec.Meta(max_length=4096)]


class _Gossip(msgspec.Struct, frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION
    cluster: ClusterName
    src: NodeId
    src_addr: Endpoint
    updates: Updates = msgspec.field(default_factory=list)
    # The sender's highest leader term (core/fencing.py): every message carries it, so a
    # member (a joiner through its first push-pull) learns the leader from any traffic.
    term: Term | None = None
    # Load records (issue 17), newest first; absent from older peers, ignored by them.
    loads: Annotated[list[LoadRecord], msgspec.Meta(max_length=LOAD_RECORDS_MAX)] | None = None


class Ping(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.PING)):
    seq: Seq
    target: NodeId


class Ack(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.ACK)):
    seq: Seq
    checksum: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0


class Nack(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.NACK)):
    seq: Seq


class PingReq(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.PING_REQ)):
    seq: Seq
    target: NodeId
    target_addr: Endpoint


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeId
    addr: Endpoint
    incarnation: Incarnation
    state: Literal["alive", "suspect", "dead", "left"]
    meta_version: Seq = 0
    gpu: GpuState | None = None
    meta_incarnation: Incarnation = 0  # the incarnation its gpu was published at (see Meta)


PUSH_PULL_PAGES_MAX = 2**31 - 1


class PushPull(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.PUSH_PULL)):
    """Anti-entropy: one page of the sender's member table (docs/PROTOCOL.md, "Push-pull in
    pages").  ``reply`` (first page only) asks the receiver to answer with its own table;
    ``page`` counts the pages of one exchange from 0; ``more``: more pages follow."""

    reply: bool
    join: bool = False
    members: Annotated[list[MemberRecord], msgspec.Meta(max_length=100_000)]
    # Absent from older peers (a whole table in one message): page 0, nothing more.
    page: Annotated[int, msgspec.Meta(ge=0, le=PUSH_PULL_PAGES_MAX)] = 0
    more: bool = False


class PushPullEncoded(
    _Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.PUSH_PULL)
):
    """A PushPull to send whose records are already encoded (``encode_record``): the same
    bytes on the wire as PushPull, each record encoded once, so that a page is sized exactly
    as it is built (core/antientropy.py).  Never decoded."""

    reply: bool
    join: bool = False
    members: list[msgspec.Raw]
    page: int = 0
    more: bool = False


def encode_record(record: MemberRecord) -> msgspec.Raw:
    """One member record's bytes, to send in a PushPullEncoded."""
    return msgspec.Raw(_encoder.encode(record))


class GossipOnly(_Gossip, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.GOSSIP)):
    """Updates with nothing else: sent every gossip interval while urgent updates are pending."""


GossipMessage = Ping | Ack | Nack | PingReq | PushPull | GossipOnly


class GossipHeader(TypedDict):
    """The fields every gossip message starts with (``SwimNode.header``), as keywords."""

    cluster: str
    src: str
    src_addr: str
    updates: list[Update]
    term: Term | None


_gossip_decoder = msgspec.msgpack.Decoder(GossipMessage)


def encode_gossip(message: GossipMessage | PushPullEncoded) -> bytes:
    return _encoder.encode(message)


def encode_update(update: Update) -> bytes:
    """One update's bytes (its size counts against a message's byte budget)."""
    return _encoder.encode(update)


def decode_gossip(data: bytes, *, bytes_max: int) -> GossipMessage:
    """Decode and validate one gossip message, or raise ``RemoteProtocolError``."""
    message: GossipMessage = decode_between_daemons(_gossip_decoder, data, bytes_max, "gossip")
    problem = addresses_problem(message)
    if problem is not None:
        raise RemoteProtocolError(f"invalid gossip message: {problem}", code=ErrorCode.BAD_REQUEST)
    return message


def addresses_problem(message: GossipMessage) -> str | None:
    """Why an address in ``message`` is not one a socket may connect to, or None.  Every
    address a member learns it may send to (a probe, an ack, a forward): one ZeroMQ refuses
    ("tcp://h:5\\n", "garbage") would fail that send, far from where it came in.  Checked
    here (endpoint_problem, cached) rather than in the structs, which our own code builds."""
    problem = endpoint_problem(message.src_addr)
    if problem is not None:
        return f"src_addr: {problem}"
    if type(message) is PingReq and (problem := endpoint_problem(message.target_addr)):
        return f"target_addr: {problem}"
    for update in message.updates:
        kind = type(update)
        if kind is Alive:
            assert isinstance(update, Alive)
            if problem := endpoint_problem(update.addr):
                return f"Alive of {update.node!r}: addr: {problem}"
        elif kind is Meta:
            assert isinstance(update, Meta)
            if problem := _gpu_problem(update.gpu):
                return f"Meta of {update.node!r}: {problem}"
    if type(message) is PushPull:
        for record in message.members:
            if problem := endpoint_problem(record.addr):
                return f"member {record.node!r}: addr: {problem}"
            if record.gpu is not None and (problem := _gpu_problem(record.gpu)):
                return f"member {record.node!r}: {problem}"
    return None


def _gpu_problem(gpu: GpuState) -> str | None:
    """The rpc and ingress addresses of a GpuState, each empty (none) or connectable."""
    for field, value in (("rpc", gpu.rpc), ("ingress", gpu.ingress)):
        if value and (problem := endpoint_problem(value)):
            return f"gpu.{field}: {problem}"
    return None
