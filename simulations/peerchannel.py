"""Fan-out's peer channel in virtual time: ``SimPeerClient`` and ``SimPeerServer``
(``gossipd.peerchannel``'s protocols) on a ``simulations.netsim.SimNetwork``.

The same network model as ``SimTransport``'s: each frame's loss and delay drawn from the
network's seeded RNG, partitions by node, frames on one path never overtaking each other.
A client's connection to a server is an address of its own, ``sim://CLIENT/c/N``, bound on
the network while the connection is open: its identity at the server is that address, so a
reply travels the path (server, connection), in order, and a reply to a connection that has
closed is refused at once, as ZeroMQ's ROUTER_MANDATORY refuses one.  The sender a server
sees is the client's node name: the network knows who sent, as CURVE with every key known.
"""

from __future__ import annotations

from collections.abc import Callable

from gossipd.errors import LocalProtocolError, TransportClosed
from gossipd.peerchannel import OnReplies, OnRequest
from simulations.netsim import SimNetwork


class _Connection:
    """One client's connection to one server address, bound at its own return address."""

    __slots__ = ("addr", "client", "identity", "return_addr", "used_at")

    def __init__(self, client: SimPeerClient, addr: str, return_addr: str, now: float) -> None:
        self.client = client
        self.addr = addr  # the server's
        self.return_addr = return_addr
        self.identity = return_addr.encode()
        self.used_at = now  # the network's time at the last send

    def _deliver(self, frame: object) -> None:
        """A reply from the server: to the client's ``on_replies``, unless it has stopped."""
        on_replies = self.client._on_replies
        if on_replies is not None and not self.client._stopped:
            assert isinstance(frame, bytes)
            on_replies(self.addr, [frame])


class SimPeerClient:
    """``gossipd.peerchannel.PeerClient`` on a ``SimNetwork``, for the node ``name``."""

    def __init__(self, network: SimNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self._on_replies: OnReplies | None = None
        self._connections: dict[str, _Connection] = {}
        self._opened = 0  # connections made: each return address is new
        self._stopped = False
        self._closed = False
        self.dropped = 0
        self.protocol_errors = 0  # the simulated network carries no bytes to get wrong

    def start(self, on_replies: OnReplies) -> None:
        self._on_replies = on_replies

    def send(self, addr: str, frame: bytes) -> bool:
        if self._closed:
            raise TransportClosed("send on a closed peer client")
        network = self.network
        conn = self._connections.get(addr)
        if conn is None:
            conn = self._connect(addr)
        conn.used_at = network.now
        if network._send(self.name, addr, (conn.identity, frame, self.name)):
            return True
        self.dropped += 1
        return False

    def _connect(self, addr: str) -> _Connection:
        if self._on_replies is None:
            raise LocalProtocolError("start() the peer client before sending")
        self._opened += 1
        conn = _Connection(self, addr, f"sim://{self.name}/c/{self._opened}", self.network.now)
        self._connections[addr] = conn
        self.network._bound[conn.return_addr] = conn
        return conn

    def close_idle(self, now: float, idle_s: float, keep: Callable[[str], bool]) -> int:
        idle = [
            addr
            for addr, conn in self._connections.items()
            if conn.used_at <= now - idle_s and not keep(addr)
        ]
        for addr in idle:
            self._disconnect(addr)
        return len(idle)

    def close_rekeyed(self, *, unknown_only: bool = False) -> int:
        return 0  # the simulated network has no keys

    def _disconnect(self, addr: str) -> None:
        conn = self._connections.pop(addr)
        del self.network._bound[conn.return_addr]  # replies in flight: undeliverable

    def stop(self) -> None:
        self._stopped = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        for addr in list(self._connections):
            self._disconnect(addr)

    def __len__(self) -> int:
        return len(self._connections)


class SimPeerServer:
    """``gossipd.peerchannel.PeerServer`` on a ``SimNetwork``, for the node ``name``, at
    ``sim://NAME/rpc`` (one server a node).  Frames that arrive before ``start`` or after
    ``stop`` wait, as they would in a socket's queue, and are lost at ``close``."""

    def __init__(self, network: SimNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self.addr = f"sim://{name}/rpc"
        self._on_request: OnRequest | None = None
        self._waiting: list[tuple[bytes, bytes, str]] = []
        self._bound = False
        self._closed = False
        self.dropped = 0
        self.protocol_errors = 0  # the simulated network carries no bytes to get wrong
        self.busy = 0  # (nor bounds to go past)

    def bind(self, addr: str) -> str:
        """Accept at ``sim://NAME/rpc`` (``addr`` is ignored: one server a node)."""
        if self._closed:
            raise TransportClosed("bind on a closed peer server")
        if self._bound or self.addr in self.network._bound:
            raise LocalProtocolError(f"{self.addr} is already bound")
        self._bound = True
        self.network._bound[self.addr] = self
        return self.addr

    def start(self, on_request: OnRequest, on_malformed: Callable[[], None]) -> None:
        """(Nothing is malformed here: a simulated frame is always one.)"""
        if not self._bound:
            raise LocalProtocolError("bind() the peer server first")
        self._on_request = on_request
        waiting, self._waiting = self._waiting, []
        for identity, frame, sender in waiting:
            on_request(identity, frame, sender)

    def _deliver(self, frame: object) -> None:
        assert isinstance(frame, tuple)
        if self._on_request is None:
            self._waiting.append(frame)
            return
        self._on_request(*frame)

    def send(self, identity: bytes, frame: bytes) -> bool:
        if self._closed or not self._bound:
            raise TransportClosed("send on a closed (or unbound) peer server")
        addr = identity.decode()
        if addr not in self.network._bound or not self.network._send(self.name, addr, frame):
            self.dropped += 1  # the connection is gone, or its path is full
            return False
        return True

    def flush(self) -> None:
        """Nothing to do: a send is on its way when it returns."""

    def stop(self) -> None:
        self._on_request = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._waiting.clear()
        if self.network._bound.get(self.addr) is self:
            del self.network._bound[self.addr]
