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
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

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
    placements (known at once, where a summary takes a gossip round or two)."""

    def __init__(self, recent_max: int = 4096) -> None:
        self._gossiped: dict[int, set[str]] = {}
        self._recent: OrderedDict[int, str] = OrderedDict()
        self._recent_max = recent_max

    def set_summaries(self, summaries: Mapping[str, Iterable[int]]) -> None:
        index: dict[int, set[str]] = {}
        for member, hashes in summaries.items():
            for h in hashes:
                index.setdefault(h, set()).add(member)
        self._gossiped = index

    def placed(self, hashes: Sequence[int], member: str) -> None:
        for h in hashes:
            self._recent[h] = member
            self._recent.move_to_end(h)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def holders(self, hashes: Sequence[int]) -> list[tuple[int, frozenset[str]]]:
        """For each known depth, deepest first: (depth, members holding that prefix)."""
        out = []
        for depth in range(len(hashes), 0, -1):
            h = hashes[depth - 1]
            members = set(self._gossiped.get(h, ()))
            recent = self._recent.get(h)
            if recent is not None:
                members.add(recent)
            if members:
                out.append((depth, frozenset(members)))
        return out

    def forget_member(self, member: str) -> None:
        for h in [h for h, m in self._recent.items() if m == member]:
            del self._recent[h]
