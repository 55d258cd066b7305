"""This node's NVIDIA GPUs and where they sit: PCI bus id, NUMA node, the CPUs near them.

The GPUs are numbered in PCI bus order, which is NVML's order and CUDA's with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the rendered units set it), so GPU index N means the same
device to NVML, to CUDA and here.  The list comes from NVML when it is installed and finds a
driver; otherwise from sysfs: every ``/sys/bus/pci/devices/*/`` whose ``vendor`` is 0x10de
(NVIDIA) and whose ``class`` is a 3D controller (0x0302xx) or a VGA controller (0x0300xx), so
NVSwitches and audio functions are left out.  The NUMA node and CPU list always come from
sysfs (``numa_node``, ``local_cpulist`` of the GPU's PCI device); a ``sysfs_root`` other than
/sys (a fake tree, for tests) skips NVML.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gossipd.ops.topology")

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x030200, 0x030000)  # 3D controller (data-centre GPUs), VGA controller
_CLASS_MASK = 0xFFFF00  # the last byte is the programming interface
_BUS_ID_RE = re.compile(r"^([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", re.I)
_CPULIST_RE = re.compile(r"^\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*$")


class TopologyError(Exception):
    """The GPUs could not be read, or a request names one this node does not have."""


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int  # position in PCI bus order: NVML's index, CUDA's with PCI_BUS_ID order
    pci_bus_id: str  # sysfs form, "0000:3b:00.0"
    numa_node: int | None  # None: the platform reports none (-1), e.g. one socket
    cpulist: str  # the CPUs local to the GPU, kernel list syntax ("0-23,48-71"); "" unknown


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` (NVML) or ``0000:3b:00.0`` (sysfs) -> ``0000:3b:00.0``."""
    match = _BUS_ID_RE.match(bus_id.strip())
    if match is None:
        raise TopologyError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def parse_cpulist(text: str) -> list[int]:
    """The kernel's list syntax ("0-3,8,10-11") as CPU numbers; ValueError if malformed."""
    text = text.strip()
    if not text:
        return []
    if not _CPULIST_RE.match(text):
        raise ValueError(f"not a CPU list: {text!r}")
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.extend(range(first, last + 1))
    return cpus


def parse_index_list(text: str) -> list[int]:
    """``--gpus`` syntax: "0-7", "0,2,4-5"; sorted, each once; ValueError if malformed."""
    try:
        indices = parse_cpulist(text)
    except ValueError:
        raise ValueError(f"expected GPU indices like 0-7 or 0,2,5, found {text!r}") from None
    if not indices:
        raise ValueError("expected at least one GPU index, found none")
    return sorted(set(indices))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


def _locate(sysfs_root: Path, bus_id: str) -> tuple[int | None, str]:
    device = sysfs_root / "bus" / "pci" / "devices" / bus_id
    numa_text = _read(device / "numa_node")
    try:
        numa = int(numa_text)
    except ValueError:
        numa = -1
    cpulist = _read(device / "local_cpulist")
    try:
        parse_cpulist(cpulist)
    except ValueError:
        log.warning("unreadable local_cpulist", extra={"device": str(device), "found": cpulist})
        cpulist = ""
    return (numa if numa >= 0 else None), cpulist


def sysfs_bus_ids(sysfs_root: Path) -> list[str]:
    """The NVIDIA GPUs' PCI bus ids found in sysfs, in bus order."""
    devices = sysfs_root / "bus" / "pci" / "devices"
    if not devices.is_dir():
        raise TopologyError(f"{devices}: no such directory (is {sysfs_root} a sysfs tree?)")
    found = []
    for device in devices.iterdir():
        vendor = _hex(_read(device / "vendor"))
        pci_class = _hex(_read(device / "class"))
        if vendor != NVIDIA_VENDOR or pci_class is None:
            continue
        if pci_class & _CLASS_MASK in GPU_CLASSES:
            try:
                found.append(normalize_bus_id(device.name))
            except TopologyError:
                log.warning("skipping a device with an odd name", extra={"device": str(device)})
    return sorted(found)


def nvml_bus_ids() -> list[str] | None:
    """The GPUs' PCI bus ids from NVML in its index order; None without NVML or a driver."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver
        log.debug("NVML unavailable", extra={"error": str(exc)})
        return None
    try:
        ids = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            bus_id = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).busId
            ids.append(normalize_bus_id(bus_id.decode() if isinstance(bus_id, bytes) else bus_id))
        return ids
    except Exception as exc:  # a GPU NVML cannot query (fallen off the bus): sysfs lists it
        log.warning("NVML cannot list the GPUs; reading sysfs", extra={"error": str(exc)})
        return None
    finally:
        pynvml.nvmlShutdown()


def read_gpus(sysfs_root: Path = Path("/sys"), *, use_nvml: bool | None = None) -> list[Gpu]:
    """This node's GPUs in index order.  ``use_nvml`` None: NVML when ``sysfs_root`` is /sys."""
    if use_nvml is None:
        use_nvml = sysfs_root == Path("/sys")
    bus_ids = nvml_bus_ids() if use_nvml else None
    if bus_ids is None:
        bus_ids = sysfs_bus_ids(sysfs_root)
    gpus = []
    for index, bus_id in enumerate(bus_ids):
        numa, cpulist = _locate(sysfs_root, bus_id)
        gpus.append(Gpu(index=index, pci_bus_id=bus_id, numa_node=numa, cpulist=cpulist))
    return gpus


def select(gpus: Sequence[Gpu], indices: Sequence[int], *, where: str) -> list[Gpu]:
    """The GPUs with these indices; TopologyError naming what this node has otherwise."""
    by_index = {gpu.index: gpu for gpu in gpus}
    missing = [i for i in indices if i not in by_index]
    if missing:
        have = f"GPUs 0-{len(gpus) - 1}" if gpus else "no NVIDIA GPU"
        raise TopologyError(f"GPU {', '.join(map(str, missing))} not found: {where} shows {have}")
    return [by_index[i] for i in indices]
