"""Push-pull in pages (core/antientropy.py rule 1a, docs/PROTOCOL.md "Push-pull in pages"):
pages bounded in bytes, paced, each applied as it arrives; two tables with arbitrary
differences converge after a paged exchange exactly as after a one-message exchange; no
cache of the table's records outlives an exchange."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from gossipd.core.antientropy import STREAMS_MAX
from gossipd.core.gossip_messages import (
    Alive,
    Dead,
    GossipMessage,
    GpuState,
    Left,
    Meta,
    PushPull,
    PushPullEncoded,
    Suspect,
    Update,
    decode_gossip,
    encode_gossip,
    encode_record,
)
from gossipd.core.membership import shared_base
from gossipd.core.messages import ENDPOINT_CHARS_MAX
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

PAGE_BYTES = 16 * 1024
PAGED = SwimConfig(cluster="c", push_pull_page_bytes=PAGE_BYTES)
SMALL = SwimConfig(cluster="c", push_pull_page_bytes=4096)  # two or three 256-prefix records
WHOLE = SwimConfig(cluster="c")  # 1 MiB pages: these tables fit in one
BYTES_MAX = 8 * 1024 * 1024


def addr_of(name: str) -> str:
    return f"tcp://{name}:7946"


def gpu(prefixes: int, seed: int = 0) -> GpuState:
    rng = random.Random(seed)
    return GpuState(rpc="tcp://x:5558", prefixes=[rng.getrandbits(32) for _ in range(prefixes)])


def make(name: str, updates: list[Update], config: SwimConfig = PAGED) -> SwimNode:
    """A member whose table holds ``updates`` (applied by the table's rules), no timers due."""
    node = SwimNode(config, node=name, addr=addr_of(name), rng=random.Random(1), now=0.0)
    for update in updates:
        node.table.apply(update, 0.0)
    ae = node.antientropy
    ae.next_push_pull_at = ae.next_heal_at = math.inf
    node.take_outbox()
    node.take_events()
    return node


def exchange(a: SwimNode, b: SwimNode, now: float = 0.0) -> list[tuple[str, float, int, PushPull]]:
    """``a`` push-pulls with ``b``; every page is delivered as it leaves, later pages when
    their time comes.  Returns (sender, time, bytes, page) for each page."""
    nodes = {a.addr: a, b.addr: b}
    pages: list[tuple[str, float, int, PushPull]] = []
    a.antientropy.push_pull(b.addr, reply=True, now=now)
    for _ in range(100_000):
        moved = False
        for sender in (a, b):
            for addr, data in sender.take_outbox():
                msg = decode_gossip(data, bytes_max=BYTES_MAX)
                if isinstance(msg, PushPull) and addr in nodes:
                    pages.append((sender.node, now, len(data), msg))
                    nodes[addr].receive(now, data)
                    moved = True
        if moved:
            continue
        due = min(a.antientropy.next_page_at, b.antientropy.next_page_at)
        if due == math.inf:
            return pages
        now = due
        a.antientropy.tick(now)
        b.antientropy.tick(now)
    raise AssertionError("the exchange never ended")


def view(node: SwimNode) -> dict[str, tuple[Any, ...]]:
    return {
        name: (
            m.addr,
            m.incarnation,
            m.state.value,
            m.meta_incarnation,
            m.meta_version,
            m.gpu,
            tuple(m.prefixes),
        )
        for name, m in node.table.members.items()
    }


# -- arbitrary differences --------------------------------------------------------------------

SUBJECTS = [f"n{i:02d}" for i in range(40)]
subjects = st.sampled_from(SUBJECTS)
incarnations = st.integers(0, 4)


@st.composite
def tables(draw: st.DrawFn) -> list[Update]:
    """News about up to 40 members: each joins alive, then may be suspected, declared dead,
    leave, and publish GPU state (with up to 256 prefix hashes: pages of ten records or so)."""
    out: list[Update] = []
    for name in draw(st.lists(subjects, unique=True, max_size=40)):
        inc = draw(incarnations)
        out.append(Alive(node=name, incarnation=inc, addr=addr_of(name)))
        kind = draw(st.integers(0, 5))
        if kind == 1:
            out.append(Suspect(node=name, incarnation=inc, by="zz"))
        elif kind == 2:
            out.append(Dead(node=name, incarnation=inc, by="zz"))
        elif kind == 3:
            out.append(Left(node=name, incarnation=inc))
        if draw(st.booleans()):
            # A member publishes one state per (incarnation, version): its content follows.
            version = draw(st.integers(1, 3))
            state = gpu([0, 8, 256][(inc + version) % 3], seed=hash((name, inc, version)))
            out.append(Meta(node=name, version=version, incarnation=inc, gpu=state))
    return out


@settings(max_examples=60, deadline=None)
@given(a_news=tables(), b_news=tables())
def test_two_tables_with_arbitrary_differences_converge_after_a_paged_exchange(
    a_news: list[Update], b_news: list[Update]
) -> None:
    a, b = make("a", a_news, SMALL), make("b", b_news, SMALL)
    pages = exchange(a, b)
    # The same exchange in one message each way: the paged one ends in the same tables (the
    # answer leaves after the last page, as it did after the one message).
    a1, b1 = make("a", a_news, WHOLE), make("b", b_news, WHOLE)
    whole = exchange(a1, b1)
    assert len(whole) == 2
    assert view(a) == view(a1) and view(b) == view(b1)
    assert all(size <= 4096 for _, _, size, _ in pages)
    target(float(len(pages)))  # towards tables of many pages
    event("one page each way" if len(pages) == 2 else "several pages")
    # Every difference repaired: whoever either side knows live, both know, at the same
    # incarnation, and GPU state both hold is the same version.  (Members both hold dead or
    # left may keep different incarnations: the table's rules, paged or not.)
    for name in (set(a.table.members) | set(b.table.members)) - {"a", "b"}:
        ma, mb = a.table.members.get(name), b.table.members.get(name)
        if any(m is not None and m.state.value in ("alive", "suspect") for m in (ma, mb)):
            assert ma is not None and mb is not None, name
            assert ma.incarnation == mb.incarnation, name
        if ma is not None and mb is not None and ma.gpu is not None and mb.gpu is not None:
            assert (ma.meta_incarnation, ma.meta_version, ma.gpu, list(ma.prefixes)) == (
                mb.meta_incarnation,
                mb.meta_version,
                mb.gpu,
                list(mb.prefixes),
            ), name
    # Nothing left to repair: a second exchange changes nothing.
    before = (view(a), view(b))
    exchange(b, a, now=10.0)
    assert (view(a), view(b)) == before
    assert a.antientropy.next_deadline() == b.antientropy.next_deadline() == math.inf


# -- the pages -------------------------------------------------------------------------------


def big_table(n: int, prefixes: int = 256) -> list[Update]:
    out: list[Update] = []
    for i in range(n):
        name = f"m{i:04d}"
        out.append(Alive(node=name, incarnation=0, addr=addr_of(name)))
        out.append(Meta(node=name, version=1, gpu=gpu(prefixes, seed=i)))
    return out


def test_a_large_table_goes_in_bounded_pages_paced_each_member_once_our_own_first() -> None:
    a, b = make("a", big_table(60)), make("b", [])
    a.set_gpu(0.0, gpu(256, seed=99))
    pages = [(t, size, p) for sender, t, size, p in exchange(a, b) if sender == "a"]
    assert len(pages) >= 5  # 60 records of about 1.4 KB in 16 KiB pages
    assert all(size <= PAGE_BYTES for _, size, _ in pages)
    assert [p.page for _, _, p in pages] == list(range(len(pages)))
    assert [p.more for _, _, p in pages] == [True] * (len(pages) - 1) + [False]
    assert [p.reply for _, _, p in pages] == [False] * (len(pages) - 1) + [True]
    # The first page at once, then one every push_pull_page_interval_s.
    times = [t for t, _, _ in pages]
    assert times == pytest.approx([i * PAGED.push_pull_page_interval_s for i in range(len(pages))])
    records = [r for _, _, p in pages for r in p.members]
    # (our own GPU state as published: its 256 prefixes cut to what rides piggyback)
    assert records[0].node == "a" and records[0].gpu == a.table.gpu
    assert a.table.gpu is not None and 100 < len(a.table.gpu.prefixes) < 256
    assert sorted(r.node for r in records[1:]) == sorted(set(a.table.members) - {"b"})
    assert view(b) == {k: v for k, v in view(a).items() if k != "b"} | {"a": view(b)["a"]}
    # b answered once it had a's whole table (the last page asks), in pages: it knows a's.
    answer = [(t, p) for sender, t, _, p in exchange(make("c", []), b) if sender == "b"]
    assert len(answer) >= 5 and not any(p.reply for _, p in answer)
    asked = [(t, p) for sender, t, _, p in exchange(a, make("d", [])) if sender == "a"]
    assert asked[-1][1].reply and asked[-1][1].more is False


def test_a_member_gone_mid_exchange_is_skipped_and_one_new_since_waits() -> None:
    a, b = make("a", big_table(40)), make("b", [])
    a.antientropy.push_pull(b.addr, reply=False, now=0.0)
    first = decode_gossip(a.take_outbox()[0][1], bytes_max=BYTES_MAX)
    assert isinstance(first, PushPull) and first.more
    sent = {r.node for r in first.members}
    gone = next(n for n in a.table.members if n not in sent)
    del a.table.members[gone]  # as the leader's forget would
    a.table.apply(Alive(node="late", incarnation=0, addr=addr_of("late")), 0.0)
    now, later = 0.0, []
    while a.antientropy.next_deadline() == a.antientropy.next_page_at < math.inf:
        now = a.antientropy.next_page_at
        a.antientropy.tick(now)
        later += [decode_gossip(d, bytes_max=BYTES_MAX) for _, d in a.take_outbox()]
    nodes = [r.node for p in later for r in p.members]
    assert gone not in nodes and "late" not in nodes
    assert sorted(sent | set(nodes)) == sorted({"a", *a.table.members} - {"late"})
    assert later[-1].more is False


def test_exchanges_are_bounded_one_per_peer_and_the_refused_are_counted() -> None:
    a = make("a", big_table(40))
    a.antientropy.push_pull(addr_of("p0"), reply=True, now=0.0)
    a.antientropy.push_pull(addr_of("p0"), reply=True, now=0.0)  # one to p0 in progress
    assert (a.stats.push_pulls, a.stats.push_pulls_refused) == (1, 1)
    for i in range(1, STREAMS_MAX + 1):
        a.antientropy.push_pull(addr_of(f"p{i}"), reply=True, now=0.0)
    assert (a.stats.push_pulls, a.stats.push_pulls_refused) == (STREAMS_MAX, 2)
    sent = len(a.take_outbox())
    assert sent == STREAMS_MAX  # a first page each, none for the refused
    while a.antientropy.next_page_at < math.inf:
        a.antientropy.tick(a.antientropy.next_page_at)
    a.antientropy.push_pull(addr_of("p0"), reply=True, now=1.0)  # done: accepted again
    assert a.stats.push_pulls == STREAMS_MAX + 1


def test_a_small_table_is_one_page_and_pages_encode_as_push_pull() -> None:
    a, b = make("a", big_table(3, prefixes=4)), make("b", [])
    pages = exchange(a, b)
    assert [(s, p.page, p.more) for s, _, _, p in pages] == [("a", 0, False), ("b", 0, False)]
    assert a.antientropy.next_deadline() == math.inf
    # PushPullEncoded's bytes are PushPull's: a receiver cannot tell them apart.
    msg = pages[0][3]
    encoded = PushPullEncoded(
        cluster=msg.cluster,
        src=msg.src,
        src_addr=msg.src_addr,
        reply=msg.reply,
        join=msg.join,
        members=[encode_record(r) for r in msg.members],
        page=3,
        more=True,
    )
    plain = msgspec.structs.replace(msg, page=3, more=True)
    assert encode_gossip(encoded) == encode_gossip(plain)


def test_the_largest_record_gossip_takes_fits_the_smallest_page_one_a_page() -> None:
    """Every field at its bound, addresses as long as a receiver takes them
    (endpoint_problem): a record and its page's header fit the smallest page (4,096
    bytes), one record a page, each received."""
    config = SwimConfig(cluster="c", push_pull_page_bytes=4096, message_bytes_max=16384)
    far = "tcp://" + "h" * (ENDPOINT_CHARS_MAX - len("tcp://:65535")) + ":65535"
    names = [WIDE * 126 + suffix for suffix in ("x1", "x2", "x3")]  # 506 bytes each
    a, b = make("a", _huge_members(names, far, far), config), make("b", [], config)
    sent = [(size, p) for s, _, size, p in exchange(a, b) if s == "a"]
    assert all(4000 < size <= 4096 for size, p in sent[1:])
    assert [len(p.members) for _, p in sent] == [1, 1, 1, 1]
    assert view(b).keys() == {"a", *names}
    assert b.table.members[names[1]].gpu is not None


def test_a_record_larger_than_a_page_goes_alone() -> None:
    """The sender's side: a record over the page (here with addresses no receiver would
    take, the one way past the bound) still leaves, in a page of its own."""
    config = SwimConfig(cluster="c", push_pull_page_bytes=4096, message_bytes_max=16384)
    wide_ipc = "ipc://" + WIDE * 250  # 256 characters, 1,006 bytes
    names = [WIDE * 126 + suffix for suffix in ("x1", "x2", "x3")]
    a = make("a", _huge_members(names, wide_ipc, wide_ipc), config)
    a.antientropy.push_pull(addr_of("b"), reply=False, now=0.0)
    sizes, members = [], []
    for _ in range(10):
        for _, data in a.take_outbox():
            page = msgspec.msgpack.decode(data, type=GossipMessage)  # (no address check)
            if isinstance(page, PushPull):
                sizes.append(len(data))
                members.append(len(page.members))
        if a.antientropy.next_page_at == math.inf:
            break
        a.antientropy.tick(a.antientropy.next_page_at)
    assert all(size > 4096 for size in sizes[1:]) and members == [1, 1, 1, 1]


WIDE = "\U0001d11e"  # 4 bytes in UTF-8


def _huge_members(names: list[str], addr: str, rpc: str) -> list[Update]:
    huge = GpuState(
        model=WIDE * 128,
        software_version=WIDE * 128,
        ingress=rpc,
        rpc=rpc,
        prefixes=list(range(2**31, 2**31 + 256)),
        memory_free_mb=2**62,
        memory_total_mb=2**62,
        running_requests=2**62,
        waiting_requests=2**62,
        inflight=2**62,
        queued_tokens=2**62,
    )
    updates: list[Update] = []
    for name in names:
        updates += [
            Alive(node=name, incarnation=2**53 - 1, addr=addr),
            Meta(node=name, version=2**62, gpu=huge, incarnation=2**53 - 1),
        ]
    return updates


# -- memory ------------------------------------------------------------------------------------


def test_no_copy_of_the_table_outlives_a_push_pull_and_an_exchange_holds_little() -> None:
    """At 1,000 members with 256 prefixes each: the table's state per member (x 10,000 must
    stay under 100 MB), nothing retained after a paged exchange, and its peak bounded by a
    few pages and the names (not O(members x prefixes)).  The 10,000-member figure:
    ``gossipd bench place`` (memory_mb)."""
    n = 1000
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        a = make("a", big_table(n))
        gc.collect()
        table_bytes = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        sink = addr_of("sink")
        a.antientropy.push_pull(sink, reply=True, now=0.0)
        pages = len(a.take_outbox())
        while a.antientropy.next_page_at < math.inf:
            a.antientropy.tick(a.antientropy.next_page_at)
            pages += len(a.take_outbox())
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pages >= 2
    assert table_bytes / n < 10_000, table_bytes
    assert after - before < 50_000, after - before  # (was: a 10 MB records cache here)
    assert peak - before < 4 * PAGED.push_pull_page_bytes + 100 * n, peak - before


def test_a_simulated_members_shared_table_goes_in_pages_with_its_own_entries() -> None:
    """The simulator's copy-on-write tables (core/sharedtable.py): shared entries' records
    are encoded once for all; a paged push-pull sends the same records as a daemon's table."""
    names = [(f"s{i:03d}", addr_of(f"s{i:03d}")) for i in range(300)]
    base = shared_base([*names, ("a", addr_of("a"))], 0.0)
    shared = make("a", [], SMALL)
    shared.bootstrap_shared(0.0, base)
    plain = make("a", [], SMALL)
    plain.bootstrap(0.0, names)
    for node in (shared, plain):  # an entry of its own, and one forgotten
        node.table.apply(Suspect(node="s007", incarnation=0, by="zz"), 0.0)
        del node.table.members["s200"]
        node.take_outbox()
    sent = {}
    for node in (shared, plain):
        pages = [p for s, _, _, p in exchange(node, make("b", [], SMALL)) if s == "a"]
        assert len(pages) >= 3
        sent[id(node)] = sorted((r.node, r.incarnation, r.state) for p in pages for r in p.members)
    assert sent[id(shared)] == sent[id(plain)]
    assert ("s007", 0, "suspect") in sent[id(shared)] and len(sent[id(shared)]) == 300
    # Small enough for one page: the whole shared table at once.
    one = make("a", [], WHOLE)
    one.bootstrap_shared(0.0, base)
    assert [p.more for s, _, _, p in exchange(one, make("b", [], WHOLE)) if s == "a"] == [False]
