"""Host names in ZeroMQ addresses, looked up off the loop and off ZeroMQ's I/O thread.

A producer's ``reply_to`` may name its host (``tcp://producer-7:5555``), and so may a member's
advertised address or a seed (``tcp://gpu-node-3:7946``).  Connected as it is, libzmq looks
the name up with a blocking call in its I/O thread, the thread every socket of the daemon's
context shares (tasks in, gossip, replies): a name whose resolver does not answer froze all
of them for about 20 s, again at each reconnect (a review's reproduction for reply_to; for a
seed named by host, every task's answer took 9-10 s while the resolver stalled).  So the
reply sender and gossip (and the ZeroMQ peer channel) connect to addresses only: a name is
looked up here first, in threads of its own (daemon threads: one stuck in the resolver does
not hold up the daemon's exit), at most ``LOOKUPS_MAX`` at once, even those given up on
after ``timeout_s`` and still stuck, and the answer is kept for ``TTL_S`` (a failure for
``FAILED_TTL_S``).  A stalled resolver then costs what is sent to the names it holds up,
nothing else.  A socket connected to a name's address keeps it until the pool closes the
socket (idle, evicted): a member whose address changes is reached again after that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gossipd.ops.logs import RateLimiter

log = logging.getLogger("gossipd.hostnames")
_failure_log = RateLimiter(1.0)  # (names a producer makes up fail as fast as it sends them)

LOOKUPS_MAX = 16  # lookups in threads at once; a reply to one more name is dropped (counted)
NAMES_MAX = 4096  # answers kept
TTL_S = 60.0
FAILED_TTL_S = 10.0
FAILED = ""  # a name that did not resolve (cached as such)


def name_in(endpoint: str) -> tuple[str, int] | None:
    """The host name and port of a ``tcp://NAME:PORT`` endpoint (a route may add " KEY");
    None for an IP address or an ipc:// path, which need no lookup."""
    if not endpoint.startswith("tcp://") or endpoint.startswith("tcp://["):
        return None
    host, _, port = endpoint[len("tcp://") :].partition(" ")[0].rpartition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return host, int(port)
    return None


def with_address(endpoint: str, address: str) -> str:
    """``endpoint`` (tcp://NAME:PORT) with ``address`` (an IP) in the name's place."""
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


class HostNames:
    """Looked-up host names: ``address`` answers from what is known, ``look_up`` asks the
    resolver once for each name, however many sends wait for it."""

    def __init__(
        self,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo,
    ) -> None:
        """``getaddrinfo``: the resolver (socket's; a test's stalls at will)."""
        self._timeout_s = timeout_s
        self._getaddrinfo_call = getaddrinfo
        self._clock = clock
        self._known: OrderedDict[str, tuple[str, float]] = OrderedDict()  # name -> (IP, until)
        self._looking: dict[str, asyncio.Future[str]] = {}
        self._threads = 0  # lookups in their threads (those given up on included)
        self._lock = threading.Lock()
        self.failed = 0  # lookups that failed or timed out
        self.refused = 0  # lookups not made: LOOKUPS_MAX were under way

    def address(self, name: str) -> str | None:
        """The IP ``name`` resolved to, FAILED if it did not lately, None if not known."""
        known = self._known.get(name)
        if known is None:
            return None
        if known[1] <= self._clock():
            del self._known[name]
            return None
        return known[0]

    async def look_up(self, name: str, port: int) -> str:
        """``name``'s IP, or FAILED (it did not resolve within the timeout, or too many names
        are being looked up)."""
        known = self.address(name)
        if known is not None:
            return known
        looking = self._looking.get(name)
        if looking is None:
            lookup = self._start(name, port)  # (counted now: a turn's lookups stay bounded)
            if lookup is None:
                return FAILED
            looking = self._looking[name] = asyncio.ensure_future(self._answer(name, lookup))
            looking.add_done_callback(lambda _: self._looking.pop(name, None))
        return await asyncio.shield(looking)

    def address_for(
        self, endpoint: str, lookups: set[asyncio.Task[str]]
    ) -> tuple[bool, str | None]:
        """For a sender that must not wait (a datagram, a forward): ``(ready, address)``.
        Not ready: ``endpoint`` names a host not known yet, whose lookup starts now (its task
        added to ``lookups``, the caller's to cancel when it closes), or one that failed
        lately; what is sent now is dropped.  Ready: connect to ``address`` in the name's
        place (None: the endpoint is an address already)."""
        named = name_in(endpoint)
        if named is None:
            return True, None
        address = self.address(named[0])
        if address is None:
            if named[0] not in self._looking:
                try:
                    task = asyncio.get_running_loop().create_task(self.look_up(*named))
                except RuntimeError:  # (no loop: nothing can wait for it)
                    return False, None
                lookups.add(task)
                task.add_done_callback(lookups.discard)
            return False, None
        if address == FAILED:
            return False, None
        return True, address

    def _start(self, name: str, port: int) -> asyncio.Future[Any] | None:
        """A lookup of ``name`` in a thread of its own; None where none may start (LOOKUPS_MAX
        under way, or no thread to be had)."""
        with self._lock:
            if self._threads >= LOOKUPS_MAX:
                self.refused += 1
                return None
            self._threads += 1
        loop = asyncio.get_running_loop()
        lookup: asyncio.Future[Any] = loop.create_future()
        try:
            threading.Thread(
                target=self._getaddrinfo, args=(loop, lookup, name, port), name="host-name",
                daemon=True,
            ).start()  # fmt: skip
        except RuntimeError:  # (a pids limit: this reply waits for no lookup)
            with self._lock:
                self._threads -= 1
            self.refused += 1
            return None
        return lookup

    async def _answer(self, name: str, lookup: asyncio.Future[Any]) -> str:
        try:
            async with asyncio.timeout(self._timeout_s):
                found = await lookup
            address = str(found[0][4][0])
        except (OSError, TimeoutError, IndexError) as exc:
            self.failed += 1
            if _failure_log.allow():
                log.warning(
                    "a host name did not resolve: what is sent to it is dropped (replies, "
                    "gossip, forwards) until it does",
                    extra={"host": name[:100], "error": str(exc) or type(exc).__name__,
                           "failed": self.failed},
                )  # fmt: skip
            self._keep(name, FAILED, FAILED_TTL_S)
            return FAILED
        self._keep(name, address, TTL_S)
        return address

    def _getaddrinfo(
        self, loop: asyncio.AbstractEventLoop, lookup: asyncio.Future[Any], name: str, port: int
    ) -> None:
        """In a thread of its own: the lookup, its answer handed to the loop."""
        try:
            try:
                answer: Any = self._getaddrinfo_call(name, port, 0, socket.SOCK_STREAM)
            except Exception as exc:  # (a label too long for IDNA raises UnicodeError)
                answer = (
                    exc if isinstance(exc, OSError) else OSError(f"{type(exc).__name__}: {exc}")
                )
            loop.call_soon_threadsafe(_settle, lookup, answer)
        except RuntimeError:  # the loop closed meanwhile
            pass
        finally:
            with self._lock:
                self._threads -= 1

    def _keep(self, name: str, address: str, ttl_s: float) -> None:
        self._known[name] = (address, self._clock() + ttl_s)
        self._known.move_to_end(name)
        while len(self._known) > NAMES_MAX:
            self._known.popitem(last=False)


def _settle(lookup: asyncio.Future[Any], answer: Any) -> None:
    if lookup.done():  # (given up on)
        return
    if isinstance(answer, OSError):
        lookup.set_exception(answer)
    else:
        lookup.set_result(answer)
