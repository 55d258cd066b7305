from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from gossipd.tools.launcher import DaemonProcess
from simulations.cluster import Cluster

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
# The fuzz tests (tests/test_fuzz.py): GOSSIPD_FUZZ_EXAMPLES examples each, 300 by default; the
# nightly run sets 100,000 (docs/OPERATIONS.md).
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("GOSSIPD_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytests_own_directory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """What tests start without a directory of their own (the benchmarks run by
    tests/test_bench.py: their daemons' logs, clusters and key pairs; a killed vLLM daemon's
    logging config) is made with ``tempfile`` and kept for its logs: under pytest it goes to
    this session's base temp, which pytest removes after 3 more runs, not to /tmp (issue 24:
    test runs left ``gossipd-*`` directories there). TMPDIR reaches the subprocesses too."""
    root = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # read TMPDIR again
    yield root
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture
def daemon_factory(tmp_path) -> Iterator:  # type: ignore[no-untyped-def]
    """Start real daemon processes; every one still running is stopped after the test."""
    started: list[DaemonProcess] = []

    def start(*overrides: str, env: dict[str, str] | None = None, name: str = "d") -> DaemonProcess:
        daemon = DaemonProcess(overrides=overrides, env=env, log_dir=tmp_path, name=name)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop(timeout_s=15)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama made by `gossipd model make-tiny` (about 10 s), once per session."""
    from gossipd.tools.tinymodel import make_tiny

    return make_tiny(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """One real etcd member on free loopback ports (tests/etcd_cluster.py), killed afterwards."""
    from tests.etcd_cluster import EtcdCluster

    cluster = EtcdCluster(1, tmp_path)
    try:
        yield cluster.start_all()
    finally:
        cluster.close()


@pytest.fixture
def echo_pair(tmp_path: Path) -> Iterator[Cluster]:
    """Two daemons with the echo engine, each with its HTTP door on a free port."""
    from tests.helpers import running

    with running(Cluster(2, log_dir=str(tmp_path),
                         extra_overrides=['http.bind="127.0.0.1:0"'])) as cluster:  # fmt: skip
        yield cluster


# Test files that must not run while another of their group runs, when pytest-xdist spreads
# the suite over workers (README's test command: `-n 2 --dist loadfile`, each file on one
# worker): under loadfile a group's files are one unit of work (_GroupsWhole, below), and
# in any case a worker takes its group's lock for the whole module (its module-scoped
# fixtures included) and waits for it while the other worker holds it.
_SERIAL_GROUPS = {
    # one fixed /24 and namespace prefix: a second bed would refuse to start (BedUnavailable)
    "test_hosts.py": "netbed",
    "test_hosts_acceptance.py": "netbed",
    # real vLLM engines and the benchmarks (`vllm serve` among them): two at once would
    # share the two cores, run past their waits and measure each other
    "test_vllm.py": "heavy",
    "test_vllm_death.py": "heavy",
    "test_vllm_logs.py": "heavy",
    "test_openai_client.py": "heavy",
    "test_bench.py": "heavy",
    "test_bench_http.py": "heavy",
}


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # (without pytest-xdist the suite runs in one process: nothing to place)
    LoadFileScheduling = None

if LoadFileScheduling is not None:

    class _GroupsWhole(LoadFileScheduling):  # type: ignore[misc]
        """``--dist loadfile`` with each serial group one unit of work: its files go to one
        worker, one after another, so that the other worker never sits waiting for the
        group's lock (it takes the rest of the suite meanwhile).  The lock below stays: it
        is what holds where this scheduler is not used."""

        def _split_scope(self, nodeid: str) -> str:
            group = _SERIAL_GROUPS.get(nodeid.split("::", 1)[0].rpartition("/")[2])
            return f"serial group {group}" if group else super()._split_scope(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        if config.getvalue("dist") != "loadfile":
            return None  # (xdist's own scheduler for every other mode)
        return _GroupsWhole(config, log)


@pytest.fixture(scope="module", autouse=True)
def _one_module_of_a_group_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    group = _SERIAL_GROUPS.get(request.path.name)
    if group is None or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # The workers' base temps share a parent: this run's, not another run's.
    lock = tmp_path_factory.getbasetemp().parent / f"{group}.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (released with the descriptor)
        yield
    finally:
        os.close(fd)
