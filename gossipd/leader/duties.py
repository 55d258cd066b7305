"""Leader duties: coroutines that run only while this daemon leads.

``LeaderDuties.register(name, duty)``: ``async def duty(ctx: LeaderContext) -> None``.  On
election every registered duty starts with a fresh ``LeaderContext`` (the new token); on
step-down every one is cancelled (and started again on the next election).  A duty that
returns is done for this term; one that raises is logged and started again after
``RESTART_S`` while we still lead.

``LeaderContext`` is what a duty may use: the token, the aetcd client, ``prefix``
(``/gossipd/<cluster>``), fenced writes (an etcd transaction that succeeds only while our
campaign key still exists with create_revision == token: a deposed leader's write fails),
the same fence with keys that must still be as the duty read them (``fenced_put_if``,
``fenced_check``: a write, or an action, decided on a read that an operator's change has
since made stale is refused), ``publish`` (a Directive gossiped with our token) and
``members()`` (the live membership view).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aetcd import rpc

from gossipd.leader.backoff import Backoff
from gossipd.leader.election import ETCD_FAILURES

log = logging.getLogger("gossipd.leader.duties")

RESTART_S = 1.0  # a failed duty's first restart (then doubling, with jitter: backoff.py)
RESTART_MAX_S = 30.0

Duty = Callable[["LeaderContext"], Awaitable[None]]


class Fenced(enum.Enum):
    """The outcome of a fenced transaction."""

    OK = "ok"  # done (or, for a check, all still holds)
    DEPOSED = "refused"  # our campaign key is gone or not ours: we no longer lead
    CHANGED = "changed"  # we lead, but a key is no longer as read: read again


@dataclass(slots=True)
class LeaderContext:
    token: int
    node: str
    client: Any  # the aetcd client (gossipd.leader.client.EtcdClient)
    prefix: str  # /gossipd/<cluster>
    leader_key: bytes  # our campaign key: the fence of every write
    request_timeout_s: float
    _publish: Callable[[str, object], bool]
    _members: Callable[[], list[Any]]
    fenced_writes: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "refused": 0, "changed": 0}
    )

    def _fence(self) -> Any:
        return rpc.Compare(
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.CREATE,
            key=self.leader_key,
            create_revision=self.token,
        )

    async def _txn(self, ops: list[Any], unchanged: Mapping[bytes, int]) -> Fenced:
        """``ops`` in one transaction, only while our fence holds and every key of
        ``unchanged`` still has that mod_revision (0: still absent)."""
        await self.client.connect()
        compare = [self._fence()]
        compare += [
            rpc.Compare(
                result=rpc.Compare.CompareResult.EQUAL,
                target=rpc.Compare.CompareTarget.MOD,
                key=key,
                mod_revision=revision,
            )
            for key, revision in unchanged.items()
        ]
        # Refused: our key as etcd has it now says which compare failed.
        failure = [rpc.RequestOp(request_range=rpc.RangeRequest(key=self.leader_key))]
        reply = await self.client.kvstub.Txn(
            rpc.TxnRequest(compare=compare, success=ops, failure=failure if unchanged else []),
            timeout=self.request_timeout_s,
        )
        if reply.succeeded:
            outcome = Fenced.OK
        elif not unchanged:
            outcome = Fenced.DEPOSED
        else:
            kvs = reply.responses[0].response_range.kvs
            held = bool(kvs) and kvs[0].create_revision == self.token
            outcome = Fenced.CHANGED if held else Fenced.DEPOSED
        self.fenced_writes[outcome.value] += 1
        return outcome

    async def fenced_put(self, key: str | bytes, value: str | bytes) -> bool:
        """Put ``key`` only while we still lead with this token (False: we do not)."""
        return await self._txn([_put(key, value)], {}) is Fenced.OK

    async def fenced_delete(self, key: str | bytes) -> bool:
        """Delete ``key`` only while we still lead with this token (False: we do not)."""
        op = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=_bytes(key)))
        return await self._txn([op], {}) is Fenced.OK

    async def fenced_put_if(
        self, key: str | bytes, value: str | bytes, unchanged: Mapping[bytes, int]
    ) -> Fenced:
        """Put ``key`` only while we still lead with this token and every key of
        ``unchanged`` still has the mod_revision given (0: absent), as the duty read it: a
        compare-and-swap in one transaction."""
        return await self._txn([_put(key, value)], unchanged)

    async def fenced_check(self, unchanged: Mapping[bytes, int]) -> Fenced:
        """``fenced_put_if`` without the put: do we still lead, and is every key of
        ``unchanged`` still as read (now, at a revision later than the read)?"""
        return await self._txn([], unchanged)

    def publish(self, kind: str, body_obj: object) -> bool:
        """Gossip a Directive of ``kind`` with our token; ``body_obj`` is msgpack-encoded
        (at most 64 KiB).  Applied here too (subscribers on the leader get it).  False: our
        own fence refused it (a higher token was seen: we are no longer the leader)."""
        return self._publish(kind, body_obj)

    def members(self) -> list[Any]:
        """This daemon's live membership view (MemberView: node, state, incarnation, addr,
        gpu), ourselves not included."""
        return self._members()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _put(key: str | bytes, value: str | bytes) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=_bytes(key), value=_bytes(value)))


class LeaderDuties:
    def __init__(self) -> None:
        self._duties: dict[str, Duty] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._context: LeaderContext | None = None
        self.failures: dict[str, int] = {}

    def register(self, name: str, duty: Duty) -> None:
        """Run ``duty`` while we lead (from the next election on, or now if we lead)."""
        if name in self._duties:
            raise ValueError(f"a leader duty named {name!r} is already registered")
        self._duties[name] = duty
        if self._context is not None:
            self._start(name, self._context)

    @property
    def names(self) -> list[str]:
        return sorted(self._duties)

    @property
    def running(self) -> list[str]:
        return sorted(n for n, t in self._running.items() if not t.done())

    def start(self, ctx: LeaderContext) -> None:
        """We were elected: start every duty with ``ctx``."""
        self.stop()
        self._context = ctx
        for name in self._duties:
            self._start(name, ctx)

    def stop(self) -> None:
        """We stepped down: cancel every duty."""
        self._context = None
        for task in self._running.values():
            task.cancel()
        self._running.clear()

    def _start(self, name: str, ctx: LeaderContext) -> None:
        self._running[name] = asyncio.get_running_loop().create_task(
            self._run(name, ctx), name=f"duty-{name}"
        )

    async def _run(self, name: str, ctx: LeaderContext) -> None:
        backoff = Backoff(RESTART_S, RESTART_MAX_S)
        loop = asyncio.get_running_loop()
        while self._context is ctx:
            began = loop.time()
            try:
                await self._duties[name](ctx)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures[name] = self.failures.get(name, 0) + 1
                if loop.time() - began > RESTART_MAX_S:
                    backoff.reset()  # it ran well for a while: this failure is a new one
                pause_s = backoff.next_s()
                if isinstance(exc, ETCD_FAILURES):
                    # etcd's trouble, which the election's error log already reports once
                    # per outage: one line, no traceback (it was one a second while it lasted)
                    log.warning("leader duty %s: etcd failed (%s: %s); again in %.1f s", name,
                                type(exc).__name__, str(exc)[:200], pause_s)  # fmt: skip
                else:
                    log.exception("leader duty %s failed; starting it again in %.1f s", name,
                                  pause_s)  # fmt: skip
                await asyncio.sleep(pause_s)
