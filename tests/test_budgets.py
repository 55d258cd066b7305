"""Memory bounded by bytes (gossipd/core/budgets.py): the pending tasks, the results cache,
the forwarder's ledger and the reply queues, in the cores and in a real daemon's RSS."""

from __future__ import annotations

import asyncio
import sys
import time
import tracemalloc

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gossipd.core.admission import Admission, Verdict
from gossipd.core.budgets import (
    RESULT_OVERHEAD_BYTES,
    TASK_OVERHEAD_BYTES,
    result_bytes,
    task_bytes,
)
from gossipd.core.codec import decode_task
from gossipd.core.forwarded import ForwardedLedger
from gossipd.core.lifecycle import TaskBook
from gossipd.core.messages import Result, Task
from gossipd.core.ring import LoadCounts
from gossipd.replysender import ReplySender
from gossipd.sockets import SocketPool
from gossipd.tools.launcher import free_tcp_port
from gossipd.zmqloop import SocketReader
from tests.helpers import RawProducer, run_with_context, scrape, wait_until_async

IDS = st.sampled_from([f"t{i}" for i in range(10)])
SIZES = st.integers(0, 400)


def ok(task_id: str, chars: int = 0) -> Result:
    return Result(id=task_id, ok=True, text="r" * chars)


def task(task_id: str, prompt: str = "p") -> Task:
    return Task(v=1, id=task_id, prompt=prompt, reply_to="tcp://127.0.0.1:9")


