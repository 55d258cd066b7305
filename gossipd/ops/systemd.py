"""systemd units for one daemon per GPU: ``gossipd systemd render`` writes them for this node.

What it writes under the output directory, laid out as under / (so one copy installs it):

- ``etc/systemd/system/gossipd@.service``: the template every instance runs (the same on every
  node; the sandbox a daemon holding a GPU tolerates);
- ``etc/systemd/system/gossipd.target``: wants one instance per rendered GPU;
- ``etc/systemd/system/gossipd@N.service.d/numa.conf``: instance N's CPUs and memory bound to
  its GPU's NUMA node (``CPUAffinity=`` the GPU's ``local_cpulist``, ``NUMAPolicy=bind``);
- ``etc/gossipd/N.env``: instance N's own settings as GOSSIPD_* variables, which override
  the shared ``gossipd.toml`` (gossipd/config/load.py: file, then environment, then ``--set``).

Per-instance settings (the rule docs/OPERATIONS.md states): instance N takes every port of
gossipd.toml (ingress.bind, fanout.rpc_bind and rpc_advertise, gossip.bind and advertise,
metrics.bind) plus ``N x port_stride`` (10 by default: 5557, 5567, 5577...; a port of 0 or
``*`` stays as it is, an ipc:// path gets ``-N``), ``node.gpu_index = N``, its GPU alone in
CUDA_VISIBLE_DEVICES (indices in PCI bus order, as NVML numbers them), its journal in its own
state directory, ``node.id`` with ``-gpuN`` appended when one is set (the default id already
ends in ``-gpuN``), and the node's other instances added to ``gossip.seeds``, each named by
its node id (``NODE@tcp://HOST:PORT``, as CURVE requires).  Rendering refuses a port that two
instances (or two sockets of one) would share, or one past 65535, and with CURVE on and more
than one GPU a ``security.secret_key_file`` without ``{node_id}`` (every instance is its own
member with its own key pair; the daemon puts its node id there, gossipd/config/load.py).

The env file is the subset of systemd's EnvironmentFile syntax that ``read_env_file`` reads
back: ``KEY=VALUE`` lines, a value bare or in single quotes, ``#`` comments.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gossipd.config import NODE_ID_PLACEHOLDER, Config, parse_scalar
from gossipd.ops.topology import Gpu

DEFAULT_BIN = "/opt/gossipd/bin/gossipd"
DEFAULT_CONFIG = "/etc/gossipd/gossipd.toml"
DEFAULT_STATE_ROOT = "/var/lib/gossipd"  # the units' StateDirectory=gossipd/%i lives here
DEFAULT_PORT_STRIDE = 10
ENV_DIR = "etc/gossipd"
UNIT_DIR = "etc/systemd/system"
PORT_MAX = 65535

SERVICE_TEMPLATE = """\
# gossipd@N: the daemon of GPU N (gossipd/ops/systemd.py writes this file; docs/OPERATIONS.md
# installs it).  Every instance reads {config}; its own settings (ports, GPU, journal)
# come from /etc/gossipd/N.env, its CPU and NUMA binding from gossipd@N.service.d/numa.conf,
# both written for this node by `gossipd systemd render`.  `systemctl start gossipd.target`
# starts them all.  Type=notify: systemd waits for READY=1 and restarts a daemon whose
# WATCHDOG=1 stops (a wedged event loop) or that exits non-zero (its engine died).
[Unit]
Description=gossipd agent daemon for GPU %i
# time-sync.target: membership's probe schedule starts from the wall clock (then follows
# the monotonic clock), so that members that start on a synced clock agree (MEMBERSHIP.md).
After=network-online.target time-sync.target
Wants=network-online.target
PartOf=gossipd.target
# A daemon that cannot start (a port taken, a bad setting: exit status 2) is retried 5 times
# within 2 minutes, then left failed instead of looping; `systemctl reset-failed` after the fix.
StartLimitIntervalSec=120
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={bin} run --config {config}
# Required: without it every instance would take gossipd.toml's ports and all but the first
# would fail.
EnvironmentFile=/etc/gossipd/%i.env
User=gossipd
Group=gossipd
# /var/lib/gossipd/N (the journal) and /var/cache/gossipd/N (vLLM, Triton, CUDA and Hugging
# Face caches) are the only places it writes: HOME and XDG_CACHE_HOME are the cache directory
# (what finds its cache through HOME, as Triton's ~/.triton and CUDA's ~/.nv, lands there too).
StateDirectory=gossipd/%i
StateDirectoryMode=0750
CacheDirectory=gossipd/%i
CacheDirectoryMode=0750
Environment=HOME=%C/gossipd/%i XDG_CACHE_HOME=%C/gossipd/%i
UMask=0027
# SIGTERM: stop intake, finish in-flight tasks within lifecycle.shutdown_grace_s, then leave,
# settle forwards and flush replies (about 10 s more), exit 0.  Rendered from the grace.
KillSignal=SIGTERM
# mixed: that SIGTERM to the daemon alone, SIGKILL to every process left at the timeout.
# With the default (control-group) vLLM's engine core got the SIGTERM too and aborted the
# running requests at once: tasks answered engine_error instead of finishing in the grace.
KillMode=mixed
TimeoutStopSec={stop_timeout_s}
# Loading a model into vLLM takes from ~35 s (the tiny model on CPU) to minutes (a large one).
TimeoutStartSec=900
WatchdogSec=10
Restart=on-failure
RestartSec=1
LimitNOFILE=65536

