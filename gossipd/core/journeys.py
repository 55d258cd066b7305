"""What the forwarder (core/forwarder.py) is made of and what it says: its settings and
counters, the Placement it asks, a task's Journey and the Flights of its Forwards, the Route
it answers for a task of our intake, and the events it emits (Refuse, HandedOff, RunHere)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import msgspec

from gossipd.core.breaker import Breaker
from gossipd.core.messages import ErrorCode, Task


class Route(enum.Enum):
    LOCAL = "local"  # run it here: the caller admits it
    TAKEN = "taken"  # forwarded, or answered with an error: nothing more for the caller


class AttemptFailure(enum.StrEnum):
    """Why an attempt failed without a refusal from the member (never sent on the wire: these
    label attempts in the error message a producer gets)."""

    NO_REPLY = "no reply"
    CIRCUIT_OPEN = "circuit_open"
    NOT_A_MEMBER = "not_a_member"
    DEADLINE = "deadline reached"


class Placement(Protocol):
    """Which member should run a task, as this node sees the cluster."""

    def owner_for(self, task: Task, now: float) -> str | None: ...

    def order(self, task: Task, now: float, exclude: frozenset[str] = frozenset()) -> list[str]: ...

    def addr(self, member: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ForwarderSettings:
    attempts_max: int = 4
    ack_timeout_s: float = 0.5
    backoff_base_s: float = 0.005
    backoff_max_s: float = 0.2
    hedge: bool = False
    hedge_quantile: float = 0.95
    hedge_min_s: float = 0.002
    hedge_budget: float = 0.1
    breaker_failures: int = 3
    breaker_open_s: float = 2.0
    forwarded_max: int = 200_000
    forwarded_bytes_max: int = 1 << 30
    retry_after_ms: int = 1000  # the hint when no member gave one
    retry_after_max_ms: int = 10_000  # the most a producer is told (a member's hint is cut)
    owner_check: bool = False  # rule 6: Forwards ask if_free

    @classmethod
    def of(
        cls, config: object, retry_after_ms: int, retry_after_max_ms: int = 10_000
    ) -> ForwarderSettings:
        """From a FanoutConfig (or anything with these attributes) and the ingress's hints."""
        hints = ("retry_after_ms", "retry_after_max_ms")
        names = [n for n in cls.__dataclass_fields__ if n not in hints]
        return cls(
            retry_after_ms=retry_after_ms,
            retry_after_max_ms=retry_after_max_ms,
            **{n: getattr(config, n) for n in names},
        )


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the task's producer with this error: no member took the task."""

    task: Task
    code: ErrorCode
    message: str
    retry_after_ms: int


@dataclass(frozen=True, slots=True)
class HandedOff:
    """A hand-off ended: another member took the task (ok: ``to``) or none did."""

    task: Task
    ok: bool
    to: str = ""
    # ``to``'s TaskDone stood for its accept: the task ended there, its Result gone.
    done: bool = False


@dataclass(frozen=True, slots=True)
class RunHere:
    """Offer ``task`` to our own admission as received at ``received_at`` (a retry or a
    migration whose next member is ourselves); answer with ``local_verdict``."""

    task: Task
    received_at: float


@dataclass(slots=True)
class ForwarderCounters:
    local: int = 0  # tasks from our intake run here
    forwarded: int = 0  # forwards a member accepted
    attempts_failed: int = 0  # forwards that got no answer in time
    unavailable: int = 0  # tasks no member took
    migrated: int = 0  # accepted tasks dispatched again off a dead member
    # ...not dispatched again: past their deadline (its owner answered, or its producer has
    # given up on it; its TaskDone may have been lost to a partition)
    expired_not_migrated: int = 0
    # ...not dispatched again: its producer had cancelled it (answered cancelled here)
    cancelled_not_migrated: int = 0
    handed_off: int = 0  # hand-offs another member accepted
    hedged: int = 0  # forwards also sent to a second member
    hedge_wins: int = 0  # ...where the second member accepted first
    resends_absorbed: int = 0  # a producer's resend of a task on its way or run for us
    hedges_over_budget: int = 0  # slow acks not hedged: hedge_budget was spent
    withdrawn: int = 0  # Withdraws sent
    moved: int = 0  # tasks an owner handed over to another member (Moved): ledgered there


class Journey(msgspec.Struct, eq=False):
    """One task on its way to a member: the members tried and the Forwards sent (its
    Flights), until one accepts or none is left.  A Struct: one is made per forwarded
    task, on the hot path, and msgspec builds it in C (its empty lists copied per
    instance)."""

    task: Task
    received_at: float  # at the entry point: the deadline counts from it
    deadline: float
    quiet: bool  # a hand-off: report the outcome as an event, never answer
    exclude: frozenset[str]  # members never to try (ourselves at drain, a dead member)
    order: list[str] | None = None  # members left to try, computed when needed
    tried: list[str] = []  # members tried, in order
    attempts: list[str] = []  # "member: outcome" of the failed ones
    busy_hint_ms: int = 0  # the largest retry_after_ms among busy refusals
    flights: list[Flight] = []  # every copy sent (live or landed)
    live: int = 0  # copies still awaiting their answer
    winner: str = ""  # the member that accepted
    waiting: bool = False  # a backoff timer is armed for the next attempt
    ended: bool = False
    saturated: str = ""  # the first member that refused as saturated (rule 6)
    plain: bool = False  # ...asked again without if_free
    cancelled: bool = False  # its producer's Cancel followed its copies in the air
    engine_deaths: int = 0  # a hand-off's: engines that died running it (Forward's field)


class Flight(msgspec.Struct, eq=False):
    """One Forward awaiting its ForwardReply (a Struct: one is made per forward, in C)."""

    req: int
    member: str
    journey: Journey
    breaker: Breaker
    sent_at: float
    hedge_armed: bool = False
    live: bool = True
    hedge: bool = False  # sent by _hedge, racing the first copy
    trial: int = 0  # its member's breaker was half-open: the trial call it is (Breaker.trials)
