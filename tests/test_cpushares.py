"""Several vLLM daemons on one CPU host, each engine on its own cores (gossipd/tools/cpushares.py),
and the setting that carries a share to the engine (engine.cpu_threads_bind)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import load_config
from gossipd.errors import ConfigError
from gossipd.tools.cpushares import cpu_list, cpu_share_overrides, cpu_threads_binds


def expand_cpu_list(text: str) -> list[int]:
    """A CPU list as vLLM reads it ("0-2,5" -> [0, 1, 2, 5])."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _topology(cores: int):  # type: ignore[no-untyped-def]
    """A host whose logical CPU c is a thread of physical core c % cores (Linux's usual
    numbering: 0..P-1 the first threads, P..2P-1 their siblings), sockets of 4 cores."""

    def read(cpu: int, name: str) -> int:
        core = cpu % cores
        return core // 4 if name == "physical_package_id" else core

    return read


@settings(max_examples=300, deadline=None)
@given(
    daemons=st.integers(min_value=1, max_value=40),
    cpus=st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=512, unique=True),
)
def test_every_daemon_gets_its_own_cores_while_there_are_enough(
    daemons: int, cpus: list[int]
) -> None:
    """Without topology (each CPU its own core): every daemon gets cores; with more cores
    than daemons no core is given twice, the shares are even and in order, and one core is
    held back; as many: one each; fewer: one each, round robin.  Each share is a setting
    the config takes."""
    binds = cpu_threads_binds(daemons, cpus, topology=lambda cpu, name: None)
    shares = [expand_cpu_list(b) for b in binds]
    assert len(shares) == daemons and all(shares)
    given_cpus = [c for share in shares for c in share]
    ordered = sorted(cpus)
    if daemons < len(cpus):
        assert given_cpus == ordered[:-1]  # in order, each once, the last held back
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert all(len(s) == 1 for s in shares) and set(given_cpus) == set(cpus)
    for bind in binds:
        assert load_config(environ={}, overrides=[f'engine.cpu_threads_bind="{bind}"'])


def test_hyperthreads_of_one_core_never_go_to_two_engines() -> None:
    """16 logical CPUs as 8 cores of 2 threads (c and c + 8 are one core): 2 daemons get 3
    and 4 whole cores (one held back), each named by one of its threads."""
    binds = cpu_threads_binds(2, range(16), topology=_topology(8))
    cores = [{c % 8 for c in expand_cpu_list(b)} for b in binds]
    assert cores[0].isdisjoint(cores[1]) and len(cores[0]) + len(cores[1]) == 7
    assert [len(expand_cpu_list(b)) for b in binds] == [4, 3]


def test_cpu_lists_are_written_as_ranges() -> None:
    assert cpu_list([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert cpu_list([5]) == "5"


def test_gossipd_up_binds_several_vllm_daemons_of_a_cpu_host_only() -> None:
    overrides = cpu_share_overrides("vllm", 2, gpus=0, environ={})
    assert len(overrides) == 2
    binds = [load_config(environ={}, overrides=o).engine.cpu_threads_bind for o in overrides]
    assert all(binds) and set(expand_cpu_list(binds[0])).isdisjoint(expand_cpu_list(binds[1]))
    assert cpu_share_overrides("echo", 2, gpus=0, environ={}) == []
    assert cpu_share_overrides("vllm", 2, gpus=1, environ={}) == []
    assert cpu_share_overrides("vllm", 1, gpus=0, environ={}) == []
    # The operator's own VLLM_CPU_OMP_THREADS_BIND wins: every daemon inherits it.
    assert cpu_share_overrides("vllm", 2, gpus=0, environ={"VLLM_CPU_OMP_THREADS_BIND": "0"}) == []


def test_cpu_threads_bind_takes_what_vllm_parses_and_refuses_the_rest() -> None:
    for good in ("", "auto", "nobind", "0", "0-3", "4,6-7"):
        config = load_config(environ={}, overrides=[f'engine.cpu_threads_bind="{good}"'])
        assert config.engine.cpu_threads_bind == good
    two_ranks = ['engine.cpu_threads_bind="0-1|2-3"', "engine.tensor_parallel_size=2"]
    assert load_config(environ={}, overrides=two_ranks).engine.cpu_threads_bind == "0-1|2-3"
    bad = ["cores 1", "-", "0-", "1,,2", "0|", "|||", "0-3|", "3-1", "auto\\n", "0-1|2-3"]
    for value in bad:  # (the last: two lists for one rank)
        with pytest.raises(ConfigError, match=r"engine\.cpu_threads_bind"):
            load_config(environ={}, overrides=[f'engine.cpu_threads_bind="{value}"'])
