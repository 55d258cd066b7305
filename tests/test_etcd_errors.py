"""The election's etcd errors are logged once per kind per outage (docs/OPERATIONS.md): against
a loopback port where nothing listens, and against a real etcd stopped and started again
(then one "reachable again" line with the count).  Every failed call is still counted."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import pytest

from gossipd.config import EtcdConfig
from gossipd.leader.client import EtcdClient
from gossipd.leader.election import EtcdElection
from gossipd.leader.errorlog import EtcdErrorLog, error_kind
from tests.etcd_cluster import EtcdCluster

UNREACHABLE = "etcd unreachable or refusing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


async def _until(until: Callable[[], bool], limit_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not until() and loop.time() < end:
        await asyncio.sleep(0.05)
    assert until(), f"not within {limit_s} s: {what}"


async def _stop(task: asyncio.Future[None], election: EtcdElection) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await election.close()


def _election(endpoints: list[str], elected: list[int]) -> EtcdElection:
    config = EtcdConfig(endpoints=endpoints, ttl_s=2.0, request_timeout_s=0.3)
    return EtcdElection(
        config, node="n1", cluster="t", on_elected=elected.append, on_deposed=lambda r: None
    )


def test_refused_port_is_logged_once_per_kind_while_every_call_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gossipd.leader.election")
    election = _election([f"127.0.0.1:{_free_port()}"], [])

    async def main() -> None:
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: election.errors >= 8, 20.0, "8 failed calls")
        await _stop(task, election)

    asyncio.run(main())
    lines = _lines(caplog, UNREACHABLE)
    assert 1 <= len(lines) <= len(election._error_log.kinds), lines
    assert sum(election._error_log.kinds.values()) == election.errors >= 8


def test_etcd_stopped_then_started_logs_each_kind_once_then_the_count(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gossipd.leader.election")
    elected: list[int] = []
    election = _election(etcd.endpoints, elected)

    async def main() -> None:
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: len(elected) == 1, 20.0, "elected")
        etcd.stop(0)
        before = election.errors
        await _until(lambda: election.errors >= before + 10, 30.0, "10 failed calls")
        logs = (election._error_log, election._keepalive_error_log)  # one per loop
        kinds = sum(len(log.kinds) for log in logs)
        etcd.start(0)
        await _until(lambda: not any(log.failing for log in logs), 30.0, "etcd answers again")
        await _stop(task, election)
        lines = _lines(caplog, UNREACHABLE)
        assert 1 <= len(lines) <= kinds + 2, lines  # a kind may first appear after `kinds`
        # one line per loop that saw the outage (the campaign's, the lease keepalive's)
        again = _lines(caplog, "etcd reachable again after")
        assert 1 <= len(again) <= 2 and all("failed calls" in line for line in again), again

    asyncio.run(main())


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t


def test_a_long_outage_gets_one_summary_a_minute() -> None:
    clock = _Clock()
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.etcd.errorlog")
    logger.addHandler(Capture())
    logger.setLevel(logging.INFO)
    errors = EtcdErrorLog(logger, clock.monotonic)
    for _ in range(1500):  # 150 s at one failed call each 0.1 s, alternating kinds
        errors.failed(TimeoutError())
        errors.failed(OSError("connect refused to 127.0.0.1:1"))
        clock.t += 0.1
    assert len([r for r in records if r.startswith(UNREACHABLE)]) == 2
    summaries = [r for r in records if r.startswith("etcd still unreachable")]
    assert len(summaries) == 2 and "3000 failed calls" not in summaries[0]
    errors.cleared()
    assert records[-1].startswith("etcd reachable again after 150.0 s: 3000 failed calls")
    errors.cleared()
    assert records[-1].startswith("etcd reachable again after 150.0 s")  # said once
    assert not errors.failing and error_kind(TimeoutError()) == "TimeoutError"


def test_a_slow_but_healthy_etcd_keeps_its_leader(etcd: EtcdCluster) -> None:
    """Keepalives answered in 0.7 s (a slow disk, a far etcd; inside request_timeout_s): the
    next one leaves TTL/3 after the last was sent, not after its answer, so the lease stays
    valid and the leader stays (counted from the answer: 8 step-downs in 12 s, helper audit)."""
    elected: list[int] = []
    deposed: list[str] = []
    config = EtcdConfig(endpoints=etcd.endpoints, ttl_s=2.0, request_timeout_s=1.0)
    election = EtcdElection(
        config, node="n1", cluster="t", on_elected=elected.append, on_deposed=deposed.append
    )
    answer = election.client.refresh_lease

    async def slowly(lease_id: int) -> object:
        await asyncio.sleep(0.7)
        return await answer(lease_id)

    election.client.refresh_lease = slowly  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: len(elected) == 1, 20.0, "elected")
        await asyncio.sleep(6.0)  # three TTLs
        await _stop(task, election)

    asyncio.run(main())
    assert len(elected) == 1 and deposed[:-1] == [], (elected, deposed)
    assert election.errors == 0


def test_a_request_timeout_over_half_the_lease_is_refused() -> None:
    with pytest.raises(ValueError, match="request_timeout_s: at most half of ttl_s"):
        EtcdConfig(endpoints=["127.0.0.1:2379"], ttl_s=2.0, request_timeout_s=1.5)
    assert EtcdConfig(endpoints=["127.0.0.1:2379"], ttl_s=2.0, request_timeout_s=1.0)


def test_a_key_without_a_lease_under_the_election_prefix_does_not_stop_the_election(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A key put there by hand (no lease: no daemon's) was the lowest candidate for ever and
    nobody led; it is ignored, and said once."""
    caplog.set_level(logging.WARNING, logger="gossipd.leader.election")
    elected: list[int] = []
    election = _election(etcd.endpoints, elected)

    async def main() -> None:
        await election.client.connect()
        await election.client.put(election.election_prefix + b"zz-by-hand", b"x")
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: len(elected) == 1, 10.0, "elected beside the stray key")
        await asyncio.sleep(1.0)  # (it looks again every TTL: said once)
        await _stop(task, election)

    asyncio.run(main())
    assert election.stray_keys == 1
    assert len(_lines(caplog, "a key without a lease under the election prefix")) == 1


