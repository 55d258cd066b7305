"""The transmit-limited broadcast queue."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.broadcast import BroadcastQueue, retransmit_limit


def test_BroadcastQueue_sends_each_update_limit_times_then_forgets_it() -> None:
    q = BroadcastQueue(retransmit_mult=2, items_max=100)
    q.push(("a", 0), "A", 10, urgent=True)
    limit = retransmit_limit(2, 5)
    sent = [q.select(100, 5) for _ in range(limit + 2)]
    assert sent == [["A"]] * limit + [[], []]
    assert len(q) == 0 and not q.urgent_pending


@given(mult=st.integers(1, 4), n=st.integers(1, 5000))
def test_BroadcastQueue_an_item_with_a_limit_multiple_is_sent_that_many_times_more(
    mult: int, n: int
) -> None:
    q = BroadcastQueue(retransmit_mult=2, items_max=100)
    q.push(("dead", 0), "D", 10, urgent=True, limit_mult=mult)
    q.push(("alive", 0), "A", 10, urgent=True)
    sent = [u for _ in range(10 * retransmit_limit(2, n)) for u in q.select(100, n)]
    assert sent.count("D") == mult * retransmit_limit(2, n)
    assert sent.count("A") == retransmit_limit(2, n)
    assert len(q) == 0 and not q.urgent_pending


def test_BroadcastQueue_least_sent_first_and_newest_first_among_unsent() -> None:
    q = BroadcastQueue(retransmit_mult=4, items_max=100)
    q.push(("old", 0), "old", 10, urgent=False)
    assert q.select(10, 10) == ["old"]
    q.push(("x", 0), "x", 10, urgent=False)
    q.push(("y", 0), "y", 10, urgent=False)
    assert q.select(10, 10) == ["y"]
    assert q.select(10, 10) == ["x"]
    assert sorted(q.select(30, 10)) == ["old", "x", "y"]  # all at one send now


def test_BroadcastQueue_newer_update_replaces_queued_one_with_same_key() -> None:
    q = BroadcastQueue(retransmit_mult=4, items_max=100)
    q.push(("n", 0), "suspect", 10, urgent=True)
    q.select(100, 10)
    q.push(("n", 0), "alive", 10, urgent=True)
    assert len(q) == 1 and q.get(("n", 0)) == "alive"


def test_BroadcastQueue_first_keys_go_first() -> None:
    q = BroadcastQueue(retransmit_mult=4, items_max=100)
    for name in "abc":
        q.push((name, 0), name, 10, urgent=False)
    assert q.select(20, 10, first=[("a", 0)]) == ["a", "c"]


def test_BroadcastQueue_is_bounded_and_counts_drops() -> None:
    q = BroadcastQueue(retransmit_mult=4, items_max=3)
    for i in range(5):
        q.push((i, 0), i, 10, urgent=False)
    assert len(q) == 3 and q.dropped == 2


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(1, 300), st.booleans()), max_size=60),
    st.integers(64, 2000),
)
def test_BroadcastQueue_select_respects_budget_and_keys_are_unique(
    items: list[tuple[int, int, bool]], budget: int
) -> None:
    q = BroadcastQueue(retransmit_mult=3, items_max=1000)
    for key, size, urgent in items:
        q.push((key, 0), (key, size), size, urgent=urgent)
    for _ in range(20):
        chosen = q.select(budget, 50)
        assert sum(size for _, size in chosen) <= budget
        assert len({k for k, _ in chosen}) == len(chosen)
    assert q.urgent_pending == any(q._by_key[k].urgent for k in q._by_key)
