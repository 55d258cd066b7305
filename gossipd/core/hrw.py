"""Compiled rendezvous kernels for large rings (issue 17), sans-IO.

``Ring`` scores a new key against every member: with NumPy that is seven passes over arrays
of N uint64 (xor, multiply, shift, ... of splitmix64) and an argmax, ~11 us at N=10,000 on
this machine, where the same arithmetic fused into one loop that the compiler vectorises is
~1.5 us.  The kernels here are that loop, written as plain Python over NumPy arrays and
compiled with Numba when it is installed (``pip install gossipd[fast]``; vLLM depends on it,
so GPU nodes have it).  Without Numba, ``load()`` answers None and the ring keeps its NumPy
passes: the same owners either way, only slower at large N.

The members are scanned in chunks: a chunk's maximum is a reduction the compiler
vectorises (no index kept in the loop, which would keep it scalar); only the chunks that can
hold a winner are scanned again for indices.  Both kernels give exactly what the NumPy code
gives: ``best`` the first index of the largest mixed value (``argmax``), ``top`` the ``k``
largest, larger first, the lower index first among equal values (repeated ``argmax``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

import numpy as np

_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S31 = np.uint64(27), np.uint64(31)
_ZERO = np.uint64(0)
CHUNK = 256  # members a chunk for ``best``: long enough to vectorise, short to scan again


def chunk_maxima(
    seeds_a: np.ndarray, ka: np.uint64, lo: int, hi: int, size: int, out: np.ndarray
) -> int:
    """``out[c]`` = the largest mix64(kh ^ seed) of chunk ``c`` (``size`` members) of
    ``seeds_a[lo:hi]`` (``ka`` is a(kh), see ``Ring._mixed``); returns the number of chunks."""
    chunks = (hi - lo + size - 1) // size
    for c in range(chunks):
        part = seeds_a[lo + c * size : min(lo + (c + 1) * size, hi)]
        top = _ZERO
        for i in range(part.shape[0]):  # (an index from 0: the loop the compiler vectorises)
            x = (part[i] ^ ka) * _C1
            x = (x ^ (x >> _S27)) * _C2
            x = x ^ (x >> _S31)
            top = max(top, x)
        out[c] = top
    return chunks


def best(seeds_a: np.ndarray, ka: np.uint64, lo: int, hi: int, scratch: np.ndarray) -> int:
    """The first index in ``[lo, hi)`` of the largest mixed value (``lo`` when empty);
    ``scratch`` holds at least ceil((hi - lo) / CHUNK) values."""
    chunks = chunk_maxima(seeds_a, ka, lo, hi, CHUNK, scratch)
    top, at = _ZERO, 0
    for c in range(chunks):
        if scratch[c] > top:  # strictly: the first chunk holding the maximum
            top, at = scratch[c], c
    start = lo + at * CHUNK
    part = seeds_a[start : min(start + CHUNK, hi)]
    for i in range(part.shape[0]):
        x = (part[i] ^ ka) * _C1
        x = (x ^ (x >> _S27)) * _C2
        x = x ^ (x >> _S31)
        if x == top:
            return start + i
    return lo


def top_size(n: int, k: int) -> int:
    """``top``'s chunk size for ``n`` members: about 4k chunks (so that the k-th largest chunk
    maximum exists and few chunks reach it), 8 to 128 members each."""
    return max(8, min(128, n // (4 * max(1, k))))


def kth_largest(values: np.ndarray, n: int, k: int) -> np.uint64:
    """The ``k``-th largest of ``values[:n]`` (1 <= k <= n): the k largest kept in a small
    sorted array, one comparison for most values (k is a few, n a few hundred)."""
    kept = np.zeros(k, dtype=np.uint64)  # descending
    for c in range(n):
        v = values[c]
        if v <= kept[k - 1] and c >= k:
            continue
        j = min(c, k - 1)
        while j > 0 and kept[j - 1] < v:
            kept[j] = kept[j - 1]
            j -= 1
        kept[j] = v
    return kept[k - 1]


def top(
    seeds_a: np.ndarray,
    ka: np.uint64,
    lo: int,
    hi: int,
    k: int,
    scratch: np.ndarray,
    out: np.ndarray,
    out_values: np.ndarray,
) -> int:
    """The indices of the ``k`` largest mixed values in ``[lo, hi)`` into ``out`` and the
    values into ``out_values`` (larger first, the lower index first among equals); returns
    how many (``min(k, hi - lo)``).
    ``scratch`` holds at least ceil((hi - lo) / top_size(hi - lo, k)) values.

    The k-th largest chunk maximum is a lower bound of the k-th largest value (those k
    maxima are k values), so only chunks whose maximum reaches it hold any of the k."""
    k = min(k, hi - lo)
    if k <= 0:
        return 0
    size = top_size(hi - lo, k)
    chunks = chunk_maxima(seeds_a, ka, lo, hi, size, scratch)
    bound = _ZERO  # fewer chunks than k: every value may be among them
    if chunks >= k:
        bound = kth_largest(scratch, chunks, k)
    reaching = 0
    for c in range(chunks):
        if scratch[c] >= bound:
            reaching += 1
    values = np.empty(reaching * size, dtype=np.uint64)
    index = np.empty(reaching * size, dtype=np.int64)
    n = 0
    for c in range(chunks):
        if scratch[c] < bound:
            continue
        start = lo + c * size
        part = seeds_a[start : min(start + size, hi)]
        for i in range(part.shape[0]):
            x = (part[i] ^ ka) * _C1
            x = (x ^ (x >> _S27)) * _C2
            x = x ^ (x >> _S31)
            if x >= bound:
                values[n] = x
                index[n] = start + i
                n += 1
    # Larger first, then the lower index: a stable sort of the complements (the indices
    # arrive in increasing order).
    order = np.argsort(~values[:n], kind="mergesort")
    for j in range(k):
        out[j] = index[order[j]]
        out_values[j] = values[order[j]]
    return k


Kernels = dict[str, Callable[..., Any]]
_loaded: list[Kernels | None] = []


def load() -> Kernels | None:
    """The kernels compiled with Numba, or None when Numba is not installed.  The first call
    in a process imports Numba (~0.5 s, ~80 MB) and loads the compiled code cached on disk
    (``__pycache__``, else ``NUMBA_CACHE_DIR``), or compiles it (~2-4 s here) where there is
    none: a daemon calls it off its event loop (``fanout/placement_feed.py``)."""
    if not _loaded:
        _loaded.append(_compile())
    return _loaded[0]


def loaded() -> bool:
    """Has ``load()`` finished in this process (so that it returns at once)?"""
    return bool(_loaded)


def _compile() -> Kernels | None:
    try:
        import numba
    except ImportError:  # pragma: no cover - where Numba is installed (tests, vLLM nodes)
        return None
    jit = numba.njit(cache=True, nogil=True)
    # best and top call the helpers above: compiled against their compiled versions.
    glob = {
        **globals(),
        "chunk_maxima": jit(chunk_maxima),
        "top_size": jit(top_size),
        "kth_largest": jit(kth_largest),
    }
    best_fn = FunctionType(best.__code__, glob, "best")
    top_fn = FunctionType(top.__code__, glob, "top")
    return {"best": jit(best_fn), "top": jit(top_fn)}
