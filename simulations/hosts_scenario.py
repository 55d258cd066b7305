"""One run of the bed: make the hosts, deploy, start, load from the producer host, do the
nemesis, measure, tear everything down; the report as a dict (hosts_cli prints it as JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulations.hosts_deploy import (
    PRODUCER_NAME,
    REPO,
    BedOptions,
    Deployment,
    ingress,
    node_id,
)
from simulations.hosts_measure import Watcher, leaders_per_term
from simulations.hosts_nemesis import Nemesis, NemesisOptions, progress
from simulations.hosts_net import PRODUCER_ADDR, Net, loss_available
from simulations.hosts_units import NOT_APPLIED


@dataclass
class ScenarioOptions:
    bed: BedOptions = field(default_factory=BedOptions)
    nemesis: list[str] = field(default_factory=list)
    nemesis_opts: NemesisOptions = field(default_factory=NemesisOptions)
    rate: float = 100.0
    duration_s: float = 20.0
    warmup_s: float = 3.0
    keys: int = 500


def producer_command(
    d: Deployment,
    *,
    rate: float,
    duration_s: float,
    keys: int,
    ids_file: Path,
    id_prefix: str = "bed",
) -> list[str]:
    """The Python producer, run in the producer's namespace, to every daemon's ingress."""
    endpoints = [ingress(hd.host, g) for hd in d.hosts for g in range(d.opts.gpus)]
    argv = [
        "ip",
        "netns",
        "exec",
        d.producer.host.netns,
        sys.executable,
        "-m",
        "simulations.hosts_producer",
        "--reply-bind",
        f"tcp://{PRODUCER_ADDR}:*",
        "--rate",
        str(rate),
        "--duration",
        str(duration_s),
        "--keys",
        str(keys),
        "--ids",
        str(ids_file),
        "--id-prefix",
        id_prefix,
    ]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    if d.opts.curve:
        keys_dir = d.producer.root / "etc/gossipd"
        argv += ["--secret-key", str(keys_dir / "keys" / f"{PRODUCER_NAME}.key_secret")]
        for hd in d.hosts:
            for g in range(d.opts.gpus):
                argv += ["--server-key", str(keys_dir / "servers" / f"{node_id(hd.host, g)}.key")]
    return argv


def start_producer(d: Deployment, **kwargs: Any) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    argv = producer_command(d, ids_file=d.root / "ids.jsonl", **kwargs)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, text=True, env=env, cwd=REPO)


def finish_producer(d: Deployment, proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        d.supervise()
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        return {"error": f"the producer did not finish within {timeout_s:.0f} s"}
    out = proc.stdout.read() if proc.stdout else ""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"the producer exited {proc.returncode}: {out[-1500:]}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def run(opts: ScenarioOptions) -> dict[str, Any]:
    report: dict[str, Any] = {
        "hosts": opts.bed.hosts,
        "gpus": opts.bed.gpus,
        "curve": opts.bed.curve,
        "etcd": opts.bed.etcd,
        "rate": opts.rate,
        "duration_s": opts.duration_s,
        "nemesis": opts.nemesis,
        "nftables": loss_available() or "available",
        "not_applied_from_units": NOT_APPLIED,
    }
    net = Net.plan(opts.bed.hosts)
    d: Deployment | None = None
    watcher: Watcher | None = None
    try:
        net.create()
        d = Deployment(net, opts.bed)
        report["dir"] = str(d.root)
        progress(f"deploying {opts.bed.hosts} hosts x {opts.bed.gpus} GPUs under {d.root}")
        d.deploy()
        d.start_etcd()
        t0 = time.monotonic()
        d.start_units()
        watcher = Watcher(d).start()
        nodes = [u.name for u in d.units]
        report["all_alive_after_start_s"] = round(watcher.wait_all_alive(nodes, 60, since=t0), 2)
        progress(
            f"{len(nodes)} members alive everywhere after {report['all_alive_after_start_s']} s"
        )
        producer = start_producer(d, rate=opts.rate, duration_s=opts.duration_s, keys=opts.keys)
        started = time.monotonic()
        nemesis = Nemesis(net, d, watcher, opts.nemesis_opts)
        nemesis.hold(opts.warmup_s)
        report["faults"] = [nemesis.run(name) for name in opts.nemesis]
        left = opts.duration_s - (time.monotonic() - started)
        if left > 0:
            progress(f"load for {left:.0f} s more")
        report["producer"] = finish_producer(d, producer, max(0.0, left) + 120)
        report["members_alive_per_daemon"] = {n: s.alive for n, s in watcher.latest().items()}
        terms = leaders_per_term(d.units)
        report["leaders_per_term"] = terms
        report["max_leaders_per_term"] = max((len(v) for v in terms.values()), default=0)
        report["max_rss_mib"] = {
            n: round(k / 1024, 1) for n, k in sorted(watcher.rss_max_kib.items())
        }
        report["restarts"] = {u.name: len(u.starts) - 1 for u in d.units}
        report["ok"] = _verdict(report)
        return report
    finally:
        if watcher is not None:
            watcher.stop()
        if d is not None:
            d.close()
        net.destroy()


def _verdict(report: dict[str, Any]) -> bool:
    producer = report.get("producer", {})
    return (
        "error" not in producer
        and producer.get("lost", 1) == 0
        and report.get("max_leaders_per_term", 0) <= 1
    )
