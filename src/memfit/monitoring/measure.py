"""Measured peak memory during training, per window, at low overhead.

On CUDA: ``torch.cuda.max_memory_allocated/reserved`` since the last window (the counters are reset
after each read) and NVML's used memory of the device (all processes, context included) when
``nvidia-ml-py`` is installed. On CPU: the process's peak resident memory since the last window
(Linux resets it through ``/proc/self/clear_refs``; elsewhere the lifetime peak is used).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["MemorySample", "PeakSampler", "nvml_device_used_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemorySample:
    """Peaks measured over one window; ``None`` where the quantity cannot be measured here."""

    allocated_bytes: int | None
    reserved_bytes: int | None
    device_used_bytes: int | None
    rss_bytes: int | None


class PeakSampler:
    """Reads and resets peak counters for one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._nvml_failed = False
        self._rss_resettable = _CLEAR_REFS.exists() and _STATUS.exists()
        self.reset()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def reset(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._rss_resettable:
            try:
                _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak resident set size
            except OSError:
                self._rss_resettable = False

    def sample(self) -> MemorySample:
        """Peaks since the last ``sample``/``reset``; the counters start over afterwards."""
        if self.is_cuda:
            allocated = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            used = None if self._nvml_failed else self._nvml()
            result = MemorySample(allocated, reserved, used, None)
        else:
            result = MemorySample(None, None, None, peak_rss_bytes())
        self.reset()
        return result

    def _nvml(self) -> int | None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        used = nvml_device_used_bytes(index)
        self._nvml_failed = used is None
        return used


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (since the last reset on Linux)."""
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def nvml_device_used_bytes(index: int) -> int | None:
    """Used memory of GPU ``index`` from NVML, or ``None`` without ``nvidia-ml-py`` or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(_memory_info(pynvml, handle).used)
    except pynvml.NVMLError:  # no driver, no such device, a lost GPU: no NVML figure
        return None


def _memory_info(pynvml: Any, handle: Any) -> Any:
    """NVML's memory info, version 2 where the driver has it: version 1 counts the memory the driver
    reserves for itself (hundreds of MiB on a data-centre GPU) as used, though no process can have it."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        with contextlib.suppress(pynvml.NVMLError):  # a driver without version 2
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
    return pynvml.nvmlDeviceGetMemoryInfo(handle)
