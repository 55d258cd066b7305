"""Fuzzing: any input decodes to a valid message or raises RemoteProtocolError, and the
membership core survives any sequence of messages with its invariants intact.

Every decoder that reads the network (a producer's intake, the replies a producer reads, the
daemons' fan-out and gossip messages) gets maps built around each message's real field names
and types, each field sometimes missing or of another type, sometimes an unknown field, the
packed bytes sometimes truncated or with a byte changed; and raw bytes.  The SWIM node gets
sequences of well-formed messages with forged incarnations (up to the bound), updates about
itself, foreign cluster names and garbage, with time moving on and timers firing.

How many examples: the "fuzz" hypothesis profile (tests/conftest.py), GOSSIPD_FUZZ_EXAMPLES
(300 by default; the nightly run, docs/OPERATIONS.md, sets 100,000).
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gossipd.core.codec import check_forwarded_task, decode_intake, decode_reply, decode_task
from gossipd.core.gossip_messages import (
    Ack,
    Alive,
    Dead,
    GossipOnly,
    GpuState,
    Left,
    MemberRecord,
    Meta,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Suspect,
    decode_gossip,
    encode_gossip,
)
from gossipd.core.membership import LIVE_STATES, State, _contribution
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Chunk,
    ErrorCode,
    Result,
    Task,
    encode,
    endpoint_problem,
)
from gossipd.core.peer_messages import Forward, PeerBatch, decode_peer, encode_peer
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig
from gossipd.errors import RemoteProtocolError

FUZZ = settings(settings.get_profile("fuzz"))
CODES = {c.value for c in ErrorCode}

# -- values ---------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=30)
    | st.binary(max_size=30),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-3, 3), children, max_size=4)
    ),
    max_leaves=12,
)
EDGE_INTS = [-1, 0, 1, 2**31, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
nat = st.integers(0, 100) | st.sampled_from(EDGE_INTS)
version = st.sampled_from([PROTOCOL_VERSION] * 6 + [0, 2, -1, 2**64 - 1])
ident = st.text(max_size=12) | st.sampled_from(["a", "b", "me", ""]) | st.text(min_size=126)
endpoint = st.sampled_from(
    [
        "tcp://127.0.0.1:5000",
        "tcp://[::1]:1",
        "ipc:///tmp/x",
        "tcp://*:1",
        "tcp://h:0",
        "tcp://h:70000",
        "tcp://h",
        "",
    ]
) | st.text(max_size=20)
ratio = st.floats(-1, 2) | st.sampled_from([0.0, 1.0, float("nan"), float("inf")])


@st.composite
def fields(draw: st.DrawFn, spec: dict[str, st.SearchStrategy[Any]]) -> dict[Any, Any]:
    """A map with ``spec``'s field names: each field usually of its type, sometimes missing
    or of any type; sometimes an unknown field too."""
    out: dict[Any, Any] = {}
    for name, valid in spec.items():
        roll = draw(st.integers(0, 19))
        if roll == 0:
            continue
        out[name] = draw(msgpack_values) if roll == 1 else draw(valid)
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.text(max_size=8))] = draw(msgpack_values)
    return out


params_map = fields(
    {
        "max_tokens": nat,
        "temperature": ratio,
        "top_p": ratio,
        "top_k": st.integers(-2, 3),
        "seed": st.none() | nat,
        "stop": st.lists(st.text(max_size=70), max_size=10),
        "ignore_eos": st.booleans(),
        "logprobs": st.none() | st.integers(-1, 22),
        "prompt_logprobs": st.none() | st.integers(-1, 22),
        "prompt_token_ids": st.none() | st.lists(st.integers(-2, 2**31 + 1), max_size=5),
        "logit_bias": st.none()
        | st.dictionaries(
            st.integers(-2, 2**31 + 1) | st.text(max_size=3), ratio | nat, max_size=4
        ),
        "stop_token_ids": st.none() | st.lists(st.integers(-2, 2**31 + 1), max_size=5),
        "add_special_tokens": st.booleans() | st.none(),
    }
)
task_spec = {
    "v": version,
    "t": st.sampled_from([1] * 5 + [4, 3, 99]),
    "id": ident,
    "key": st.text(max_size=20),
    "prompt": st.text(max_size=100),
    "params": params_map,
    "reply_to": endpoint,
    "timeout_ms": nat,
    "stream": st.booleans(),
    "model": st.text(max_size=10),
    "traceparent": st.text(max_size=10),
    "attempt": nat,
}
task_map = fields(task_spec)
cancel_map = fields({"v": version, "t": st.sampled_from([4, 4, 1]), "id": ident})
timings_map = fields({"queued_ms": ratio, "first_token_ms": ratio, "total_ms": ratio})
# A TokenLogprob: [token, logprob, [[token, logprob], ...]], sometimes broken.
token_logprob = (
    st.tuples(
        st.text(max_size=6), ratio, st.lists(st.tuples(st.text(max_size=4), ratio), max_size=22)
    ).map(list)
    | msgpack_values
)
error_map = fields(
    {"code": st.sampled_from(sorted(CODES)), "message": st.text(), "retry_after_ms": nat}
)
reply_map = fields(
    {
        "v": version,
        "t": st.sampled_from([2, 3, 3, 1]),
        "id": ident,
        "seq": nat,
        "delta": st.text(max_size=10),
        "ok": st.booleans(),
        "text": st.text(max_size=20),
        "error": st.none() | error_map,
        "node": ident,
        "attempts": nat,
        "chunks": nat,
        "timings": timings_map,
        "logprobs": st.none() | st.lists(token_logprob, max_size=4),
        "prompt_logprobs": st.none() | st.lists(token_logprob, max_size=4),
    }
)
gpu_map = fields(
    {
        "gpu_index": nat,
        "ingress": endpoint,
        "model": st.text(max_size=10),
        "memory_free_mb": nat,
        "utilization_pct": st.integers(-1, 101),
        "kv_cache_usage_ratio": ratio,
        "capacity_weight": ratio,
        "rpc": endpoint,
        "inflight": nat,
        "status": st.sampled_from(["serving", "draining", "unhealthy", "x"]),
        "prefixes": st.lists(nat, max_size=5),
    }
)
update_map = fields(
    {
        "k": st.integers(0, 6),
        "node": ident,
        "incarnation": nat,
        "addr": endpoint,
        "by": ident,
        "version": nat,
        "gpu": gpu_map,
    }
)
record_map = fields(
    {
        "node": ident,
        "addr": endpoint,
        "incarnation": nat,
        "state": st.sampled_from(["alive", "suspect", "dead", "left", "zombie"]),
        "meta_version": nat,
        "gpu": st.none() | gpu_map,
    }
)
gossip_map = fields(
    {
        "v": version,
        "t": st.integers(9, 16),
        "cluster": st.sampled_from(["default", "other", ""]),
        "src": ident,
        "src_addr": endpoint,
        "updates": st.lists(update_map, max_size=4),
        "seq": nat,
        "target": ident,
        "target_addr": endpoint,
        "checksum": nat,
        "reply": st.booleans(),
        "join": st.booleans(),
        "members": st.lists(record_map, max_size=4),
        "page": st.integers(-2, 2**31 + 1) | st.sampled_from([0, 1]),  # push-pull pages
        "more": st.booleans(),
    }
)
peer_item_map = fields(
    {
        "v": version,
        "t": st.sampled_from([20, 20, 21, 22, 4, 24, 23, 28, 29, 34, 35]),
        "req": nat,
        "src": ident,
        "node": ident,
        "task": task_map,
        "remaining_ms": nat,
        "attempt": nat,
        "if_free": st.booleans() | st.integers(0, 1),  # the owner check (non-bool: refused)
        "accepted": st.booleans(),
        "code": st.text(max_size=10),
        "message": st.text(max_size=10),
        "retry_after_ms": nat,
        "id": ident,
        "model": st.text(max_size=130),  # ModelCard (at most 128)
        "max_model_len": st.integers(-1, 2**31 + 1),
        # ReplayQuery / ReplayKnown
        "tasks": st.lists(st.lists(ident | st.text(max_size=42), max_size=3), max_size=3),
        "known": st.lists(ident, max_size=3),
    }
)
peer_map = peer_item_map | fields(
    {"v": version, "t": st.just(23), "items": st.lists(peer_item_map, max_size=4)}
)


@st.composite
def frames(draw: st.DrawFn, maps: st.SearchStrategy[Any]) -> bytes:
    """A packed map, sometimes truncated or with one byte changed; or raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    frame = msgpack.packb(draw(maps))
    how = draw(st.integers(0, 9))
    if how == 0 and frame:
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif how == 1 and frame:
        at = draw(st.integers(0, len(frame) - 1))
        frame = frame[:at] + bytes([draw(st.integers(0, 255))]) + frame[at + 1 :]
    return frame


