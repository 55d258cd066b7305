"""The wire codec: valid messages round-trip, every bad input is refused with a reason.

Fuzz invariant: any bytes decode to a Task or raise RemoteProtocolError (nothing else)."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.codec import decode_replies, decode_reply, decode_task, pack_replies, pack_tasks
from gossipd.core.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    ErrorCode,
    ErrorInfo,
    Result,
    Task,
    Tasks,
    encode,
    endpoint_problem,
    error_result,
)
from gossipd.core.peer_messages import (
    Forward,
    ForwardReply,
    ModelCard,
    ModelQuery,
    PeerBatch,
    ReplayKnown,
    ReplayQuery,
    TaskDone,
    Withdraw,
    decode_peer,
    encode_peer,
)
from gossipd.core.sampling import SamplingParams, StructuredOutput
from gossipd.errors import ProtocolError, RemoteProtocolError

LIMIT = 64 * 1024


def plain_task(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "v": 1,
        "t": 1,
        "id": "t-1",
        "prompt": "hi",
        "reply_to": "tcp://127.0.0.1:9",
    }
    base.update(fields)
    return base


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:65535", True),
        ("ipc:///tmp/gossipd.sock", True),
        ("tcp://127.0.0.1:0", False),
        ("tcp://127.0.0.1:65536", False),
        ("tcp://*:5557", False),
        ("tcp://127.0.0.1", False),
        ("http://127.0.0.1:80", False),
        ("", False),
        ("ipc://", False),
        ("tcp://127.0.0.1:5\n", False),  # $ would take it; ZeroMQ's connect would not
        ("ipc:///tmp/gossipd.sock\n", False),
        ("ipc:///tmp/my dir/r.sock", False),  # a route splits at its first space
        ("ipc:///tmp/tab\there", False),
        ("ipc:///" + "a" * 106, True),  # 107 bytes: a Unix socket path's most
        ("ipc:///" + "a" * 107, False),  # ZeroMQ: "File name too long"
        ("ipc:///" + "\u00e9" * 53, True),  # 107 bytes in UTF-8
        ("ipc:///" + "\u00e9" * 54, False),  # 54 characters, 109 bytes
        ("tcp://127.0.0.1:\uff15\uff15\uff15\uff17", False),  # \\d's digits: connect refuses
        ("tcp://127.0.0.1:\u0665\u0665", False),
        ("tcp://[::::::::]:5", False),  # not an address (connect takes it)
        ("tcp://[1.2.3.4]:5", False),
        ("tcp://[fe80::1]:5", True),
        ("tcp://[::ffff:1.2.3.4]:5", True),
    ],
)
def test_endpoint_problem_table(endpoint: str, ok: bool) -> None:
    assert (endpoint_problem(endpoint) is None) is ok


_ZMQ = zmq.Context.instance()
_DIGITS = st.text(st.sampled_from("0123456789\uff15\u0665\u0967"), min_size=1, max_size=6)
_HOSTS = st.sampled_from(["127.0.0.1", "localhost", "a-b.c", "[::1]", "[::]", "[1::2:3]"]) | (
    st.text(st.sampled_from("0123456789abcdefABCDEF:."), min_size=2, max_size=12).map(
        lambda h: f"[{h}]"
    )
)


@settings(max_examples=300, deadline=None)
@given(_HOSTS, _DIGITS)
def test_an_endpoint_the_check_takes_zeromqs_connect_takes(host: str, port: str) -> None:
    """A reply address the task's check takes must be one ZeroMQ connects to: a refusal at
    the first answer's send would lose every reply of a task already run."""
    endpoint = f"tcp://{host}:{port}"
    if endpoint_problem(endpoint) is not None:
        return
    sock = _ZMQ.socket(zmq.PUSH)
    try:
        sock.connect(endpoint)
    finally:
        sock.close(0)


def test_task_round_trips_through_plain_msgpack() -> None:
    task = Task(
        v=1,
        id="a",
        prompt="p",
        reply_to="tcp://h:1",
        params=SamplingParams(max_tokens=3, stop=["x"]),
    )
    raw = msgpack.unpackb(encode(task))
    assert raw["t"] == 1 and raw["v"] == PROTOCOL_VERSION and raw["params"]["stop"] == ["x"]
    assert decode_task(msgpack.packb(raw), bytes_max=LIMIT) == task


def test_minimal_plain_map_is_a_task_with_defaults() -> None:
    task = decode_task(msgpack.packb(plain_task()), bytes_max=LIMIT)
    assert task.timeout_ms == 30_000 and task.params == SamplingParams() and not task.stream


def test_unknown_top_level_keys_are_ignored_for_compatibility() -> None:
    assert decode_task(msgpack.packb(plain_task(future_field=1)), bytes_max=LIMIT).id == "t-1"


