"""The whole daemon in virtual time: membership, fan-out, owners, engines, journals and
producers, all in one process and deterministic for a seed.

Each simulated daemon runs the real protocol cores: ``SwimNode`` (membership), ``Forwarder``
(fan-out, the forwarder's side), ``Admission`` (dedup and bounds) and ``HeldResults`` (an
owner's Results held while their forwarder may have migrated the task; ``hold_results``).  Around them the
simulator plays what the asyncio shell and the world do: the owner's handling of Forward /
Withdraw / TaskDone (as ``gossipd/fanout/owner.py`` does), an engine with a few slots and
random service times whose aborts take ``abort_s`` (a task's slot and entry held until its
worker ends), the runner's deadlines (a task that waited past its deadline is answered
``deadline_exceeded`` and never runs; one still running at its deadline is aborted, through
the task book's rule 4), a journal whose records survive a crash once fsynced, a network
(latency, per-link FIFO order, loss, partitions), and producers that resubmit as
docs/PROTOCOL.md says (same id after a silence, after ``retry_after_ms`` for a busy refusal)
and deduplicate final Results by id.

Faults: crash (SIGKILL; the node restarts later and replays its journal), stall (SIGSTOP for
a while), partition (a few members cut off), loss (a share of daemon-to-daemon messages lost).
Cancels: every ``cancel_every``-th task is cancelled by its producer and by an intruder (another
producer key), as many others by the intruder alone, through the daemons' own task book and forwarder (the Cancel passed on to the
member running the task).  What travels is encoded and decoded by the daemon's own codec.

Invariants (simulations/fanout_checks.py lists them), checked as the run goes and at the end:
lost, duplicate_results_accepted, two_runs, answer_after_withdraw, taskdone_before_result,
chunk_gap, cancelled_by_another_key, undecodable, loads, stuck, ledger_kept.  A
violation prints the seed; ``trace_for`` replays the seed recording the events of one task,
the shortest trace that shows it.  The report names the first lost and the first
duplicated ids (``lost_ids``, ``duplicate_ids``: second final Results a producer dropped),
for ``--trace``.

The simulator's modules, one concern each: fanout_run.py (the parameters, ``FanoutRun``, and
the names they share), fanout_daemon.py (a daemon: its cores and the shell around them),
fanout_world.py (the shared state, the event loop, the wiring), fanout_network.py,
fanout_faults.py (faults and journals), fanout_producers.py, fanout_checks.py (the
invariants); this one runs them (``run_fanout``, ``swarm``, ``trace_for``) and reports
(``degradation``).  fanout_cli.py is ``python -m simulations fanout``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from gossipd.core.forwarder import Forwarder
from gossipd.core.lifecycle import Phase, TaskBook
from gossipd.core.owner import Owner
from simulations.fanout_run import ARRIVAL, FAULT_KINDS, FanoutRun
from simulations.fanout_world import World

# After the last answer, simulated seconds (beyond the last fault's end and a stall) in which
# every copy still queued or running somewhere ends.
SETTLE_S = 5.0
SETTLE_SERVICE_TIMES = 20  # e^-20: no exponential engine time outlasts it in practice

__all__ = ["FAULT_KINDS", "FanoutRun", "World", "degradation", "run_fanout", "swarm", "trace_for"]


def run_fanout(run: FanoutRun) -> dict[str, object]:
    world = World(run)
    duration_s = run.tasks / world.rate
    world.push(0.0, ARRIVAL, -1)
    world.schedule_faults(duration_s)
    end = duration_s + run.timeout_ms / 1000.0 + 5.0
    last_report = 0.0
    while world.heap and world.heap[0][0] <= end:
        world.step()
        if run.progress is not None and world.now - last_report >= 5.0:
            last_report = world.now
            done = sum(1 for s in world.tasks.values() if s.final is not None)
            run.progress(
                f"t={world.now:6.1f}s  sent {world.sent:,}  answered {done:,}  events {world.events:,}"
            )
        if world.sent >= run.tasks and all_answered(world):
            break
    # Every task answered: let the copies still queued or running elsewhere (hedges,
    # migrations, stalled owners) end, then no live daemon may still hold one.
    healed = max((b for _, (_, b) in world.fault_spans if b != math.inf), default=0.0)
    settle = max(world.now, healed) + run.stall_s + SETTLE_S
    while world.heap and world.heap[0][0] <= settle:
        world.step()
    # A copy still running then ends in its own time (engine time is exponential: a long
    # one outlasts any fixed settle): at most SETTLE_SERVICE_TIMES mean service times more.
    limit = settle + SETTLE_SERVICE_TIMES * run.service_s
    while world.heap and world.heap[0][0] <= limit and _running_somewhere(world):
        world.step()
    world.check_stuck()
    world.check_two_runs()
    lost_taskdones = world.check_ledgers()
    # Unanswered: lost, unless the last the producer heard was a refusal to retry (every
    # member busy): the cluster never held it, and the producer still does (it would retry,
    # or gave up at its timeout).  Not a loss of an accepted task; counted apart.
    refused = [t for t, s in world.tasks.items() if s.final is None and s.refused_last]
    lost = [t for t, s in world.tasks.items() if s.final is None and not s.refused_last]
    latencies = sorted(world.latencies)
    return {
        "nodes": run.nodes,
        "tasks": run.tasks,
        "seed": run.seed,
        "faults": [f"{t:.2f}s {what}" for t, what in world.faults_log],
        "sent": world.sent,
        "ok": len(world.served_at),
        "errors": world.errors,
        "cancels_sent": world.cancels_sent,
        "cancels": dict(world.cancels),
        "restarted_after_abort": world.restarted,
        "replays_known_elsewhere": world.replays_known_elsewhere,
        # Forwarded tasks whose TaskDone never came, forgotten past their window (rule 4).
        "ledger_expired_at_end": lost_taskdones,
        "lost": len(lost),
        "lost_ids": lost[:10],
        "refused_to_the_end": len(refused),
        "duplicate_results_accepted": world.duplicates_accepted,
        "duplicate_results_dropped": world.duplicates_dropped,
        "two_runs_withdrawn": len(world.two_runs),
        "two_runs_after_resubmission": world.resubmitted_two_runs,
        "duplicates_by_fault": world.duplicates_by_fault,
        "duplicate_ids": world.duplicate_ids,
        "invariant_violations": len(world.violations),
        "violations": world.violations[:20],
        "refused_saturated": world.refused_saturated,
        "latency_p50_s": _pct(latencies, 0.5),
        "latency_p99_s": _pct(latencies, 0.99),
        "simulated_s": round(world.now, 3),
        "events": world.events,
        "trace_digest": world.digest.hexdigest(),
        "_world": world,
    }


def _running_somewhere(world: World) -> bool:
    return any(
        owned.phase is Phase.RUNNING
        for up, d in zip(world.up, world.daemons, strict=True)
        if up
        for owned in d.book
    )


def all_answered(world: World) -> bool:
    # Checked rarely: only once every task is sent.
    return world.events % 1000 == 0 and all(s.final is not None for s in world.tasks.values())


def _pct(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    # Nearest rank (progress.percentile's): the p99 of 100 values is the 99th, not the max.
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 6)


def trace_for(run: FanoutRun, task_id: str) -> list[str]:
    """Replay ``run`` (same seed) recording the events of one task."""
    from dataclasses import replace

    report = run_fanout(replace(run, trace_task=task_id, progress=None))
    world = report["_world"]
    assert isinstance(world, World)
    return world.trace_lines


def swarm(
    count: int,
    *,
    seed: int = 1,
    forwarder_class: type[Forwarder] = Forwarder,
    owner_class: type[Owner] = Owner,
    book_class: type[TaskBook] = TaskBook,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Run ``count`` short simulations, each with its own seed and a random mix of faults
    (TigerBeetle's VOPR in miniature); report every seed that broke an invariant."""
    rng = random.Random(seed)
    failures: list[dict[str, object]] = []
    for i in range(count):
        s = rng.getrandbits(32)
        kinds = tuple(k for k in FAULT_KINDS if rng.random() < 0.6) or (rng.choice(FAULT_KINDS),)
        run = FanoutRun(
            nodes=rng.randint(4, 12),
            tasks=rng.choice([300, 600, 1200]),
            seed=s,
            faults=kinds,
            fault_events=rng.randint(1, 4),
            load=rng.uniform(0.3, 0.9),
            hedge=rng.random() < 0.3,
            cancel_every=rng.choice([10, 50]),
            abort_s=rng.choice([0.0, 0.005, 0.05]),
            forwarder_class=forwarder_class,
            owner_class=owner_class,
            book_class=book_class,
        )
        report = run_fanout(run)
        broken = (
            report["lost"] or report["duplicate_results_accepted"] or report["invariant_violations"]
        )
        if broken:
            failures.append(
                {
                    "seed": s,
                    "nodes": run.nodes,
                    "tasks": run.tasks,
                    "faults": list(kinds),
                    "fault_events": run.fault_events,
                    "load": run.load,
                    "hedge": run.hedge,
                    "cancel_every": run.cancel_every,
                    "abort_s": run.abort_s,
                    "lost": report["lost"],
                    "violations": report["violations"][:3],  # type: ignore[index]
                }
            )
        if progress is not None and (i + 1) % 20 == 0:
            progress(f"swarm: {i + 1}/{count} runs, {len(failures)} failing")
    return {"runs": count, "seed": seed, "failing": len(failures), "failures": failures}


