"""The host (``"cpu"``): a run on the CPU plans against the machine's available RAM; no context, no cards,
and no caching allocator to simulate (the monitor reads the process's resident memory instead)."""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.devices.backend import DeviceBackend

__all__ = ["HostBackend", "available_ram_bytes"]


class HostBackend(DeviceBackend):
    """Tensors in host memory, traced with the host's own kernels."""

    device_type = "cpu"
    trace_device = "cpu"
    collective_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def free_bytes(self, device: torch.device) -> int:
        return available_ram_bytes()


def available_ram_bytes() -> int:
    """RAM the machine can still give a process (Linux's ``MemAvailable``, else psutil's; ``0`` when unknown)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        import psutil
    except ImportError:
        return 0
    return int(psutil.virtual_memory().available)