@pytest.mark.parametrize(
    ("frame", "code", "hint_part", "answerable"),
    [
        (b"\xc1not msgpack", ErrorCode.BAD_REQUEST, "not a MessagePack", False),
        (msgpack.packb([1, 2, 3]), ErrorCode.BAD_REQUEST, "Expected `object`", False),
        (msgpack.packb(plain_task(prompt=5)), ErrorCode.BAD_REQUEST, "$.prompt", True),
        (
            msgpack.packb({k: v for k, v in plain_task().items() if k != "prompt"}),
            ErrorCode.BAD_REQUEST,
            "prompt",
            True,
        ),
        (msgpack.packb(plain_task(v=2)), ErrorCode.UNSUPPORTED_VERSION, "version 2", True),
        (
            msgpack.packb({"v": 9, "id": "x", "reply_to": "tcp://a:1"}),
            ErrorCode.UNSUPPORTED_VERSION,
            "version 9",
            True,
        ),
        (
            msgpack.packb(plain_task(reply_to="tcp://nowhere")),
            ErrorCode.BAD_REQUEST,
            "reply_to",
            False,
        ),
        (msgpack.packb(plain_task(params={"top_k": 0})), ErrorCode.BAD_REQUEST, "top_k", True),
        (
            msgpack.packb(plain_task(params={"max_tokens": 0})),
            ErrorCode.BAD_REQUEST,
            "max_tokens",
            True,
        ),
        (msgpack.packb(plain_task(params={"bogus": 1})), ErrorCode.BAD_REQUEST, "bogus", True),
        (msgpack.packb(plain_task(id="")), ErrorCode.BAD_REQUEST, "$.id", True),
        (msgpack.packb(plain_task(id="x" * 129)), ErrorCode.BAD_REQUEST, "$.id", True),
        (msgpack.packb(plain_task(timeout_ms=0)), ErrorCode.BAD_REQUEST, "timeout_ms", True),
        # Every bound PROTOCOL.md's Task table gives, one past it.
        (
            msgpack.packb(plain_task(timeout_ms=3_600_001)),
            ErrorCode.BAD_REQUEST,
            "timeout_ms",
            True,
        ),
        (msgpack.packb(plain_task(attempt=-1)), ErrorCode.BAD_REQUEST, "attempt", True),
        (msgpack.packb(plain_task(attempt=1001)), ErrorCode.BAD_REQUEST, "attempt", True),
        (
            msgpack.packb(plain_task(params={"max_tokens": 32769})),
            ErrorCode.BAD_REQUEST,
            "max_tokens",
            True,
        ),
        (
            msgpack.packb(plain_task(params={"temperature": 10.5})),
            ErrorCode.BAD_REQUEST,
            "temperature",
            True,
        ),
        (msgpack.packb(plain_task(params={"top_p": 0.0})), ErrorCode.BAD_REQUEST, "top_p", True),
        (
            msgpack.packb(plain_task(params={"top_k": 100_001})),
            ErrorCode.BAD_REQUEST,
            "top_k",
            True,
        ),
        (msgpack.packb(plain_task(params={"top_k": -2})), ErrorCode.BAD_REQUEST, "top_k", True),
        (msgpack.packb(plain_task(params={"seed": -1})), ErrorCode.BAD_REQUEST, "seed", True),
        (
            msgpack.packb(plain_task(params={"stop": ["s"] * 9})),
            ErrorCode.BAD_REQUEST,
            "stop",
            True,
        ),
        (msgpack.packb(plain_task(params={"stop": [""]})), ErrorCode.BAD_REQUEST, "stop", True),
        *(
            (msgpack.packb(plain_task(params={name: value})), ErrorCode.BAD_REQUEST, name, True)
            for name, value in (
                ("presence_penalty", 2.01),
                ("presence_penalty", -2.01),
                ("frequency_penalty", 2.01),
                ("frequency_penalty", -2.01),
                ("repetition_penalty", 0.0),
                ("repetition_penalty", 10.01),
                ("min_p", -0.01),
                ("min_p", 1.01),
                ("min_tokens", -1),
                ("min_tokens", 17),  # past max_tokens (16 by default)
                ("structured", {}),  # none of the forms
                ("structured", {"regex": "a", "json_object": True}),  # two
                ("structured", {"json": "[1]"}),  # a schema is an object
                ("structured", {"json": "{oops"}),
                ("structured", {"regex": "a" * 4097}),
                ("structured", {"choice": ["c"] * 257}),
                ("structured", {"choice": [""]}),
                ("structured", {"structural_tag": "t"}),
            )
        ),
        (
            msgpack.packb(plain_task(params={"stop": ["x" * 65]})),
            ErrorCode.BAD_REQUEST,
            "stop",
            True,
        ),
        (
            msgpack.packb(plain_task(reply_to="tcp://127.0.0.1:5\n")),
            ErrorCode.BAD_REQUEST,
            "reply_to",
            False,
        ),
        (msgpack.packb(plain_task(t=3)), ErrorCode.BAD_REQUEST, "", True),
        (
            msgpack.packb(plain_task(producer_key="k" * 39)),
            ErrorCode.BAD_REQUEST,
            "producer_key",
            True,
        ),
        (
            msgpack.packb(plain_task(producer_key="k" * 41)),
            ErrorCode.BAD_REQUEST,
            "producer_key",
            True,
        ),
        (
            msgpack.packb(plain_task(producer_key="~" * 40)),
            ErrorCode.BAD_REQUEST,
            "producer_key",
            True,
        ),
        (
            msgpack.packb(plain_task(prompt="x" * LIMIT)),
            ErrorCode.BAD_REQUEST,
            "exceeds the limit",
            True,
        ),
    ],
)
def test_bad_frames_are_refused_with_code_and_reason(
    frame: bytes, code: ErrorCode, hint_part: str, answerable: bool
) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_task(frame, bytes_max=LIMIT)
    assert info.value.code == code
    assert hint_part in info.value.hint
    assert bool(info.value.reply_to) is answerable