class ByteBudgetMachine(RuleBasedStateMachine):
    """Model: pending ids with their sizes, an LRU of (id, result bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending_bytes_max = 1000
        self.results_bytes_max = 3 * RESULT_OVERHEAD_BYTES + 600
        self.adm = Admission(
            pending_max=100,
            results_max=100,
            pending_bytes_max=self.pending_bytes_max,
            results_bytes_max=self.results_bytes_max,
        )
        self.pending: dict[str, int] = {}
        self.done: list[tuple[str, int]] = []  # oldest first
        self.evicted_bytes = 0

    @rule(task_id=IDS, size=SIZES)
    def offer(self, task_id: str, size: int) -> None:
        verdict, _ = self.adm.offer(task_id, size_bytes=size)
        used = sum(self.pending.values())
        if task_id in self.pending:
            assert verdict is Verdict.DUPLICATE_PENDING
        elif any(i == task_id for i, _ in self.done):
            assert verdict is Verdict.DUPLICATE_DONE
            entry = next(e for e in self.done if e[0] == task_id)
            self.done.remove(entry)
            self.done.append(entry)
        elif used and used + size > self.pending_bytes_max:
            assert verdict is Verdict.OVERLOADED and self.adm.refused_bytes
        else:
            assert verdict is Verdict.ADMIT and not self.adm.refused_bytes
            self.pending[task_id] = size

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), chars=st.integers(0, 2000))
    def finish(self, data: st.DataObject, chars: int) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.pending)))
        result = ok(task_id, chars)
        self.adm.finish(task_id, result)
        del self.pending[task_id]
        size = result_bytes(result)
        if size > self.results_bytes_max:
            self.evicted_bytes += 1
            return
        self.done.append((task_id, size))
        while sum(s for _, s in self.done) > self.results_bytes_max:
            self.done.pop(0)
            self.evicted_bytes += 1

    @invariant()
    def accounted_and_bounded(self) -> None:
        stats = self.adm.statistics()
        assert stats.pending_bytes == sum(self.pending.values())
        # The budget, or one lone task over it.
        assert stats.pending_bytes <= self.pending_bytes_max or len(self.pending) == 1
        assert stats.cached_results_bytes == sum(s for _, s in self.done)
        assert stats.cached_results_bytes <= self.results_bytes_max
        assert stats.cached_results == len(self.done)
        assert stats.results_evicted_bytes == self.evicted_bytes
        assert stats.results_evicted_count == 0


TestByteBudgetMachine = ByteBudgetMachine.TestCase


def test_Admission_refuses_by_pending_bytes_and_says_so_then_admits_when_room_frees() -> None:
    adm = Admission(pending_max=10, results_max=10, pending_bytes_max=100)
    assert adm.offer("a", size_bytes=60)[0] is Verdict.ADMIT
    assert adm.offer("b", size_bytes=60)[0] is Verdict.OVERLOADED and adm.refused_bytes
    assert adm.offer("c", size_bytes=40)[0] is Verdict.ADMIT and not adm.refused_bytes
    adm.finish("a", ok("a"))
    assert adm.offer("b", size_bytes=60)[0] is Verdict.ADMIT
    stats = adm.statistics()
    assert stats.pending_bytes == 100 and stats.overloaded_pending_bytes == 1


def test_Admission_a_lone_task_larger_than_the_budget_still_runs() -> None:
    adm = Admission(pending_max=10, results_max=10, pending_bytes_max=100)
    assert adm.offer("big", size_bytes=500)[0] is Verdict.ADMIT
    assert adm.offer("small", size_bytes=1)[0] is Verdict.OVERLOADED


def test_Admission_results_cache_forgets_oldest_by_bytes_and_counts_by_reason() -> None:
    budget = 2 * result_bytes(ok("x", 1000))
    adm = Admission(pending_max=10, results_max=3, results_bytes_max=budget)
    for i in range(4):
        adm.offer(f"s{i}")
        adm.finish(f"s{i}", ok(f"s{i}"))  # small: the count bound evicts s0
    stats = adm.statistics()
    assert stats.results_evicted_count == 1 and stats.results_evicted_bytes == 0
    adm.offer("big")
    adm.finish("big", ok("big", 10 * budget))  # larger than the whole budget: not kept
    assert adm.statistics().results_evicted_bytes == 1
    assert adm.offer("big")[0] is Verdict.ADMIT  # forgotten: it runs again
    adm.finish("big", ok("big", 1000))
    adm.offer("big2")
    adm.finish("big2", ok("big2", 1000))  # two big ones fill the budget: the small ones go
    stats = adm.statistics()
    assert stats.cached_results == 2 and stats.cached_results_bytes == budget
    assert stats.results_evicted_bytes >= 2
    assert stats.results_evicted_count + stats.results_evicted_bytes == 5
    assert adm.offer("s3")[0] is Verdict.ADMIT and adm.offer("big")[0] is Verdict.DUPLICATE_DONE


def test_TaskBook_counts_each_task_by_its_prompt() -> None:
    book = TaskBook(Admission(pending_max=10, results_max=10, pending_bytes_max=1 << 20))
    book.offer(task("a", "x" * 1000), 0.0, 0.0)
    book.offer(task("b", "\N{SNOWMAN}" * 1000), 0.0, 0.0)  # 2 bytes a character in memory
    pending = book.admission.pending_bytes
    strings = 2 * (len("tcp://127.0.0.1:9") + 1)  # (each task's id and reply_to, ASCII)
    assert pending == 2 * TASK_OVERHEAD_BYTES + strings + sys.getsizeof("x" * 1000) + sys.getsizeof(
        "\N{SNOWMAN}" * 1000
    )
    assert 2 * TASK_OVERHEAD_BYTES + 3000 <= pending - strings < 2 * TASK_OVERHEAD_BYTES + 3200


def test_a_tasks_other_strings_count_at_their_width_in_memory() -> None:
    """Beside its prompt a task holds up to about 6 KB of strings (id, key, reply_to, model,
    traceparent, stop: 4-byte characters at their bounds); they counted nothing, so a
    task measured 6,744 bytes held against 749 counted (a review's reproduction)."""
    from gossipd.core.sampling import SamplingParams

    wide = "\N{GRINNING FACE}"  # 4 bytes a character in memory
    big = Task(v=1, id=wide * 128, key=wide * 256, prompt="", reply_to="tcp://h:1",
               model=wide * 256, traceparent=wide * 128,
               params=SamplingParams(stop=[wide * 64] * 8))  # fmt: skip
    frames = [msgspec.msgpack.encode(msgspec.structs.replace(big, id=f"{i:04d}" + wide * 124))
              for i in range(500)]  # fmt: skip
    book = TaskBook(Admission(pending_max=10**6, results_max=10**6))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for frame in frames:
        book.offer(decode_task(frame, bytes_max=1 << 20), 0.0, 0.0)
    held_each = (tracemalloc.get_traced_memory()[0] - before) / len(frames)
    tracemalloc.stop()
    counted_each = book.admission.pending_bytes / len(frames)
    assert held_each / 1.5 <= counted_each <= held_each * 1.5, (held_each, counted_each)


def test_budgets_fixed_parts_are_close_to_what_tracemalloc_measures() -> None:
    """The fixed part of task_bytes / result_bytes is within 2x of the memory a small task
    decoded from the wire and admitted (a TaskBook) or a small Result really takes."""
    frames = [
        msgpack.packb(
            {"v": 1, "t": 1, "id": f"task-{i:08d}", "prompt": "", "reply_to": "tcp://h:1"}
        )
        for i in range(2000)
    ]
    book = TaskBook(Admission(pending_max=10**6, results_max=10**6))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for frame in frames:
        book.offer(decode_task(frame, bytes_max=1 << 20), 0.0, 0.0)
    task_each = (tracemalloc.get_traced_memory()[0] - before) / len(frames)
    before = tracemalloc.get_traced_memory()[0]
    results = {f"r{i:08d}": Result(id=f"r{i:08d}", ok=True, text="") for i in range(2000)}
    result_each = (tracemalloc.get_traced_memory()[0] - before) / len(results)
    tracemalloc.stop()
    assert task_each / 2 <= TASK_OVERHEAD_BYTES <= task_each * 2, task_each
    assert result_each / 2 <= RESULT_OVERHEAD_BYTES <= result_each * 2, result_each


def test_logprob_bytes_are_close_to_what_decoded_log_probabilities_take() -> None:
    """result_bytes' share for log probabilities is within 2x of what a Result's decoded
    from a frame (as an entry holds it) takes: per token, and per top entry."""
    from gossipd.core.budgets import LOGPROB_BYTES, LOGPROB_TOP_BYTES
    from gossipd.core.codec import decode_reply
    from gossipd.core.messages import encode
    from gossipd.core.sampling import TokenLogprob

    def frame(top: int) -> bytes:
        logprobs = [
            TokenLogprob(f" w{i}", -1.5 - i, tuple((f" t{i}{j}", -2.0 - j) for j in range(top)))
            for i in range(2000)
        ]
        return encode(Result(id="r", ok=True, text="", logprobs=logprobs))

    each = []
    for top in (0, 5):
        data = frame(top)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        kept = decode_reply(data)
        each.append((tracemalloc.get_traced_memory()[0] - before) / 2000)
        tracemalloc.stop()
        assert kept.logprobs is not None and result_bytes(kept) > 2000 * LOGPROB_BYTES
    per_token, per_top = each[0], (each[1] - each[0]) / 5
    assert per_token / 2 <= LOGPROB_BYTES <= per_token * 2, per_token
    assert per_top / 2 <= LOGPROB_TOP_BYTES <= per_top * 2, per_top


def test_a_task_asking_logprobs_counts_the_entries_it_may_gather() -> None:
    from gossipd.core.budgets import LOGPROB_BYTES, LOGPROB_TOP_BYTES
    from gossipd.core.sampling import SamplingParams

    plain = task("a", "x" * 100)
    asking = msgspec.structs.replace(plain, params=SamplingParams(max_tokens=100, logprobs=5))
    assert task_bytes(asking) == task_bytes(plain) + 100 * (LOGPROB_BYTES + 5 * LOGPROB_TOP_BYTES)


def test_ForwardedLedger_forgets_oldest_by_bytes_and_keeps_outstanding_right() -> None:
    outstanding = LoadCounts()
    size = task_bytes(task("t0", "x" * 5000))  # (each id as long)
    ledger = ForwardedLedger(outstanding, entries_max=100, bytes_max=3 * size)
    for i in range(5):
        ledger.accepted(task(f"t{i}", "x" * 5000), "m1" if i % 2 else "m2", 0.0)
    assert len(ledger) == 3 and ledger.bytes == 3 * size and ledger.evicted_bytes == 2
    assert ledger.get("t0") is None and ledger.get("t1") is None and ledger.get("t4") is not None
    assert outstanding == {"m1": 1, "m2": 2}
    ledger.done("t4", "m2")
    assert ledger.bytes == 2 * size and outstanding == {"m1": 1, "m2": 1}
    small = ForwardedLedger(LoadCounts(), entries_max=2)
    for i in range(3):
        small.accepted(task(f"t{i}"), "m", 0.0)
    assert small.evicted_count == 1 and small.evicted_bytes == 0


def test_ReplySender_drops_and_counts_replies_beyond_the_queue_byte_budget() -> None:
    async def main() -> tuple[int, int, int]:
        ctx = zmq.Context()
        sender = ReplySender(
            SocketPool(ctx),
            sockets_max=4,
            idle_s=60.0,
            timeout_s=0.3,
            queue_max=1000,
            queue_bytes_max=10_000,
        )
        dead = f"tcp://127.0.0.1:{free_tcp_port()}"  # nobody reads: replies wait in the queue
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            for _ in range(5):
                sender.send(dead, b"x" * 3000)
            await asyncio.sleep(0)  # the turn's batch goes into the queue
            stats = sender.statistics()
            queued_bytes, dropped = stats.queued_bytes, stats.dropped_queue_bytes
            await wait_until_async(
                lambda: sender.statistics().dropped_undeliverable == 3, 5, "the 0.3 s timeout"
            )
            sender.stop()
        after = sender.statistics().queued_bytes
        sender.close()
        ctx.term()
        return queued_bytes, dropped, after

    queued_bytes, dropped, after = asyncio.run(main())
    assert queued_bytes == 9000 and dropped == 2 and after == 0


def test_replies_to_a_connected_reader_that_does_not_read_wait_within_the_byte_budget() -> None:
    """Once a reply connection was up, every reply went into ZeroMQ's pipe (10,000
    messages, counted in messages), beyond the byte budget: a reader that did not read
    held the daemon's memory (270 MB in a review's run, against 1 MiB of budget).  Now
    only REPLY_PIPE_MESSAGES_MAX (256) of them go there; the rest wait in the counted
    queue, and what does not fit it is dropped and counted."""
    frame_bytes, sent_count = 100_000, 768  # (76.8 MB, three times the pipe's 256)

    async def main() -> tuple[int, int, int]:
        ctx = zmq.Context()
        reader = ctx.socket(zmq.PULL)
        reader.setsockopt(zmq.RCVHWM, 1)
        reader.setsockopt(zmq.RCVBUF, 4096)
        port = reader.bind_to_random_port("tcp://127.0.0.1")
        sender = ReplySender(
            SocketPool(ctx), sockets_max=4, idle_s=60.0, timeout_s=30.0, queue_max=10_000,
            queue_bytes_max=1 << 20,
        )  # fmt: skip
        address = f"tcp://127.0.0.1:{port}"
        try:
            async with asyncio.TaskGroup() as tg:
                sender.start(tg)
                sender.send(address, b"first")
                await wait_until_async(lambda: reader.poll(10) != 0, 5, "the connection up")
                for _ in range(sent_count):
                    sender.send(address, b"x" * frame_bytes)
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.3)
                stats = sender.statistics()
                sender.stop()
        finally:
            sender.close(linger_ms=0)
            reader.close(0)
            ctx.term()
        return stats.sent, stats.queued_bytes, stats.dropped_queue_bytes

    sent, queued_bytes, dropped = asyncio.run(main())
    # In ZeroMQ's pipe and the kernel's buffers (a few MB on loopback), not all of them.
    assert sent < 384, sent
    assert queued_bytes <= 1 << 20 and dropped > 0
    assert sent + queued_bytes // frame_bytes + dropped == sent_count + 1


