"""Check gossipd's GPU readings against a real NVIDIA GPU (run on a GPU machine).

What it checks, printing one JSON object (and writing it to $OUT/gpu_check.json when OUT is
set):
- membership/gpu.py's GpuProbe picks NVML and its memory figures match nvidia-smi's;
- the free memory it reports drops by what a process allocates (torch), and utilization
  rises while the GPU is busy;
- ops/topology.py finds the same GPUs (PCI bus ids) through NVML and through sysfs, in
  nvidia-smi's order;
- the device nodes and /proc/devices names that the systemd unit's DeviceAllow= lines name
  (gossipd/ops/systemd.py) exist.

Usage: PYTHONPATH=. python3 scripts/device_check_gpu.py  (needs nvidia-ml-py; torch optional)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from pathlib import Path

from gossipd.membership.gpu import GpuProbe
from gossipd.ops.topology import normalize_bus_id, read_gpus


def nvidia_smi(fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


def main() -> int:
    report: dict[str, object] = {}
    checks: dict[str, bool] = {}
    probe = GpuProbe(0, static_memory_total_mb=1)
    reading = probe.read()
    smi = nvidia_smi("memory.free,memory.total,utilization.gpu,pci.bus_id,name")
    report["probe_source"] = probe.source
    report["probe"] = dataclasses.asdict(reading)
    report["nvidia_smi"] = smi
    checks["source_is_nvml"] = probe.source == "nvml"
    # nvidia-smi's MiB vs NVML's bytes // 2**20: equal, or within what another process moved.
    checks["total_matches_smi"] = abs(reading.memory_total_mb - int(smi[0][1])) <= 2
    checks["free_matches_smi"] = abs(reading.memory_free_mb - int(smi[0][0])) <= 512

    try:
        import torch

        before = probe.read().memory_free_mb
        block = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")  # 8 GiB
        torch.cuda.synchronize()
        after = probe.read().memory_free_mb
        report["free_drop_mb_for_8192_mb"] = before - after
        checks["free_drops_by_allocation"] = 8192 <= before - after <= 8192 + 1024
        stop = threading.Event()

        def busy() -> None:
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            while not stop.is_set():
                a @ a
                torch.cuda.synchronize()

        worker = threading.Thread(target=busy)
        worker.start()
        samples = []
        for _ in range(20):
            time.sleep(0.1)
            samples.append(probe.read().utilization_pct)
        stop.set()
        worker.join()
        report["utilization_busy_samples"] = samples
        checks["utilization_rises_when_busy"] = max(samples) >= 50
        del block
    except ImportError:
        report["torch"] = "absent: allocation and utilization not checked"

    via_nvml = [g.pci_bus_id for g in read_gpus(use_nvml=True)]
    via_sysfs = [g.pci_bus_id for g in read_gpus(use_nvml=False)]
    smi_ids = [normalize_bus_id(row[3]) for row in smi]
    report["topology"] = {
        "nvml": via_nvml,
        "sysfs": via_sysfs,
        "nvidia_smi": smi_ids,
        "gpus": [dataclasses.asdict(g) for g in read_gpus()],
    }
    checks["topology_nvml_matches_smi"] = via_nvml == smi_ids
    checks["topology_sysfs_same_set"] = sorted(via_sysfs) == sorted(smi_ids)

    devices = (
        Path("/proc/devices").read_text().split("\n") if Path("/proc/devices").exists() else []
    )
    names = {
        line.split()[1]: int(line.split()[0])
        for line in devices
        if len(line.split()) == 2 and line.split()[0].isdigit()
    }
    report["proc_devices_nvidia"] = {k: v for k, v in names.items() if "nvidia" in k}
    nodes = {}
    for path in sorted(Path("/dev").glob("nvidia*")):
        try:
            st = path.stat()
            nodes[path.name] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
        except OSError as exc:
            nodes[path.name] = str(exc)
    report["dev_nodes"] = nodes
    checks["frontend_major_195"] = (
        names.get("nvidia-frontend") == 195 or nodes.get("nvidiactl", [0])[0] == 195
    )
    report["checks"] = checks
    report["ok"] = all(checks.values())
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
