"""Rolling drain: the leader's plan, one member at a time (sans-IO).

An operator writes a ``Plan`` (``gossipd cluster drain``) to etcd; the leader keeps its
``Progress`` there (fenced writes) and, each time it looks, calls ``advance`` with what its
membership view shows.  ``advance`` returns the new progress to store and the ``Order`` to
gossip to the member concerned (a fenced ``drain`` directive; docs/PROTOCOL.md).  Nothing here
remembers anything between calls: a new leader that reads the stored progress resumes
exactly where the old one stopped.

Rules:
1. The order of members is fixed when the plan starts and stored with the progress: the
   nodes the plan names, in its order; for a rolling plan that names none, every live member
   sorted by name, the leader last (draining the leader hands the plan to the next one).
2. One member at a time, in phases:
   DRAIN  -- order "drain"; done when the member gossips status draining with nothing in
             flight (its queued tasks handed off, its running ones finished).  After
             ``step_timeout_s`` the step goes on anyway: the shutdown of the next phase
             hands off and finishes what is left, as on SIGTERM.
   LEAVE  -- order "leave" (plan mode drain: exit 0 and stay down) or "restart" (rolling:
             exit with EXIT_RESTART so that the supervisor, systemd's Restart=on-failure,
             starts it again, with the new software); done when the member is no longer
             live (it left, or died), or is live at a higher incarnation (it already came
             back).  The incarnation it had when this phase began is stored.
   RETURN -- rolling only: done when the member is live again at a higher incarnation than
             the stored one, status serving.  Then the next member.
   A member that is not live when its turn comes is skipped (noted): it is down already.
3. LEAVE and RETURN have ``step_timeout_s`` each; past it the plan fails (status failed,
   message naming the member and phase) and nothing more is ordered: an upgrade that does
   not come back must not take the next member down.
4. A finished plan (done or failed) is final: ``advance`` returns it unchanged, no order.
5. Times are wall-clock seconds (``now_s``), so that a leader on another host can judge how
   long the current phase has lasted.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

NODES_MAX = 1024
NodeName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class Phase(enum.StrEnum):
    DRAIN = "drain"
    LEAVE = "leave"
    RETURN = "return"


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the operator asked for (the JSON value of ``/gossipd/<cluster>/drain/plan``)."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    mode: Literal["drain", "rolling"]
    nodes: Annotated[list[NodeName], msgspec.Meta(max_length=NODES_MAX)] = msgspec.field(
        default_factory=list
    )
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)] = 300.0
    created_wall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode == "drain" and not self.nodes:
            raise ValueError("nodes: a drain plan names at least one member")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes: a member is named twice")


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Where the plan stands (``/gossipd/<cluster>/drain/progress``).  Fields a later version
    adds are ignored, not refused: an unreadable progress starts the plan over, which in a
    rolling upgrade of mixed versions would drain the members already done again."""

    plan: str
    order: list[str]
    # The member in hand: order[index]; len(order) when done.  Bounded: -1 would take the
    # last (the leader) first, and -len - 1 raised in ``advance`` every tick.
    index: Annotated[int, msgspec.Meta(ge=0)] = 0
    phase: Phase = Phase.DRAIN
    incarnation: int = 0  # the member's, when LEAVE began
    phase_since_s: float = 0.0
    status: Literal["running", "done", "failed"] = "running"
    message: str = ""
    steps: list[str] = msgspec.field(default_factory=list)  # one line per finished member
    leader: str = ""  # who wrote this

    def __post_init__(self) -> None:
        if self.index > len(self.order):
            raise ValueError(f"index: at most len(order) ({len(self.order)}), found {self.index}")

    @property
    def node(self) -> str | None:
        return self.order[self.index] if self.index < len(self.order) else None


class Seen(msgspec.Struct, frozen=True, kw_only=True):
    """One live member as the leader's membership view shows it."""

    node: str
    incarnation: int
    status: str = "serving"  # its gossiped status; "" while no GPU state is known
    inflight: int = 0


