"""The longest prompt + output (``max_model_len``) of the models other members serve, for
GET /v1/models: asked of each member by a ModelQuery, answered by its ModelCard.

Not gossiped: a GpuState key that daemons before 0.2.0 refuse would cost them whole gossip
messages (docs/PROTOCOL.md "Adding a field to GpuState"), while a question between two
members that both run 0.3.0 or later costs nobody else anything.  A member is asked only
when its GpuState says it runs 0.3.0 or later (older ones would refuse the query), at most
once per ``ask_again_s`` until it answers, again when its incarnation or its model changes,
and again after ``card_ttl_s`` (a restarted daemon may start at the same incarnation).

Pure: the caller passes the members it sees and the time; the shell sends the queries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gossipd.core.releases import release_at_least

CARDS_FROM_VERSION = (0, 3, 0)  # the first release that answers a ModelQuery
ASK_AGAIN_S = 2.0  # an unanswered query is sent again after this
CARD_TTL_S = 60.0  # an answered card is asked for again after this


def answers_queries(software_version: str) -> bool:
    """True when a member of this release answers a ModelQuery ("0.3.0" or later; an empty
    or unreadable version: no)."""
    return release_at_least(software_version, CARDS_FROM_VERSION)


@dataclass(frozen=True, slots=True)
class Serving:
    """A live member as the cards see it."""

    node: str
    incarnation: int
    model: str
    software_version: str


@dataclass(slots=True)
class _Card:
    incarnation: int
    model: str
    max_model_len: int | None  # None: asked, not answered yet
    at: float  # when asked (unanswered) or answered


class ModelCards:
    def __init__(self, *, ask_again_s: float = ASK_AGAIN_S, card_ttl_s: float = CARD_TTL_S):
        self._ask_again_s = ask_again_s
        self._card_ttl_s = card_ttl_s
        self._cards: dict[str, _Card] = {}
        # Members asked and not answered yet -> when: what GET /v1/models waits for (a
        # member that stays silent is waited for ask_again_s after each query at most).
        self._waiting: dict[str, float] = {}
        self.asked = 0
        self.answered = 0
        self.refused = 0  # cards nobody asked for, or for another model than asked

    def to_ask(self, members: Iterable[Serving], now: float) -> list[str]:
        """The members to send a ModelQuery now (each is then counted as asked); cards of
        members no longer in ``members`` are forgotten."""
        out = []
        seen = set()
        for m in members:
            seen.add(m.node)
            if not m.model or not answers_queries(m.software_version):
                self._cards.pop(m.node, None)  # an answer still on its way is not taken
                self._waiting.pop(m.node, None)
                continue
            card = self._cards.get(m.node)
            if card is not None and card.incarnation == m.incarnation and card.model == m.model:
                wait = self._ask_again_s if card.max_model_len is None else self._card_ttl_s
                if now - card.at < wait:
                    continue
                known = card.max_model_len  # kept while asked again: still the best we know
            else:
                known = None
            self._cards[m.node] = _Card(m.incarnation, m.model, known, now)
            if known is None:
                self._waiting[m.node] = now
            out.append(m.node)
        for node in [n for n in self._cards if n not in seen]:
            del self._cards[node]
            self._waiting.pop(node, None)
        self.asked += len(out)
        return out

    def on_card(self, node: str, model: str, max_model_len: int, now: float) -> bool:
        """A member's answer.  Taken only from a member we asked, for the model we asked it
        about; ``max_model_len`` 0 (its engine does not know yet) is asked again later."""
        card = self._cards.get(node)
        if card is None or card.model != model:
            self.refused += 1
            return False
        self.answered += 1
        self._waiting.pop(node, None)
        if max_model_len > 0:
            card.max_model_len = max_model_len
            card.at = now
        return True

    def pending(self, now: float) -> bool:
        """True while a member asked less than ``ask_again_s`` ago has not answered (cheap:
        GET /v1/models looks at it every few milliseconds while it waits)."""
        return any(now - at < self._ask_again_s for at in self._waiting.values())

    def lengths(self, members: Iterable[Serving]) -> dict[str, int | None]:
        """Each model ``members`` serve -> the smallest max_model_len its members told us
        (a request placed on any of them fits), None where none has."""
        out: dict[str, int | None] = {}
        for m in members:
            if not m.model:
                continue
            card = self._cards.get(m.node)
            known = None
            if card is not None and card.model == m.model and card.incarnation == m.incarnation:
                known = card.max_model_len
            have = out.get(m.model)
            if known is None:
                out.setdefault(m.model, None)
            elif have is None or known < have:
                out[m.model] = known
        return out
