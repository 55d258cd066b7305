"""Final Results an owner holds back until the task's forwarder says it did not migrate the
task, sans-IO (docs/PROTOCOL.md "Duplicate final Results", the partition case).

An owner cut off from a forwarder cannot tell a partition from the forwarder's death; on the
other side the forwarder may have declared the owner dead and migrated the task, whose new
owner answers.  So a forwarded task's Result is held, not sent, until the forwarder can say
which of the two happened.

Rule 0, which Results are held (``offer``): with ``always`` every forwarded task's Result
(asked at once: one round trip to the forwarder before the producer hears, so that a Result
is never in flight to the producer when the cut comes); else only while the forwarder is
suspect or dead in our view, or was since the task may have been sent (its arrival minus
its remaining time: a Forward can wait that long in a connection stalled by a cut, and TCP
delivers it after the heal, long after the forwarder's ack timeout sent the task
elsewhere), or we refuted a suspicion of ours since (it may have migrated the task
meanwhile: asked at once when it is alive).  A member that left gracefully is no reason to
hold (rule 7).

Rules (every held Result ends exactly once, as SEND or DROP, by its task's deadline):
1. ``hold`` takes a Result unless the byte budget (``bytes_max``) is spent or the task's
   deadline has passed: then the caller sends it at once (counted ``not_held``).
2. While the forwarder is alive in our view, its held tasks are asked about in a Confirm
   (at most ``CONFIRM_IDS_MAX`` ids each), again every ``confirm_every_s`` while unanswered.
3. A ConfirmReply decides each id it names that we hold under that forwarder: ``migrated``
   -> DROP (the forwarder had it run elsewhere, which answers); ``still_mine`` or
   ``unknown`` -> SEND (when in doubt, answer: a duplicate beats a loss).
4. At the task's deadline a Result still held is sent (SEND): the forwarder never came back
   or never answered (an old daemon that does not know Confirm).
5. A Withdraw from the forwarder a Result is held for (it had the task run elsewhere, and
   its Withdraw came through after the heal) -> DROP, as ``migrated``.
6. ``answered``: a resubmission of the id was answered from the results cache (its Forward
   or the producer's own resend is its confirmation): the held copy ends, counted as sent.
7. ``member_left``: a forwarder that left the cluster (a graceful leave, not a death) had
   not migrated the task (it was alive in our view) and will migrate nothing now: its held
   Results are sent.  (A Result is never held for a member that has left.)
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gossipd.core.membership import Member, State
from gossipd.core.messages import TIMEOUT_MS_MAX
from gossipd.core.peer_messages import CONFIRM_IDS_MAX

# Rule 0 looks back at most a task's whole time before its receipt: a member down longer
# ago than twice the longest timeout says nothing, and is forgotten (churning names).
LOOK_BACK_S = 2 * TIMEOUT_MS_MAX / 1000.0


class Decision(enum.Enum):
    SEND = "send"  # send the held Result to its producer now (and its TaskDones)
    DROP = "drop"  # never send it: its forwarder migrated the task


@dataclass(slots=True)
class _Held:
    member: str  # the forwarder
    deadline: float
    size: int
    asked_at: float = float("-inf")  # when a Confirm last named it


@dataclass(slots=True)
class HeldCounters:
    held: int = 0  # Results held back
    sent_confirmed: int = 0  # ...sent: the forwarder still routed them to us
    sent_unknown: int = 0  # ...sent: the forwarder did not know them (restarted)
    sent_deadline: int = 0  # ...sent at the deadline with no answer
    sent_resubmitted: int = 0  # ...answered from the cache to a resubmission
    sent_shutdown: int = 0  # ...sent as the daemon stopped
    sent_left: int = 0  # ...sent: their forwarder left the cluster (rule 7)
    dropped_migrated: int = 0  # ...dropped: migrated elsewhere
    not_held: int = 0  # sent at once: no room in bytes_max, or past the deadline
    confirms_sent: int = 0  # Confirm messages asked


def forwarder_view(member: Member | None) -> str:
    """What ``offer`` calls the forwarder's ``view``, from its entry in our member table."""
    if member is None or member.state is State.LEFT:
        return "gone"
    return "alive" if member.state is State.ALIVE else "down"


