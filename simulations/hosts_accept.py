"""Running docs/OPERATIONS.md's new-node steps on every host of a bed (simulations/hosts_docs.py
reads and substitutes them), then checking what the docs say the operator then sees.

Each documented command runs on every host before the next command (so step 5's keys exist on
all hosts when they are exchanged).  What the docs leave to the operator in words, the bed
does at the point they say it: after the step that makes the keys, "copy the NODE.key files
(public) into /etc/gossipd/peers/ on every node" (and step 7's producer key ``ops``, made by
``gossipd keygen ops --out ~/.gossipd`` on each host, into every ``producer_keys_dir`` as
``ops-hN.key``); ``check-config`` then runs.  ``systemctl enable --now gossipd.target`` starts
the units; step 7's commands (a task through the last instance, the members in /metrics) run
once every member sees every other alive.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from simulations.hosts_deploy import REPO, BedOptions, Deployment, HostDeploy, make_fake_sysfs
from simulations.hosts_docs import Command, DocsDiverge, HostDocs, commands, edit_toml, plan
from simulations.hosts_docs import run_step as run_doc_step
from simulations.hosts_measure import Watcher
from simulations.hosts_net import Net
from simulations.hosts_units import BASE_PATH

GOSSIPD_TOML = "etc/gossipd/gossipd.toml"


class Acceptance:
    def __init__(self, net: Net, d: Deployment, doc: str) -> None:
        self.net, self.d = net, d
        self.cmds = commands(doc)
        self.planned = plan(self.cmds)
        self.docs = {hd.node: HostDocs(hd, d.hosts[0], d.opts.gpus) for hd in d.hosts}
        self.log: list[dict[str, Any]] = []
        self.watcher: Watcher | None = None

    def runner(self, hd: HostDeploy, argv: list[str]) -> tuple[int, str]:
        env = {
            "HOME": str(hd.root / "root"),
            "PATH": f"/opt/gossipd/bin:{BASE_PATH}",
            "LANG": "C.UTF-8",
        }
        done = self.d.on_host(hd, argv, check=False, env=env, cwd=REPO)
        return done.returncode, done.stdout + done.stderr

    def run(self) -> list[dict[str, Any]]:
        self.d.prepare_dirs()
        for hd in self.d.hosts:  # step 1's GPUs: a fake topology that render reads (--sysfs)
            make_fake_sysfs(hd.root / "sys", self.d.opts.gpus)
        keygen_step = next((c.step for c in self.cmds if " keygen " in f" {c.text}"), None)
        deferred: list[Command] = []
        exchanged = False
        for cmd, what in self.planned:
            if keygen_step is not None and not exchanged and cmd.step > keygen_step:
                self.exchange_keys()
                exchanged = True
                for later in deferred:
                    self.everywhere(later)
                deferred.clear()
            if what == "deferred" and keygen_step is not None and not exchanged:
                deferred.append(cmd)
            elif what in ("run", "deferred"):
                if cmd.step >= 7 and self.watcher is None:
                    raise DocsDiverge(f"step {cmd.step}: `{cmd.text}` before the units start")
                self.everywhere(cmd)
            elif what == "toml":
                for hd in self.d.hosts:
                    edit_toml(hd.root / GOSSIPD_TOML, self.docs[hd.node].toml_edits(cmd.text))
                self.log.append({"step": cmd.step, "toml": cmd.text})
            else:
                self.log.append({"step": cmd.step, "command": cmd.text, "stand_in": what})
                if "gossipd.target" in cmd.text:
                    self.start()
        if self.watcher is None:
            raise DocsDiverge("the steps never start the units (systemctl enable --now ...)")
        return self.log

    def everywhere(self, cmd: Command) -> None:
        for hd in self.d.hosts:
            out = run_doc_step(hd, self.docs[hd.node], cmd, self.runner)
            self.log.append(
                {"step": cmd.step, "host": hd.node, "command": cmd.text, "out": out[-300:]}
            )
            if cmd.text.startswith("curl ") and "gossipd_members" in cmd.text:
                self.check_members(hd, out)

    def exchange_keys(self) -> None:
        """ "copy the NODE.key files (public) into /etc/gossipd/peers/ on every node", and the
        producer key ``ops`` of step 7 into every producer_keys_dir."""
        keys = [p for hd in self.d.hosts for p in (hd.root / "etc/gossipd/keys").glob("*.key")]
        producers = []
        for hd in self.d.hosts:
            rc, out = self.runner(
                hd,
                [
                    "/opt/gossipd/bin/gossipd",
                    "keygen",
                    "ops",
                    "--out",
                    str(hd.root / "root/.gossipd"),
                ],
            )
            if rc != 0:
                raise DocsDiverge(f"gossipd keygen ops on {hd.node}: {out}")
            producers.append((hd.node, hd.root / "root/.gossipd/ops.key"))
        for hd in self.d.hosts:
            for sub in ("peers", "producers"):
                (hd.root / "etc/gossipd" / sub).mkdir(parents=True, exist_ok=True)
            for key in keys:
                shutil.copy(key, hd.root / "etc/gossipd/peers" / key.name)
            for node, key in producers:
                shutil.copy(key, hd.root / "etc/gossipd/producers" / f"ops-{node}.key")
        self.log.append({"stand_in": "public keys copied to every node", "keys": len(keys)})

    def start(self) -> None:
        for hd in self.d.hosts:
            self.d.adopt_units(hd)
        t0 = time.monotonic()
        try:
            self.d.start_units()
        except RuntimeError as exc:
            raise DocsDiverge(f"the units as the steps install them do not start: {exc}") from None
        self.watcher = Watcher(self.d).start()
        nodes = [u.name for u in self.d.units]
        alive_s = self.watcher.wait_all_alive(nodes, 30, since=t0)
        self.log.append({"started": nodes, "all_alive_after_s": round(alive_s, 2)})

    def check_members(self, hd: HostDeploy, out: str) -> None:
        alive = re.search(r'gossipd_members\{state="alive"\}\s+([0-9.]+)', out)
        want = len(self.d.units) - 1
        if alive is None or int(float(alive.group(1))) != want:
            raise DocsDiverge(
                f"step 7 on {hd.node}: /metrics shows {alive and alive.group(1)} "
                f"members alive, not {want}:\n{out[-1000:]}"
            )

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


def run_acceptance(doc_path: Path, hosts: int = 2, gpus: int = 2) -> list[dict[str, Any]]:
    """The steps on a fresh bed of ``hosts`` x ``gpus``; the log; DocsDiverge on a mismatch."""
    net = Net.plan(hosts)
    d: Deployment | None = None
    acceptance: Acceptance | None = None
    try:
        net.create()
        d = Deployment(net, BedOptions(hosts=hosts, gpus=gpus, curve=True, etcd=False))
        acceptance = Acceptance(net, d, doc_path.read_text())
        return acceptance.run()
    finally:
        if acceptance is not None:
            acceptance.close()
        if d is not None:
            d.close()
        net.destroy()
