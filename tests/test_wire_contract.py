"""docs/PROTOCOL.md's types, units and limits, held to the letter at the decoder (issue 27):
string limits count code points, float fields take MessagePack integers, 64-bit integers
round-trip, and a refusal names the message by its id as given."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.codec import decode_intake, decode_reply, decode_task
from gossipd.core.messages import ErrorCode, encode, error_result
from gossipd.errors import RemoteProtocolError

LIMIT = 64 * 1024
EMOJI = "\U0001f600"  # 1 code point, 4 UTF-8 bytes, 2 UTF-16 units (JavaScript .length 2)


def task(**fields: object) -> bytes:
    base: dict[str, object] = {
        "v": 1,
        "t": 1,
        "id": "t-1",
        "prompt": "hi",
        "reply_to": "tcp://127.0.0.1:9",
    }
    base.update(fields)
    return msgpack.packb(base)


def refusal(frame: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode_intake(frame, bytes_max=LIMIT)
    return info.value


@pytest.mark.parametrize(
    ("field", "limit", "extra"),
    [("id", 128, {}), ("key", 256, {}), ("model", 256, {}), ("traceparent", 128, {})],
)
def test_string_limits_count_code_points_not_bytes(
    field: str, limit: int, extra: dict[str, object]
) -> None:
    at_limit = decode_task(task(**{field: EMOJI * limit}, **extra), bytes_max=LIMIT)
    assert getattr(at_limit, field) == EMOJI * limit  # 4 x limit bytes: still valid
    error = refusal(task(**{field: EMOJI * (limit + 1)}))
    assert error.code == ErrorCode.BAD_REQUEST and f"$.{field}" in error.hint


def test_stop_strings_count_code_points() -> None:
    ok = decode_task(task(params={"stop": [EMOJI * 64] * 8}), bytes_max=LIMIT)
    assert ok.params.stop == [EMOJI * 64] * 8
    assert "stop" in refusal(task(params={"stop": [EMOJI * 65]})).hint


@pytest.mark.parametrize("bad_id", ["", "x" * 129, EMOJI * 129, "é" * 500])
def test_a_refused_invalid_id_is_echoed_as_given(bad_id: str) -> None:
    error = refusal(task(id=bad_id))
    assert error.code == ErrorCode.BAD_REQUEST and "$.id" in error.hint
    assert error.task_id == bad_id and error.reply_to == "tcp://127.0.0.1:9"
    # ... and a Result carrying it decodes at the producer.
    result = decode_reply(encode(error_result(error.task_id, ErrorCode.BAD_REQUEST, error.hint)))
    assert result.id == bad_id


@pytest.mark.parametrize("unreadable", [None, 5, b"bytes", ["x"], {"a": 1}])
def test_an_id_that_is_not_a_string_is_answered_as_the_empty_id(unreadable: object) -> None:
    error = refusal(task(id=unreadable))
    assert error.task_id == "" and error.reply_to


def test_an_oversized_frame_echoes_its_id_only_when_it_fits_the_frame_limit() -> None:
    small = refusal(task(id="big-1", prompt="x" * LIMIT))
    assert "exceeds the limit" in small.hint and small.task_id == "big-1"
    huge = refusal(task(id="y" * (LIMIT + 1)))
    assert "exceeds the limit" in huge.hint and huge.task_id == ""


@given(st.text(max_size=300))
def test_any_string_id_of_a_refused_task_comes_back_as_given(task_id: str) -> None:
    error = refusal(task(id=task_id, timeout_ms=0))  # refused whatever the id
    assert error.task_id == task_id


def test_float_fields_accept_msgpack_integers() -> None:
    # JavaScript encoders write 1.0 as the integer 1.
    got = decode_task(task(params={"temperature": 1, "top_p": 1}), bytes_max=LIMIT)
    assert got.params.temperature == 1.0 and type(got.params.temperature) is float
    assert got.params.top_p == 1.0 and type(got.params.top_p) is float
    assert "temperature" in refusal(task(params={"temperature": 11})).hint
    assert "temperature" in refusal(task(params={"temperature": "1"})).hint


def test_integer_fields_refuse_floats() -> None:
    assert "max_tokens" in refusal(task(params={"max_tokens": 3.0})).hint
    assert "timeout_ms" in refusal(task(timeout_ms=1000.0)).hint


def test_seed_takes_64_bit_integers_up_to_2_63_minus_1() -> None:
    top = decode_task(task(params={"seed": 2**63 - 1}), bytes_max=LIMIT)
    assert top.params.seed == 2**63 - 1
    assert decode_task(encode(top), bytes_max=LIMIT).params.seed == 2**63 - 1
    assert "seed" in refusal(task(params={"seed": 2**63})).hint
    assert "seed" in refusal(task(params={"seed": -1})).hint


def test_strings_refuse_bin_and_bools_refuse_integers() -> None:
    assert "$.prompt" in refusal(task(prompt=b"bytes")).hint
    assert "$.stream" in refusal(task(stream=1)).hint
    assert decode_task(task(stream=True), bytes_max=LIMIT).stream is True


def test_echo_output_is_exactly_max_tokens_words_cycled_as_documented() -> None:
    from gossipd.engines.echo import echo_tokens

    assert echo_tokens("red green", 3) == ["red", " green", " red"]
    assert echo_tokens("  a\t\x1cb\n", 4) == ["a", " b", " a", " b"]  # str.split() whitespace
    assert echo_tokens(" \t", 2) == ["<empty>", " <empty>"]
    assert echo_tokens("a\ufeffb", 1) == ["a\ufeffb"]  # U+FEFF is no space here
