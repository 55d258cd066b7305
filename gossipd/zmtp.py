"""ZMTP 3.0 with the NULL and CURVE mechanisms, sans I/O: one connection's greeting,
handshake and frames, for the peer channel that runs on the event loop (looppeer.py).

Why our own: libzmq moves every message through its I/O thread, two more thread wake-ups
a hop on each side.  A request/reply between two processes: p50 113 -> 85 us and CPU 111 ->
74 us a round trip (16 at a time: 23 -> 11 us); the HTTP door with half its requests
forwarded passes 1.22x the requests at 16 connections (bench/README, "The peer channel on
the loop").  The wire stays ZeroMQ's: a libzmq DEALER or ROUTER with the same keys talks to this
one (tests/test_zmtp_interop.py), so CurveZMQ still guards every socket and a daemon of an
older release still reaches a newer one.

What is implemented (RFC 23/ZMTP 3.0, 25/ZMTP-CURVE, 26/CurveZMQ, checked against libzmq
4.3's curve_client_tools.hpp, curve_server.cpp and curve_mechanism_base.cpp):

- the 64-byte greeting, version 3.0, mechanism NULL or CURVE;
- frames: short and long, MORE, COMMAND; a frame larger than ``frame_bytes_max`` as it is
  on the wire (a CURVE MESSAGE's overhead included) ends the connection, as MAXMSGSIZE
  does, and one larger than 4 KiB before the handshake ends;
- NULL: READY both ways, with Socket-Type and Identity metadata;
- CURVE: HELLO, WELCOME (with a cookie), INITIATE (with the vouch), READY; MESSAGE boxes
  whose short nonces must rise strictly (a replay or a reordering ends the connection); the
  server asks ``authorize(client's long-term key)`` for the user it is, and a
  refused client gets ERROR "400" and is closed; the client checks that the server holds
  the key it was given (WELCOME opens only with it);
- PING is answered with PONG; other commands after the handshake are ignored.

Everything here raises ``ZmtpError`` for what the peer got wrong; the caller closes the
connection.  Nothing blocks and nothing here knows about sockets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from nacl.bindings import (
    crypto_box,
    crypto_box_afternm,
    crypto_box_beforenm,
    crypto_box_keypair,
    crypto_box_open,
    crypto_box_open_afternm,
    crypto_secretbox,
    crypto_secretbox_open,
)
from nacl.exceptions import CryptoError

GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
# A CURVE MESSAGE's bytes beside its frame: "\x07MESSAGE", the short nonce, the box's MAC,
# the flags byte.
CURVE_OVERHEAD = 8 + 8 + 16 + 1
HANDSHAKE_BYTES_MAX = 4096  # no handshake command of ours or libzmq's comes near this


class ZmtpError(Exception):
    """The peer broke the protocol (or was refused): close its connection."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # a short label for counters: "greeting", "frame", "crypto", ...


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """This side's long-term key pair (32 raw bytes each) and, for a client, the server's."""

    public: bytes
    secret: bytes
    server: bytes = b""


@dataclass(slots=True)
class PeerCurve:
    """CURVE for the loop channel: this daemon's key pair (32 raw bytes each); a client's
    ``server_key(addr)`` (the member at ``addr``'s key, None when unknown: no connection is
    made); a server's ``authorize(client key, client address)`` (the user the key is:
    "NODE KEY" for a member, None: refused, and counted by the caller)."""

    public: bytes
    secret: bytes
    server_key: Callable[[str], bytes | None] = lambda addr: None
    authorize: Callable[[bytes, str], str | None] = lambda key, address: None


def greeting(mechanism: bytes, as_server: bool) -> bytes:
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00"
        + mechanism.ljust(20, b"\x00") + (b"\x01" if as_server else b"\x00") + b"\x00" * 31
    )  # fmt: skip


def frame_header(flags: int, size: int) -> bytes:
    if size < 256:
        return bytes((flags, size))
    return bytes((flags | LONG,)) + size.to_bytes(8, "big")


def command(name: bytes, body: bytes) -> bytes:
    data = bytes((len(name),)) + name + body
    return frame_header(COMMAND, len(data)) + data


