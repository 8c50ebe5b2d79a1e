"""Independent counts on real tensors, the yardsticks memfit's predictions are checked against.

Nothing here uses memfit: saved activations come from autograd's ``saved_tensors_hooks``, peaks
from PyTorch's ``MemTracker`` (CPU), the CPU allocator's own reports to ``torch.profiler`` (CPU,
whatever allocates: a framework's loop, DDP's C++ reducer) or ``torch.cuda.max_memory_*`` (GPU),
after real steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["memtracker_peak", "onednn_off", "profiled_cpu_peak", "run_steps", "saved_activation_bytes"]

LossOf = Callable[[nn.Module, Any], torch.Tensor]
Context = Callable[[], contextlib.AbstractContextManager[Any]]


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """oneDNN off, as in memfit's trace: its RNN kernels keep a workspace fake tensors cannot size."""
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    if isinstance(obj, torch.Tensor):
        return [obj.untyped_storage()]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _storages(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _storages(v)]
    return []


def saved_activation_bytes(
    model: nn.Module, batch: Any, loss_of: LossOf, autocast: Context = contextlib.nullcontext
) -> int:
    """Bytes one real forward keeps for backward: autograd's saved tensors, deduplicated by storage,
    without parameters, buffers and the batch itself, plus the loss (alive until backward too)."""
    model.train()
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    excluded |= {s.data_ptr() for s in _storages(batch)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with onednn_off(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = loss_of(model, batch)
    saved[loss.untyped_storage().data_ptr()] = loss.untyped_storage().nbytes()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_of: LossOf,
    *,
    steps: int,
    autocast: Context = contextlib.nullcontext,
    after_step: Callable[[], None] | None = None,
) -> None:
    """Real training steps: forward and loss under ``autocast``, backward, step, ``zero_grad``."""
    for _ in range(steps):
        with autocast():
            loss = loss_of(model, batch)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()


def memtracker_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_of: LossOf,
    *,
    steps: int = 2,
    autocast: Context = contextlib.nullcontext,
) -> int:
    """Peak bytes PyTorch's ``MemTracker`` sees over real CPU steps (it raises on frozen parameters)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.train()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with onednn_off(), tracker:
        run_steps(model, optimizer, batch, loss_of, steps=steps, autocast=autocast, after_step=tracker.reset_mod_stats)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def profiled_cpu_peak(run: Callable[[], Any]) -> int:
    """Peak bytes of CPU tensors allocated inside ``run()`` and alive at once, as the CPU allocator
    reports every allocation and free to ``torch.profiler`` (``profile_memory=True``).

    Everything ``run`` creates counts (build the model and the batch inside it for an absolute
    peak); what was alive before it does not, and neither does its free: the allocator remembers
    the blocks of every earlier profile, so a block an earlier measurement saw allocated would
    otherwise be subtracted here when it is freed.
    """
    import gc

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # what earlier runs left in reference cycles must not be freed inside the measurement
    with onednn_off(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    pending = list(profiler.profiler.kineto_results.experimental_event_tree())
    allocations = []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    blocks: dict[int, int] = {}
    live = peak = 0
    for _, pointer, size in sorted(allocations):
        if size > 0:
            blocks[pointer] = size
            live += size
            peak = max(peak, live)
        elif pointer in blocks:
            live -= blocks.pop(pointer)
    return peak
