"""Admin answers: what a daemon sends an operator's tool at its ``reply_to``, and their codec.

A StatusReport answers a StatusQuery, an AdminReply answers a Drain (a Result when the daemon
refused the request).  The requests themselves (StatusQuery, Drain) are read by the ingress's
intake decoder, so they live beside it in ``core/messages.py``.  ``docs/PROTOCOL.md``,
"Admin", documents the fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gossipd.core.gossip_messages import GpuState, Incarnation, MemberRecord, NodeId, SmallText
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    TASK_ID_CHARS_MAX,
    Drain,
    ErrorCode,
    MsgType,
    NodeName,
    Result,
    StatusQuery,
)
from gossipd.errors import RemoteProtocolError

_encoder = msgspec.msgpack.Encoder()


# --- Admin answers (docs/PROTOCOL.md, "Admin") ----------------------------------------------


class AdminReply(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.ADMIN_REPLY)
):
    """The answer to a Drain: ``ok`` and the member's status now, or why not."""

    v: int = PROTOCOL_VERSION
    id: Annotated[str, msgspec.Meta(max_length=TASK_ID_CHARS_MAX)]
    node: NodeName
    ok: bool
    status: Annotated[str, msgspec.Meta(max_length=32)] = ""
    message: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """A daemon's own counts, read as it answers."""

    pending: Annotated[int, msgspec.Meta(ge=0)] = 0  # admitted and not finished (queued + running)
    queued: Annotated[int, msgspec.Meta(ge=0)] = 0
    running: Annotated[int, msgspec.Meta(ge=0)] = 0
    received: Annotated[int, msgspec.Meta(ge=0)] = 0  # messages read from its ingress
    served: Annotated[int, msgspec.Meta(ge=0)] = 0  # tasks it ran to an ok Result
    failed: Annotated[int, msgspec.Meta(ge=0)] = 0  # tasks it answered with an error


class StatusReport(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.STATUS_REPORT)
):
    """One daemon's answer to a StatusQuery: itself, and every member as it sees them."""

    v: int = PROTOCOL_VERSION
    id: Annotated[str, msgspec.Meta(max_length=TASK_ID_CHARS_MAX)]
    node: NodeId
    software_version: SmallText = ""
    engine: SmallText = ""
    model: SmallText = ""
    # serving | draining (drained, or stopping) | unhealthy (its engine died) | shutting_down
    status: Literal["serving", "draining", "unhealthy", "shutting_down"] = "serving"
    drained: bool = False  # by a Drain (not by a stop)
    gossip: bool = False  # membership is on (gossip.bind set)
    incarnation: Incarnation = 0
    checksum: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0  # of its live set
    gpu: GpuState | None = None  # its own latest sample
    load: LoadReport = msgspec.field(default_factory=LoadReport)
    # The other members as this daemon sees them (every state, dead and left included).
    members: Annotated[list[MemberRecord], msgspec.Meta(max_length=100_000)] = msgspec.field(
        default_factory=list
    )
    # The highest leader term this daemon has seen (core/fencing.py): nil before any.
    leader: NodeName | None = None
    term: Annotated[int, msgspec.Meta(ge=0)] | None = None
    election: bool = False  # this daemon campaigns through etcd (etcd.endpoints set)


_admin_answer_decoder = msgspec.msgpack.Decoder(Result | AdminReply | StatusReport)


def encode_admin(message: StatusQuery | Drain | AdminReply | StatusReport) -> bytes:
    return _encoder.encode(message)


def decode_admin_answer(data: bytes) -> Result | AdminReply | StatusReport:
    """An answer to a StatusQuery or Drain (a Result when the daemon refused the request).
    Raises ``RemoteProtocolError``."""
    try:
        return _admin_answer_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RemoteProtocolError(f"invalid answer: {exc}", code=ErrorCode.BAD_REQUEST) from None