def test_protocol_error_is_abstract() -> None:
    with pytest.raises(TypeError):
        ProtocolError("x")


def test_result_requires_error_exactly_when_not_ok() -> None:
    with pytest.raises(ValueError):
        Result(id="a", ok=False)
    with pytest.raises(ValueError):
        Result(id="a", ok=True, error=ErrorInfo(code="x", message="y"))


def test_reply_messages_round_trip() -> None:
    chunk = Chunk(id="a", seq=3, delta=" w", node="n")
    result = error_result("a", ErrorCode.OVERLOADED, "busy", retry_after_ms=5)
    assert decode_reply(encode(chunk)) == chunk
    assert decode_reply(encode(result)) == result
    with pytest.raises(RemoteProtocolError):
        decode_reply(b"\x93\x01\x02\x03")


ids = st.text(min_size=1, max_size=128)
params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 32768),
    temperature=st.floats(0, 10),
    top_p=st.floats(0.001, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 100_000)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop=st.lists(st.text(min_size=1, max_size=64), max_size=8),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.01, 10),
    min_p=st.floats(0, 1),
    min_tokens=st.integers(0, 1),
    structured=st.one_of(
        st.none(),
        st.builds(StructuredOutput, json=st.just('{"type": "object"}')),
        st.builds(StructuredOutput, json_object=st.just(True)),
        st.builds(StructuredOutput, regex=st.text(min_size=1, max_size=20)),
        st.builds(StructuredOutput, choice=st.lists(st.text(min_size=1, max_size=9), min_size=1)),
    ),
)
tasks = st.builds(
    Task,
    v=st.just(1),
    id=ids,
    key=st.text(max_size=256),
    prompt=st.text(max_size=2000),
    params=params,
    reply_to=st.sampled_from(["tcp://127.0.0.1:5000", "tcp://[::1]:1", "ipc:///tmp/x"]),
    timeout_ms=st.integers(1, 3_600_000),
    stream=st.booleans(),
)


@pytest.mark.parametrize("key", ["", "k" * 40, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"])
def test_an_empty_or_z85_producer_key_decodes(key: str) -> None:
    assert (
        decode_task(msgpack.packb(plain_task(producer_key=key)), bytes_max=LIMIT).producer_key
        == key
    )


def test_producer_keys_that_matched_are_remembered_boundedly_and_bad_ones_still_refused() -> None:
    from gossipd.core import messages

    def decode(key: str) -> str:
        return decode_task(
            msgpack.packb(plain_task(producer_key=key)), bytes_max=LIMIT
        ).producer_key

    messages._KEYS_MATCHED.clear()
    good = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    assert decode(good) == good and good in messages._KEYS_MATCHED
    assert decode(good) == good  # from the set this time
    for i in range(messages._KEYS_MATCHED_MAX + 5):  # distinct keys: the set is emptied, not grown
        decode(f"{i:040d}")
    assert 0 < len(messages._KEYS_MATCHED) <= messages._KEYS_MATCHED_MAX
    with pytest.raises(RemoteProtocolError, match="producer_key"):
        decode("~" * 40)
    assert "~" * 40 not in messages._KEYS_MATCHED


def test_a_cancel_producer_key_with_a_trailing_newline_is_refused() -> None:
    """The pattern ends with \\Z, not $ (which would let "KEY\\n" through)."""
    import msgspec

    key = "k" * 40
    assert msgspec.convert({"v": 1, "id": "a", "producer_key": key}, Cancel).producer_key == key
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"v": 1, "id": "a", "producer_key": key + "\n"}, Cancel)


@given(tasks)
def test_any_valid_task_round_trips(task: Task) -> None:
    assert decode_task(encode(task), bytes_max=1 << 20) == task


@given(st.binary(max_size=2048))
def test_any_bytes_decode_to_a_task_or_raise_remote_protocol_error(data: bytes) -> None:
    try:
        task = decode_task(data, bytes_max=1024)
    except RemoteProtocolError as exc:
        assert exc.code in {c.value for c in ErrorCode}
        return
    assert isinstance(task, Task)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=50)
    | st.binary(max_size=50),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


@given(
    st.dictionaries(st.sampled_from([*list(plain_task()), "params", "stream", "x"]), msgpack_values)
)
def test_any_map_of_wrong_types_decodes_or_is_refused(fields: dict[str, object]) -> None:
    frame = msgpack.packb({**plain_task(), **fields})
    try:
        task = decode_task(frame, bytes_max=1 << 16)
    except RemoteProtocolError as exc:
        assert exc.code in {ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_VERSION}
        assert exc.hint
        return
    # Whatever decoded is a fully valid task.
    assert isinstance(task.prompt, str) and endpoint_problem(task.reply_to) is None


def test_deeply_nested_garbage_is_refused_not_crashing() -> None:
    frame = b"\x91" * 100_000 + b"\x00"
    with pytest.raises(RemoteProtocolError):
        decode_task(frame, bytes_max=1 << 20)


@given(st.binary(max_size=2048))
def test_any_bytes_decode_to_a_peer_or_gossip_message_or_raise_remote_protocol_error(
    data: bytes,
) -> None:
    from gossipd.core.gossip_messages import decode_gossip
    from gossipd.core.peer_messages import decode_peer

    for decode in (decode_peer, decode_gossip):
        try:
            decode(data, bytes_max=1024)
        except RemoteProtocolError as exc:
            assert exc.code in {c.value for c in ErrorCode}


