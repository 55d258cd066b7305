"""The owner's side of fan-out as a core: what a Forward asks of this member, and what it
answers (sans-IO).  The daemon's ROUTER endpoint (``fanout/owner.py``) and the simulator's
daemons (``simulations/fanout_daemon.py``) both drive it.

A Forward goes through two steps, so that admission (the shell's: its run queue, journal and
cached answers) stays outside and nothing here calls back into the shell:

1. ``forward(identity, msg, now, saturated)``: refused at once (``Refused``: the reply to
   send, and why) or to be offered to admission (``Admit``: the task and when it came in at
   its entry point, ``now`` less the time it has spent):
   - a Forward of another protocol version, or whose task the ingress would refuse from a
     producer (its size against ``task_bytes_max``): ``invalid``, with the code and reason;
   - ``if_free`` while our engine is saturated (the owner check of issue 17): ``saturated``;
   - one from an earlier process of its sender than one we have heard from (``boot``
     older than the latest we saw: it waited in a dead process's connection): ``stale``,
     refused ``unavailable``, never run.
2. ``admitted(msg, verdict, retry_after_ms, load)``: admission's verdict as the reply.
   A task admitted, or already here (running, or done: its cached Result was just sent
   again, or not, by admission's rule 5), is accepted; the forwarder then waits for its
   TaskDone, which a task already done gets at once (``Reply.done_now``).  Every other verdict is a refusal with its code and
   the retry hint.

3. After the task ends, its forwarders hear a TaskDone, never before its Result has left
   (``task_finished`` says who, by connection identity or, for a task re-run from our
   journal, by member name; ``results_left(route, load)`` gives the TaskDones once every
   reply to that route so far has left: the shell asks its reply sender to say when).
   The load rule: the first reply queued for a forwarder between two flushes carries our
   load record (``wants_load``; ``flushed`` starts the next message), one record a message.
4. A Withdraw (``withdrawn``): the task book drops that forwarder's copy (core/lifecycle.py
   rule 3); when it had ended here already, its Result may be held for that forwarder
   (core/heldresults.py): the member to tell them is returned.

It also keeps which member forwarded on each connection identity (``member_of``): whose a
held Result is (``core/heldresults.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from gossipd.core.admission import Verdict
from gossipd.core.codec import check_forwarded_task
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.lifecycle import ANY, Owned
from gossipd.core.messages import PROTOCOL_VERSION, ErrorCode, Task
from gossipd.core.peer_messages import Forward, ForwardReply, TaskDone
from gossipd.errors import RemoteProtocolError

# Connection identities (and senders' boots) remembered: bounded, the oldest forgotten first.
MEMBER_OF_MAX = 4096

_ACCEPTED = (Verdict.ADMIT, Verdict.DUPLICATE_PENDING, Verdict.DUPLICATE_DONE)
_DUPLICATE_DONE = Verdict.DUPLICATE_DONE


@dataclass(slots=True)
class OwnerCounters:
    accepted_from_peers: int = 0
    refused_to_peers: int = 0
    bad_peer_messages: int = 0
    replies_dropped: int = 0  # acks and TaskDones refused: the connection gone or full
    withdrawn_by_peers: int = 0  # copies a forwarder withdrew from us before they finished
    invalid_from_peers: int = 0  # Forwards whose task the ingress would refuse (version, size)
    refused_unauthorised: int = 0  # CURVE: a revoked key, or a source not the key's node
    refused_saturated: int = 0  # Forwards with if_free refused: our engine is saturated
    refused_stale: int = 0  # Forwards from an earlier process of their sender (Forward.boot)
    replies_relayed: int = 0  # replies sent back on a forwarder's connection (Forward.relay)
    relays_by_socket: int = 0  # ...that could not go on it, sent to the route's socket
    relays_refused: int = 0  # Forward.relay for a route not its sender's own (CURVE)
    accepts_in_done: int = 0  # accepts not sent: their task's TaskDone stood for them


@dataclass(frozen=True, slots=True)
class Refused:
    """Send ``reply`` (a refusal) now; ``why`` and ``hint`` are for the shell's log."""

    reply: ForwardReply
    why: Literal["invalid", "saturated", "stale"]
    hint: str = ""


# Admit and Reply are made once a forwarded task: not frozen (a frozen dataclass costs
# ~0.5 us to build here, a plain one ~0.2 us).
@dataclass(slots=True)
class Admit:
    """Offer ``task`` to admission as received at ``received_at``; ``with_load``: its reply
    is the first queued for its forwarder since the last flush, and carries our load (the
    load rule, ``wants_load``)."""

    task: Task
    received_at: float
    with_load: bool


