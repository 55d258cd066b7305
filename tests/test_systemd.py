"""systemd on a multi-GPU node: the topology read from a fake sysfs tree, the per-instance
settings `gossipd systemd render` writes (distinct ports, the GPU's NUMA node), the units
checked by systemd-analyze (verify; security exposure <= 4.0), and two instances started by
hand from the rendered files, both serving."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossipd.config import Config, load_config
from gossipd.ops import systemd
from gossipd.ops.topology import (
    Gpu,
    TopologyError,
    normalize_bus_id,
    parse_cpulist,
    parse_index_list,
    read_gpus,
)
from tests.helpers import RawProducer, gossipd_cli, wait_until

REPO = Path(__file__).resolve().parent.parent
GOSSIPD_BIN = str(Path(sys.executable).parent / "gossipd")
# CI installs systemd-analyze and sets this, so that the checks fail there instead of skipping.
REQUIRE_ANALYZE = os.environ.get("GOSSIPD_REQUIRE_SYSTEMD_ANALYZE") == "1"
SECURITY_EXPOSURE_MAX = 4.0

# A two-socket node: 8 GPUs (3D controllers), four behind each socket, created out of bus
# order; beside them what must not count: an NVSwitch (NVIDIA, class 0x068000), the GPU's
# audio function (0x040300), a BMC's VGA (vendor 0x1a03) and an AMD GPU.
NODE0_CPUS, NODE1_CPUS = "0-23,48-71", "24-47,72-95"
FAKE_GPUS = [  # bus id, NUMA node
    ("0000:db:00.0", 1),
    ("0000:18:00.0", 0),
    ("0000:9a:00.0", 1),
    ("0000:2a:00.0", 0),
    ("0000:ab:00.0", 1),
    ("0000:3a:00.0", 0),
    ("0000:5d:00.0", 0),
    ("0000:ba:00.0", 1),
]
GPUS_IN_BUS_ORDER = sorted(FAKE_GPUS)


def make_fake_sysfs(root: Path, gpus: list[tuple[str, int]] = FAKE_GPUS) -> Path:
    devices = root / "bus" / "pci" / "devices"
    others = [
        ("0000:05:00.0", "0x10de", "0x068000", 0),  # NVSwitch
        ("0000:18:00.1", "0x10de", "0x040300", 0),  # audio
        ("0000:03:00.0", "0x1a03", "0x030000", 0),  # BMC VGA
        ("0000:c1:00.0", "0x1002", "0x030200", 1),  # another vendor's accelerator
    ]
    rows = [(bus, "0x10de", "0x030200", numa) for bus, numa in gpus] + others
    for bus, vendor, pci_class, numa in rows:
        device = devices / bus
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
        (device / "numa_node").write_text(f"{numa}\n")
        (device / "local_cpulist").write_text((NODE0_CPUS if numa == 0 else NODE1_CPUS) + "\n")
    return root


# --- topology -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("", []),
        ("0", [0]),
        ("0-3", [0, 1, 2, 3]),
        ("0-1,4,6-7", [0, 1, 4, 6, 7]),
        ("0-23,48-71", [*range(24), *range(48, 72)]),
    ],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "1,,2", "-1"])
def test_parse_cpulist_refuses_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_parse_index_list_sorts_and_dedups() -> None:
    assert parse_index_list("4-5,0,2,5") == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="0-7"):
        parse_index_list("all of them")


@pytest.mark.parametrize(
    ("bus_id", "normal"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:3b:00.0", "0000:3b:00.0")],
)
def test_normalize_bus_id(bus_id: str, normal: str) -> None:
    assert normalize_bus_id(bus_id) == normal


def test_read_gpus_from_sysfs_in_bus_order(tmp_path: Path) -> None:
    gpus = read_gpus(make_fake_sysfs(tmp_path))
    assert [g.pci_bus_id for g in gpus] == [bus for bus, _ in GPUS_IN_BUS_ORDER]
    assert [g.index for g in gpus] == list(range(8))
    assert [g.numa_node for g in gpus] == [numa for _, numa in GPUS_IN_BUS_ORDER]
    assert all(g.cpulist == (NODE0_CPUS if g.numa_node == 0 else NODE1_CPUS) for g in gpus)


class FakeNvml:
    """pynvml with the GPUs at these bus ids (NVML's spelling), or failing to enumerate."""

    def __init__(self, bus_ids: list[str], *, broken: bool = False) -> None:
        self.bus_ids, self.broken, self.shut = bus_ids, broken, False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if self.broken:
            raise RuntimeError("GPU is lost")
        return index

    def nvmlDeviceGetPciInfo(self, handle: int) -> object:
        return type("PciInfo", (), {"busId": self.bus_ids[handle].encode()})()


def test_read_gpus_takes_nvml_order_and_sysfs_placement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs = make_fake_sysfs(tmp_path)
    nvml = FakeNvml(["00000000:5D:00.0", "00000000:DB:00.0"])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpus = read_gpus(sysfs, use_nvml=True)
    assert [(g.index, g.pci_bus_id, g.numa_node) for g in gpus] == [
        (0, "0000:5d:00.0", 0),
        (1, "0000:db:00.0", 1),
    ]
    assert nvml.shut
    # NVML that cannot list its GPUs: sysfs does
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(["00000000:5D:00.0"], broken=True))
    assert len(read_gpus(sysfs, use_nvml=True)) == 8


