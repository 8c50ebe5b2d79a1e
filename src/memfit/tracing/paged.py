"""bitsandbytes' paged optimizers: what of their state the GPU's caching allocator holds, and what it does not.

Read from bitsandbytes 0.50 (``optim/optimizer.py``, ``Optimizer8bit.get_state_buffer``;
``functional.py``, ``get_paged``): on a CUDA device a paged optimizer (``PagedAdamW``,
``PagedAdamW8bit``, ``PagedLion``, ``PagedAdEMAMix``..., ``optim="paged_*"`` in the HF Trainer)
allocates ``state1``/``state2`` of every parameter of 100,000 elements or more with
``cudaMallocManaged`` (``cget_managed_ptr``): CUDA unified memory, outside PyTorch's caching
allocator. ``torch.cuda.memory_allocated``/``memory_reserved`` never include it, and the driver
migrates its pages to host RAM when device allocations need the room, so it cannot cause an
out-of-memory error on the GPU; before each parameter's update bitsandbytes prefetches that
parameter's state to the GPU (``prefetch_state``). Smaller parameters' states, the 8-bit
optimizers' ``absmax`` and their code books are ordinary device tensors.

In the trace (for a CUDA target) the paged buffers are made as fakes the recorder never logs
(``StorageRecorder.off_device``); their bytes are reported in the estimate's notes. On the CPU
bitsandbytes pages nothing (it warns and falls back), and neither does the trace.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.tracing.recorder import StorageRecorder
from memfit.units import format_bytes

__all__ = ["PAGED_MIN_ELEMENTS", "PagedState", "page_optimizer_state", "paged_note"]

PAGED_MIN_ELEMENTS = 100_000  # bitsandbytes: ``if not self.is_paged or p.numel() < 1e5`` -> a device tensor


@dataclass
class PagedState:
    """Bytes of optimizer state a paged optimizer keeps in CUDA unified memory, all of it and the
    largest parameter's (what one update prefetches to the GPU)."""

    total_bytes: int = 0
    largest_bytes: int = 0
    _per_parameter: dict[int, int] = field(default_factory=dict, repr=False)

    def add(self, param: torch.Tensor, nbytes: int) -> None:
        self.total_bytes += nbytes
        self._per_parameter[id(param)] = self._per_parameter.get(id(param), 0) + nbytes
        self.largest_bytes = max(self.largest_bytes, self._per_parameter[id(param)])


def page_optimizer_state(optimizer: Any, recorder: StorageRecorder) -> PagedState | None:
    """Make a paged bitsandbytes ``optimizer`` (built over fake parameters) allocate its big state
    buffers as it does on CUDA: outside the device allocator the recorder models. ``None`` for any
    other optimizer. Only the optimizer built for the trace is changed (an instance attribute)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    base = getattr(module, "Optimizer8bit", None)
    if base is None or not isinstance(optimizer, base) or not getattr(optimizer, "is_paged", False):
        return None
    paged = PagedState()

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if p.numel() < PAGED_MIN_ELEMENTS:
            return torch.zeros_like(p, dtype=dtype, device=p.device)
        with recorder.off_device():
            buffer = torch.zeros_like(p, dtype=dtype, device=p.device)
        paged.add(p, buffer.numel() * buffer.element_size())
        return buffer

    def get_state_double_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """AdEMAMix's two first moments in one buffer, paged by the same rule (``_get_state_double_buffer``)."""
        if p.numel() < PAGED_MIN_ELEMENTS:
            return torch.zeros((2, *p.shape), dtype=dtype, device=p.device)
        with recorder.off_device():
            buffer = torch.zeros((2, *p.shape), dtype=dtype, device=p.device)
        paged.add(p, buffer.numel() * buffer.element_size())
        return buffer

    optimizer.get_state_buffer = get_state_buffer
    if hasattr(optimizer, "_get_state_double_buffer"):
        optimizer._get_state_double_buffer = get_state_double_buffer
    return paged


def paged_note(paged: PagedState) -> str:
    """The estimate's note for a paged optimizer's unified-memory state."""
    return (
        f"paged optimizer: {format_bytes(paged.total_bytes)} of its state (parameters of {PAGED_MIN_ELEMENTS:,} "
        "elements or more) lives in CUDA unified memory, outside PyTorch's allocator, and is not in the predicted "
        "peak: the driver pages it to host RAM when the GPU needs the room (host RAM must hold it), and "
        f"bitsandbytes moves each parameter's state (up to {format_bytes(paged.largest_bytes)}) to the GPU for its "
        "update; nvidia-smi shows it as used while the GPU has room to spare"
    )
