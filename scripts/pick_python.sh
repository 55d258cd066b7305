#!/usr/bin/env bash
# Print the Python (>= 3.11, able to make a venv with pip) that runs gossipd's kind of code
# fastest, of `python3` on PATH and the distribution's /usr/bin/python3; setup.sh makes .venv
# with it.  Why: the daemon's request path is two thirds interpreter (bench/README, "Where a
# request's CPU goes"), and how the interpreter was built matters as much as a week of trims.
# Debian's python3.11 (profile-guided, link-time optimised, libpython linked in) runs the HTTP
# door's path with 9-12% less CPU than a default source build (pyenv's: neither, libpython as
# a shared library), and passes 10-11% more requests at 16 connections (bench/README, "The
# interpreter").  Rather than guess from build flags, which distributions do not record
# alike, each candidate times the same small loop (objects, dicts, calls: about 1 s in all), best of 3;
# the fastest wins.  Diagnostics go to stderr, the choice alone to stdout.
set -uo pipefail
declare -A seen
best=""
best_s=""
for candidate in python3 /usr/bin/python3; do
    path="$(command -v "$candidate" 2>/dev/null)" || continue
    real="$("$path" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null)" || continue
    [ -n "${seen[$real]:-}" ] && continue
    seen[$real]=1
    # >= 3.11, and ensurepip present (Debian ships it apart, in python3-venv)
    "$path" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
        echo "pick_python: $real left out (older than 3.11, or no venv/ensurepip)" >&2
        continue
    }
    seconds="$("$path" - <<'PY'
import time

class Item:
    __slots__ = ("key", "size")

    def __init__(self, key: int, size: int) -> None:
        self.key = key
        self.size = size

def work(n: int) -> int:
    table: dict[int, Item] = {}
    total = 0
    for i in range(n):
        item = Item(i, i & 255)
        table[i & 1023] = item
        found = table.get(i & 511)
        total += item.size + (found.size if found is not None else 0) + len(table)
    return total

best = min(
    (lambda t0: (work(1_000_000), time.process_time() - t0)[1])(time.process_time())
    for _ in range(3)
)
print(f"{best:.4f}")
PY
)" || continue
    echo "pick_python: $real $seconds s" >&2
    if [ -z "$best" ] || awk -v a="$seconds" -v b="$best_s" 'BEGIN { exit !(a < b) }'; then
        best="$real"  # the interpreter itself: a shim (pyenv's) may resolve elsewhere later
        best_s="$seconds"
    fi
done
[ -n "$best" ] || { echo "pick_python: no Python >= 3.11 with venv found" >&2; exit 1; }
echo "$best"
