"""gossipd/zmtp.py, sans I/O: two ZmtpConnections wired back to back (no sockets), the
decoder under arbitrary splits and arbitrary bytes, and CurveZMQ's refusals: a wrong server
key, an unauthorised client, a replayed or tampered MESSAGE, an oversized frame.
Interoperation with libzmq itself is in test_zmtp_interop.py."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.bindings import crypto_box_afternm, crypto_box_keypair

from gossipd.zmtp import (
    CURVE_OVERHEAD,
    MORE,
    CurveKeys,
    ZmtpConnection,
    ZmtpError,
    decode_metadata,
    encode_metadata,
    frame_header,
    greeting,
)

LIMIT = 1 << 16
SERVER = crypto_box_keypair()
CLIENT = crypto_box_keypair()


def pair(
    curve: bool, *, server_key: bytes = SERVER[0], allowed: bytes = CLIENT[0]
) -> tuple[ZmtpConnection, ZmtpConnection]:
    client = ZmtpConnection(
        as_server=False,
        socket_type=b"DEALER",
        peer_types=(b"ROUTER",),
        frame_bytes_max=LIMIT,
        curve=CurveKeys(CLIENT[0], CLIENT[1], server_key) if curve else None,
    )
    server = ZmtpConnection(
        as_server=True,
        socket_type=b"ROUTER",
        peer_types=(b"DEALER",),
        frame_bytes_max=LIMIT,
        curve=CurveKeys(SERVER[0], SERVER[1]) if curve else None,
        authorize=lambda key: "client-node" if key == allowed else None,
    )
    return client, server


def shake(client: ZmtpConnection, server: ZmtpConnection) -> None:
    """Move bytes both ways until neither has any to send."""
    for _ in range(10):
        to_server, to_client = client.data_to_send(), server.data_to_send()
        if not to_server and not to_client:
            return
        assert server.receive(to_server) == [] or not to_server
        assert client.receive(to_client) == [] or not to_client


@pytest.mark.parametrize("curve", [False, True])
def test_a_handshake_between_the_two_sides_makes_both_ready_and_names_the_client(
    curve: bool,
) -> None:
    client, server = pair(curve)
    shake(client, server)
    assert client.ready and server.ready
    assert server.peer_user == ("client-node" if curve else "")
    assert server.peer_metadata[b"socket-type"] == b"DEALER"
    assert client.peer_metadata[b"socket-type"] == b"ROUTER"
    assert server.receive(client.encode(b"forward")) == [[b"forward"]]
    assert client.receive(server.encode(b"reply")) == [[b"reply"]]


def test_a_server_without_the_key_the_client_was_given_gets_no_connection() -> None:
    client, server = pair(True, server_key=crypto_box_keypair()[0])
    server.receive(client.data_to_send())  # the greeting
    client.receive(server.data_to_send())
    with pytest.raises(ZmtpError) as refused:
        server.receive(client.data_to_send())  # HELLO, boxed for another key
    assert refused.value.reason == "crypto" and not server.ready


def test_an_unauthorised_client_gets_ERROR_400_and_no_connection() -> None:
    client, server = pair(True, allowed=crypto_box_keypair()[0])
    with pytest.raises(ZmtpError) as refused:
        shake(client, server)
    assert refused.value.reason == "refused" and not server.ready
    with pytest.raises(ZmtpError) as told:
        client.receive(server.data_to_send())  # the ERROR the server left to send
    assert told.value.reason == "refused" and "400" in str(told.value)
    assert not client.ready


def test_a_replayed_MESSAGE_ends_the_connection() -> None:
    client, server = pair(True)
    shake(client, server)
    message = client.encode(b"pay once")
    assert server.receive(message) == [[b"pay once"]]
    with pytest.raises(ZmtpError) as replayed:
        server.receive(message)
    assert replayed.value.reason == "nonce"


def test_a_tampered_MESSAGE_ends_the_connection() -> None:
    client, server = pair(True)
    shake(client, server)
    message = bytearray(client.encode(b"forward"))
    message[-1] ^= 1
    with pytest.raises(ZmtpError) as tampered:
        server.receive(bytes(message))
    assert tampered.value.reason == "crypto"


@pytest.mark.parametrize("curve", [False, True])
def test_a_frame_over_the_limit_on_the_wire_ends_the_connection(curve: bool) -> None:
    """As libzmq's MAXMSGSIZE: the frame as sent, a CURVE MESSAGE's 33 bytes included."""
    client, server = pair(curve)
    shake(client, server)
    largest = LIMIT - (CURVE_OVERHEAD if curve else 0)
    assert server.receive(client.encode(b"x" * largest)) == [[b"x" * largest]]
    with pytest.raises(ZmtpError) as large:
        server.receive(client.encode(b"x" * (largest + 1)))
    assert large.value.reason == "too_large"


@pytest.mark.parametrize("curve", [False, True])
def test_a_message_of_several_frames_comes_out_empty_and_its_parts_are_not_kept(
    curve: bool,
) -> None:
    client, server = pair(curve)
    shake(client, server)
    more = b"".join(_with_more(client, curve, b"y" * 1000) for _ in range(100))
    assert server.receive(more) == []
    assert server._in == []  # 100 parts read, none held
    assert server.receive(client.encode(b"last part")) == [[]]
    assert server.receive(client.encode(b"whole")) == [[b"whole"]]


def _with_more(client: ZmtpConnection, curve: bool, part: bytes) -> bytes:
    """``part`` as a frame with MORE set (NULL: the frame's flags; CURVE: the box's)."""
    if not curve:
        return frame_header(MORE, len(part)) + part
    short = client._next_nonce()
    nonce8 = short.to_bytes(8, "big")
    box = crypto_box_afternm(bytes((MORE,)) + part, b"CurveZMQMESSAGEC" + nonce8, client._precom)
    body = b"\x07MESSAGE" + nonce8 + box
    return frame_header(0, len(body)) + body


def test_one_PONG_waits_at_most_whatever_the_PINGs() -> None:
    client, server = pair(False)
    shake(client, server)
    ping = b"\x04PING" + b"\x00\x10" + b"ctx"
    server.receive((bytes((0x04, len(ping))) + ping) * 1000)
    assert server.data_to_send() == bytes((0x04, 8)) + b"\x04PONGctx"


def test_another_mechanism_or_no_ZMTP_greeting_is_refused() -> None:
    null_client, _ = pair(False)
    _, curve_server = pair(True)
    with pytest.raises(ZmtpError) as mechanism:
        curve_server.receive(null_client.data_to_send())
    assert mechanism.value.reason == "mechanism"
    _, server = pair(False)
    with pytest.raises(ZmtpError) as http:
        server.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
    assert http.value.reason == "greeting"


def test_PING_is_answered_with_PONG_and_its_context() -> None:
    client, server = pair(False)
    shake(client, server)
    ping = b"\x04PING" + b"\x00\x10" + b"ctx"
    assert server.receive(bytes((0x04, len(ping))) + ping) == []
    assert server.data_to_send() == bytes((0x04, 8)) + b"\x04PONGctx"


@settings(max_examples=60, deadline=None)
@given(
    curve=st.booleans(),
    frames=st.lists(st.binary(max_size=600), min_size=1, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=8),
)
def test_messages_come_out_whole_and_in_order_however_the_stream_is_cut(
    curve: bool, frames: list[bytes], cuts: list[int]
) -> None:
    client, server = pair(curve)
    stream = client.data_to_send()
    server.receive(stream)
    client.receive(server.data_to_send())
    # From here on (the rest of the handshake, then the messages) in arbitrary pieces.
    wire = client.data_to_send()
    handshake_done = False
    while not handshake_done:
        server.receive(wire)
        client.receive(server.data_to_send())
        wire = client.data_to_send()
        handshake_done = server.ready and client.ready and not wire
    wire = b"".join(client.encode(f) for f in frames)
    got: list[list[bytes]] = []
    last = 0
    for cut in [*sorted({c % (len(wire) + 1) for c in cuts}), len(wire)]:
        got += server.receive(wire[last:cut])
        last = cut
    assert got == [[f] for f in frames]


@settings(max_examples=200, deadline=None)
@given(
    curve=st.booleans(),
    data=st.binary(max_size=400),
    as_server=st.booleans(),
    greeted=st.booleans(),
)
def test_arbitrary_bytes_raise_ZmtpError_or_wait_for_more_never_anything_else(
    curve: bool, data: bytes, as_server: bool, greeted: bool
) -> None:
    client, server = pair(curve)
    side = server if as_server else client
    if greeted:  # past a valid greeting: the frame decoder and the handshake see the rest
        data = greeting(b"CURVE" if curve else b"NULL", not as_server) + data
    with contextlib.suppress(ZmtpError):
        assert side.receive(data) == []  # nothing from a peer that never shook hands
    assert not side.ready


@given(st.dictionaries(st.binary(min_size=1, max_size=255), st.binary(max_size=255), max_size=6))
def test_metadata_decodes_to_what_was_encoded(props: dict[bytes, bytes]) -> None:
    lowered = {k.lower(): v for k, v in props.items()}
    if len(lowered) == len(props):
        assert decode_metadata(encode_metadata(props)) == lowered


@given(st.binary(max_size=300))
def test_metadata_decoder_raises_ZmtpError_or_decodes(data: bytes) -> None:
    with contextlib.suppress(ZmtpError):
        decode_metadata(data)


@pytest.mark.parametrize("curve", [False, True])
def test_before_the_handshake_ends_a_frame_over_4_KiB_ends_the_connection(curve: bool) -> None:
    """An unauthenticated peer cannot make the server hold a message's worth of bytes."""
    client, server = pair(curve)
    server.receive(client.data_to_send())  # the greeting
    with pytest.raises(ZmtpError) as large:
        server.receive(bytes((0x06,)) + (5000).to_bytes(8, "big") + b"\x05HELLO")
    assert large.value.reason == "too_large" and not server.ready


def test_a_curve_client_of_the_wrong_socket_type_gets_no_READY() -> None:
    """The server sent its READY before it read the client's Socket-Type in INITIATE, and
    then closed: the client had a READY and took itself for connected (libzmq checks the
    metadata first, and sends no READY to a socket type it refuses)."""
    client = ZmtpConnection(
        as_server=False,
        socket_type=b"PUB",
        peer_types=(b"ROUTER",),
        frame_bytes_max=LIMIT,
        curve=CurveKeys(CLIENT[0], CLIENT[1], SERVER[0]),
    )
    _, server = pair(True)
    with pytest.raises(ZmtpError) as refused:
        shake(client, server)
    assert refused.value.reason == "socket_type" and not server.ready
    left = server.data_to_send()
    assert b"READY" not in left
    client.receive(left)
    assert not client.ready
