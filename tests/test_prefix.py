"""Prefix affinity: the hashing, the record each daemon gossips, the index placement reads."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.prefix import PrefixIndex, PrefixRecord, prefix_hashes, prefix_key

texts = st.text(min_size=0, max_size=400)


@given(shared=texts, a=texts, b=texts, block=st.integers(1, 64), blocks_max=st.integers(1, 16))
def test_prompts_sharing_whole_blocks_share_those_hashes(
    shared: str, a: str, b: str, block: int, blocks_max: int
) -> None:
    ha = prefix_hashes(shared + a, block, blocks_max)
    hb = prefix_hashes(shared + b, block, blocks_max)
    common = min(len(shared) // block, blocks_max)
    assert ha[:common] == hb[:common]
    assert len(ha) == min(blocks_max, len(shared + a) // block)
    assert all(0 <= h < 2**32 for h in ha)


@given(a=st.text(min_size=8, max_size=8), b=st.text(min_size=8, max_size=8), tail=texts)
def test_hashes_chain_so_a_different_first_block_changes_every_hash(
    a: str, b: str, tail: str
) -> None:
    if a == b:
        return
    ha = prefix_hashes(a + tail, 8, 8)
    hb = prefix_hashes(b + tail, 8, 8)
    # 32-bit hashes: a collision is possible in principle, never seen at this size.
    assert all(x != y for x, y in zip(ha, hb, strict=True))


def test_prompts_shorter_than_a_block_have_no_prefix() -> None:
    assert prefix_hashes("short", 128, 8) == []
    assert prefix_key(prefix_hashes("x" * 128, 128, 8)).startswith("prefix:")


def test_the_record_gossips_only_shared_prefixes_most_used_first() -> None:
    record = PrefixRecord(capacity=100)
    record.add([1, 2, 3])  # a prompt seen once: worth nothing to others
    for _ in range(3):
        record.add([10, 11])
    record.add([20])
    record.add([20])
    assert record.summary(10) == [11, 10, 20]
    assert record.summary(1) == [11]


@given(st.lists(st.lists(st.integers(0, 50), max_size=5), max_size=200), st.integers(1, 30))
def test_the_record_stays_bounded(adds: list[list[int]], capacity: int) -> None:
    record = PrefixRecord(capacity=capacity)
    for hashes in adds:
        record.add(hashes)
        assert len(record) <= capacity
    summary = record.summary(5)
    assert len(summary) <= 5 and len(set(summary)) == len(summary)


def test_the_index_answers_deepest_prefix_first_from_gossip_and_own_placements() -> None:
    index = PrefixIndex()
    index.set_summaries({"a": [1, 2], "b": [1]})
    assert index.holders([1, 2, 3]) == [(2, frozenset({"a"})), (1, frozenset({"a", "b"}))]
    index.placed([1, 2, 3], "c")  # known here at once, before any gossip
    assert index.holders([1, 2, 3])[0] == (3, frozenset({"c"}))
    index.forget_member("c")
    assert index.holders([1, 2, 3])[0] == (2, frozenset({"a"}))
    index.set_summaries({})
    assert index.holders([1, 2, 3]) == []


# -- the compact index (issue 17): incremental == rebuilt from scratch ----------------------

summaries = st.dictionaries(
    st.sampled_from([f"m{i}" for i in range(6)]),
    st.lists(st.integers(0, 40) | st.integers(2**32 - 3, 2**32 - 1), max_size=12),
)


@given(st.lists(summaries, min_size=1, max_size=12), st.integers(1, 50))
def test_the_index_updated_member_by_member_equals_one_built_from_scratch(
    rounds: list[dict[str, list[int]]], merge_pairs: int
) -> None:
    index = PrefixIndex(merge_pairs=merge_pairs)
    held: dict[str, list[int]] = {}
    for changes in rounds:
        for member, hashes in changes.items():
            index.set_member(member, hashes)
            held[member] = hashes
        fresh = PrefixIndex()
        fresh.set_summaries(held)
        probe = [*range(41), 2**32 - 3, 2**32 - 2, 2**32 - 1]
        expected = {h: frozenset(m for m, hs in held.items() if h in hs) for h in probe}
        for h in probe:
            got = index.holders([h])
            assert (got[0][1] if got else frozenset()) == expected[h]
            assert fresh.holders([h]) == got
        assert len(index) == sum(1 for hs in held.values() if hs)


def test_a_member_that_leaves_frees_its_id_for_the_next() -> None:
    index = PrefixIndex(merge_pairs=1)
    index.set_member("a", [1, 2])
    index.set_member("a", [])
    index.set_member("b", [2, 3])
    assert index.holders([1, 2, 3]) == [(3, frozenset({"b"})), (2, frozenset({"b"}))]
    assert index.nbytes() > 0


def test_the_index_takes_the_member_tables_compact_arrays_as_they_are() -> None:
    import numpy as np

    index = PrefixIndex(merge_pairs=2)
    table_array = array("I", [9, 4, 9])  # duplicates are one hash
    index.set_member("a", table_array)
    index.set_member("b", np.array([4], dtype=np.uint32))
    assert index.holders([4]) == [(1, frozenset({"a", "b"}))]
    index.set_member("a", array("I", [5]))
    index.set_member("a", array("I", [5]))  # the same again: nothing to do
    assert index.holders([9]) == [] and index.holders([5]) == [(1, frozenset({"a"}))]


def test_remembered_holders_are_forgotten_when_summaries_change_or_too_many_are_kept() -> None:
    from gossipd.core import prefix

    index = PrefixIndex(merge_pairs=1)
    index.set_member("a", [1, 2])
    assert index.holders([1]) == [(1, frozenset({"a"}))]
    index.set_member("b", [1])  # adds 1: its remembered holders are forgotten
    assert index.holders([1]) == [(1, frozenset({"a", "b"}))]
    index.set_member("a", [2])  # removes 1
    assert index.holders([1]) == [(1, frozenset({"b"}))]
    many = list(range(100, 100 + prefix.MEMO_MAX))
    assert index.holders(many) == []  # more than MEMO_MAX remembered: all forgotten once
    assert len(index._memo) <= prefix.MEMO_MAX
    assert index.holders([1, 2]) == [(2, frozenset({"a"})), (1, frozenset({"b"}))]
