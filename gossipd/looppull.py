"""A ZeroMQ PULL socket spoken by the event loop: ``LoopPullServer``, the receiving end of
PUSH sockets (libzmq's, or any ZMTP 3.0 implementation's), NULL or CURVE.  It serves the
membership socket (gossip.receiver, through gossipd/datagrams.py), the ingress
(ingress.receiver, gossipd/ingress/service.py) and the HTTP door's reply socket
(http.reply_receiver, gossipd/http/answers.py).

Why not libzmq's PULL: its I/O thread reads on while the loop is busy and queues up to
RCVHWM messages a connection whatever their size, so what a busy daemon holds was bounded in
messages, not bytes.  Here each complete frame is handed over as it is read, and what is
held is only frames not complete yet, within the server's read budget in bytes over all
connections (looppeer.py); a daemon that does not read leaves the bytes in TCP's buffers, and
senders wait.

A turn reads each connection once, at most 256 KiB (the loop's read size): a burst of large
tasks is taken a few at a time, with the work they make running in between, as
``SocketReader``'s batches do for libzmq's sockets (``ingress.recv_batch_max`` and
``recv_batch_bytes_max`` bound those batches; here the read size does).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

from gossipd.looppeer import LoopPeerServer
from gossipd.ops.logs import handler_name, note_handler_failure
from gossipd.peerlink import PeerLink
from gossipd.zmtp import PeerCurve

log = logging.getLogger("gossipd.looppull")

# The frames one read of a connection completed, and who sent them ("NODE KEY" of a member,
# a producer's key, as ZAP said; "" without CURVE).
OnFrames = Callable[[list[bytes], str], None]


def loop_binds(addr: str) -> bool:
    """Does the loop's PULL bind ``addr``: ``tcp://`` with an IP address or ``*`` and a port
    number or ``*`` (any free port).  What else libzmq binds stays libzmq's: ``ipc://``, a
    network interface's name (``tcp://eth0:5557``), a host name."""
    if not addr.startswith("tcp://"):
        return False
    host, _, port = addr[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not (port.isdigit() or port == "*") or not host:
        return False
    if host == "*":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class LoopPullServer(LoopPeerServer):
    """``LoopPeerServer`` as a PULL: ``receive(on_frames, on_malformed)`` hands over the
    frames of each read together (one call, not one a frame: the ingress's tasks are small
    and many), and nothing is ever sent back."""

    def __init__(
        self,
        *,
        message_bytes_max: int,
        curve: PeerCurve | None = None,
        read_bytes_max: int = 0,
        refused_lines_per_s: float = 5.0,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            message_bytes_max=message_bytes_max,
            curve=curve,
            read_bytes_max=read_bytes_max,
            refused_lines_per_s=refused_lines_per_s,
            socket_type=b"PULL",
            peer_types=(b"PUSH",),
            on_read=on_read,
        )
        self._held = False  # pause_reading(): nothing more is read until close
        self._accepting = True  # until stop_accepting
        self._on_frames: OnFrames | None = None
        self._ended: asyncio.Event | None = None  # set once stopped and no connection is left

    def bind(self, addr: str) -> str:
        """As ``LoopPeerServer.bind``; port ``*`` (libzmq's any free port) is the kernel's
        pick, as port 0; -> the address bound, with its port."""
        return super().bind(addr[:-1] + "0" if addr.endswith(":*") else addr)

    def receive(self, on_frames: OnFrames, on_malformed: Callable[[], None]) -> None:
        """Accept from the next loop turn on; ``on_malformed()`` once a message of several
        frames (no datagram or task is)."""
        self._on_frames = on_frames
        self.start(lambda identity, frame, sender: None, on_malformed)

    def _on_messages(self, link: PeerLink, messages: list[list[bytes]]) -> None:
        on_frames = self._on_frames
        if self._stopped or on_frames is None:
            return
        frames = self._single_frames(messages)
        if not frames:
            return
        try:
            on_frames(frames, link.zmtp.peer_user)
        except Exception:  # a bug of the handler's: the connection and the next reads go on
            self.handler_errors += 1
            note_handler_failure(handler_name(on_frames), log, "handling frames read")

    def _new_link(self) -> PeerLink:
        link = super()._new_link()
        if not self._accepting:
            link.close()  # (accepted as the listening socket closed)
        return link

    def _on_ready(self, link: PeerLink) -> None:
        super()._on_ready(link)
        if not self._accepting:  # shook hands as we stopped accepting: it ends as the rest
            link.shut_write()
        if self._held:
            link.pause()

    def _on_lost(self, link: PeerLink, reason: str) -> None:
        super()._on_lost(link, reason)
        if self._ended is not None and not self._links and not self._shaking:
            self._ended.set()

    def stop_accepting(self) -> None:
        """Take no new connection and ask the open ones to end (our FIN: libzmq's PUSH takes
        it for a dropped connection, then sends its messages elsewhere or holds them),
        reading on what they sent before (``ended`` waits for them); connections still
        shaking hands have sent nothing yet and are closed.  A stopping daemon unbinds its
        ingress so."""
        self._accepting = False
        self._ended = asyncio.Event()
        if self._server is not None:
            self._server.close()  # (the listening socket; the connections stay)
        for link in list(self._shaking):
            link.close()
        for link in list(self._links.values()):
            link.shut_write()
        if not self._links:
            self._ended.set()

    async def ended(self, timeout_s: float) -> bool:
        """After ``stop_accepting``: wait until every connection has ended (its sender closed
        it after our FIN, once what it had sent was read and handed over), at most
        ``timeout_s``.  -> whether they all did."""
        assert self._ended is not None, "stop_accepting() first"
        try:
            await asyncio.wait_for(self._ended.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def pause_reading(self) -> None:
        """Read nothing more (what arrives waits in TCP's buffers, unread and unanswered),
        until ``close``."""
        self._held = True
        for link in list(self._links.values()):
            link.pause()
