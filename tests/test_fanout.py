"""Fan-out with real daemons: owners, affinity, refusals, migration, drain and the journal."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import pytest

from gossipd.core.ring import Ring
from gossipd.tools.client import Client
from simulations.cluster import Cluster
from tests.helpers import RawProducer, scrape, wait_until, wait_until_async


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture
def make_cluster(tmp_path):  # type: ignore[no-untyped-def]
    made: list[Cluster] = []

    def make(n: int, *overrides: str) -> Cluster:
        c = Cluster(n, log_dir=str(tmp_path / f"c{len(made)}"), extra_overrides=list(overrides))
        made.append(c)
        c.start()
        c.wait_converged(timeout_s=20)
        c.wait_meta(timeout_s=20)
        return c

    yield make
    for c in made:
        c.stop()


async def submit_all(endpoints: list[str], keys: list[str], window: int = 10_000, **kw):  # type: ignore[no-untyped-def]
    async with Client(
        endpoints, resubmit_after_s=kw.pop("resubmit_after_s", 5.0), outstanding_max=window
    ) as client:
        handles = [await client.submit(f"prompt {i}", key=k, **kw) for i, k in enumerate(keys)]
        return [await h.result() for h in handles], client.statistics()


def test_tasks_run_on_their_keys_owner_with_affinity(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3)
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    keys = [f"session-{i % 300}" for i in range(3000)]
    entry = [cluster.daemons[0].endpoint, cluster.daemons[1].endpoint, cluster.daemons[2].endpoint]
    # A steady producer (100 tasks in flight), not an instant burst: under a burst bounded
    # loads rightly move keys off members that fall behind.
    results, _ = run(submit_all(entry, keys, window=100, max_tokens=2))
    assert all(r.ok for r in results)
    by_key: dict[str, Counter[str]] = defaultdict(Counter)
    for key, r in zip(keys, results, strict=True):
        by_key[key][r.node] += 1
    on_owner = sum(by_key[k][ring.owner(k)] for k in by_key)
    assert on_owner / len(keys) >= 0.999, (
        "a key's tasks run on its owner while membership is stable"
    )


def test_everyone_refusing_gives_a_clear_error_listing_attempts(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        2, "ingress.pending_max=1", "ingress.concurrency_max=1", "engine.token_delay_s=0.2"
    )
    keys = [f"k{i}" for i in range(12)]
    results, _ = run(submit_all([cluster.daemons[0].endpoint], keys, max_tokens=5, timeout_s=3))
    refused = [r for r in results if not r.ok and r.error.code in ("overloaded", "unavailable")]
    assert refused
    message = refused[0].error.message
    assert "attempts:" in message and "d00" in message and "d01" in message


def test_tasks_on_a_killed_owner_migrate_and_every_task_gets_one_result(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "engine.token_delay_s=0.05", 'metrics.bind="127.0.0.1:0"')
    victim = cluster.daemons[2]
    held = "gossipd_fanout_outstanding{member=d02}"

    async def main():  # type: ignore[no-untyped-def]
        async with Client([cluster.daemons[0].endpoint], resubmit_after_s=30) as client:
            handles = [
                await client.submit(f"p{i}", key=f"key-{i}", max_tokens=40, timeout_s=30)
                for i in range(60)
            ]

            def d02_holds_accepted_tasks() -> bool:
                # Accepted, not only sent: an accept waits up to ack_delay_s at the owner, and
                # a forward killed before its accept is retried (ack timeout), not migrated.
                m = scrape(cluster.daemons[0].metrics_port)
                routed = m.get("gossipd_fanout_forwarded_total", 0) + m.get(
                    "gossipd_fanout_local_total", 0
                )
                return routed >= 60 and m.get(held, 0) >= 5

            await wait_until_async(
                d02_holds_accepted_tasks, 10, "d00 to have tasks accepted by d02"
            )
            victim.kill()
            results = [await h.result() for h in handles]
            return results, client.statistics()

    results, stats = run(main())
    assert len({r.id for r in results}) == 60
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert all(r.node != "d02" for r in results), "what d02 held was re-run elsewhere"
    assert stats.resubmitted == 0, "migration, not the producer's resubmission, saved them"
    d0_events = cluster.daemons[0].events()
    assert any(e.get("msg") == "migrating tasks off a dead member" for e in d0_events)


def test_sigterm_hands_queued_tasks_to_other_members(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        2,
        "engine.token_delay_s=0.02",
        "ingress.concurrency_max=2",
        "lifecycle.shutdown_grace_s=5",
        'metrics.bind="127.0.0.1:0"',
    )
    leaver = cluster.daemons[1]

    async def main():  # type: ignore[no-untyped-def]
        async with Client([leaver.endpoint], resubmit_after_s=30) as client:
            ring = Ring({"d00": 1.0, "d01": 1.0})
            keys = [k for k in (f"k{i}" for i in range(400)) if ring.owner(k) == "d01"][:40]
            handles = [await client.submit("x", key=k, max_tokens=10, timeout_s=30) for k in keys]
            await wait_until_async(
                lambda: scrape(leaver.metrics_port).get("gossipd_tasks_pending", 0) >= 20,
                10,
                "the leaver to hold tasks, most of them queued",
            )
            leaver.terminate()
            return [await h.result() for h in handles]

    results = run(main())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert {r.node for r in results} == {"d00", "d01"}
    drained = next(e for e in leaver.events() if e.get("msg") == "drained")
    assert drained["handed_off"] > 0
    assert leaver.wait(10) == 0
    # What it handed off is the other member's now: a restart does not run it again.
    restarted = cluster.restart(1)
    assert not any(
        e.get("msg") == "re-running unfinished tasks from the journal" for e in restarted.events()
    )


def test_a_task_handed_over_by_a_stopping_owner_is_migrated_when_its_new_owner_dies(  # type: ignore[no-untyped-def]
    make_cluster,
) -> None:
    """Tasks entering at d00 are owned by d01; d01 stops (SIGTERM), hands its queued ones
    over, some to d02, and exits; then d02 is SIGKILLed before they finish.  d01 told d00
    where each went (Moved), so d00 migrates those off d02 when it dies.  Before, d00 still
    held them under d01, which had left (not died: nothing to migrate), and nobody else
    knew them: never answered."""
    cluster = make_cluster(
        3,
        "engine.token_delay_s=0.03",
        "ingress.concurrency_max=2",
        "lifecycle.shutdown_grace_s=5",
        'metrics.bind="127.0.0.1:0"',
    )
    entry, owner, taker = cluster.daemons
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    after = Ring({entry.name: 1.0, taker.name: 1.0})
    keys = [k for k in (f"k{i}" for i in range(2000)) if ring.owner(k) == owner.name]
    keys = [k for k in keys if after.owner(k) == taker.name][:16] + [
        k for k in keys if after.owner(k) == entry.name
    ][:8]

    def moved() -> float:
        return scrape(entry.metrics_port).get("gossipd_fanout_moved_total", 0.0)

    async def main():  # type: ignore[no-untyped-def]
        async with Client([entry.endpoint], resubmit_after_s=120) as client:
            handles = [await client.submit("x", key=k, max_tokens=30, timeout_s=25) for k in keys]
            await wait_until_async(
                lambda: scrape(owner.metrics_port).get("gossipd_tasks_pending", 0) >= 20,
                10,
                "the owner to hold the tasks, most of them queued",
            )
            owner.terminate()
            assert await asyncio.to_thread(owner.wait, 15) == 0  # gone: it migrates nothing
            taker.kill()  # (16 queued tasks of 0.9 s, 2 at a time: most not yet run)
            results = [await h.result() for h in handles]
            return results, client.statistics()

    results, stats = run(main())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert stats.resubmitted == 0  # the migration, not the producer, saved them
    assert moved() >= 8  # (those handed to d02, and to d00 itself)


def test_journal_reruns_unfinished_tasks_after_a_crash(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        1, "engine.token_delay_s=0.05", "ingress.concurrency_max=4", 'metrics.bind="127.0.0.1:0"'
    )
    daemon = cluster.daemons[0]

    async def main():  # type: ignore[no-untyped-def]
        async with Client([daemon.endpoint], resubmit_after_s=60) as client:
            handles = [await client.submit(f"j{i}", max_tokens=20, timeout_s=60) for i in range(16)]
            await wait_until_async(
                lambda: scrape(daemon.metrics_port).get("gossipd_tasks_pending", 0) == 16,
                10,
                "all 16 tasks admitted",
            )
            # Deliberate: past the journal's 10 ms fsync batch (no metric counts fsyncs).
            await asyncio.sleep(0.05)
            daemon.kill()
            daemon.wait(5)
            restarted = await asyncio.to_thread(cluster.restart, 0)
            results = [await h.result() for h in handles]
            return results, client.statistics(), restarted

    results, stats, restarted = run(main())
    assert all(r.ok for r in results)
    assert stats.resubmitted == 0, "the journal, not a resubmission, brought them back"
    assert any(
        e.get("msg") == "re-running unfinished tasks from the journal" for e in restarted.events()
    )


def test_a_restart_keeps_each_journaled_tasks_deadline(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """A task whose deadline passed while its daemon was down is answered deadline_exceeded
    after the restart without running; one with time left runs, timed from its first
    receipt (the journal keeps deadlines by the wall clock, not a fresh timeout)."""
    cluster = make_cluster(
        1, "engine.token_delay_s=0.05", "ingress.concurrency_max=1", 'metrics.bind="127.0.0.1:0"'
    )
    daemon = cluster.daemons[0]
    producer = RawProducer(daemon.endpoint)
    try:
        sent_at = time.monotonic()
        producer.send_task("long", params={"max_tokens": 10}, timeout_ms=60_000)  # 0.5 s
        producer.send_task("short", params={"max_tokens": 2}, timeout_ms=1_500)  # behind it
        wait_until(
            lambda: scrape(daemon.metrics_port).get("gossipd_tasks_pending", 0) == 2,
            10,
            "both admitted",
        )
        time.sleep(0.05)  # deliberate: past the journal's 10 ms fsync batch
        daemon.kill()
        daemon.wait(5)
        time.sleep(max(0.0, sent_at + 1.6 - time.monotonic()))  # "short" is past its deadline
        restarted_after_s = time.monotonic() - sent_at
        restarted = cluster.restart(0)
        results = {r["id"]: r for r in producer.results(2, timeout_s=20)}
    finally:
        producer.close()
    # With a fresh 1.5 s from the restart, "short" would have run after "long" and been ok.
    assert not results["short"]["ok"]
    assert results["short"]["error"]["code"] == "deadline_exceeded"
    assert "(0 tokens done)" in results["short"]["error"]["message"]
    assert results["long"]["ok"]
    assert results["long"]["timings"]["queued_ms"] >= restarted_after_s * 1000 - 100
    replayed = [
        e
        for e in restarted.events()
        if e.get("msg") == "re-running unfinished tasks from the journal"
    ]
    assert replayed and replayed[0]["tasks"] == 2 and replayed[0]["past_deadline"] == 1


def test_a_task_its_daemon_died_under_twice_is_answered_not_run_a_third_time(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """A task that kills its daemon (not only its engine) would be run again from the
    journal at every restart, killing it each time.  The journal counts the daemon's death
    under a running task (RUNNING records), and at engine.deaths_per_task_max (2) the
    restart answers it engine_error instead of running it a third time; the task that only
    waited behind it (queued, never given to the engine) has no death counted, and runs."""
    cluster = make_cluster(
        1, "engine.token_delay_s=0.05", "ingress.concurrency_max=1", 'metrics.bind="127.0.0.1:0"'
    )
    daemon = cluster.daemons[0]
    producer = RawProducer(daemon.endpoint)
    restarts = []
    try:
        producer.send_task("killer", params={"max_tokens": 200}, timeout_ms=120_000)  # 10 s
        producer.send_task("waiter", params={"max_tokens": 2}, timeout_ms=120_000)
        for _ in range(2):
            port = daemon.metrics_port
            wait_until(
                lambda port=port: scrape(port).get("gossipd_tasks_running", 0) == 1,  # type: ignore[misc]
                20,
                "the killer on the engine",
            )
            time.sleep(0.05)  # deliberate: past the journal's 10 ms fsync batch (a first run)
            daemon.kill()
            daemon.wait(5)
            daemon = cluster.restart(0)
            restarts.append(daemon)
        results = {r["id"]: r for r in producer.results(2, timeout_s=20)}
    finally:
        producer.close()
    killer = results["killer"]
    assert not killer["ok"] and killer["error"]["code"] == "engine_error", killer
    assert "2 engines or daemons went down while running this task" in killer["error"]["message"]
    assert results["waiter"]["ok"], results["waiter"]
    for restarted in restarts:
        replayed = [
            e
            for e in restarted.events()
            if e.get("msg") == "re-running unfinished tasks from the journal"
        ]
        assert replayed and replayed[-1]["tasks"] == 2 and replayed[-1]["died_under_it"] == 1
    assert scrape(daemon.metrics_port).get("gossipd_tasks_not_handed_on_total") == 1


def test_a_restarted_daemon_leaves_a_task_its_producer_sent_elsewhere_to_that_member(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    """d00 accepts a task and dies; its producer sends the task again to d01, which runs and
    answers it.  d00, restarted from its journal, asks d01 which of its unfinished tasks it
    holds before it runs them, and leaves that one out: the producer gets one answer, not
    two (before the question, d00 ran it again and answered a second time)."""
    # The question's waits long (it ends once the answers are in): a loaded CI machine once
    # took longer than the default 2 s + 1 s, and the task ran again; that is the fallback
    # by design, not what this test is about.
    cluster = make_cluster(
        2,
        "engine.token_delay_s=0.05",
        'metrics.bind="127.0.0.1:0"',
        "journal.replay_join_wait_s=10",
        "journal.replay_answer_wait_s=5",
    )
    a, b = cluster.daemons
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    key = next(f"k{i}" for i in range(100) if ring.owner(f"k{i}") == a.name)
    to_a, to_b = RawProducer(a.endpoint), RawProducer(b.endpoint)
    try:
        task = {"key": key, "params": {"max_tokens": 10}, "timeout_ms": 60_000}  # 0.5 s
        to_a.send_task("again", **task)
        wait_until(
            lambda: scrape(a.metrics_port).get("gossipd_tasks_pending", 0) == 1,
            10,
            "accepted by d00",
        )
        time.sleep(0.05)  # deliberate: past the journal's 10 ms fsync batch
        a.kill()
        a.wait(5)
        to_b.send_task("again", reply_to=to_a.reply_to, **task)  # the producer's resubmission
        first = to_a.results(1, timeout_s=20)
        assert first and first[0]["ok"] and first[0]["node"] == b.name
        restarted = cluster.restart(0)

        def replayed() -> dict | None:  # type: ignore[type-arg]
            return next(
                (
                    e
                    for e in restarted.events()
                    if e.get("msg") == "re-running unfinished tasks from the journal"
                ),
                None,
            )

        event = wait_until(replayed, 30, "the journal read again")  # (the waits: 15 s)
        # Deliberate: an absence is waited for, 1 s past the replay (a re-run is 0.5 s).
        later = [x for x in to_a.replies(timeout_s=1.5, quiet_s=1.0) if x["t"] == 3]
        metrics = scrape(restarted.metrics_port)
    finally:
        to_a.close()
        to_b.close()
    # On a failure, what the restart's question found (CI saw a second answer once, under
    # load, with the default waits of 2 s for a first member and 1 s for its answers).
    asked = [e for e in restarted.events() if e.get("msg", "").startswith("asked members")]
    assert later == [], ("answered once, by d01", asked, event)
    assert event["tasks"] == 1 and event["known_elsewhere"] == 1
    assert metrics["gossipd_journal_replayed_tasks_total{outcome=known_elsewhere}"] == 1
    assert metrics["gossipd_journal_replayed_tasks_total{outcome=run}"] == 0


def test_journaled_tasks_that_admission_refuses_on_restart_leave_the_journal(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """More unfinished tasks in the journal than ingress.pending_max: the ones refused at
    the restart are answered overloaded (their producers send them again) and leave the
    journal, instead of staying there to be replayed at every later start."""
    from gossipd.core.messages import Task
    from gossipd.ingress.journal import Journal

    producer = RawProducer("tcp://127.0.0.1:9")  # only its reply address is used here
    path = tmp_path / "d00.journal"
    journal = Journal(path)
    for i in range(6):
        task = Task(v=1, id=f"j{i}", prompt="p q", reply_to=producer.reply_to)
        journal.accept(task, int(time.time() * 1000) + 60_000)
    journal.close()
    cluster = Cluster(
        1,
        log_dir=str(tmp_path),
        extra_overrides=[
            f'journal.path="{path}"',
            "ingress.pending_max=4",
            "ingress.concurrency_max=1",
            "engine.token_delay_s=0.05",
        ],
    )
    try:
        cluster.start()
        answers = {r["id"]: r for r in producer.results(6, timeout_s=20)}
        refused = sorted(
            i for i, r in answers.items() if r["error"] and r["error"]["code"] == "overloaded"
        )
        assert len(refused) == 2 and all(answers[f"j{i}"]["ok"] for i in range(4))
        cluster.daemons[0].stop()
    finally:
        cluster.stop()
        producer.close()
    assert Journal(path).replay() == [], "nothing left to run again"


def test_a_task_for_a_model_nobody_serves_is_refused_as_unavailable(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2)

    async def main():  # type: ignore[no-untyped-def]
        async with Client([cluster.daemons[0].endpoint]) as client:
            served = await client.run("x", max_tokens=2, model="echo")
            # unavailable means "later": the Client retries it until the deadline, then
            # gives the last answer (a member serving the model could have come).
            started = time.monotonic()
            missing = await client.run("x", max_tokens=2, model="llama-70b", timeout_s=1.0)
            stats = client.statistics()
            return served, missing, time.monotonic() - started, stats

    served, missing, took_s, stats = run(main())
    assert served.ok
    assert (
        not missing.ok
        and missing.error.code == "unavailable"
        and "llama-70b" in missing.error.message
    )
    assert stats.retried >= 1 and took_s < 2.0


def test_a_burst_of_large_forwarded_tasks_is_split_under_the_message_limit(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        2, "ingress.message_bytes_max=1048576", "fanout.message_bytes_max=1048576"
    )
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [k for k in (f"big-{i}" for i in range(200)) if ring.owner(k) == "d01"][:30]
    prompt = "word " * 40_000  # 200 KB: 30 of them are 6 MB, far over one message's limit

    async def main():  # type: ignore[no-untyped-def]
        async with Client([cluster.daemons[0].endpoint]) as client:
            handles = [await client.submit(prompt, key=k, max_tokens=2, timeout_s=30) for k in keys]
            return [await h.result() for h in handles]

    results = run(main())
    assert all(r.ok and r.node == "d01" for r in results), [r.error for r in results if not r.ok][
        :2
    ]


def test_a_silent_owner_is_passed_over_after_the_ack_timeout(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2, "fanout.ack_timeout_s=0.3", 'metrics.bind="127.0.0.1:0"')
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [k for k in (f"s-{i}" for i in range(100)) if ring.owner(k) == "d01"][:10]
    stalled = cluster.daemons[1]
    stalled.pause()
    try:
        results, _ = run(
            submit_all([cluster.daemons[0].endpoint], keys, max_tokens=2, timeout_s=10)
        )
    finally:
        stalled.resume()
    assert all(r.ok and r.node == "d00" for r in results), "the next member took them"
    # Each went to d01 first, got no ForwardReply within the ack timeout, and was withdrawn
    # from it before d00 ran it: counted per task (what happened, not how long it took).
    metrics = scrape(cluster.daemons[0].metrics_port)
    assert metrics["gossipd_fanout_attempts_failed_total"] >= len(keys)
    assert metrics["gossipd_fanout_withdrawn_total"] >= len(keys)


LONG_TASKS = 10  # each 100 tokens at 50 ms: 5 s


def _start_long_tasks_on_d01(cluster: Cluster, producer: RawProducer) -> None:
    """Send LONG_TASKS tasks keyed to d01 through d00; return once d01 runs them all and d00
    has their accepts."""
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [k for k in (f"l-{i}" for i in range(100)) if ring.owner(k) == "d01"][:LONG_TASKS]
    for i, key in enumerate(keys):
        producer.send_task(f"t{i}", "a b c d", key=key, params={"max_tokens": 100})
    entry, owner = cluster.daemons
    wait_for(
        lambda: scrape(owner.metrics_port).get("gossipd_tasks_pending") == LONG_TASKS,
        10,
        "the owner to run them",
    )
    # ...and its accepts (held up to fanout.ack_delay_s) to reach the entry: a fault before
    # that is a silent owner (ack timeout, next member), not an owner holding accepted tasks.
    wait_for(
        lambda: scrape(entry.metrics_port).get("gossipd_fanout_forwarded_total") == LONG_TASKS,
        10,
        "the entry to get the owner's accepts",
    )


def _wait_for_migration(entry) -> None:  # type: ignore[no-untyped-def]
    wait_for(
        lambda: any(e.get("msg") == "migrating tasks off a dead member" for e in entry.events()),
        30,
        "the entry to declare the owner dead and migrate its tasks",
    )


def _assert_one_result_each_from(entry, replies: list[dict], owner) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Every task answered once, by the entry that took the migrated copies; the owner
    withdrew every copy it held (at the forwarder's Withdraw, or, restarted, when the entry
    answered its ReplayQuery that it holds them) and holds nothing."""
    results = [r for r in replies if r["t"] == 3]
    assert sorted(r["id"] for r in results) == sorted(f"t{i}" for i in range(LONG_TASKS))
    assert all(r["ok"] and r["node"] == entry.name for r in results), results[:3]
    metrics = scrape(owner.metrics_port)
    by_peers = metrics.get("gossipd_fanout_withdrawn_by_peers_total")
    held = metrics.get("gossipd_journal_replayed_tasks_total{outcome=known_elsewhere}", 0)
    assert by_peers + held == LONG_TASKS, (by_peers, held)
    assert metrics.get("gossipd_task_results_total{outcome=withdrawn}") == LONG_TASKS
    assert metrics.get("gossipd_tasks_pending") == 0


