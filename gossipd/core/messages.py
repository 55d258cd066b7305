"""Every message that crosses a producer <-> daemon socket, and its codec.

The wire format is plain MessagePack: each message is a map with ``v`` (protocol version) and
``t`` (message type, a number from ``MsgType``).  ``docs/PROTOCOL.md`` documents the same
fields for producers written without gossipd's code.  What every message shares is here too
(``MsgType``, ``UpdateKind``, ``ErrorCode``, the version check between daemons); the other
messages have their own modules: membership in ``gossip_messages.py``, fan-out in
``peer_messages.py``, the answers to admin requests in ``admin_messages.py``; and a Task's
sampling parameters, with the log probabilities its answers carry, in ``sampling.py``.

Rules:
1. Decoding validates everything: types, lengths, ranges and cross-field rules.  A message that
   passes ``decode_task`` is a well-formed ``Task``; anything else raises ``RemoteProtocolError``
   with the error code to answer with.  No input makes the decoder raise anything else.
2. Structs are frozen and keyword-only, and ``__post_init__`` checks what types cannot, so an
   invalid message can neither be decoded nor built.
3. A refused message is answered when it is possible: if its ``reply_to`` (and ``id``) can be
   read from the broken bytes, the caller gets them in the exception.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from gossipd.core.sampling import (
    LOGIT_BIAS_MAX,
    Logprobs,
    SamplingParams,
    TokenLogprob,
    check_logprobs,
)
from gossipd.errors import RemoteProtocolError

PROTOCOL_VERSION = 1

# Every length limit on a string field counts Unicode code points (Python's len, msgspec's
# max_length), never UTF-8 bytes nor UTF-16 units: an id of 128 emoji (512 bytes) is valid.
# Only frame and memory limits count bytes (docs/PROTOCOL.md, "Types, units and limits").
TASK_ID_CHARS_MAX = 128
# A refusal echoes an invalid id as given, cut to this: a reply a producer's frame can make
# large would otherwise be as large as that frame, and wait as long in the reply queues.
ECHOED_ID_CHARS_MAX = 1024
TASK_KEY_CHARS_MAX = 256
ENDPOINT_CHARS_MAX = 256


class MsgType(enum.IntEnum):
    """Append-only: these numbers are the protocol.  Never renumber or reuse one."""

    TASK = 1
    CHUNK = 2
    RESULT = 3
    CANCEL = 4
    REPLIES = 5  # several Chunks/Results in one frame, to a producer that asked (batch_replies)
    TASKS = 6  # several producer messages in one frame (a producer's choice)
    # Membership (SWIM), daemon to daemon.
    PING = 10
    ACK = 11
    NACK = 12
    PING_REQ = 13
    PUSH_PULL = 14
    GOSSIP = 15
    # Fan-out between daemons.
    FORWARD = 20
    FORWARD_REPLY = 21
    TASK_DONE = 22
    PEER_BATCH = 23
    WITHDRAW = 24
    CONFIRM = 25  # an owner holding Results asks their forwarder: still routed to me?
    CONFIRM_REPLY = 26
    RELAY = 27  # an owner's reply for a task whose forwarder holds the client (Forward.relay)
    MODEL_QUERY = 28  # what is your model's max_model_len? (from 0.3.0)
    MODEL_CARD = 29
    # Admin: an operator's tool to any daemon's ingress; the answer goes to reply_to.
    STATUS_QUERY = 30
    STATUS_REPORT = 31
    DRAIN = 32
    ADMIN_REPLY = 33
    # Fan-out again (from 0.3.0; 20-29 were taken): a restarted daemon asks members before
    # it runs its journal's unfinished tasks again.
    REPLAY_QUERY = 34
    REPLAY_KNOWN = 35
    MOVED = 36  # an owner handed a forwarded task over to another member (from 0.3.1)


class UpdateKind(enum.IntEnum):
    """Append-only: kinds of membership updates carried piggyback."""

    ALIVE = 1
    SUSPECT = 2
    DEAD = 3
    LEFT = 4
    META = 5
    TERM = 6
    DIRECTIVE = 7


class ErrorCode(enum.StrEnum):
    """Append-only: producers switch on these strings."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ENGINE_ERROR = "engine_error"
    UNAVAILABLE = "unavailable"
    SHUTTING_DOWN = "shutting_down"
    CANCELLED = "cancelled"
    OVER_BUDGET = "over_budget"
    ID_IN_USE = "id_in_use"  # the id is another producer's pending or cached task: use another
    # Between daemons only: a Forward with if_free reached an owner whose engine is saturated
    # (docs/PROTOCOL.md "Fresh where placement looks"); a producer never gets it.
    SATURATED = "saturated"


