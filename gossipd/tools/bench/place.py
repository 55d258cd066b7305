"""`gossipd bench place`: placement's cost per task as the cluster grows (issue 17).

One entry point's ``Placer`` over a real ``MemberTable`` of N members (each with GPU state
and ``prefixes`` prefix hashes), no sockets.  Four paths, each timed per task (the least of
``repeats`` runs, each a slice of ``tasks`` distinct tasks):
- keyed, new key: every task a key never seen (the ring's cache misses);
- keyed, repeated key: one session key (the cache hits);
- keyless, popular prefix: prompts sharing a prefix that ``holders`` members hold;
- order(): the preference order for a retry (the owner excluded).
Then the cost of one Meta change that changes a load only, and of one that changes the prefix
summary, and (``--memory``) the memory of the membership and placement state at
``--memory-nodes`` members, measured with tracemalloc.

Goals: every path <= 25 us at N=10,000 and within 1.5x of its N=64 cost.  The file runs
against another checkout's gossipd too (``PYTHONPATH=/work/main python
gossipd/tools/bench/place.py``): it uses only what the Placer had before this benchmark.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from functools import partial
from typing import Any

from gossipd.config import FanoutConfig
from gossipd.core.gossip_messages import Alive, GpuState, Meta
from gossipd.core.membership import MemberTable
from gossipd.core.messages import Task
from gossipd.core.placer import Placer
from gossipd.core.prefix import prefix_hashes
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig
from gossipd.fanout.placement_feed import KernelLoader

try:  # running totals (this change); a plain dict before it
    from gossipd.core.ring import LoadCounts

    def _loads() -> dict[str, int]:
        return LoadCounts()
except ImportError:  # pragma: no cover - an older checkout

    def _loads() -> dict[str, int]:
        return {}


NOW = 0.0  # the decisions' time (no load record's age matters here)
KERNELS = KernelLoader()  # the ring's compiled kernels, loaded once for every cluster
PATHS = ("keyed_new_key", "keyed_repeated_key", "keyless_popular_prefix", "order_retry")
POPULAR = "You are a helpful assistant. " * 20  # 560 characters: 4 blocks of 128


class _Cluster:
    """A member table of ``n`` members (us and n - 1 others) and a Placer over it."""

    def __init__(self, n: int, *, prefixes: int, holders: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.me = "gpu-00000"
        # The daemon's membership core (its table, dissemination, anti-entropy...).
        self.swim = SwimNode(
            SwimConfig(), node=self.me, addr="tcp://10.0.0.0:7946", rng=random.Random(seed), now=0.0
        )
        self.table: MemberTable = self.swim.table
        self.table.members_max = max(self.table.members_max, n)
        self.listeners: list[Any] = []
        self.versions: dict[str, int] = {}
        config = FanoutConfig()
        self.popular = prefix_hashes(POPULAR, config.prefix_block_chars, config.prefix_blocks_max)
        self.names = [f"gpu-{i:05d}" for i in range(1, n)]
        for i, name in enumerate(self.names):
            self._apply(
                Alive(node=name, incarnation=0, addr=f"tcp://10.0.{i // 250}.{i % 250}:7946")
            )
        for i, name in enumerate(self.names):
            own = [self.rng.getrandbits(32) for _ in range(prefixes)]
            if i < holders:
                own[: len(self.popular)] = self.popular
            self.meta(name, prefixes=own, running=0)
        self.placer = Placer(config, node=self.me, loads=_loads(), local_ids=set(), kernels=KERNELS)
        self.placer.rebuild(self.table.members.values())
        self.listeners.append(
            lambda event: self.placer.member_event(event, self.table.members.get(event.node))
        )
        self.placer.view()
        if KERNELS._thread is not None:  # measure the steady state: with the kernels
            KERNELS._thread.join(timeout=120)

    def _apply(self, update: Any) -> None:
        outcome = self.table.apply(update, 0.0)
        if outcome.event is not None:
            for listener in self.listeners:
                listener(outcome.event)

    def meta(self, name: str, *, prefixes: list[int], running: int) -> None:
        version = self.versions.get(name, 0) + 1
        self.versions[name] = version
        gpu = GpuState(
            rpc=f"tcp://{name}:5558",
            model="",
            running_requests=running,
            prefixes=prefixes,
        )
        self._apply(Meta(node=name, version=version, gpu=gpu, incarnation=0))


def _slice_us(run: Any, tasks: list[Task], budget_s: float) -> tuple[float, int]:
    """The mean time per task in us over ``tasks`` (fewer if slow), and how many ran."""
    start = time.perf_counter()
    done = 0
    for task in tasks:
        run(task)
        done += 1
        if time.perf_counter() - start > budget_s:
            break
    return (time.perf_counter() - start) / done * 1e6, done


def _tasks(rng: random.Random, tasks: int) -> dict[str, list[Task]]:
    def task(i: int, key: str, prompt: str = "x") -> Task:
        return Task(v=1, reply_to="tcp://127.0.0.1:9", id=f"t{i}", prompt=prompt, key=key)

    return {
        "new": [task(i, f"session-{rng.getrandbits(64):x}") for i in range(tasks)],
        "same": [task(i, "session-7") for i in range(tasks)],
        "keyless": [task(i, "", POPULAR + f"question {rng.getrandbits(32)}") for i in range(tasks)],
    }


def measure(
    nodes: list[int], *, prefixes: int, holders: int, tasks: int, repeats: int, budget_s: float
) -> list[dict[str, Any]]:
    """Every path at every size, the sizes and paths interleaved run by run (a burst of
    other processes' work then spoils one run of each, not all runs of one size); the
    least of ``repeats`` runs is reported."""
    clusters, work, paths = [], [], []
    for n in nodes:
        print(f"bench place: building N={n}", file=sys.stderr)
        cluster = _Cluster(n, prefixes=prefixes, holders=min(holders, n - 1))
        placer = cluster.placer
        w = _tasks(random.Random(n), tasks)
        retry = frozenset({placer.owner_for(w["same"][0], NOW) or "", cluster.me})
        clusters.append(cluster)
        work.append(w)
        paths.append(
            {
                # partial, not a lambda: no Python frame more than the placer's own call
                "keyed_new_key": (partial(placer.owner_for, now=NOW), w["new"]),
                "keyed_repeated_key": (partial(placer.owner_for, now=NOW), w["same"]),
                "keyless_popular_prefix": (partial(placer.owner_for, now=NOW), w["keyless"]),
                "order_retry": (partial(placer.order, now=NOW, exclude=retry), w["new"]),
            }
        )
    samples: dict[tuple[int, str], list[float]] = {}
    ran: dict[tuple[int, str], int] = {}
    hits = [c.placer.prefix_hits for c in clusters]
    gc.collect()
    for r in range(repeats):
        print(f"bench place: run {r + 1} of {repeats}", file=sys.stderr)
        for n, by_path in zip(nodes, paths, strict=True):
            for path, (run, items) in by_path.items():
                us, done = _slice_us(run, items[r::repeats], budget_s)
                samples.setdefault((n, path), []).append(us)
                ran[(n, path)] = ran.get((n, path), 0) + done
    rows = []
    for i, (n, cluster) in enumerate(zip(nodes, clusters, strict=True)):
        row: dict[str, Any] = {"nodes": n}
        for path in PATHS:
            row[path] = round(min(samples[(n, path)]), 2)
        placed = cluster.placer.prefix_hits - hits[i]
        keyless_ran = ran[(n, "keyless_popular_prefix")]
        row["prefix_hit_share"] = round(placed / max(1, keyless_ran), 3)
        row.update(_meta_costs(cluster, work[i]["same"][0], repeats))
        rows.append(row)
    return rows


def _meta_costs(cluster: _Cluster, task: Task, repeats: int) -> dict[str, float]:
    """One Meta that changes a load only, and one that changes one prefix hash, each with
    the next placement (the view catches up): medians in us."""
    placer, rng = cluster.placer, random.Random(2)
    name = cluster.names[len(cluster.names) // 2]
    member = cluster.table.members[name]
    kept = list(getattr(member, "prefixes", ()) or (member.gpu.prefixes if member.gpu else ()))
    load, prefix = [], []
    for i in range(max(3, repeats)):
        start = time.perf_counter()
        cluster.meta(name, prefixes=kept, running=i + 1)
        placer.owner_for(task, NOW)
        load.append((time.perf_counter() - start) * 1e6)
        kept = [*kept[1:], rng.getrandbits(32)]
        start = time.perf_counter()
        cluster.meta(name, prefixes=kept, running=i + 1)
        placer.owner_for(task, NOW)
        prefix.append((time.perf_counter() - start) * 1e6)
    return {
        "meta_load_change_us": round(statistics.median(load), 1),
        "meta_prefix_change_us": round(statistics.median(prefix), 1),
    }


def memory_mb(n: int, *, prefixes: int) -> dict[str, float]:
    """MB allocated for the membership + placement state of ``n`` members (tracemalloc): the
    SWIM core (member table, dissemination, anti-entropy) and the Placer's view, after a
    push-pull of the whole table; and the peak while that push-pull was sent (its pages
    taken from the outbox as a daemon's flush does).  The ring's compiled kernels are
    loaded first (a library, once a process, not state)."""
    try:
        from gossipd.core import hrw

        hrw.load()
    except ImportError:  # pragma: no cover - an older checkout
        pass
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cluster = _Cluster(n, prefixes=prefixes, holders=8)
    cluster.placer.view()
    gc.collect()
    built = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    ae = cluster.swim.antientropy
    pages = 0
    try:
        ae.push_pull("tcp://10.9.9.9:7946", reply=True, now=0.0)
    except TypeError:  # pragma: no cover - an older checkout: one message, no pages
        ae.push_pull("tcp://10.9.9.9:7946", reply=True)  # type: ignore[call-arg]
    pages += len(cluster.swim.take_outbox())
    while getattr(ae, "next_page_at", float("inf")) < float("inf"):
        ae.tick(ae.next_page_at)
        pages += len(cluster.swim.take_outbox())
    gc.collect()
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del cluster
    return {
        "state_mb": round((after - before) / 1e6, 1),
        "state_before_push_pull_mb": round((built - before) / 1e6, 1),
        "push_pull_peak_mb": round((peak - before) / 1e6, 1),
        "push_pull_pages": pages,
    }


def main(
    *,
    nodes: list[int] | None = None,
    prefixes: int = 256,
    holders: int = 8,
    tasks: int = 2000,
    repeats: int = 7,
    memory: bool = True,
    memory_nodes: int = 10_000,
    as_json: bool = False,
    kernel_min: int | None = None,
) -> int:
    """``kernel_min``: the ring size from which the compiled kernels score (core/ring.py's
    KERNEL_MIN; e.g. 16 to compare sizes on the same code path)."""
    kernels = _kernels(kernel_min)
    nodes = nodes or [64, 1000, 10_000]
    rows = measure(
        nodes, prefixes=prefixes, holders=holders, tasks=tasks, repeats=repeats, budget_s=0.5
    )
    largest, smallest = rows[-1], rows[0]
    worst = max(PATHS, key=lambda p: largest[p])
    report: dict[str, Any] = {
        "benchmark": "place",
        "prefixes_per_member": prefixes,
        "popular_prefix_holders": holders,
        "results": rows,
        f"us_per_task_max_n{largest['nodes']}": largest[worst],
        "worst_path": worst,
        f"ratio_n{largest['nodes']}_vs_n{smallest['nodes']}": round(
            largest[worst] / smallest[worst], 2
        ),
        "ratio_by_path": {p: round(largest[p] / smallest[p], 2) for p in PATHS},
        "goals": {"us_per_task_max": 25.0, "ratio_max": 1.5, "memory_mb_max": 100.0},
        # Which rings were scored by the compiled kernels (Numba), which by NumPy passes.
        "kernels": kernels,
    }
    if memory:
        print(f"bench place: memory at N={memory_nodes}", file=sys.stderr)
        held = memory_mb(memory_nodes, prefixes=prefixes)
        report[f"memory_mb_n{memory_nodes}"] = held["state_mb"]
        report[f"memory_n{memory_nodes}"] = held
    if as_json:
        print(json.dumps(report))
    else:
        print(f"placement per task (us), {prefixes} prefixes a member, least of {repeats} runs")
        print(f"  {'N':>6} " + " ".join(f"{p:>22}" for p in PATHS) + "  meta(load) meta(prefix)")
        for r in rows:
            print(
                f"  {r['nodes']:>6} "
                + " ".join(f"{r[p]:>22.2f}" for p in PATHS)
                + f"  {r['meta_load_change_us']:>9.1f} {r['meta_prefix_change_us']:>11.1f}"
            )
        ratios = report["ratio_by_path"]
        print(
            f"  ratio N={largest['nodes']} / N={smallest['nodes']} "
            + " ".join(f"{ratios[p]:>22.2f}" for p in PATHS)
        )
        for k, v in report.items():
            if k.startswith(("us_per_task", "ratio_n", "memory_", "worst")):
                print(f"  {k}: {v}")
    return 0


def _kernels(kernel_min: int | None) -> dict[str, Any]:
    """The compiled kernels' threshold (set to ``kernel_min`` if given) and availability."""
    try:
        from gossipd.core import hrw, ring
    except ImportError:  # pragma: no cover - an older checkout
        return {"available": False}
    if kernel_min is not None:
        ring.KERNEL_MIN = kernel_min
    return {"available": hrw.load() is not None, "min_members": ring.KERNEL_MIN}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,1000,10000")
    p.add_argument("--prefixes", type=int, default=256)
    p.add_argument("--holders", type=int, default=8)
    p.add_argument("--tasks", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--memory-nodes", type=int, default=10_000)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--kernel-min", type=int, default=None, help="ring.KERNEL_MIN for this run")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _parse()
    sys.exit(
        main(
            nodes=[int(x) for x in a.nodes.split(",")],
            prefixes=a.prefixes,
            holders=a.holders,
            tasks=a.tasks,
            repeats=a.repeats,
            memory=not a.no_memory,
            kernel_min=a.kernel_min,
            memory_nodes=a.memory_nodes,
            as_json=a.json,
        )
    )
