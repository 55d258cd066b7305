"""Prefix affinity without a central index (sans-IO).

vLLM reuses the KV cache of a prompt's leading tokens when a later prompt starts the same way
(automatic prefix caching).  That only helps if prompts sharing a prefix meet on the same
engine.  Dynamo, llm-d and SGLang's router keep a central index of which engine holds which
prefix; here each daemon knows only what it ran, and gossips a small summary of it:

1. A prompt's leading text is cut into blocks of ``block_chars`` characters; block i's hash
   chains over blocks 1..i (``prefix_hashes``), so equal hashes mean equal prefixes.
   Characters, not tokens: routing must not run a tokenizer per task, and a byte-level
   tokenizer maps equal text to equal tokens, so equal character prefixes are equal token
   prefixes up to the last partial token.
2. A task without a key is placed by the hash of its first block: a burst of prompts with a
   new shared prefix lands on one member at once, before any summary has spread.
3. Each daemon counts the block hashes of the prompts it ran (``PrefixRecord``) and gossips
   the ones seen more than once, most used first, at most ``summary_max`` of them (32-bit
   hashes: a few hundred bytes in its GPU state).
4. ``PrefixIndex`` merges the summaries (and the entry point's own recent decisions, which need
   no gossip round) into hash -> members, and ``holders`` answers: for this prompt, which
   members hold its longest known prefix.  Placement prefers those, under the bounded-load rule.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

HASH_MAX = 2**32


def prefix_hashes(prompt: str, block_chars: int, blocks_max: int) -> list[int]:
    """Chained 32-bit hashes of the prompt's leading whole blocks (at most ``blocks_max``).
    The last partial block is left out: it is what differs between prompts."""
    out: list[int] = []
    previous = b""
    whole = min(blocks_max, len(prompt) // block_chars)
    for i in range(whole):
        block = prompt[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(previous + block, digest_size=4).digest()
        out.append(int.from_bytes(digest, "big"))
        previous = digest
    return out


def prefix_key(hashes: Sequence[int]) -> str:
    """The placement key of a keyless task with a prefix: its first block's hash."""
    return f"prefix:{hashes[0]:08x}"


class PrefixRecord:
    """Block hashes of the prompts this daemon ran, with counts, bounded (least recent out)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._counts: OrderedDict[int, int] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        counts = self._counts
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1
            counts.move_to_end(h)
        while len(counts) > self._capacity:
            counts.popitem(last=False)

    def summary(self, summary_max: int) -> list[int]:
        """Hashes seen at least twice (shared prefixes), most seen first, recent first among
        equals; a prefix seen once is a prompt's own text and worth nothing to others."""
        ranked = [
            (count, age, h) for age, (h, count) in enumerate(self._counts.items()) if count > 1
        ]
        ranked.sort(reverse=True)
        return [h for _, _, h in ranked[:summary_max]]

    def __len__(self) -> int:
        return len(self._counts)


