"""The machine's RAM, read without torch: what the kept answers key on and measure again when they are replayed."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_ram_bytes", "machine_ram_bytes"]


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


def machine_ram_bytes() -> int | None:
    """The physical memory of this machine (``None`` where the system does not say, as on Windows)."""
    try:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return size if size > 0 else None
