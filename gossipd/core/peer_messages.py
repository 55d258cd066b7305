"""Fan-out messages between daemons (DEALER -> ROUTER on ``fanout.rpc_bind``) and their codec.

A task forwarded to the member that runs it (Forward, answered by ForwardReply), its end
(TaskDone), its withdrawal (Withdraw), an owner's question whether tasks whose Results it
holds are still routed to it (Confirm, answered ConfirmReply), a producer's Cancel passed on, an operator's Drain
relayed to the member it names, a question for another member's model card (ModelQuery,
answered ModelCard), a restarted daemon's question which of its journal's unfinished tasks a
member holds (ReplayQuery, answered ReplayKnown), an owner's word that it handed a task over
to another member (Moved), and PeerBatch (several of
them in one ZeroMQ message).  ``docs/PROTOCOL.md``, "Between daemons" / "Fan-out", documents
the fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gossipd.core.gossip_messages import LoadRecord, NodeId, Seq, SmallText
from gossipd.core.messages import (
    ENDPOINT_CHARS_MAX,
    PROTOCOL_VERSION,
    Cancel,
    Drain,
    MsgType,
    Task,
    TaskId,
    decode_between_daemons,
)

_encoder = msgspec.msgpack.Encoder()

# A refusal's hint from a member: at most what any member's ingress.retry_after_max_ms may be
# (gossipd/config/data_path.py's bound, one hour); the entry cuts it to its own before a
# producer sees it.
RETRY_AFTER_MS_MAX = 3_600_000


# --- Fan-out (daemon to daemon, DEALER -> ROUTER) -------------------------------------------


class Forward(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.FORWARD)
):
    """A task handed to the member that should run it.  The receiver answers ForwardReply."""

    v: int = PROTOCOL_VERSION
    req: Seq
    src: NodeId
    task: Task
    # What is left of the task's deadline, so the owner does not restart the clock.
    remaining_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)]
    attempt: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    # Refuse at once with code "saturated" (and your load) if your engine is saturated as you
    # read it now (issue 17; docs/PROTOCOL.md "Fresh where placement looks").  Optional.
    if_free: bool = False
    # When the sending process started (ms since the epoch, its host's clock; 0: not said).
    # A Forward from an earlier process of ``src`` than one the owner has heard from is stale
    # (it waited in a dead process's connection: docs/PROTOCOL.md "Duplicate final Results").
    boot: Annotated[int, msgspec.Meta(ge=0, le=1 << 53)] = 0
    # Send the task's replies back on this connection as Relay messages, not to its
    # reply_to: the forwarder holds the client itself (its HTTP door).  Optional.
    relay: bool = False
    # Engines that died while running the task (a hand-off by a member whose engine died
    # counts its own): the owner hands it on after its engine dies only while that stays
    # under its engine.deaths_per_task_max.  Optional.
    engine_deaths: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0


class ForwardReply(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.FORWARD_REPLY),
):
    v: int = PROTOCOL_VERSION
    req: Seq
    node: NodeId
    accepted: bool
    code: Annotated[str, msgspec.Meta(max_length=64)] = ""
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    retry_after_ms: Annotated[int, msgspec.Meta(ge=0, le=RETRY_AFTER_MS_MAX)] = 0
    load: LoadRecord | None = None  # the owner's load as it answers (optional, issue 17)


class TaskDone(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.TASK_DONE)
):
    """The owner sent the task's final Result: the forwarder may forget it."""

    v: int = PROTOCOL_VERSION
    id: TaskId
    node: NodeId
    load: LoadRecord | None = None  # the owner's load as it answers (optional, issue 17)


class Withdraw(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.WITHDRAW)
):
    """The forwarder has the task run elsewhere (a hedged copy lost, this member did not ack
    in time, or it was declared dead and the task migrated): drop it without answering the
    producer.  Only the copy this forwarder sent is withdrawn (after a restart, a task re-run
    from the journal by any forwarder)."""

    v: int = PROTOCOL_VERSION
    id: TaskId
    node: NodeId  # the forwarder


MOVED_FROM_VERSION = (0, 3, 1)  # the first release that understands a Moved


class Moved(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.MOVED)
):
    """The owner handed a task this forwarder gave it over to another member (it drains or
    stops, or its engine died): the task runs at ``to`` now, so the forwarder answers for it
    there (and migrates it if ``to`` dies).  Sent alone in its message: a member before
    0.3.1 refuses the frame (counted), and then forgets the task at its window's end, as
    before."""

    v: int = PROTOCOL_VERSION
    id: TaskId
    node: NodeId  # the owner that handed it over
    to: NodeId  # the member that took it
    # Engines that died running it (Forward.engine_deaths): a migration off ``to`` keeps it.
    engine_deaths: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0


