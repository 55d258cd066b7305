"""Lifeguard's dynamic suspicion timeout (sans-IO).

A suspicion starts with the longest timeout; each independent confirmation (a distinct member
that suspects the same incarnation) shrinks it, logarithmically, down to the minimum once
``k`` confirmations are in:

    timeout(C) = max(min_s, max_s - (max_s - min_s) * log(C + 1) / log(k + 1))

Who runs a short timer: only a *witness*, a member that has evidence of its own (it suspected
first, or it probed the suspect and failed).  A member that only heard the suspicion waits
``max_s``: it cannot tell a dead member from a stalled one, and the witness's Dead message
reaches it sooner anyway.  This keeps a refutation, which reaches the witnesses directly, ahead
of every timer that could fire.

K is capped by the members that could still confirm: those live and not suspect, less the
observer (issue 24).  A member cut off with one other, suspecting the four beyond the cut, can
get one confirmation (from the other), never three: it runs the timer of K = 1, not the
maximum.  A member that suspects few keeps K.
"""

from __future__ import annotations

import math


def suspicion_min_s(mult: float, n: int, probe_interval_s: float, floor_s: float) -> float:
    """The shortest suspicion timeout for a cluster of ``n`` live members."""
    return max(floor_s, mult * math.log10(max(n, 1) + 1) * probe_interval_s)


def remaining_timeout_s(confirmations: int, k: int, min_s: float, max_s: float) -> float:
    """Lifeguard's timeout after ``confirmations`` independent confirmations."""
    if k < 1 or confirmations >= k:
        return min_s
    frac = math.log(confirmations + 1) / math.log(k + 1)
    return max(min_s, max_s - (max_s - min_s) * frac)


class Suspicion:
    """One suspicion of one member's incarnation, at one observer."""

    __slots__ = (
        "accuser",
        "confirmers",
        "incarnation",
        "k",
        "max_s",
        "min_s",
        "started_at",
        "witness",
    )

    def __init__(
        self,
        *,
        incarnation: int,
        started_at: float,
        by: str,
        k: int,
        min_s: float,
        max_s: float,
        witness: bool,
    ) -> None:
        self.incarnation = incarnation
        self.started_at = started_at
        self.k = k
        self.min_s = min_s
        self.max_s = max_s
        self.witness = witness
        self.accuser = by  # the first suspecter: confirmations are sent to it directly
        self.confirmers: set[str] = {by}

    def confirm(self, by: str) -> bool:
        """Count ``by`` as a confirmer; False if it already was one, or if K confirmers
        are already counted (more change no timer: the set stays at K + 1 names, whatever
        a message's 4,096 Suspects name)."""
        if by in self.confirmers or len(self.confirmers) > self.k:
            return False
        self.confirmers.add(by)
        return True

    def deadline(self, can_confirm: int | None = None) -> float:
        """When the timer fires.  ``can_confirm``: how many members could still confirm (the
        live ones we do not suspect, less us): K is never more than that, so that a member
        cut off with a few others does not wait for confirmations that cannot come."""
        if not self.witness:
            return self.started_at + self.max_s
        k = self.k if can_confirm is None else min(self.k, max(0, can_confirm))
        # The first suspecter is not a confirmation of itself.
        timeout = remaining_timeout_s(len(self.confirmers) - 1, k, self.min_s, self.max_s)
        return self.started_at + timeout