node_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=32)
peer_items = st.one_of(
    st.builds(
        Forward,
        req=st.integers(0, 2**63 - 1),
        src=node_ids,
        task=tasks,
        remaining_ms=st.integers(0, 3_600_000),
        attempt=st.integers(1, 1000),
    ),
    st.builds(
        ForwardReply,
        req=st.integers(0, 2**63 - 1),
        node=node_ids,
        accepted=st.booleans(),
        code=st.text(max_size=64),
        retry_after_ms=st.integers(0, 10**6),
    ),
    st.builds(TaskDone, id=ids, node=node_ids),
    st.builds(Cancel, v=st.just(PROTOCOL_VERSION), id=ids),
    st.builds(Withdraw, id=ids, node=node_ids),
    st.builds(ModelQuery, node=node_ids),
    st.builds(
        ModelCard, node=node_ids, model=st.text(max_size=128), max_model_len=st.integers(0, 2**31)
    ),
    st.builds(
        ReplayQuery,
        node=node_ids,
        tasks=st.lists(st.tuples(ids, st.sampled_from(["", "K" * 40])), max_size=5),
    ),
    st.builds(ReplayKnown, node=node_ids, known=st.lists(ids, max_size=5)),
)


@given(st.one_of(peer_items, st.builds(PeerBatch, items=st.lists(peer_items, max_size=8))))
def test_any_valid_peer_message_round_trips(message: object) -> None:
    assert decode_peer(encode_peer(message), bytes_max=1 << 22) == message  # type: ignore[arg-type]


def test_an_oversized_message_is_refused_with_the_oversized_reason() -> None:
    """Counted under its own label because the error says so, not because the ingress reads
    the hint's text."""
    import pytest

    from gossipd.core.codec import decode_intake
    from gossipd.errors import RemoteProtocolError

    with pytest.raises(RemoteProtocolError) as info:
        decode_intake(b"\x80" * 2000, bytes_max=1024)
    assert info.value.reason == "oversized" and info.value.code == "bad_request"
    with pytest.raises(RemoteProtocolError) as info:
        decode_intake(b"\xc1", bytes_max=1024)
    assert info.value.reason == info.value.code == "bad_request"


# --- Admin messages (docs/PROTOCOL.md, "Admin") ----------------------------------------------


def test_admin_requests_decode_on_the_ingress_and_answers_round_trip() -> None:
    from gossipd.core.admin_messages import (
        AdminReply,
        LoadReport,
        StatusReport,
        decode_admin_answer,
        encode_admin,
    )
    from gossipd.core.codec import decode_intake
    from gossipd.core.gossip_messages import MemberRecord
    from gossipd.core.messages import Drain, StatusQuery

    rt = "tcp://127.0.0.1:9999"
    query = StatusQuery(v=PROTOCOL_VERSION, id="q1", reply_to=rt)
    drain = Drain(v=PROTOCOL_VERSION, id="d1", reply_to=rt, node="gpu1", drain=False)
    assert decode_intake(encode_admin(query), bytes_max=LIMIT) == query
    assert decode_intake(encode_admin(drain), bytes_max=LIMIT) == drain
    # A third-party tool writes them with plain msgpack.
    plain = {"v": 1, "t": 32, "id": "d2", "reply_to": rt, "node": "gpu0"}
    got = decode_intake(msgpack.packb(plain), bytes_max=LIMIT)
    assert got == Drain(v=1, id="d2", reply_to=rt, node="gpu0", drain=True, relayed=False)
    report = StatusReport(
        id="q1",
        node="gpu0",
        status="draining",
        drained=True,
        load=LoadReport(pending=2, served=7),
        members=[MemberRecord(node="gpu1", addr="tcp://127.0.0.1:1", incarnation=3, state="alive")],
    )
    reply = AdminReply(id="d1", node="gpu1", ok=True, status="serving", message="serving again")
    assert decode_admin_answer(encode_admin(report)) == report
    assert decode_admin_answer(encode_admin(reply)) == reply
    assert report.leader is None and report.term is None  # no election yet
    refusal = error_result("d1", ErrorCode.BAD_REQUEST, "no")
    assert decode_admin_answer(encode(refusal)) == refusal
    with pytest.raises(RemoteProtocolError):
        decode_admin_answer(b"\xc1")


@pytest.mark.parametrize(
    ("fields", "reason", "words"),
    [
        ({"t": 99, "id": "x"}, "unknown_type", "unknown message type t=99"),
        ({"t": 31, "id": "x"}, "unknown_type", "30 (StatusQuery)"),  # an answer is not a request
        ({"t": 32, "id": "x"}, "bad_admin", "invalid Drain"),  # no node
        ({"t": 32, "id": "x", "node": ""}, "bad_admin", "name the member"),
        ({"t": 30, "id": "x", "reply_to": 5}, "bad_admin", "invalid StatusQuery"),
        ({"t": 30, "id": "x", "reply_to": "smtp://host"}, "bad_admin", "reply_to"),
        ({"t": 32, "id": "x", "node": "n", "reply_to": "smtp://host"}, "bad_admin", "reply_to"),
        ({"t": "30", "id": "x"}, "bad_request", "invalid message"),  # t is an int
        ({"id": "x"}, "bad_request", "invalid message"),
        ({"t": 6, "id": "x", "items": []}, "bad_request", "invalid Tasks: "),  # named by its t
        ({"t": 4}, "bad_request", "invalid Cancel: "),
        ({"t": 1, "id": "x", "v": "1"}, "bad_request", "invalid Task: "),  # not unsupported_version
        ({"t": 1, "id": "x", "v": None}, "bad_request", "invalid Task: "),
    ],
)
def test_unknown_and_malformed_admin_messages_are_refused_by_reason(
    fields: dict[str, object], reason: str, words: str
) -> None:
    from gossipd.core.codec import decode_intake

    message = {"v": 1, "reply_to": "tcp://127.0.0.1:9", "prompt": "p", **fields}
    with pytest.raises(RemoteProtocolError) as info:
        decode_intake(msgpack.packb(message), bytes_max=LIMIT)
    assert info.value.reason == reason and info.value.code == "bad_request"
    assert words in info.value.hint
    if "reply_to" not in fields:
        assert info.value.reply_to == "tcp://127.0.0.1:9"  # so it can be answered


