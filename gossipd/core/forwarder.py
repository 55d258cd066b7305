"""Fan-out, the forwarder's side, sans-IO: get each task to a member that accepts it, and keep
answering for it until that member reports it done.

Inputs (each with the time ``now``, seconds on one monotonic clock):
    route(task, now)         a task from our intake: run it here (LOCAL) or forward it (TAKEN)
    hand_off(task, t0, now, engine_deaths)  give an admitted task to another member (drain,
                             dead engine)
    on_reply(msg, now)       a ForwardReply or TaskDone from a peer
    member_dead(node, now)   membership declared a member dead: migrate what it held for us
    cancel(task_id)          a producer's Cancel for a task we forwarded
    tick(now)                timers: ack timeouts, hedges, backoffs (due at next_deadline())
    local_verdict(id, verdict, now)  admission's verdict on a RunHere (below)
Outputs:
    take_outbox()  [(rpc address, Forward | Withdraw | Cancel)] to send, in order
    take_events()  [Refuse | HandedOff | RunHere]: answer a producer with an error; a
                   hand-off's outcome; offer a task to our own admission (the shell does,
                   and answers with local_verdict before anything else reaches us)

Rules (one code path for each decision):
1. A task is a ``Journey``: its attempts, in placement order, each a Forward that the member
   accepts or refuses within ``ack_timeout_s``.  A refusal or silence moves to the next member
   after a backoff of min(backoff_max_s, backoff_base_s * 2^(n-1)) x U(0.5, 1.5) (no backoff
   for hand-offs, which race a drain), never past the task's deadline and at most
   ``attempts_max`` members.  A member that is ourselves is tried by a ``RunHere`` event:
   the shell offers the task to our admission and gives the verdict back
   (``local_verdict``), which counts as that member's answer.
2. A member that stays silent gets a Withdraw for its copy (a stalled member that resumes
   reads the Forward, then the Withdraw, and answers nothing), and a failure on its breaker.
   Accepts and busy refusals (overloaded, shutting_down) count as successes: it answered.
3. Hedging (``hedge``): when the first attempt's ack takes longer than the ``hedge_quantile``
   of recent ack times, the task goes to the next member too, within ``hedge_budget``.  The
   first copy to accept wins; every other copy is withdrawn, also one accepted later.
4. Accepted tasks sit in the ledger (``ForwardedLedger``) until their TaskDone.  When their
   member is declared dead each is withdrawn from it and dispatched again, same id, to the
   others (migration): the producer's deduplication by id makes the re-run safe.  One past
   its deadline is withdrawn, not dispatched again: its producer gets ``deadline_exceeded``
   (a second answer if the owner had answered: a producer keeps ids resolved for a
   ``timeout_ms`` after their deadline, docs/PROTOCOL.md), or nothing once that window too
   has passed.  An entry whose TaskDone never comes (lost to a partition, or its owner
   restarted and left the task to a member that held it) is forgotten once that window too
   has passed: the ledger is looked through every LEDGER_SWEEP_S while it holds tasks, in
   slices of LEDGER_SWEEP_SLICE (``ForwardedLedger.expire``), so that it does not count
   against its member's load for ever.
5. When no member takes a task, the producer gets one error: ``overloaded`` with the largest
   retry_after_ms heard when some member (ourselves included) refused it as overloaded or
   saturated (cut to ``retry_after_max_ms``; the default hint when none was heard), else
   ``unavailable``;
   the message lists every attempt.  A hand-off that fails is reported (HandedOff ok=False) and answered by the
   caller.
6. The owner check (``owner_check``; docs/PROTOCOL.md "Fresh where placement looks"): every
   Forward asks ``if_free``: the owner refuses it at once with ``saturated`` (and its load
   record) when its own engine is saturated as it reads it, and the next member is tried
   with no backoff (it answered; another member is another queue).  When no member is left
   to try (``attempts_max`` reached, or the order spent) and one refused as saturated, the
   first that did is asked once more without ``if_free`` (so a cluster saturated everywhere
   still queues the task, as without the check), beyond ``attempts_max``.
7. A Cancel is passed on only from the key that submitted the task (``Task.producer_key``),
   with that key, so that the owner checks it too; an ``id_in_use`` refusal (the id is
   another producer's task there, core/admission.py rule 1a) is final: the producer gets it.

Loads: ``loads[m]`` counts, per member, the forwards awaiting an answer plus the accepted
tasks it holds for us; the placement reads the same dict for bounded loads.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Collection, Sequence

from gossipd.core.admission import Verdict
from gossipd.core.breaker import AckTimes, Breaker, BreakerState
from gossipd.core.forwarded import Forwarded, ForwardedLedger
from gossipd.core.journeys import (
    AttemptFailure,
    Flight,
    ForwarderCounters,
    ForwarderSettings,
    HandedOff,
    Journey,
    Placement,
    Refuse,
    Route,
    RunHere,
)
from gossipd.core.messages import PROTOCOL_VERSION, Cancel, ErrorCode, Task
from gossipd.core.peer_messages import Forward, ForwardReply, TaskDone, Withdraw
from gossipd.core.ring import LoadCounts
from gossipd.core.sampling import release_asked

_INF = float("inf")
HEDGE_BURST = 10.0  # hedges allowed back to back before hedge_budget limits them
# Rule 4: how often the ledger is looked through for entries past their producer's window
# (only while it holds tasks), and how many ids one tick looks at (a long ledger is looked
# through in pieces, not in one pause of the loop).
LEDGER_SWEEP_S = 10.0
LEDGER_SWEEP_SLICE = 2048

# What a local attempt's verdict means for the journey.
_TAKEN_HERE = (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE)
_BUSY = (ErrorCode.OVERLOADED.value, ErrorCode.SHUTTING_DOWN.value, ErrorCode.SATURATED.value)
_SATURATED = ErrorCode.SATURATED.value
# A TaskDone that stands for its Forward's accept (on_reply): accepted, and done already.
_ACCEPTED_DONE = ForwardReply(req=0, node="", accepted=True)


# Enum members read per task as globals (Python 3.11: ~80 ns through the class, see
# core/admission.py).
_LOCAL, _TAKEN = Route.LOCAL, Route.TAKEN


# Timer kinds, in the heap as (at, seq, kind, object); stale entries are skipped.
_ACK, _HEDGE, _RETRY = 0, 1, 2
_HALF_OPEN = BreakerState.HALF_OPEN


class Forwarder:
    def __init__(
        self,
        settings: ForwarderSettings,
        *,
        node: str,
        placement: Placement,
        rng: random.Random,
        loads: LoadCounts | None = None,
        local_ids: set[str] | None = None,
        boot: int = 0,
        relay_routes: Collection[str] = (),
    ) -> None:
        self.settings = settings
        self.node = node
        self.boot = boot  # this process's start (Forward.boot), from the shell's clock
        # Reply routes served in this process (the HTTP door's): their tasks' Forwards ask
        # the owner to relay the replies back on our connection (Forward.relay).
        self.relay_routes = relay_routes
        self._placement = placement
        self._here: dict[str, Journey] = {}  # task id -> its journey, awaiting local_verdict
        self._rng = rng
        self.loads = LoadCounts() if loads is None else loads
        self.ledger = ForwardedLedger(
            self.loads,
            entries_max=settings.forwarded_max,
            bytes_max=settings.forwarded_bytes_max,
        )
        self.counters = ForwarderCounters()
        # Tasks from our intake that run here, unfinished: our own load as placement sees it.
        self.local_ids: set[str] = set() if local_ids is None else local_ids
        self._flights: dict[int, Flight] = {}
        self._flying: dict[str, Journey] = {}  # task id -> its journey, while forwards fly
        self._backing_off: dict[str, Journey] = {}  # ...while none flies: a retry waits
        self._req = 0
        self._breakers: dict[str, Breaker] = {}
        # Each member's rpc address when we last forwarded to it: still known once the member
        # is declared dead and gone from the live view (its copies are withdrawn there).
        self._last_addr: dict[str, str] = {}
        self._timers: list[tuple[float, int, int, Flight | Journey]] = []
        # Ack timeouts of full length (the common case) are due in the order they were set:
        # a FIFO instead of the heap (append and popleft instead of heap operations).
        self._acks: deque[tuple[float, Flight]] = deque()
        self._seq = 0
        self._ack_times = AckTimes(quantile=settings.hedge_quantile)
        self._hedge_credit = HEDGE_BURST
        self._outbox: list[tuple[str, Forward | Withdraw | Cancel]] = []
        self._events: list[Refuse | HandedOff | RunHere] = []
        self._sweep_at = _INF  # the ledger's next look (rule 4); inf while it is empty
        self._sweeping: list[str] = []  # ids still to look at in this look

    # -- inputs ----------------------------------------------------------------------------

    def route(self, task: Task, now: float) -> Route:
        """A new task from our intake."""
        if task.id in self.local_ids:  # a resend of one we run: admission absorbs it
            self.counters.local += 1
            return _LOCAL
        # A resend of a task on its way (a journey) or run for us by a live member, to the
        # same route: that copy's answer is the resend's, so nothing is sent.  Placed anew
        # it could run a second time where placement by load points now, both answering.
        if self._absorbing(task) is not None:
            self.counters.resends_absorbed += 1
            return _TAKEN
        owner = self._placement.owner_for(task, now)
        if owner is None:
            self.counters.unavailable += 1
            message = f"no live member serves model {task.model!r}"
            if (needed := release_asked(task.params)) is not None:
                release = ".".join(map(str, needed))
                message += (
                    f" and reads this task's params (members before release {release} refuse "
                    "what it asks: add_special_tokens false, as chats ask, from 0.3.6; "
                    "logit_bias and stop_token_ids from 0.3.5; prompt_logprobs "
                    "and token-id prompts from 0.3.4; logprobs from 0.3.3; a penalty, min_p, "
                    "min_tokens or structured output from 0.3.2)"
                )
            self._events.append(
                Refuse(task, ErrorCode.UNAVAILABLE, message, self.settings.retry_after_ms)
            )
            return Route.TAKEN
        if owner == self.node:
            self.counters.local += 1
            self.local_ids.add(task.id)
            return _LOCAL
        journey = Journey(task, now, now + task.timeout_ms / 1000.0, False, frozenset())
        self._attempt(journey, owner, now)
        return _TAKEN

    def forwarded_for_other(self, task: Task) -> bool:
        """Rule 7's id_in_use as far as this member knows: it is forwarding ``task``'s id,
        or answers for it until its TaskDone, for another producer key (the ingress refuses
        the task then).  A journey waiting out a backoff is still on its way."""
        j = self._flying.get(task.id) or self._backing_off.get(task.id)
        if j is not None and j.task.producer_key != task.producer_key:
            return True
        entry = self.ledger.get(task.id)
        return entry is not None and entry.task.producer_key != task.producer_key

    def forwarded_here(self, task: Task) -> bool:
        """``task`` is a resend that ``route`` absorbs (token budgets do not charge it
        again): this member is forwarding its id for the same producer key and route, or a
        live member runs it for us until its TaskDone.  A resend to another route is placed
        anew, and runs again: charged."""
        copy = self._absorbing(task)
        return copy is not None and copy.producer_key == task.producer_key

    def _absorbing(self, task: Task) -> Task | None:
        """The copy of ``task`` on its way (a journey: in the air, or waiting out a backoff),
        or run for us by a live member, to the same route, whose answer is the resend's;
        None: there is none."""
        j = self._flying.get(task.id) or self._backing_off.get(task.id)
        if j is not None:
            return j.task if j.task.route == task.route else None
        entry = self.ledger.get(task.id)
        if (
            entry is not None
            and entry.task.route == task.route
            and self._placement.addr(entry.owner) is not None
        ):
            return entry.task
        return None

    def hand_off(self, task: Task, received_at: float, now: float, engine_deaths: int = 0) -> None:
        """Give an admitted task to another member; a HandedOff event tells the outcome.
        ``engine_deaths``: engines that died running it, ours included (Forward's field)."""
        me = frozenset({self.node})
        journey = Journey(task, received_at, received_at + task.timeout_ms / 1000.0, True, me)
        journey.engine_deaths = engine_deaths
        journey.order = self._placement.order(task, now, exclude=me)
        self._next(journey, now)

    def on_reply(self, msg: object, now: float) -> None:
        if isinstance(msg, ForwardReply):
            flight = self._flights.get(msg.req)
            if flight is not None and flight.member == msg.node:  # (its own forward's only)
                self._answered(flight, msg, now)
        elif isinstance(msg, TaskDone):
            # A TaskDone while the forward still awaits its accept: the owner's accept was
            # still held when the task ended, so it stands for it (fanout/owner.py), or the
            # accept was lost.  Either way the member ran the task: taken as accepted and
            # done in one (nothing ledgered; the flight lands, so an accept that comes after
            # all finds none), instead of timing out and running the task again elsewhere.
            j = self._flying.get(msg.id)
            if j is not None:
                for flight in j.flights:
                    if flight.live and flight.member == msg.node:
                        self._answered(flight, _ACCEPTED_DONE, now)
                        return
            self.ledger.done(msg.id, msg.node)

    def member_dead(self, node: str, now: float) -> int:
        """Migrate the tasks ``node`` held for us; how many were dispatched again.  (A
        Forward to it still awaiting its ForwardReply waits on: an accept arriving after this
        migrates its task at once, in ``_accepted``.)"""
        moved = 0
        for entry in self.ledger.owned_by(node):
            moved += self._migrate(entry, node, now)
        return moved

    def _migrate(self, entry: Forwarded, node: str, now: float) -> int:
        """Dispatch ``entry``'s task again, off ``node``, which is dead in our view; 1 when it
        went, 0 when it was past its deadline."""
        self.ledger.forget(entry.task.id)
        # It may only have stalled: withdraw its copy, so that if it comes back it drops
        # the task instead of running it beside the migrated one.
        self._withdraw(node, entry.task.id)
        task = entry.task
        if entry.cancelled:  # its producer cancelled it: ended here, not run again
            self.counters.cancelled_not_migrated += 1
            if now < entry.window_ends():  # (past it nothing is answered: rule 4)
                why = f"cancelled by the producer; its owner {node} died before it said so"
                self._events.append(Refuse(task, ErrorCode.CANCELLED, why, 0))
            return 0
        timeout_s = task.timeout_ms / 1000.0
        deadline = entry.received_at + timeout_s
        if deadline <= now:  # rule 4: past its deadline
            self.counters.expired_not_migrated += 1
            if now < deadline + timeout_s:
                message = f"its owner {node} died after the deadline of {task.timeout_ms} ms"
                self._events.append(Refuse(task, ErrorCode.DEADLINE_EXCEEDED, message, 0))
            return 0
        self.counters.migrated += 1
        gone = frozenset({node})
        journey = Journey(task, entry.received_at, deadline, False, gone)
        journey.engine_deaths = entry.engine_deaths  # (its taker counts on from there)
        journey.order = self._placement.order(task, now, exclude=gone)
        self._next(journey, now)
        return 1

    def cancel(self, task_id: str, producer_key: str = "") -> str | None:
        """Pass a producer's Cancel, from ``producer_key``, to the member running a task we
        forwarded: "forwarded"; "refused" when the task is another key's (rule 7); None when
        we hold no such task."""
        entry = self.ledger.get(task_id)
        if entry is None:
            return self._cancel_in_flight(task_id, producer_key)
        if entry.task.producer_key != producer_key:
            return "refused"
        # Remembered with the task: should its owner die before the Cancel lands (sent to a
        # dead address), a migration would run the task again for nobody.
        entry.cancelled = True
        self._send_cancel(entry.owner, task_id, producer_key)
        return "forwarded"

    def _send_cancel(self, member: str, task_id: str, producer_key: str) -> None:
        """A Cancel to ``member``: at its address, or at its last known one when it has left
        our view (alive, it still runs the task; dead, its death ends the task here)."""
        addr = self._placement.addr(member) or self._last_addr.get(member)
        if addr is not None:
            cancel = Cancel(v=PROTOCOL_VERSION, id=task_id, producer_key=producer_key)
            self._outbox.append((addr, cancel))

    def moved(
        self, task_id: str, owner: str, to: str, engine_deaths: int = 0, now: float = 0.0
    ) -> bool:
        """``owner`` handed ``task_id``, which we forwarded to it, over to ``to`` (a Moved):
        we answer for it there now, so that ``to``'s death migrates it (``owner``, drained
        and gone, would not), with ``engine_deaths`` (Moved's).  ``to`` already out of our
        view (declared dead as the hand-off was accepted): migrated at once, as no later
        death event would.  False: not ours at ``owner`` (ignored)."""
        entry = self.ledger.get(task_id)
        if entry is None or entry.owner != owner:
            return False
        self.ledger.forget(task_id)
        if to != self.node:  # (handed back to us: it runs here, nothing to answer for)
            deaths = max(entry.engine_deaths, engine_deaths)
            self.ledger.accepted(entry.task, to, entry.received_at, entry.cancelled, deaths)
            if self._placement.addr(to) is None:
                moved_to = self.ledger.get(task_id)
                if moved_to is not None:
                    self._migrate(moved_to, to, now)
            elif entry.cancelled:  # (its Cancel reached the owner that handed it over, or not)
                self._send_cancel(to, task_id, entry.task.producer_key)
        self.counters.moved += 1
        return True

    def stop_handed_off(self, task: Task, to: str, *, withdrawn: bool) -> None:
        """``task``, which we handed to ``to`` (at drain, or our engine dead), was stopped
        here while it was offered: withdrawn by its forwarders (a copy elsewhere answers) or
        cancelled by its producer.  The stop follows it to ``to``, which would otherwise run
        it for nobody, or answer it ok after our Cancel's "here"."""
        if withdrawn:
            self._withdraw(to, task.id)  # (its Forward recorded ``to``'s address)
            return
        entry = self.ledger.get(task.id)
        if entry is not None and entry.owner == to:
            entry.cancelled = True  # (ours to answer for: its owner's death ends it, see cancel)
        self._send_cancel(to, task.id, task.producer_key)

    def _cancel_in_flight(self, task_id: str, producer_key: str) -> str | None:
        """A Cancel for a task no member has accepted yet (its Forward awaits the accept, or
        a retry waits out its backoff): each copy in the air is followed by the Cancel, on
        the same connection (read after it: the owner aborts what it admitted); with none in
        the air the task ends here, answered cancelled.  It was dropped ("unknown") and the
        task ran to its end.  A copy that then fails (refused, silent, its member dead) sends
        the task on uncancelled, as before: ending it here instead, or following each copy
        sent on with the Cancel, made the fan-out simulator's partition+crash runs answer
        more tasks twice (a member's journal re-ran copies no forwarder knew any more)."""
        j = self._flying.get(task_id) or self._backing_off.get(task_id)
        if j is None or j.ended or j.quiet or j.winner:
            return None
        if j.task.producer_key != producer_key:
            return "refused"
        cancel = Cancel(v=PROTOCOL_VERSION, id=task_id, producer_key=producer_key)
        live = [f for f in j.flights if f.live]
        j.cancelled = True  # (an accept ledgers it so: a death then ends it, see cancel)
        for flight in live:
            addr = self._last_addr.get(flight.member)
            if addr is not None:
                self._outbox.append((addr, cancel))
        if not live:
            j.waiting = False  # (its retry timer finds it so: skipped)
            self._backing_off.pop(task_id, None)
            why = "cancelled by the producer before a member took it"
            self._events.append(Refuse(j.task, ErrorCode.CANCELLED, why, 0))
            self._end(j, ok=False)
        return "forwarded"

    def local_finished(self, task_id: str) -> None:
        """A task we kept (route() said LOCAL, or a retry admitted it here) has ended."""
        self.local_ids.discard(task_id)

    def tick(self, now: float) -> None:
        acks = self._acks
        while acks and acks[0][0] <= now:
            flight = acks.popleft()[1]
            if flight.live:
                self._timed_out(flight, now)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, obj = heapq.heappop(timers)
            if kind == _ACK:
                assert isinstance(obj, Flight)
                if obj.live:
                    self._timed_out(obj, now)
            elif kind == _HEDGE:
                assert isinstance(obj, Flight)
                if obj.live and obj.hedge_armed:
                    self._hedge(obj, now)
            else:
                assert isinstance(obj, Journey)
                if obj.waiting:
                    obj.waiting = False
                    self._backing_off.pop(obj.task.id, None)
                    self._next(obj, now, backed_off=True)
        if now >= self._sweep_at:
            self._sweep(now)

    # -- outputs ---------------------------------------------------------------------------

    # Taken after every input (once per forwarded task): nothing to take costs no new list.
    def take_outbox(self) -> Sequence[tuple[str, Forward | Withdraw | Cancel]]:
        if not self._outbox:
            return ()
        out, self._outbox = self._outbox, []
        return out

    def take_events(self) -> Sequence[Refuse | HandedOff | RunHere]:
        if not self._events:
            return ()
        out, self._events = self._events, []
        return out

    def next_deadline(self) -> float:
        """When tick() next has work (inf: none).  Skips timers that no longer matter."""
        at = self._flights_deadline()
        if self._sweep_at < at and self.ledger.entries:  # (an empty ledger: no look)
            return self._sweep_at
        return at

    def settled(self) -> bool:
        """Every forward has its answer and no retry or hedge is pending (what a stop waits
        for; the ledger's looks do not count: its tasks run at their members)."""
        return self._flights_deadline() == _INF

    def _flights_deadline(self) -> float:
        """When the next ack timeout, hedge or retry is due (inf: none)."""
        timers = self._timers
        while timers and not _matters(timers[0]):
            heapq.heappop(timers)
        acks = self._acks
        while acks and not acks[0][1].live:
            acks.popleft()
        at = timers[0][0] if timers else _INF
        return min(at, acks[0][0]) if acks else at

    def in_flight(self) -> int:
        """The sum of ``loads``: forwards awaiting an answer plus ledgered tasks (each counts
        one against its member), worked out from their sizes, not kept per change."""
        return len(self._flights) + len(self.ledger.entries)

    def take_all(
        self,
    ) -> tuple[
        Sequence[tuple[str, Forward | Withdraw | Cancel]],
        Sequence[Refuse | HandedOff | RunHere],
        float,
    ]:
        """take_outbox(), take_events() and next_deadline() in one call (once per flush)."""
        return self.take_outbox(), self.take_events(), self.next_deadline()

    def last_addr(self, member: str) -> str | None:
        """The member's rpc address when we last forwarded to it (also once it is gone)."""
        return self._last_addr.get(member)

    def pending(self) -> int:
        """Forwards awaiting their answer."""
        return len(self._flights)

    def outstanding(self) -> dict[str, int]:
        """Per member: tasks we sent it (or are sending) that it has not reported done."""
        return {m: n for m, n in self.loads.items() if n}

    # -- attempts --------------------------------------------------------------------------

    def _attempt(self, j: Journey, member: str, now: float) -> None:
        """Try ``member`` now; on a failure that needs no answer, go on to the next one."""
        j.tried.append(member)
        if member == self.node:
            # Counted as ours at once (placement reads local_ids for our load): the shell
            # answers after this input is done, and the tasks placed meanwhile (a migration
            # of many) must see those already offered to us.
            self.local_ids.add(j.task.id)
            self._here[j.task.id] = j
            self._events.append(RunHere(j.task, j.received_at))
            return
        addr = self._placement.addr(member)
        if addr is None:
            self._failed(j, member, AttemptFailure.NOT_A_MEMBER, now)
            return
        # (after the address: a half-open breaker's allow() hands out its one trial, which
        # only a Forward sent gives back)
        breaker = self._breaker(member)
        if not breaker.allow(now):
            self._failed(j, member, AttemptFailure.CIRCUIT_OPEN, now)
            return
        self._send_forward(j, member, addr, breaker, now)

    def local_verdict(
        self, task_id: str, verdict: Verdict, now: float, retry_after_ms: int = 0
    ) -> None:
        """Our admission's verdict on the RunHere for ``task_id``: taken here, or the next
        member (as a refusal from a peer would; ``retry_after_ms``: its hint, 0: none)."""
        j = self._here.pop(task_id, None)
        if j is None:
            return
        if verdict not in _TAKEN_HERE or verdict is Verdict.DUPLICATE_DONE:
            self.local_ids.discard(task_id)  # nothing of it runs here (done already, or no)
        if j.ended:
            return
        if verdict in _TAKEN_HERE:
            self.counters.local += 1
            self._end(j, ok=True)
            return
        if verdict is Verdict.CONFLICT:
            j.attempts.append(f"{self.node}: {verdict.value}")
            self._refuse_final(j, ErrorCode.ID_IN_USE)
            return
        if verdict is Verdict.OVERLOADED:  # (our own refusal counts as a member's: rule 5)
            hint = retry_after_ms or self.settings.retry_after_ms
            j.busy_hint_ms = max(j.busy_hint_ms, hint)
        self._failed(j, self.node, verdict.value, now)

    def _send_forward(
        self, j: Journey, member: str, addr: str, breaker: Breaker, now: float
    ) -> Flight:
        self._last_addr[member] = addr
        self._req += 1
        req = self._req
        remaining_s = j.deadline - now
        forward = Forward(
            req=req,
            src=self.node,
            task=j.task,
            remaining_ms=max(1, int(remaining_s * 1000)),
            attempt=len(j.tried),
            if_free=self.settings.owner_check and not j.plain,
            boot=self.boot,
            relay=bool(self.relay_routes) and j.task.route in self.relay_routes,
            engine_deaths=j.engine_deaths,
        )
        self._outbox.append((addr, forward))
        flight = Flight(req, member, j, breaker, now)
        if breaker.state is _HALF_OPEN:  # (allowed: the trial)
            flight.trial = breaker.trials
        self._flights[req] = flight
        j.flights.append(flight)
        j.live += 1
        self._flying[j.task.id] = j
        # Counted against the member at once: the tasks routed next must see it.
        loads = self.loads  # LoadCounts, its total kept here: no Python call a task
        dict.__setitem__(loads, member, loads.get(member, 0) + 1)
        loads.total += 1
        ack_timeout_s = self.settings.ack_timeout_s
        if remaining_s >= ack_timeout_s:
            timeout_s = ack_timeout_s
            self._acks.append((now + timeout_s, flight))  # due after every ack set before it
        else:  # cut to the task's deadline: out of order, so in the heap
            timeout_s = max(0.0, remaining_s)
            self._timer(now + timeout_s, _ACK, flight)
        if self.settings.hedge and len(j.tried) == 1 and not j.quiet:
            self._arm_hedge(flight, timeout_s, now)
        return flight

    def _answered(self, flight: Flight, reply: ForwardReply, now: float) -> None:
        self._land(flight)
        if self.settings.hedge:  # (only hedging reads them)
            self._ack_times.observe(now - flight.sent_at)
        j = flight.journey
        if reply.accepted or reply.code in _BUSY:
            flight.breaker.success()  # it answered: healthy, maybe busy
        if reply.accepted:
            self._accepted(flight, now, done=reply is _ACCEPTED_DONE)
            return
        if reply.code == _SATURATED:  # rule 6: the next member at once
            j.saturated = j.saturated or flight.member
            j.busy_hint_ms = max(j.busy_hint_ms, reply.retry_after_ms)
            j.attempts.append(f"{flight.member}: {reply.code}")
            if not (j.winner or j.ended or j.live):
                self._next(j, now, backed_off=True)
            return
        if reply.code == ErrorCode.OVERLOADED:
            j.busy_hint_ms = max(j.busy_hint_ms, reply.retry_after_ms)
        elif reply.code == ErrorCode.ID_IN_USE:
            j.attempts.append(f"{flight.member}: {reply.code}")
            self._refuse_final(j, ErrorCode.ID_IN_USE)
            return
        self._failed(j, flight.member, reply.code, now)

    def _accepted(self, flight: Flight, now: float, *, done: bool = False) -> None:
        """``done``: the member's TaskDone stood for its accept (the task ended there)."""
        j = flight.journey
        if j.winner:  # a copy that lost accepted after all: take it back
            self._withdraw(flight.member, j.task.id)
            return
        if j.quiet and not done and self._placement.addr(flight.member) is None:
            # A hand-off accepted by a member declared dead meanwhile (accepts leave after
            # ack_delay_s): handed to it, the task would be released here and run nowhere.
            # A failed attempt instead (and its copy withdrawn, should it live after all).
            # (Not when its TaskDone stood for the accept: it ran there.)
            self._withdraw(flight.member, j.task.id)
            self._failed(j, flight.member, AttemptFailure.NO_REPLY, now)
            return
        j.winner = flight.member
        if flight.hedge:
            self.counters.hedge_wins += 1
        first = j.flights[0]
        if first.live:
            # The first member was outrun by a hedge: a failure for its breaker, so that a
            # member that keeps stalling is skipped outright rather than hedged task after
            # task.  (A first copy that landed has had its say: an answer counts as a
            # success, a timeout as its one failure; a retry accepted after it is no win.)
            first.breaker.failure(now)
        for other in j.flights:
            if other.live:
                self._land(other)
                self._withdraw(other.member, j.task.id)
        if not j.quiet:
            self.counters.forwarded += 1
        if done:  # nothing to answer for any more: remembered as that member's
            self.ledger.finished(j.task.id, flight.member)
            self._end(j, ok=True, done=True)
            return
        self.ledger.accepted(j.task, flight.member, j.received_at, j.cancelled, j.engine_deaths)
        if self._sweep_at == _INF:
            self._sweep_at = now + LEDGER_SWEEP_S
        self._end(j, ok=True)
        if self._placement.addr(flight.member) is None and not j.quiet:
            # Accepted after the member left our view (declared dead: accepts leave after
            # ack_delay_s): no later death event would migrate it (it was forgotten at
            # twice its timeout, unanswered), so it is migrated now.
            entry = self.ledger.get(j.task.id)
            if entry is not None:
                self._migrate(entry, flight.member, now)

    def _timed_out(self, flight: Flight, now: float) -> None:
        self._land(flight)
        flight.breaker.failure(now)
        self.counters.attempts_failed += 1
        self._withdraw(flight.member, flight.journey.task.id)
        self._failed(flight.journey, flight.member, AttemptFailure.NO_REPLY, now)

    def _failed(self, j: Journey, member: str, outcome: str, now: float) -> None:
        j.attempts.append(f"{member}: {outcome}")
        if j.winner or j.ended or j.live:
            return  # another copy won, or may yet
        self._next(j, now)

    def _next(self, j: Journey, now: float, *, backed_off: bool = False) -> None:
        """Try the next member (after a backoff), or give up."""
        if j.ended:
            return
        if j.order is None:
            tried = set(j.tried) | j.exclude
            j.order = [
                m for m in self._placement.order(j.task, now, exclude=j.exclude) if m not in tried
            ]
        while j.order and j.order[0] in j.tried:  # (a hedge went there meanwhile)
            j.order.pop(0)
        s = self.settings
        if not j.order or len(j.tried) >= s.attempts_max:
            if j.saturated and not j.plain and now < j.deadline:  # rule 6: asked plainly
                j.plain = True
                self._attempt(j, j.saturated, now)
                return
            self._give_up(j)
            return
        if now >= j.deadline:
            j.attempts.append(str(AttemptFailure.DEADLINE))
            self._give_up(j)
            return
        n = len(j.tried)
        if n and not j.quiet and not backed_off:
            backoff = min(s.backoff_max_s, s.backoff_base_s * 2 ** (n - 1))
            wait = min(backoff * (0.5 + self._rng.random()), j.deadline - now)
            j.waiting = True
            self._backing_off[j.task.id] = j
            self._timer(now + wait, _RETRY, j)
            return
        self._attempt(j, j.order.pop(0), now)

    def _give_up(self, j: Journey) -> None:
        if j.quiet:
            self._end(j, ok=False)
            return
        self.counters.unavailable += 1
        attempts = j.attempts or ["none"]
        # Someone said overloaded (with a hint): the producer should come back then, not
        # treat the cluster as down, even if a dead member was among the attempts.
        # (saturated members, rule 6, are busy too: a plain ask of one that fails after
        # them still answers overloaded, as PROTOCOL.md says)
        code = ErrorCode.OVERLOADED if j.busy_hint_ms or j.saturated else ErrorCode.UNAVAILABLE
        message = "no member took the task; attempts: " + "; ".join(attempts)
        # (a member's hint, cut to ours: a member's word, not to be passed on unbounded)
        hint = min(j.busy_hint_ms, self.settings.retry_after_max_ms) or self.settings.retry_after_ms
        self._events.append(Refuse(j.task, code, message, hint))
        j.ended = True
        j.flights = []  # see _end

    def _refuse_final(self, j: Journey, code: ErrorCode) -> None:
        """A refusal that another member would not change (rule 7): answer it now.  (The
        journey is live: a winner's or an ended journey's other flights have landed.)"""
        for other in j.flights:
            if other.live:
                self._land(other)
                self._withdraw(other.member, j.task.id)
        if j.quiet:
            self._end(j, ok=False)
            return
        message = "the task was refused; attempts: " + "; ".join(j.attempts)
        self._events.append(Refuse(j.task, code, message, 0))
        self._end(j, ok=False)

    def _end(self, j: Journey, *, ok: bool, done: bool = False) -> None:
        j.ended = True
        # Break the Journey <-> Flight cycle: freed by reference counting at once instead of
        # piling up for the cyclic garbage collector (whose passes cost p99 latency).
        j.flights = []
        if j.quiet:
            if ok:
                self.counters.handed_off += 1
            self._events.append(HandedOff(j.task, ok, j.winner if ok else "", done))

    def _land(self, flight: Flight) -> None:
        """A flight's wait is over (answered, timed out or withdrawn)."""
        flight.live = False
        flight.hedge_armed = False
        if flight.trial:  # (a verdict, if any, comes after this, from the caller)
            flight.breaker.end_trial(flight.trial)
        del self._flights[flight.req]
        loads = self.loads  # as in _attempt
        dict.__setitem__(loads, flight.member, loads[flight.member] - 1)
        loads.total -= 1
        j = flight.journey
        j.live -= 1
        if not j.live and self._flying.get(j.task.id) is j:
            del self._flying[j.task.id]

    def _withdraw(self, member: str, task_id: str) -> None:
        """``member``'s copy of ``task_id`` is no longer ours (the task moved on, or ended):
        tell it to drop the copy, and remember that it moved off it, so that the member,
        asking by Confirm before it answers (a Forward that arrived late, after a cut), hears
        "migrated" and drops its Result even when the Withdraw is lost or overtaken."""
        self.ledger.moved_off(task_id, member)
        addr = self._last_addr.get(member)
        if addr is not None:
            self._outbox.append((addr, Withdraw(id=task_id, node=self.node)))
            self.counters.withdrawn += 1

    # -- hedging ---------------------------------------------------------------------------

    def _arm_hedge(self, flight: Flight, timeout_s: float, now: float) -> None:
        s = self.settings
        self._hedge_credit = min(HEDGE_BURST, self._hedge_credit + s.hedge_budget)
        usual = self._ack_times.quantile()
        if usual is None:
            return  # no estimate of a normal ack time yet
        delay = max(s.hedge_min_s, usual)
        if delay < timeout_s:
            flight.hedge_armed = True
            self._timer(now + delay, _HEDGE, flight)

    def _hedge(self, flight: Flight, now: float) -> None:
        """The first member is slower to ack than usual: send the task to the next one too."""
        flight.hedge_armed = False
        if self._hedge_credit < 1.0:
            self.counters.hedges_over_budget += 1
            return
        j = flight.journey
        # (not a member this journey tried already: one that refused it, saturated or busy,
        # would be asked again with if_free, which rule 6 keeps for one plain re-ask)
        order = self._placement.order(
            j.task, now, exclude=frozenset({flight.member, self.node, *j.tried, *j.exclude})
        )
        if not order:
            return
        member = order[0]
        addr = self._placement.addr(member)
        if addr is None:
            return
        breaker = self._breaker(member)
        if not breaker.allow(now):
            return
        j.tried.append(member)
        self._send_forward(j, member, addr, breaker, now).hedge = True
        self._hedge_credit -= 1.0
        self.counters.hedged += 1

    def _breaker(self, member: str) -> Breaker:
        """The member's circuit breaker (closed when first asked for)."""
        breaker = self._breakers.get(member)
        if breaker is None:
            s = self.settings
            breaker = self._breakers[member] = Breaker(
                failures_max=s.breaker_failures, open_s=s.breaker_open_s
            )
        return breaker

    def _sweep(self, now: float) -> None:
        """Rule 4: forget ledgered tasks past their producer's window, a slice at a time."""
        ids = self._sweeping
        if not ids:
            ids = self._sweeping = list(self.ledger.entries)
        piece = ids[-LEDGER_SWEEP_SLICE:]
        del ids[-LEDGER_SWEEP_SLICE:]
        self.ledger.expire(piece, now)
        if ids:
            self._sweep_at = now  # the next slice at the next tick
        else:
            self._sweep_at = now + LEDGER_SWEEP_S if self.ledger.entries else _INF
            self._forget_gone()

    def _forget_gone(self) -> None:
        """Members out of our view that hold nothing of ours (no forward awaiting its
        answer, no task: ``loads`` 0) lose their address, breaker and load count here: a
        cluster whose names churn kept one of each for every name it ever forwarded to."""
        loads = self.loads
        for member in [m for m in self._last_addr if self._placement.addr(m) is None]:
            if not loads.get(member, 0):
                del self._last_addr[member]
                self._breakers.pop(member, None)
                loads.pop(member, 0)

    def _timer(self, at: float, kind: int, obj: Flight | Journey) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (at, self._seq, kind, obj))


def _matters(entry: tuple[float, int, int, Flight | Journey]) -> bool:
    _, _, kind, obj = entry
    if kind == _ACK:
        return bool(obj.live)
    if kind == _HEDGE:
        return obj.hedge_armed  # type: ignore[union-attr]
    return obj.waiting  # type: ignore[union-attr]
