"""Accelerator cards by name: memory and the facts that change an estimate, so a budget can be "h100".

Memory is the total the driver reports (``nvidia-smi``'s "Total", in MiB), not the marketing figure: an
"80 GB" H100 shows 81,559 MiB. Each backend (``memfit.devices``) brings its own cards; a name is looked up
across all of them, so a budget or target names a card whatever its vendor.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.units import parse_bytes

__all__ = ["GPU", "capacity_bytes", "gpu_by_name", "known_gpus"]

_BF16 = (Precision.BF16_MIXED, Precision.BF16_TRUE)


@dataclass(frozen=True)
class GPU:
    """A GPU model and what memfit needs to know about it."""

    name: str
    memory_bytes: int
    vendor: str
    architecture: str
    compute_capability: tuple[int, int] | None
    bf16: bool
    fp8: bool
    approximate: bool = False
    aliases: tuple[str, ...] = ()
    # what CUDA kernels size their launch grids by (reductions' staging buffers grow with it): from the vendor's
    # specifications; None where the catalog has no figure (an H100's is then assumed)
    multiprocessors: int | None = None
    max_threads_per_multiprocessor: int | None = None
    # the backend (``memfit.devices``) that plans, traces and measures this card
    device_type: str = "cuda"

    @property
    def cublas_workspace_bytes(self) -> int:
        """cuBLAS workspace per handle on this architecture (32 MiB on Hopper and newer, else 8 MiB + 128 KiB)."""
        from memfit.simulation.runtime import cublas_workspace_bytes

        return cublas_workspace_bytes(self.compute_capability or (9, 0))

    @property
    def runtime(self) -> Any:
        """The runtime facts an estimate for this card takes, from its backend (for a CUDA card, a
        ``CudaRuntime``: an H100-class card's where the catalog has no figure)."""
        from memfit.devices.backend import backend_for

        return backend_for(self.device_type).runtime_for(self)

    def precision_for(self, requested: Precision | str | None, *, inference: bool = False) -> Precision:
        """The precision to plan this card in.

        ``None`` asks for the card's usual one: bf16 where it has it, else fp16 (T4, V100), mixed for
        training and half-precision weights (``*-true``) for inference. A bf16 precision asked of a card
        without bf16 raises ``InvalidInputError``: torch only emulates it there (slowly), and without
        its fused attention kernels the memory is not the one memfit models.
        """
        if requested is None:
            if inference:
                return Precision.BF16_TRUE if self.bf16 else Precision.FP16_TRUE
            return Precision.BF16_MIXED if self.bf16 else Precision.FP16_MIXED
        precision = Precision.parse(requested)
        if precision in _BF16 and not self.bf16:
            fp16 = Precision.FP16_MIXED if precision.is_mixed else Precision.FP16_TRUE
            raise InvalidInputError(
                f"{self.name} ({self.architecture}) has no bf16, so {precision.value} would run emulated, slowly "
                f"and with other kernels than memfit models; plan it with `precision` {fp16.value} instead"
            )
        return precision


def _key(name: str) -> str:
    text = name.upper()
    for noise in ("NVIDIA", "GEFORCE", "TESLA", "INSTINCT", "APPLE", "AMD"):
        text = text.replace(noise, "")
    return re.sub(r"[^A-Z0-9]", "", text)


_INDEX: list[dict[str, GPU]] = []  # the names of every registered backend's cards, built on first lookup


def forget_index() -> None:
    """Drop the name index (a backend was registered or removed)."""
    _INDEX.clear()


def _by_key() -> dict[str, GPU]:
    if not _INDEX:
        index: dict[str, GPU] = {}
        for gpu in known_gpus():
            for name in (gpu.name, *gpu.aliases):
                index[_key(name)] = gpu
        _INDEX.append(index)
    return _INDEX[0]


def known_gpus() -> tuple[GPU, ...]:
    """Every registered backend's cards, CUDA's first."""
    from memfit.devices.backend import registered_backends

    return tuple(gpu for backend in registered_backends() for gpu in backend.catalog())


def gpu_by_name(name: str) -> GPU:
    """Look a GPU up forgivingly: ``"h100"``, ``"H100-80GB"``, ``"NVIDIA A100 80GB"``, ``"rtx 4090"``.

    A name that fits several entries (``"a100"``: 40 or 80 GB) or none raises ``InvalidInputError``
    listing the candidates.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidInputError(f"a GPU name must be a non-empty string, got {name!r}")
    key = _key(name)
    by_key = _by_key()
    if key in by_key:
        return by_key[key]
    prefixed = sorted({gpu.name for k, gpu in by_key.items() if k.startswith(key)})
    if len(prefixed) == 1:
        return next(gpu for gpu in known_gpus() if gpu.name == prefixed[0])
    if len(prefixed) > 1:
        raise InvalidInputError(f"GPU {name!r} is ambiguous: {', '.join(prefixed)}; name the memory size too")
    close = difflib.get_close_matches(key, list(by_key), n=4, cutoff=0.5)
    names = sorted({by_key[k].name for k in close})
    hint = f"did you mean {', '.join(names)}? " if names else ""
    raise InvalidInputError(
        f"unknown GPU {name!r}; {hint}`memfit gpus` lists the known ones; for a card memfit does not know, plan for "
        "its memory as a budget (--budget 20GiB on the command line, budget='20GiB' in Python)"
    )


def capacity_bytes(value: int | str, argument: str = "capacity_bytes") -> int:
    """Bytes, a size such as ``"20GiB"``, or a GPU name such as ``"h100"`` (that card's memory); anything else is
    refused in one line naming ``argument`` and what it takes."""
    if isinstance(value, str) and value.strip()[:1].isalpha():
        try:
            return gpu_by_name(value).memory_bytes
        except InvalidInputError as error:  # a word that names no card: say which argument, and what else it takes
            if not str(error).startswith("unknown GPU"):
                raise
            raise InvalidInputError(f"{argument} is neither a size such as '20GiB' nor a known GPU: {error}") from None
    if isinstance(value, str) and value.strip().startswith("-"):
        raise InvalidInputError(f"{argument} must be positive, got {value!r}")
    try:
        parsed = parse_bytes(value)
    except ValueError as error:
        raise InvalidInputError(f"{argument} {error}; or name a GPU such as 'h100'") from None
    if parsed <= 0:
        raise InvalidInputError(f"{argument} must be positive, got {value!r}")
    return parsed
