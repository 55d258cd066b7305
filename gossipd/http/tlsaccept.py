"""A TLS door's accepted connections before their handshake (gossipd/http/server.py's
``serve`` with ``tls``): each is counted against ``http.connections_max`` from accept, not
from its handshake's end, since a client that stops inside its ClientHello holds ~0.4 MiB of
buffers and a descriptor (300 such raised a daemon's RSS by 126 MiB before this).  Counted,
the socket is handed to the loop's TLS with a fresh HttpConnection (counted already), which
sees the connection once the handshake is done; one not done within ``idle_timeout_s`` is
closed, and every handshake that fails is counted (``tls_failed``).

Not ``loop.start_tls`` on the counted transport: uvloop 0.23's server-side ``start_tls``
never finishes a handshake here (asyncio's does); ``connect_accepted_socket`` with ``ssl`` on
a duplicate of the accepted socket works on both loops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from gossipd.http.exchange import HttpLimits, admit

if TYPE_CHECKING:
    from gossipd.http.server import HttpConnection

log = logging.getLogger("gossipd.http.server")

_HANDSHAKES: set[asyncio.Task[None]] = set()  # under way (kept from the garbage collector)


class TlsAccept(asyncio.Protocol):
    """The plain protocol of one accepted TLS connection, for the moment it is counted and
    handed over."""

    def __init__(
        self, conn: Callable[[], HttpConnection], limits: HttpLimits, tls: ssl.SSLContext
    ) -> None:
        self._conn = conn
        self._limits = limits
        self._tls = tls

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)
        if not admit(self._limits, transport):
            return
        transport.pause_reading()  # (every byte is the TLS's)
        try:
            raw = transport.get_extra_info("socket")
            sock = socket.socket(fileno=os.dup(raw.fileno()))  # this transport's ends below
        except OSError as exc:  # out of descriptors (a flood): closed, its place given back
            log.debug("a TLS connection could not be handed over", extra={"error": str(exc)})
            transport.abort()
            self._failed()
            return
        transport.abort()
        task = asyncio.get_running_loop().create_task(self._shake_hands(sock))
        _HANDSHAKES.add(task)
        task.add_done_callback(_HANDSHAKES.discard)

    async def _shake_hands(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self._conn, sock, ssl=self._tls, ssl_handshake_timeout=self._limits.idle_timeout_s
            )
        except Exception as exc:  # refused, reset, too slow: closed
            log.debug("a TLS handshake failed", extra={"error": repr(exc)[:200]})
            sock.close()
            self._failed()

    def _failed(self) -> None:
        """Its place under connections_max given back (no HttpConnection will), counted."""
        self._limits.counters.open_now -= 1
        self._limits.counters.tls_failed += 1
