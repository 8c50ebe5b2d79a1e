"""Each rank's predicted and measured peaks, gathered to the rank that logs.

Only rank 0 writes to the loggers, but under sharding (and DDP) every rank has its own peak: an
uneven shard, a rank that keeps a persistent buffer or runs out of memory first. At each logging
step every rank calls ``per_rank_metrics`` with its own window's metrics; the gather is one
all-gather of a fixed-length vector (NaN where a rank measured nothing), so ranks that measured
different keys never disagree on the collective's shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

__all__ = ["PER_RANK_KEYS", "gathered", "per_rank_metrics", "process_group_rank", "process_group_size"]

PER_RANK_KEYS = (
    "predicted_peak_allocated_bytes",
    "predicted_peak_reserved_bytes",
    "measured_peak_allocated_bytes",
    "measured_peak_reserved_bytes",
    "measured_device_used_bytes",
    "measured_peak_rss_bytes",
    "drift_allocated_pct",
    "drift_reserved_pct",
)


def per_rank_metrics(
    metrics: Mapping[str, float] | None,
    gather: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """``memfit/rank{r}/<key>`` for every rank and every key of ``PER_RANK_KEYS`` that rank measured.

    Args:
        metrics: this rank's ``memfit/*`` metrics of the window (``None``: nothing measured here).
        gather: an all-gather of a 1-D tensor over the ranks (every rank calls it), returning the
            ranks' tensors stacked or concatenated in rank order.
        device: where the gathered tensor lives (the rank's device: NCCL gathers CUDA tensors only).
    """
    metrics = metrics or {}
    mine = [float(metrics.get(f"memfit/{key}", math.nan)) for key in PER_RANK_KEYS]
    table = gather(torch.tensor(mine, dtype=torch.float64, device=device)).reshape(-1, len(PER_RANK_KEYS))
    return {
        f"memfit/rank{rank}/{key}": value
        for rank, row in enumerate(table.cpu().tolist())
        for key, value in zip(PER_RANK_KEYS, row, strict=True)
        if not math.isnan(value)
    }


def process_group_size() -> int:
    """Processes in ``torch.distributed``'s default group (1 without one)."""
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def process_group_rank() -> int:
    """This process's rank in ``torch.distributed``'s default group (0 without one)."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's ``tensor``, stacked in rank order (the tensor alone outside a process group)."""
    if process_group_size() <= 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, tensor)
    return torch.stack(out)