def test_ReplySender_at_its_socket_bound_evicts_an_idle_socket_before_one_with_replies() -> None:
    """ingress.reply_sockets_max: a new reply address closes the least recently used socket
    with nothing waiting; replies queued for a slow producer are not dropped because other
    addresses came (they were, by the oldest socket's eviction)."""

    async def main() -> tuple[int, int, int]:
        ctx = zmq.Context()
        sender = ReplySender(
            SocketPool(ctx), sockets_max=2, idle_s=60.0, timeout_s=30.0, queue_max=1000
        )
        readers = [ctx.socket(zmq.PULL) for _ in range(3)]
        ports = [r.bind_to_random_port("tcp://127.0.0.1") for r in readers]
        slow = f"tcp://127.0.0.1:{free_tcp_port()}"  # nobody reads: its replies wait
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            for _ in range(3):
                sender.send(slow, b"held")
            await asyncio.sleep(0)
            for i, port in enumerate(ports, 1):  # new addresses that take their reply
                sender.send(f"tcp://127.0.0.1:{port}", b"taken")
                await wait_until_async(lambda i=i: sender.statistics().sent >= i, 5, "taken")
            stats = sender.statistics()
            sender.stop()
        sender.close()
        for r in readers:
            r.close(0)
        ctx.term()
        return stats.sockets_evicted, stats.dropped_undeliverable, stats.queued

    evicted, dropped, queued = asyncio.run(main())
    assert evicted == 2 and dropped == 0 and queued >= 3