@dataclass(slots=True)
class Reply:
    """Admission's verdict as the forwarder hears it; ``done_now``: the task was done already
    (its cached Result sent again, or not: admission's rule 5): its TaskDone follows."""

    reply: ForwardReply
    accepted: bool
    done_now: bool


class Owner:
    """The owner's decisions on the Forwards peers send it."""

    def __init__(self, *, node: str, task_bytes_max: int = 1 << 62) -> None:
        self.node = node
        self.task_bytes_max = task_bytes_max
        self.counters = OwnerCounters()
        # Each forwarder's connection identity -> its node (Forward.src).
        self.member_of: dict[Hashable, str] = {}
        # The latest Forward.boot heard from each member (a stale Forward's is older), and,
        # for a member declared dead since, the boot of that dead process: its Forwards
        # still in flight are stale, the next process's are not, whatever its clock says.
        self._boots: dict[str, int] = {}
        self._dead_boots: dict[str, int] = {}
        # TaskDones waiting for their Results to leave, by the Results' route:
        # (task id, forwarder identities, member by name).
        self._done_waiting: dict[str, list[tuple[str, Sequence[Hashable], str]]] = {}
        # Forwarders whose message being queued carries our load already.
        self._loaded: set[Hashable] = set()

    def forward(
        self, identity: Hashable, msg: Forward, now: float, *, saturated: bool = False
    ) -> Refused | Admit:
        refused = self._invalid(msg)
        if refused is not None:
            return refused
        if msg.if_free and saturated:
            self.counters.refused_to_peers += 1
            self.counters.refused_saturated += 1
            reply = ForwardReply(
                req=msg.req, node=self.node, accepted=False, code=ErrorCode.SATURATED.value
            )
            return Refused(reply, "saturated")
        if msg.boot and self._stale(msg):
            self.counters.refused_stale += 1
            self.counters.refused_to_peers += 1
            hint = "a Forward from an earlier process of its sender (Forward.boot)"
            return Refused(self._refusal(msg, ErrorCode.UNAVAILABLE.value, hint), "stale", hint)
        member_of = self.member_of
        # Most recently used last: the bound forgets the connection idle longest, not a
        # long-lived one that was merely opened first (its Results then went unheld and its
        # Withdraws unmatched once 4,096 others had come and gone).
        if member_of.pop(identity, None) is None and len(member_of) >= MEMBER_OF_MAX:
            del member_of[next(iter(member_of))]
        member_of[identity] = msg.src
        # What is left of the task's time is never more than all of it: a remaining_ms past
        # timeout_ms put the task's start in the future and its deadline that much later.
        spent_ms = msg.task.timeout_ms - min(msg.remaining_ms, msg.task.timeout_ms)
        return Admit(msg.task, now - spent_ms / 1000.0, self.wants_load(identity))

    def admitted(
        self, msg: Forward, verdict: Verdict, retry_after_ms: int, load: LoadRecord | None = None
    ) -> Reply:
        """``load``: our load record to carry (the shell's rule: on the first reply queued for
        a forwarder only)."""
        accepted = verdict in _ACCEPTED
        if accepted:
            self.counters.accepted_from_peers += 1
        else:
            self.counters.refused_to_peers += 1
        reply = ForwardReply(
            req=msg.req,
            node=self.node,
            accepted=accepted,
            code="" if accepted else verdict.value,
            retry_after_ms=0 if accepted else retry_after_ms,
            load=load,
        )
        return Reply(reply, accepted, verdict is _DUPLICATE_DONE)

    # -- after the task: TaskDones, the load they carry, Withdraws -------------------------

    def task_finished(self, owned: Owned) -> bool:
        """``owned`` ended here with its final Result just handed to the reply sender: its
        forwarders hear a TaskDone once that Result has left.  True: the first TaskDone
        waiting on its route (the shell asks to be told when the route's replies leave)."""
        forwarders = owned.forwarders
        if not forwarders:
            return False  # a producer's task: nobody else to tell
        if ANY in forwarders:  # re-run from the journal: its forwarder is told by name
            return self.done_after(owned.task, owned.notify(), owned.notify_member())
        return self.done_after(owned.task, tuple(forwarders), "")

    def done_after(self, task: Task, identities: Sequence[Hashable], member: str) -> bool:
        """Queue ``task``'s TaskDone for ``identities`` (and ``member`` by name) behind every
        reply to its route so far.  True: the first for that route."""
        route = task.route
        waiting = self._done_waiting.get(route)
        if waiting is not None:
            waiting.append((task.id, identities, member))
            return False
        self._done_waiting[route] = [(task.id, identities, member)]
        return True

    def results_left(
        self,
        route: str,
        load: LoadRecord | None,
        load_of: Callable[[], LoadRecord | None] | None = None,
    ) -> tuple[list[tuple[Hashable, TaskDone]], list[tuple[str, TaskDone]]]:
        """Every reply to ``route`` so far has left: the TaskDones now, to connection
        identities (``load`` on the first for each, by the load rule) and to members by
        name (each with ``load``: it goes alone).  ``load_of``: the load is read from it,
        once, when the first TaskDone that carries it is made (the shell's record costs a
        read of the engine; most TaskDones carry none)."""
        to_links: list[tuple[Hashable, TaskDone]] = []
        to_members: list[tuple[str, TaskDone]] = []
        waiting = self._done_waiting.get(route)
        if waiting is None:
            return to_links, to_members
        node, loaded = self.node, self._loaded
        for task_id, identities, member in waiting:
            for identity in identities:
                if identity in loaded:
                    to_links.append((identity, TaskDone(id=task_id, node=node)))
                else:
                    if load_of is not None:  # (before any change here: it may raise)
                        load, load_of = load_of(), None
                    loaded.add(identity)
                    to_links.append((identity, TaskDone(id=task_id, node=node, load=load)))
            if member:
                if load_of is not None:
                    load, load_of = load_of(), None
                to_members.append((member, TaskDone(id=task_id, node=node, load=load)))
        del self._done_waiting[route]
        return to_links, to_members

    def wants_load(self, identity: Hashable) -> bool:
        """Should the reply being queued for ``identity`` carry our load (the first since
        the last flush)?"""
        if identity in self._loaded:
            return False
        self._loaded.add(identity)
        return True

    def flushed(self) -> None:
        """The queued replies left: the next message to each forwarder carries our load."""
        self._loaded.clear()

    def withdrawn(self, identity: Hashable, aborted: bool) -> str | None:
        """A Withdraw from ``identity``: ``aborted`` says the task book dropped its copy
        (queued or running here).  None: done; else the member whose held Result (if
        any) is to be dropped: the task had ended here."""
        if aborted:
            self.counters.withdrawn_by_peers += 1
            return None
        return self.member_of.get(identity, "")

    def forwarders_of(self, owned: Owned) -> list[str]:
        """The members that forwarded ``owned`` to us, by name ("" for one not known)."""
        member_of = self.member_of
        return [owned.replayed_src if f == ANY else member_of.get(f, "") for f in owned.forwarders]

    def latest_boot(self, member: str) -> int:
        return self._boots.get(member, 0)

    def member_dead(self, member: str) -> None:
        """``member`` was declared dead (or left): the process we heard from is gone, so
        the next one's first Forward sets its latest boot even if lower (a host whose clock
        stepped back across the restart: an RTC behind at boot, a restored VM; each of its
        Forwards was refused ``unavailable`` for as long as this daemon lived)."""
        boot = self._boots.pop(member, 0)
        if boot:
            self._dead_boots[member] = boot
            if len(self._dead_boots) > MEMBER_OF_MAX:
                del self._dead_boots[next(iter(self._dead_boots))]

    def _refusal(self, msg: Forward, code: str, message: str) -> ForwardReply:
        return ForwardReply(req=msg.req, node=self.node, accepted=False, code=code, message=message)

    def _invalid(self, msg: Forward) -> Refused | None:
        """A Forward whose task the ingress would refuse from a producer (protocol version,
        size): refused with the code."""
        try:
            if msg.v != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    f"Forward of protocol version {msg.v} is not supported",
                    code=ErrorCode.UNSUPPORTED_VERSION,
                )
            check_forwarded_task(msg.task, bytes_max=self.task_bytes_max)
        except RemoteProtocolError as exc:
            self.counters.invalid_from_peers += 1
            self.counters.refused_to_peers += 1
            hint = exc.hint[:1024]
            return Refused(self._refusal(msg, exc.code, hint), "invalid", hint)
        return None

    def _stale(self, msg: Forward) -> bool:
        """From an earlier process of its sender than one we have heard from: it waited in
        that dead process's connection (the kernel keeps sending a closed socket's data;
        after a cut, with TCP's backoff, for tens of seconds) and nobody answers for it any
        more: whatever the old process did not get back from us it retried elsewhere, or its
        producer resends.  Not run; refused (``unavailable``), which reaches nobody from a
        dead process, and sends a live one (its host's clock stepped back across a restart)
        to the next member."""
        boots = self._boots
        latest = boots.get(msg.src, 0)
        if self._dead_boots and msg.boot and msg.boot == self._dead_boots.get(msg.src):
            return True  # (the dead process's: its connection's late data)
        if msg.boot >= latest:
            if msg.boot > latest:
                boots[msg.src] = msg.boot
                if len(boots) > MEMBER_OF_MAX:
                    del boots[next(iter(boots))]
            return False
        return True