# An endpoint that we may connect a socket to: tcp://host:port (host name, IPv4, or [IPv6])
# or ipc://path.  Wildcards are for binding, never for a reply address.  \Z, not $ (which
# also matches before a last newline: ZeroMQ's connect refuses "...:5\n", and an answer's
# send must not be where that is found out); no whitespace in a path (a route is the
# address, a space, and the producer key: sockets.py splits at the first space).
_ENDPOINT_RE = re.compile(
    r"^(?:tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[(?P<v6>[0-9A-Fa-f:.]{2,45})\])"
    r":(?P<port>[0-9]{1,5})|ipc://[^\x00*\s]{1,107})\Z"  # ([0-9]: \d takes any script's digits)
)
# A Unix socket's path: 108 bytes with its NUL (sun_path); ZeroMQ's connect refuses longer
# ("File name too long"), counted in bytes, not characters.
IPC_PATH_BYTES_MAX = 107


# Every task is checked, and most come from a few reply addresses (the HTTP door's: every
# request's): the answer is remembered for the last 4,096 (at most ~1.3 MB).
@functools.lru_cache(maxsize=4096)
def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a connectable ZeroMQ endpoint, or None when it is."""
    match = _ENDPOINT_RE.match(endpoint)
    if match is None:
        return f"{endpoint[:80]!r} is not tcp://HOST:PORT or ipc://PATH"
    port = match.group("port")
    if port is not None and not 1 <= int(port) <= 65535:
        return f"port {port} is outside 1..65535"
    v6 = match.group("v6")
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            return f"[{v6}] is not an IPv6 address"
    if port is None and len(endpoint.encode()) - len("ipc://") > IPC_PATH_BYTES_MAX:
        return f"an ipc path is at most {IPC_PATH_BYTES_MAX} bytes in UTF-8"
    return None


TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=TASK_ID_CHARS_MAX)]
Endpoint = Annotated[str, msgspec.Meta(min_length=6, max_length=ENDPOINT_CHARS_MAX)]
NodeName = Annotated[str, msgspec.Meta(max_length=128)]


# A CURVE public key in z85 (40 characters of the Z85 alphabet), or empty.
PRODUCER_KEY_PATTERN = r"^(?:[0-9a-zA-Z.:+=^!/*?&<>()\[\]{}@%$#-]{40})?\Z"
_PRODUCER_KEY_RE = re.compile(PRODUCER_KEY_PATTERN)
# Keys that matched it: a forwarded task's key is one of a few producers' keys, and a set
# lookup (0.03 us) is cheaper than the regex (0.19 us), once per forwarded task.  Bounded:
# emptied when full, so a stream of distinct keys costs the regex, never memory.
_KEYS_MATCHED: set[str] = set()
_KEYS_MATCHED_MAX = 1024


def logprobs_of(message: Chunk | Result) -> list[TokenLogprob] | None:
    """A Chunk's or Result's log probabilities; None where its task asked none."""
    logprobs = message.logprobs
    return None if logprobs is None or logprobs is UNSET else logprobs


def prompt_logprobs_of(message: Chunk | Result) -> list[TokenLogprob] | None:
    """A Result's (or a first Chunk's) prompt log probabilities; None where absent."""
    entries = message.prompt_logprobs
    return None if entries is None or entries is UNSET else entries


def prefix_text(task: Task, chars_max: int) -> str:
    """What prefix-aware placement hashes (core/prefix.py reads at most ``chars_max``
    characters): the prompt, or its leading token ids as text (prompts that share leading
    ids share a leading text; an id takes 2 characters at least)."""
    ids = task.params.prompt_token_ids
    if ids is None:
        return task.prompt
    return ",".join(map(str, ids[: chars_max // 2 + 1])) + ","


def reply_route(reply_to: str, producer_key: str) -> str:
    """Where replies go: ``reply_to``, with the producer's key when it has one ("ENDPOINT
    KEY": the reply sender connects to ENDPOINT and checks that its server holds KEY)."""
    return f"{reply_to} {producer_key}" if producer_key else reply_to


