"""Several messages in one frame: a producer's Tasks frame (``pack_tasks``), and the Replies
frames an owner sends a reply address that set ``batch_replies`` (``pack_replies``); a
producer's decoders of what comes back (``decode_reply``, ``decode_replies``).  The messages
themselves are core/messages.py; docs/PROTOCOL.md, "Tasks" and "Replies", is the wire."""

from __future__ import annotations

import msgspec

from gossipd.core.messages import PROTOCOL_VERSION, Chunk, ErrorCode, MsgType, ReplyMessage, Result
from gossipd.errors import RemoteProtocolError

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)


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
    head = _encoder.encode({**fields, "reply_to": reply_to, "items": []})
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
