"""Measured peak memory during training, per window, at low overhead.

On a device whose backend (``memfit.devices``) has peak counters, CUDA's: ``torch.cuda.max_memory_allocated/reserved``
since the last window (the counters are reset after each read) and NVML's used memory of the device (all processes,
context included) when ``nvidia-ml-py`` is installed. Elsewhere (CPU): the process's peak resident memory since the
last window (Linux resets it through ``/proc/self/clear_refs``; elsewhere the lifetime peak is used).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.devices import find_backend
from memfit.devices.cuda import nvml_device_used_bytes

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
        self.backend = find_backend(self.device)
        self._nvml_failed = False
        self._rss_resettable = _CLEAR_REFS.exists() and _STATUS.exists()
        self.reset()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def has_counters(self) -> bool:
        """Whether the device's backend keeps allocator peak counters (CUDA's), else the host's RSS is read."""
        return self.backend is not None and self.backend.has_peak_counters

    def reset(self) -> None:
        if self.backend is not None and self.has_counters:
            self.backend.reset_peaks(self.device)
        elif self._rss_resettable:
            try:
                _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak resident set size
            except OSError:
                self._rss_resettable = False

    def sample(self) -> MemorySample:
        """Peaks since the last ``sample``/``reset``; the counters start over afterwards."""
        if self.backend is not None and self.has_counters:
            allocated = self.backend.peak_allocated_bytes(self.device)
            reserved = self.backend.peak_reserved_bytes(self.device)
            used = None if self._nvml_failed else self._device_used()
            result = MemorySample(allocated, reserved, used, None)
        else:
            result = MemorySample(None, None, None, peak_rss_bytes())
        self.reset()
        return result

    def _device_used(self) -> int | None:
        """The whole device's used memory (NVML on CUDA); once it has no answer it is not asked again."""
        used = self.backend.device_used_bytes(self.device) if self.backend is not None else None
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