TIMEOUT_MS_MAX = 3_600_000  # a task's longest timeout_ms (an hour)


class Task(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.TASK),
):
    """A unit of work from a producer.  ``id`` is chosen by the producer and makes resubmission
    safe: the daemon runs a given id once and re-sends its result to duplicates."""

    v: int
    id: TaskId
    key: Annotated[str, msgspec.Meta(max_length=TASK_KEY_CHARS_MAX)] = ""
    prompt: str
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    reply_to: Endpoint
    # The task's deadline, relative: milliseconds from when a daemon first receives it.
    # Relative, not absolute, so producers and daemons need no synchronised clocks.
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=TIMEOUT_MS_MAX)] = 30_000
    stream: bool = False
    model: Annotated[str, msgspec.Meta(max_length=256)] = ""
    # W3C trace context, passed through untouched so traces join up across hops.
    traceparent: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # How many times the producer has sent this id before (0 on the first send).
    attempt: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    # The producer also reads Replies frames (t = 5) at reply_to: replies to one reply_to that
    # leave together may go as one frame (under CURVE each frame is encrypted on its own).
    batch_replies: bool = False
    # Set by the daemon, never by the producer (whatever a producer sends is replaced): with
    # CURVE, the public key (z85) the producer authenticated with; replies go only to a
    # reply_to whose server proves it holds that key.  Forwards carry it to the owner.
    # (Its pattern is checked in __post_init__: a Meta pattern runs its regex also on the ""
    # that every msgspec producer sends, 0.35 us of a 1.3 us decode, measured.)
    producer_key: Annotated[str, msgspec.Meta(max_length=40)] = ""
    # Sampling fields that take the model's own default (its generation config) where the
    # owner's engine has one, params' value standing in where it has none: MODEL_DEFAULT_*
    # bits.  The HTTP door sets those a request leaves out, as `vllm serve` reads them.
    model_defaults: Annotated[int, msgspec.Meta(ge=0, le=15)] = 0

    def __post_init__(self) -> None:
        if self.params.prompt_token_ids is not None and self.prompt:
            raise ValueError(
                "params.prompt_token_ids: with it, prompt must be empty (one or the other)"
            )
        problem = endpoint_problem(self.reply_to)
        if problem is not None:
            raise ValueError(f"reply_to: {problem}")
        key = self.producer_key
        if key and key not in _KEYS_MATCHED:
            if _PRODUCER_KEY_RE.match(key) is None:
                raise ValueError("producer_key: neither empty nor a Z85 key (40 characters)")
            if len(_KEYS_MATCHED) >= _KEYS_MATCHED_MAX:
                _KEYS_MATCHED.clear()
            _KEYS_MATCHED.add(key)

    @property
    def route(self) -> str:
        """Where its replies go: reply_to, with the producer's key when it has one
        ("ENDPOINT KEY"; the reply sender connects to ENDPOINT and checks KEY)."""
        return reply_route(self.reply_to, self.producer_key)


