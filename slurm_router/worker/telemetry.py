"""Device telemetry, read by a worker between steps (never per routing decision): memory peak and total,
utilisation. pynvml on NVIDIA GPUs, psutil for CPU workers."""

from __future__ import annotations

import os

import psutil
import torch


class Telemetry:
    def __init__(self, device: torch.device):
        self.device = device
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # first call primes the counter
        self._nvml = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                physical = self._physical_index(device.index or 0)
                self._nvml = (
                    pynvml.nvmlDeviceGetHandleByUUID(physical)
                    if isinstance(physical, str)
                    else pynvml.nvmlDeviceGetHandleByIndex(physical)
                )
                self._pynvml = pynvml
            except Exception:  # telemetry is best effort: no NVML, still train
                self._nvml = None

    @staticmethod
    def _physical_index(local: int) -> int | str:
        """NVML's index (or UUID: some clusters list GPU-... or MIG-... ids) of this process's cuda:local."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local < len(ids):
            if ids[local].isdigit():
                return int(ids[local])
            if ids[local].startswith(("GPU-", "MIG-")):
                return ids[local]
        return local

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self._proc.memory_info().rss)

    def total_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return int(psutil.virtual_memory().total)

    def free_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free)
        return int(psutil.virtual_memory().available)

    def util(self) -> float:
        """GPU utilisation % (NVML) or this process's CPU %, since the last call."""
        if self._nvml is not None:
            return float(self._pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
        return float(self._proc.cpu_percent(None))


def device_name(device: torch.device) -> str:
    """The GPU model (for MFU in the report), or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"