class PrefixIndex:
    """hash -> members that hold it: gossiped summaries plus this entry point's own recent
    placements (known at once, where a summary takes a gossip round or two).

    Compact, for 10,000 members with 256 hashes each: members are interned as small ids, each
    member's hashes are one sorted ``uint32`` array, and the index is one sorted ``uint64``
    array of (hash << 32 | id) pairs (8 bytes a pair, where a dict of sets costs ~250), found
    by binary search.  A member's new summary costs O(its own size): its added and removed
    pairs wait in small side tables, merged into the sorted array once ``merge_pairs`` of them
    have gathered (one O(pairs) pass, amortised over them)."""

    def __init__(self, recent_max: int = 4096, *, merge_pairs: int = 32_768) -> None:
        self._recent: OrderedDict[int, str] = OrderedDict()
        self._recent_max = recent_max
        self._merge_pairs = merge_pairs
        self._names: list[str] = []  # id -> member name ("" when free)
        self._ids: dict[str, int] = {}
        self._free_ids: list[int] = []
        self._held: dict[int, np.ndarray | array[int]] = {}  # id -> its hashes
        self._pairs = np.empty(0, dtype=np.uint64)  # sorted (hash << 32 | id)
        # hash -> the id (or ids) holding it, not merged yet: one holder is the common case
        # and a bare int costs a third of a one-element set.
        self._added: dict[int, int | set[int]] = {}
        self._removed: set[int] = set()  # pairs in ``_pairs`` no longer held
        self._pending = 0
        self._retired: list[int] = []
        # hash -> the names holding it (gossiped), as last looked up: a popular prefix is
        # asked for on each of its tasks, and a sorted-array search costs ~5 us in NumPy
        # calls where this costs a dict look-up.  A summary change forgets the hashes it
        # adds or removes (O(its size)); merging the side tables changes no answer.
        self._memo: dict[int, frozenset[str]] = {}

    def __len__(self) -> int:
        """Member summaries held."""
        return len(self._held)

    def set_summaries(self, summaries: Mapping[str, Iterable[int]]) -> None:
        """Replace every summary (members not named lose theirs)."""
        for member in [n for n in self._ids if n not in summaries]:
            self.set_member(member, ())
        for member, hashes in summaries.items():
            self.set_member(member, hashes)

    def set_member(self, member: str, hashes: Iterable[int]) -> None:
        """``member``'s summary is now ``hashes``: O(its size), whatever the cluster's.  An
        ``array('I')`` (the member table's) is kept as it is, shared, not copied: the table
        replaces a member's array on each Meta, it never changes one."""
        mid = self._ids.get(member)
        kept = None if mid is None else self._held.get(mid)
        if isinstance(kept, array) and isinstance(hashes, array) and kept == hashes:
            return  # the same summary again (a Meta that changed a load): one comparison
        new = _unique(hashes)
        if mid is None:
            if not len(new):
                return
            mid = self._free_ids.pop() if self._free_ids else len(self._names)
            if mid == len(self._names):
                self._names.append(member)
            else:
                self._names[mid] = member
            self._ids[member] = mid
        old = _unique(self._held.get(mid, _EMPTY))
        if len(old) == len(new) and bool((old == new).all()):
            return
        memo = self._memo
        for h in np.setdiff1d(old, new, assume_unique=True).tolist():
            memo.pop(h, None)
            if not self._unadd(h, mid):
                self._removed.add(h << 32 | mid)
            self._pending += 1
        for h in np.setdiff1d(new, old, assume_unique=True).tolist():
            memo.pop(h, None)
            pair = h << 32 | mid
            if pair in self._removed:
                self._removed.discard(pair)
            else:
                self._add(h, mid)
            self._pending += 1
        if len(new):
            shared = isinstance(hashes, array) and hashes.typecode == "I"
            self._held[mid] = hashes if shared else new  # type: ignore[assignment]
        else:
            del self._held[mid]
            del self._ids[member]
            self._names[mid] = ""
            self._retired.append(mid)  # free again once its pairs are merged away
        if self._pending >= self._merge_pairs:
            self._merge()

    def _add(self, h: int, mid: int) -> None:
        held = self._added.get(h)
        if held is None:
            self._added[h] = mid
        elif isinstance(held, int):
            self._added[h] = {held, mid}
        else:
            held.add(mid)

    def _unadd(self, h: int, mid: int) -> bool:
        """Take back a pending addition; False if there was none."""
        held = self._added.get(h)
        if held is None or held == mid:
            if held is not None:
                del self._added[h]
            return held is not None
        if isinstance(held, int) or mid not in held:
            return False
        held.discard(mid)
        if len(held) == 1:
            self._added[h] = held.pop()
        return True

    def _merge(self) -> None:
        """Fold the side tables into the sorted pairs (one O(pairs) pass)."""
        pairs = self._pairs
        if self._removed:
            gone = np.fromiter(self._removed, dtype=np.uint64, count=len(self._removed))
            gone.sort()
            # Every removed pair is in ``pairs`` (only merged pairs are marked removed).
            pairs = np.delete(pairs, np.searchsorted(pairs, gone))
        if self._added:
            new = np.fromiter(
                (h << 32 | mid for h, ids in self._added.items() for mid in _ids(ids)),
                dtype=np.uint64,
            )
            new.sort()
            pairs = np.insert(pairs, np.searchsorted(pairs, new), new)
        self._pairs = pairs
        self._added, self._removed, self._pending = {}, set(), 0
        self._free_ids += self._retired
        self._retired = []

    def _gossiped(self, hashes: Sequence[int]) -> list[set[int]]:
        """For each hash, the ids holding it (one vectorised search for them all)."""
        pairs = self._pairs
        out: list[set[int]] = []
        if len(pairs):
            # Ids stay below _ID_MASK, so [h << 32, h << 32 | _ID_MASK) holds all of h's pairs.
            low = [h << 32 for h in hashes]
            needles = np.array([*low, *(k | _ID_MASK for k in low)], dtype=np.uint64)
            bounds = np.searchsorted(pairs, needles).tolist()
            lo, hi = bounds[: len(hashes)], bounds[len(hashes) :]
        else:
            lo = hi = [0] * len(hashes)
        removed = self._removed
        for i, h in enumerate(hashes):
            ids: set[int] = set()
            if hi[i] > lo[i]:
                found = pairs[lo[i] : hi[i]].tolist()
                ids = {p & _ID_MASK for p in found if not removed or p not in removed}
            extra = self._added.get(h)
            if extra is not None:
                ids.update(_ids(extra))
            out.append(ids)
        return out

    def _gossiped_names(self, hashes: Sequence[int]) -> list[frozenset[str]]:
        """For each hash, the names of the members whose summaries hold it (remembered)."""
        memo = self._memo
        out = [memo.get(h) for h in hashes]
        missing = [i for i, names in enumerate(out) if names is None]
        if missing:
            if len(memo) + len(missing) > MEMO_MAX:
                memo.clear()
            found = self._gossiped([hashes[i] for i in missing])
            names = self._names
            for i, ids in zip(missing, found, strict=True):
                out[i] = memo[hashes[i]] = frozenset(names[j] for j in ids)
        return out  # type: ignore[return-value]

    def placed(self, hashes: Sequence[int], member: str) -> None:
        for h in hashes:
            self._recent[h] = member
            self._recent.move_to_end(h)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def holders(self, hashes: Sequence[int]) -> list[tuple[int, frozenset[str]]]:
        """For each known depth, deepest first: (depth, members holding that prefix)."""
        out = []
        gossiped = self._gossiped_names(hashes) if hashes else []
        for depth in range(len(hashes), 0, -1):
            members = gossiped[depth - 1]
            recent = self._recent.get(hashes[depth - 1])
            if recent is not None and recent not in members:
                members = members | {recent}
            if members:
                out.append((depth, members))
        return out

    def forget_member(self, member: str) -> None:
        for h in [h for h, m in self._recent.items() if m == member]:
            del self._recent[h]

    def nbytes(self) -> int:
        """The sorted pairs' bytes (the side tables and summaries not counted)."""
        return int(self._pairs.nbytes)


def _unique(hashes: Iterable[int]) -> np.ndarray:
    """Sorted distinct ``uint32`` hashes (no copy of an ``array('I')`` before sorting)."""
    if isinstance(hashes, np.ndarray):
        return np.unique(hashes)
    if isinstance(hashes, array) and hashes.typecode == "I":
        return np.unique(np.frombuffer(hashes, dtype=np.uint32))
    return np.unique(np.fromiter(hashes, dtype=np.uint32))


def _ids(held: int | set[int]) -> Iterable[int]:
    return (held,) if isinstance(held, int) else held


_ID_MASK = (1 << 32) - 1
MEMO_MAX = 4096  # hashes whose holders are remembered (then forgotten all at once)
_EMPTY = np.empty(0, dtype=np.uint32)