def encode_metadata(props: dict[bytes, bytes]) -> bytes:
    return b"".join(bytes((len(k),)) + k + len(v).to_bytes(4, "big") + v for k, v in props.items())


def decode_metadata(data: bytes) -> dict[bytes, bytes]:
    props: dict[bytes, bytes] = {}
    p, n = 0, len(data)
    while p < n:
        name_len = data[p]
        if name_len == 0 or p + 1 + name_len + 4 > n:
            raise ZmtpError("metadata", "a metadata property runs past its command")
        name = data[p + 1 : p + 1 + name_len]
        p += 1 + name_len
        value_len = int.from_bytes(data[p : p + 4], "big")
        p += 4
        if p + value_len > n:
            raise ZmtpError("metadata", "a metadata value runs past its command")
        props[name.lower()] = data[p : p + value_len]
        p += value_len
    return props


def _nonce(prefix: bytes, short: int) -> bytes:
    return prefix + short.to_bytes(8, "big")


class ZmtpConnection:
    """One ZMTP 3.0 connection's protocol state, either side.

    ``data_to_send()`` is what to write (the greeting at first, handshake commands as the
    peer's arrive); ``receive(data)`` takes bytes read and returns the messages (lists of
    frames) completed by them, in order; ``encode(frame)`` is one single-frame message on
    the wire, once ``ready``.  ``peer_user``: what ``authorize`` said of a CURVE client
    (server side), "" otherwise."""

    def __init__(
        self,
        *,
        as_server: bool,
        socket_type: bytes,
        peer_types: tuple[bytes, ...],
        frame_bytes_max: int,
        curve: CurveKeys | None = None,
        authorize: Callable[[bytes], str | None] | None = None,
    ) -> None:
        if curve is not None and as_server and authorize is None:
            raise ValueError("a CURVE server needs authorize()")
        if curve is not None and not as_server and len(curve.server) != 32:
            raise ValueError("a CURVE client needs the server's 32-byte key")
        self.as_server = as_server
        self.ready = False
        self.peer_user = ""
        self.peer_metadata: dict[bytes, bytes] = {}
        self._socket_type = socket_type
        self._peer_types = peer_types
        # As libzmq's MAXMSGSIZE: the frame as it is on the wire (a CURVE MESSAGE's 33 bytes
        # of overhead included; senders keep their messages that much under it).
        self._frame_bytes_max = frame_bytes_max
        self._curve = curve
        self._authorize = authorize
        self._out = bytearray(greeting(b"CURVE" if curve else b"NULL", as_server))
        # Bytes read and not yet parsed: chunks joined only once a frame can be complete
        # (``_need`` bytes), so a large frame read in small pieces is copied once, not once
        # a piece.
        self._in: list[bytes] = []
        self._in_bytes = 0
        self._need = 0
        self._greeted = False
        self._in_multipart = False  # inside a message of several frames: none are kept
        # CURVE state; our transient key pair is made once the peer's greeting is in (an
        # unauthenticated connection costs no key generation before that)
        self._cn_public = self._cn_secret = b""
        self._cn_peer = b""  # the peer's transient key
        self._precom = b""  # crypto_box_beforenm(peer transient, our transient)
        self._cookie_key = b""
        self._nonce = 1  # our next short nonce
        self._peer_nonce = 0  # the peer's latest short nonce
        self._step = "greeting"
        self._send_prefix = b"CurveZMQMESSAGES" if as_server else b"CurveZMQMESSAGEC"
        self._recv_prefix = b"CurveZMQMESSAGEC" if as_server else b"CurveZMQMESSAGES"

    # -- bytes out -------------------------------------------------------------------------

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def encode(self, frame: bytes) -> bytes:
        """``frame`` as one single-frame message (NULL: a data frame; CURVE: a MESSAGE)."""
        if self._curve is None:
            return frame_header(0, len(frame)) + frame
        return self._message(0, frame)

    def _message(self, flags: int, payload: bytes) -> bytes:
        """A CURVE MESSAGE: ``flags`` (MORE, COMMAND) and ``payload`` in a box under our next
        short nonce; the frame around it carries no flags (libzmq's encoding)."""
        nonce8 = self._next_nonce().to_bytes(8, "big")
        box = crypto_box_afternm(
            bytes((flags,)) + payload, self._send_prefix + nonce8, self._precom
        )
        return frame_header(0, 16 + len(box)) + b"\x07MESSAGE" + nonce8 + box

    # -- bytes in --------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received and held for a frame not complete yet."""
        return self._in_bytes

    def receive(self, data: bytes) -> list[list[bytes]]:
        """The messages completed by ``data``, in order; a message of several frames comes
        out as ``[]`` (this channel carries one-frame messages: its parts are not kept)."""
        if self._in:
            self._in.append(data)
            self._in_bytes += len(data)
            if self._in_bytes < self._need:
                return []  # the frame that waits is not complete yet
            buf = b"".join(self._in)
            self._in.clear()
        else:
            buf = data
        self._need = 0
        try:
            return self._parse(buf)
        except CryptoError:  # a key libsodium refuses (a low-order point): not one to trust
            raise ZmtpError("crypto", "a key or box libsodium refuses") from None

    def _keep(self, rest: bytes, need: int) -> None:
        self._in = [rest] if rest else []
        self._in_bytes = len(rest)
        self._need = need

    def _parse(self, buf: bytes) -> list[list[bytes]]:
        if not self._greeted:
            if len(buf) < GREETING_BYTES:
                self._check_signature(buf)
                self._keep(buf, GREETING_BYTES)
                return []
            self._on_greeting(buf[:GREETING_BYTES])
            buf = buf[GREETING_BYTES:]
        messages: list[list[bytes]] = []
        p, n = 0, len(buf)
        need = 2
        while n - p >= 2:
            # Before the handshake ends, only handshake commands: an unauthenticated peer
            # makes us hold at most a few KiB, not a whole message's worth.
            limit = self._frame_bytes_max if self.ready else HANDSHAKE_BYTES_MAX
            flags = buf[p]
            need = 2
            if flags & LONG:
                if n - p < 9:
                    need = 9
                    break
                size = int.from_bytes(buf[p + 1 : p + 9], "big")
                start = p + 9
            else:
                size = buf[p + 1]
                start = p + 2
            if size > limit:
                raise ZmtpError("too_large", f"a frame of {size} bytes (at most {limit})")
            end = start + size
            if end > n:
                need = end - p
                break
            p = end
            body = buf[start:end]
            if not self.ready:
                self._handshake(flags, body)
                continue
            if self._curve is not None:
                flags, body = self._open_message(body)
            if flags & COMMAND:
                self._on_command(body)
                continue
            if flags & MORE:
                self._in_multipart = True
                continue
            if self._in_multipart:
                self._in_multipart = False
                messages.append([])
            else:
                messages.append([body])
        self._keep(buf[p:] if p < n else b"", need)
        return messages

    def _check_signature(self, head: bytes) -> None:
        if head[:1] not in (b"", b"\xff") or (len(head) >= 10 and not head[9] & 1):
            raise ZmtpError("greeting", "not a ZMTP 3 greeting")

    def _on_greeting(self, g: bytes) -> None:
        self._check_signature(g)
        if g[10] < 3:
            raise ZmtpError("greeting", f"ZMTP version {g[10]}.{g[11]} (3.0 or later needed)")
        mechanism = g[12:32].rstrip(b"\x00")
        ours = b"CURVE" if self._curve is not None else b"NULL"
        if mechanism != ours:
            raise ZmtpError("mechanism", f"the peer speaks {mechanism!r}, this side {ours!r}")
        self._greeted = True
        if self._curve is None:
            self._step = "ready"
            self._out += command(b"READY", self._metadata())
            return
        self._cn_public, self._cn_secret = crypto_box_keypair()
        if self.as_server:
            self._step = "hello"
        else:
            self._step = "welcome"
            self._out += self._hello()

    def _metadata(self) -> bytes:
        return encode_metadata({b"Socket-Type": self._socket_type, b"Identity": b""})

    def _on_peer_metadata(self, data: bytes) -> None:
        props = decode_metadata(data)
        if props.get(b"socket-type") not in self._peer_types:
            raise ZmtpError("socket_type", f"peer socket type {props.get(b'socket-type')!r}")
        self.peer_metadata = props
        self.ready = True

    def _on_command(self, body: bytes) -> None:
        # One PONG waits at most: a peer that PINGs and never reads grows nothing here.
        if body[:5] == b"\x04PING" and len(body) >= 7 and not self._out:
            context = body[7:23]
            if self._curve is None:
                self._out += command(b"PONG", context)
            else:  # a command inside a MESSAGE box: the flags byte says so
                self._out += self._message(COMMAND, b"\x04PONG" + context)

    def _open_message(self, body: bytes) -> tuple[int, bytes]:
        if body[:8] != b"\x07MESSAGE" or len(body) < CURVE_OVERHEAD:
            raise ZmtpError("frame", "a frame that is not a CURVE MESSAGE after the handshake")
        short = int.from_bytes(body[8:16], "big")
        if short <= self._peer_nonce:
            raise ZmtpError("nonce", "a MESSAGE nonce that does not rise (a replay?)")
        self._peer_nonce = short
        try:
            plain = crypto_box_open_afternm(body[16:], self._recv_prefix + body[8:16], self._precom)
        except CryptoError:
            raise ZmtpError("crypto", "a MESSAGE box that does not open") from None
        return plain[0], plain[1:]

    # -- the handshake ---------------------------------------------------------------------

    def _handshake(self, flags: int, body: bytes) -> None:
        if not flags & COMMAND or flags & MORE:
            raise ZmtpError("handshake", "a data frame before the handshake ended")
        if body[:6] == b"\x05ERROR":
            reason = body[7 : 7 + body[6]].decode("ascii", "replace") if len(body) > 6 else ""
            raise ZmtpError("refused", f"the peer refused the handshake ({reason or 'ERROR'})")
        step = self._step
        if step == "ready":  # NULL
            if body[:6] != b"\x05READY":
                raise ZmtpError("handshake", "expected READY")
            self._on_peer_metadata(body[6:])
        elif step == "hello":
            self._on_hello(body)
        elif step == "initiate":
            self._on_initiate(body)
        elif step == "welcome":
            self._on_welcome(body)
        elif step == "curve_ready":
            self._on_curve_ready(body)
        else:
            raise ZmtpError("handshake", f"a command in step {step}")

    def _hello(self) -> bytes:
        assert self._curve is not None
        short = self._next_nonce()
        box = crypto_box(
            b"\x00" * 64, _nonce(b"CurveZMQHELLO---", short), self._curve.server, self._cn_secret
        )
        body = b"\x01\x00" + b"\x00" * 72 + self._cn_public + short.to_bytes(8, "big") + box
        return command(b"HELLO", body)

    def _next_nonce(self) -> int:
        short = self._nonce
        self._nonce = short + 1
        return short

    def _on_hello(self, body: bytes) -> None:
        assert self._curve is not None
        if body[:6] != b"\x05HELLO" or len(body) != 200:
            raise ZmtpError("handshake", "expected HELLO of 200 bytes")
        if body[6:8] != b"\x01\x00":
            raise ZmtpError("handshake", f"CurveZMQ version {body[6]}.{body[7]} (1.0 needed)")
        self._cn_peer = body[80:112]
        short = int.from_bytes(body[112:120], "big")
        try:
            plain = crypto_box_open(
                body[120:200], _nonce(b"CurveZMQHELLO---", short), self._cn_peer, self._curve.secret
            )
        except CryptoError:
            raise ZmtpError("crypto", "HELLO does not open with this server's key") from None
        if plain != b"\x00" * 64:
            raise ZmtpError("crypto", "HELLO's signature box is not zeros")
        self._peer_nonce = short
        self._cookie_key = os.urandom(32)
        cookie_nonce = os.urandom(16)
        cookie = crypto_secretbox(
            self._cn_peer + self._cn_secret, b"COOKIE--" + cookie_nonce, self._cookie_key
        )
        welcome_nonce = os.urandom(16)
        box = crypto_box(
            self._cn_public + cookie_nonce + cookie,
            b"WELCOME-" + welcome_nonce,
            self._cn_peer,
            self._curve.secret,
        )
        self._out += command(b"WELCOME", welcome_nonce + box)
        self._step = "initiate"

    def _on_welcome(self, body: bytes) -> None:
        assert self._curve is not None
        if body[:8] != b"\x07WELCOME" or len(body) != 168:
            raise ZmtpError("handshake", "expected WELCOME of 168 bytes")
        try:
            plain = crypto_box_open(
                body[24:], b"WELCOME-" + body[8:24], self._curve.server, self._cn_secret
            )
        except CryptoError:
            raise ZmtpError("crypto", "WELCOME does not open: the server lacks its key") from None
        self._cn_peer = plain[:32]
        cookie = plain[32:128]
        self._precom = crypto_box_beforenm(self._cn_peer, self._cn_secret)
        vouch_nonce = os.urandom(16)
        vouch = crypto_box(
            self._cn_public + self._curve.server,
            b"VOUCH---" + vouch_nonce,
            self._cn_peer,
            self._curve.secret,
        )
        short = self._next_nonce()
        box = crypto_box(
            self._curve.public + vouch_nonce + vouch + self._metadata(),
            _nonce(b"CurveZMQINITIATE", short),
            self._cn_peer,
            self._cn_secret,
        )
        self._out += command(b"INITIATE", cookie + short.to_bytes(8, "big") + box)
        self._step = "curve_ready"

    def _on_initiate(self, body: bytes) -> None:
        assert self._curve is not None and self._authorize is not None
        if body[:9] != b"\x08INITIATE" or len(body) < 257:
            raise ZmtpError("handshake", "expected INITIATE of at least 257 bytes")
        try:
            cookie = crypto_secretbox_open(body[25:105], b"COOKIE--" + body[9:25], self._cookie_key)
        except CryptoError:
            raise ZmtpError("crypto", "INITIATE's cookie does not open") from None
        if cookie != self._cn_peer + self._cn_secret:
            raise ZmtpError("crypto", "INITIATE's cookie is not this connection's")
        short = int.from_bytes(body[105:113], "big")
        if short <= self._peer_nonce:
            raise ZmtpError("nonce", "INITIATE's nonce does not rise past HELLO's")
        self._peer_nonce = short
        try:
            plain = crypto_box_open(
                body[113:], _nonce(b"CurveZMQINITIATE", short), self._cn_peer, self._cn_secret
            )
        except CryptoError:
            raise ZmtpError("crypto", "INITIATE's box does not open") from None
        client_key = plain[:32]
        try:
            vouch = crypto_box_open(
                plain[48:128], b"VOUCH---" + plain[32:48], client_key, self._cn_secret
            )
        except CryptoError:
            raise ZmtpError("crypto", "INITIATE's vouch does not open") from None
        if vouch[:32] != self._cn_peer or vouch[32:64] != self._curve.public:
            raise ZmtpError("crypto", "INITIATE's vouch is for another connection or server")
        user = self._authorize(client_key)
        if user is None:
            self._out += command(b"ERROR", b"\x03400")
            raise ZmtpError("refused", "the client's key is not authorised")
        self.peer_user = user
        # The client's Socket-Type before our READY: a refused one gets none (as libzmq).
        self._on_peer_metadata(plain[128:])
        self._precom = crypto_box_beforenm(self._cn_peer, self._cn_secret)
        ready_short = self._next_nonce()
        box = crypto_box_afternm(
            self._metadata(), _nonce(b"CurveZMQREADY---", ready_short), self._precom
        )
        self._out += command(b"READY", ready_short.to_bytes(8, "big") + box)

    def _on_curve_ready(self, body: bytes) -> None:
        if body[:6] != b"\x05READY" or len(body) < 30:
            raise ZmtpError("handshake", "expected READY of at least 30 bytes")
        short = int.from_bytes(body[6:14], "big")
        try:
            plain = crypto_box_open_afternm(
                body[14:], _nonce(b"CurveZMQREADY---", short), self._precom
            )
        except CryptoError:
            raise ZmtpError("crypto", "READY does not open") from None
        self._peer_nonce = short
        self._on_peer_metadata(plain)
