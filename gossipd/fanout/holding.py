"""The owner's held Results: the asyncio driver of ``core/heldresults.py``.

With ``fanout.confirm_results = "always"`` every forwarded task's final Result waits here for
one round trip: a Confirm to its forwarder, sent at once (one per forwarder per loop turn),
and its ConfirmReply.  With "suspect" it goes to its producer at once while the forwarder
is alive in our membership view, and waits here only when it is (or was since the task
came) suspect or dead: we may be cut off from it, and it may have migrated the task.  We ask
the forwarder by a Confirm once it is alive and send or drop the Result by its
ConfirmReply, or send it at the task's deadline (docs/PROTOCOL.md "Duplicate final Results";
core/heldresults.py rule 0):
    Runner._finish (ingress/runner.py) -> hold (True: held, not sent)
    membership events -> HeldResults.member_event ("alive": a Confirm to the forwarder)
    ConfirmReply (PeerLinks) -> HeldResults.on_reply
    a resubmission answered from the results cache -> HeldResults.answered
    a Withdraw from the forwarder (fanout/owner.py) -> HeldResults.withdrawn
    one loop timer at HeldResults.next_deadline() -> HeldResults.tick
Decisions: SEND -> the Result to its producer, then its TaskDones (Runner.end_held);
DROP -> nothing sent, no TaskDone (the forwarder ledgers the task elsewhere), the task
ends here as answered (journal, counters).  Streamed Chunks are not held: only the final
Result is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.core.heldresults import Decision, HeldResults, forwarder_view
from gossipd.core.lifecycle import Owned
from gossipd.core.membership import Member, MemberEvent
from gossipd.core.messages import Result
from gossipd.core.peer_messages import Confirm, ConfirmReply
from gossipd.ingress.service import Ingress


class ResultHolder:
    def __init__(
        self,
        core: HeldResults,
        *,
        node: str,
        ingress: Ingress,
        forwarders_of: Callable[[Owned], list[str]],
        member_alive: Callable[[str], bool],
        member_of: Callable[[str], Member | None],
        send_confirm: Callable[[str, Confirm], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.core = core
        self.node = node
        self._ingress = ingress
        self._forwarders_of = forwarders_of  # the member names that forwarded it to us
        self._member_alive = member_alive  # alive (not suspect, dead or unknown) in our view
        self._member_of = member_of  # its entry in our member table
        self._send_confirm = send_confirm
        self._clock = clock
        self._entries: dict[str, tuple[Owned, Result]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._flush_soon = False  # a flush is due at the end of this loop turn

    def hold(self, owned: Owned, result: Result, size: int) -> bool:
        """The ingress's final Result for a forwarded task: True when held (not sent now;
        core/heldresults.py rule 0 says which).  A task that two members forwarded is
        answered at once (nothing says both migrated it)."""
        names = self._forwarders_of(owned)
        if len(names) != 1 or not names[0]:
            return False
        member = names[0]
        task = owned.task
        if not self.core.offer(
            task.id,
            member,
            size,
            received_at=owned.received_at,
            deadline=owned.received_at + task.timeout_ms / 1000.0,
            now=self._clock.monotonic(),
            view=forwarder_view(self._member_of(member)),
        ):
            return False
        self._entries[task.id] = (owned, result)
        if not self._flush_soon:  # the Confirms of this turn's Results in one message
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        return True

    def answered(self, task_id: str) -> None:
        """A resubmission of ``task_id`` was answered from the results cache just now."""
        if self.core.answered(task_id):
            owned, result = self._entries.pop(task_id)
            self._ingress.runner.end_held(owned, result, send=False)

    def withdrawn(self, task_id: str, member: str) -> None:
        """``member`` withdrew ``task_id`` from us after its Result was held: dropped."""
        if task_id in self.core:
            self.core.withdrawn(task_id, member)
            self._flush()

    def member_event(self, event: MemberEvent) -> None:
        held_any = len(self.core) > 0  # before: a "left" may end the last one (rule 7)
        self.core.member_event(event.kind, event.node, self._clock.monotonic())
        if held_any:
            self._flush()

    def on_reply(self, msg: ConfirmReply) -> None:
        self.core.on_reply(msg.node, msg.still_mine, msg.migrated, msg.unknown)
        self._flush()

    def _flush(self) -> None:
        self._flush_soon = False
        core = self.core
        for task_id, decision in core.take_decisions():
            owned, result = self._entries.pop(task_id)
            if decision is Decision.DROP:
                # Run elsewhere: no TaskDone either (its forwarder ledgers the new owner's
                # copy; a TaskDone from us would be taken as that copy's, core/forwarded.py).
                owned.forwarders = []
                owned.replayed_src = ""
            self._ingress.runner.end_held(owned, result, send=decision is Decision.SEND)
        for member, ids in core.take_confirms():
            self._send_confirm(member, Confirm(ids=ids, node=self.node))
        at = core.next_deadline()
        if at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            delay = max(0.0, at - self._clock.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
            self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        self.core.tick(self._clock.monotonic(), self._member_alive)
        self._flush()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def send_all(self) -> int:
        """At shutdown: send every held Result now (a duplicate beats a loss); how many."""
        ids = self.core.end_all()
        for task_id in ids:
            owned, result = self._entries.pop(task_id)
            self._ingress.runner.end_held(owned, result, send=True)
        return len(ids)
