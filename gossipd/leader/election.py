"""The etcd leader election's shell: runs one ElectionCore (gossipd/core/election.py) against
etcd with aetcd.

Three loops share the core: the campaign (grant a lease, put our key under
``/gossipd/<cluster>/election/``, read the candidates, lead or watch our predecessor), the
keepalive (every TTL/3; faster while the lease is not confirmed, so leadership comes back
within a fraction of a second after etcd does) and the step-down timer (the core's deadline:
a leader whose lease was not confirmed for a TTL steps down, etcd reachable or not).

aetcd does not re-create a watch after its connection breaks: a follower waits on its
predecessor's deletion for at most a TTL, then reads the candidates again and watches anew.
Every kind of etcd error is logged once per outage, with a count when etcd answers again
(errorlog.py), and the loops go on: etcd coming back needs no operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable

import grpc
from aetcd import rpc
from aetcd.exceptions import ClientError

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import EtcdConfig
from gossipd.core.election import (
    Decision,
    Elected,
    ElectionCore,
    Phase,
    SteppedDown,
    Watch,
)
from gossipd.leader.backoff import Backoff
from gossipd.leader.client import EtcdClient
from gossipd.leader.errorlog import EtcdErrorLog

log = logging.getLogger("gossipd.leader.election")

# What an etcd call raises when etcd is down, slow or refuses: retried, never fatal.
# A follower's safety-net look at the candidates, in TTLs (its predecessor's deletion wakes it
# at once; a failed watch stream raises and it looks again then).
FOLLOWER_LOOK_TTLS = 10.0
ETCD_ERRORS = (ClientError, grpc.aio.AioRpcError, TimeoutError, OSError, ValueError)
# ...those that are surely etcd's, not a bug of ours (a duty logs them without a traceback).
ETCD_FAILURES = (ClientError, grpc.aio.AioRpcError, TimeoutError, ConnectionError)
RETRY_S = 0.1  # the campaign's first pause after an etcd error (then doubling: backoff.py)
RETRY_MAX_S = 2.0  # the longest: etcd back, a daemon campaigns again within it


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdElection:
    def __init__(
        self,
        config: EtcdConfig,
        *,
        node: str,
        cluster: str,
        on_elected: Callable[[int], None],
        on_deposed: Callable[[str], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.node = node
        self.prefix = f"/gossipd/{cluster}"
        self.election_prefix = f"{self.prefix}/election/".encode()
        self.core = ElectionCore(ttl_s=config.ttl_s)
        self.client = EtcdClient(config)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._clock = clock
        self._changed = asyncio.Event()  # wakes the campaign: the session or leadership changed
        # One log per loop: a lease kept alive says nothing of a campaign call that keeps
        # failing (a permission error, say), so each loop's outage ends with its own answer.
        self._error_log = EtcdErrorLog(log, clock.monotonic)
        self._keepalive_error_log = EtcdErrorLog(log, clock.monotonic)
        self._retry = Backoff(RETRY_S, RETRY_MAX_S)  # the campaign's, after etcd errors
        self._keepalive_retry = Backoff(RETRY_S, RETRY_MAX_S)
        self.errors = 0
        self.stray_keys = 0  # keys without a lease under the election prefix (ignored)
        self._strays_said: set[bytes] = set()
        self.resigned = False
        # The lease run_forever held when it ended (0: none): after a crash of ours its key
        # would hold off the next leader, and our own new key, for up to a TTL.
        self.abandoned_lease = 0

    @property
    def key(self) -> bytes:
        """Our campaign key (one per lease)."""
        return self.election_prefix + f"{self.core.lease_id:016x}".encode()

    @property
    def leading(self) -> bool:
        """We lead, and our lease is still believed valid now (after a pause of the process,
        before the step-down timer has run, this is already False)."""
        return self.core.leading and self.core.lease_valid(self._clock.monotonic())

    @property
    def token(self) -> int:
        return self.core.leader_token

    # -- the loops ---------------------------------------------------------------------------

    async def run_forever(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._campaign_forever(), name="election-campaign")
                tg.create_task(self._keepalive_forever(), name="election-keepalive")
                tg.create_task(self._timer_forever(), name="election-timer")
        finally:
            self.abandoned_lease = self._held_lease()  # (revoked by Leadership on a crash)
            self._apply(self.core.resign("stopped"))

    async def _campaign_forever(self) -> None:
        core = self.core
        while True:
            self._changed.clear()
            try:
                if core.phase is Phase.RESIGNED:
                    await self._changed.wait()
                elif core.phase is Phase.NO_SESSION:
                    await self._grant()
                elif core.phase is Phase.NO_KEY:
                    await self._put_key()
                else:
                    await self._look()
            except ETCD_ERRORS as exc:
                self._error(exc)
                await asyncio.sleep(self._retry.next_s())

    async def _grant(self) -> None:
        sent_at = self._clock.monotonic()
        ttl = max(1, math.ceil(self.config.ttl_s))  # etcd's leases are whole seconds
        lease = await self.client.lease(ttl)
        self._error_cleared()
        self.core.granted(sent_at, lease.id, float(lease.ttl))

    async def _put_key(self) -> None:
        """Create our key (only if absent: a retry after a lost answer finds it there)."""
        await self.client.connect()
        key = self.key
        compare = rpc.Compare(
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.CREATE,
            key=key,
            create_revision=0,
        )
        put = rpc.RequestOp(
            request_put=rpc.PutRequest(key=key, value=self.node.encode(), lease=self.core.lease_id)
        )
        get = rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
        reply = await self.client.kvstub.Txn(
            rpc.TxnRequest(compare=[compare], success=[put], failure=[get]),
            timeout=self.config.request_timeout_s,
        )
        self._error_cleared()
        if reply.succeeded:
            self.core.key_created(reply.header.revision)
            return
        kvs = reply.responses[0].response_range.kvs
        if kvs:
            self.core.key_created(kvs[0].create_revision)

    async def _candidates(self) -> tuple[list[tuple[int, bytes]], int]:
        """(create_revision, key) of every candidate, lowest first; the read's revision."""
        await self.client.connect()
        reply = await self.client.kvstub.Range(
            rpc.RangeRequest(
                key=self.election_prefix,
                range_end=prefix_end(self.election_prefix),
                keys_only=True,
                sort_order=rpc.RangeRequest.SortOrder.ASCEND,
                sort_target=rpc.RangeRequest.SortTarget.CREATE,
            ),
            timeout=self.config.request_timeout_s,
        )
        self._error_cleared()
        # A key without a lease is no candidate's (every candidate's key is put with its
        # lease): one put there by hand would otherwise be the lowest for ever, and no
        # daemon would lead.  Said once per key.
        stray = [kv.key for kv in reply.kvs if kv.lease == 0]
        for key in stray:
            if key not in self._strays_said:
                self._strays_said.add(key)
                log.warning(
                    "a key without a lease under the election prefix is ignored: delete it "
                    "(etcdctl del KEY); no gossipd daemon writes one",
                    extra={"key": key.decode("utf-8", "replace")},
                )
        self.stray_keys = len(stray)
        candidates = [(kv.create_revision, kv.key) for kv in reply.kvs if kv.lease != 0]
        return candidates, reply.header.revision

    async def _look(self) -> None:
        """Read the candidates and act: lead, or wait on our predecessor; a leader watches
        its own key and looks again every TTL or when the session changes.  Its key deleted
        (by hand: its lease lives), it steps down as soon as the watch says so; the successor,
        which watches that key too, must read the candidates before it leads."""
        candidates, revision = await self._candidates()
        decision = self.core.candidates(self._clock.monotonic(), [r for r, _ in candidates])
        self._apply(decision)
        if isinstance(decision, Watch):
            key = next(k for r, k in candidates if r == decision.revision)
            # A follower looks again only when its predecessor's key goes (or the watch
            # fails: raised), else after FOLLOWER_LOOK_TTLS TTLs, jittered: every TTL, 1,000
            # followers at TTL 2 s read the whole candidate list 500 times a second.
            look_s = self.config.ttl_s * FOLLOWER_LOOK_TTLS * random.uniform(0.75, 1.25)
            await self._wait_gone(key, revision + 1, timeout_s=look_s)
        elif self.core.phase is Phase.CANDIDATE:
            if self.core.leading:
                await self._wait_gone(
                    self.key, revision + 1, on_gone=lambda: self._apply(self.core.key_deleted())
                )
            else:
                await self._woken_within(self.core.keepalive_interval_s())

    async def _wait_gone(
        self,
        key: bytes,
        start_revision: int,
        on_gone: Callable[[], None] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Until ``key`` is deleted, the session changes, or ``timeout_s`` passes (default a
        TTL; then we look again, whatever the watch missed; a watch whose stream fails
        raises).  ``on_gone``: called as soon as the deletion is seen (before the watch's
        cancel, a round trip to etcd)."""
        watch = await self.client.watch(key, start_revision=start_revision)

        async def deleted() -> None:
            async for event in watch:
                if event.kind == "DELETE":
                    return

        waiter = asyncio.ensure_future(deleted())
        woken = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait(
                {waiter, woken},
                timeout=self.config.ttl_s if timeout_s is None else timeout_s,
                return_when="FIRST_COMPLETED",
            )
            gone = waiter.done() and not waiter.cancelled() and waiter.exception() is None
            if gone and on_gone is not None:
                on_gone()
        finally:
            woken.cancel()
            waiter.cancel()
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    await watch.cancel()
            except ETCD_ERRORS:  # (TimeoutError among them)
                pass
            except asyncio.CancelledError:
                # Ours (the daemon stops: its task group cancelled us) goes on up; swallowed,
                # the campaign went on and the stop waited for it for ever.  Only a cancel
                # from inside the watch's own teardown is dropped.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()  # type: ignore[misc]

    async def _keepalive_forever(self) -> None:
        core = self.core
        while True:
            sent_at = self._clock.monotonic()
            failed = False
            if core.phase in (Phase.NO_KEY, Phase.CANDIDATE):
                lease_id = core.lease_id
                try:
                    async with asyncio.timeout(self.config.request_timeout_s):
                        reply = await self.client.refresh_lease(lease_id)
                except ETCD_ERRORS as exc:
                    self.errors += 1
                    self._keepalive_error_log.failed(exc)
                    self.client.failed(exc)
                    failed = True
                else:
                    self._keepalive_error_log.cleared()
                    self.client.answered()
                    self._keepalive_retry.reset()
                    if reply is not None and lease_id == core.lease_id:
                        was_valid = core.lease_valid(self._clock.monotonic())
                        self._apply(
                            core.keepalive_answered(self._clock.monotonic(), sent_at, reply.TTL)
                        )
                        if not was_valid or core.phase is Phase.NO_SESSION:
                            self._changed.set()
            # Every TTL/3 from the last send, not from its answer: counted from the answer, a
            # slow etcd (answers in 0.6 s, inside request_timeout_s) stretched the cycle past
            # what the lease's validity (counted from the send) allows, and a healthy leader
            # stepped down again and again.  While the lease is unconfirmed, sooner (to lead
            # again quickly).
            interval = core.keepalive_interval_s()
            now = self._clock.monotonic()
            if failed:  # etcd down or overloaded: less and less often, each daemon apart
                interval = min(interval, self._keepalive_retry.next_s())
            elif not core.lease_valid(now):
                interval = min(interval, RETRY_S)
            await asyncio.sleep(max(0.0, sent_at + interval - now))

    async def _timer_forever(self) -> None:
        core = self.core
        while True:
            deadline = core.next_deadline()
            now = self._clock.monotonic()
            await asyncio.sleep(min(max(0.0, deadline - now), core.keepalive_interval_s()))
            decision = core.tick(self._clock.monotonic())
            if decision is not None:
                self._apply(decision)
                self._changed.set()

    async def _woken_within(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
        except TimeoutError:
            pass

    # -- resign ------------------------------------------------------------------------------

    def resign_nowait(self) -> int:
        """Step down now and campaign no more until ``rejoin()``; the lease to revoke (0:
        none of ours).  Synchronous, so that a ``rejoin()`` right after it (an undrain in the
        same loop turn) undoes it: a resign left pending would run after the rejoin."""
        core = self.core
        lease_id = self._held_lease()
        self._apply(core.resign())
        self.resigned = True
        self._changed.set()
        return lease_id

    def _held_lease(self) -> int:
        """Our lease while it may hold our campaign key (0: none)."""
        core = self.core
        return core.lease_id if core.phase in (Phase.NO_KEY, Phase.CANDIDATE) else 0

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease ``resign_nowait()`` gave up: its key goes at once, and the next
        candidate takes over without waiting for the TTL (a failure is logged: it expires
        within the TTL)."""
        if not lease_id:
            return
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await self.client.revoke_lease(lease_id)
        except ETCD_ERRORS as exc:
            log.warning("could not revoke the election lease (it expires within the TTL): %s", exc)

    async def resign(self) -> None:
        """Step down now and revoke the lease (``resign_nowait``, then ``revoke``)."""
        await self.revoke(self.resign_nowait())

    def rejoin(self) -> None:
        """Campaign again after a resign (e.g. a drain was undone)."""
        self.resigned = False
        self.core.restart()
        self._changed.set()

    async def close(self) -> None:
        with contextlib.suppress(*ETCD_ERRORS):
            await self.client.close()

    # -- helpers -----------------------------------------------------------------------------

    def _apply(self, decision: Decision) -> None:
        if isinstance(decision, Elected):
            log.info(
                "leader_elected",
                extra={"token": decision.token, "node": self.node, "t_wall": self._clock.wall()},
            )
            self._on_elected(decision.token)
        elif isinstance(decision, SteppedDown):
            t_wall = self._clock.wall()
            # lease_until_wall: when the leadership really ended (earlier than t_wall only
            # when the process was paused past its lease: it could not act meanwhile).
            late_s = max(0.0, self._clock.monotonic() - decision.lease_until)
            log.info(
                "leader_stepped_down",
                extra={
                    "token": decision.token,
                    "node": self.node,
                    "reason": decision.reason,
                    "t_wall": t_wall,
                    "lease_until_wall": t_wall - late_s,
                },
            )
            self._on_deposed(decision.reason)

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        self._error_log.failed(exc)
        self.client.failed(exc)  # (the next endpoint, after a few in a row)

    def _error_cleared(self) -> None:
        """etcd answered a call: an outage (if any) is over (only an answer clears it: a
        campaign step that made no call, e.g. a wait woken up, says nothing about etcd)."""
        self._retry.reset()
        self._error_log.cleared()
        self.client.answered()
