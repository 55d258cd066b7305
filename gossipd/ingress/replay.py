"""A restarted daemon's unfinished tasks, from its journal, run again.

Each runs by the deadline it was accepted with (one that passed while the daemon was down is
answered deadline_exceeded without running); what admission refuses now is answered to its
producer and leaves the journal.  The journal is read at once, before any new task can be
journaled.  A task a peer forwarded is admitted then too, but held from the workers: its
forwarder's Withdraw drops it if the forwarder migrated it while we were down, and its
TaskDone goes to that forwarder by name.  Then the live members are asked which of these
tasks they hold (core/replaycheck.py: a producer resubmitted it, or a forwarder migrated it,
elsewhere while we were down).  A producer's own task waits for the answers and, held
elsewhere, leaves the journal unanswered here, since that member answers; a forwarded one
held elsewhere is dropped as its forwarder's Withdraw would drop it, and the rest go to the
workers.  The question takes at most ``journal.replay_join_wait_s`` +
``journal.replay_answer_wait_s`` (2 s + 1 s), while the daemon serves, and ends at once when
it begins to stop.  A producer's Cancel for one of its own tasks that waits meanwhile
is kept (``cancel``, through IngressLinks): the task is then admitted and cancelled as a
queued one is, or the Cancel goes on to the member that holds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from gossipd.clock import Clock
from gossipd.config import Config, split_seed
from gossipd.core.admission import Verdict
from gossipd.core.messages import PROTOCOL_VERSION, Cancel, ErrorCode, Task
from gossipd.core.modelcards import answers_queries
from gossipd.core.peer_messages import ReplayKnown
from gossipd.core.replaycheck import (
    ANSWER_WAIT_S,
    JOIN_WAIT_S,
    OUTCOMES,
    ReplayCheck,
    cancel_waiting,
)
from gossipd.ingress.intake import Intake
from gossipd.ingress.journal import Journal
from gossipd.membership.gossip import MemberView

log = logging.getLogger("gossipd.ingress.replay")

_ADMIT = Verdict.ADMIT
# Who withdraws a replayed forwarded task that another member holds (as any forwarder may).
_BY_REPLAY = object()
POLL_S = 0.01  # how often the wait for members and their answers looks (a restart only)


def expects_members(config: Config, node: str) -> bool:
    """A seed other than ourselves, or seeds from etcd: a restart has members to ask."""
    if config.etcd.endpoints:
        return True
    for seed in config.gossip.seeds:
        name, addr = split_seed(seed)
        # By address: where we listen, or the address we give peers (a wildcard bind's).
        ours = name == node if name else addr in (config.gossip.bind, config.gossip.advertise)
        if not ours:
            return True
    return False


class JournalReplay:
    def __init__(
        self,
        journal: Journal,
        intake: Intake,
        *,
        node: str,
        clock: Clock,
        expect_members: bool,
        join_wait_s: float = JOIN_WAIT_S,
        answer_wait_s: float = ANSWER_WAIT_S,
    ) -> None:
        """``expect_members``: this daemon has seeds to join (so a restart waits up to
        ``join_wait_s`` for its first member before it asks); ``answer_wait_s``: how long it
        waits for the members' answers."""
        self.journal = journal  # (its counters are read by the metrics too)
        self._intake = intake
        self._node = node
        self._clock = clock
        self._expect_members = expect_members
        self._join_wait_s = join_wait_s
        self._answer_wait_s = answer_wait_s
        self._check: ReplayCheck | None = None
        self._waiting: list[Task] = []  # producers' own tasks: admitted after the answers
        self._cancelled: set[str] = set()  # ids of waiting ones their producer cancelled
        # Forwarded ones, admitted and held from the workers: (task, outcome if not dropped).
        self._held: list[tuple[Task, str]] = []
        # Tasks by what became of them: run, past_deadline (answered deadline_exceeded),
        # refused (answered), known_elsewhere (a member holds it: left or dropped),
        # held_here (sent again meanwhile), left_for_next_start (a stop while it asked),
        # withdrawn (a forwarded one its forwarder withdrew while we asked), cancelled (its
        # producer cancelled it while we asked: answered cancelled).
        self.outcomes: Counter[str] = Counter()
        # Tasks admitted again that were running when the daemon went down (each carries
        # its count of deaths under it to its worker: engine.deaths_per_task_max).
        self.died_under_it = 0

    def read(self, *, fanout: bool) -> int:
        """Read the journal's unfinished tasks (before the first new task can be
        journaled) and admit the forwarded ones now, held from the workers (``fanout``
        False: none counts as forwarded); how many to ask about (``run``)."""
        unfinished = self.journal.replay()
        forwarded = self.journal.forwarded if fanout else {}
        self._waiting = [task for task in unfinished if task.id not in forwarded]
        now_ones = [task for task in unfinished if task.id in forwarded]
        for task, outcome in self._admit(now_ones, {}, enqueue=False):
            if outcome in ("run", "past_deadline"):
                # Its forwarder's Withdraw is honoured from any connection (rule 2).
                self._intake.book.expect_withdraw(task.id, forwarded[task.id])
                self._held.append((task, outcome))
            else:
                self.outcomes[outcome] += 1
        self._log(now_ones, forwarded=True)
        return len(self._waiting) + len(self._held)

    def cancel(self, task_id: str, producer_key: str) -> str | None:
        """A producer's Cancel for a task that no part holds (IngressLinks.cancel_waiting):
        "here" when it is one of the producers' tasks waiting for the members' answers (it
        will be answered cancelled, not run), "refused" when another key submitted it, None
        when it is not waiting."""
        waiting = ((task.id, task.producer_key) for task in self._waiting)
        return cancel_waiting(waiting, self._cancelled, task_id, producer_key)

    def on_known(self, msg: ReplayKnown, its_own: bool) -> None:
        """A member's answer to our ReplayQuery (Dispatcher.on_replay_known)."""
        if self._check is not None:
            self._check.on_known(msg.node, msg.known, its_own)

    async def run(
        self,
        live: Callable[[], list[MemberView]],
        ask: Callable[[str, list[tuple[str, str]]], bool] | None,
        *,
        pass_cancel: Callable[[str, Cancel], None] | None = None,
        can_ask: Callable[[str], bool] | None = None,
    ) -> None:
        """Ask the members (``ask``: send one ReplayQuery, False when the member has no
        address; None: no fan-out, nobody to ask), then admit the producers' own tasks
        that nobody else holds, drop the forwarded ones that a member holds as their
        forwarder's Withdraw would (no TaskDone: that says a Result went from here), and
        hand the rest to the workers.  ``pass_cancel(member, cancel)``: a Cancel taken
        while we asked, for a task that member holds, goes on to it.  A stop ends the
        question at once (the daemon waits for this to settle its tasks)."""
        held, self._held = self._held, []
        waiting = self._waiting  # (still cancellable while we ask)
        tasks = [*waiting, *(task for task, _ in held)]
        known: dict[str, str] = {}
        if ask is not None and tasks:
            known = await self._ask(tasks, live, ask, can_ask)
        self._waiting = []
        book, runner = self._intake.book, self._intake.runner
        for task, outcome in held:
            owned = book.get(task.id)
            if owned is None:  # its forwarder withdrew it meanwhile: released
                self.outcomes["withdrawn"] += 1
            elif task.id in known and runner.withdraw(task.id, _BY_REPLAY):
                self.outcomes["known_elsewhere"] += 1
            else:
                self.outcomes[outcome] += 1
                runner.enqueue(owned)  # a worker runs it, or answers its Cancel
        for task, outcome in self._admit(waiting, known):
            self.outcomes[outcome] += 1
            if outcome == "known_elsewhere" and task.id in self._cancelled and pass_cancel:
                # Its producer cancelled it here: the member that holds it hears so.
                cancel = Cancel(v=PROTOCOL_VERSION, id=task.id, producer_key=task.producer_key)
                pass_cancel(known[task.id], cancel)
        self._cancelled.clear()
        self._log(tasks, forwarded=False)

    async def _ask(
        self,
        unfinished: list[Task],
        live: Callable[[], list[MemberView]],
        ask: Callable[[str, list[tuple[str, str]]], bool],
        can_ask: Callable[[str], bool] | None = None,
    ) -> dict[str, str]:
        clock = self._clock
        check = self._check = ReplayCheck(
            [(task.id, task.producer_key) for task in unfinished],
            started=clock.monotonic(),
            expect_members=self._expect_members,
            join_wait_s=self._join_wait_s,
            answer_wait_s=self._answer_wait_s,
        )
        admission = self._intake.admission
        try:
            while not check.done(now := clock.monotonic()) and not admission.shutting_down:
                members = [
                    m.node
                    for m in live()
                    if m.node != self._node
                    and m.gpu is not None
                    and answers_queries(m.gpu.software_version)
                    # (not yet where placement knows its address: asked at a later look)
                    and (can_ask is None or can_ask(m.node))
                ]
                for member, tasks in check.queries(members, now):
                    if not ask(member, tasks):
                        check.unreachable(member)
                await asyncio.sleep(POLL_S)
        finally:
            self._check = None
        outcome = check.outcome()
        log.info(
            "asked members which journaled tasks they hold",
            extra={
                "tasks": len(unfinished),
                "asked": outcome.asked,
                "answered": outcome.answered,
                "known_elsewhere": len(outcome.known),
                "refused_answers": check.refused,
            },
        )
        return outcome.known

    def _admit(
        self, unfinished: list[Task], known: dict[str, str], *, enqueue: bool = True
    ) -> list[tuple[Task, str]]:
        """Admit each task by its deadline unless ``known`` elsewhere or held here
        (``enqueue=False``: held from the workers); each task with what became of it (an
        ``outcomes`` key)."""
        journal, intake = self.journal, self._intake
        admission = intake.admission
        now, wall = self._clock.monotonic(), self._clock.wall()
        out: list[tuple[Task, str]] = []
        for task in unfinished:
            if admission.knows(task.id):
                # Sent again while we asked (by its producer, or the same id by another):
                # that copy runs (or ran) here, under its own journal record; a Cancel
                # taken while we asked is its now (the runner checks the key), and so is
                # the count of deaths under it (else a resend would reset it).
                if task.id in self._cancelled:
                    intake.runner.cancel(task.id, task.producer_key)
                self._count_deaths(task)
                out.append((task, "held_here"))
                continue
            if task.id in known:  # its producer's answer comes from that member
                journal.done(task.id)
                out.append((task, "known_elsewhere"))
                continue
            if task.id in self._cancelled and admission.shutting_down:
                intake.send_error(task, ErrorCode.CANCELLED, "cancelled before it ran again")
                journal.done(task.id)
                out.append((task, "cancelled"))
                continue
            if admission.shutting_down:  # stopping while we asked: it stays in the journal
                out.append((task, "left_for_next_start"))
                continue
            received_at, past = now, False
            deadline_ms = journal.deadlines.get(task.id)
            if deadline_ms is not None:  # as if received timeout_ms before that deadline
                received_at = now + deadline_ms / 1000.0 - wall - task.timeout_ms / 1000.0
                # Never after now: a wall clock set back across the restart (an RTC behind,
                # a VM restored) would give the task more than its whole timeout again.
                received_at = min(received_at, now)
                past = deadline_ms / 1000.0 <= wall
            if intake.admit(task, received_at, answer=True, enqueue=enqueue) is not _ADMIT:
                journal.done(task.id)
                out.append((task, "refused"))
                continue
            self._count_deaths(task)
            if task.id in self._cancelled:
                # Cancelled while we asked: admitted and cancelled as a queued task is, so
                # its answer is the results cache's too (a late resubmission gets it).
                intake.runner.cancel(task.id, task.producer_key)
                out.append((task, "cancelled"))
                continue
            out.append((task, "past_deadline" if past else "run"))  # (deadline_exceeded)
        return out

    def _count_deaths(self, task: Task) -> None:
        """A task that was on the engine when the daemon went down: its worker counts on
        from the deaths under it (Journal.died_under)."""
        died = self.journal.died_under.get(task.id)
        if died:
            owned = self._intake.book.get(task.id)
            if (
                owned is not None
                and owned.task.producer_key == task.producer_key  # (not another's id)
                and owned.engine_deaths < died
            ):
                owned.engine_deaths = died
                self.died_under_it += 1

    def _log(self, tasks: list[Task], *, forwarded: bool) -> None:
        """What became of the journal's tasks so far (``forwarded``: the forwarded ones
        just admitted, held from the workers; else: ``tasks`` after the answers)."""
        if tasks:
            extra: dict[str, object] = {"tasks": len(tasks), "forwarded_only": forwarded}
            extra.update((k, self.outcomes[k]) for k in OUTCOMES)
            extra["died_under_it"] = self.died_under_it
            log.info("re-running unfinished tasks from the journal", extra=extra)