def test_ReplySender_delivers_to_an_ipv6_reply_address() -> None:
    """tcp://[::1]:PORT is a reply_to the task's check takes (PROTOCOL.md): its replies must
    arrive (libzmq's sockets do not connect to IPv6 unless asked: they were dropped)."""

    async def main() -> list[bytes]:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.IPV6, 1)
        pull.setsockopt(zmq.RCVTIMEO, 5000)  # (a reply that never comes: zmq.Again, no hang)
        port = pull.bind_to_random_port("tcp://[::1]")
        sender = ReplySender(SocketPool(ctx), sockets_max=4, idle_s=60.0, timeout_s=5.0,
                             queue_max=10)  # fmt: skip
        async with asyncio.TaskGroup() as tg:
            sender.start(tg)
            sender.send(f"tcp://[::1]:{port}", b"to ipv6")
            got = [await asyncio.to_thread(pull.recv)]
            sender.stop()
        sender.close()
        pull.close(0)
        ctx.term()
        return got

    assert asyncio.run(main()) == [b"to ipv6"]


def test_SocketReader_stops_a_batch_at_its_byte_limit() -> None:
    async def main(ctx: zmq.Context) -> list[int]:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(10):
            push.send(b"x" * 100_000)
        await wait_until_async(lambda: pull.poll(0), 5, "the first frame")
        await asyncio.sleep(0.2)  # all ten queued at the PULL
        batches: list[int] = []
        reader = SocketReader(pull, pull.recv, 256, lambda m: batches.append(len(m)), 250_000)
        await wait_until_async(lambda: sum(batches) == 10, 5, "ten frames")
        reader.close()
        push.close(linger=0)
        pull.close(linger=0)
        return batches

    batches = run_with_context(main)
    assert max(batches) == 3 and sum(batches) == 10  # 3 x 100 KB reach the 250 KB limit


