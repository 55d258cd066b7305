"""Leader duties and fenced writes with a real etcd: two Leadership instances in one process
(each over its own SWIM core, the membership shell stood in for by a few lines): a duty runs
only on the leader and is cancelled when it resigns; the deposed leader's fenced writes and
directives fail; directives reach subscribers on the leader itself.  Also a 3-member etcd with
the election's several endpoints: killing the etcd member it talks to does not stop the
election."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any

import pytest

from gossipd.config import Config, load_config
from gossipd.core.gossip_messages import Directive, Term
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig
from gossipd.leader import build_leadership
from gossipd.leader.duties import LeaderContext
from gossipd.leader.leadership import Leadership
from tests.etcd_cluster import EtcdCluster
from tests.helpers import wait_until_async


class _Gossip:
    """The parts of GossipService that Leadership uses, over a real SWIM core (no sockets)."""

    def __init__(self, node: str) -> None:
        self.core = SwimNode(
            SwimConfig.sim(), node=node, addr=f"tcp://{node}:1", rng=random.Random(1), now=0.0
        )
        self.leadership_listeners: list[Any] = []

    def _flush(self) -> None:
        for item in self.core.take_leadership():
            for listener in self.leadership_listeners:
                listener(item)

    def publish_term(self, term: Term) -> None:
        self.core.publish_term(time.time(), term)
        self._flush()

    def publish_directive(self, directive: Directive) -> bool:
        admitted = self.core.publish_directive(time.time(), directive)
        self._flush()
        return admitted

    def live_members(self) -> list[Any]:
        return []


def _config(endpoints: list[str], ttl_s: float = 2.0) -> Config:
    return load_config(
        None,
        environ={},
        overrides=[f"etcd.endpoints={json.dumps(endpoints)}", f"etcd.ttl_s={ttl_s}"],
    )


async def _run(leaderships: list[Leadership]) -> list[asyncio.Task[None]]:
    return [asyncio.create_task(x.run_forever()) for x in leaderships]


async def _stop(tasks: list[asyncio.Task[None]], *leaderships: Leadership) -> None:
    """``_run``'s tasks ended and ``leaderships`` closed (a test's ``finally``)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for x in leaderships:
        await x.close()


def test_duties_run_on_the_leader_only_and_fenced_writes_fail_after_it_resigns(etcd) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        config = _config(etcd.endpoints)
        a = build_leadership(config, node="a", gossip=_Gossip("a"))
        b = build_leadership(config, node="b", gossip=_Gossip("b"))
        assert a is not None and b is not None
        contexts: dict[str, LeaderContext] = {}
        writes: list[tuple[str, int]] = []
        got: list[tuple[str, object]] = []

        async def duty(ctx: LeaderContext) -> None:
            assert await ctx.fenced_put(f"{ctx.prefix}/owner", ctx.node)
            assert ctx.publish("hello", {"from": ctx.node, "token": ctx.token})
            contexts[ctx.node] = ctx  # (its write and directive are out: the test reads both)
            while True:
                writes.append((ctx.node, ctx.token))
                await asyncio.sleep(0.05)

        for x in (a, b):
            x.duties.register("writer", duty)
            x.directives.subscribe("hello", lambda d, body, x=x: got.append((x.node, body)))
        tasks = await _run([a, b])
        try:
            first = await wait_until_async(
                lambda: next((x for x in (a, b) if x.is_leader), None), 10, "a leader"
            )
            second = b if first is a else a
            await wait_until_async(lambda: first.node in contexts, 5, "the duty to start")
            assert first.duties.running == ["writer"] and second.duties.running == []
            await wait_until_async(lambda: got, 5, "the leader's directive")
            assert got == [(first.node, {"from": first.node, "token": first.token})]
            old = contexts[first.node]
            await first.resign()
            assert first.duties.running == [] and not first.is_leader
            await wait_until_async(lambda: second.is_leader, 1.0, "the other to lead")
            await wait_until_async(lambda: second.node in contexts, 5, "its duty to start")
            assert second.token > old.token
            # The deposed leader's context: its etcd writes are refused, its directives too.
            assert not await old.fenced_put(f"{old.prefix}/owner", "stale")
            assert not await old.fenced_delete(f"{old.prefix}/owner")
            assert not old.publish("hello", {"stale": True})
            value = await second.election.client.get(f"{old.prefix}/owner".encode())
            assert value is not None and value.value == second.node.encode()
            n = len([w for w in writes if w[0] == first.node])
            await asyncio.sleep(0.2)
            assert len([w for w in writes if w[0] == first.node]) == n, "cancelled"
            # The stale leader's directive, if it reached the new leader, is refused there.
            stale = Directive(leader=first.node, token=old.token, seq=99, kind="hello")
            assert not second._gossip.publish_directive(stale)
            assert second.fence.statistics().refused["stale_token"] == 1
            assert second.statistics()["directives_refused"]["stale_token"] == 1
        finally:
            await _stop(tasks, a, b)

    asyncio.run(main())