class Chunk(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.CHUNK),
):
    """A piece of a streamed result.  ``seq`` counts from 0 without gaps, so a producer drops
    a chunk it already has (after a resubmission or a migration) and notices a gap."""

    v: int = PROTOCOL_VERSION
    id: TaskId
    seq: Annotated[int, msgspec.Meta(ge=0)]
    delta: str
    node: NodeName = ""
    # The tokens this delta's text came from, when the task asked logprobs (release 0.3.3);
    # absent (not written) otherwise.
    logprobs: Logprobs | UnsetType | None = UNSET
    # The prompt's tokens (as Result's prompt_logprobs), on a task's first Chunk when it
    # asked prompt_logprobs (release 0.3.4); absent otherwise.
    prompt_logprobs: Logprobs | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.logprobs:
            check_logprobs(self.logprobs)
        if self.prompt_logprobs:
            if self.seq:
                raise ValueError("prompt_logprobs: on a task's first Chunk (seq 0) only")
            check_logprobs(self.prompt_logprobs)


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    code: str
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    # For overloaded / shutting_down: when the producer may try again.
    retry_after_ms: Annotated[int, msgspec.Meta(ge=0)] = 0


class Timings(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Milliseconds spent at the daemon that ran the task."""

    queued_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Tokens a task took, as its engine counted them (OpenAI's ``usage``), and why it
    ended: "length" (max_tokens) or "stop" (end of sequence or a stop string)."""

    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    finish_reason: Annotated[str, msgspec.Meta(max_length=32)] = ""


class Result(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.RESULT),
):
    """The one final answer for a task: ``ok`` with ``text``, or not ok with ``error``."""

    v: int = PROTOCOL_VERSION
    # A task's id; a refusal's echoes the refused message's id as given, also an invalid one
    # (empty, too long: bounded by the frame limit only), "" when it had no string id.
    id: str
    ok: bool
    text: str = ""
    error: ErrorInfo | None = None
    node: NodeName = ""
    attempts: int = 1
    chunks: int = 0
    timings: Timings = msgspec.field(default_factory=Timings)
    # Added in the HTTP door's release: absent (None) from older daemons and on errors.
    usage: TokenUsage | None = None
    # Every generated token's, when the task asked logprobs (release 0.3.3); absent (not
    # written) otherwise.
    logprobs: Logprobs | UnsetType | None = UNSET
    # Every prompt token's, when the task asked prompt_logprobs (release 0.3.4): the first
    # has no log probability (nothing comes before it: logprob 0, no top ones); absent
    # (not written) otherwise.
    prompt_logprobs: Logprobs | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.ok == (self.error is not None):
            raise ValueError("a Result has an error exactly when ok is false")
        if self.logprobs:
            check_logprobs(self.logprobs)
        if self.prompt_logprobs:
            check_logprobs(self.prompt_logprobs)


class Cancel(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    tag_field="t",
    tag=int(MsgType.CANCEL),
):
    """A producer gives up on a task: wherever it runs, its engine request is aborted and it is
    answered with ``cancelled``.  Unknown or finished ids are ignored (and counted)."""

    v: int
    id: TaskId
    # Set by the daemon, never by the producer, as Task's: the key the Cancel came with.  A
    # Cancel passed on to the owner carries it, and only the task's own key cancels it.
    producer_key: Annotated[str, msgspec.Meta(pattern=PRODUCER_KEY_PATTERN)] = ""


# --- Admin (docs/PROTOCOL.md, "Admin"): operator tools to any daemon's ingress PULL, answered
# at reply_to like tasks.  `gossipd status` and `gossipd drain` speak these.  The requests are
# here, beside the intake decoder that reads them; the answers are in admin_messages.py.


class StatusQuery(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.STATUS_QUERY)
):
    """What does this daemon see?  Answered with one StatusReport."""

    v: int
    id: TaskId
    reply_to: Endpoint

    def __post_init__(self) -> None:
        problem = endpoint_problem(self.reply_to)
        if problem is not None:
            raise ValueError(f"reply_to: {problem}")


class Drain(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.DRAIN)):
    """Drain ``node`` (``drain`` true: new tasks go to other members, its queued ones are
    handed off, it keeps running) or put it back to serving (``drain`` false).  A daemon that
    is not ``node`` relays it once to ``node``'s ingress (``relayed`` true), and ``node``
    answers ``reply_to`` with one AdminReply."""

    v: int
    id: TaskId
    reply_to: Endpoint
    node: NodeName
    drain: bool = True
    relayed: bool = False
    # Set by the daemons, never by the producer (the ingress replaces what one sends): with
    # CURVE, the key the asking producer authenticated with, carried on a relay (over the
    # members' authenticated rpc channel) so that ``node`` answers over a connection to a
    # server holding that key, as it answers a Task.
    producer_key: Annotated[str, msgspec.Meta(max_length=40)] = ""

    def __post_init__(self) -> None:
        problem = endpoint_problem(self.reply_to)
        if problem is not None:
            raise ValueError(f"reply_to: {problem}")
        if not self.node:
            raise ValueError("node: name the member to drain")


