"""The models the cluster serves, with each one's max_model_len, as GET /v1/models and a
request's model check read them: ours from our engine, other members' from their ModelCards
(core/modelcards.py), asked for when the door reads the list (never while it is idle).
Which members to ask is returned: the caller sends the ModelQuerys (Dispatcher)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gossipd.clock import Clock
from gossipd.core.modelcards import ModelCards, Serving
from gossipd.core.peer_messages import ModelCard
from gossipd.membership.gossip import MemberView


class ClusterModels:
    def __init__(
        self,
        *,
        node: str,
        model: str,
        own_max_model_len: Callable[[], int | None],
        clock: Clock,
        cards: ModelCards | None = None,
    ) -> None:
        self._node = node
        self._model = model
        self._own = own_max_model_len
        self._clock = clock
        self.cards = cards if cards is not None else ModelCards()

    def _others(self, live: Iterable[MemberView]) -> list[Serving]:
        return [
            Serving(m.node, m.incarnation, m.gpu.model, m.gpu.software_version)
            for m in live
            if m.node != self._node and m.gpu is not None and m.gpu.model
        ]

    def models(self, live: Iterable[MemberView]) -> tuple[dict[str, int | None], list[str]]:
        """Model -> max_model_len (None: not known yet), ours and the ``live`` members'; and
        the members to send a ModelQuery now."""
        others = self._others(live)
        ask = self.cards.to_ask(others, self._clock.monotonic())
        models = self.cards.lengths(others)
        own = self._own()
        theirs = models.get(self._model)
        # Our model served elsewhere too: the smallest length known (a request fits anywhere).
        models[self._model] = (
            own if theirs is None or (own is not None and own < theirs) else theirs
        )
        return models, ask

    def pending(self) -> bool:
        """True while a member asked a moment ago has not sent its card yet."""
        return self.cards.pending(self._clock.monotonic())

    def on_card(self, card: ModelCard, its_own: bool = True) -> None:
        """A member's answer to our ModelQuery (Dispatcher.on_model_card); ``its_own``:
        it came on our connection to the member it names (else refused: another member
        may not speak for it)."""
        if not its_own:
            self.cards.refused += 1
            return
        self.cards.on_card(card.node, card.model, card.max_model_len, self._clock.monotonic())

    def card(self) -> ModelCard:
        """Our answer to a member's ModelQuery (OwnerEndpoint's model_card)."""
        return ModelCard(node=self._node, model=self._model, max_model_len=self._own() or 0)
