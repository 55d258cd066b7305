"""Before a restarted daemon runs its journal's unfinished tasks again, it asks live members
which of them they hold: a producer that got no answer while the daemon was down sent the
task elsewhere (same id), and that member ran it or runs it; a re-run here would answer the
producer a second time (docs/PROTOCOL.md "Duplicate final Results", ReplayQuery).

The check waits for a first live member (gossip's join) up to ``join_wait_s`` when members
are expected, then asks the live members that answer queries (0.3.0 or later), at most
``members_max`` of them, in pieces of ``ids_per_query`` tasks, and waits for their answers up
to ``answer_wait_s``.  A member that does not answer in time counts as holding nothing: the
task runs, as before this check (a second answer beats a lost task).  What a member says it
holds is dropped here.

Pure: the caller passes the members it sees, their answers and the time; the shell sends
the queries and acts on ``outcome()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gossipd.core.peer_messages import CONFIRM_IDS_MAX, ReplayKnown, ReplayQuery

JOIN_WAIT_S = 2.0  # how long a restarted daemon waits for its first live member
ANSWER_WAIT_S = 1.0  # how long it waits for the members' answers once asked
MEMBERS_MAX = 64  # members asked (a restart in a larger cluster asks this many)


def replay_known(
    query: ReplayQuery,
    node: str,
    held: Callable[[list[tuple[str, str]]], list[str]],
    finished_by: Callable[[str, list[str]], list[str]],
) -> ReplayKnown:
    """Member ``node``'s answer to a restarted member's ``query``: the tasks it holds
    (``held``: its task book, for the same producer key), and the tasks it forwarded to the
    asker and had the asker's TaskDone for (``finished_by``: its forwarder's ledger), which the
    asker answered before its crash took their journal's DONE records.  The asker must run
    neither again."""
    known = held(query.tasks)
    finished = finished_by(query.node, [task_id for task_id, _ in query.tasks])
    if finished:
        known = list(dict.fromkeys([*known, *finished]))
    return ReplayKnown(node=node, known=known)


def cancel_waiting(
    waiting: Iterable[tuple[str, str]], cancelled: set[str], task_id: str, producer_key: str
) -> str | None:
    """A producer's Cancel for one of ``waiting`` ((id, producer key) pairs: a restart's own
    tasks, not yet run again while it asks): "here", and the id added to ``cancelled``;
    "refused" when another key submitted it (only the task's key cancels it); None when it
    is not waiting."""
    for waiting_id, key in waiting:
        if waiting_id == task_id:
            if producer_key != key:
                return "refused"
            cancelled.add(task_id)
            return "here"
    return None


# What became of a journaled task (ingress/replay.py; gossipd_journal_replayed_tasks_total's
# label values).
OUTCOMES = (
    "run",
    "past_deadline",
    "refused",
    "known_elsewhere",
    "held_here",
    "left_for_next_start",
    "withdrawn",
    "cancelled",
)


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What the check decided: ``run`` (ids, journal order) and ``known`` (held elsewhere:
    by whom)."""

    run: list[str]
    known: dict[str, str]
    asked: int  # members asked
    answered: int  # members that answered every piece


class ReplayCheck:
    def __init__(
        self,
        tasks: Iterable[tuple[str, str]],
        *,
        started: float,
        expect_members: bool,
        join_wait_s: float = JOIN_WAIT_S,
        answer_wait_s: float = ANSWER_WAIT_S,
        members_max: int = MEMBERS_MAX,
        ids_per_query: int = CONFIRM_IDS_MAX,
    ) -> None:
        """``tasks``: (id, producer key) of each unfinished task, in journal order;
        ``expect_members``: the daemon has seeds to join (else it asks whoever is live at
        once: nobody, for a daemon alone)."""
        self._tasks = list(tasks)
        self._ids = {task_id for task_id, _ in self._tasks}
        self._join_by = started + (join_wait_s if expect_members else 0.0)
        self._answer_wait_s = answer_wait_s
        self._members_max = members_max
        self._ids_per_query = max(1, ids_per_query)
        self._asked_at: float | None = None
        self._owed: dict[str, int] = {}  # member -> answers still owed (one per piece)
        self._asked = 0
        self._known: dict[str, str] = {}  # task id -> the member that holds it
        self._unreachable = 0
        self.refused = 0  # answers not from the member they name, or not asked for

    def queries(self, members: list[str], now: float) -> list[tuple[str, list[tuple[str, str]]]]:
        """The queries to send now, as (member, tasks) pieces: to each of ``members`` not
        asked yet (at most ``members_max`` in all), from when a member is live or the join
        wait has passed until ``done`` (members learnt of meanwhile, e.g. from a seed's
        later push-pull pages, are asked too)."""
        if not self._tasks or self.done(now):
            return []
        if self._asked_at is None:
            if not members and now < self._join_by:
                return []
            self._asked_at = now
        step = self._ids_per_query
        pieces = [self._tasks[i : i + step] for i in range(0, len(self._tasks), step)]
        out: list[tuple[str, list[tuple[str, str]]]] = []
        for member in members:
            if self._asked >= self._members_max:
                break
            if member in self._owed:
                continue
            self._asked += 1
            self._owed[member] = len(pieces)
            out += [(member, piece) for piece in pieces]
        return out

    def unreachable(self, member: str) -> None:
        """A member the shell could not send its query to (no address known): not waited
        for; it counts as holding nothing."""
        if self._owed.get(member, 0) > 0:
            self._owed[member] = 0
            self._unreachable += 1

    def on_known(self, member: str, known: Iterable[str], its_own: bool = True) -> None:
        """A member's answer to one piece; ``its_own``: it came on our connection to the
        member it names (another member may not speak for it)."""
        owed = self._owed.get(member, 0)
        if not its_own or owed == 0:
            self.refused += 1
            return
        self._owed[member] = owed - 1
        for task_id in known:
            if task_id in self._ids:  # (an id we did not ask about is ignored)
                self._known.setdefault(task_id, member)

    def done(self, now: float) -> bool:
        """True once every asked member answered, or the answer wait has passed (also when
        there was nobody to ask, or nothing to check)."""
        if not self._tasks:
            return True
        if self._asked_at is None:
            return False
        return not any(self._owed.values()) or now >= self._asked_at + self._answer_wait_s

    def next_deadline(self) -> float:
        """When ``done`` becomes true at the latest (the shell sleeps until then or an
        answer)."""
        if self._asked_at is None:
            return self._join_by
        return self._asked_at + self._answer_wait_s

    def outcome(self) -> ReplayOutcome:
        answered = sum(1 for owed in self._owed.values() if owed == 0) - self._unreachable
        return ReplayOutcome(
            run=[task_id for task_id, _ in self._tasks if task_id not in self._known],
            known=dict(self._known),
            asked=self._asked,
            answered=answered,
        )
