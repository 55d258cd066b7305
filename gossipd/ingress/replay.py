"""A restarted daemon's unfinished tasks, from its journal, run again.

Each runs by the deadline it was accepted with (one that passed while the daemon was down is
answered deadline_exceeded without running); what admission refuses now is answered to its
producer and leaves the journal.  The journal is read at once, before any new task can be
journaled.  A task a peer forwarded is admitted then too: its forwarder's Withdraw drops it
if the forwarder migrated it while we were down, and its TaskDone goes to that forwarder by
name.  A producer's own task first waits while the live members are asked which of them
they hold (core/replaycheck.py: its producer resubmitted it elsewhere while we were down);
those leave the journal unanswered here, since that member answers.  The question takes at
most about 3 s, while the daemon serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from gossipd.clock import Clock
from gossipd.config import Config, split_seed
from gossipd.core.admission import Verdict
from gossipd.core.messages import Task
from gossipd.core.modelcards import answers_queries
from gossipd.core.peer_messages import ReplayKnown
from gossipd.core.replaycheck import ReplayCheck
from gossipd.ingress.intake import Intake
from gossipd.ingress.journal import Journal
from gossipd.membership.gossip import MemberView

log = logging.getLogger("gossipd.ingress.replay")

POLL_S = 0.01  # how often the wait for members and their answers looks (a restart only)


def expects_members(config: Config, node: str) -> bool:
    """A seed other than ourselves, or seeds from etcd: a restart has members to ask."""
    if config.etcd.endpoints:
        return True
    for seed in config.gossip.seeds:
        name, addr = split_seed(seed)
        if (name or addr) != (node if name else config.gossip.bind):
            return True
    return False


class JournalReplay:
    def __init__(
        self, journal: Journal, intake: Intake, *, node: str, clock: Clock, expect_members: bool
    ) -> None:
        """``expect_members``: this daemon has seeds to join (so a restart waits a moment
        for its first member before it asks)."""
        self._journal = journal
        self._intake = intake
        self._node = node
        self._clock = clock
        self._expect_members = expect_members
        self._check: ReplayCheck | None = None
        self._unfinished: list[Task] = []
        # Tasks by what became of them: run, past_deadline (answered deadline_exceeded),
        # refused (answered), known_elsewhere, held_here (both left to that copy),
        # left_for_next_start (the daemon began to stop while it asked).
        self.outcomes: Counter[str] = Counter()

    def read(self, expect_withdraw: Callable[[str, str], None] | None) -> int:
        """Read the journal's unfinished tasks (before the first new task can be
        journaled) and admit the forwarded ones (``expect_withdraw(task id, forwarder)``;
        None: no fan-out here, every task waits for ``run``); how many wait for ``run``."""
        unfinished = self._journal.replay()
        forwarded = self._journal.forwarded if expect_withdraw is not None else {}
        self._unfinished = [task for task in unfinished if task.id not in forwarded]
        now_ones = [task for task in unfinished if task.id in forwarded]
        if now_ones:
            self._admit(now_ones, {}, expect_withdraw)
        return len(self._unfinished)

    def on_known(self, msg: ReplayKnown, its_own: bool) -> None:
        """A member's answer to our ReplayQuery (Dispatcher.on_replay_known)."""
        if self._check is not None:
            self._check.on_known(msg.node, msg.known, its_own)

    async def run(
        self,
        live: Callable[[], list[MemberView]],
        ask: Callable[[str, list[tuple[str, str]]], bool] | None,
    ) -> None:
        """Ask the members (``ask``: send one ReplayQuery, False when the member has no
        address; None: no fan-out, nobody to ask), then admit what nobody else holds."""
        unfinished, self._unfinished = self._unfinished, []
        if not unfinished:
            return
        known: dict[str, str] = {}
        if ask is not None:
            known = await self._ask(unfinished, live, ask)
        self._admit(unfinished, known, None)

    async def _ask(
        self,
        unfinished: list[Task],
        live: Callable[[], list[MemberView]],
        ask: Callable[[str, list[tuple[str, str]]], bool],
    ) -> dict[str, str]:
        clock = self._clock
        check = self._check = ReplayCheck(
            [(task.id, task.producer_key) for task in unfinished],
            started=clock.monotonic(),
            expect_members=self._expect_members,
        )
        try:
            while not check.done(now := clock.monotonic()):
                members = [
                    m.node
                    for m in live()
                    if m.node != self._node
                    and m.gpu is not None
                    and answers_queries(m.gpu.software_version)
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
        self,
        unfinished: list[Task],
        known: dict[str, str],
        expect_withdraw: Callable[[str, str], None] | None,
    ) -> None:
        journal, intake = self._journal, self._intake
        admission = intake.admission
        counts: Counter[str] = Counter()
        if admission.shutting_down:  # stopping while we asked: they stay in the journal
            counts["left_for_next_start"] = len(unfinished)
            unfinished = []
        now, wall = self._clock.monotonic(), self._clock.wall()
        for task in unfinished:
            if admission.holds(task.id, task.producer_key) or admission.held_by_other(
                task.id, task.producer_key
            ):
                # Sent again while we asked (by its producer, or the same id by another):
                # that copy runs (or ran) here, under its own journal record.
                counts["held_here"] += 1
                continue
            if task.id in known:  # its producer's answer comes from that member
                counts["known_elsewhere"] += 1
                journal.done(task.id)
                continue
            received_at, past = now, False
            deadline_ms = journal.deadlines.get(task.id)
            if deadline_ms is not None:  # as if received timeout_ms before that deadline
                received_at = now + deadline_ms / 1000.0 - wall - task.timeout_ms / 1000.0
                past = deadline_ms / 1000.0 <= wall
            if intake.admit(task, received_at, answer=True) is not Verdict.ADMIT:
                counts["refused"] += 1
                journal.done(task.id)
                continue
            counts["past_deadline" if past else "run"] += 1  # (answered deadline_exceeded)
            src = journal.forwarded.get(task.id)
            if src is not None and expect_withdraw is not None:
                expect_withdraw(task.id, src)
        self.outcomes.update(counts)
        log.info(
            "re-running unfinished tasks from the journal",
            extra={
                "tasks": sum(counts.values()),
                "forwarded": expect_withdraw is not None,
                "past_deadline": counts["past_deadline"],
                "refused": counts["refused"],
                "known_elsewhere": counts["known_elsewhere"],
                "held_here": counts["held_here"],
                "left_for_next_start": counts["left_for_next_start"],
            },
        )
