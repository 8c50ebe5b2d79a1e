"""A small catalog of GPUs by name, so a budget can be "h100" instead of a number of bytes."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from memfit.errors import InvalidInputError
from memfit.units import GiB

__all__ = ["GPU", "gpu_by_name", "known_gpus"]


@dataclass(frozen=True)
class GPU:
    """A GPU model: its name, memory the driver reports as total, and compute capability."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]


# Total memory as torch.cuda.get_device_properties reports it (about the marketing figure in GiB).
_CATALOG: tuple[GPU, ...] = (
    GPU("T4", 15 * GiB, (7, 5)),
    GPU("V100-16GB", 16 * GiB, (7, 0)),
    GPU("V100-32GB", 32 * GiB, (7, 0)),
    GPU("A10G", 22 * GiB, (8, 6)),
    GPU("L4", 22 * GiB, (8, 9)),
    GPU("RTX3090", 24 * GiB, (8, 6)),
    GPU("RTX4090", 24 * GiB, (8, 9)),
    GPU("RTX5090", 32 * GiB, (12, 0)),
    GPU("A100-40GB", 40 * GiB, (8, 0)),
    GPU("A100-80GB", 80 * GiB, (8, 0)),
    GPU("L40S", 45 * GiB, (8, 9)),
    GPU("H100", 80 * GiB, (9, 0)),
    GPU("H200", 140 * GiB, (9, 0)),
    GPU("B200", 180 * GiB, (10, 0)),
)
_ALIASES = {
    "A100": "A100-80GB",
    "V100": "V100-32GB",
    "H10080GB": "H100",
    "H100SXM": "H100",
    "H100PCIE": "H100",
}


def _key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper().replace("NVIDIA", "").replace("GEFORCE", ""))


_BY_KEY = {_key(gpu.name): gpu for gpu in _CATALOG}


def known_gpus() -> tuple[GPU, ...]:
    return _CATALOG


def gpu_by_name(name: str) -> GPU:
    """Look a GPU up forgivingly (``"h100"``, ``"H100-80GB"``, ``"NVIDIA A100 80GB"``)."""
    key = _key(name)
    key = _key(_ALIASES.get(key, key))
    if key in _BY_KEY:
        return _BY_KEY[key]
    if key.endswith("80GB") and key[:-4] in _BY_KEY and _BY_KEY[key[:-4]].memory_bytes == 80 * GiB:
        return _BY_KEY[key[:-4]]
    close = difflib.get_close_matches(key, list(_BY_KEY), n=3, cutoff=0.5)
    names = ", ".join(_BY_KEY[k].name for k in close) or ", ".join(gpu.name for gpu in _CATALOG)
    raise InvalidInputError(f"unknown GPU {name!r}; did you mean {names}? Or give the budget in bytes ('20GiB')")
