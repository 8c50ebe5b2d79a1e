"""What ``DistributedDataParallel`` adds to every rank's memory: its gradient buckets.

DDP all-reduces gradients in flat buckets that it allocates when the model is wrapped and keeps
for the life of the wrapper: the trainable parameters' bytes once more, in their dtype. With the
default ``gradient_as_bucket_view=False`` each gradient also keeps its own tensor, so gradients
cost twice; with ``True`` they become views of the buckets (autograd's fresh gradient is copied in
and freed at once). The buckets are laid out as DDP lays them out, because a few large blocks and
many small ones round and fragment differently in the caching allocator:

* the first iteration uses one bucket per dtype when DDP looks for no unused parameters (the
  default) or the graph is static, else buckets of ``bucket_cap_mb`` (the first one 1 MiB);
* in that first case DDP rebuilds them at the start of the second forward, in gradient order
  (roughly the reverse of the parameters), freeing the old ones first.

The 250 MiB broadcast of the parameters at wrapping time and NCCL's own buffers are not modelled:
the first is freed before training starts, the second is outside PyTorch's allocator.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import InvalidInputError

__all__ = ["DDPConfig", "bucket_bytes"]

_MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_BYTES = _MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class DDPConfig:
    """The ``DistributedDataParallel`` options that decide its buckets (its keyword arguments).

    ``bucket_cap_mb=None`` is DDP's default: 25 MiB buckets after a 1 MiB first one.
    """

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise InvalidInputError(f"bucket_cap_mb must be a positive number of MiB or None, got {cap!r}")
        for name in ("gradient_as_bucket_view", "find_unused_parameters", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> DDPConfig:
        """From ``DistributedDataParallel``'s keyword arguments, as Lightning's ``DDPStrategy`` and
        accelerate's ``DistributedDataParallelKwargs`` keep them; other keys are ignored."""
        kwargs = dict(kwargs or {})
        return cls(
            bucket_cap_mb=kwargs.get("bucket_cap_mb"),  # given at all, even as 25, DDP drops the 1 MiB first bucket
            gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
            find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
            static_graph=bool(kwargs.get("static_graph", False)),
        )

    @property
    def _limits(self) -> list[int]:
        cap = int((self.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * _MiB)
        first = FIRST_BUCKET_BYTES if self.bucket_cap_mb is None else cap
        return [first, cap] if first < cap else [cap]

    @property
    def rebuilds(self) -> bool:
        """DDP lays its buckets out again after the first iteration (it does unless it looks for unused
        parameters in a dynamic graph)."""
        return self.static_graph or not self.find_unused_parameters

    def initial_bucket_bytes(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Bucket sizes when the model is wrapped, for its trainable parameters in order."""
        return bucket_bytes(params, [sys.maxsize] if self.rebuilds else self._limits)

    def rebuilt_bucket_bytes(self, params: Sequence[torch.Tensor]) -> list[int] | None:
        """Bucket sizes from the second iteration on (``None`` when DDP keeps the first ones)."""
        return bucket_bytes(list(reversed(params)), self._limits) if self.rebuilds else None

    def describe(self) -> str:
        cap = f"{self.bucket_cap_mb:g} MiB" if self.bucket_cap_mb is not None else "25 MiB (1 MiB first)"
        view = ", gradients as bucket views" if self.gradient_as_bucket_view else ""
        return f"DDP gradient buckets of {cap}{view}"


def bucket_bytes(params: Sequence[torch.Tensor], limits: Sequence[int]) -> list[int]:
    """Bytes of each bucket, as ``torch.distributed._compute_bucket_assignment_by_size`` forms them.

    Parameters fill one open bucket per (dtype, device) until it reaches the current limit; then
    the next limit applies (the last one repeats). Buckets come out ordered by their first
    parameter, as DDP's do.
    """
    if not limits:
        raise InvalidInputError("bucket_bytes needs at least one size limit")
    open_buckets: dict[tuple[torch.dtype, str], list[int]] = {}  # key -> [first index, bytes, limit index]
    closed: list[tuple[int, int]] = []
    for index, param in enumerate(params):
        key = (param.dtype, str(param.device))
        bucket = open_buckets.setdefault(key, [index, 0, 0])
        if bucket[1] == 0:
            bucket[0] = index
        bucket[1] += param.numel() * param.element_size()
        if bucket[1] >= limits[bucket[2]]:
            closed.append((bucket[0], bucket[1]))
            bucket[1] = 0
            bucket[2] = min(bucket[2] + 1, len(limits) - 1)
    closed.extend((first, size) for first, size, _ in open_buckets.values() if size > 0)
    return [size for _, size in sorted(closed)]
