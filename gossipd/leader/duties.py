"""Leader duties: coroutines that run only while this daemon leads.

``LeaderDuties.register(name, duty)``: ``async def duty(ctx: LeaderContext) -> None``.  On
election every registered duty starts with a fresh ``LeaderContext`` (the new token); on
step-down every one is cancelled (and started again on the next election).  A duty that
returns is done for this term; one that raises is logged and started again after
``RESTART_S`` while we still lead.

``LeaderContext`` is what a duty may use: the token, the aetcd client, ``prefix``
(``/gossipd/<cluster>``), fenced writes (an etcd transaction that succeeds only while our
campaign key still exists with create_revision == token: a deposed leader's write fails),
``publish`` (a Directive gossiped with our token) and ``members()`` (the live membership view).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aetcd import rpc

from gossipd.leader.backoff import Backoff
from gossipd.leader.election import ETCD_FAILURES

log = logging.getLogger("gossipd.leader.duties")

RESTART_S = 1.0  # a failed duty's first restart (then doubling, with jitter: backoff.py)
RESTART_MAX_S = 30.0

Duty = Callable[["LeaderContext"], Awaitable[None]]


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
    fenced_writes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "refused": 0})

    def _fence(self) -> Any:
        return rpc.Compare(
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.CREATE,
            key=self.leader_key,
            create_revision=self.token,
        )

    async def _txn(self, op: Any) -> bool:
        await self.client.connect()
        reply = await self.client.kvstub.Txn(
            rpc.TxnRequest(compare=[self._fence()], success=[op], failure=[]),
            timeout=self.request_timeout_s,
        )
        self.fenced_writes["ok" if reply.succeeded else "refused"] += 1
        return bool(reply.succeeded)

    async def fenced_put(self, key: str | bytes, value: str | bytes) -> bool:
        """Put ``key`` only while we still lead with this token (False: we do not)."""
        return await self._txn(
            rpc.RequestOp(request_put=rpc.PutRequest(key=_bytes(key), value=_bytes(value)))
        )

    async def fenced_delete(self, key: str | bytes) -> bool:
        """Delete ``key`` only while we still lead with this token (False: we do not)."""
        return await self._txn(
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=_bytes(key)))
        )

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
