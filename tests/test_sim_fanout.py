"""The whole-daemon simulator (simulations/fanout.py): the promises under faults, replay by
seed both ways, and a swarm that catches a forwarder that forgets to withdraw and an owner
that says done before its Result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Hashable
from dataclasses import replace

from gossipd.core.admission import Verdict
from gossipd.core.forwarder import Forwarder
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.lifecycle import Abort, Phase, TaskBook
from gossipd.core.owner import Owner, Reply
from gossipd.core.peer_messages import Forward
from simulations.fanout import FanoutRun, run_fanout, swarm, trace_for
from simulations.fanout_run import PEER_MSG, TO_PRODUCER


def _digest(**kw: object) -> str:
    report = run_fanout(FanoutRun(nodes=8, tasks=1500, **kw))  # type: ignore[arg-type]
    return str(report["trace_digest"])


def test_same_seed_same_trace_and_another_seed_another() -> None:
    assert _digest(seed=11) == _digest(seed=11)
    assert _digest(seed=11) != _digest(seed=12)


def test_replay_does_not_depend_on_the_interpreters_hash_seed() -> None:
    """Set iteration order changes with PYTHONHASHSEED; the trace must not."""

    def digest(hash_seed: str) -> str:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "simulations",
                "fanout",
                "--nodes",
                "8",
                "--tasks",
                "1500",
                "--seed",
                "11",
                "--json",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        return str(json.loads(out.stdout)["trace_digest"])

    assert digest("1") == digest("2") == _digest(seed=11)


def test_every_fault_kind_together_loses_nothing_and_breaks_no_invariant() -> None:
    report = run_fanout(FanoutRun(nodes=16, tasks=6000, seed=1, fault_events=8))
    kinds = {line.split()[1] for line in report["faults"]}  # type: ignore[union-attr]
    assert {"crash", "stall", "partition", "loss"} <= kinds, report["faults"]
    assert report["lost"] == 0, report["lost_ids"]
    assert report["invariant_violations"] == 0, report["violations"]
    assert report["duplicate_results_accepted"] == 0
    assert report["ok"] + report["errors"].get("cancelled", 0) == 6000  # type: ignore[attr-defined]


def test_the_owner_check_under_every_fault_kind_loses_nothing() -> None:
    """Owners with 2 tasks waiting refuse if_free Forwards (rule 6 of core/forwarder.py): the
    refusals move tasks on and a plain re-ask ends the all-saturated case, with the same
    promises under crashes, stalls, partitions and loss."""
    run = FanoutRun(nodes=16, tasks=6000, seed=1, fault_events=8, load=0.9, saturated_waiting=2)
    report = run_fanout(run)
    assert report["refused_saturated"] > 1000  # type: ignore[operator]
    assert report["lost"] == 0, report["lost_ids"]
    assert report["invariant_violations"] == 0, report["violations"]
    assert report["duplicate_results_accepted"] == 0
    assert report["ok"] + report["errors"].get("cancelled", 0) == 6000  # type: ignore[attr-defined]


class ForgetsToWithdraw(Forwarder):
    """A broken forwarder: never sends a Withdraw (hedge losers, silent members and dead
    members keep running their copies)."""

    def _withdraw(self, addr: str, task_id: str) -> None:
        return None


def test_swarm_passes_the_real_forwarder_and_catches_one_that_skips_withdraw() -> None:
    good = swarm(40, seed=3)
    assert good["failing"] == 0, good["failures"]
    bad = swarm(40, seed=3, forwarder_class=ForgetsToWithdraw)
    assert bad["failing"] >= 1
    failure = bad["failures"][0]  # type: ignore[index]
    assert failure["violations"][0]["invariant"] == "two_runs"
    assert isinstance(failure["seed"], int), "the seed to replay it is reported"


class DoneAtOnce(Owner):
    """A broken owner: tells its forwarder a task is done as it accepts it (the TaskDone
    leaves before the Result: a forwarder that forgets the task cannot migrate it when this
    owner then dies)."""

    def admitted(
        self, msg: Forward, verdict: Verdict, retry_after_ms: int, load: LoadRecord | None = None
    ) -> Reply:
        reply = super().admitted(msg, verdict, retry_after_ms, load)
        return Reply(reply.reply, reply.accepted, done_now=reply.accepted)


def test_swarm_catches_an_owner_that_says_done_before_its_result() -> None:
    """The simulated daemons run the daemon's own owner core (core/owner.py): break it and
    the swarm fails, on the rule it breaks."""
    bad = swarm(10, seed=3, owner_class=DoneAtOnce)
    assert bad["failing"] >= 1
    failure = bad["failures"][0]  # type: ignore[index]
    assert failure["violations"][0]["invariant"] == "taskdone_before_result"


def test_what_travels_is_the_wire_bytes_of_the_production_codec(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Between daemons and to and from the producer, the simulated network carries frames
    (encoded and decoded by the daemon's codec), never the message objects themselves."""
    import simulations.fanout_world as world_module

    kinds: dict[int, set[type]] = {}
    push = world_module.World.push

    def recording(self, at, kind, node, payload=None):  # type: ignore[no-untyped-def]
        if kind in (PEER_MSG, TO_PRODUCER):
            kinds.setdefault(kind, set()).add(type(payload[3]))
        push(self, at, kind, node, payload)

    monkeypatch.setattr(world_module.World, "push", recording)
    report = run_fanout(FanoutRun(nodes=6, tasks=300, seed=4, fault_events=2))
    assert report["lost"] == 0 and report["invariant_violations"] == 0, report["violations"]
    assert kinds == {PEER_MSG: {bytes}, TO_PRODUCER: {bytes}}


