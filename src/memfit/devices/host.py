"""The host (``"cpu"``): a run on the CPU plans against the machine's available RAM; no context, no cards,
and no caching allocator to simulate (the monitor reads the process's resident memory instead)."""

from __future__ import annotations

import torch

from memfit.devices.backend import DeviceBackend
from memfit.host_memory import available_ram_bytes

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
