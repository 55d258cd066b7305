"""Two cProfile files of the same path side by side, per request: Python-level calls and
self time by file, then the functions whose calls a request changed.  What it is for: a
path that grew slower over many commits, each within its own noise (the door's, between
607a358 and a483671: 335 -> 378 calls a request), shows where the calls were added.

    .venv/bin/python scripts/door_path_cpu.py --requests 10000 --cprofile /tmp/new.prof
    (the same in the other tree, to /tmp/old.prof)
    .venv/bin/python scripts/profile_diff.py /tmp/old.prof /tmp/new.prof [--requests 10000]

Both profiles must cover the same number of requests (door_path_cpu.py's --requests).
Self times under cProfile are inflated (2-3x on this path): compare them with each other.
"""

from __future__ import annotations

import argparse
import collections
import pstats

Row = tuple[float, float]  # (calls a request, self microseconds a request)


def _short(path: str) -> str:
    if "/gossipd/" in path:
        return path.split("/gossipd/")[-1]
    return "~" if path == "~" else path[-40:]


def per_request(path: str, requests: int) -> tuple[dict[tuple[str, str], Row], dict[str, Row]]:
    """By function (file, name) and by file: calls and self microseconds a request."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    functions: dict[tuple[str, str], Row] = {}
    files: dict[str, Row] = collections.defaultdict(lambda: (0.0, 0.0))
    for (file, _line, name), (_cc, calls, self_s, _cum_s, _callers) in stats.items():
        key = (_short(file), name)
        c, t = functions.get(key, (0.0, 0.0))
        functions[key] = (c + calls / requests, t + self_s * 1e6 / requests)
        c, t = files[key[0]]
        files[key[0]] = (c + calls / requests, t + self_s * 1e6 / requests)
    return functions, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--requests", type=int, default=10_000, help="in each profile")
    args = parser.parse_args()
    old_fn, old_files = per_request(args.old, args.requests)
    new_fn, new_files = per_request(args.new, args.requests)
    total = [sum(v[i] for v in files.values()) for files in (old_files, new_files) for i in (0, 1)]
    print(
        f"calls a request {total[0]:.1f} -> {total[2]:.1f}; self us {total[1]:.1f} -> {total[3]:.1f}"
    )
    print("\nby file: calls, self us (old -> new)")
    zero = (0.0, 0.0)
    for file in sorted(
        set(old_files) | set(new_files),
        key=lambda f: -abs(new_files.get(f, zero)[1] - old_files.get(f, zero)[1]),
    ):
        (oc, ot), (nc, nt) = old_files.get(file, zero), new_files.get(file, zero)
        if abs(nt - ot) > 0.5 or abs(nc - oc) >= 1:
            print(f"  {file:42s} {oc:6.1f} -> {nc:6.1f}   {ot:6.1f} -> {nt:6.1f} ({nt - ot:+.1f})")
    print("\nfunctions whose calls a request changed (by half a call or more)")
    for key in sorted(
        set(old_fn) | set(new_fn),
        key=lambda k: -abs(new_fn.get(k, zero)[0] - old_fn.get(k, zero)[0]),
    ):
        (oc, ot), (nc, nt) = old_fn.get(key, zero), new_fn.get(key, zero)
        if abs(nc - oc) >= 0.5:
            print(
                f"  {key[0][-30:]:30s} {key[1][:44]:44s} {oc:6.2f} -> {nc:6.2f}  ({ot:.2f} -> {nt:.2f} us)"
            )


if __name__ == "__main__":
    main()
