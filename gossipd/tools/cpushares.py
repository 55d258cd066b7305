"""Several vLLM daemons on one CPU host: each engine on its own cores.

vLLM's CPU build binds its engine's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``).
Its default, "auto", picks the same cores for every engine of a host, where one busy engine
starves the others: with 2 daemons on a 2-core host, the first tasks of one waited 6 s behind
the other's.  ``gossipd up`` gives each daemon an ``engine.cpu_threads_bind`` of its own from
``cpu_threads_binds``.

Shares are whole physical cores (a core's hyperthreads never go to two engines), in the
order of their socket and core ids, so that a share stays within a socket when it can, one
logical CPU named per physical core as vLLM's "auto" does on x86.  When there are more
physical cores than daemons, one is held back for everything else (the daemons' event
loops, the engines' schedulers, producers), as "auto" holds one back.  Fewer cores than
daemons: one core each, round robin (shared).  Not done: NUMA memory placement (systemd's
``NUMAPolicy=`` does that for GPU units).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def _read_topology(cpu: int, name: str) -> int | None:
    try:
        return int(Path(_TOPOLOGY.format(cpu, name)).read_text())
    except (OSError, ValueError):
        return None


def physical_cores(
    cpus: Sequence[int], topology: Callable[[int, str], int | None] = _read_topology
) -> list[list[int]]:
    """``cpus`` grouped by physical core (socket id, core id), in that order; a CPU whose
    topology cannot be read is a core of its own."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for cpu in sorted(cpus):
        package, core = topology(cpu, "physical_package_id"), topology(cpu, "core_id")
        key = (0, package, core) if package is not None and core is not None else (1, cpu, 0)
        groups.setdefault(key, []).append(cpu)
    return [groups[key] for key in sorted(groups)]


def cpu_list(cpus: Sequence[int]) -> str:
    """vLLM's form of a CPU list: runs of consecutive ids as ranges ("0-3,8,10-11")."""
    out: list[str] = []
    ids = sorted(cpus)
    start = prev = ids[0]
    for cpu in [*ids[1:], -2]:
        if cpu != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cpu
        prev = cpu
    return ",".join(out)


def cpu_threads_binds(
    daemons: int,
    cpus: Sequence[int] | None = None,
    topology: Callable[[int, str], int | None] = _read_topology,
) -> list[str]:
    """``engine.cpu_threads_bind`` for each of ``daemons`` vLLM daemons on one host:
    ``cpus`` (default: those this process may run on) as whole physical cores, in even
    contiguous shares (see the module's docstring)."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if daemons <= 0 or not available:
        return []
    # One logical CPU per physical core (the last, as vLLM's "auto" picks on x86).
    cores = [group[-1] for group in physical_cores(available, topology)]
    if daemons >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(daemons)]
    usable = cores[:-1] if len(cores) > daemons else cores  # one held back for the rest
    shares, extra = divmod(len(usable), daemons)
    binds, at = [], 0
    for i in range(daemons):
        size = shares + (1 if i < extra else 0)
        binds.append(cpu_list(usable[at : at + size]))
        at += size
    return binds


def cpu_share_overrides(
    kind: str, nodes: int, gpus: int, environ: Mapping[str, str] | None = None
) -> list[list[str]]:
    """``--set`` items per daemon of a local cluster: several vLLM engines on a CPU host
    each on its own cores.  None for one daemon (vLLM's choice serves it), for GPUs, for
    the echo engine, and when ``VLLM_CPU_OMP_THREADS_BIND`` is set in the environment (the
    operator's choice, which every daemon then inherits)."""
    env = os.environ if environ is None else environ
    if kind != "vllm" or gpus or nodes < 2 or env.get("VLLM_CPU_OMP_THREADS_BIND"):
        return []
    return [[f'engine.cpu_threads_bind="{bind}"'] for bind in cpu_threads_binds(nodes)]