TASKS_ITEMS_MAX = 1024  # the items of one Tasks frame


class Tasks(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=int(MsgType.TASKS)):
    """Several producer messages in one frame (docs/PROTOCOL.md, "Tasks"): each item is read
    and answered as if it had come as a frame of its own.  Under CURVE each frame is
    encrypted on its own, so 30 tasks in one frame cost one encryption instead of 30.
    Other top-level keys are ignored (no ``forbid_unknown_fields``): a producer's ``id`` and
    ``reply_to`` there are for daemons that do not know ``t`` = 6 (they answer bad_request)."""

    v: int
    # Bounded: each item is decoded, counted and answered on its own, so a frame of a
    # million 1-byte items held the loop for seconds (gossipd's Client packs at most 32).
    items: Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1, max_length=TASKS_ITEMS_MAX)]


ReplyMessage = Chunk | Result
IntakeMessage = Task | Cancel | StatusQuery | Drain | Tasks
# The numbers the ingress takes, and their names (for the refusal of any other type).
INTAKE_TYPES = {
    int(MsgType.TASK): "Task",
    int(MsgType.CANCEL): "Cancel",
    int(MsgType.TASKS): "Tasks",
    int(MsgType.STATUS_QUERY): "StatusQuery",
    int(MsgType.DRAIN): "Drain",
}
ADMIN_TYPES = frozenset({int(MsgType.STATUS_QUERY), int(MsgType.DRAIN)})

_encoder = msgspec.msgpack.Encoder()
_task_decoder = msgspec.msgpack.Decoder(Task)
_intake_decoder = msgspec.msgpack.Decoder(IntakeMessage)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
_any_decoder = msgspec.msgpack.Decoder()
_NIL = msgspec.Raw(b"\xc0")
_STR_HEADS = frozenset((*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB))  # fixstr, str8, str16, str32
# fixmap, fixarray, array16/32, map16/32 (the rest of a 9-byte scalar's heads are scalars or
# bin/ext, which decode as what they hold: bounded by those 9 bytes)
_CONTAINER_HEADS = frozenset((*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF))


def encode(message: Task | Cancel | Chunk | Result) -> bytes:
    return _encoder.encode(message)


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


def error_result(
    task_id: str, code: ErrorCode, message: str, *, node: str = "", retry_after_ms: int = 0
) -> Result:
    return Result(
        id=task_id,
        ok=False,
        error=ErrorInfo(code=code.value, message=message[:4096], retry_after_ms=retry_after_ms),
        node=node,
    )


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
        size = len(_encoder.encode(task))
        if size > limit:
            raise RemoteProtocolError(
                f"task of {size} bytes exceeds the limit of {bytes_max} bytes",
                code=ErrorCode.BAD_REQUEST,
                reason="oversized",
                task_id=task.id,
                reply_to=task.reply_to,
            )


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


# The decoders of gossip_messages.py and peer_messages.py share this rule.
def decode_between_daemons(
    decoder: msgspec.msgpack.Decoder, data: bytes, bytes_max: int, what: str
) -> Any:
    """Size check, decode + validate, version check: one rule for every daemon-to-daemon
    decoder.  Raises ``RemoteProtocolError`` and nothing else."""
    if len(data) > bytes_max:
        raise RemoteProtocolError(
            f"{what} message of {len(data)} bytes exceeds the limit of {bytes_max} bytes",
            code=ErrorCode.BAD_REQUEST,
            reason="oversized",
        )
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RemoteProtocolError(
            f"invalid {what} message: {exc}", code=ErrorCode.BAD_REQUEST
        ) from None
    if message.v != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"{what} protocol version {message.v} is not supported",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    return message
