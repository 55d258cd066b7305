"""A refused connection as evidence of a crash (sans-IO): when to check a member's port, and
what a refusal decides.

A process that dies has its sockets closed by the kernel: its peers' connections drop and its
listening port refuses new connections (a TCP RST, ECONNREFUSED).  A stalled process (SIGSTOP,
GC, CPU starvation) keeps its listening socket: the kernel completes connections into its
backlog, so a connect succeeds.  Silence cannot tell the two apart, which is why SWIM waits out
a suspicion timeout; a refusal can, at once.  docs/MEMBERSHIP.md has the safety argument.

Inputs: ``want(now, node)`` (a reason to check: our connection to it dropped, or our probe's
ack is late), ``checked(now, check, refused=...)`` (what the shell's TCP connect found).
Output: ``take()`` -> the checks to run; ``checked`` returns its verdict.

Rules:
1. A check is asked only for a live member, at most once per member per ``probe_timeout_s``,
   and only while ``crash_by_refusal`` is on; pending checks are kept per member (bounded by
   the table).
2. Only a refusal is evidence.  A connect that succeeds, times out, or fails any other way
   (unreachable, a name that does not resolve, an address that is not TCP) decides nothing:
   SWIM's probes and suspicion go on as before.
3. A refusal applies to the member's life that was checked: if by the answer the member has
   another incarnation or another address (it refuted, restarted, moved), or is no longer
   live, the refusal is stale and ignored.
4. A valid refusal declares the member dead at once, at the checked incarnation, and the Dead
   is gossiped urgently and sent straight to ``gossip_fanout`` members.  A member that is in
   fact alive refutes it like any other Dead about itself (membership rule 3).
5. Budget: at most ``refusal_burst`` such declarations, refilled at one per
   ``refusal_refill_s``.  Over budget a refusal is ignored (counted): many members refusing at
   once more likely means our own network is wrong (a firewall, a namespace) than that they
   all crashed, and SWIM still judges them at its usual pace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipd.core.gossip_messages import Dead
from gossipd.core.membership import LIVE_STATES

if TYPE_CHECKING:
    from gossipd.core.swim import SwimNode

# Verdicts of ``checked`` (also metric labels).
ACCEPTED = "accepted"  # not refused: no evidence
DEAD = "dead"  # declared dead on this refusal
STALE = "stale"  # refused, but the member has since changed life or state
OVER_BUDGET = "over_budget"  # refused, but we declared too many dead this way lately
VERDICTS = (ACCEPTED, DEAD, STALE, OVER_BUDGET)


@dataclass(frozen=True, slots=True)
class PortCheck:
    """Connect to ``addr`` (the member's gossip address) and say whether it was refused."""

    node: str
    addr: str
    incarnation: int


class RefusalDetector:
    def __init__(self, swim: SwimNode, now: float) -> None:
        self._swim = swim
        self._pending: dict[str, PortCheck] = {}
        self._asked_at: dict[str, float] = {}
        self.tokens = float(swim.config.refusal_burst)
        self._tokens_at = now
        self.verdicts: dict[str, int] = dict.fromkeys(VERDICTS, 0)

    def want(self, now: float, node: str) -> None:
        swim = self._swim
        cfg = swim.config
        if not cfg.crash_by_refusal:
            return
        member = swim.table.members.get(node)
        if member is None or member.state not in LIVE_STATES:
            return
        if now - self._asked_at.get(node, -cfg.probe_timeout_s) < cfg.probe_timeout_s:
            return
        self._asked_at[node] = now
        self._pending[node] = PortCheck(node, member.addr, member.incarnation)
        if len(self._asked_at) > 2 * len(swim.table.members) + 16:
            self._asked_at = {n: t for n, t in self._asked_at.items() if n in swim.table.members}

    def take(self) -> list[PortCheck]:
        out = list(self._pending.values())
        self._pending.clear()
        return out

    def checked(self, now: float, check: PortCheck, *, refused: bool) -> str:
        verdict = self._verdict(now, check, refused)
        self.verdicts[verdict] += 1
        return verdict

    def _verdict(self, now: float, check: PortCheck, refused: bool) -> str:
        swim = self._swim
        if not refused:
            return ACCEPTED
        member = swim.table.members.get(check.node)
        if (
            member is None
            or member.state not in LIVE_STATES
            or member.addr != check.addr
            or member.incarnation != check.incarnation
        ):
            return STALE
        cfg = swim.config
        self.tokens = min(
            float(cfg.refusal_burst), self.tokens + (now - self._tokens_at) / cfg.refusal_refill_s
        )
        self._tokens_at = now
        if self.tokens < 1.0:
            return OVER_BUDGET
        self.tokens -= 1.0
        swim.stats.declared_dead += 1
        swim.apply(Dead(node=check.node, incarnation=check.incarnation, by=swim.node), now)
        for target in swim.random_live_sample(cfg.gossip_fanout):
            swim.dissemination.send_gossip_to(target)
        return DEAD
