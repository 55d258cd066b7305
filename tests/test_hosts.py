"""gossipd deployed on a bed of hosts as an operator would (simulations/hosts_*.py): 3 hosts x 2
GPUs as network namespaces on a bridge, CURVE on, etcd on host h0, keys by `gossipd keygen`,
units by `gossipd systemd render` run as rendered (no hand edits), and the operator's commands
run from a producer host (contract.md: --reply-bind, keys for every producer-side command).

One bed for the module (about 2 minutes here).  It needs root and `ip`: without them the tests
are skipped, and fail under GOSSIPD_REQUIRE_NETNS=1 (CI), as GOSSIPD_REQUIRE_ETCD does for etcd.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from simulations.hosts_deploy import BedOptions, Deployment
from simulations.hosts_measure import Watcher, leaders_per_term
from simulations.hosts_nemesis import Nemesis, NemesisOptions
from simulations.hosts_net import Net, why_unavailable
from simulations.hosts_operator import Operator
from simulations.hosts_scenario import finish_producer, start_producer

HOSTS, GPUS = 3, 2
MEMBERS = HOSTS * GPUS


def _require_bed() -> None:
    problem = why_unavailable()
    if problem is None and shutil.which("etcd") is None and not os.path.exists("/usr/bin/etcd"):
        problem = "etcd is not installed (apt-get install etcd-server)"
    if problem is not None:
        if os.environ.get("GOSSIPD_REQUIRE_NETNS") == "1":
            pytest.fail(f"GOSSIPD_REQUIRE_NETNS=1 and {problem}")
        pytest.skip(problem)


class Bed:
    def __init__(self, net: Net, d: Deployment, watcher: Watcher) -> None:
        self.net, self.d, self.watcher = net, d, watcher
        self.op = Operator(d)
        self.nodes = [u.name for u in d.units]
        self.started_s = 0.0

    def status(self, via: str) -> dict[str, Any]:
        answer = self.op.status(via)
        assert answer.rc == 0, f"gossipd status through {via}: {answer.err}{answer.out}"
        return answer.json()  # type: ignore[no-any-return]

    def wait_status(self, via: str, what: str, check: Any, timeout_s: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            answer = self.op.status(via)
            if answer.rc == 0:
                last = answer.json()
                if check(last):
                    return last
            else:
                last = answer.err
            time.sleep(0.3)
        raise AssertionError(f"{what} not seen within {timeout_s} s; last status: {last}")


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    _require_bed()
    net = Net.plan(HOSTS)
    d: Deployment | None = None
    watcher: Watcher | None = None
    try:
        net.create()
        d = Deployment(net, BedOptions(hosts=HOSTS, gpus=GPUS, curve=True, etcd=True)).deploy()
        d.start_etcd()
        t0 = time.monotonic()
        d.start_units()
        watcher = Watcher(d).start()
        b = Bed(net, d, watcher)
        b.started_s = watcher.wait_all_alive(b.nodes, 30, since=t0)
        yield b
    finally:
        if watcher is not None:
            watcher.stop()
        if d is not None:
            d.close()
        net.destroy()


def _row(status: dict[str, Any], node: str) -> dict[str, Any]:
    return next(r for r in status["members"] if r["node"] == node)


def test_all_six_members_alive_as_rendered(bed: Bed) -> None:
    alive = {n: s.alive for n, s in bed.watcher.latest().items()}
    assert alive == dict.fromkeys(bed.nodes, MEMBERS - 1)
    for unit in bed.d.units:  # each its own key pair, named by its node id (contract.md, 1)
        text = unit.log_path.read_text()
        assert f'/etc/gossipd/keys/{unit.name}.key_secret"' in text, unit.log_tail()
        assert unit.exits == [], f"{unit.name} exited {unit.exits}"
    env = (bed.d.hosts[0].root / "etc/gossipd/1.env").read_text()
    assert "h0-gpu0@tcp://10.213.47.11:7946" in env  # the sibling as a named seed (2)


def test_submit_file_from_the_producer_host_all_ok(bed: Bed) -> None:
    tasks = [
        {"prompt": f"task {i}", "id": f"f{i}", "key": f"k{i % 300}", "params": {"max_tokens": 4}}
        for i in range(3000)
    ]
    answer, results = bed.op.submit_file(tasks, bed.nodes)
    assert answer.rc == 0, answer.err[-2000:]
    report = answer.json()
    assert report["ok"] == 3000 and report["failed"] == {}, report
    assert len(results) == 3000 and all(r["error"] is None for r in results)
    assert {r["node"] for r in results} == set(bed.nodes)  # keyed tasks reach every member


def test_status_with_keys_shows_six_members_the_leader_and_its_term(bed: Bed) -> None:
    # (agreeing checksums waited for: a view that changes as the leader is read disagrees
    # for a gossip round; CI saw it once)
    status = bed.wait_status(
        "h1-gpu0",
        "a leader, and the members' checksums agreeing",
        lambda s: s["leader"] is not None and s["checksums_agree"],
    )
    assert status["members_live"] == MEMBERS, status
    assert status["checksums_agree"], status
    assert status["leader"] in bed.nodes and isinstance(status["term"], int)
    assert all(row["reachable"] for row in status["members"]), status["members"]


def test_drain_and_undrain_of_a_member_on_another_host(bed: Bed) -> None:
    target, via = "h2-gpu1", "h0-gpu0"
    answer = bed.op.drain(target, via)
    assert answer.rc == 0, answer.err
    assert target in answer.out  # answered by the target, relayed through another host
    bed.wait_status(
        via,
        f"{target} draining everywhere",
        lambda s: (
            _row(s, target)["status"] == "draining"
            and set(_row(s, target)["seen_as"].values()) == {"draining"}
        ),
    )
    tasks = [{"prompt": f"d {i}", "id": f"d{i}", "key": f"k{i % 300}"} for i in range(600)]
    answer, results = bed.op.submit_file(tasks, bed.nodes, name="drained")
    assert answer.rc == 0, answer.err[-2000:]
    assert target not in {r["node"] for r in results}
    answer = bed.op.drain(target, via, undrain=True)
    assert answer.rc == 0, answer.err
    bed.wait_status(
        via,
        f"{target} serving everywhere",
        lambda s: set(_row(s, target)["seen_as"].values()) == {"serving"},
    )
    tasks = [{"prompt": f"u {i}", "id": f"u{i}", "key": f"k{i % 300}"} for i in range(600)]
    answer, results = bed.op.submit_file(tasks, bed.nodes, name="undrained")
    assert answer.rc == 0
    assert target in {r["node"] for r in results}


def test_rolling_drain_of_all_six_under_load_loses_nothing(bed: Bed) -> None:
    starts = {u.name: len(u.starts) for u in bed.d.units}
    producer = start_producer(bed.d, rate=100, duration_s=300, keys=300)
    try:
        time.sleep(2)
        answer = bed.op.cluster_drain_rolling(step_timeout_s=60, timeout_s=240)
    finally:
        producer.send_signal(signal.SIGTERM)  # stop sending; what was sent is waited for
        report = finish_producer(bed.d, producer, 90)
    assert answer.rc == 0, f"{answer.out[-3000:]}{answer.err[-2000:]}"
    assert {u.name: len(u.starts) - starts[u.name] for u in bed.d.units} == dict.fromkeys(
        bed.nodes, 1
    )  # each restarted once, by its unit (exit 75, Restart=on-failure)
    assert report.get("lost") == 0 and report["sent"] > 500, report
    bed.watcher.wait_all_alive(bed.nodes, 30)


def test_a_short_nemesis_loses_nothing(bed: Bed) -> None:
    nemesis = Nemesis(
        bed.net, bed.d, bed.watcher, NemesisOptions(cut_s=5.0, pause_s=3.0, settle_s=1.0)
    )
    producer = start_producer(bed.d, rate=100, duration_s=300, keys=300)
    try:
        time.sleep(1)
        faults = {name: nemesis.run(name) for name in ("partition", "kill", "pause")}
    finally:
        producer.send_signal(signal.SIGTERM)
        report = finish_producer(bed.d, producer, 120)
    assert report.get("lost") == 0 and report["sent"] > 500, (report, faults)
    cut = faults["partition"]
    # Both sides of the cut see it, and all are alive within 5 s of the heal (docs/MEMBERSHIP.md
    # has the rules that make the cut-off side see it).  The 3 s goal for seeing a cut is the
    # nemesis benchmark's figure (`python -m simulations hosts ... --nemesis partition`, 1.2 s
    # there); here, with 6 daemons, etcd and a producer sharing 2 cores, a regression guard at
    # 1.5 times the goal (one CI run took 3.04 s with the watcher's sampling lag included).
    assert cut["seen_by_both_sides_s"] is not None and cut["seen_by_both_sides_s"] <= 4.5, cut
    assert cut["all_alive_after_heal_s"] is not None and cut["all_alive_after_heal_s"] <= 5.0, cut
    assert faults["kill"]["restarted_by_unit"] == GPUS, faults["kill"]
    terms = leaders_per_term(bed.d.units)
    assert all(len(leaders) == 1 for leaders in terms.values()), terms