reply_items = st.one_of(
    st.builds(Chunk, id=st.text(min_size=1, max_size=8), seq=st.integers(0, 99), delta=st.text()),
    st.builds(Result, id=st.text(max_size=8), ok=st.just(True), text=st.text(max_size=64)),
)


@given(st.lists(reply_items, min_size=1, max_size=40), st.integers(1, 2000))
def test_pack_replies_keeps_every_reply_in_order_within_the_frame_limit(
    items: list[Chunk | Result], bytes_max: int
) -> None:
    frames = [encode(item) for item in items]
    packed = pack_replies(frames, bytes_max)
    assert [r for frame in packed for r in decode_replies(frame)] == items
    for frame in packed:
        raw = msgpack.unpackb(frame)
        if raw["t"] == 5:  # a Replies frame: plain MessagePack, as PROTOCOL.md says
            assert raw["v"] == PROTOCOL_VERSION and len(raw["items"]) >= 2
            # Only the head (at most 18 bytes) over the limit on the replies.
            assert len(frame) <= bytes_max + 18
        else:  # a lone reply goes as itself
            assert frame in frames


@pytest.mark.parametrize("count", [15, 16, 65_535, 65_536])
def test_pack_replies_writes_each_msgpack_array_size(count: int) -> None:
    frame = encode(Result(id="x", ok=True))
    (packed,) = pack_replies([frame] * count, bytes_max=len(frame) * count)
    assert len(msgpack.unpackb(packed)["items"]) == count


def test_decode_replies_refuses_what_is_not_replies() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_replies(msgpack.packb({"v": 1, "t": 5, "items": [{"t": 1}]}))
    with pytest.raises(RemoteProtocolError):
        decode_replies(b"\xc1")


@given(st.lists(tasks, min_size=1, max_size=20))
def test_pack_tasks_is_a_Tasks_frame_whose_items_decode_as_sent(items: list[Task]) -> None:
    from gossipd.core.codec import decode_intake

    frames = [encode(task) for task in items]
    batch = decode_intake(pack_tasks(frames), bytes_max=LIMIT * 64)
    assert type(batch) is Tasks and [bytes(raw) for raw in batch.items] == frames
    assert [decode_intake(raw, bytes_max=LIMIT) for raw in batch.items] == items
    raw = msgpack.unpackb(pack_tasks(frames))  # plain MessagePack, as PROTOCOL.md says
    assert raw["t"] == 6 and raw["v"] == PROTOCOL_VERSION and len(raw["items"]) == len(items)


@given(
    st.lists(tasks, min_size=1, max_size=5),
    st.text(min_size=1, max_size=128),
    st.sampled_from(["tcp://127.0.0.1:5558", "ipc:///tmp/producer"]),
)
def test_a_Tasks_frame_with_a_pack_id_decodes_and_an_older_decoder_reads_its_id(
    items: list[Task], pack_id: str, reply_to: str
) -> None:
    """Its id and reply_to are ignored by a daemon that takes Tasks frames; one that knows
    only Task reads them for its bad_request answer (docs/PROTOCOL.md, "Tasks")."""
    from gossipd.core.codec import decode_intake, decode_task

    frames = [encode(task) for task in items]
    packed = pack_tasks(frames, pack_id=pack_id, reply_to=reply_to)
    batch = decode_intake(packed, bytes_max=LIMIT * 64)
    assert type(batch) is Tasks and [bytes(raw) for raw in batch.items] == frames
    raw = msgpack.unpackb(packed)
    assert (raw["v"], raw["t"], raw["id"], raw["reply_to"]) == (1, 6, pack_id, reply_to)
    with pytest.raises(RemoteProtocolError) as refused:
        decode_task(packed, bytes_max=LIMIT * 64)
    assert (refused.value.task_id, refused.value.reply_to) == (pack_id, reply_to)


def test_an_empty_Tasks_frame_is_refused() -> None:
    from gossipd.core.codec import decode_intake

    with pytest.raises(RemoteProtocolError):
        decode_intake(msgpack.packb({"v": 1, "t": 6, "items": []}), bytes_max=LIMIT)


