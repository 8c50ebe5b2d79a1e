"""Real FSDP2 ``fully_shard`` training on fake tensors under PyTorch's fake process group: rank 0 of N in one process.

PyTorch's own FSDP memory-tracker tests run this way (``torch.testing._internal.distributed.fake_pg``): the
collectives are no-ops, every buffer FSDP allocates (sharded parameters, all-gather outputs, prefetched units,
reduce-scatter inputs and outputs) is a real allocation of FSDP's code on a fake tensor, and PyTorch's
``MemTracker`` (which follows ``UntypedStorage.resize_``, FSDP's way of freeing gathered parameters) gives the
rank's peak tensor bytes by kind. On torch 2.13 CPU it reproduces the peaks of real gloo runs of the same step
(``benchmarks/sharding_gloo.py``).

The user's model is left untouched: the trace runs on a copy whose parameters and buffers are ``meta`` tensors,
materialised as fake tensors. A process that already has a default process group is not touched: the trace is
refused (``None``) and the documented model (``memfit.tracing.fsdp``) stands.

Known limitations: it measures tensor bytes on the traced device (no caching-allocator replay, no CUDA kernel
substitutions on a CPU-only torch); ``fsdp-hybrid`` (a 2-D mesh) and FSDP1 are not traced this way; ``torch``'s
``MemTracker`` and fake process group are private APIs, feature-detected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.tracing.sharding import ShardingConfig

__all__ = ["FakeRankPeak", "fake_rank_peak"]


@dataclass(frozen=True)
class FakeRankPeak:
    """Rank 0's peak tensor bytes over two real FSDP2 steps, and its split by ``MemTracker``'s kinds."""

    peak_bytes: int
    by_kind: dict[str, int]


def fake_rank_peak(
    model: nn.Module,
    batch: Any,
    sharding: ShardingConfig,
    *,
    blocks: list[nn.Module],
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    device: str = "cpu",
) -> FakeRankPeak | None:
    """Trace two training steps of ``model`` wrapped as ``fully_shard(block)`` for each of ``blocks`` then the root,
    as rank 0 of ``sharding.world_size``; ``None`` where this process cannot (a default process group exists,
    the strategy is not FSDP2, or torch lacks the private pieces)."""
    import torch.distributed as dist

    if sharding.strategy not in ("fsdp", "fsdp-grad-op") or not dist.is_available() or dist.is_initialized():
        return None
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    copied, index = _meta_copy(model, blocks)
    options: dict[str, Any] = {"reshard_after_forward": sharding.reshard_after_forward and sharding.strategy == "fsdp"}
    if sharding.mixed_precision_param_dtype:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, sharding.mixed_precision_param_dtype))
    if sharding.offload_params:
        options["offload_policy"] = CPUOffloadPolicy()
    dist.init_process_group("fake", rank=0, world_size=sharding.world_size, store=FakeStore())
    try:
        for block in (dict(copied.named_modules())[name] for name in index):
            fully_shard(block, **options)
        fully_shard(copied, **options)
        with FakeTensorMode(allow_non_fake_inputs=True):
            copied.to_empty(device=device)
            fake_batch = _fake(batch, device)
            step_optimizer = optimizer([p for p in copied.parameters() if p.requires_grad])
            tracker = MemTracker()
            tracker.track_external(copied, step_optimizer)
            with tracker:
                for _ in range(2):
                    loss_of(copied, fake_batch).backward()
                    step_optimizer.step()
                    step_optimizer.zero_grad()
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    totals = next((v for d, v in peak.items() if torch.device(d).type == torch.device(device).type), {})
    return FakeRankPeak(
        int(totals.get("Total", 0)),
        {str(kind).rsplit(".", 1)[-1].lower(): int(size) for kind, size in totals.items() if kind != "Total"},
    )


def _meta_copy(model: nn.Module, blocks: list[nn.Module]) -> tuple[nn.Module, list[str]]:
    """A copy of ``model`` whose parameters and buffers are ``meta`` tensors (no memory, no copy of the weights),
    and the qualified names of ``blocks`` in it."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter) else meta  # fmt: skip
    names = {id(module): name for name, module in model.named_modules()}
    return copy.deepcopy(model, memo), [names[id(block)] for block in blocks]


def _fake(batch: Any, device: str) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype, device=device)
    if isinstance(batch, dict):
        return {k: _fake(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake(v, device) for v in batch)
    return batch
