"""The operator's commands, run on the bed's producer host as docs/OPERATIONS.md and
contract.md give them: ``gossipd submit --file``, ``status``, ``drain``/``undrain`` and
``cluster drain --rolling``, each with ``--reply-bind tcp://10.213.47.200:*`` (an address of
the producer host the daemons reach) and, with CURVE, ``--secret-key`` (the producer's
``bed-producer.key_secret``) and ``--server-key`` (the asked daemon's ``NODE.key``, from the
directory holding a copy of every daemon's public key: /etc/gossipd/servers on the producer
host).  Each returns the command's exit status and what it printed.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.hosts_deploy import ETCD_PORT, GOSSIPD, PRODUCER_NAME, Deployment, ingress
from simulations.hosts_net import PRODUCER_ADDR

SERVERS_DIR = "/etc/gossipd/servers"  # on the producer host


@dataclass
class Answer:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        lines = [line for line in self.out.splitlines() if line.startswith("{")]
        if not lines:
            raise ValueError(f"no JSON in the output (exit {self.rc}): {self.out}{self.err}")
        return json.loads(lines[-1])


class Operator:
    def __init__(self, d: Deployment) -> None:
        self.d = d

    def producer_flags(self, nodes: list[str]) -> list[str]:
        """--reply-bind, and with CURVE the keys: ``nodes`` are the daemons asked, in the
        order of their --endpoint flags (one --server-key each)."""
        flags = ["--reply-bind", f"tcp://{PRODUCER_ADDR}:*"]
        if self.d.opts.curve:
            flags += ["--secret-key", f"/etc/gossipd/keys/{PRODUCER_NAME}.key_secret"]
            for node in nodes:
                flags += ["--server-key", f"{SERVERS_DIR}/{node}.key"]
        return flags

    def gossipd(self, *args: str, timeout_s: float = 120.0) -> Answer:
        try:
            done = self.d.on_host(
                self.d.producer, [GOSSIPD, *args], check=False, timeout_s=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            return Answer(124, str(exc.stdout or ""), f"timed out after {timeout_s} s")
        return Answer(done.returncode, done.stdout, done.stderr)

    def endpoint(self, node: str) -> str:
        for unit in self.d.units:
            if unit.name == node:
                hd = self.d.host_of(unit)
                return ingress(hd.host, int(unit.instance))
        raise KeyError(node)

    def submit_file(
        self, tasks: list[dict[str, Any]], nodes: list[str], *, name: str = "tasks"
    ) -> tuple[Answer, list[dict[str, Any]]]:
        """``gossipd submit --file`` of ``tasks`` to ``nodes``' ingresses; every Result."""
        folder = self.d.producer.root / "root"
        task_file, out_file = folder / f"{name}.jsonl", folder / f"{name}.results.jsonl"
        task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        endpoints = [a for n in nodes for a in ("--endpoint", self.endpoint(n))]
        answer = self.gossipd(
            "submit",
            "--file",
            str(task_file),
            "--out",
            str(out_file),
            "--json",
            "--no-progress",
            *endpoints,
            *self.producer_flags(nodes),
        )
        results = [json.loads(line) for line in _read(out_file).splitlines() if line]
        return answer, results

    def status(self, node: str, timeout_s: float = 3.0) -> Answer:
        return self.gossipd(
            "status",
            "--json",
            "--timeout",
            str(timeout_s),
            "--endpoint",
            self.endpoint(node),
            *self.producer_flags([node]),
        )

    def drain(self, target: str, via: str, *, undrain: bool = False) -> Answer:
        return self.gossipd(
            "undrain" if undrain else "drain",
            target,
            "--endpoint",
            self.endpoint(via),
            *self.producer_flags([via]),
        )

    def cluster_drain_rolling(
        self, *, step_timeout_s: float = 60.0, timeout_s: float = 300.0
    ) -> Answer:
        etcd = f"{self.d.hosts[0].host.addr}:{ETCD_PORT}"
        return self.gossipd(
            "cluster",
            "drain",
            "--rolling",
            "--etcd",
            etcd,
            "--cluster",
            "gsdbed",
            "--step-timeout",
            str(step_timeout_s),
            *self.producer_flags([self.d.units[0].name]),
            timeout_s=timeout_s,
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