def test_a_Tasks_frame_of_more_than_TASKS_ITEMS_MAX_items_is_refused_whole_at_its_id() -> None:
    """Each item is decoded and answered on its own: a frame of a million 1-byte items held
    the loop for 3.6 s (a review's reproduction).  Past the bound the frame is refused
    whole, at its pack id, and none of its items is read."""
    from gossipd.core.codec import decode_intake
    from gossipd.core.messages import TASKS_ITEMS_MAX

    item = msgpack.packb(plain_task())
    at_most = {"v": 1, "t": 6, "id": "pack-1", "reply_to": "tcp://h:1",
               "items": [item] * TASKS_ITEMS_MAX}  # fmt: skip
    assert len(decode_intake(msgpack.packb(at_most), bytes_max=1 << 24).items) == TASKS_ITEMS_MAX
    over = {**at_most, "items": [b"\xc0"] * (TASKS_ITEMS_MAX + 1)}
    with pytest.raises(RemoteProtocolError) as refused:
        decode_intake(msgpack.packb(over), bytes_max=1 << 24)
    assert refused.value.code == "bad_request"
    assert (refused.value.task_id, refused.value.reply_to) == ("pack-1", "tcp://h:1")


def test_a_refusal_echoes_a_long_invalid_id_cut_to_ECHOED_ID_CHARS_MAX() -> None:
    """An invalid id is echoed so that the producer can tell which message was refused, but
    not whole: a 900 KB id made each refusal a 900 KB reply (a review's run)."""
    from gossipd.core.messages import ECHOED_ID_CHARS_MAX

    for sent, echoed in (("i" * 129, "i" * 129), ("\N{SNOWMAN}" * 5000, "\N{SNOWMAN}" * 1024)):
        frame = msgpack.packb({"v": 1, "t": 1, "id": sent, "prompt": "p", "reply_to": "tcp://h:1"})
        with pytest.raises(RemoteProtocolError) as refused:
            decode_task(frame, bytes_max=1 << 20)
        assert refused.value.task_id == echoed and len(echoed) <= ECHOED_ID_CHARS_MAX


def test_a_refused_frames_answer_reads_its_id_without_building_the_rest() -> None:
    """A refused frame's id and reply_to were read by decoding all of it: a 1 MiB frame of
    empty maps beside them became a million dicts (a 4 MiB one: 300 MB and 1.2 s, a
    review's reproduction).  Now nothing but those keys (and v, t) is decoded."""
    import tracemalloc

    frame = msgpack.packb(
        {"v": 1, "t": 1, "id": "junk-1", "reply_to": "tcp://h:1", "junk": [{}] * 1_000_000}
    )
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError) as refused:  # (no prompt: invalid)
            decode_task(frame, bytes_max=1 << 22)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (refused.value.task_id, refused.value.reply_to) == ("junk-1", "tcp://h:1")
    assert peak < len(frame) // 4, peak  # (decoded whole: about 60 times the frame)


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
_HEAD_VALUES = _ANY | st.sampled_from([1, 2, 6, "x", "tcp://127.0.0.1:5", "tcp://h:1\n", "é" * 50])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "t", "id", "reply_to", "prompt", "x"]), _HEAD_VALUES, max_size=6
    )
    | _ANY,
    st.integers(8, 4096),
)
def test_a_refusals_id_and_reply_to_are_those_a_whole_decode_reads(obj: object, limit: int) -> None:
    """The refusal's reading of a message (codec._peek, which decodes only v, t, id and
    reply_to) against the whole decode it replaces, as a model: the same id, reply_to, and
    the same v and t where they are ints."""
    from gossipd.core.codec import _over, _peek
    from gossipd.core.messages import endpoint_problem

    data = msgpack.packb(obj, use_bin_type=True)
    head, task_id, reply_to = _peek(data, limit)
    whole = msgspec.msgpack.decode(data)
    if not isinstance(whole, dict):
        assert (task_id, reply_to) == ("", "") and head is not None
        return
    want_id = whole.get("id")
    if not isinstance(want_id, str) or _over(want_id, limit):
        want_id = ""
    want_to = whole.get("reply_to")
    if not (isinstance(want_to, str) and len(want_to) <= 256 and endpoint_problem(want_to) is None):
        want_to = ""
    assert (task_id, reply_to) == (want_id, want_to)
    assert head is not None
    for key in ("v", "t"):
        if type(whole.get(key)) is int:
            assert head[key] == whole[key]


def test_a_replay_query_of_more_than_a_thousand_tasks_or_with_a_bad_key_is_refused() -> None:
    from gossipd.core.peer_messages import CONFIRM_IDS_MAX

    at_most = ReplayQuery(node="a", tasks=[(f"t{i}", "") for i in range(CONFIRM_IDS_MAX)])
    assert decode_peer(encode_peer(at_most), bytes_max=1 << 22) == at_most
    too_many = msgpack.packb(
        {"t": 34, "v": 1, "node": "a", "tasks": [[f"t{i}", ""] for i in range(1001)]}
    )
    long_key = msgpack.packb({"t": 34, "v": 1, "node": "a", "tasks": [["t", "K" * 41]]})
    for frame in (too_many, long_key):
        with pytest.raises(RemoteProtocolError) as refused:
            decode_peer(frame, bytes_max=1 << 22)
        assert refused.value.code == "bad_request"