# Sandbox: what a daemon holding a GPU tolerates.  The GPU's device nodes are open to it
# (DevicePolicy=closed keeps every other device out; so no PrivateDevices=, which would hide
# them); the file system is read-only but for the two directories above; no capabilities, no
# privilege gain, no kernel or cgroup changes, system calls limited to a service's set.
# Not set, on purpose: MemoryDenyWriteExecute= (CUDA, Triton and libffi map memory
# writable and executable), ProcSubset=pid (NVML reads /proc/driver/nvidia), PrivateNetwork=
# and IPAddressDeny= (it serves the network), and a deny-list of @resources (CPU and NUMA
# placement calls that torch and vLLM make).
DevicePolicy=closed
# Major 195 (/dev/nvidia[0-9]* and /dev/nvidiactl) is named "nvidia-frontend" in
# /proc/devices by older drivers and "nvidia" (and "nvidiactl") by recent ones (seen: driver
# 580 on an H200, scripts/device_check_gpu.py), so both names; nvidia-uvm: CUDA's memory
# manager; nvidia-caps: MIG.  The paths name the same nodes for drivers that register them
# under other names.  Every GPU of the node, not only GPU %i: NVML numbers the GPUs it
# can open, and CUDA_VISIBLE_DEVICES (in N.env) is what gives the daemon its one GPU.
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia rw
DeviceAllow=char-nvidia-uvm rw
DeviceAllow=char-nvidia-caps r
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateIPC=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
KeyringMode=private
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
# A call outside the set fails with EPERM instead of killing the daemon.
SystemCallErrorNumber=EPERM

[Install]
WantedBy=gossipd.target
"""

TARGET_TEMPLATE = """\
# gossipd.target: the gossipd daemons of this node, one per GPU ({gpus}), written by
# `gossipd systemd render`.  `systemctl enable --now gossipd.target` starts them and at boot;
# `systemctl stop gossipd.target` stops them all (each instance is PartOf= it).
[Unit]
Description=gossipd daemons of this node (GPUs {gpus})
Wants={wants}
After={wants}

[Install]
WantedBy=multi-user.target
"""


class RenderError(Exception):
    """The configuration and the options cannot give every instance its own settings."""


@dataclass(frozen=True, slots=True)
class Instance:
    gpu: Gpu
    env: dict[str, str]  # GOSSIPD_* and CUDA variables, as the process sees them
    ports: dict[str, int]  # setting -> port, for the collision check and the summary
    node_id: str  # the id it runs under
    key_file: str  # with CURVE: its key pair, {node_id} filled in; "" without


def format_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 3, 5] -> "0-3,5"."""
    parts: list[str] = []
    ordered = sorted(indices)
    start = prev = ordered[0] if ordered else 0
    for index in [*ordered[1:], None]:
        if index is not None and index == prev + 1:
            prev = index
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if index is not None:
            start = prev = index
    return ",".join(parts) if ordered else ""