class HeldResults:
    def __init__(
        self, *, bytes_max: int, confirm_every_s: float = 1.0, always: bool = False
    ) -> None:
        self.bytes_max = bytes_max
        self.confirm_every_s = confirm_every_s
        self.always = always  # rule 0: every forwarded Result waits for its forwarder's word
        self.bytes = 0
        self.counters = HeldCounters()
        self._held: dict[str, _Held] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped
        self._decisions: list[tuple[str, Decision]] = []
        self._confirms: list[tuple[str, list[str]]] = []
        self._asks: dict[str, list[str]] = {}  # forwarder -> ids to ask at the next take
        self._poll_at = float("inf")  # when tick() next looks who is alive (rule 2)
        # Rule 0's memory: when each member was last suspect or dead in our view, and when
        # we last refuted a suspicion or death of ours (any forwarder may have migrated our
        # tasks then: we were cut off from them, or stalled).
        self._last_down: dict[str, float] = {}
        self._last_down_pruned_at = 64  # its size when it is next pruned (LOOK_BACK_S)
        self._refuted_at = -math.inf

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._held

    # -- inputs ----------------------------------------------------------------------------

    def offer(
        self,
        task_id: str,
        member: str,
        size: int,
        *,
        received_at: float,
        deadline: float,
        now: float,
        view: str,
    ) -> bool:
        """Rules 0 and 1: the final Result of ``task_id``, forwarded to us by ``member``,
        which is ``view`` in our membership now: "alive", "down" (suspect or dead), or
        "gone" (left, or not known: nothing says it migrated the task, and nobody would
        answer a Confirm).  True when held (not sent now)."""
        if view == "gone":
            return False
        if not self.always and view == "alive":
            # A Forward can wait in a stalled connection for up to its remaining time (TCP
            # delivers it after a heal, with the forwarder's Withdraw behind it): look back
            # that far before it came.
            since = received_at - max(0.0, deadline - received_at)
            last_down = max(self._last_down.get(member, -math.inf), self._refuted_at)
            if last_down < since:
                return False  # alive all along since it may have been sent: nothing says it moved
        if not self.hold(task_id, member, size, deadline, now):
            return False
        if view == "alive":  # ask it at once
            self._held[task_id].asked_at = now
            self._asks.setdefault(member, []).append(task_id)
        return True

    def member_event(self, kind: str, member: str, now: float) -> None:
        """A membership event (core/membership.py's MemberEvent.kind) about ``member``."""
        if kind in ("suspect", "dead"):
            self._last_down[member] = now
            if len(self._last_down) >= self._last_down_pruned_at:
                horizon = now - LOOK_BACK_S
                kept = {m: at for m, at in self._last_down.items() if at >= horizon}
                self._last_down = kept
                self._last_down_pruned_at = max(64, 2 * len(kept))
        elif kind == "refuted":
            self._refuted_at = now
        elif kind == "left":
            self.member_left(member)
        elif kind in ("alive", "joined") and self._held:
            self.member_alive(member, now)

    def hold(self, task_id: str, member: str, size: int, deadline: float, now: float) -> bool:
        """Rule 1: True when held; False: send it now."""
        if now >= deadline or self.bytes + size > self.bytes_max or task_id in self._held:
            self.counters.not_held += 1
            return False
        self._held[task_id] = _Held(member, deadline, size)
        self.bytes += size
        self.counters.held += 1
        self._poll_at = min(self._poll_at, now + self.confirm_every_s)
        heap = self._deadlines
        if len(heap) >= 2 * len(self._held) + 64:
            # Mostly ended ones behind one held with an early deadline (only the head's are
            # popped): rebuilt from what is held, so the heap stays within 2x of it (it grew
            # with throughput x the longest timeout, outside held_results_bytes_max).
            heap[:] = [(h.deadline, tid) for tid, h in self._held.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (deadline, task_id))
        return True

    def member_alive(self, member: str, now: float) -> None:
        """Rule 2: ``member`` is alive in our view: ask it about what we hold for it."""
        ids = []
        for task_id, held in self._held.items():
            if held.member == member and now - held.asked_at >= self.confirm_every_s:
                held.asked_at = now
                ids.append(task_id)
        for i in range(0, len(ids), CONFIRM_IDS_MAX):
            self._confirms.append((member, ids[i : i + CONFIRM_IDS_MAX]))
            self.counters.confirms_sent += 1

    def on_reply(
        self,
        member: str,
        still_mine: Sequence[str],
        migrated: Sequence[str],
        unknown: Sequence[str],
    ) -> None:
        """Rule 3: ``member``'s ConfirmReply."""
        for task_id in migrated:
            if self._end(task_id, member):
                self.counters.dropped_migrated += 1
                self._decisions.append((task_id, Decision.DROP))
        for task_id in still_mine:
            if self._end(task_id, member):
                self.counters.sent_confirmed += 1
                self._decisions.append((task_id, Decision.SEND))
        for task_id in unknown:
            if self._end(task_id, member):
                self.counters.sent_unknown += 1
                self._decisions.append((task_id, Decision.SEND))

    def withdrawn(self, task_id: str, member: str) -> None:
        """Rule 5: ``member`` withdrew its copy of ``task_id``."""
        if self._end(task_id, member):
            self.counters.dropped_migrated += 1
            self._decisions.append((task_id, Decision.DROP))

    def answered(self, task_id: str) -> bool:
        """Rule 6: True when ``task_id`` was held (it ends now, as sent)."""
        if self._end(task_id, None):
            self.counters.sent_resubmitted += 1
            return True
        return False

    def member_left(self, member: str) -> None:
        """Rule 7: ``member`` left: every Result held for it is sent."""
        for task_id in [t for t, h in self._held.items() if h.member == member]:
            if self._end(task_id, member):
                self.counters.sent_left += 1
                self._decisions.append((task_id, Decision.SEND))

    def end_all(self) -> list[str]:
        """At shutdown: every held Result is to be sent now (a duplicate beats a loss)."""
        ids = list(self._held)
        for task_id in ids:
            self._end(task_id, None)
        self.counters.sent_shutdown += len(ids)
        return ids

    def tick(self, now: float, alive: Callable[[str], bool]) -> None:
        """Rule 4 (deadlines due), and rule 2 again for alive members not answered within
        ``confirm_every_s``."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, task_id = heapq.heappop(heap)
            held = self._held.get(task_id)
            if held is not None and held.deadline <= now and self._end(task_id, None):
                self.counters.sent_deadline += 1
                self._decisions.append((task_id, Decision.SEND))
        if now < self._poll_at:
            return
        self._poll_at = now + self.confirm_every_s if self._held else float("inf")
        every_s = self.confirm_every_s
        members = {h.member for h in self._held.values() if now - h.asked_at >= every_s}
        for member in sorted(members):
            if alive(member):
                self.member_alive(member, now)

    # -- outputs ---------------------------------------------------------------------------

    def take_decisions(self) -> list[tuple[str, Decision]]:
        out, self._decisions = self._decisions, []
        return out

    def take_confirms(self) -> list[tuple[str, list[str]]]:
        """(forwarder, task ids) to ask in a Confirm each."""
        out, self._confirms = self._confirms, []
        for member, ids in self._asks.items():
            ids = [t for t in ids if t in self._held]
            for i in range(0, len(ids), CONFIRM_IDS_MAX):
                out.append((member, ids[i : i + CONFIRM_IDS_MAX]))
                self.counters.confirms_sent += 1
        self._asks.clear()
        return out

    def next_deadline(self) -> float:
        """When tick() next has work (inf: nothing held)."""
        if not self._held:
            self._deadlines.clear()
            return float("inf")
        while self._deadlines and self._deadlines[0][1] not in self._held:
            heapq.heappop(self._deadlines)
        at = self._deadlines[0][0] if self._deadlines else float("inf")
        return min(at, self._poll_at)

    # -- internals -------------------------------------------------------------------------

    def _end(self, task_id: str, member: str | None) -> bool:
        """Stop holding ``task_id`` (only if held under ``member``, when one is named)."""
        held = self._held.get(task_id)
        if held is None or (member is not None and held.member != member):
            return False
        del self._held[task_id]
        self.bytes -= held.size
        return True