def test_read_gpus_without_numa(tmp_path: Path) -> None:
    root = make_fake_sysfs(tmp_path, [("0000:01:00.0", -1)])
    (root / "bus/pci/devices/0000:01:00.0/local_cpulist").write_text("\n")
    [gpu] = read_gpus(root)
    assert gpu.numa_node is None and gpu.cpulist == ""
    numa = systemd.render_numa(gpu)
    assert "NUMAPolicy" not in numa and "CPUAffinity" not in numa


def test_read_gpus_without_a_sysfs_tree(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no such directory"):
        read_gpus(tmp_path / "nowhere")


# --- render -------------------------------------------------------------------------------------


def _unit_value(text: str, key: str) -> str:
    [value] = re.findall(rf"^{key}=(.*)$", text, re.M)
    return value


def test_render_gpus_0_7_gives_8_instances_with_distinct_ports_and_their_numa_node(
    tmp_path: Path,
) -> None:
    sysfs = make_fake_sysfs(tmp_path / "sys")
    config_path = tmp_path / "gossipd.toml"
    config_path.write_text(
        '[gossip]\nbind = "tcp://10.0.0.5:7946"\nseeds = ["tcp://10.0.0.9:7946"]\n'
        '[metrics]\nbind = "0.0.0.0:9557"\n[journal]\npath = "/var/lib/shared.journal"\n'
    )
    out = tmp_path / "out"
    done = gossipd_cli(
        "systemd", "render", "--gpus", "0-7", "--out", str(out), "--sysfs", str(sysfs),
        "--config", str(config_path), "--bin", GOSSIPD_BIN,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "gossipd@7" in done.stdout and "systemctl enable --now gossipd.target" in done.stdout

    envs = {i: systemd.read_env_file((out / f"etc/gossipd/{i}.env").read_text()) for i in range(8)}
    assert len(envs) == 8
    ports: list[int] = []
    for i, env in envs.items():
        config = load_config(config_path, environ=env)  # what instance i runs with
        assert config.node.gpu_index == i
        assert env["CUDA_VISIBLE_DEVICES"] == str(i)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert config.ingress.bind == f"tcp://127.0.0.1:{5557 + 10 * i}"
        assert config.gossip.bind == f"tcp://10.0.0.5:{7946 + 10 * i}"
        assert config.journal.path == f"/var/lib/gossipd/{i}/journal"
        # the other seven instances of the node, after the configured seed
        assert config.gossip.seeds[0] == "tcp://10.0.0.9:7946"
        host = socket.gethostname()  # named seeds: NODE@ADDR (PROTOCOL.md, with CURVE)
        assert sorted(config.gossip.seeds[1:]) == sorted(
            f"{host}-gpu{j}@tcp://10.0.0.5:{7946 + 10 * j}" for j in range(8) if j != i
        )
        for endpoint in (config.ingress.bind, config.fanout.rpc_bind, config.gossip.bind):
            ports.append(int(endpoint.rsplit(":", 1)[1]))
        ports.append(int(config.metrics.bind.rsplit(":", 1)[1]))

        numa = (out / f"etc/systemd/system/gossipd@{i}.service.d/numa.conf").read_text()
        bus_id, node = GPUS_IN_BUS_ORDER[i]
        assert _unit_value(numa, "NUMAMask") == str(node)
        assert _unit_value(numa, "NUMAPolicy") == "bind"
        assert _unit_value(numa, "CPUAffinity") == (NODE0_CPUS if node == 0 else NODE1_CPUS)
        assert bus_id in numa
    assert len(ports) == 32 and len(set(ports)) == 32  # 4 sockets x 8 instances, all distinct

    target = (out / "etc/systemd/system/gossipd.target").read_text()
    assert _unit_value(target, "Wants").split() == [f"gossipd@{i}.service" for i in range(8)]
    service = (out / "etc/systemd/system/gossipd@.service").read_text()
    assert systemd.exec_start_argv(service, "3") == [
        GOSSIPD_BIN, "run", "--config", str(config_path),
    ]  # fmt: skip


def test_render_gives_each_instance_its_own_http_ports_and_a_stop_timeout_past_the_grace() -> None:
    """http.bind and http.reply_bind are shifted like the other ports (every instance took
    gossipd.toml's, and all but one failed to bind); TimeoutStopSec is the grace plus what a
    stop takes after it, so systemd does not SIGKILL a drain a longer grace allows."""
    gpus = [Gpu(index=i, pci_bus_id=f"0000:0{i}:00.0", numa_node=0, cpulist="") for i in (0, 1, 2)]
    environ = {
        "GOSSIPD_HTTP__BIND": "10.0.0.5:8000",
        "GOSSIPD_HTTP__REPLY_BIND": "tcp://127.0.0.1:8100",
        "GOSSIPD_LIFECYCLE__SHUTDOWN_GRACE_S": "30.5",
    }
    config = load_config(environ=environ)
    files, instances = systemd.render_files(config, gpus)
    for instance in instances:
        i = instance.gpu.index
        env = systemd.read_env_file(files[f"etc/gossipd/{i}.env"])
        ran = load_config(environ={**environ, **env})
        assert ran.http.bind == f"10.0.0.5:{8000 + 10 * i}"
        assert ran.http.reply_bind == f"tcp://127.0.0.1:{8100 + 10 * i}"
    service = files["etc/systemd/system/gossipd@.service"]
    assert _unit_value(service, "TimeoutStopSec") == str(31 + systemd.STOP_AFTER_GRACE_S)
    assert _unit_value(systemd.render_service(), "TimeoutStopSec") == "20"  # (grace 10 s)
    with pytest.raises(systemd.RenderError, match=r"http\.bind"):
        systemd.plan(load_config(environ={"GOSSIPD_HTTP__BIND": "10.0.0.5:5567"}), gpus)


def test_render_refuses_ports_that_two_instances_would_share() -> None:
    gpus = [Gpu(index=i, pci_bus_id=f"0000:0{i}:00.0", numa_node=0, cpulist="0-3") for i in (0, 1)]
    # ingress 5557 and rpc 5558 with a stride of 1: gossipd@1's ingress is gossipd@0's rpc
    with pytest.raises(systemd.RenderError, match=r"port 5558 would be both fanout\.rpc_bind"):
        systemd.plan(Config(), gpus, port_stride=1)
    assert len(systemd.plan(Config(), gpus, port_stride=10)) == 2


def test_render_refuses_a_port_past_65535() -> None:
    config = load_config(environ={"GOSSIPD_INGRESS__BIND": "tcp://127.0.0.1:65530"})
    gpus = [Gpu(index=i, pci_bus_id=f"0000:0{i}:00.0", numa_node=0, cpulist="") for i in (0, 1)]
    with pytest.raises(systemd.RenderError, match="past 65535"):
        systemd.plan(config, gpus)


def test_render_names_the_gpus_a_node_lacks(tmp_path: Path) -> None:
    sysfs = make_fake_sysfs(tmp_path / "sys", FAKE_GPUS[:2])
    config_path = tmp_path / "gossipd.toml"
    config_path.write_text("")
    done = gossipd_cli(
        "systemd", "render", "--gpus", "0-7", "--out", str(tmp_path / "out"),
        "--sysfs", str(sysfs), "--config", str(config_path),
    )  # fmt: skip
    assert done.returncode == 2
    assert "GPU 2, 3, 4, 5, 6, 7 not found" in done.stderr and "GPUs 0-1" in done.stderr
    done = gossipd_cli(
        "systemd", "render", "--out", str(tmp_path / "out"), "--sysfs", str(sysfs),
        "--config", str(tmp_path / "missing.toml"),
    )  # fmt: skip
    assert done.returncode == 2 and "missing.toml: no such file" in done.stderr
    assert "give --config FILE" in done.stderr


def test_node_ids_and_quoted_values_survive_the_env_file() -> None:
    config = load_config(environ={"GOSSIPD_NODE__ID": '"2024-01-01"'})  # a TOML date if bare
    gpu = Gpu(index=2, pci_bus_id="0000:02:00.0", numa_node=None, cpulist="")
    [instance] = systemd.plan(config, [gpu], state_root="/srv/state dir")
    env = systemd.read_env_file(systemd.render_env(instance, "/etc/gossipd/gossipd.toml"))
    again = load_config(environ=env)
    assert again.node.id == "2024-01-01-gpu2"
    assert again.journal.path == "/srv/state dir/2/journal"


def test_a_stop_signals_the_daemon_alone_and_kills_what_is_left_at_the_timeout() -> None:
    """KillMode=mixed: with the default (control-group) systemd's SIGTERM also reached vLLM's
    engine core, which aborted its requests at once (a review's reproduction: a streaming
    task answered engine_error 1.7 s after the SIGTERM to the group, ok after 1.1 s with the
    SIGTERM to the daemon alone); the grace for running tasks was never had."""
    unit = systemd.render_service()
    assert "\nKillMode=mixed\n" in unit and "\nKillSignal=SIGTERM\n" in unit


def test_the_repository_units_are_what_render_writes() -> None:
    """systemd/ holds the template and the target of an 8-GPU node as render writes them."""
    assert (REPO / "systemd/gossipd@.service").read_text() == systemd.render_service()
    assert (REPO / "systemd/gossipd.target").read_text() == systemd.render_target(range(8))


# --- systemd-analyze ----------------------------------------------------------------------------


def _analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if REQUIRE_ANALYZE:
            pytest.fail("systemd-analyze is missing (apt-get install systemd)")
        pytest.skip("systemd-analyze is not installed")
    return path


@pytest.fixture
def rendered_units(tmp_path: Path) -> Path:
    """Units for the fake 8-GPU node that run this checkout's gossipd (an existing ExecStart
    path: verify checks it)."""
    config_path = tmp_path / "gossipd.toml"
    config_path.write_text("")
    gpus = read_gpus(make_fake_sysfs(tmp_path / "sys"))
    files, _ = systemd.render_files(
        Config(), gpus, config_path=str(config_path), bin_path=GOSSIPD_BIN
    )
    systemd.write_files(tmp_path / "out", files)
    return tmp_path / "out" / systemd.UNIT_DIR


def test_systemd_analyze_verify_passes_on_every_unit(rendered_units: Path) -> None:
    analyze = _analyze()
    units = [
        rendered_units / "gossipd.target",
        *(rendered_units / f"gossipd@{i}.service" for i in range(8)),  # template + drop-ins
    ]
    done = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=rendered_units,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # verify warns about what it cannot check and still exits 0; none of those here
    assert done.stderr.strip() == "", done.stderr


def security_exposure(analyze: str, unit_dir: Path, unit: str) -> tuple[float, str]:
    done = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", unit],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit_dir,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\S+)", done.stdout)
    assert match, done.stdout + done.stderr
    return float(match.group(1)), done.stdout


def test_systemd_analyze_security_exposure_is_ok(rendered_units: Path) -> None:
    exposure, report = security_exposure(_analyze(), rendered_units, "gossipd@0.service")
    assert exposure <= SECURITY_EXPOSURE_MAX, report


# --- two instances by hand ----------------------------------------------------------------------


def _free_base_port(stride: int, instances: int, taken: set[int]) -> int:
    """A port p with p + k x stride free for every instance k (and none handed out before)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        ports = [base + k * stride for k in range(instances)]
        if any(p in taken or p > 65535 for p in ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        taken.update(ports)
        return base
    raise AssertionError("no free ports")


@pytest.mark.slow
def test_two_instances_started_from_rendered_files_both_serve(tmp_path: Path) -> None:
    """What systemd would run, by hand: each instance's ExecStart= with its N.env as its
    environment.  Both start on the shared config without a port clash and answer a task."""
    taken: set[int] = set()
    ingress, rpc, gossip = (_free_base_port(10, 2, taken) for _ in range(3))
    config_path = tmp_path / "gossipd.toml"
    config_path.write_text(
        f'[ingress]\nbind = "tcp://127.0.0.1:{ingress}"\n'
        f'[fanout]\nrpc_bind = "tcp://127.0.0.1:{rpc}"\n'
        f'[gossip]\nbind = "tcp://127.0.0.1:{gossip}"\npreset = "local"\n'
    )
    sysfs = make_fake_sysfs(tmp_path / "sys", FAKE_GPUS[:2])
    out = tmp_path / "out"
    done = gossipd_cli(
        "systemd", "render", "--gpus", "0-1", "--out", str(out), "--sysfs", str(sysfs),
        "--config", str(config_path), "--bin", GOSSIPD_BIN,
        "--state-root", str(tmp_path / "state"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    service = (out / "etc/systemd/system/gossipd@.service").read_text()

    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i in (0, 1):
            env = {
                **os.environ,
                **systemd.read_env_file((out / f"etc/gossipd/{i}.env").read_text()),
            }
            (tmp_path / "state" / str(i)).mkdir(parents=True)  # StateDirectory= makes it
            log_path = tmp_path / f"gossipd@{i}.log"
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    systemd.exec_start_argv(service, str(i)), env=env, stdout=log, stderr=log
                )
            procs.append((proc, log_path))
        for i, (proc, log_path) in enumerate(procs):

            def serving(proc: subprocess.Popen[bytes] = proc, log_path: Path = log_path) -> bool:
                assert proc.poll() is None, log_path.read_text()
                return '"msg": "serving"' in log_path.read_text()

            wait_until(serving, 30, f"gossipd@{i} serving")
        # one cluster: each joined the other through the seeds render gave it
        host = socket.gethostname()
        for i, (_, log_path) in enumerate(procs):
            other = f"{host}-gpu{1 - i}"

            def joined(log_path: Path = log_path, other: str = other) -> bool:
                lines = re.findall(r"^\{.*\}$", log_path.read_text(), re.M)
                return any(
                    (e.get("msg"), e.get("event"), e.get("member")) == ("member", "joined", other)
                    for e in map(json.loads, lines)
                )

            wait_until(joined, 15, f"gossipd@{i} to see {other} join")
        for i in (0, 1):
            producer = RawProducer(f"tcp://127.0.0.1:{ingress + 10 * i}")
            try:
                producer.send_task(f"task-{i}", prompt=f"hello gossipd@{i}")
                [result] = producer.results(1, timeout_s=15)
                assert result["id"] == f"task-{i}" and result["ok"] is True, result
            finally:
                producer.close()
            assert (tmp_path / "state" / str(i) / "journal").exists()
    finally:
        for proc, _ in procs:
            proc.terminate()
        deadline = time.monotonic() + 20
        for proc, _ in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc, _ in procs] == [0, 0]


# /proc/devices' character devices as an H200 with driver 580.159 lists them (read on a GPU
# machine by scripts/device_check_gpu.py, 2026-11-30); older drivers name major 195
# "nvidia-frontend" instead.
PROC_DEVICES_DRIVER_580 = {
    "nvidia": 195,
    "nvidiactl": 195,
    "nvidia-uvm": 238,
    "nvidia-nvswitch": 239,
    "nvidia-nvlink": 240,
    "nvidia-caps": 241,
    "nvidia-caps-imex-channels": 242,
}


@pytest.mark.parametrize("frontend_name", ["nvidia", "nvidia-frontend"])
def test_the_unit_allows_the_gpu_and_uvm_majors_whatever_the_driver_names_them(
    frontend_name: str,
) -> None:
    """systemd resolves ``DeviceAllow=char-NAME`` by matching NAME (a glob) against
    /proc/devices: a name the driver does not register allows nothing, and the GPU is gone."""
    import fnmatch

    devices = dict(PROC_DEVICES_DRIVER_580)
    if frontend_name != "nvidia":
        devices.pop("nvidia")
        devices[frontend_name] = 195
    patterns = [
        line.split("=", 1)[1].split()[0].removeprefix("char-")
        for line in systemd.render_service().splitlines()
        if line.startswith("DeviceAllow=char-")
    ]
    allowed = {
        major
        for name, major in devices.items()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    }
    assert {195, 238} <= allowed