# What a stop takes after lifecycle.shutdown_grace_s (daemon.py's _shut_down and
# _close_intake): the leave, INTAKE_CLOSE_S (1 s) for producers to end their connections,
# FORWARDS_SETTLE_S for forwards, the replies' flush (2 s) and the
# sockets' linger (2 s), with room to spare; systemd's SIGKILL must not cut the drain.
STOP_AFTER_GRACE_S = 10


def stop_timeout_s(config: Config) -> int:
    return math.ceil(config.lifecycle.shutdown_grace_s) + STOP_AFTER_GRACE_S


def render_service(
    *,
    bin_path: str = DEFAULT_BIN,
    config_path: str = DEFAULT_CONFIG,
    stop_timeout: int = stop_timeout_s(Config()),
) -> str:
    for what, path in (("--bin", bin_path), ("--config", config_path)):
        if not path.startswith("/") or any(c in path for c in " \t\n%\"'\\"):
            raise RenderError(
                f"{what} {path!r}: a unit needs an absolute path without spaces, quotes or %"
            )
    return SERVICE_TEMPLATE.format(bin=bin_path, config=config_path, stop_timeout_s=stop_timeout)


def render_target(indices: Sequence[int]) -> str:
    wants = " ".join(f"gossipd@{i}.service" for i in indices)
    return TARGET_TEMPLATE.format(gpus=format_indices(indices), wants=wants)


def render_numa(gpu: Gpu) -> str:
    where = f"NUMA node {gpu.numa_node}" if gpu.numa_node is not None else "no NUMA node"
    lines = [
        f"# gossipd@{gpu.index}: GPU {gpu.index} at PCI {gpu.pci_bus_id}, {where}, "
        f"CPUs {gpu.cpulist or 'unknown'}.",
        "# Written by `gossipd systemd render` from this node's topology; render again after",
        "# moving GPUs or CPUs.",
        "[Service]",
    ]
    if gpu.cpulist:
        lines.append(f"CPUAffinity={gpu.cpulist}")
    else:
        lines.append("# The kernel reports no CPU list for this GPU: no CPU binding.")
    if gpu.numa_node is not None:
        lines += [
            "# Memory from the GPU's node only (pinned buffers stay near the GPU); a node out",
            "# of memory fails allocations rather than spilling to the other socket.",
            "NUMAPolicy=bind",
            f"NUMAMask={gpu.numa_node}",
        ]
    else:
        lines.append("# The platform reports no NUMA node for this GPU: no memory binding.")
    return "\n".join(lines) + "\n"


# --- per-instance settings --------------------------------------------------------------------


def _shift_port(port_text: str, offset: int, what: str) -> tuple[str, int]:
    if port_text in ("*", "0"):
        return port_text, 0
    port = int(port_text) + offset
    if port > PORT_MAX:
        raise RenderError(
            f"{what}: port {port_text} + {offset} = {port} is past {PORT_MAX}; lower the port "
            "in gossipd.toml or --port-stride"
        )
    return str(port), port


