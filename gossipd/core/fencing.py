"""The fence: which leader term a member believes, and which leader directives it applies
(sans-IO).

Rules (docs/PROTOCOL.md, "Leadership"):
1. A member keeps the highest term (leader, token) it has seen.  A higher token replaces it;
   a lower one is ignored.  The same token naming another leader is a conflict (two etcd
   clusters, or a forged update): ignored and counted; the first one seen stays.
2. A directive is applied only if its token is >= the highest token seen; applying it raises
   the highest term to (directive.leader, directive.token).  A lower token is refused and
   counted (reason ``stale_token``).
3. For one ``kind`` only the newest (token, seq) applies: a directive at or below the newest
   applied of its kind is a duplicate (gossip delivers each one several times: not counted)
   or superseded (older: refused, reason ``superseded``).
4. Bounded: at most ``kinds_max`` kinds are tracked; a directive of a new kind beyond that is
   refused (reason ``kinds_full``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossipd.core.gossip_messages import Directive, Term

KINDS_MAX = 256
REFUSAL_REASONS = ("stale_token", "superseded", "conflict", "kinds_full")


@dataclass(slots=True)
class FenceStatistics:
    terms_raised: int = 0
    terms_conflicting: int = 0
    directives_admitted: int = 0
    directives_duplicate: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))


class Fence:
    def __init__(self, *, kinds_max: int = KINDS_MAX) -> None:
        self._term: Term | None = None
        self._newest: dict[str, tuple[int, int]] = {}  # kind -> (token, seq) applied
        self._kinds_max = kinds_max
        self._stats = FenceStatistics()

    @property
    def term(self) -> Term | None:
        """The highest term seen (None before any)."""
        return self._term

    @property
    def token(self) -> int:
        """The highest token seen (0 before any)."""
        return 0 if self._term is None else self._term.token

    def observe(self, term: Term) -> bool:
        """Rule 1: True if ``term`` raised the highest term."""
        current = self._term
        if current is not None and term.token <= current.token:
            if term.token == current.token and term.leader != current.leader:
                self._stats.terms_conflicting += 1
            return False
        self._term = term
        self._stats.terms_raised += 1
        return True

    def admit(self, directive: Directive) -> bool:
        """Rules 2 to 4: True if ``directive`` is to be applied (and passed on)."""
        current = self._term
        if current is not None:
            if directive.token < current.token:
                return self._refuse("stale_token")
            if directive.token == current.token and directive.leader != current.leader:
                self._stats.terms_conflicting += 1
                return self._refuse("conflict")
        key = (directive.token, directive.seq)
        newest = self._newest.get(directive.kind)
        if newest is not None and key <= newest:
            if key == newest:
                self._stats.directives_duplicate += 1
                return False
            return self._refuse("superseded")
        if newest is None and len(self._newest) >= self._kinds_max:
            return self._refuse("kinds_full")
        self._newest[directive.kind] = key
        self.observe(Term(leader=directive.leader, token=directive.token))
        self._stats.directives_admitted += 1
        return True

    def newest(self, kind: str) -> tuple[int, int] | None:
        """The (token, seq) of the newest applied directive of ``kind``."""
        return self._newest.get(kind)

    def _refuse(self, reason: str) -> bool:
        self._stats.refused[reason] += 1
        return False

    def statistics(self) -> FenceStatistics:
        return self._stats
