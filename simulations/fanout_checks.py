"""The invariants, mixed into the world (simulations/fanout_world.py), checked as the run goes
(and the two-runs one at the end):
- lost: every task a producer sent ends with a final Result it accepted (counted by
  ``run_fanout``);
- duplicate_results_accepted: a second final Result for an id that the producer would accept
  (arriving after it stopped remembering the id: ``producer_memory_s`` after its first);
  second Results it drops by id are counted apart (``duplicate_results_dropped``), with the
  faults under way when the second copy started (counted by the producers,
  fanout_producers.py);
- two_runs: a task starts on a second owner while an earlier copy of the same producer send
  runs, and the forwarder withdrew neither copy (a hedge or a migration must withdraw one; a
  crash of the first owner excuses it).  Two copies of different producer sends (the producer
  resent during a stall or a partition) are counted apart, not a violation;
- answer_after_withdraw: an owner answers for a task that was withdrawn before it ran;
- taskdone_before_result: an owner sends a TaskDone for a task whose Result this process has
  not sent (docs/PROTOCOL.md: a TaskDone never leaves before its Result; a forwarder that
  forgets a task its owner then loses cannot migrate it);
- chunk_gap: a final Result arrives while the producer misses some of its chunks;
- cancelled_by_another_key: a task ends ``cancelled`` though its own producer sent no Cancel
  (only an intruder's key did: docs/PROTOCOL.md, only the task's key cancels it);
- undecodable: a frame (fan-out message, producer task or Cancel, reply) the daemon's codec
  cannot read back (simulations/fanout_network.py);
- loads: each forwarder's load counts equal its pending forwards plus its ledger;
- stuck: at the end, after every task was answered and every fault healed and the copies
  still queued or running elsewhere had time to end, a live daemon still holds a task
  (queued or running): it is never run, answered or released;
- ledger_kept: at the end, once every ledgered task's deadline and its producer's window
  after it have passed (each forwarder's clock moved on to then: it is pure), a forwarder
  still answers for a task (its TaskDone never came, and it would count against its
  member's load for ever: core/forwarder.py rule 4).
A violation prints the seed; ``trace`` records the events of one task (``trace_for`` in
simulations/fanout.py replays a seed with it), the shortest trace that shows it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossipd.core.forwarder import LEDGER_SWEEP_S
from gossipd.core.messages import Task

if TYPE_CHECKING:
    from simulations.fanout_daemon import SimDaemon


class Checks:
    """Which owner runs which task, the violations found, one task's trace."""

    def started_running(self, d: SimDaemon, task: Task) -> None:
        task_id = task.id
        others = self.running_on.setdefault(task_id, [])
        for node, epoch, attempt in others:
            if node == d.index:
                continue
            if attempt == task.attempt:  # fan-out made two copies: one must be withdrawn
                self.two_runs.append((task_id, node, epoch, d.index, self.now))
            else:  # the producer resent it while the first copy ran (a stall, a partition)
                self.resubmitted_two_runs += 1
        others.append((d.index, d.epoch, task.attempt))
        self.trace(task_id, d.name, "starts running")

    def stopped_running(self, d: SimDaemon, task_id: str) -> None:
        runs = self.running_on.get(task_id)
        if runs:
            runs[:] = [r for r in runs if r[0] != d.index]
            if not runs:
                del self.running_on[task_id]

    def violation(self, kind: str, task_id: str, node: str) -> None:
        self.violations.append(
            {"invariant": kind, "task": task_id, "node": node, "at": round(self.now, 6)}
        )

    def check_loads(self) -> None:
        for d in self.daemons:
            fw = d.forwarder
            if sum(fw.loads.values()) != fw.pending() + len(fw.ledger):
                self.violation("loads", "", d.name)

    def trace(self, task_id: str, who: str, what: str) -> None:
        if task_id == self.run.trace_task:
            self.trace_lines.append(f"{self.now:12.6f}  {who:>9}  {what}")

    def check_stuck(self) -> None:
        """At the end, once every copy had time to end: no live daemon holds a task still."""
        for i, d in enumerate(self.daemons):
            if self.up[i]:
                for owned in d.book:
                    self.violation("stuck", owned.task.id, d.name)

    def check_ledgers(self) -> int:
        """At the end: each live forwarder, its clock moved past every ledgered task's
        window, answers for none; how many it forgot then (their TaskDone never came)."""
        forgotten = 0
        for i, d in enumerate(self.daemons):
            fw = d.forwarder
            if not self.up[i] or not fw.ledger.entries:
                continue
            later = max(e.window_ends() for e in fw.ledger.entries.values()) + LEDGER_SWEEP_S
            before = fw.ledger.expired
            # Every look due by then, slice by slice (one left half done counts too).
            for _ in range(10_000):
                if fw.next_deadline() > later:
                    break
                fw.tick(later)
            forgotten += fw.ledger.expired - before
            for task_id in fw.ledger.entries:
                self.violation("ledger_kept", task_id, d.name)
        return forgotten

    def check_two_runs(self) -> None:
        """At the end: two runs at once are excused when the earlier copy was withdrawn or its
        daemon crashed."""
        for task_id, first, epoch, second, _ in self.two_runs:
            names = (self.daemons[first].name, self.daemons[second].name)
            withdrawn = any((name, task_id) in self.withdraws_sent for name in names)
            if not withdrawn and (first, epoch) not in self.crashed_at:
                self.violation("two_runs", task_id, names[0])
