"""How much memory a run may use: an explicit budget, a GPU name, or what the device has free now."""

from __future__ import annotations

import torch

from memfit.devices import find_backend
from memfit.devices.catalog import capacity_bytes
from memfit.devices.host import available_ram_bytes
from memfit.diagnostics import degrade

__all__ = ["available_ram_bytes", "free_device_bytes", "parse_budget"]


def parse_budget(budget: int | str | None) -> int | None:
    """``None`` (measure later), bytes, a size such as ``"20GiB"``, or a GPU name such as ``"h100"``."""
    return None if budget is None else capacity_bytes(budget, "`budget`")


def free_device_bytes(device: torch.device) -> int:
    """Memory this process could still use on ``device`` now, as its backend tells it (``memfit.devices``): free
    memory plus what its own caching allocator holds (CUDA), or the machine's available RAM (CPU). ``0`` when it
    cannot be told, or no backend answers for the device."""
    backend = find_backend(device)
    if backend is None:
        return 0
    try:
        return backend.free_bytes(device)
    except Exception as error:  # a device runtime that cannot answer: the capacity is unknown
        degrade(f"memfit could not read the free memory of {device} ({type(error).__name__}: {error})", error,
                key="free-memory")  # fmt: skip
        return 0