def refused_properly(exc: RemoteProtocolError) -> None:
    assert exc.code in CODES and exc.hint


# -- decoders -------------------------------------------------------------------------------


@FUZZ
@given(frames(task_map | cancel_map))
def test_fuzz_producer_intake_decodes_to_a_valid_message_or_is_refused(frame: bytes) -> None:
    for decode in (decode_intake, decode_task):
        try:
            msg = decode(frame, bytes_max=1 << 16)
        except RemoteProtocolError as exc:
            refused_properly(exc)
            continue
        assert msg.v == PROTOCOL_VERSION
        if isinstance(msg, Task):
            assert endpoint_problem(msg.reply_to) is None
            check_forwarded_task(msg, bytes_max=1 << 16)  # what ingress took, an owner takes
        assert encode(decode(encode(msg), bytes_max=1 << 17)) == encode(msg)  # NaN-safe


@FUZZ
@given(frames(reply_map))
def test_fuzz_replies_a_producer_reads_decode_or_are_refused(frame: bytes) -> None:
    try:
        msg = decode_reply(frame)
    except RemoteProtocolError as exc:
        refused_properly(exc)
        return
    assert isinstance(msg, Chunk | Result)
    assert encode(decode_reply(encode(msg))) == encode(msg)  # NaN != NaN: compare bytes