# -- a real daemon ------------------------------------------------------------------------

TASKS = 150
WORD = "x" * 10_000
PROMPT = " ".join([WORD] * 90)  # 900 KB; the echo engine answers its words: 900 KB results
BUDGET_MIB = 24  # each of pending_bytes_max, results_cache_bytes_max, reply_queue_bytes_max


def _rss_mib(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


@pytest.mark.timeout(180)
def test_a_daemon_fed_large_prompts_and_results_stays_within_its_byte_budgets(
    daemon_factory,  # type: ignore[no-untyped-def]
) -> None:
    budget = BUDGET_MIB * 1024 * 1024
    port = free_tcp_port()
    daemon = daemon_factory(
        f"metrics.bind=127.0.0.1:{port}",
        f"ingress.pending_bytes_max={budget}",
        f"ingress.results_cache_bytes_max={budget}",
        f"ingress.reply_queue_bytes_max={budget}",
        "ingress.queue_wait_admission=false",
        # The burst read at once (not 8 MiB a turn), so that the pending budget refuses:
        # libzmq's PULL (the loop's reads 256 KiB a turn, and then all of it runs).
        'ingress.receiver="zmq"',
        f"ingress.recv_batch_bytes_max={256 * 1024 * 1024}",
    )
    producer = RawProducer(daemon.endpoint)
    try:
        producer.send_task("warm", prompt="a b", params={"max_tokens": 2})
        producer.results(1)
        baseline = _rss_mib(daemon.pid)
        started = time.monotonic()
        for i in range(TASKS):
            producer.send_task(f"t{i}", prompt=PROMPT, params={"max_tokens": 90})
        results = producer.results(TASKS, timeout_s=120)
        elapsed_s = time.monotonic() - started
        assert len(results) == TASKS
        # Settled: read until it is within the bound, for up to 5 s.  What stays beyond the
        # results cache varies from run to run, at 81811a7 as after it (2026-12-05, 25 runs on
        # this machine: 77-78 MiB in 17, 94-116 in 8, from a baseline of 53-54; why, not
        # found: the allocator keeping some freed buffers, we think): slack of 48 MiB.
        # Without the budgets the daemon kept 289 MiB from 36; its peak here is about 210.
        bound = baseline + BUDGET_MIB + 48
        settled = _rss_mib(daemon.pid)
        until = time.monotonic() + 5.0
        while settled >= bound and time.monotonic() < until:
            time.sleep(0.1)
            settled = _rss_mib(daemon.pid)
        peak = _rss_mib(daemon.pid, "VmHWM")
        metrics = scrape(port)
    finally:
        producer.close()
    ok = [r for r in results if r["ok"]]
    refused = [r for r in results if not r["ok"]]
    assert ok and refused, "some tasks run, the pending budget refuses others"
    assert all(r["error"]["code"] == "overloaded" for r in refused)
    assert all("ingress.pending_bytes_max" in r["error"]["message"] for r in refused)
    assert metrics.get("gossipd_messages_refused_total{reason=overloaded_pending_bytes}", 0) == len(
        refused
    )
    assert metrics["gossipd_results_cached_bytes"] <= budget
    assert metrics["gossipd_results_evicted_total{reason=bytes}"] >= len(ok) - budget // len(PROMPT)
    print(
        f"RSS baseline {baseline:.0f} MiB, settled {settled:.0f} MiB, peak {peak:.0f} MiB; "
        f"{len(ok)} ok, {len(refused)} overloaded in {elapsed_s:.1f} s"
    )
    # What stays: the results cache (one budget) over the baseline, and some slack (the
    # allocator, ZeroMQ; above). Before the budgets and ops/memory.py: 289 MiB from 36.
    assert settled < bound, (baseline, settled, peak)


@pytest.mark.timeout(120)
def test_rss_settles_under_the_documented_bound_after_each_of_5_bursts_over_curve(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Issue 24: 5 bursts of 150 x 900 KB prompts from an authorised CURVE producer, budgets
    pending 32 MiB, cache 16, replies 16 (scripts/memory_bursts.py). Before the fix each
    idle worker kept its last prompt: settled RSS rose by ~15 MiB a burst (85 -> 150)."""
    from scripts.memory_bursts import run_bursts

    out = run_bursts(bursts=5, tasks=150, log_dir=tmp_path)
    print(out)
    for row in out["bursts"]:
        assert row["answered"] == 150, row
        assert row["results_cached_bytes"] <= 16 * 1024 * 1024
        # docs/OPERATIONS.md "Memory budgets": baseline + the results cache's budget + 20 MiB.
        assert row["settled_mib"] < out["bound_mib"], (out["baseline_mib"], row)


def test_large_buffers_are_set_to_go_back_to_the_system_on_glibc() -> None:
    """The daemon's allocator setting (ops/memory.py) takes on this glibc: buffers of 128 KiB
    or more are mappings of their own, unmapped when freed (the RSS test above allows for
    glibc's per-thread arenas, so it no longer tells this setting's absence apart)."""
    from gossipd.ops.memory import return_large_buffers

    assert return_large_buffers() is True


def test_a_structured_forms_text_counts_in_a_tasks_bytes_as_its_prompt_does() -> None:
    from gossipd.core.budgets import task_bytes
    from gossipd.core.messages import Task
    from gossipd.core.sampling import SamplingParams, StructuredOutput

    plain = Task(v=1, id="t", prompt="p", reply_to="tcp://1.2.3.4:5")
    schema = '{"description": "' + "d" * 60_000 + '"}'
    for form in (StructuredOutput(json=schema), StructuredOutput(grammar="g" * 60_000),
                 StructuredOutput(choice=["c" * 250] * 240)):  # fmt: skip
        task = msgspec.structs.replace(plain, params=SamplingParams(structured=form))
        assert task_bytes(task) >= task_bytes(plain) + 60_000