def shift_endpoint(endpoint: str, index: int, stride: int, what: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` with PORT + index x stride (and that port; 0 for none)."""
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{index}", 0
    head, _, port_text = endpoint.rpartition(":")
    new_port, port = _shift_port(port_text, index * stride, what)
    return f"{head}:{new_port}", port


def shift_hostport(hostport: str, index: int, stride: int, what: str) -> tuple[str, int]:
    head, _, port_text = hostport.rpartition(":")
    new_port, port = _shift_port(port_text, index * stride, what)
    return f"{head}:{new_port}", port


def _endpoints(config: Config, index: int, stride: int) -> tuple[dict[str, str], dict[str, int]]:
    """The settings with a port, shifted for instance ``index`` (empty ones left out)."""
    sources = {
        "ingress.bind": config.ingress.bind,
        "fanout.rpc_bind": config.fanout.rpc_bind,
        "fanout.rpc_advertise": config.fanout.rpc_advertise,
        "gossip.bind": config.gossip.bind,
        "gossip.advertise": config.gossip.advertise,
        "http.reply_bind": config.http.reply_bind,
    }
    values: dict[str, str] = {}
    ports: dict[str, int] = {}
    for key, value in sources.items():
        if value:
            values[key], ports[key] = shift_endpoint(value, index, stride, key)
    for key, hostport in (("metrics.bind", config.metrics.bind), ("http.bind", config.http.bind)):
        if hostport:
            values[key], ports[key] = shift_hostport(hostport, index, stride, key)
    return values, ports


def _env_name(dotted: str) -> str:
    return "GOSSIPD_" + dotted.upper().replace(".", "__")


def env_literal(value: str | int | Sequence[str]) -> str:
    """A value as an env-file literal that load_config reads back as exactly ``value``: bare
    when that is unambiguous, else a TOML string or array in single quotes."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if re.fullmatch(r"[A-Za-z0-9_./:@*+,=\[\]-]+", value) and parse_scalar(value) == value:
            return value
        text = json.dumps(value)  # a JSON string of printable text is a TOML basic string
    else:
        text = "[" + ", ".join(json.dumps(item) for item in value) + "]"
    if "'" in text or "\n" in text:
        raise RenderError(f"cannot write {value!r} to an environment file (a quote or newline)")
    return f"'{text}'"


def instance_node_id(config: Config, index: int, hostname: str) -> str:
    """The node id instance ``index`` runs under (config.node_id for its env file)."""
    return f"{config.node.id or hostname}-gpu{index}"


def _check_keys(config: Config, gpus: Sequence[Gpu]) -> None:
    sc = config.security
    if sc.curve and len(gpus) > 1 and NODE_ID_PLACEHOLDER not in sc.secret_key_file:
        raise RenderError(
            f"security.secret_key_file = {sc.secret_key_file!r} would be the key pair of all "
            f"{len(gpus)} instances, each its own member under its own node id: put "
            f"{NODE_ID_PLACEHOLDER} in it, e.g. secret_key_file = "
            f'"/etc/gossipd/keys/{NODE_ID_PLACEHOLDER}.key_secret", and make one key pair per '
            "instance with `gossipd keygen NODE... --out DIR` (docs/OPERATIONS.md, Security)"
        )


def plan(
    config: Config,
    gpus: Sequence[Gpu],
    *,
    port_stride: int = DEFAULT_PORT_STRIDE,
    state_root: str = DEFAULT_STATE_ROOT,
    hostname: str | None = None,
) -> list[Instance]:
    """Every instance's settings; RenderError if two would share a port, or share a key pair
    under CURVE.  ``hostname``: what the default node ids start with (this host's)."""
    if port_stride < 1:
        raise RenderError(f"--port-stride: expected at least 1, found {port_stride}")
    _check_keys(config, gpus)
    host = socket.gethostname() if hostname is None else hostname
    ids = {gpu.index: instance_node_id(config, gpu.index, host) for gpu in gpus}
    endpoints = {gpu.index: _endpoints(config, gpu.index, port_stride) for gpu in gpus}
    owner: dict[int, str] = {}
    for gpu in gpus:
        for key, port in endpoints[gpu.index][1].items():
            if not port:
                continue
            # a bind and its own advertise address may share a port: one socket
            base = key.replace("advertise", "bind")
            here = f"{base} of gossipd@{gpu.index}"
            if port in owner and owner[port] != here:
                raise RenderError(
                    f"port {port} would be both {owner[port]} and {here}: two ports of "
                    f"gossipd.toml that differ by a multiple of --port-stride ({port_stride}) "
                    f"below {port_stride * len(gpus)} collide; change one of them or the stride"
                )
            owner[port] = here
    instances = []
    for gpu in gpus:
        values, ports = endpoints[gpu.index]
        env: dict[str, str] = {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": str(gpu.index),
            _env_name("node.gpu_index"): str(gpu.index),
        }
        if config.node.id:
            env[_env_name("node.id")] = env_literal(f"{config.node.id}-gpu{gpu.index}")
        for key, value in values.items():
            env[_env_name(key)] = env_literal(value)
        if config.gossip.bind:
            others = [
                f"{ids[other.index]}@"
                + (
                    endpoints[other.index][0].get("gossip.advertise")
                    or endpoints[other.index][0]["gossip.bind"]
                )
                for other in gpus
                if other.index != gpu.index
            ]
            seeds = list(dict.fromkeys([*config.gossip.seeds, *others]))
            env[_env_name("gossip.seeds")] = env_literal(seeds)
        journal = f"{state_root.rstrip('/')}/{gpu.index}/journal"
        env[_env_name("journal.path")] = env_literal(journal)
        key_file = ""
        if config.security.curve:
            key_file = config.security.secret_key_file.replace(NODE_ID_PLACEHOLDER, ids[gpu.index])
        instances.append(
            Instance(gpu=gpu, env=env, ports=ports, node_id=ids[gpu.index], key_file=key_file)
        )
    return instances


def render_env(instance: Instance, config_path: str) -> str:
    gpu = instance.gpu
    lines = [
        f"# gossipd@{gpu.index}: its own settings over {config_path} (the environment beats the",
        "# file, a --set flag beats both).  Written by `gossipd systemd render`: ports are",
        "# gossipd.toml's plus the GPU index x the port stride (docs/OPERATIONS.md).",
        f"# GPU {gpu.index}: PCI {gpu.pci_bus_id}, NUMA node "
        f"{gpu.numa_node if gpu.numa_node is not None else 'none'}, CPUs {gpu.cpulist or '?'}",
    ]
    lines += [f"{name}={value}" for name, value in instance.env.items()]
    return "\n".join(lines) + "\n"


def render_files(
    config: Config,
    gpus: Sequence[Gpu],
    *,
    config_path: str = DEFAULT_CONFIG,
    bin_path: str = DEFAULT_BIN,
    port_stride: int = DEFAULT_PORT_STRIDE,
    state_root: str = DEFAULT_STATE_ROOT,
) -> tuple[dict[str, str], list[Instance]]:
    """Every file to write (path relative to the output directory -> text), and the plan."""
    if not gpus:
        raise RenderError("no GPU to render units for")
    instances = plan(config, gpus, port_stride=port_stride, state_root=state_root)
    files = {
        f"{UNIT_DIR}/gossipd@.service": render_service(
            bin_path=bin_path, config_path=config_path, stop_timeout=stop_timeout_s(config)
        ),
        f"{UNIT_DIR}/gossipd.target": render_target([gpu.index for gpu in gpus]),
    }
    for instance in instances:
        index = instance.gpu.index
        files[f"{UNIT_DIR}/gossipd@{index}.service.d/numa.conf"] = render_numa(instance.gpu)
        files[f"{ENV_DIR}/{index}.env"] = render_env(instance, config_path)
    return files, instances


def write_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    written = []
    for relative, text in files.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


# --- reading them back (running an instance by hand, tests) -----------------------------------


def read_env_file(text: str) -> dict[str, str]:
    """The variables of an env file as systemd sets them, for the syntax render writes:
    ``KEY=VALUE``, VALUE bare or in single quotes (taken literally), ``#``/``;`` comments."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"line {number}: expected KEY=VALUE, found {raw!r}")
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        elif "'" in value or '"' in value or "\\" in value:
            raise ValueError(f"line {number}: quote the whole value in single quotes: {raw!r}")
        env[key] = value
    return env


def exec_start_argv(service_text: str, instance: str) -> list[str]:
    """The ExecStart= command line of a unit, with %i (and %%) expanded for ``instance``."""
    for line in service_text.splitlines():
        if line.startswith("ExecStart="):
            command = line[len("ExecStart=") :]
            break
    else:
        raise ValueError("no ExecStart= line")
    command = command.replace("%%", "\0").replace("%i", instance)
    if "%" in command:
        raise ValueError(f"ExecStart= uses a specifier this reader does not expand: {command}")
    return [word.replace("\0", "%") for word in shlex.split(command)]
