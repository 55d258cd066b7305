"""The forwarder's ledger: tasks it handed to another member that accepted them, kept until
that member reports them done (TaskDone), sans-IO.

While a task is in the ledger the forwarder answers for it: if its owner is declared dead,
the task is dispatched again (migration).  Per member, ``outstanding`` counts the tasks it
holds for us; the placer reads that dict for bounded loads (the dispatcher also counts the
forwards still awaiting their ack there).

Rules (the forwarder ends a Forward at its first answer, so an accept never follows a
TaskDone that answered the same Forward):
- a task is in the ledger at most once, under the member that last accepted it;
- ``outstanding[m]`` rises by one for each task ledgered under ``m`` and falls by one when it
  leaves, so it equals the number of ledger entries under ``m`` plus what the dispatcher adds;
- a TaskDone that comes while its Forward to that member still awaits the accept stands
  for the accept (an owner does not send an accept still held when its task ends, and an
  accept may be lost): nothing is ledgered, and the task is remembered as finished by that
  member (``finished``; another member's copy's entry is forgotten, as an accept's would be);
- a TaskDone from a member other than the one ledgered (a withdrawn hedged copy finished
  before the withdrawal landed, or a second copy of the id that a producer's resubmission
  brought here) leaves the entry alone and is not remembered: a later copy that member
  accepts is ledgered.  (Before TaskDones stood for accepts, one that came before its own
  Forward's accept was remembered for that accept; without that, the accept replaced the
  entry and stayed ledgered for ever: found by the simulator with producers resubmitting
  while tasks ran.)
- at most ``entries_max`` tasks and ``bytes_max`` bytes of them (``budgets.task_bytes``: the
  prompt and a fixed part): the oldest goes first (it can no longer migrate), counted by the
  bound that forced it (``evicted_count`` / ``evicted_bytes``);
- an entry whose task's deadline, and its producer's window after it (``timeout_ms`` again),
  have passed is forgotten by ``expire`` (``expired``): its TaskDone was lost (a partition,
  or its owner restarted and left the task to a member that held it), and nothing it could
  still do (a migration, a Cancel, an answer) would reach a producer that remembers the id;
  before, it stayed ledgered until its owner died, counting against that member's load;
- a task migrated off a member is remembered as moved off it (the last ``MOVED_MAX`` tasks,
  with every member each moved off), so that the member, asking later whether it still runs
  the task for us (``confirm``), hears "migrated" even after the new owner's TaskDone and
  after the task moved on again; a task neither ledgered nor remembered is
  "unknown" (the owner then answers: a duplicate beats a loss);
- a task whose TaskDone came from the member it was ledgered under (or stood for that
  member's accept) is remembered as finished by that member (the last
  ``FINISHED_MAX`` tasks), so that the member, restarted from a journal whose DONE record
  the crash lost, hears that it answered the task (``finished_by``) and does not run it
  again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gossipd.core.budgets import task_bytes
from gossipd.core.messages import Task
from gossipd.core.ring import LoadCounts

MOVED_MAX = 100_000  # migrations remembered for confirm() (~150 bytes each)
# TaskDones remembered for finished_by(): 3.9 MiB when full of 128-character ids (the most a
# task id may have), 2.2 MiB with 20-character ones; a restart is answered for the tasks its
# forwarder had the TaskDones of, among the last this many
FINISHED_MAX = 16_384


@dataclass(slots=True)
class Forwarded:
    owner: str
    task: Task
    received_at: float  # time.monotonic() at the entry point: the task's deadline counts from it
    size_bytes: int  # budgets.task_bytes(task), worked out once when it is ledgered
    # Its producer cancelled it (the Cancel went to the owner, or could not: the owner out of
    # our view): if the owner dies, the task ends here answered cancelled, not run again.
    cancelled: bool = False
    # Engines that died running it before it came to ``owner`` (Forward.engine_deaths): a
    # migration or a Moved keeps the count.
    engine_deaths: int = 0

    def window_ends(self) -> float:
        """When its deadline and the producer's window after it (timeout_ms again) have
        passed: past this, no answer for it reaches a producer that remembers the id."""
        return self.received_at + self.task.timeout_ms / 500.0


class ForwardedLedger:
    def __init__(
        self, outstanding: LoadCounts, *, entries_max: int, bytes_max: int = 1 << 62
    ) -> None:
        self.outstanding = outstanding
        self.entries_max = entries_max
        self._bytes_max = bytes_max
        self.bytes = 0  # budgets.task_bytes of the entries
        self.evicted_count = 0  # forgotten for room: entries_max
        self.evicted_bytes = 0  # ...bytes_max
        self.expired = 0  # forgotten past their deadline and the window after it (expire)
        # Read-only to others: its size is the forwarder's in-flight count's part (per task).
        self.entries: OrderedDict[str, Forwarded] = OrderedDict()
        # task id -> every member it moved off (a task can move more than once, and each of
        # those members may ask)
        self._moved: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        # task id -> the member whose TaskDone ended its entry (the last FINISHED_MAX)
        self._finished: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, task_id: str) -> Forwarded | None:
        return self.entries.get(task_id)

    def owned_by(self, member: str) -> list[Forwarded]:
        return [f for f in self.entries.values() if f.owner == member]

    def accepted(
        self,
        task: Task,
        owner: str,
        received_at: float,
        cancelled: bool = False,
        engine_deaths: int = 0,
    ) -> None:
        """``owner`` accepted ``task``: we answer for it until its TaskDone.  ``cancelled``:
        its producer's Cancel came before (Forwarded.cancelled); ``engine_deaths``: engines
        that died running it (Forwarded.engine_deaths)."""
        task_id = task.id
        if task_id in self.entries:  # accepted again (a retry, a hedge): ledgered once
            self.forget(task_id)
        self._finished.pop(task_id, None)  # this copy is not finished (a resubmission)
        size = task_bytes(task)
        self.entries[task_id] = Forwarded(owner, task, received_at, size, cancelled, engine_deaths)
        self.bytes += size
        outstanding = self.outstanding  # its total kept here: no Python call a task
        dict.__setitem__(outstanding, owner, outstanding.get(owner, 0) + 1)
        outstanding.total += 1
        while len(self.entries) > self.entries_max:
            self.forget(next(iter(self.entries)))
            self.evicted_count += 1
        while self.bytes > self._bytes_max and len(self.entries) > 1:
            self.forget(next(iter(self.entries)))
            self.evicted_bytes += 1

    def done(self, task_id: str, node: str) -> None:
        """``node`` reports ``task_id`` finished: its entry goes if ledgered under ``node``
        (another member's TaskDone, of a copy withdrawn or resubmitted, leaves it alone)."""
        entry = self.entries.get(task_id)
        if entry is not None and entry.owner == node:
            self.forget(task_id)
            self._finish(task_id, entry.owner)  # (the ledger's string: one for all)

    def finished(self, task_id: str, owner: str) -> None:
        """``owner`` accepted ``task_id`` and finished it in one report (its TaskDone came
        while its Forward awaited the accept, and stands for it): nothing to answer for; any
        earlier copy's entry goes, as an accept's would."""
        if task_id in self.entries:
            self.forget(task_id)
        self._finish(task_id, owner)

    def _finish(self, task_id: str, member: str) -> None:
        finished = self._finished
        if task_id in finished:  # (seldom: accepted() forgot it; a new key goes last anyway)
            finished.move_to_end(task_id)
        finished[task_id] = member
        if len(finished) > FINISHED_MAX:
            finished.popitem(last=False)

    def finished_by(self, member: str, task_ids: list[str]) -> list[str]:
        """Those of ``task_ids`` whose TaskDone ``member`` sent us for the copy we had
        ledgered under it (among the last FINISHED_MAX): tasks it answered, which it must not
        run again after a restart (a ReplayQuery's answer)."""
        finished = self._finished
        return [task_id for task_id in task_ids if finished.get(task_id) == member]

    def forget(self, task_id: str) -> Forwarded | None:
        """Stop answering for ``task_id``; the entry, if there was one."""
        entry = self.entries.pop(task_id, None)
        if entry is not None:
            outstanding = self.outstanding  # as in accepted()
            dict.__setitem__(outstanding, entry.owner, outstanding[entry.owner] - 1)
            outstanding.total -= 1
            self.bytes -= entry.size_bytes
        return entry

    def expire(self, task_ids: list[str], now: float) -> int:
        """Forget those of ``task_ids`` still ledgered whose deadline and the producer's
        window after it have passed by ``now``; how many."""
        entries = self.entries
        gone = 0
        for task_id in task_ids:
            entry = entries.get(task_id)
            if entry is not None and entry.window_ends() <= now:
                self.forget(task_id)
                gone += 1
        self.expired += gone
        return gone

    def moved_off(self, task_id: str, member: str) -> None:
        """``task_id`` was withdrawn from ``member`` (declared dead, no accept in time, a
        hedge's loser): remember it for confirm()."""
        before = self._moved.get(task_id, ())
        self._moved[task_id] = before if member in before else (*before, member)
        self._moved.move_to_end(task_id)
        if len(self._moved) > MOVED_MAX:
            self._moved.popitem(last=False)

    def confirm(self, task_ids: list[str], member: str) -> tuple[list[str], list[str], list[str]]:
        """``member`` asks whether we still route each task to it: (still routed to it,
        migrated off it, unknown here)."""
        still: list[str] = []
        migrated: list[str] = []
        unknown: list[str] = []
        for task_id in task_ids:
            entry = self.entries.get(task_id)
            if entry is not None and entry.owner == member:
                still.append(task_id)
            elif entry is not None or member in self._moved.get(task_id, ()):
                migrated.append(task_id)  # ledgered under another member, or moved off it
            else:
                unknown.append(task_id)
        return still, migrated, unknown