class Order(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of a ``drain`` directive: what one member must do now."""

    plan: Annotated[str, msgspec.Meta(max_length=64)]
    node: NodeName
    action: Literal["drain", "leave", "restart"]
    # When the leader issued it (wall clock): a member ignores orders issued before it
    # started, so a restarted member does not obey its previous life's order.
    issued_wall_s: float


def start(plan: Plan, live: Mapping[str, Seen], leader: str, now_s: float) -> Progress:
    """The progress of a plan that has not begun (rule 1)."""
    if plan.nodes:
        order = list(plan.nodes)
    else:
        order = sorted(n for n in live if n != leader) + ([leader] if leader in live else [])
    return Progress(plan=plan.id, order=order, phase_since_s=now_s, leader=leader)


def advance(
    plan: Plan,
    progress: Progress | None,
    live: Mapping[str, Seen],
    leader: str,
    now_s: float,
) -> tuple[Progress, Order | None]:
    """The progress after looking at ``live`` (the leader's live members, itself included),
    and the order to gossip now (None: nothing to order)."""
    if progress is None or progress.plan != plan.id:
        progress = start(plan, live, leader, now_s)
    p = progress
    for _ in range(3 * len(p.order) + 1):  # each pass finishes a phase or returns
        if p.status != "running":
            return p, None
        node = p.node
        if node is None:
            return _with(p, status="done", message=f"{len(p.order)} members done"), None
        seen = live.get(node)
        waited_s = now_s - p.phase_since_s
        if p.phase is Phase.DRAIN:
            if seen is None:
                p = _next(p, leader, now_s, f"{node}: not live when its turn came; skipped")
                continue
            if seen.status == "draining" and seen.inflight == 0:
                p = _phase(p, Phase.LEAVE, now_s, seen.incarnation)
                continue
            if waited_s > plan.step_timeout_s:
                note = f"{node}: still {seen.inflight} in flight after {waited_s:.0f} s"
                p = _phase(p, Phase.LEAVE, now_s, seen.incarnation, note=note)
                continue
            return _with(p, leader=leader), _order(plan, node, "drain", now_s)
        if p.phase is Phase.LEAVE:
            if seen is None or seen.incarnation > p.incarnation:
                if plan.mode == "drain":
                    p = _next(p, leader, now_s, f"{node}: drained and left")
                else:
                    p = _phase(p, Phase.RETURN, now_s, p.incarnation)
                continue
            if waited_s > plan.step_timeout_s:
                return _failed(p, leader, f"{node} did not leave within {plan.step_timeout_s} s")
            action = "leave" if plan.mode == "drain" else "restart"
            return _with(p, leader=leader), _order(plan, node, action, now_s)
        # Phase.RETURN
        if seen is not None and seen.incarnation > p.incarnation and seen.status == "serving":
            p = _next(p, leader, now_s, f"{node}: restarted and serving again")
            continue
        if waited_s > plan.step_timeout_s:
            return _failed(
                p, leader, f"{node} did not come back serving within {plan.step_timeout_s} s"
            )
        return _with(p, leader=leader), None
    raise AssertionError("advance: no phase finished in a pass")  # pragma: no cover


def _with(p: Progress, **changes: object) -> Progress:
    return msgspec.structs.replace(p, **changes)


def _phase(p: Progress, phase: Phase, now_s: float, incarnation: int, note: str = "") -> Progress:
    steps = [*p.steps, note] if note else p.steps
    return _with(p, phase=phase, phase_since_s=now_s, incarnation=incarnation, steps=steps)


def _next(p: Progress, leader: str, now_s: float, line: str) -> Progress:
    return _with(
        p,
        index=p.index + 1,
        phase=Phase.DRAIN,
        phase_since_s=now_s,
        incarnation=0,
        steps=[*p.steps, line],
        leader=leader,
    )


def _failed(p: Progress, leader: str, why: str) -> tuple[Progress, None]:
    return _with(p, status="failed", message=why, leader=leader), None


def _order(plan: Plan, node: str, action: str, now_s: float) -> Order:
    return Order(plan=plan.id, node=node, action=action, issued_wall_s=now_s)  # type: ignore[arg-type]


def describe(p: Progress) -> str:
    """One line for the operator: where the plan stands."""
    if p.status == "done":
        return f"done: {p.message}"
    if p.status == "failed":
        return f"FAILED: {p.message}"
    node = p.node or "-"
    return f"[{p.index + 1}/{len(p.order)}] {node}: {p.phase.value} (leader {p.leader or '?'})"


plan_decoder = msgspec.json.Decoder(Plan)
progress_decoder = msgspec.json.Decoder(Progress)
order_decoder = msgspec.msgpack.Decoder(Order)
