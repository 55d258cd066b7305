"""The producer protocol's codec: a producer's (or an operator's tool's) frames decoded and
checked, a task that came inside a peer's Forward checked as the ingress checks it, and
several messages in one frame (a producer's Tasks frame, the Replies frames an owner sends a
reply address that set ``batch_replies``, and a producer's decoders of what comes back).
The messages themselves are core/messages.py; docs/PROTOCOL.md, "Tasks" and "Replies", is
the wire.

Rules (core/messages.py's 1 and 3):
1. Decoding validates everything: types, lengths, ranges and cross-field rules.  A message
   that passes ``decode_task`` is a well-formed ``Task``; anything else raises
   ``RemoteProtocolError`` with the error code to answer with.  No input makes the decoder
   raise anything else.
2. A refused message is answered when it is possible: if its ``reply_to`` (and ``id``) can
   be read from the broken bytes, the caller gets them in the exception, and nothing else of
   it is decoded (``_peek``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gossipd.core.messages import (
    ADMIN_TYPES,
    ECHOED_ID_CHARS_MAX,
    ENDPOINT_CHARS_MAX,
    INTAKE_TYPES,
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    Drain,
    ErrorCode,
    IntakeMessage,
    MsgType,
    ReplyMessage,
    Result,
    StatusQuery,
    Task,
    Tasks,
    encode,
    endpoint_problem,
)
from gossipd.core.sampling import LOGIT_BIAS_MAX
from gossipd.errors import RemoteProtocolError

_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
_task_decoder = msgspec.msgpack.Decoder(Task)
_intake_decoder = msgspec.msgpack.Decoder(IntakeMessage)
_any_decoder = msgspec.msgpack.Decoder()
_NIL = msgspec.Raw(b"\xc0")
_STR_HEADS = frozenset((*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB))  # fixstr, str8, str16, str32
# fixmap, fixarray, array16/32, map16/32 (the rest of a 9-byte scalar's heads are scalars or
# bin/ext, which decode as what they hold: bounded by those 9 bytes)
_CONTAINER_HEADS = frozenset((*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF))


def _over(text: str, bytes_max: int) -> bool:
    """``text`` encodes in more than ``bytes_max`` bytes (only in an oversized frame)."""
    return 4 * len(text) > bytes_max and len(text.encode()) > bytes_max


class _Head(msgspec.Struct, gc=False):
    """A refused message's keys that its answer needs, undecoded; every other key is
    skipped unread (no object built for it)."""

    v: msgspec.Raw = _NIL
    t: msgspec.Raw = _NIL
    id: msgspec.Raw = _NIL
    reply_to: msgspec.Raw = _NIL


_head_decoder = msgspec.msgpack.Decoder(_Head)
_raw_decoder = msgspec.msgpack.Decoder(msgspec.Raw)


def _small(raw: msgspec.Raw, *, text_bytes_max: int = 0) -> object:
    """``raw`` decoded where it is a scalar (a str: of at most ``text_bytes_max`` bytes);
    None where it is anything else, which is not decoded at all (a refused frame's 4 MiB of
    empty maps would be millions of dicts)."""
    if not raw:
        return None
    head = memoryview(raw)[0]
    if head in _STR_HEADS:
        small = len(raw) <= text_bytes_max + 5
    else:
        small = len(raw) <= 9 and head not in _CONTAINER_HEADS
    try:
        return _any_decoder.decode(raw) if small else None
    except msgspec.DecodeError:  # (a str that is not UTF-8)
        return None


def _peek(data: bytes, bytes_max: int) -> tuple[dict[str, object] | None, str, str]:
    """Best effort: the message's ``v`` and ``t`` (None: not one MessagePack object), its
    id as given when it is a string that fits the frame limit (so the producer can tell
    which message was refused, even for an invalid id), and its reply_to when it is usable.
    Nothing in the message but those is decoded: its answer costs what the frame holds
    in bytes, not what its values would take as Python objects."""
    try:
        _raw_decoder.decode(data)  # (one well-formed object: walked, nothing built)
    except (msgspec.DecodeError, RecursionError):
        return None, "", ""
    try:
        head = _head_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):  # not a map of str keys
        return {}, "", ""
    obj = {"v": _small(head.v), "t": _small(head.t)}
    task_id = _small(head.id, text_bytes_max=bytes_max)
    reply_to = _small(head.reply_to, text_bytes_max=4 * ENDPOINT_CHARS_MAX)
    if not isinstance(task_id, str) or _over(task_id, bytes_max):
        task_id = ""
    elif len(task_id) > ECHOED_ID_CHARS_MAX:  # (a refusal's answer as small as any)
        task_id = task_id[:ECHOED_ID_CHARS_MAX]
    if not (
        isinstance(reply_to, str)
        and len(reply_to) <= ENDPOINT_CHARS_MAX
        and endpoint_problem(reply_to) is None
    ):
        reply_to = ""
    return obj, task_id, reply_to


def decode_task(data: bytes, *, bytes_max: int, peer: str = "") -> Task:
    """Decode and validate one task, or raise ``RemoteProtocolError`` saying why not."""
    return _decode_from_producer(_task_decoder, data, bytes_max, peer)


def decode_intake(
    data: bytes, *, bytes_max: int, peer: str = ""
) -> Task | Cancel | StatusQuery | Drain | Tasks:
    """What a producer (or an operator's tool) may PUSH to the ingress: a Task, a Cancel, a
    StatusQuery, a Drain, or Tasks (several of them, undecoded).  Raises ``RemoteProtocolError`` saying why not: an unknown ``t``
    is counted as ``unknown_type``, a malformed admin message as ``bad_admin``."""
    return _decode_from_producer(_intake_decoder, data, bytes_max, peer)


def _decode_from_producer(
    decoder: msgspec.msgpack.Decoder, data: bytes, bytes_max: int, peer: str
) -> Any:
    if len(data) > bytes_max:
        _, task_id, reply_to = _peek(data, bytes_max)
        raise RemoteProtocolError(
            f"message of {len(data)} bytes exceeds the limit of {bytes_max} bytes",
            code=ErrorCode.BAD_REQUEST,
            reason="oversized",
            peer=peer,
            task_id=task_id,
            reply_to=reply_to,
        )
    try:
        task = decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        obj, task_id, reply_to = _peek(data, bytes_max)
        reason = ""
        kind = obj.get("t") if isinstance(obj, dict) else None
        if obj is None:
            hint, code = "not a MessagePack message", ErrorCode.BAD_REQUEST
        elif (
            isinstance(obj, dict) and type(obj.get("v")) is int and obj["v"] != PROTOCOL_VERSION
        ):  # (a v of another type, "1" or nil, is a bad_request below: no version at all)
            hint = f"protocol version {obj['v']!r} is not supported; this daemon speaks {PROTOCOL_VERSION}"
            code = ErrorCode.UNSUPPORTED_VERSION
        elif decoder is _intake_decoder and type(kind) is int and kind not in INTAKE_TYPES:
            known = ", ".join(f"{n} ({name})" for n, name in INTAKE_TYPES.items())
            hint = f"unknown message type t={kind}: the ingress takes {known}"
            code, reason = ErrorCode.BAD_REQUEST, "unknown_type"
        elif type(kind) is int and kind in ADMIN_TYPES:
            hint = f"invalid {INTAKE_TYPES[kind]}: {exc}"
            code, reason = ErrorCode.BAD_REQUEST, "bad_admin"
        else:  # named by its t where that is one the ingress (or a peer) takes
            what = INTAKE_TYPES.get(kind, "message") if type(kind) is int else "message"
            hint, code = f"invalid {what}: {exc}", ErrorCode.BAD_REQUEST
        raise RemoteProtocolError(
            hint, code=code, peer=peer, task_id=task_id, reply_to=reply_to, reason=reason
        ) from None
    if task.v != PROTOCOL_VERSION:
        if isinstance(task, Task):
            answer_id, answer_to = task.id, task.reply_to
        else:  # (Tasks: a producer's id and reply_to there, which the struct does not keep)
            _, answer_id, answer_to = _peek(data, bytes_max)
        raise RemoteProtocolError(
            f"protocol version {task.v} is not supported; this daemon speaks {PROTOCOL_VERSION}",
            code=ErrorCode.UNSUPPORTED_VERSION,
            peer=peer,
            task_id=answer_id,
            reply_to=answer_to,
        )
    return task


# A forwarder writes out every field of a task, also those its producer left to their
# defaults (about 200 bytes of them), and its floats as float64 (9 bytes, where a producer
# may send an int of 1: 8 more for each float field and each logit_bias bias), so a
# forwarded task may encode that much larger than the frame the ingress accepted
# (tests/test_messages.py builds the most: about 2.7 KB).
FORWARD_REENCODE_SLACK_BYTES = 1024 + 8 * LOGIT_BIAS_MAX
# Every field of a Task but its prompt (and a structured output's form, or prompt token ids,
# which are checked apart) encodes in less than this: bounded strings and lists, at most
# about 11.3 KB with every string of 4-byte characters and a full logit_bias and
# stop_token_ids (tests/test_http_token_bias.py).
TASK_FIXED_BYTES_MAX = 16384


def check_forwarded_task(task: Task, *, bytes_max: int) -> None:
    """Validate a task that arrived inside a peer's Forward (already decoded, so its types,
    bounds and reply_to are checked) as the ingress validates a producer's: its protocol
    version, and its size against the ingress's ``bytes_max`` (with
    ``FORWARD_REENCODE_SLACK_BYTES``).  Raises ``RemoteProtocolError`` with the code to refuse
    it with.  O(1) unless the prompt is large enough to matter, then one encode."""
    if task.v != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"protocol version {task.v} is not supported; this daemon speaks {PROTOCOL_VERSION}",
            code=ErrorCode.UNSUPPORTED_VERSION,
            task_id=task.id,
            reply_to=task.reply_to,
        )
    limit = bytes_max + FORWARD_REENCODE_SLACK_BYTES
    # UTF-8: at most 4 bytes a char.  A structured output's text is as unbounded as a
    # prompt for this: such a (rare) task is encoded.
    ids = task.params.prompt_token_ids
    if (
        4 * len(task.prompt) + TASK_FIXED_BYTES_MAX > limit
        or task.params.structured is not None
        or (ids is not None and 5 * len(ids) + TASK_FIXED_BYTES_MAX > limit)
    ):
        size = len(encode(task))
        if size > limit:
            raise RemoteProtocolError(
                f"task of {size} bytes exceeds the limit of {bytes_max} bytes",
                code=ErrorCode.BAD_REQUEST,
                reason="oversized",
                task_id=task.id,
                reply_to=task.reply_to,
            )


# A Tasks frame's head: {"v": 1, "t": 6, "items": [...]}, the items as encoded alone.
_TASKS_HEAD = b"\x83\xa1v" + bytes((PROTOCOL_VERSION,)) + b"\xa1t" + bytes((MsgType.TASKS,))
_TASKS_HEAD += b"\xa5items"


def pack_tasks(frames: list[bytes], *, pack_id: str = "", reply_to: str = "") -> bytes:
    """Encoded producer messages (Tasks, Cancels) as one Tasks frame, in order (the caller
    keeps it within the daemon's ``ingress.message_bytes_max``).  ``pack_id`` and
    ``reply_to``: the frame's own top-level ``id`` and ``reply_to``, which a daemon that
    takes Tasks frames ignores and one that does not answers with a ``bad_request`` Result
    for that id (docs/PROTOCOL.md, "Tasks")."""
    if not pack_id:
        return b"".join((_TASKS_HEAD, _array_head(len(frames)), *frames))
    fields = {"v": PROTOCOL_VERSION, "t": int(MsgType.TASKS), "id": pack_id}
    head = msgspec.msgpack.encode({**fields, "reply_to": reply_to, "items": []})
    # The map's last value, the empty array (0x90), is replaced by the items.
    return b"".join((head[:-1], _array_head(len(frames)), *frames))


def _array_head(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def decode_reply(data: bytes) -> Chunk | Result:
    """Decode a Chunk or Result (the producer's side).  Raises ``RemoteProtocolError``."""
    try:
        return _reply_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RemoteProtocolError(f"invalid reply: {exc}", code=ErrorCode.BAD_REQUEST) from None


# A Replies frame: {"v": 1, "t": 5, "items": [Chunk or Result, ...]}, the items as encoded
# alone (docs/PROTOCOL.md, "Replies").  Built from the encoded replies by concatenation.
_REPLIES_HEAD = b"\x83\xa1v" + bytes((PROTOCOL_VERSION,)) + b"\xa1t" + bytes((MsgType.REPLIES,))
_REPLIES_HEAD += b"\xa5items"
# A Replies frame holds at most this many bytes of replies (one reply larger goes alone).
REPLIES_BYTES_MAX = 256 * 1024
# The largest reply frame a reply address takes (ZMQ_MAXMSGSIZE on a producer's PULL and the
# door's): a Result carries the whole output text, so one reply may be large, but bounded.
REPLY_FRAME_BYTES_MAX = 64 * 1024 * 1024


class Replies(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.REPLIES)):
    v: int = PROTOCOL_VERSION
    items: list[Chunk | Result]


_replies_decoder = msgspec.msgpack.Decoder(Chunk | Result | Replies)


def replies_groups(frames: list[bytes], bytes_max: int = REPLIES_BYTES_MAX) -> list[list[bytes]]:
    """Encoded Chunks/Results for one reply address in order, cut into runs of at most
    ``bytes_max`` bytes (a larger reply alone): each run is one frame (``replies_frame``)."""
    out: list[list[bytes]] = []
    group: list[bytes] = []
    size = 0
    for frame in frames:
        if group and size + len(frame) > bytes_max:
            out.append(group)
            group, size = [], 0
        group.append(frame)
        size += len(frame)
    if group:
        out.append(group)
    return out


def pack_replies(frames: list[bytes], bytes_max: int = REPLIES_BYTES_MAX) -> list[bytes]:
    """Encoded Chunks/Results for one reply address as few frames as ``bytes_max`` allows, in
    order: a Replies frame for several, the reply itself for a lone one."""
    return [replies_frame(group) for group in replies_groups(frames, bytes_max)]


def replies_frame(items: list[bytes]) -> bytes:
    """One frame for a run of encoded replies: a Replies frame, or the lone reply itself."""
    if len(items) == 1:
        return items[0]
    return b"".join((_REPLIES_HEAD, _array_head(len(items)), *items))


def decode_replies(data: bytes) -> list[Chunk | Result]:
    """The Chunks/Results in one frame at a producer that set ``batch_replies``: a Replies
    frame's items, or the one reply.  Raises ``RemoteProtocolError``."""
    try:
        msg = _replies_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RemoteProtocolError(f"invalid reply: {exc}", code=ErrorCode.BAD_REQUEST) from None
    return msg.items if type(msg) is Replies else [msg]
