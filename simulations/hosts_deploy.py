"""Deploying gossipd on the bed's hosts as docs/OPERATIONS.md says, then running its units.

Per host ``hN`` (its own root directory under the bed's temporary directory, seen by every
command run "on" the host at the unit's paths: simulations/hosts_units.py):

1. ``/opt/gossipd``: a link to the virtual environment running the bed (the installed code);
2. keys: ``gossipd keygen hN-gpuG --out /etc/gossipd/keys`` for each instance (and
   ``gossipd keygen bed-producer`` on the producer host), then the public ``.key`` files
   copied: every instance's into every host's ``/etc/gossipd/peers``, the producer's into
   every ``/etc/gossipd/producers``, the daemons' into the producer's ``servers`` directory;
3. ``/etc/gossipd/gossipd.toml`` from configs/cluster.toml with the host's addresses
   (``node.id = "hN"``, the other hosts' first instances as named seeds, the echo engine,
   ``secret_key_file = "/etc/gossipd/keys/{node_id}.key_secret"``: contract.md);
   ``gossipd check-config`` on it;
4. ``gossipd systemd render --gpus 0-(G-1)`` on a fake sysfs tree of G GPUs (``--sysfs``, as
   tests/test_systemd.py fakes it), copied into the host's /etc as the docs copy it;
5. each ``gossipd@N`` started from the rendered unit (hosts_units.Unit).

Without ``curve`` the configuration sets ``security.insecure = true`` (non-loopback binds
without CURVE) and no key files.  etcd (``etcd=True``) runs inside host h0's namespace on
its address (10.213.47.11:2379), one member.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulations.hosts_net import Host, Net
from simulations.hosts_units import Unit, host_command, read_unit

REPO = Path(__file__).resolve().parent.parent
GOSSIPD = "/opt/gossipd/bin/gossipd"  # as the docs run it, on every host
PORTS = {"ingress": 5557, "rpc": 5558, "gossip": 7946, "metrics": 9557}
STRIDE = 10
ETCD_PORT = 2379
PRODUCER_NAME = "bed-producer"


@dataclass
class BedOptions:
    hosts: int = 3
    gpus: int = 2
    curve: bool = True
    etcd: bool = True
    ttl_s: float = 2.0
    # leave the bed's directory (logs, keys, units) behind; GSDBED_KEEP=1 does it for tests
    keep: bool = field(default_factory=lambda: os.environ.get("GSDBED_KEEP") == "1")
    # SECTION.KEY=VALUE (a TOML value; a bare word is a string) written into every host's
    # gossipd.toml, as an operator edits it: to compare a setting on the bed.
    settings: list[str] = field(default_factory=list)


def apply_settings(doc: dict[str, dict[str, Any]], settings: list[str]) -> None:
    for item in settings:
        dotted, sep, raw = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not key or "." in key:
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        doc.setdefault(section, {})[key] = value


@dataclass
class HostDeploy:
    host: Host
    root: Path
    units: list[Unit] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.host.name


def node_id(host: Host, gpu: int) -> str:
    return f"{host.name}-gpu{gpu}"


def ingress(host: Host, gpu: int) -> str:
    return f"tcp://{host.addr}:{PORTS['ingress'] + STRIDE * gpu}"


def metrics_port(gpu: int) -> int:
    return PORTS["metrics"] + STRIDE * gpu


def toml_text(doc: dict[str, dict[str, Any]]) -> str:
    """A configuration of flat sections (strings, numbers, booleans, lists of strings)."""
    out = []
    for section, values in doc.items():
        out.append(f"[{section}]")
        for key, value in values.items():
            out.append(f"{key} = {json.dumps(value)}")  # JSON scalars and arrays are TOML
        out.append("")
    return "\n".join(out)


def host_config(net: Net, host: Host, opts: BedOptions) -> str:
    """The host's gossipd.toml: configs/cluster.toml with the bed's addresses."""
    doc: dict[str, dict[str, Any]] = tomllib.loads((REPO / "configs" / "cluster.toml").read_text())
    others = [h for h in net.hosts if h is not host]
    doc["node"].update(id=host.name, cluster="gsdbed")
    doc["engine"] = {"kind": "echo"}
    doc["ingress"]["bind"] = f"tcp://{host.addr}:{PORTS['ingress']}"
    doc["gossip"]["bind"] = f"tcp://{host.addr}:{PORTS['gossip']}"
    doc["gossip"]["seeds"] = [
        f"{node_id(h, 0)}@tcp://{h.addr}:{PORTS['gossip']}" for h in others[:3]
    ]
    doc["fanout"]["rpc_bind"] = f"tcp://{host.addr}:{PORTS['rpc']}"
    doc["metrics"] = {"bind": f"{host.addr}:{PORTS['metrics']}"}
    security = doc["security"]
    if opts.curve:
        security.update(
            curve=True,
            secret_key_file="/etc/gossipd/keys/{node_id}.key_secret",  # contract.md, 1
            peer_keys_dir="/etc/gossipd/peers",
            producer_keys_dir="/etc/gossipd/producers",
            insecure=False,
        )
    else:
        doc["security"] = {"curve": False, "insecure": True}
    if opts.etcd:
        doc["etcd"] = {
            "endpoints": [f"{net.hosts[0].addr}:{ETCD_PORT}"],
            "ttl_s": opts.ttl_s,
            "request_timeout_s": min(1.0, opts.ttl_s / 2),  # (at most half the TTL)
        }
    apply_settings(doc, opts.settings)
    return toml_text(doc)


def make_fake_sysfs(root: Path, gpus: int) -> Path:
    """G NVIDIA 3D controllers (tests/test_systemd.py's form), half on each NUMA node."""
    for g in range(gpus):
        device = root / "bus" / "pci" / "devices" / f"0000:{0x18 + 0x10 * g:02x}:00.0"
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x030200\n")
        numa = 0 if g < (gpus + 1) // 2 else 1
        (device / "numa_node").write_text(f"{numa}\n")
        (device / "local_cpulist").write_text(("0-23" if numa == 0 else "24-47") + "\n")
    return root


class Deployment:
    def __init__(self, net: Net, opts: BedOptions, root: Path | None = None) -> None:
        self.net = net
        self.opts = opts
        self.root = root or Path(tempfile.mkdtemp(prefix="gsdbed-"))
        self.hosts = [HostDeploy(h, self.root / h.name) for h in net.hosts]
        self.producer = HostDeploy(net.producer, self.root / net.producer.name)
        self.etcd: subprocess.Popen[bytes] | None = None
        self.steps: list[dict[str, Any]] = []  # each operator command: argv, rc, output
        self._systemd: threading.Thread | None = None
        self._stopping = threading.Event()

    # --- running commands on a host ----------------------------------------------------

    def on_host(
        self,
        hd: HostDeploy,
        argv: list[str],
        *,
        check: bool = True,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        clean_env: bool = False,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` run on host ``hd`` as root there (its netns, its paths mounted)."""
        command = host_command(hd.host.netns, hd.root, self.root / "scratch" / hd.node, argv)
        full_env = dict(env or {}) if clean_env else {**os.environ, **(env or {})}
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=full_env,
            cwd=cwd or hd.root / "root",
        )
        self.steps.append(
            {
                "host": hd.node,
                "argv": argv,
                "rc": done.returncode,
                "out": (done.stdout + done.stderr)[-2000:],
            }
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"on {hd.node}: {' '.join(argv)} exited {done.returncode}:\n"
                f"{done.stdout}{done.stderr}"
            )
        return done

    # --- the steps ----------------------------------------------------------------------

    def prepare_dirs(self) -> None:
        venv = Path(sys.prefix)
        for hd in [*self.hosts, self.producer]:
            for sub in ("etc/gossipd", "var/lib/gossipd", "var/cache/gossipd", "opt", "root"):
                (hd.root / sub).mkdir(parents=True, exist_ok=True, mode=0o750)
            (hd.root / "opt" / "gossipd").symlink_to(venv)  # ln -sfn /opt/gossipd-V /opt/gossipd

    def keygen(self) -> None:
        if not self.opts.curve:
            return
        for hd in self.hosts:
            for g in range(self.opts.gpus):
                self.on_host(
                    hd, [GOSSIPD, "keygen", node_id(hd.host, g), "--out", "/etc/gossipd/keys"]
                )
        self.on_host(
            self.producer, [GOSSIPD, "keygen", PRODUCER_NAME, "--out", "/etc/gossipd/keys"]
        )
        self.distribute_keys()

    def distribute_keys(self) -> None:
        """The public keys only (secrets stay where they were made)."""
        daemon_keys = [p for hd in self.hosts for p in (hd.root / "etc/gossipd/keys").glob("*.key")]
        producer_key = self.producer.root / "etc/gossipd/keys" / f"{PRODUCER_NAME}.key"
        for hd in self.hosts:
            for sub in ("peers", "producers"):
                (hd.root / "etc/gossipd" / sub).mkdir(exist_ok=True)
            for key in daemon_keys:
                shutil.copy(key, hd.root / "etc/gossipd/peers" / key.name)
            shutil.copy(producer_key, hd.root / "etc/gossipd/producers" / producer_key.name)
        servers = self.producer.root / "etc/gossipd/servers"
        servers.mkdir(exist_ok=True)
        for key in daemon_keys:
            shutil.copy(key, servers / key.name)

    def configure(self) -> None:
        for hd in self.hosts:
            (hd.root / "etc/gossipd/gossipd.toml").write_text(
                host_config(self.net, hd.host, self.opts)
            )

    def check_config(self) -> None:
        """`gossipd check-config` as each instance resolves it: with its unit's environment
        (N.env over the shared file).  The shared file alone resolves the file's node.id,
        which is no instance's (with CURVE its key file does not exist)."""
        for unit in self.units:
            env = unit.environment(read_unit(unit.unit_dir, unit.instance), "")
            env.pop("NOTIFY_SOCKET", None)
            self.on_host(
                self.host_of(unit),
                [GOSSIPD, "check-config", "--config", "/etc/gossipd/gossipd.toml"],
                env=env,
                clean_env=True,
            )

    def host_of(self, unit: Unit) -> HostDeploy:
        return next(hd for hd in self.hosts if hd.node == unit.host)

    def render(self) -> None:
        """`gossipd systemd render` on each host, then the docs' `cp -r units/etc/. /etc/`."""
        for hd in self.hosts:
            sysfs = make_fake_sysfs(hd.root / "sys", self.opts.gpus)
            out = hd.root / "root" / "gossipd-units"
            self.on_host(
                hd,
                [
                    GOSSIPD,
                    "systemd",
                    "render",
                    "--gpus",
                    f"0-{self.opts.gpus - 1}",
                    "--out",
                    str(out),
                    "--config",
                    "/etc/gossipd/gossipd.toml",
                    "--sysfs",
                    str(sysfs),
                ],
            )
            shutil.copytree(out / "etc", hd.root / "etc", dirs_exist_ok=True)
            self.adopt_units(hd)

    def adopt_units(self, hd: HostDeploy) -> None:
        """The instances gossipd.target wants (as installed in the host's /etc), as Units;
        their StateDirectory= and CacheDirectory= made, as systemd makes them."""
        unit_dir = hd.root / "etc" / "systemd" / "system"
        target = (unit_dir / "gossipd.target").read_text()
        wants = re.search(r"^Wants=(.*)$", target, re.M)
        instances = re.findall(r"gossipd@(\d+)\.service", wants.group(1) if wants else "")
        for g in instances:
            for sub in ("var/lib/gossipd", "var/cache/gossipd"):
                (hd.root / sub / g).mkdir(mode=0o750, parents=True, exist_ok=True)
            hd.units.append(
                Unit(
                    name=node_id(hd.host, int(g)),
                    host=hd.node,
                    netns=hd.host.netns,
                    instance=g,
                    host_root=hd.root,
                    unit_dir=unit_dir,
                    run_dir=self.root / "run" / hd.node,
                )
            )

    def deploy(self) -> Deployment:
        self.prepare_dirs()
        self.keygen()
        self.configure()
        self.render()
        self.check_config()
        return self

    # --- etcd and the units -------------------------------------------------------------

    def start_etcd(self) -> None:
        if not self.opts.etcd:
            return
        binary = os.environ.get("ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            raise RuntimeError("--etcd: etcd is not installed (apt-get install etcd-server)")
        h0 = self.hosts[0].host
        client, peer = f"http://{h0.addr}:{ETCD_PORT}", f"http://{h0.addr}:{ETCD_PORT + 1}"
        data = self.root / "etcd"
        log = (self.root / "etcd.log").open("ab")
        self.etcd = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                h0.netns,
                binary,
                "--name",
                "e0",
                "--data-dir",
                str(data),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"e0={peer}",
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "100",
                "--election-timeout",
                "1000",
                "--log-level",
                "error",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:  # through the bridge: the root namespace reaches the bed's /24 only
                with urllib.request.urlopen(f"{client}/health", timeout=1) as answer:
                    if b'"health":"true"' in answer.read():
                        return
            except (OSError, http.client.HTTPException):  # (a cut answer: still starting)
                time.sleep(0.1)
        raise RuntimeError(
            f"etcd not healthy within 20 s: {(self.root / 'etcd.log').read_text()[-1500:]}"
        )

    @property
    def units(self) -> list[Unit]:
        return [u for hd in self.hosts for u in hd.units]

    def start_units(self, timeout_s: float = 30.0) -> None:
        """`systemctl enable --now gossipd.target` on every host: all started, then READY."""
        for unit in self.units:
            unit.start()
        for unit in self.units:
            unit.wait_ready(timeout_s)
        if self._systemd is None:  # from now on "systemd" restarts what fails, meanwhile
            self._systemd = threading.Thread(
                target=self._supervise_forever, daemon=True, name="gsdbed-systemd"
            )
            self._systemd.start()

    def _supervise_forever(self) -> None:
        while not self._stopping.wait(0.05):
            self.supervise()

    def supervise(self) -> None:
        """One turn of "systemd": notifications read, failed instances restarted."""
        for unit in self.units:
            unit.poll()

    def close(self) -> None:
        """Stop every instance (SIGTERM, all at once; SIGKILL what is left) and etcd."""
        self._stopping.set()
        if self._systemd is not None:
            self._systemd.join(5)
        for unit in self.units:
            if unit.pid is not None:
                if unit.paused:
                    unit.resume()
                unit.stop(wait=False)
        deadline = time.monotonic() + 15
        for unit in self.units:
            unit.wait_stopped(max(0.1, deadline - time.monotonic()))
            unit.close()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(10)
        if not self.opts.keep:
            shutil.rmtree(self.root, ignore_errors=True)