@FUZZ
@given(frames(peer_map))
def test_fuzz_peer_messages_decode_to_a_valid_message_or_are_refused(frame: bytes) -> None:
    try:
        msg = decode_peer(frame, bytes_max=1 << 16)
    except RemoteProtocolError as exc:
        refused_properly(exc)
        return
    assert msg.v == PROTOCOL_VERSION
    assert encode_peer(decode_peer(encode_peer(msg), bytes_max=1 << 17)) == encode_peer(msg)
    items = msg.items if isinstance(msg, PeerBatch) else [msg]
    for item in items:
        if isinstance(item, Forward):  # what the owner then checks raises nothing else
            try:
                check_forwarded_task(item.task, bytes_max=1 << 16)
            except RemoteProtocolError as exc:
                refused_properly(exc)


@FUZZ
@given(frames(gossip_map))
def test_fuzz_gossip_messages_decode_to_a_valid_message_or_are_refused(frame: bytes) -> None:
    try:
        msg = decode_gossip(frame, bytes_max=1 << 16)
    except RemoteProtocolError as exc:
        refused_properly(exc)
        return
    assert msg.v == PROTOCOL_VERSION
    assert encode_gossip(decode_gossip(encode_gossip(msg), bytes_max=1 << 17)) == encode_gossip(msg)


# -- the membership core --------------------------------------------------------------------

ME = "me"
NAMES = [ME, "a", "b", "c", "ghost"]
CLUSTER = "c1"
MAX_INCARNATION = 2**53  # gossip_messages.Incarnation's bound


def addr_of(name: str) -> str:
    return f"tcp://{name}:7946"


names = st.sampled_from(NAMES)
incarnations = st.integers(0, 6) | st.sampled_from([MAX_INCARNATION - 1, MAX_INCARNATION])
updates = st.one_of(
    st.builds(Alive, node=names, incarnation=incarnations, addr=names.map(addr_of)),
    st.builds(Suspect, node=names, incarnation=incarnations, by=names),
    st.builds(Dead, node=names, incarnation=incarnations, by=names),
    st.builds(Left, node=names, incarnation=incarnations),
    st.builds(
        Meta,
        node=names,
        version=st.integers(0, 5),
        gpu=st.builds(GpuState, inflight=st.integers(0, 9), rpc=names.map(addr_of)),
    ),
)
records = st.builds(
    MemberRecord,
    node=names,
    addr=names.map(addr_of),
    incarnation=incarnations,
    state=st.sampled_from(["alive", "suspect", "dead", "left"]),
)


