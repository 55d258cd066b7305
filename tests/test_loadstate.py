"""Load records (issue 17, core/loadstate.py): the view keeps the newest sample per member
whatever order copies arrive in, the rumor queue sends newest first within its budget and
each record a bounded number of times, the wire form decodes (and older peers ignore it),
and the placer uses an owner's load as soon as a reply brings it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.gossip_messages import (
    Alive,
    GossipOnly,
    GpuState,
    LoadRecord,
    Meta,
    decode_gossip,
    encode_gossip,
    encode_update,
)
from gossipd.core.loadstate import CONFIRM_MIN_S, LoadRumors, LoadSampler, LoadView, with_age
from gossipd.core.messages import Task
from gossipd.core.peer_messages import ForwardReply, TaskDone, decode_peer, encode_peer
from gossipd.errors import RemoteProtocolError
from tests.test_placer import NAMES, Harness

NODES = ["a", "b", "c", "d"]

records = st.builds(
    LoadRecord,
    st.sampled_from(NODES),
    st.integers(0, 20),
    st.integers(0, 5000),
    st.integers(0, 100),
    st.integers(0, 10),
    st.integers(0, 10**6),
    st.integers(0, 100),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(records, st.floats(0, 100)), max_size=40))
def test_the_view_holds_each_members_newest_sample_in_any_arrival_order(arrivals) -> None:  # type: ignore[no-untyped-def]
    view = LoadView()
    now = 0.0
    best: dict[str, tuple[int, float]] = {}
    for record, step in arrivals:
        now += step
        sampled_at = now - record.age_ms / 1000.0
        old = best.get(record.node)
        newer = (
            old is None
            or record.seq > old[0]
            or (record.seq == old[0] and sampled_at >= old[1] + CONFIRM_MIN_S)
        )
        kept = view.offer(record, now)
        assert (kept is not None) == newer
        if newer:
            best[record.node] = (record.seq, sampled_at)
        known = view.get(record.node)
        assert known is not None
        assert (known.record.seq, known.sampled_at) == best[record.node]
        assert known.age_s(now) == pytest.approx(max(0.0, now - best[record.node][1]))
    assert len(view) == len(best)
    for node in NODES:
        view.forget(node)
    assert len(view) == 0


def test_the_view_refuses_members_past_its_bound() -> None:
    view = LoadView(members_max=1)
    assert view.offer(LoadRecord("a", 1), 0.0) is not None
    assert view.offer(LoadRecord("b", 1), 0.0) is None and view.refused_full == 1
    assert view.offer(LoadRecord("a", 2), 0.0) is not None  # a known member still updates
    assert view.age_s("a", 1.5) == 1.5 and view.age_s("b", 1.5) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.sampled_from(NODES), st.floats(0, 10)),
            st.tuples(st.just("take"), st.integers(0, 120), st.sampled_from(["", *NODES])),
        ),
        max_size=50,
    ),
    st.integers(1, 4),
)
def test_rumors_go_newest_first_within_the_budget_and_a_bounded_number_of_times(
    ops, transmits
) -> None:  # type: ignore[no-untyped-def]
    rumors = LoadRumors(transmits=transmits, age_max_s=5.0)
    model: dict[str, list[float | int]] = {}  # node -> [sampled_at, sends_left, seq]
    now, seq = 10.0, 0
    for op in ops:
        now += 0.1
        if op[0] == "add":
            _, node, back_s = op
            seq += 1
            rumors.add(LoadRecord(node, seq), now - back_s)
            model[node] = [now - back_s, transmits, seq]
            continue
        _, bytes_max, exclude = op
        for node in [n for n, (at, _, _) in model.items() if at < now - 5.0]:
            del model[node]
        sent = rumors.take(now, bytes_max, exclude=exclude)
        expect: list[str] = []
        used = 0
        for node in sorted(model, key=lambda n: (-model[n][0], n)):
            if node == exclude:
                continue
            size = len(encode_update(LoadRecord(node, int(model[node][2]))))  # type: ignore[arg-type]
            if used + size > bytes_max:
                break
            used += size
            expect.append(node)
        assert [r.node for r in sent] == expect
        for r in sent:
            at, left, s = model[r.node]
            assert r.seq == s and r.age_ms == int((now - at) * 1000)
            if left == 1:
                del model[r.node]
            else:
                model[r.node][1] = int(left) - 1
        assert len(rumors) == len(model)


def test_rumors_refuse_a_budget_of_no_sends() -> None:
    with pytest.raises(ValueError, match="transmits must be >= 1"):
        LoadRumors(transmits=0, age_max_s=1.0)


def test_the_sampler_takes_a_new_seq_only_when_a_figure_changed() -> None:
    sampler = LoadSampler("a", 1000)
    first = sampler.current(0.0, inflight=3, kv_ratio=0.5)
    assert first.seq == 1001 and first.kv_pct == 50
    assert sampler.current(1.0, inflight=3, kv_ratio=0.5) is first
    second = sampler.current(2.0, inflight=4, kv_ratio=0.5)
    assert second.seq == 1002 and second.inflight == 4
    assert with_age(second, 1.0, 2.5).age_ms == 1500
    assert with_age(second, 2.0, 1.0).age_ms == 0  # never negative


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**64), st.integers(0, 2**64), st.integers(0, 2**64))
def test_the_sampler_cuts_its_figures_to_what_a_record_may_carry(
    inflight: int, waiting: int, queued: int
) -> None:
    """A figure past the record's bounds would make peers refuse every message carrying it
    (gossip and ForwardReplies): the sampler cuts them, so its record always decodes."""
    sampler = LoadSampler("a", 1)
    record = sampler.current(0.0, inflight=inflight, waiting=waiting, queued_tokens=queued)
    done = TaskDone(id="t", node="a", load=record)
    assert decode_peer(encode_peer(done), bytes_max=1 << 16) == done
    assert record.queued_tokens == min(queued, 2**40) and record.inflight == min(inflight, 2**31)
    # The same figures again are the same record (not a new seq on every call): compared
    # as the record carries them.
    assert sampler.current(1.0, inflight=inflight, waiting=waiting, queued_tokens=queued) is record


@settings(max_examples=200, deadline=None)
@given(records)
def test_load_records_travel_on_replies_and_gossip_and_older_peers_ignore_them(record) -> None:  # type: ignore[no-untyped-def]
    reply = ForwardReply(req=1, node=record.node, accepted=True, load=record)
    done = TaskDone(id="t", node=record.node, load=record)
    assert decode_peer(encode_peer(reply), bytes_max=1 << 20) == reply
    assert decode_peer(encode_peer(done), bytes_max=1 << 20) == done
    gossip = GossipOnly(cluster="c", src="a", src_addr="tcp://10.0.0.1:1", loads=[record])
    assert decode_gossip(encode_gossip(gossip), bytes_max=1 << 20) == gossip

    class OldForwardReply(msgspec.Struct, tag_field="t", tag=21):  # the struct before issue 17
        req: int
        node: str
        accepted: bool
        v: int = 1

    old = msgspec.msgpack.decode(encode_peer(reply), type=OldForwardReply)
    assert (old.req, old.node, old.accepted) == (1, record.node, True)


def test_a_malformed_load_record_is_refused_with_the_message() -> None:
    bad = msgspec.msgpack.encode(
        {"t": 21, "v": 1, "req": 1, "node": "a", "accepted": True, "load": ["a", 1, -5]}
    )
    with pytest.raises(RemoteProtocolError, match="invalid peer message"):
        decode_peer(bad, bytes_max=1 << 20)


def test_the_placer_uses_an_owners_load_from_its_reply_and_records_its_age() -> None:
    h = Harness()
    for name in NAMES:
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        h.apply(Meta(node=name, version=1, gpu=GpuState(rpc=f"tcp://{name}:5558"), incarnation=0))
    placer = h.placer()
    task = Task(v=1, id="t1", key="k", prompt="p", reply_to="tcp://1.2.3.4:5")
    owner = placer.owner_for(task, 5.0)
    assert owner is not None and owner != "me"
    assert placer.state_ages.unknown == 1  # its Meta only, so far
    # The owner answers: saturated (its engine queue is long), as of 200 ms ago.
    busy = LoadRecord(owner, 7, 200, 3, 1_000_000, 0, 10)
    assert placer.on_load(busy, 5.0)
    assert owner in placer.view().saturated
    assert placer.owner_for(task, 5.0) != owner  # the next decision avoids it
    # The age recorded is the chosen member's state: of that one we had no record either.
    assert placer.state_ages.unknown == 2 and placer.state_ages.count == 0
    # An older copy (gossip relayed late) changes nothing; a newer idle one frees it.
    assert not placer.on_load(LoadRecord(owner, 6, 0, 0, 0, 0, 0), 5.0)
    assert placer.on_load(LoadRecord(owner, 8, 0, 0, 0, 0, 0), 5.0)
    assert placer.owner_for(task, 5.0) == owner
    assert placer.state_ages.count == 1 and placer.state_ages.counts[0] == 1  # ~0 s old


def test_a_swim_node_hands_the_load_records_a_gossip_message_carries_to_its_shell() -> None:
    import random

    from gossipd.core.swim import SwimNode
    from gossipd.core.swim_config import SwimConfig

    record = LoadRecord("b", 3, 40, 1, 0, 0, 5)
    message = GossipOnly(cluster="default", src="b", src_addr="tcp://10.0.0.2:1", loads=[record])
    deaf = SwimNode(SwimConfig(), node="a", addr="tcp://10.0.0.1:1", rng=random.Random(1), now=0.0)
    deaf.receive(1.0, encode_gossip(message))  # no listener: nothing to hand over (no error)
    got: list[list[LoadRecord]] = []
    node = SwimNode(
        SwimConfig(),
        node="a",
        addr="tcp://10.0.0.1:1",
        rng=random.Random(1),
        now=0.0,
        on_loads=got.append,
    )
    node.receive(1.0, encode_gossip(message))
    node.receive(
        1.0, encode_gossip(GossipOnly(cluster="default", src="b", src_addr="tcp://10.0.0.2:1"))
    )
    assert got == [[record]]  # a message without loads hands nothing
