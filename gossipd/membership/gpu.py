"""What this daemon's GPU looks like right now: NVML where it exists, torch.cuda as fallback,
and on machines without a GPU the static capacity from the configuration (said so in
``source``).  Engine load (running/waiting requests, KV-cache use) is added by the caller."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gossipd.membership.gpu")


@dataclass(frozen=True, slots=True)
class GpuReading:
    source: str  # "nvml", "torch", or "static" (no GPU here)
    memory_free_mb: int
    memory_total_mb: int
    utilization_pct: int


class GpuProbe:
    def __init__(self, gpu_index: int, *, static_memory_total_mb: int) -> None:
        self.gpu_index = gpu_index
        self._static_total = static_memory_total_mb
        self._nvml: Any = None
        self._handle: Any = None
        self._torch: Any = None
        self.source = self._detect()

    def _detect(self) -> str:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            self._nvml = pynvml
            return "nvml"
        except Exception as exc:  # no library, no driver, no such GPU
            log.debug("NVML unavailable", extra={"error": str(exc)})
        # torch only when something (the vLLM engine) imported it already: importing it just
        # to learn there is no GPU costs seconds at every start.
        torch = sys.modules.get("torch")
        try:
            if (
                torch is not None
                and torch.cuda.is_available()
                and self.gpu_index < torch.cuda.device_count()
            ):
                self._torch = torch
                return "torch"
        except Exception as exc:
            log.debug("torch.cuda unavailable", extra={"error": str(exc)})
        return "static"

    def read(self) -> GpuReading:
        if self._nvml is not None:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            return GpuReading("nvml", mem.free // 2**20, mem.total // 2**20, int(util.gpu))
        if self._torch is not None:
            free, total = self._torch.cuda.mem_get_info(self.gpu_index)
            return GpuReading("torch", free // 2**20, total // 2**20, 0)
        return GpuReading("static", self._static_total, self._static_total, 0)
