"""The member table's state rules (gossipd/core/membership.py), by table and by state machine."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gossipd.core.gossip_messages import (
    Alive,
    Dead,
    GpuState,
    Left,
    MemberRecord,
    Meta,
    Suspect,
    Update,
)
from gossipd.core.membership import TRANSITIONS, MemberTable, State
from gossipd.core.messages import UpdateKind
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

ADDR = "tcp://10.0.0.1:7946"


def table_with(state: State, incarnation: int = 5) -> MemberTable:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    t.apply(Alive(node="x", incarnation=incarnation, addr=ADDR), 0.0)
    if state is State.SUSPECT:
        t.apply(Suspect(node="x", incarnation=incarnation, by="y"), 0.0)
    elif state is State.DEAD:
        t.apply(Dead(node="x", incarnation=incarnation, by="y"), 0.0)
    elif state is State.LEFT:
        t.apply(Left(node="x", incarnation=incarnation), 0.0)
    assert t.members["x"].state is state
    return t


def make(kind: str, inc: int):  # type: ignore[no-untyped-def]
    return {
        "alive": Alive(node="x", incarnation=inc, addr=ADDR),
        "suspect": Suspect(node="x", incarnation=inc, by="z"),
        "dead": Dead(node="x", incarnation=inc, by="z"),
        "left": Left(node="x", incarnation=inc),
    }[kind]


# (state before, update kind, incarnation delta) -> state after.  Rule 1: higher incarnation
# wins; rule 2 at equal incarnation: alive < suspect < dead < left.
ROWS = [
    (State.ALIVE, "alive", 0, State.ALIVE),
    (State.ALIVE, "alive", 1, State.ALIVE),
    (State.ALIVE, "suspect", 0, State.SUSPECT),
    (State.ALIVE, "suspect", -1, State.ALIVE),
    (State.ALIVE, "dead", 0, State.DEAD),
    (State.ALIVE, "left", 0, State.LEFT),
    (State.SUSPECT, "alive", 0, State.SUSPECT),
    (State.SUSPECT, "alive", 1, State.ALIVE),
    (State.SUSPECT, "dead", 0, State.DEAD),
    (State.SUSPECT, "left", 0, State.LEFT),
    (State.DEAD, "alive", 0, State.DEAD),
    (State.DEAD, "alive", 1, State.ALIVE),
    (State.DEAD, "suspect", 1, State.DEAD),
    (State.DEAD, "left", 0, State.LEFT),
    (State.LEFT, "alive", 0, State.LEFT),
    (State.LEFT, "alive", 1, State.ALIVE),
    (State.LEFT, "dead", 1, State.LEFT),
    (State.LEFT, "suspect", 1, State.LEFT),
]


@pytest.mark.parametrize(("before", "kind", "delta", "after"), ROWS)
def test_transition_table(before: State, kind: str, delta: int, after: State) -> None:
    t = table_with(before)
    t.apply(make(kind, 5 + delta), 1.0)
    assert t.members["x"].state is after


def test_transition_table_covers_every_live_pair_it_documents() -> None:
    assert (None, UpdateKind.ALIVE) in TRANSITIONS
    assert (None, UpdateKind.SUSPECT) not in TRANSITIONS  # rule 5
    assert all((s, UpdateKind.META) in TRANSITIONS for s in State)  # rule 6


@pytest.mark.parametrize(
    "news",
    [
        Suspect(node="me", incarnation=3, by="y"),
        Dead(node="me", incarnation=3, by="y"),
        Left(node="me", incarnation=3),
    ],
)
def test_a_member_never_declares_itself_dead_it_refutes(news) -> None:  # type: ignore[no-untyped-def]
    t = MemberTable(me="me", addr=ADDR, now=0.0, incarnation=3)
    outcome = t.apply(news, 1.0)
    assert outcome.refuted and t.incarnation == 4 and "me" not in t.members
    assert outcome.refute_to == getattr(news, "by", None)


def test_stale_news_about_me_is_answered_not_refuted_again() -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0, incarnation=7)
    outcome = t.apply(Suspect(node="me", incarnation=6, by="y"), 1.0)
    assert outcome.stale_about_me and not outcome.refuted and t.incarnation == 7


def test_a_leaving_member_does_not_refute() -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    t.leaving = True
    assert not t.apply(Dead(node="me", incarnation=0, by="y"), 1.0).refuted


def test_a_meta_of_version_0_is_never_taken_even_at_a_higher_incarnation() -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    t.apply(Alive(node="x", incarnation=1, addr=ADDR), 0.0)
    assert not t.apply(Meta(node="x", version=0, gpu=DRAINING, incarnation=1), 1.0).changed
    assert t.members["x"].gpu is None
    assert t.apply(Meta(node="x", version=1, gpu=DRAINING, incarnation=1), 1.0).changed


def test_a_leaving_member_hearing_a_higher_alive_of_its_own_leaves_again_above_it() -> None:
    """Refuted, the Alive undid the leave at every peer (our exit then read as a death);
    ignored, peers holding the higher Alive ignore our Left.  So: a Left above it."""
    node = SwimNode(SwimConfig(), node="me", addr=ADDR, rng=random.Random(1), now=0.0)
    node.bootstrap(0.0, [("me", ADDR), ("x", "tcp://10.0.0.9:1")])
    node.leave(1.0)
    outcome = node.apply(Alive(node="me", incarnation=5, addr=ADDR), 2.0)
    assert not outcome.refuted and node.table.incarnation == 6
    mine = [u for u in node.dissemination.piggyback() if getattr(u, "node", "") == "me"]
    assert Left(node="me", incarnation=6) in mine
    assert not any(isinstance(u, Alive) for u in mine)
    assert node.stats.refutations == 0
    # A peer holding the higher Alive takes the new Left.
    peer = MemberTable(me="x", addr="tcp://10.0.0.9:1", now=0.0)
    peer.apply(Alive(node="me", incarnation=5, addr=ADDR), 2.0)
    assert peer.apply(Left(node="me", incarnation=6), 2.1).changed
    assert peer.members["me"].state is State.LEFT


def test_suspicion_confirmations_count_distinct_members_and_go_to_the_accuser() -> None:
    t = table_with(State.SUSPECT)
    first = t.apply(Suspect(node="x", incarnation=5, by="a"), 1.0)
    assert first.changed and not first.rebroadcast and first.confirm_to is None
    assert not t.apply(Suspect(node="x", incarnation=5, by="a"), 1.0).changed
    mine = t.apply(Suspect(node="x", incarnation=5, by="me"), 1.0)
    assert mine.confirm_to == "y" and t.members["x"].suspicion.witness
    assert t.members["x"].suspicion.confirmers == {"y", "a", "me"}


def test_a_suspicion_counts_at_most_k_confirmers_however_many_suspects_name_others() -> None:
    """A message may carry 4,096 Suspects, each with another confirmer: past K they change
    no timer, and the set stays at K + 1 names (the accuser and K)."""
    t = table_with(State.SUSPECT)
    t.apply(Suspect(node="x", incarnation=5, by="y"), 1.0)
    suspicion = t.members["x"].suspicion
    assert suspicion is not None
    k = suspicion.k
    for i in range(50):
        t.apply(Suspect(node="x", incarnation=5, by=f"m{i}"), 1.0)
    assert len(suspicion.confirmers) == k + 1 < 50


def test_metadata_has_its_own_version_and_never_changes_state() -> None:
    t = table_with(State.SUSPECT)
    gpu = GpuState(model="m", running_requests=3)
    assert t.apply(Meta(node="x", version=2, gpu=gpu), 1.0).changed
    assert not t.apply(Meta(node="x", version=1, gpu=GpuState()), 1.0).changed
    assert t.members["x"].gpu == gpu and t.members["x"].state is State.SUSPECT


SERVING = GpuState(model="m", rpc="tcp://x:1", status="serving")
DRAINING = GpuState(model="m", rpc="tcp://x:1", status="draining")
MOVED = "tcp://10.0.0.2:7946"


def test_metadata_is_ordered_by_incarnation_then_version() -> None:
    """Rule 6: a restarted process counts versions from 0 again; its incarnation outranks."""
    t = table_with(State.ALIVE, incarnation=0)
    assert t.apply(Meta(node="x", version=200, gpu=DRAINING, incarnation=0), 1.0).changed
    assert t.apply(Meta(node="x", version=2, gpu=SERVING, incarnation=1), 1.0).changed
    assert not t.apply(Meta(node="x", version=201, gpu=DRAINING, incarnation=0), 1.0).changed
    assert not t.apply(Meta(node="x", version=2, gpu=DRAINING, incarnation=1), 1.0).changed
    m = t.members["x"]
    assert (m.gpu, m.meta_incarnation, m.meta_version) == (SERVING, 1, 2)


# (state before, Alive's incarnation delta, at another address?, the stored metadata's
# incarnation delta) -> is the stored metadata kept?  Rule 8a: a rejoin after dead or left, or
# a move, starts without the previous life's GPU state; a refutation in place keeps it.
REJOIN_ROWS = [
    (State.ALIVE, 1, False, 0, True),  # a refutation: same process, same endpoints
    (State.SUSPECT, 1, False, 0, True),
    (State.ALIVE, 1, True, 0, False),  # back at another address: a new process
    (State.SUSPECT, 1, True, 0, False),
    (State.DEAD, 1, False, 0, False),
    (State.LEFT, 1, False, 0, False),
    (State.LEFT, 3, True, 0, False),
    (State.LEFT, 1, False, 1, True),  # its new life's metadata came before its Alive
    (State.DEAD, 1, True, 1, True),
    (State.LEFT, 0, False, 0, True),  # not a rejoin: the Alive is stale
    (State.ALIVE, 0, True, 0, True),
]


@pytest.mark.parametrize(("before", "delta", "moved", "meta_delta", "kept"), REJOIN_ROWS)
def test_rejoin_table(before: State, delta: int, moved: bool, meta_delta: int, kept: bool) -> None:
    t = table_with(before)
    t.apply(Meta(node="x", version=90, gpu=DRAINING, incarnation=5 + meta_delta), 1.0)
    t.apply(Alive(node="x", incarnation=5 + delta, addr=MOVED if moved else ADDR), 2.0)
    m = t.members["x"]
    assert (m.gpu == DRAINING) is kept and (m.gpu is None) is (not kept)
    if not kept:
        assert (m.meta_incarnation, m.meta_version) == (5 + delta, 0)
        # The previous life's metadata stays out, wherever it was delayed; the new life's wins.
        assert not t.apply(Meta(node="x", version=91, gpu=DRAINING, incarnation=5), 3.0).changed
        assert t.apply(Meta(node="x", version=1, gpu=SERVING, incarnation=5 + delta), 3.0).changed
        assert m.gpu == SERVING


def test_metadata_of_a_previous_life_makes_the_member_refute_and_publish_again() -> None:
    """Rule 8b: a restarted process hears its old metadata (a higher pair, or the same pair
    with other content) and outranks it."""
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    mine = t.publish_meta(SERVING)
    assert (mine.incarnation, mine.version) == (0, 1)
    assert not t.apply(mine, 1.0).changed, "our own metadata coming back is not news"
    outcome = t.apply(Meta(node="me", version=200, gpu=DRAINING, incarnation=0), 1.0)
    assert outcome.refuted and t.incarnation == 1
    assert t.publish_meta(SERVING).incarnation == 1
    assert not t.apply(Meta(node="me", version=201, gpu=DRAINING, incarnation=0), 2.0).changed
    same_pair = Meta(node="me", version=2, gpu=DRAINING, incarnation=1)
    assert t.apply(same_pair, 2.0).refuted and t.incarnation == 2
    t.leaving = True
    assert not t.apply(Meta(node="me", version=999, gpu=DRAINING, incarnation=9), 3.0).changed


@settings(max_examples=300)
@given(
    old_inc=st.integers(0, 3),
    old_versions=st.integers(1, 6),
    new_versions=st.integers(2, 5),
    how=st.sampled_from(["left", "dead", "alive"]),
    moved=st.booleans(),
    order=st.randoms(use_true_random=False),
    repeats=st.lists(st.integers(0, 20), max_size=6),
)
def test_a_restarted_member_ends_with_its_new_life_whatever_the_delivery_order(
    old_inc: int,
    old_versions: int,
    new_versions: int,
    how: str,
    moved: bool,
    order: random.Random,
    repeats: list[int],
) -> None:
    """The previous life published versions 1..n at old_inc and stopped (left, was declared
    dead, or is still thought alive); the new life published version 1 at old_inc (before it
    learnt better) and then, refuting, from version 2 at old_inc + 1 (rule 6).  Delivered in any order, with repeats, every
    member ends with the new life alive and its latest GPU state."""
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    t.apply(Alive(node="x", incarnation=old_inc, addr=ADDR), 0.0)
    old = [
        Meta(node="x", version=v, gpu=DRAINING, incarnation=old_inc)
        for v in range(1, old_versions + 1)
    ]
    down = {
        "left": [Left(node="x", incarnation=old_inc)],
        "dead": [Dead(node="x", incarnation=old_inc, by="y")],
        "alive": [],
    }[how]
    addr = MOVED if moved else ADDR
    new_gpu = [GpuState(model="m", rpc=addr, running_requests=v) for v in range(new_versions)]
    new = [
        Meta(node="x", version=1, gpu=new_gpu[0], incarnation=old_inc),
        Alive(node="x", incarnation=old_inc, addr=addr),
        Alive(node="x", incarnation=old_inc + 1, addr=addr),
        *(
            Meta(node="x", version=v + 1, gpu=new_gpu[v], incarnation=old_inc + 1)
            for v in range(1, new_versions)
        ),
    ]
    updates: list[Update] = [*old, *down, *new]
    updates += [updates[i % len(updates)] for i in repeats]
    order.shuffle(updates)
    keys = []
    for now, update in enumerate(updates, start=1):
        t.apply(update, float(now))
        m = t.members["x"]
        keys.append((m.meta_incarnation, m.meta_version))
    assert keys == sorted(keys), "a member's metadata key never goes back"
    m = t.members["x"]
    assert (m.state, m.incarnation, m.addr) == (State.ALIVE, old_inc + 1, addr)
    assert m.gpu == new_gpu[-1]


def test_push_pull_dead_record_is_only_suspected_here() -> None:
    t = table_with(State.ALIVE)
    record = MemberRecord(node="x", addr=ADDR, incarnation=5, state="dead")
    for update in t.merge_record(record, sender="s"):
        t.apply(update, 1.0)
    assert t.members["x"].state is State.SUSPECT


@pytest.mark.parametrize("state", ["dead", "left", "suspect"])
def test_a_push_pull_record_of_our_previous_life_is_refuted_dead_too(state: str) -> None:
    """A restarted member hears its previous life's record in a seed's push-pull reply and
    refutes it (MEMBERSHIP.md, "A restart"): a dead one was dropped with the rule that
    ignores dead members we do not know, and we are never in our own table."""
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    record = MemberRecord(node="me", addr=ADDR, incarnation=5, state=state)
    outcomes = [t.apply(update, 1.0) for update in t.merge_record(record, sender="s")]
    assert any(o.refuted for o in outcomes) and t.incarnation > 5
    assert "me" not in t.members


def test_checksum_depends_on_live_set_and_incarnations_only() -> None:
    a = MemberTable(me="a", addr=ADDR, now=0.0)
    b = MemberTable(me="b", addr=ADDR, now=0.0)
    a.apply(Alive(node="b", incarnation=0, addr=ADDR), 0.0)
    b.apply(Alive(node="a", incarnation=0, addr=ADDR), 0.0)
    assert a.checksum() == b.checksum()
    a.apply(Alive(node="b", incarnation=1, addr=ADDR), 0.0)
    assert a.checksum() != b.checksum()


NODES = st.sampled_from(["me", "a", "b", "c"])
INCS = st.integers(0, 4)


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = MemberTable(me="me", addr=ADDR, now=0.0)
        self.seen_inc: dict[str, int] = {}
        self.seen_meta: dict[str, tuple[int, int]] = {}
        self.my_inc = 0
        self.now = 0.0

    @rule(
        kind=st.sampled_from(["alive", "suspect", "dead", "left", "meta"]),
        node=NODES,
        inc=INCS,
        by=NODES,
    )
    def apply(self, kind: str, node: str, inc: int, by: str) -> None:
        self.now += 0.1
        update = {
            "alive": Alive(node=node, incarnation=inc, addr=ADDR),
            "suspect": Suspect(node=node, incarnation=inc, by=by),
            "dead": Dead(node=node, incarnation=inc, by=by),
            "left": Left(node=node, incarnation=inc),
            "meta": Meta(
                node=node, version=inc, gpu=GpuState(running_requests=inc), incarnation=inc % 3
            ),
        }[kind]
        before = self.t.members.get(node)
        before_state = None if before is None else (before.state, before.incarnation)
        outcome = self.t.apply(update, self.now)
        if node == "me" and kind in ("suspect", "dead", "left") and inc >= self.my_inc:
            assert outcome.refuted and self.t.incarnation == inc + 1
        if before_state is not None and before_state[0] is State.LEFT and kind != "meta":
            member = self.t.members[node]
            assert member.state is State.LEFT or member.incarnation > before_state[1]
        self.my_inc = self.t.incarnation

    @invariant()
    def never_lists_itself(self) -> None:
        assert "me" not in self.t.members

    @invariant()
    def incarnations_never_go_back(self) -> None:
        for node, m in self.t.members.items():
            assert m.incarnation >= self.seen_inc.get(node, 0)
            self.seen_inc[node] = m.incarnation

    @invariant()
    def metadata_keys_never_go_back(self) -> None:
        for node, m in self.t.members.items():
            key = (m.meta_incarnation, m.meta_version)
            assert key >= self.seen_meta.get(node, (0, 0))
            self.seen_meta[node] = key

    @invariant()
    def incremental_checksum_and_count_match_a_recount(self) -> None:
        from gossipd.core.membership import _contribution

        live = [m for m in self.t.members.values() if m.state in (State.ALIVE, State.SUSPECT)]
        xor = _contribution("me", self.t.incarnation)
        for m in live:
            xor ^= _contribution(m.node, m.incarnation)
        assert self.t.checksum() == xor >> 1
        assert self.t.live_count() == 1 + len(live)

    @invariant()
    def state_index_matches_states(self) -> None:
        for state, names in (
            (State.SUSPECT, self.t.suspects),
            (State.DEAD, self.t.dead),
            (State.LEFT, self.t.left),
        ):
            assert names == {n for n, m in self.t.members.items() if m.state is state}
        for m in self.t.members.values():
            assert (m.suspicion is not None) == (m.state is State.SUSPECT)


TestTableMachine = TableMachine.TestCase


def test_a_full_table_refuses_new_members_and_still_updates_known_ones() -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    t.members_max = 2
    for node in ("a", "b", "c"):
        t.apply(Alive(node=node, incarnation=0, addr=ADDR), 0.0)
    assert set(t.members) == {"a", "b"} and t.refused_full == 1 and t.live_count() == 3
    assert t.apply(Suspect(node="a", incarnation=0, by="b"), 1.0).changed
    assert t.members["a"].state is State.SUSPECT


@pytest.mark.parametrize(
    ("state", "declared"),
    [(State.ALIVE, False), (State.SUSPECT, True), (State.DEAD, False), (State.LEFT, False)],
)
def test_only_a_suspect_is_declared_dead_by_its_timer(state: State, declared: bool) -> None:
    t = table_with(state)
    expected = Dead(node="x", incarnation=5, by="me") if declared else None
    assert t.declare_dead("x", 9.0) == expected
    assert t.declare_dead("nobody", 9.0) is None


GPU = GpuState(model="m", running_requests=1)


# A push-pull record about a member we know -> the updates it stands for (rule 7: suspect and
# dead are only suspected, by the sender; metadata only with a version).
MERGE_ROWS = [
    ("alive", 0, None, [Alive(node="x", incarnation=4, addr=ADDR)]),
    ("suspect", 0, None, [Alive(node="x", incarnation=4, addr=ADDR),
                          Suspect(node="x", incarnation=4, by="s")]),
    ("dead", 0, None, [Alive(node="x", incarnation=4, addr=ADDR),
                       Suspect(node="x", incarnation=4, by="s")]),
    ("left", 0, None, [Left(node="x", incarnation=4)]),
    ("alive", 3, GPU, [Alive(node="x", incarnation=4, addr=ADDR),
                       Meta(node="x", version=3, gpu=GPU)]),
    ("left", 3, GPU, [Left(node="x", incarnation=4), Meta(node="x", version=3, gpu=GPU)]),
    ("alive", 0, GPU, [Alive(node="x", incarnation=4, addr=ADDR)]),
]  # fmt: skip


@pytest.mark.parametrize(("state", "meta_version", "gpu", "updates"), MERGE_ROWS)
def test_merge_record_table(
    state: str, meta_version: int, gpu: GpuState | None, updates: list[object]
) -> None:
    record = MemberRecord(
        node="x",
        addr=ADDR,
        incarnation=4,
        state=state,  # type: ignore[arg-type]
        meta_version=meta_version,
        gpu=gpu,
    )
    table = MemberTable(me="me", addr=ADDR, now=0.0)
    table.apply(Alive(node="x", incarnation=0, addr=ADDR), 0.0)  # known (below: unknown)
    assert table.merge_record(record, sender="s") == updates


def test_merge_record_of_a_dead_member_we_do_not_know_stands_for_nothing() -> None:
    """(A member we reaped must not come back through a record of it; a suspect one we do
    not know is live, and learned as suspect.)"""
    table = MemberTable(me="me", addr=ADDR, now=0.0)
    dead = MemberRecord(node="x", addr=ADDR, incarnation=4, state="dead", meta_version=3, gpu=GPU)
    assert table.merge_record(dead, sender="s") == []
    suspect = msgspec.structs.replace(dead, state="suspect")
    assert table.merge_record(suspect, sender="s")[:2] == [
        Alive(node="x", incarnation=4, addr=ADDR),
        Suspect(node="x", incarnation=4, by="s"),
    ]


def test_reap_forgets_dead_and_left_members_after_their_ages_and_never_live_ones() -> None:
    t = MemberTable(me="me", addr=ADDR, now=0.0)
    for node in ("a", "b", "c", "d"):
        t.apply(Alive(node=node, incarnation=0, addr=ADDR), 0.0)
    t.apply(Suspect(node="b", incarnation=0, by="a"), 0.0)
    t.apply(Dead(node="c", incarnation=0, by="a"), 10.0)
    t.apply(Left(node="d", incarnation=0), 20.0)
    version = t.live_version

    def reap(now: float) -> list[str]:
        return t.reap(now, dead_after_s=100.0, left_after_s=10.0)

    assert reap(29.9) == [] and t.live_version == version
    assert reap(30.0) == ["d"] and t.live_version == version + 1
    assert reap(109.9) == []
    assert reap(110.0) == ["c"] and t.live_version == version + 2
    assert reap(1e9) == []
    assert set(t.members) == {"a", "b"} and not t.dead and not t.left
    assert t.members["b"].state is State.SUSPECT
    # Forgotten, a member that comes back joins afresh, even at its old incarnation.
    assert t.apply(Alive(node="c", incarnation=0, addr=ADDR), 200.0).changed
    assert t.members["c"].state is State.ALIVE


def test_prefix_hashes_are_stored_compact_and_given_back_whole_in_records() -> None:
    """A member's prefix hashes live apart from its GPU state (4 bytes each, issue 17); a
    push-pull record carries them as they came."""
    table = MemberTable(me="a", addr="tcp://a:1", now=0.0)
    table.apply(Alive(node="b", incarnation=0, addr="tcp://b:1"), 0.0)
    gpu = GpuState(rpc="tcp://b:2", prefixes=[7, 2**32 - 1, 3])
    table.apply(Meta(node="b", version=1, gpu=gpu, incarnation=0), 0.0)
    member = table.members["b"]
    assert list(member.prefixes) == [7, 2**32 - 1, 3] and member.prefixes.itemsize == 4
    assert member.gpu is not None and member.gpu.prefixes == []
    assert member.record().gpu == gpu
    table.apply(Meta(node="b", version=2, gpu=GpuState(rpc="tcp://b:2"), incarnation=0), 0.0)
    assert member.prefixes == () and member.record().gpu == GpuState(rpc="tcp://b:2")