def test_a_tasks_frame_of_another_version_is_answered_at_its_reply_to() -> None:
    """PROTOCOL.md "Bad input": a refusal goes to the reply_to it can read; a Tasks frame's
    own id and reply_to are there for that (the version check came after the decode, which
    had no such fields to give)."""
    from gossipd.core.codec import decode_intake
    from gossipd.core.messages import MsgType

    frame = {"t": int(MsgType.TASKS), "v": 2, "id": "batch-1", "reply_to": "tcp://h:1",
             "items": [msgpack.packb(plain_task())]}  # fmt: skip
    with pytest.raises(RemoteProtocolError) as info:
        decode_intake(msgpack.packb(frame), bytes_max=LIMIT)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    assert info.value.task_id == "batch-1" and info.value.reply_to == "tcp://h:1"


# -- addresses in gossip: what a member learns it may connect to ----------------------------

_GOOD_ADDR = "tcp://10.0.0.1:7946"
_BAD_ADDRS = ["tcp://127.0.0.1:5\n", "garbage-addr", "tcp://127.0.0.1:99999", "ipc:///tmp/a b"]


def _gossip_with(where: str, addr: str) -> object:
    from gossipd.core.gossip_messages import (
        Alive,
        GossipOnly,
        GpuState,
        MemberRecord,
        Meta,
        PingReq,
        PushPull,
    )

    header = {"cluster": "c", "src": "a", "src_addr": addr if where == "src_addr" else _GOOD_ADDR}
    if where == "target_addr":
        return PingReq(**header, seq=1, target="b", target_addr=addr)
    if where == "alive":
        return GossipOnly(**header, updates=[Alive(node="b", incarnation=1, addr=addr)])
    if where in ("meta.rpc", "meta.ingress"):
        gpu = GpuState(**{where.partition(".")[2]: addr})
        return GossipOnly(**header, updates=[Meta(node="b", version=1, gpu=gpu)])
    record = {"node": "b", "addr": _GOOD_ADDR, "incarnation": 1, "state": "alive"}
    if where == "record.addr":
        record["addr"] = addr
    elif where == "record.rpc":
        record["gpu"] = GpuState(rpc=addr)
    if where.startswith("record."):
        return PushPull(**header, reply=False, members=[MemberRecord(**record)])  # type: ignore[arg-type]
    return GossipOnly(**header)


_WHERE = ["src_addr", "target_addr", "alive", "meta.rpc", "meta.ingress", "record.addr",
          "record.rpc"]  # fmt: skip


@pytest.mark.parametrize("where", _WHERE)
@pytest.mark.parametrize("addr", _BAD_ADDRS)
def test_gossip_naming_an_address_no_socket_connects_to_is_refused(where: str, addr: str) -> None:
    """One such frame (no key needed without CURVE; any member's under it) left a daemon
    up and serving nothing: the ack or probe's connect raised inside its task group."""
    from gossipd.core.gossip_messages import decode_gossip, encode_gossip

    with pytest.raises(RemoteProtocolError, match="invalid gossip message") as refused:
        decode_gossip(encode_gossip(_gossip_with(where, addr)), bytes_max=1 << 16)  # type: ignore[arg-type]
    assert refused.value.code == ErrorCode.BAD_REQUEST.value


@pytest.mark.parametrize("where", _WHERE)
def test_gossip_naming_connectable_addresses_decodes(where: str) -> None:
    from gossipd.core.gossip_messages import decode_gossip, encode_gossip

    message = _gossip_with(where, "ipc:///run/gossipd/peer.sock")
    assert decode_gossip(encode_gossip(message), bytes_max=1 << 16) == message  # type: ignore[arg-type]


def test_a_structured_outputs_schema_or_grammar_is_bounded_in_code_points() -> None:
    # (Past the test decoder's frame limit, so checked on the struct itself.)
    for key in ("grammar", "json"):
        text = "é" * 65536 if key == "grammar" else '{"a": "' + "é" * 65527 + '"}'
        assert len(text) == 65536
        assert msgspec.convert({key: text}, StructuredOutput)
        with pytest.raises(msgspec.ValidationError, match=key):
            msgspec.convert({key: text + " "}, StructuredOutput)


def test_params_that_ask_nothing_are_written_as_nothing_whatever_their_spelling() -> None:
    """A member from before the penalties, min_p, min_tokens and structured refuses those keys:
    the neutral values clients send (LangChain's 0s, `vllm bench serve`'s repetition_penalty
    1.0 and min_p 0.0, -0.0) must not be written on, here or when a task is forwarded."""
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1,
               "min_p": -0.0, "min_tokens": 0, "structured": None}  # fmt: skip
    task = decode_task(msgpack.packb(plain_task(params=neutral)), bytes_max=LIMIT)
    assert msgspec.msgpack.encode(task.params) == msgspec.msgpack.encode(SamplingParams())
    assert b"penalty" not in msgspec.msgpack.encode(task)
    asked = SamplingParams(presence_penalty=0.5, repetition_penalty=1.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(asked)) == {
        "presence_penalty": 0.5,
        "repetition_penalty": 1.5,
    }


def test_a_json_schema_nests_at_most_64_deep_and_deeper_is_refused_not_raised() -> None:
    def nested(depth: int) -> str:
        return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)

    assert msgspec.convert({"json": nested(64)}, StructuredOutput)
    for depth in (65, 3000):  # (3000: past what the decoder itself may recurse into)
        with pytest.raises(msgspec.ValidationError, match=r"nests deeper|JSON Schema"):
            msgspec.convert({"json": nested(depth)}, StructuredOutput)


