"""What a run needs in host (CPU) RAM: the loaded weights, the batches in flight, pinned and offloaded memory.

A GPU plan that fits can still die on the host: loading a checkpoint keeps a CPU copy of the
weights, every dataloader worker prefetches batches, pinned staging buffers are page-locked, and
ZeRO-style offload moves optimizer state (and optionally parameters) into RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.host_memory import available_ram_bytes
from memfit.units import format_bytes

__all__ = ["HostEstimate", "estimate_host", "offloaded_optimizer_bytes"]

_OFFLOAD_STATE_DTYPE_BYTES = 4  # ZeRO-Offload keeps the optimizer state in fp32 on the host


@dataclass(frozen=True)
class HostEstimate:
    """Host RAM by component, and the machine's available RAM when planning for this machine."""

    weights_bytes: int
    batches_bytes: int
    pinned_bytes: int
    offload_bytes: int
    available_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.batches_bytes + self.pinned_bytes + self.offload_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.total_bytes <= self.available_bytes

    def summary(self) -> str:
        parts = f"weights {format_bytes(self.weights_bytes)}, batches {format_bytes(self.batches_bytes)}"
        if self.pinned_bytes:
            parts += f", pinned {format_bytes(self.pinned_bytes)}"
        if self.offload_bytes:
            parts += f", offload {format_bytes(self.offload_bytes)}"
        line = f"host RAM: {format_bytes(self.total_bytes)} ({parts})"
        if self.available_bytes is not None:
            line += f" of {format_bytes(self.available_bytes)} available here"
        return line

    def to_dict(self) -> dict[str, int | bool | None]:
        return {
            "weights_bytes": self.weights_bytes,
            "batches_bytes": self.batches_bytes,
            "pinned_bytes": self.pinned_bytes,
            "offload_bytes": self.offload_bytes,
            "total_bytes": self.total_bytes,
            "available_bytes": self.available_bytes,
            "fits": self.fits,
        }


def estimate_host(
    *,
    weights_bytes: int,
    batch_bytes: int,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    offload_bytes: int = 0,
    local_machine: bool = False,
) -> HostEstimate:
    """Host RAM of a run.

    Args:
        weights_bytes: a loaded copy of the weights (the checkpoint read into CPU memory first).
        batch_bytes: one micro batch as the dataloader yields it.
        num_workers, prefetch_factor: each worker keeps ``prefetch_factor`` batches ready; with no
            workers the main process holds one batch.
        pin_memory: one more copy of a batch in page-locked memory for the transfer.
        offload_bytes: optimizer state and/or parameters offloaded to the CPU (ZeRO-Offload, FSDP).
        local_machine: compare with this machine's available RAM.
    """
    in_flight = num_workers * prefetch_factor if num_workers > 0 else 1
    return HostEstimate(
        weights_bytes=weights_bytes,
        batches_bytes=in_flight * batch_bytes,
        pinned_bytes=batch_bytes if pin_memory else 0,
        offload_bytes=offload_bytes,
        available_bytes=available_ram_bytes() if local_machine else None,
    )


def offloaded_optimizer_bytes(optimizer: str | None, trainable_parameters: int) -> int:
    """Host RAM the optimizer state of ``trainable_parameters`` takes when offloaded (fp32 states, per
    the optimizer registry that the formula tier and the trace also read)."""
    from memfit.tracing.optimizers import optimizer_info  # torch: not for a kept answer's host line

    return trainable_parameters * optimizer_info(optimizer).state_bytes(_OFFLOAD_STATE_DTYPE_BYTES)