# Task ids in one Confirm / ConfirmReply list (an owner asks in pieces of this size).
CONFIRM_IDS_MAX = 1000
_Ids = Annotated[list[TaskId], msgspec.Meta(max_length=CONFIRM_IDS_MAX)]


class Confirm(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.CONFIRM)
):
    """An owner that held these tasks' final Results while their forwarder was not alive in
    its view asks that forwarder, now alive again, whether it still routes each to the owner
    (docs/PROTOCOL.md "Duplicate final Results").  Sent to the forwarder's rpc address."""

    v: int = PROTOCOL_VERSION
    ids: _Ids
    node: NodeId  # the owner asking


class ConfirmReply(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.CONFIRM_REPLY),
):
    """The forwarder's answer, from its ledger: ``still_mine`` (routed to the asker: send the
    Result), ``migrated`` (run elsewhere since: drop it), ``unknown`` (not known here, e.g.
    after a restart: the owner sends the Result, a duplicate beats a loss)."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the forwarder
    still_mine: _Ids = []
    migrated: _Ids = []
    unknown: _Ids = []


class Relay(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.RELAY)
):
    """A reply (Chunk, Result or Replies frame, encoded as it would go to ``to``) for a task
    whose Forward asked ``relay``: the forwarder hands ``frame`` to its own reply address
    ``to`` (the task's route) in-process."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the owner
    to: Annotated[str, msgspec.Meta(max_length=ENDPOINT_CHARS_MAX + 41)]  # a route
    frame: bytes


class ModelQuery(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.MODEL_QUERY)
):
    """Which model do you serve, and its longest prompt + output?  (GET /v1/models; from
    0.3.0: sent alone, only to members whose GpuState says 0.3.0 or later.)  Answered by a
    ModelCard on the same connection."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the asker


class ModelCard(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="t", tag=int(MsgType.MODEL_CARD)
):
    """A member's answer to a ModelQuery: its model and that model's max_model_len (0: its
    engine does not know it yet)."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the member that serves ``model``
    model: SmallText
    max_model_len: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0


# A task as a ReplayQuery names it: its id and its producer's key ("" without CURVE).
ReplayId = tuple[TaskId, Annotated[str, msgspec.Meta(max_length=40)]]


class ReplayQuery(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.REPLAY_QUERY),
):
    """A daemon restarted with unfinished tasks in its journal asks a member which of them it
    holds (pending or answered, for the same producer key) before it runs them again: a
    producer that resubmitted one elsewhere while the daemon was down has its answer there.
    (From 0.3.0: sent alone, only to members whose GpuState says 0.3.0 or later.)  Answered
    by a ReplayKnown on the same connection."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the asker
    tasks: Annotated[list[ReplayId], msgspec.Meta(max_length=CONFIRM_IDS_MAX)]


class ReplayKnown(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.REPLAY_KNOWN),
):
    """A member's answer to one ReplayQuery: the ids of it that it holds."""

    v: int = PROTOCOL_VERSION
    node: NodeId  # the member that holds ``known``
    known: _Ids = []


# One fan-out message (a PeerBatch holds several).  A Cancel between daemons: the entry
# point passes a producer's cancel on to the task's owner; a Drain: an operator's drain of
# another member, relayed to it (gossipd/admin.py).
PeerItem = (
    Forward
    | ForwardReply
    | TaskDone
    | Cancel
    | Withdraw
    | Drain
    | Confirm
    | ConfirmReply
    | Relay
    | ModelQuery
    | ModelCard
    | ReplayQuery
    | ReplayKnown
    | Moved
)


class PeerBatch(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.PEER_BATCH)
):
    """Several fan-out messages for one peer, sent together at the end of an event-loop turn
    (one ZeroMQ message instead of many under load; no added wait)."""

    v: int = PROTOCOL_VERSION
    items: Annotated[list[PeerItem], msgspec.Meta(max_length=100_000)]


PeerMessage = PeerItem | PeerBatch
_peer_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode_peer(message: PeerMessage) -> bytes:
    return _encoder.encode(message)


def decode_peer(data: bytes, *, bytes_max: int) -> PeerMessage:
    """Decode and validate one fan-out message, or raise ``RemoteProtocolError``."""
    return decode_between_daemons(_peer_decoder, data, bytes_max, "peer")
