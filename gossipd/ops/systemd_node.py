"""`gossipd systemd render`, the command: read the node's configuration and GPU topology, write
the files gossipd/ops/systemd.py renders, and say what was written: per instance its ports,
its node id and (with CURVE) the key pair it will load, and whether that exists yet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gossipd.config import Config
from gossipd.ops.systemd import Instance, RenderError, format_indices, render_files, write_files


def _keys_summary(config: Config, instances: Sequence[Instance]) -> str:
    """Per instance: its node id, and with CURVE the key pair it will load (and whether it is
    there yet: `gossipd keygen` makes the missing ones)."""
    if not config.security.curve:
        ids = ", ".join(f"gossipd@{i.gpu.index} {i.node_id}" for i in instances)
        return f"node ids: {ids} (CURVE off)\n"
    lines = ["CURVE on; each instance's key pair (security.secret_key_file):"]
    missing = []
    for instance in instances:
        there = Path(instance.key_file).exists()
        if not there:
            missing.append(instance.node_id)
        lines.append(
            f"  gossipd@{instance.gpu.index} {instance.node_id}: {instance.key_file} "
            f"({'exists' if there else 'MISSING'})"
        )
    if missing:
        where = str(Path(instances[0].key_file).parent)
        lines.append(
            f"  make them: gossipd keygen {' '.join(missing)} --out {where}, and copy each "
            f"NODE.key into security.peer_keys_dir on every node"
        )
    return "\n".join(lines) + "\n"


def render_node(
    *,
    out_dir: Path,
    gpus_spec: str | None,
    sysfs_root: Path,
    config_path: Path,
    bin_path: str,
    port_stride: int,
    state_root: str,
) -> str:
    """`gossipd systemd render`: read the node's config and topology, write the files, and
    return a summary to print.  RenderError (or ConfigError) says what to fix."""
    from gossipd.config import load_config
    from gossipd.ops.topology import TopologyError, parse_index_list, read_gpus, select

    config_path = config_path.absolute()
    if not config_path.exists():
        raise RenderError(
            f"{config_path}: no such file; write the node's configuration there first (start "
            "from configs/local.toml, docs/OPERATIONS.md) or give --config FILE"
        )
    # The file alone: this shell's GOSSIPD_* variables are not the instances'; {node_id} is
    # filled in per instance.
    config = load_config(config_path, environ={}, hostname="")
    try:
        found = read_gpus(sysfs_root)
        indices = parse_index_list(gpus_spec) if gpus_spec else [gpu.index for gpu in found]
        where = f"{sysfs_root}/bus/pci/devices" if sysfs_root != Path("/sys") else "this node"
        gpus = select(found, indices, where=where)
    except (TopologyError, ValueError) as exc:
        raise RenderError(str(exc)) from None
    if not gpus:
        nvml = "NVML is not installed or finds none, and " if sysfs_root == Path("/sys") else ""
        raise RenderError(f"no NVIDIA GPU found: {nvml}{sysfs_root}/bus/pci/devices lists none")
    files, instances = render_files(
        config,
        gpus,
        config_path=str(config_path),
        bin_path=bin_path,
        port_stride=port_stride,
        state_root=state_root,
    )
    write_files(out_dir, files)
    rows: list[tuple[str, ...]] = [
        ("unit", "PCI", "NUMA", "CPUs", "ingress", "gossip", "rpc", "metrics")
    ]
    for instance in instances:
        gpu, ports = instance.gpu, instance.ports
        rows.append(
            (
                f"gossipd@{gpu.index}",
                gpu.pci_bus_id,
                "-" if gpu.numa_node is None else str(gpu.numa_node),
                gpu.cpulist or "-",
                *(
                    str(ports.get(key) or "-")
                    for key in ("ingress.bind", "gossip.bind", "fanout.rpc_bind", "metrics.bind")
                ),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
    return (
        f"wrote {len(files)} files under {out_dir} for GPUs {format_indices(indices)}:\n"
        f"{table}\n"
        f"{_keys_summary(config, instances)}"
        f"install: sudo cp -r {out_dir}/etc/. /etc/ && sudo systemctl daemon-reload && "
        "sudo systemctl enable --now gossipd.target"
    )