@pytest.mark.slow
def test_several_endpoints_survive_the_loss_of_the_etcd_member_in_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster = EtcdCluster(3, tmp_path).start_all()

    async def main() -> None:
        config = _config(cluster.endpoints, ttl_s=5.0)  # a 3-member etcd: TTL 2 s is too short
        a = build_leadership(config, node="a", gossip=_Gossip("a"))
        assert a is not None
        tasks = await _run([a])
        try:
            await wait_until_async(lambda: a.is_leader, 10, "a leader")
            token = a.token
            in_use = cluster.endpoints.index(a.election.client.endpoint)
            cluster.kill(in_use)  # (each client takes the endpoints in an order of its own)
            steps = a.election.core.step_downs
            await asyncio.sleep(7.0)  # past a TTL: keepalives went through another member
            assert a.is_leader and a.token == token, steps
            assert a.election.client.endpoint != cluster.endpoints[in_use]
        finally:
            await _stop(tasks, a)

    try:
        asyncio.run(main())
    finally:
        cluster.close()


def test_tls_with_a_client_certificate_and_several_endpoints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Several endpoints made one gRPC target ("ipv4:A:P,B:P"), and TLS checked the member's
    certificate against that whole string, which none can match: with TLS and two endpoints
    (OPERATIONS.md's example has three) no daemon ever connected.  The member is given twice
    here: each endpoint is its own target now, checked against its own name."""
    cluster = EtcdCluster(1, tmp_path, tls=True).start_all()

    async def main() -> None:
        tls = cluster.client_tls
        overrides = [f"etcd.{k}={json.dumps(v)}" for k, v in tls.items()]
        endpoints = cluster.endpoints * 2
        config = load_config(
            None,
            environ={},
            overrides=[f"etcd.endpoints={json.dumps(endpoints)}", *overrides],
        )
        a = build_leadership(config, node="a", gossip=_Gossip("a"))
        assert a is not None
        plain = build_leadership(_config(cluster.endpoints), node="p", gossip=_Gossip("p"))
        assert plain is not None
        tasks = await _run([a, plain])
        try:
            await wait_until_async(lambda: a.is_leader, 10, "the TLS client to lead")
            await asyncio.sleep(0.5)
            assert not plain.is_leader and plain.election.errors > 0, "no TLS: refused"
        finally:
            await _stop(tasks, a, plain)

    try:
        asyncio.run(main())
    finally:
        cluster.close()


def test_etcd_config_is_checked_with_clear_errors() -> None:
    from gossipd.errors import ConfigError

    for overrides, expected in (
        (['etcd.endpoints=["http://127.0.0.1:2379"]'], "expected HOST:PORT"),
        (['etcd.cert_file="c.crt"', 'etcd.ca_file="ca.crt"'], "set both"),
        (['etcd.cert_file="c.crt"', 'etcd.key_file="c.key"'], "ca_file: required"),
        (["etcd.ttl_s=0.5"], "ttl_s"),
    ):
        with pytest.raises(ConfigError, match=expected):
            load_config(None, environ={}, overrides=overrides)
    assert build_leadership(Config(), node="n", gossip=None) is None, "no etcd: no leadership"


def test_seeds_read_from_etcd_keep_only_addresses_a_socket_connects_to() -> None:
    """A seed value in etcd is written by the leader (from gossip, whose addresses are
    checked), but etcd is not gossip: what is read is checked again, so a bad value costs
    those seeds, never a send that raises."""
    from types import SimpleNamespace

    from gossipd.leader.seeding import read_seeds

    value = (
        b'{"seeds": ["n1@tcp://10.0.0.1:7946", "tcp://10.0.0.2:7946", "n3@garbage",'
        b' "tcp://10.0.0.4:7946\\n", "n5@tcp://10.0.0.5:99999"]}'
    )

    async def get(key: bytes) -> object:
        return SimpleNamespace(value=value)

    seeds = asyncio.run(read_seeds(get, "/gossipd/default/"))
    assert seeds == ["n1@tcp://10.0.0.1:7946", "tcp://10.0.0.2:7946"]


def test_a_failing_duty_restarts_later_and_later_and_only_a_bug_logs_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd's failures (a timeout, a refused connection) are one warning line each, with no
    traceback (the election already reports the outage once); any other exception is a bug
    and logged with its traceback.  The pause before a restart doubles (with jitter)."""
    from gossipd.leader import duties as duties_module
    from gossipd.leader.duties import LeaderContext, LeaderDuties

    monkeypatch.setattr(duties_module, "RESTART_S", 0.02)
    monkeypatch.setattr(duties_module, "RESTART_MAX_S", 0.5)
    caplog.set_level(logging.WARNING, logger="gossipd.leader.duties")
    calls: dict[str, list[float]] = {"etcd": [], "bug": []}

    def failing(name: str, exc: Exception) -> Any:
        async def duty(ctx: LeaderContext) -> None:
            calls[name].append(asyncio.get_running_loop().time())
            if len(calls[name]) < 4:
                raise exc
            await asyncio.sleep(10)

        return duty

    async def main() -> None:
        duties = LeaderDuties()
        duties.register("etcd", failing("etcd", TimeoutError("etcd slow")))
        duties.register("bug", failing("bug", ValueError("a bug of ours")))
        ctx = LeaderContext(token=1, node="n", client=None, prefix="/gossipd/t",
                            leader_key=b"k", request_timeout_s=1.0, _publish=lambda k, v: True,
                            _members=lambda: [])  # fmt: skip
        duties.start(ctx)
        for _ in range(200):
            if len(calls["etcd"]) >= 4 and len(calls["bug"]) >= 4:
                break
            await asyncio.sleep(0.02)
        duties.stop()

    asyncio.run(main())
    assert len(calls["etcd"]) == len(calls["bug"]) == 4
    gaps = [b - a for a, b in zip(calls["etcd"], calls["etcd"][1:], strict=False)]
    assert gaps[-1] > gaps[0]  # 0.01-0.02, 0.02-0.04, 0.04-0.08 s
    etcd_lines = [r for r in caplog.records if "duty etcd" in r.getMessage()]
    bug_lines = [r for r in caplog.records if "duty bug" in r.getMessage()]
    assert len(etcd_lines) == len(bug_lines) == 3
    assert all(r.exc_info is None for r in etcd_lines)
    assert all(r.exc_info is not None for r in bug_lines)


def _two(endpoints: list[str], ttl_s: float) -> tuple[Leadership, Leadership]:
    """Leaderships "a" and "b" on one etcd (neither running yet)."""
    config = _config(endpoints, ttl_s=ttl_s)
    a = build_leadership(config, node="a", gossip=_Gossip("a"))
    b = build_leadership(config, node="b", gossip=_Gossip("b"))
    assert a is not None and b is not None
    return a, b


def test_a_leader_whose_election_fails_revokes_its_lease_and_an_undrain_at_stop_stays_out(
    etcd,  # type: ignore[no-untyped-def]
) -> None:
    """A failure of the election's own code (a bug: the election starts again after 1 s)
    left its lease, and so its campaign key, to expire at the TTL: the next leader waited a
    whole TTL (8 s here).  Now the key goes at once.  And an undrain that came while the
    daemon stopped (resigned) had it campaign again."""

    async def main() -> None:
        a, b = _two(etcd.endpoints, ttl_s=8.0)
        tasks = await _run([a])
        try:
            await wait_until_async(lambda: a.is_leader, 10, "a to lead")
            tasks += await _run([b])
            await asyncio.sleep(0.5)  # (b's key is there, behind a's)
            assert not b.is_leader

            crashed: list[float] = []

            async def bug(*args: object, **kwargs: object) -> object:
                crashed.append(time.monotonic())
                raise RuntimeError("a bug in the keepalive")

            a.election.client.refresh_lease = bug  # type: ignore[method-assign]
            await wait_until_async(lambda: b.is_leader, 8, "b to lead")
            # (a's last keepalive was at most TTL/3 before the crash: its key would stay 5 s)
            assert time.monotonic() - crashed[0] < 3.0
            await b.resign()
            b.on_drain(False)  # an undrain while b stops
            await asyncio.sleep(0.3)
            assert b.election.resigned and not b.is_leader
        finally:
            await _stop(tasks, a, b)

    asyncio.run(main())


def test_a_follower_reads_the_candidates_when_its_predecessor_goes_not_every_ttl(
    etcd,  # type: ignore[no-untyped-def]
) -> None:
    """Each follower read the whole candidate list every TTL (a watch timeout): 1,000
    daemons at TTL 2 s made 500 reads a second of 1,000 keys each.  It now reads when the
    key it watches goes, or after about ten TTLs; and it still takes over at once."""

    async def main() -> None:
        a, b = _two(etcd.endpoints, ttl_s=2.0)
        tasks = await _run([a])
        try:
            await wait_until_async(lambda: a.is_leader, 10, "a to lead")
            reads: list[float] = []
            real = b.election._candidates

            async def counted() -> Any:
                reads.append(time.monotonic())
                return await real()

            b.election._candidates = counted  # type: ignore[method-assign]
            tasks += await _run([b])
            await wait_until_async(lambda: reads, 5, "b's first look")
            await asyncio.sleep(5.0)  # two and a half TTLs
            assert len(reads) == 1, reads
            await a.resign()
            await wait_until_async(lambda: b.is_leader, 1.0, "b to lead at once")
        finally:
            await _stop(tasks, a, b)

    asyncio.run(main())
