"""One candidate of the etcd leader election: its decisions, sans-IO (the shell:
gossipd/leader/election.py).

The recipe is etcd's own: each candidate holds a lease and puts one key under the election
prefix, attached to that lease; the key with the lowest create_revision leads; every other
candidate watches only its predecessor (the next lower key), so a leader's end wakes one
candidate, not all.  The leader's create_revision is its fencing token.

Rules (docs/PROTOCOL.md, "Leadership"):
1. A session is one lease.  The lease is believed valid until ``valid_until``: the send time
   of the last keepalive (or grant) etcd answered, plus the TTL etcd gave in that answer,
   less ``margin_s``.  Counting from the send time, not the answer's arrival, keeps us on the
   safe side: etcd started its countdown no earlier than that.
2. We lead only when our key has the lowest create_revision among the candidates and our
   lease is believed valid; the token is our key's create_revision.
3. A leader steps down by itself as soon as its lease is no longer believed valid (no
   keepalive answered for a TTL), even while etcd is unreachable: etcd expires the lease no
   earlier, and only then can a successor see our key go and take over.
4. An answer saying the lease is gone (TTL 0), a candidate list without our key, or our key
   seen deleted (the leader watches it: deleted by hand, its lease alive, the successor leads
   at once) ends the session: step down, and campaign again with a new lease and key (a new,
   higher token).
5. A session whose lease etcd confirms again after an outage (TTL > 0) carries on: the same
   key, the same token, leading again if still lowest.
6. Resign: step down first, then revoke the lease (the shell), so that our key goes at once
   and the successor takes over without waiting for the TTL.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class Phase(enum.Enum):
    NO_SESSION = "no_session"  # no lease: grant one
    NO_KEY = "no_key"  # a lease, no campaign key yet: put it
    CANDIDATE = "candidate"  # our key is there: read the candidates, lead or watch
    RESIGNED = "resigned"  # resigned: nothing more until restarted


@dataclass(frozen=True, slots=True)
class Elected:
    token: int


@dataclass(frozen=True, slots=True)
class SteppedDown:
    token: int
    reason: str  # lease_expired, lease_lost, key_gone, not_lowest, resigned, stopped
    # Until when the lease was believed valid: after a pause of the process the step-down
    # comes late, but the leadership ended here.
    lease_until: float = field(default=math.inf, compare=False)


@dataclass(frozen=True, slots=True)
class Watch:
    """Not the leader: wait for this candidate (our predecessor) to go."""

    revision: int


Decision = Elected | SteppedDown | Watch | None


class ElectionCore:
    def __init__(self, *, ttl_s: float, margin_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        # Step down a little before the lease could expire at etcd (loop lag, clock rates).
        self.margin_s = min(0.1 * ttl_s, 0.25) if margin_s is None else margin_s
        self.phase = Phase.NO_SESSION
        self.lease_id = 0
        self.revision = 0  # our campaign key's create_revision (the token if we lead)
        self.valid_until = -math.inf
        self.leader_token = 0  # nonzero while we believe we lead
        self.elections = 0
        self.step_downs: dict[str, int] = {}

    @property
    def leading(self) -> bool:
        return self.leader_token != 0

    def lease_valid(self, now: float) -> bool:
        return now < self.valid_until

    def keepalive_interval_s(self) -> float:
        return self.ttl_s / 3

    # -- inputs -----------------------------------------------------------------------------

    def granted(self, sent_at: float, lease_id: int, ttl_s: float) -> None:
        """etcd granted ``lease_id`` (a grant sent at ``sent_at``) for ``ttl_s``."""
        if self.phase is Phase.RESIGNED:
            return
        self.phase = Phase.NO_KEY
        self.lease_id = lease_id
        self.revision = 0
        self.valid_until = sent_at + ttl_s - self.margin_s

    def key_created(self, revision: int) -> None:
        """Our campaign key exists, created at ``revision``."""
        if self.phase is Phase.NO_KEY:
            self.phase = Phase.CANDIDATE
            self.revision = revision

    def keepalive_answered(self, now: float, sent_at: float, ttl_left_s: float) -> Decision:
        """etcd answered a keepalive sent at ``sent_at``: the lease has ``ttl_left_s`` (0: it
        is gone, rule 4)."""
        if self.phase in (Phase.NO_SESSION, Phase.RESIGNED):
            return None
        if ttl_left_s <= 0:
            return self._end_session("lease_lost")
        self.valid_until = max(self.valid_until, sent_at + ttl_left_s - self.margin_s)
        return None

    def candidates(self, now: float, revisions: Sequence[int]) -> Decision:
        """The create_revisions of every key under the election prefix, read just now:
        lead (rule 2), watch the predecessor, or, without our key, start again (rule 4)."""
        if self.phase is not Phase.CANDIDATE:
            return None
        if self.revision not in revisions:
            return self._end_session("key_gone")
        lower = [r for r in revisions if r < self.revision]
        if lower:
            if self.leading:  # cannot happen with etcd's revisions; never lead beside another
                return self._step_down("not_lowest")
            return Watch(max(lower))
        if not self.lease_valid(now):
            return None  # rule 3: wait for a keepalive answer first
        if self.leading:
            return None
        self.leader_token = self.revision
        self.elections += 1
        return Elected(self.revision)

    def key_deleted(self) -> Decision:
        """A watch saw our campaign key deleted (rule 4): the next candidate, watching it
        too, reads the candidates and leads; step down now, before it can."""
        if self.phase is not Phase.CANDIDATE:
            return None
        return self._end_session("key_gone")

    def tick(self, now: float) -> Decision:
        """Rule 3; call at ``next_deadline()``."""
        if self.leading and not self.lease_valid(now):
            return self._step_down("lease_expired")
        return None

    def next_deadline(self) -> float:
        return self.valid_until if self.leading else math.inf

    def resign(self, reason: str = "resigned") -> Decision:
        """Rule 6: step down now; the shell revokes ``lease_id`` afterwards (``reason``:
        "stopped" when the election itself stops)."""
        decision = self._step_down(reason) if self.leading else None
        self.phase = Phase.RESIGNED
        return decision

    def restart(self) -> None:
        """After a resign: campaign again (a drain that was cancelled)."""
        if self.phase is Phase.RESIGNED:
            self.phase = Phase.NO_SESSION
            self.valid_until = -math.inf

    # -- helpers ----------------------------------------------------------------------------

    def _end_session(self, reason: str) -> Decision:
        decision = self._step_down(reason) if self.leading else None
        if self.phase is not Phase.RESIGNED:
            self.phase = Phase.NO_SESSION
        self.revision = 0
        self.valid_until = -math.inf
        return decision

    def _step_down(self, reason: str) -> SteppedDown:
        token, self.leader_token = self.leader_token, 0
        self.step_downs[reason] = self.step_downs.get(reason, 0) + 1
        return SteppedDown(token, reason, self.valid_until)