def test_a_forwarded_task_with_a_large_structured_form_is_measured_not_assumed_small() -> None:
    from gossipd.core.codec import check_forwarded_task

    form = StructuredOutput(json='{"d": "' + "é" * 65000 + '"}')  # ~130 KB in UTF-8
    task = decode_task(msgpack.packb(plain_task()), bytes_max=LIMIT)
    big = msgspec.structs.replace(
        task, params=SamplingParams(structured=form), prompt="p" * 100_000
    )
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        check_forwarded_task(big, bytes_max=200_000)
    check_forwarded_task(msgspec.structs.replace(big, prompt="p"), bytes_max=200_000)


def test_a_task_the_ingress_takes_at_its_limit_an_owner_takes_when_forwarded() -> None:
    """The forwarder re-encodes a task with every field written out: its defaults, and its
    floats (and logit_bias's biases) as float64, 9 bytes where a producer may send an int of
    1.  A frame at the ingress's limit that grows most must still pass the owner's check
    (FORWARD_REENCODE_SLACK_BYTES): it was refused with 300 biases (about 2.5 KB more)."""
    from gossipd.core.codec import FORWARD_REENCODE_SLACK_BYTES, check_forwarded_task
    from gossipd.core.sampling import LOGIT_BIAS_MAX

    limit = 1 << 20
    params = {name: 1 for name in ("top_p", "presence_penalty", "frequency_penalty", "min_p")}
    params |= {"temperature": 2, "repetition_penalty": 2, "max_tokens": 1}
    params["logit_bias"] = {i: 1 for i in range(LOGIT_BIAS_MAX)}
    frame = msgpack.packb(plain_task(prompt="", params=params))
    frame = msgpack.packb(plain_task(prompt="p" * (limit - len(frame) - 4), params=params))
    assert limit - 8 <= len(frame) <= limit
    task = decode_task(frame, bytes_max=limit)
    grown = len(msgspec.msgpack.encode(task)) - len(frame)
    assert 2048 < grown <= FORWARD_REENCODE_SLACK_BYTES
    check_forwarded_task(task, bytes_max=limit)


def test_release_asked_names_each_field_and_the_release_that_reads_it() -> None:
    from gossipd.core.sampling import release_asked

    assert release_asked(SamplingParams()) is None
    assert release_asked(SamplingParams(presence_penalty=0, repetition_penalty=1)) is None
    for asked in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"min_p": 0.1},
        {"min_tokens": 1},
        {"structured": StructuredOutput(json_object=True)},
    ):
        assert release_asked(SamplingParams(**asked)) == (0, 3, 2), asked
    for asked in ({"logprobs": 0}, {"logprobs": 5, "min_p": 0.1}):
        assert release_asked(SamplingParams(**asked)) == (0, 3, 3), asked
    # A chat's: tokenized without special tokens (the default, true, is not written).
    for asked in ({"add_special_tokens": False}, {"add_special_tokens": False, "logprobs": 1}):
        assert release_asked(SamplingParams(**asked)) == (0, 3, 6), asked
    assert release_asked(SamplingParams(add_special_tokens=True)) is None
    assert b"add_special_tokens" not in msgspec.msgpack.encode(SamplingParams())
    chat = SamplingParams(add_special_tokens=False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(chat), type=SamplingParams) == chat


def test_logprobs_are_bounded_by_what_a_result_may_carry() -> None:
    assert SamplingParams(max_tokens=32768, logprobs=0).logprobs == 0
    assert SamplingParams(max_tokens=1560, logprobs=20).logprobs == 20
    with pytest.raises(ValueError, match=r"max_tokens x \(logprobs \+ 1\) must be at most 32768"):
        SamplingParams(max_tokens=1561, logprobs=20)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"logprobs": 21}, SamplingParams)
    # A task without logprobs writes no key for them: members before 0.3.3 read it.
    assert b"logprobs" not in msgspec.msgpack.encode(SamplingParams(max_tokens=3))
    # Nor does a Chunk or Result of a task that asked none; one that did carries them,
    # bounded: entries (the top ones counted) at most LOGPROB_ENTRIES_MAX.
    from gossipd.core.messages import logprobs_of
    from gossipd.core.sampling import TokenLogprob

    plain = Chunk(id="t", seq=0, delta="x")
    assert b"logprobs" not in encode(plain) and logprobs_of(decode_reply(encode(plain))) is None
    entries = [TokenLogprob("x", -1.0, (("x", -1.0),))] * 16384
    full = Result(id="t", ok=True, text="x", logprobs=entries)
    assert logprobs_of(decode_reply(encode(full))) == entries
    entry = ["x", -1.0, [["x", -1.0]]]
    over = msgpack.packb({"v": 1, "t": 3, "id": "t", "ok": True, "logprobs": [entry] * 16385})
    with pytest.raises(RemoteProtocolError, match="logprobs"):
        decode_reply(over)
    # The prompt's (an echo's, release 0.3.4): the same bound, apart; absent unless asked.
    assert b"prompt_logprobs" not in encode(full)
    echoed = Result(id="t", ok=True, text="x", logprobs=entries, prompt_logprobs=entries)
    assert decode_reply(encode(echoed)) == echoed
    over_prompt = msgpack.packb({"v": 1, "t": 2, "id": "t", "seq": 0, "delta": "x",
                                 "prompt_logprobs": [entry] * 16385})  # fmt: skip
    with pytest.raises(RemoteProtocolError, match="logprobs"):
        decode_reply(over_prompt)