def test_an_unreachable_etcd_is_asked_less_and_less_often() -> None:
    """The campaign's pause after an error doubles from 0.1 s to 2 s, with jitter (it was
    0.1 s for ever: 60 calls in 6 s from every daemon, in step)."""
    election = _election([f"127.0.0.1:{_free_port()}"], [])

    async def main() -> None:
        task = asyncio.ensure_future(election.run_forever())
        await asyncio.sleep(6.0)
        await _stop(task, election)

    asyncio.run(main())
    # 0.05-0.1, 0.1-0.2, ... then 1-2 s each: 6 to 12 calls in 6 s
    assert 4 <= election.errors <= 14, election.errors


def test_Backoff_doubles_to_its_cap_with_jitter_and_starts_over_after_a_success() -> None:
    import random

    from gossipd.leader.backoff import Backoff

    backoff = Backoff(0.1, 2.0, random.Random(7))
    pauses = [backoff.next_s() for _ in range(10)]
    for n, pause in enumerate(pauses):
        ceiling = min(2.0, 0.1 * 2**n)
        assert ceiling / 2 <= pause <= ceiling
    assert len(set(pauses[6:])) == 4  # at the cap, still spread
    backoff.reset()
    assert 0.05 <= backoff.next_s() <= 0.1


def test_several_endpoints_one_not_resolving_still_elect_and_one_channel_is_built_at_a_time(
    etcd: EtcdCluster,
) -> None:
    """An endpoint that does not resolve (a DNS hiccup at boot) is left behind for the next
    after FAILOVER_AFTER failed calls, in whichever order this client took them; two
    connects at once build one channel, to the endpoint in use alone (gRPC resolves it:
    IPv6 literals and names alike)."""
    from gossipd.leader import client as etcd_client

    elected: list[int] = []
    election = _election(["etcd-gone.invalid:2379", *etcd.endpoints], elected)

    async def main() -> None:
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: len(elected) == 1, 15.0, "elected through the endpoint that resolves")
        await _stop(task, election)
        made: list[str] = []
        real = etcd_client.rpc.insecure_channel

        def counted(target: str, **kw: object) -> object:
            made.append(target)
            return real(target, **kw)

        etcd_client.rpc.insecure_channel = counted  # type: ignore[assignment]
        try:
            two = etcd_client.EtcdClient(
                EtcdConfig(endpoints=["[::1]:1", "localhost:2"]), shuffle=False
            )
            await asyncio.gather(two.connect(), two.connect())
            await two.close()
        finally:
            etcd_client.rpc.insecure_channel = real  # type: ignore[assignment]
        assert made == ["[::1]:1"]

    asyncio.run(main())