@st.composite
def gossip_messages(draw: st.DrawFn) -> Any:
    src = draw(names)
    header = {
        "cluster": draw(st.sampled_from([CLUSTER, CLUSTER, CLUSTER, "other"])),
        "src": src,
        "src_addr": addr_of(src),
        "updates": draw(st.lists(updates, max_size=4)),
    }
    seq = draw(st.integers(0, 5))
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return Ping(**header, seq=seq, target=draw(names))
    if kind == 1:
        return Ack(**header, seq=seq, checksum=draw(st.integers(0, 2**63 - 1)))
    if kind == 2:
        return Nack(**header, seq=seq)
    if kind == 3:
        target = draw(names)
        return PingReq(**header, seq=seq, target=target, target_addr=addr_of(target))
    if kind == 4:
        return PushPull(
            **header,
            reply=draw(st.booleans()),
            join=draw(st.booleans()),
            members=draw(st.lists(records, max_size=5)),
            page=draw(st.integers(0, 3)),
            more=draw(st.booleans()),
        )
    return GossipOnly(**header)


class SwimFuzz(RuleBasedStateMachine):
    """One SwimNode ("me") fed arbitrary messages; the invariants after every step."""

    @initialize(seed=st.integers(0, 2**32))
    def start(self, seed: int) -> None:
        self.config = SwimConfig.lan(cluster=CLUSTER)
        self.now = 0.0
        self.node = SwimNode(
            self.config, node=ME, addr=addr_of(ME), rng=random.Random(seed), now=self.now
        )
        self.node.bootstrap(self.now, [(n, addr_of(n)) for n in ("a", "b", "c")])
        self.incarnation = self.node.table.incarnation

    def _drain(self) -> None:
        for _, data in self.node.take_outbox():
            # Whatever we send, our peers can decode (no field past its bound).
            decode_gossip(data, bytes_max=self.config.message_bytes_max)
        for event in self.node.take_events():
            if event.node == ME:
                assert event.kind == "refuted", event

    @rule(msg=gossip_messages(), dt_s=st.floats(0, 0.5))
    def receive(self, msg: Any, dt_s: float) -> None:
        self.now += dt_s
        table = self.node.table
        before = (table.version, table.incarnation, table.checksum())
        self.node.receive(self.now, encode_gossip(msg))
        if msg.cluster != CLUSTER:  # read no further than the envelope
            assert (table.version, table.incarnation, table.checksum()) == before
            assert self.node.take_outbox() == [] and self.node.take_events() == []
        self._drain()

    @rule(frame=frames(gossip_map))
    def receive_garbage(self, frame: bytes) -> None:
        self.node.receive(self.now, frame)
        self._drain()

    @rule(dt_s=st.floats(0, 3))
    def tick(self, dt_s: float) -> None:
        self.now += dt_s
        if self.now >= self.node.next_deadline():
            self.node.tick(self.now)
        self._drain()

    @invariant()
    def never_a_member_of_itself_nor_dead(self) -> None:
        assert ME not in self.node.table.members

    @invariant()
    def own_incarnation_only_increases_within_its_bound(self) -> None:
        incarnation = self.node.table.incarnation
        assert self.incarnation <= incarnation <= MAX_INCARNATION
        self.incarnation = incarnation

    @invariant()
    def live_count_and_checksum_agree_with_the_table(self) -> None:
        table = self.node.table
        live = {n: m for n, m in table.members.items() if m.state in LIVE_STATES}
        assert table.live_count() == 1 + len(live) >= 1
        xor = _contribution(ME, table.incarnation)
        for name, member in live.items():
            xor ^= _contribution(name, member.incarnation)
        assert table.checksum() == xor >> 1
        for state, names_in in ((State.SUSPECT, table.suspects), (State.DEAD, table.dead)):
            assert names_in == {n for n, m in table.members.items() if m.state is state}
        assert table.left == {n for n, m in table.members.items() if m.state is State.LEFT}


SwimFuzz.TestCase.settings = settings(
    settings.get_profile("fuzz"), stateful_step_count=30, deadline=None
)
TestSwimFuzz = SwimFuzz.TestCase
