"""Freed large buffers go back to the operating system (glibc's malloc).

glibc serves a request of 128 KiB or more with its own mmap, returned to the OS when freed,
but raises that threshold to the size of each such buffer freed (up to 32 MiB): after the
first 1 MB prompt is freed, later ones come from the heap, and a heap whose free space lies
under a live allocation (a cached result) is never returned.  A daemon that once received a
burst of large prompts then kept its peak RSS for good (37 -> 193 MB, issue 14).  Fixing the
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the adjustment off) makes every
buffer of that size or more its own mapping, unmapped when freed.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("gossipd.ops.memory")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def return_large_buffers(mmap_threshold_bytes: int = 128 * 1024) -> bool:
    """Make allocations of ``mmap_threshold_bytes`` or more mappings of their own (glibc
    only; False elsewhere, where nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    # Free space at the heap's top beyond this goes back too (glibc's default, made fixed).
    ok = mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold_bytes) == 1 and ok
    return ok