def test_an_etcd_member_without_a_leader_is_left_for_the_next(etcd: EtcdCluster) -> None:
    """An etcd member cut off from its quorum still serves gRPC and answers every request
    UNAVAILABLE ("etcdserver: no leader"): gRPC's pick_first moves on only when a connection
    fails, so every daemon (all given the same list) stayed on it and none could lead.  A
    gRPC server that answers so stands in for it here, first in the list."""
    import grpc

    class NoLeader(grpc.GenericRpcHandler):
        def service(self, details: object) -> object:
            async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")

            return grpc.unary_unary_rpc_method_handler(refuse)

    elected: list[int] = []

    async def main() -> EtcdElection:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([NoLeader()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        election = _election([f"127.0.0.1:{port}", *etcd.endpoints], elected)
        election.client = EtcdClient(election.config, shuffle=False)  # (no leader first)
        task = asyncio.ensure_future(election.run_forever())
        try:
            await _until(lambda: len(elected) == 1, 15.0, "elected through the next endpoint")
        finally:
            await _stop(task, election)
            await server.stop(0)
        return election

    election = asyncio.run(main())
    assert election.client.failovers >= 1 and election.client.endpoint == etcd.endpoints[0]


def test_a_stop_that_lands_while_a_watch_is_being_cancelled_ends_the_election(
    etcd: EtcdCluster,
) -> None:
    """The leader watches its own key for a TTL, then cancels the watch (a round trip to
    etcd) and looks again.  A stop (its task cancelled) that landed during that round trip
    was swallowed with the watch's own errors: the campaign went on, the task group waited
    for it, and the daemon's stop hung for ever (CI: this file's slow-etcd test, 300 s).
    The watch's cancel is made slow here so that the stop lands in it every time."""
    elected: list[int] = []
    election = _election(etcd.endpoints, elected)
    real_watch = election.client.watch
    cancelling = asyncio.Event()

    async def slow_watch(*args: object, **kwargs: object) -> object:
        watch = await real_watch(*args, **kwargs)  # type: ignore[arg-type]
        real_cancel = watch.cancel

        async def cancel() -> object:
            cancelling.set()
            await asyncio.sleep(0.5)
            return await real_cancel()

        watch.cancel = cancel  # type: ignore[method-assign]
        return watch

    election.client.watch = slow_watch  # type: ignore[method-assign]

    async def main() -> bool:
        task = asyncio.ensure_future(election.run_forever())
        await _until(lambda: len(elected) == 1, 20.0, "elected")
        await asyncio.wait_for(cancelling.wait(), 10.0)  # a TTL watched: now it cancels
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:  # (the old code: still campaigning; stop it for the teardown)
            election.resign_nowait()
            return False
        await election.close()
        return True

    assert asyncio.run(main()), "the election's task did not end within 5 s of its cancel"
