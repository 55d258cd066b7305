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
   passes ``decode_task`` (codec.py) is a well-formed ``Task``; anything else raises
   ``RemoteProtocolError`` with the error code to answer with.  No input makes the decoder
   raise anything else.
2. Structs are frozen and keyword-only, and ``__post_init__`` checks what types cannot, so an
   invalid message can neither be decoded nor built.
3. A refused message is answered when it is possible: if its ``reply_to`` (and ``id``) can be
   read from the broken bytes, the caller gets them in the exception.

The codec (decoding and checking a producer's frames, several messages in one frame) is
codec.py.
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


def encode(message: Task | Cancel | Chunk | Result) -> bytes:
    return _encoder.encode(message)


def error_result(
    task_id: str, code: ErrorCode, message: str, *, node: str = "", retry_after_ms: int = 0
) -> Result:
    return Result(
        id=task_id,
        ok=False,
        error=ErrorInfo(code=code.value, message=message[:4096], retry_after_ms=retry_after_ms),
        node=node,
    )


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