def test_a_frame_the_codec_cannot_read_back_is_a_violation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A broken encoder (a TaskDone's frame cut short) fails the run on the rule it breaks:
    the receiving daemon's decoder refuses it."""
    import simulations.fanout_network as network_module
    from gossipd.core.peer_messages import TaskDone, encode_peer

    def cuts_taskdones(msg):  # type: ignore[no-untyped-def]
        frame = encode_peer(msg)
        return frame[:-1] if type(msg) is TaskDone else frame

    monkeypatch.setattr(network_module, "encode_peer", cuts_taskdones)
    report = run_fanout(FanoutRun(nodes=6, tasks=300, seed=4, faults=()))
    assert report["invariant_violations"] > 0
    assert {v["invariant"] for v in report["violations"]} == {"undecodable"}  # type: ignore[union-attr]


def test_cancels_from_the_producer_end_tasks_and_an_intruders_do_not() -> None:
    """Every 10th task is cancelled by its producer and by an intruder (another key), as
    many by the intruder alone, under
    every fault kind: each task still gets one final Result (ok, or cancelled when the
    producer's Cancel came first), the intruder's Cancels are refused, none is lost."""
    run = FanoutRun(nodes=12, tasks=4000, seed=2, fault_events=8, cancel_every=10)
    report = run_fanout(run)
    assert report["lost"] == 0, report["lost_ids"]
    assert report["invariant_violations"] == 0, report["violations"]
    assert report["duplicate_results_accepted"] == 0
    cancelled = report["errors"].get("cancelled", 0)  # type: ignore[attr-defined]
    assert cancelled > 50 and report["ok"] + cancelled == 4000
    cancels = report["cancels"]
    # (a task cancelled while no member had it is answered cancelled by its entry member:
    # outcome "forwarded", not "here")
    handled = cancels["here"] + cancels["forwarded"]  # type: ignore[index]
    assert handled >= cancelled and cancels["forwarded"] > 0 and cancels["refused"] > 0  # type: ignore[index]


class ObeysAnyKey(TaskBook):
    """A broken task book: a Cancel from any key stops the task (rule 4 skipped)."""

    def cancel(self, task_id: str, producer_key: str = "") -> Abort:
        owned = self.get(task_id)
        return super().cancel(task_id, "" if owned is None else owned.task.producer_key)


def test_swarm_catches_a_task_book_that_obeys_anothers_cancel() -> None:
    bad = swarm(10, seed=3, book_class=ObeysAnyKey)
    assert bad["failing"] >= 1
    failure = bad["failures"][0]  # type: ignore[index]
    assert failure["violations"][0]["invariant"] == "cancelled_by_another_key"


class KeepsAStoppedQueuedCopy(TaskBook):
    """The task book before a fix: a queued task cancelled (or expired) and then withdrawn
    was marked withdrawn but not released, so no worker ever took it and it stayed."""

    def withdraw(self, task_id: str, forwarder: Hashable) -> Abort:
        owned = self.get(task_id)
        stopped = owned is not None and owned.stop is not None and owned.phase is Phase.QUEUED
        abort = super().withdraw(task_id, forwarder)
        return Abort.NOTHING if stopped and abort is Abort.MARKED else abort


def test_a_task_a_daemon_would_hold_forever_is_caught_at_the_end() -> None:
    """After every answer and every fault, copies still held elsewhere get time to end;
    one that never can (here: cancelled while queued, then withdrawn) is a violation."""
    run = FanoutRun(nodes=12, tasks=3000, seed=2, fault_events=8, cancel_every=5, hedge=True)
    good = run_fanout(run)
    assert good["invariant_violations"] == 0, good["violations"]
    # The break shows only where a Cancel meets a queued copy that is then withdrawn, which
    # some seeds' event orders bring about and others not: the first seed that does.
    for seed in range(1, 13):
        bad = run_fanout(replace(run, seed=seed, book_class=KeepsAStoppedQueuedCopy))
        if bad["invariant_violations"]:
            break
    assert {v["invariant"] for v in bad["violations"]} == {"stuck"}  # type: ignore[union-attr]


def test_trace_replays_one_tasks_story() -> None:
    run = FanoutRun(nodes=6, tasks=300, seed=4, faults=())
    lines = trace_for(run, "t0000007")
    assert "producer  sends attempt 0" in lines[0]
    answered = next(i for i, line in enumerate(lines) if "answers ok" in line)
    assert any("producer  gets ok" in line for line in lines[answered:])


def test_losing_a_fifth_of_the_members_at_once_degrades_gracefully() -> None:
    """20% of the members crash at once with the engines at 90% of capacity: served
    throughput is back to >= 0.78x within 5 simulated seconds and nothing is lost."""
    from simulations.fanout import degradation

    run = FanoutRun(nodes=20, tasks=30_000, seed=2, faults=(), load=0.9, crash_share=0.2)
    run.crash_at_s = 0.5 * run.tasks / (run.load * run.nodes * run.slots / run.service_s)
    report = run_fanout(run)
    seen = degradation(report["_world"], run.crash_at_s)  # type: ignore[arg-type]
    assert report["lost"] == 0
    assert seen["back_to_0_78x_within_s"] is not None, seen
    assert seen["back_to_0_78x_within_s"] <= 5, seen  # type: ignore[operator]


def test_the_cli_passes_the_queue_wait_target_to_the_owners(capsys) -> None:  # type: ignore[no-untyped-def]
    """--queue-wait-target-s reaches the owners' queues: a tight target refuses tasks as
    overloaded that the default (half the deadline) queues."""
    from simulations.fanout_cli import main

    def errors(target_s: str) -> dict[str, int]:
        argv = ["--nodes", "8", "--tasks", "3000", "--seed", "3", "--load", "0.95", "--faults", ""]
        main([*argv, "--json", "--quiet", "--queue-wait-target-s", target_s])
        report = json.loads(capsys.readouterr().out)
        assert report["lost"] == 0 and report["invariant_violations"] == 0
        return report["errors"]  # type: ignore[no-any-return]

    assert errors("0").get("overloaded", 0) == 0
    assert errors("0.002").get("overloaded", 0) > 0


def test_producers_resubmitting_while_long_tasks_run_get_no_late_second_answer() -> None:
    """Tasks of 2 s on average, resubmitted every second without a Result, under partitions
    and stalls (then crashes): every copy of an id ends ledgered nowhere, and no answer comes
    after the producer has forgotten the id.  Found here: a second copy's TaskDone that came
    before its accept left it ledgered for ever (core/forwarded.py), and a task migrated off
    a dead member long past its deadline was answered again (core/forwarder.py rule 4)."""
    for faults in (("partition", "stall"), ("partition", "crash")):
        run = FanoutRun(
            nodes=8, tasks=2000, seed=5, faults=faults, cancel_every=10, service_s=2.0,
            resubmit_s=1.0, abort_s=0.0,
        )  # fmt: skip
        report = run_fanout(run)
        assert report["duplicate_results_accepted"] == 0, faults
        assert report["invariant_violations"] == 0, faults
        # (Not "lost": the resubmissions overload this cluster, and a few tasks are still
        # refused as overloaded, to be retried, when the run ends.)


def test_a_copy_that_comes_while_its_withdrawn_run_is_aborted_is_run_again() -> None:
    """Aborts that take their time (abort_s): a copy of a withdrawn task that comes while its
    run is being aborted restarts it (core/lifecycle.py rule 3b), and nothing is lost."""
    # (A seed whose run has such copies: seeds 1 to 5 have 2, 2, 3, 1 and 1.  This load is
    # past the cluster's capacity, 2,500 to 35,000 `overloaded` refusals a run; a task still
    # refused at every try when the run ends is counted apart, `refused_to_the_end`.)
    run = FanoutRun(
        nodes=8, tasks=2000, seed=3, cancel_every=10, service_s=0.5, abort_s=0.5, resubmit_s=0.5
    )
    report = run_fanout(run)
    assert report["restarted_after_abort"] > 0
    assert report["lost"] == 0 and report["invariant_violations"] == 0
    assert report["duplicate_results_accepted"] == 0


def test_overlapping_partitions_each_heal_their_own_cut_and_crashes_kill_up_members() -> None:
    """Every heal reset every member to group 0: the first ended any partition overlapping
    it, early, while the run still counted it.  And a crash whose target was down already
    was skipped without a word: "8 crashes" were fewer members killed."""
    from simulations.fanout_world import World

    world = World(FanoutRun(nodes=16, tasks=10, seed=3, faults=()))
    world.fault(("partition", 0))
    first = [i for i, g in enumerate(world.group) if g]
    world.fault(("partition", 0))
    both = {i for i, g in enumerate(world.group) if g}
    second = sorted(both - set(first)) or first
    world.fault(("heal", 0))  # the first partition's heal
    still = {i for i, g in enumerate(world.group) if g}
    assert still == set(world.partitions[1]) and set(second) <= still
    world.fault(("heal", 1))
    assert not any(world.group) and world.active_faults["partition"] == 0
    world.fault(("crash", 5))
    world.fault(("crash", 5))  # down already: another member instead
    assert world.up.count(False) == 2


def test_the_latency_percentiles_are_nearest_rank() -> None:
    from simulations.fanout import _pct

    values = [float(v) for v in range(1, 101)]
    assert _pct(values, 0.99) == 99.0 and _pct(values, 0.5) == 50.0
    assert _pct([1.0, 2.0], 0.5) == 1.0 and _pct([], 0.5) == 0.0
