"""Other members' max_model_len for GET /v1/models (core/modelcards.py): whom to ask, when
to ask again, which answers to take, and what the list says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.modelcards import ASK_AGAIN_S, CARD_TTL_S, ModelCards, Serving, answers_queries


def member(node: str, model: str = "m", version: str = "0.3.0", inc: int = 1) -> Serving:
    return Serving(node=node, incarnation=inc, model=model, software_version=version)


def test_only_members_of_0_3_0_or_later_that_serve_a_model_are_asked() -> None:
    cards = ModelCards()
    members = [
        member("a"),
        member("b", version="0.2.0"),
        member("c", version=""),
        member("d", version="1.0.0rc1"),
        member("e", model=""),
        member("f", version="0.10.2"),
    ]
    assert cards.to_ask(members, 0.0) == ["a", "f"]
    assert [answers_queries(v) for v in ("0.3.0", "0.2.9", "0.3", "x.y.z", "1.2.3")] == [
        True,
        False,
        False,
        False,
        True,
    ]


def test_an_unanswered_member_is_asked_again_after_ask_again_s_and_an_answered_one_after_the_ttl() -> (
    None
):
    cards = ModelCards()
    a = [member("a")]
    assert cards.to_ask(a, 0.0) == ["a"]
    assert cards.to_ask(a, ASK_AGAIN_S - 0.1) == []
    assert cards.pending(ASK_AGAIN_S - 0.1)
    assert not cards.pending(ASK_AGAIN_S), "a silent member is waited for ask_again_s at most"
    assert cards.to_ask(a, ASK_AGAIN_S) == ["a"]
    assert cards.pending(ASK_AGAIN_S)
    assert cards.on_card("a", "m", 4096, ASK_AGAIN_S + 0.1)
    assert not cards.pending(ASK_AGAIN_S + 0.1)
    assert cards.lengths(a) == {"m": 4096}
    assert cards.to_ask(a, CARD_TTL_S) == []
    assert cards.to_ask(a, ASK_AGAIN_S + 0.1 + CARD_TTL_S) == ["a"]
    assert cards.lengths(a) == {"m": 4096}, "kept while it is asked again"


def test_a_new_incarnation_or_model_is_asked_again_and_its_old_card_not_shown() -> None:
    cards = ModelCards()
    cards.to_ask([member("a")], 0.0)
    cards.on_card("a", "m", 4096, 0.0)
    assert cards.to_ask([member("a", inc=2)], 1.0) == ["a"]
    assert cards.lengths([member("a", inc=2)]) == {"m": None}
    assert cards.to_ask([member("a", model="n", inc=2)], 1.5) == ["a"]
    assert not cards.on_card("a", "m", 4096, 1.6), "an answer about the model it left"
    assert cards.on_card("a", "n", 1024, 1.7)
    assert cards.lengths([member("a", model="n", inc=2)]) == {"n": 1024}


def test_answers_nobody_asked_for_are_refused_and_zero_means_ask_again() -> None:
    cards = ModelCards()
    assert not cards.on_card("x", "m", 10, 0.0)
    assert cards.refused == 1
    cards.to_ask([member("a")], 0.0)
    assert cards.on_card("a", "m", 0, 0.1)  # its engine does not know yet
    assert not cards.pending(0.1), "answered: not waited for"
    assert cards.to_ask([member("a")], ASK_AGAIN_S) == ["a"]


def test_members_that_left_are_forgotten() -> None:
    cards = ModelCards()
    cards.to_ask([member("a"), member("b")], 0.0)
    cards.on_card("a", "m", 100, 0.0)
    assert cards.pending(0.4)  # b
    cards.to_ask([member("c")], 0.5)
    assert not cards.on_card("a", "m", 100, 0.6), "a is no longer known"
    assert not cards.on_card("b", "m", 100, 0.6)
    assert cards.pending(0.6)  # c, asked at 0.5
    cards.to_ask([], 0.7)
    assert not cards.pending(0.7), "nobody left to wait for"


members = st.lists(
    st.builds(
        Serving,
        node=st.sampled_from("abcdef"),
        incarnation=st.integers(0, 2),
        model=st.sampled_from(["", "m", "n"]),
        software_version=st.sampled_from(["0.2.0", "0.3.0"]),
    ),
    max_size=6,
    unique_by=lambda m: m.node,
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("view"), members),
        st.tuples(
            st.just("card"),
            st.sampled_from("abcdef"),
            st.sampled_from(["m", "n"]),
            st.integers(0, 5000),
        ),
    ),
    max_size=30,
)


@given(steps)
def test_the_list_shows_only_what_the_member_serving_it_said_and_the_smallest_of_those(
    script: list[tuple],
) -> None:
    """Whatever the views and answers: each listed length is the smallest a member that
    serves the model now said for it at its current incarnation after we asked; members
    before 0.3.0 are never asked; no member is asked twice within ASK_AGAIN_S."""
    cards = ModelCards()
    now = 0.0
    view: list[Serving] = []
    said: dict[str, tuple[int, str, int]] = {}  # node -> (incarnation, model, length)
    last_ask: dict[str, tuple[float, int, str]] = {}  # node -> (when, incarnation, model)
    waiting: dict[str, float] = {}  # asked with nothing known, not answered -> when
    for step in script:
        now += 0.7
        if step[0] == "view":
            view = step[1]
            here = {m.node: m for m in view if m.model and m.software_version == "0.3.0"}
            for table in (said, last_ask, waiting):
                for gone in [n for n in table if n not in here]:
                    del table[gone]  # forgotten with the member (or not asked: too old)
            for node in cards.to_ask(view, now):
                m = here[node]
                when, inc, model = last_ask.get(node, (-1e9, -1, ""))
                assert now - when >= ASK_AGAIN_S or (inc, model) != (m.incarnation, m.model)
                last_ask[node] = (now, m.incarnation, m.model)
                if said.get(node, (None, None))[:2] != (m.incarnation, m.model):
                    said.pop(node, None)
                    waiting[node] = now
        else:
            _, node, model, length = step
            m = next((m for m in view if m.node == node), None)
            if cards.on_card(node, model, length, now):
                waiting.pop(node, None)
                if length > 0 and m is not None:
                    said[node] = (m.incarnation, model, length)
        assert cards.pending(now) == any(now - t < ASK_AGAIN_S for t in waiting.values())
        for model, length in cards.lengths(view).items():
            told = [
                said[m.node][2]
                for m in view
                if m.model == model
                and m.node in said
                and said[m.node][:2] == (m.incarnation, model)
            ]
            assert length == (min(told) if told else None)


def test_the_door_lists_ours_and_members_cards_and_refuses_a_card_from_another_connection() -> None:
    """http/clustermodels.py over the cards: our own length joins the members' (the smaller
    wins for a model both serve); a card that did not come on our connection to the member
    it names (Dispatcher: ``its_own`` False) is refused, whoever sent it."""
    from gossipd.clock import ManualClock
    from gossipd.core.gossip_messages import GpuState
    from gossipd.core.peer_messages import ModelCard
    from gossipd.http.clustermodels import ClusterModels
    from gossipd.membership.gossip import MemberView

    def view(node: str, model: str) -> MemberView:
        gpu = GpuState(model=model, software_version="0.3.0")
        return MemberView(node, "alive", 1, "tcp://127.0.0.1:1", gpu)

    clock = ManualClock()
    models = ClusterModels(node="me", model="m", own_max_model_len=lambda: 4096, clock=clock)
    live = [view("me", "m"), view("a", "m"), view("b", "n")]
    listed, ask = models.models(live)
    assert listed == {"m": 4096, "n": None} and sorted(ask) == ["a", "b"]
    assert models.pending()
    models.on_card(ModelCard(node="b", model="n", max_model_len=512), its_own=False)
    assert models.cards.refused == 1 and models.pending()
    models.on_card(ModelCard(node="b", model="n", max_model_len=512))
    models.on_card(ModelCard(node="a", model="m", max_model_len=2048))
    assert not models.pending()
    assert models.models(live) == ({"m": 2048, "n": 512}, [])
    assert models.card() == ModelCard(node="me", model="m", max_model_len=4096)