def test_a_falsely_dead_owner_drops_the_tasks_that_migrated_off_it(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """An owner stopped long enough to be declared dead, then resumed (a stall, not a
    crash): its running tasks migrate, and the forwarder withdraws its copies, so that the
    owner aborts them instead of running them beside the migrated ones and answering too."""
    cluster = make_cluster(2, "engine.token_delay_s=0.05", 'metrics.bind="127.0.0.1:0"')
    entry, stalled = cluster.daemons
    producer = RawProducer(entry.endpoint)
    try:
        _start_long_tasks_on_d01(cluster, producer)
        stalled.pause()
        try:
            _wait_for_migration(entry)
        finally:
            stalled.resume()
        got = producer.results(LONG_TASKS, timeout_s=30)
        late = producer.replies(timeout_s=3.0, quiet_s=1.5)
    finally:
        producer.close()
    _assert_one_result_each_from(entry, [*got, *late], stalled)


def test_a_restarted_owner_drops_the_journaled_tasks_that_migrated_off_it(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """An owner killed with forwarded tasks running: the forwarder migrates them when it
    declares the owner dead.  Restarted, the owner finds them unfinished in its journal and
    runs them again; the forwarder's Withdraws (queued for the owner's address), or its
    answer to the owner's ReplayQuery, make it drop them instead of running them to the end
    a second time and answering too."""
    cluster = make_cluster(2, "engine.token_delay_s=0.05", 'metrics.bind="127.0.0.1:0"')
    entry, owner = cluster.daemons
    producer = RawProducer(entry.endpoint)
    try:
        _start_long_tasks_on_d01(cluster, producer)
        time.sleep(0.1)  # past the journal's 10 ms fsync batch
        owner.kill()
        owner.wait(5)
        _wait_for_migration(entry)
        restarted = cluster.restart(1)
        got = producer.results(LONG_TASKS, timeout_s=30)
        late = producer.replies(timeout_s=8.0, quiet_s=6.0)  # past a replayed task's 5 s
    finally:
        producer.close()
    replayed = [
        e
        for e in restarted.events()
        if e.get("msg") == "re-running unfinished tasks from the journal"
    ]
    assert replayed and replayed[0]["tasks"] == LONG_TASKS
    _assert_one_result_each_from(entry, [*got, *late], restarted)


def test_an_owner_restarted_before_it_is_declared_dead_reports_its_replayed_tasks_done(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    """Killed and restarted faster than failure detection: nobody migrates its tasks, so it
    re-runs them from its journal and answers them; its forwarder, whose connection to it is
    a new one, still gets their TaskDones (sent by name) and stops answering for them (else
    they would count against the owner's load, and migrate again at its next death)."""
    cluster = make_cluster(
        2,
        "engine.token_delay_s=0.05",
        'metrics.bind="127.0.0.1:0"',
        "gossip.swim.suspicion_floor_s=120",  # no death declared during the test
        "gossip.swim.crash_by_refusal=false",  # (a refused port would declare it at once)
    )
    entry, owner = cluster.daemons
    producer = RawProducer(entry.endpoint)
    outstanding = "gossipd_fanout_outstanding{member=d01}"
    try:
        _start_long_tasks_on_d01(cluster, producer)
        assert scrape(entry.metrics_port).get(outstanding) == LONG_TASKS
        time.sleep(0.1)  # past the journal's 10 ms fsync batch
        owner.kill()
        owner.wait(5)
        restarted = cluster.restart(1)
        got = producer.results(LONG_TASKS, timeout_s=30)
        late = producer.replies(timeout_s=3.0, quiet_s=1.5)
    finally:
        producer.close()
    results = [r for r in [*got, *late] if r["t"] == 3]
    assert sorted(r["id"] for r in results) == sorted(f"t{i}" for i in range(LONG_TASKS))
    assert all(r["ok"] and r["node"] == restarted.name for r in results), results[:3]
    assert not any(e.get("msg") == "migrating tasks off a dead member" for e in entry.events())
    wait_for(
        lambda: scrape(entry.metrics_port).get(outstanding, 0.0) == 0.0,
        5,
        "the forwarder to stop answering for the tasks the restarted owner finished",
    )


def test_a_restarted_owner_does_not_run_again_the_tasks_it_answered_before_it_died(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    """An owner killed after it answered its forwarded tasks, before its journal wrote their
    DONE records (its batch, 3 s here instead of 10 ms to make the window plain), finds them
    unfinished on restart.  Their forwarder had their TaskDones: its answer to the owner's
    ReplayQuery names them, and the owner drops them instead of running them again and
    answering each a second time."""
    cluster = make_cluster(
        2,
        "engine.token_delay_s=0.05",
        'metrics.bind="127.0.0.1:0"',
        "journal.fsync_interval_s=3.0",
    )
    entry, owner = cluster.daemons
    producer = RawProducer(entry.endpoint)
    outstanding = "gossipd_fanout_outstanding{member=d01}"
    try:
        # Accepted at t0, their ACCEPT records written at t0 + 3 s; they end at t0 + 5 s
        # and their DONE records would be written at t0 + 8 s.
        _start_long_tasks_on_d01(cluster, producer)
        got = producer.results(LONG_TASKS, timeout_s=30)
        wait_for(
            lambda: scrape(entry.metrics_port).get(outstanding, 0.0) == 0.0,
            2,
            "the forwarder to get the owner's TaskDones",
        )
        owner.kill()
        owner.wait(5)
        restarted = cluster.restart(1)
        wait_for(
            lambda: any(
                e.get("msg") == "re-running unfinished tasks from the journal"
                and e.get("forwarded_only") is False
                for e in restarted.events()
            ),
            15,
            "the restarted owner to ask about its journaled tasks",
        )
        late = producer.replies(timeout_s=3.0, quiet_s=1.5)
    finally:
        producer.close()
    assert sorted(r["id"] for r in got) == sorted(f"t{i}" for i in range(LONG_TASKS))
    assert [r for r in late if r["t"] == 3] == []  # no second answer
    replayed = [
        e
        for e in restarted.events()
        if e.get("msg") == "re-running unfinished tasks from the journal"
        and e.get("forwarded_only") is False
    ]
    assert replayed[0]["tasks"] == LONG_TASKS, replayed  # the DONE records were lost
    assert replayed[0]["known_elsewhere"] == LONG_TASKS and replayed[0]["run"] == 0, replayed
    metrics = scrape(restarted.metrics_port)
    assert metrics.get("gossipd_journal_replayed_tasks_total{outcome=run}") == 0


def test_the_owner_reports_a_task_done_right_after_its_result(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """The owner's TaskDone follows the task's Result at once, instead of waiting like an
    accept (``fanout.ack_delay_s``, 0.5 s here to make any hold-back plain) to share a
    message: the forwarder forgets the task within milliseconds of the producer getting the
    Result.  In between, an owner killed at the wrong moment has its task migrated and
    answered a second time (found at 5 ms with 20-30 ms of loop lag under load)."""
    cluster = make_cluster(
        2,
        "engine.token_delay_s=0.05",
        "fanout.ack_timeout_s=5",
        "fanout.ack_delay_s=0.5",
        'metrics.bind="127.0.0.1:0"',
    )
    entry = cluster.daemons[0]
    ring = Ring({"d00": 1.0, "d01": 1.0})
    keys = [k for k in (f"done-{i}" for i in range(100)) if ring.owner(k) == "d01"][:3]
    outstanding = "gossipd_fanout_outstanding{member=d01}"
    producer = RawProducer(entry.endpoint)
    gaps_s = []
    try:
        for i, key in enumerate(keys):  # 20 tokens at 50 ms: 1 s, past the accept's 0.5 s
            producer.send_task(f"t{i}", "a b c d", key=key, params={"max_tokens": 20})
            [result] = producer.results(1, timeout_s=10)
            got_at = time.monotonic()
            assert result["ok"] and result["node"] == "d01", result
            while scrape(entry.metrics_port).get(outstanding, 0.0) != 0.0:
                assert time.monotonic() - got_at < 5, "the forwarder never got the TaskDone"
            gaps_s.append(time.monotonic() - got_at)
    finally:
        producer.close()
    print("Result to TaskDone at the forwarder (s):", gaps_s)
    assert max(gaps_s) < 0.2, f"Result to TaskDone at the forwarder: {gaps_s} s"


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    wait_until(predicate, timeout_s, what)


def _group_spread(cluster: Cluster) -> dict[int, Counter[str]]:
    """Keyless prompts in 6 groups, each group sharing a 300-character prefix, pushed to all
    three entry points; which members ran each group."""
    systems = [f"system prompt {g}: " + ("you are a careful assistant " * 12) for g in range(6)]
    prompts = [(i % 6, systems[i % 6] + f" question {i}") for i in range(240)]
    endpoints = [d.endpoint for d in cluster.daemons]

    async def main() -> list[object]:
        async with Client(endpoints, outstanding_max=30) as client:
            handles = [await client.submit(p, max_tokens=1) for _, p in prompts]
            return [await h.result() for h in handles]

    results = run(main())
    assert all(r.ok for r in results)  # type: ignore[attr-defined]
    spread: dict[int, Counter[str]] = defaultdict(Counter)
    for (group, _), r in zip(prompts, results, strict=True):
        spread[group][r.node] += 1  # type: ignore[attr-defined]
    return spread


def test_keyless_prompts_sharing_a_prefix_meet_on_one_member(make_cluster) -> None:  # type: ignore[no-untyped-def]
    spread = _group_spread(make_cluster(3))  # fanout.policy = "prefix", the default
    on_one = sum(c.most_common(1)[0][1] for c in spread.values())
    assert on_one / 240 >= 0.95, spread
    assert len({c.most_common(1)[0][0] for c in spread.values()}) >= 2, "groups spread out"


def test_key_hashing_scatters_a_shared_prefix(make_cluster) -> None:  # type: ignore[no-untyped-def]
    spread = _group_spread(make_cluster(3, "fanout.policy=key"))
    # Keyless tasks hashed by id: each group over the members at random ("prefix" puts
    # >= 0.95 of each on one member; a 40-task group keeps 0.75 on one by chance ~1e-5).
    assert all(len(c) >= 2 for c in spread.values()), spread
    on_one = sum(c.most_common(1)[0][1] for c in spread.values())
    assert on_one / 240 <= 0.75, spread


def test_round_robin_sends_an_entrys_tasks_to_every_member_in_turn(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """The n-th keyless task an entry daemon takes goes to member n mod N, whatever its
    prompt.  (Not "every prefix group scattered": with several entries, which entry the
    client picks can fall in step with the groups, so a group may gather; CI saw 22/17/1.)"""
    cluster = make_cluster(3, "fanout.policy=round_robin")
    prompt = "system prompt: " + "you are a careful assistant " * 12

    async def main() -> list[str]:
        nodes = []
        async with Client([cluster.daemons[0].endpoint]) as client:
            for i in range(12):  # one at a time: the entry takes them in this order
                handle = await client.submit(prompt + f" question {i}", max_tokens=1)
                nodes.append((await handle.result()).node)  # type: ignore[attr-defined]
        return nodes

    nodes = run(main())
    assert all(len(set(nodes[i : i + 3])) == 3 for i in range(len(nodes) - 2)), nodes


def test_a_cancel_reaches_the_owner_of_a_forwarded_task(make_cluster) -> None:  # type: ignore[no-untyped-def]
    from gossipd.ops.scrape import scrape

    cluster = make_cluster(2, "engine.token_delay_s=0.05", 'metrics.bind="127.0.0.1:0"')
    entry, owner = cluster.daemons
    ring = Ring({d.name: 1.0 for d in cluster.daemons})
    keys = [k for k in (f"c{i}" for i in range(100)) if ring.owner(k) == owner.name][:5]

    async def main() -> list[object]:
        async with Client([entry.endpoint]) as client:
            handles = [
                await client.submit("slow words", key=k, max_tokens=200, stream=True) for k in keys
            ]
            for h in handles:  # each is generating on the owner
                await asyncio.wait_for(h.deltas().__anext__(), 10)
            for h in handles:
                assert await client.cancel(h.id)
            return [await asyncio.wait_for(h.result(), 10) for h in handles]

    results = run(main())
    assert {r.error.code for r in results} == {"cancelled"}  # type: ignore[attr-defined]
    assert {r.node for r in results} == {owner.name}  # type: ignore[attr-defined]
    assert scrape(entry.metrics_port)["gossipd_cancels_total{outcome=forwarded}"] == len(keys)
    assert scrape(owner.metrics_port)["gossipd_cancels_total{outcome=here}"] == len(keys)
    assert scrape(owner.metrics_port)["gossipd_engine_running_requests"] == 0