def degradation(world: World, crash_at_s: float) -> dict[str, object]:
    """Served throughput (ok Results a second) in the 5 s before the mass crash and in each
    second after it, as a ratio to before; the time it took to get back to 0.78x; and the
    latency of the tasks served in each of those seconds (from the send that was admitted to
    its ok: a refused send is retried by its producer after retry_after_ms)."""
    served, latency = world.served_at, world.attempt_latencies
    window = 5.0
    before = sum(1 for t in served if crash_at_s - window <= t < crash_at_s) / window
    before_lat = sorted(
        x for t, x in zip(served, latency, strict=True) if crash_at_s - window <= t < crash_at_s
    )
    ratios, p99s = [], []
    for k in range(10):
        a = crash_at_s + k
        second = sorted(x for t, x in zip(served, latency, strict=True) if a <= t < a + 1.0)
        ratios.append(round(len(second) / before, 3) if before else 0.0)
        p99s.append(_pct(second, 0.99))
    back = next((k + 1 for k, r in enumerate(ratios) if r >= 0.78), None)
    return {
        "crash_at_s": round(crash_at_s, 3),
        "before_per_s": round(before, 1),
        "before_latency_p99_s": _pct(before_lat, 0.99),
        "after_ratio_per_s": ratios,
        "after_latency_p99_s": p99s,
        "back_to_0_78x_within_s": back,
        "overloaded_answers": world.errors.get("overloaded", 0),
    }
