"""Record every tensor storage a traced step creates and frees, in order.

The recorder is a ``TorchDispatchMode`` that sits above ``FakeTensorMode``: every aten op's
outputs pass through it, and each new untyped storage gets an id, a size and a weak reference
whose callback logs the free. No real memory is involved; the log is replayed afterwards
(``replay``) to find peaks, and through the caching-allocator simulation to predict what the
CUDA allocator would reserve.

Memory that a kernel uses internally without returning a tensor never passes through dispatch: the cuBLAS
workspace and the scratch of CUDA kernels (``memfit.tracing.cuda_scratch``: cuDNN workspaces, reductions' staging
buffers, embedding backward's sort) are added here for a CUDA target; NCCL buffers are modelled where DDP and
sharding are.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from memfit.categories import Category, Phase
from memfit.tracing import cuda_scratch
from memfit.tracing.known_masks import KnownOnes
from memfit.tracing.packed_sequences import KnownPositions

__all__ = ["PhaseMark", "StorageRecorder", "fold_sums_in_place", "storage_bytes", "symbolic_decompositions"]

_ADD = torch.ops.aten.add.Tensor

# Ops that reach cuBLAS on a GPU: the first one on each thread makes cuBLAS allocate its workspace.
_CUBLAS_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
        "_scaled_mm",
        "matmul",
        "linear",
    }
)


def storage_bytes(storage: torch.UntypedStorage) -> Any:
    """The storage's size in bytes: an ``int``, or under a symbolic batch a sympy expression in it.

    The expression is read off the ``SymInt`` without comparing it to anything, which would install a
    guard on the batch (see ``memfit.tracing.symbolic``).
    """
    size = storage.nbytes()
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else expr
    return size


def symbolic_decompositions() -> dict[Any, Any]:
    """Ops whose kernels read sizes as plain integers, run as their decompositions under a symbolic batch.

    ``constant_pad_nd``'s kernel (``F.pad``, used by transformers' causal-LM loss) calls ``sizes()``, which
    pins a symbolic batch to the value it was traced at; its decomposition allocates the same single
    output from symbolic sizes.
    """
    from torch._decomp import decomposition_table

    ops = (torch.ops.aten.constant_pad_nd.default,)
    table = {op: decomposition_table[op] for op in ops if op in decomposition_table}
    table[torch.ops.aten.slice_backward.default] = _slice_backward
    return table


def _slice_backward(grad: torch.Tensor, input_sizes: Any, dim: int, start: Any, end: Any, step: Any) -> torch.Tensor:
    """``slice_backward`` that passes the gradient through where indexing sliced a whole dimension.

    Eager indexing returns the tensor itself for ``x[:, ...]`` or ``x[0:]``, so nothing runs in backward; over a
    symbolic dimension it cannot tell the slice is whole, records it, and its backward would allocate a zeroed
    gradient of the input's size and copy into it. Only the open end that indexing passes (``sys.maxsize``) is
    taken as whole: it is past any size without installing a guard, while an explicit ``narrow`` over the whole
    dimension is recorded in eager too and keeps its backward.
    """
    whole = (start, step) == (0, 1) and isinstance(end, int) and end >= sys.maxsize
    if whole and all(isinstance(value, int) for value in (start, step)):
        return torch.ops.aten.alias.default(grad)
    return torch.ops.aten.slice_backward.default(grad, input_sizes, dim, start, end, step)


@dataclass(frozen=True)
class PhaseMark:
    """The event index where a phase of a step starts."""

    event_index: int
    step: int
    phase: Phase


class StorageRecorder(TorchDispatchMode):
    """Log of storage allocations (``+id``) and frees (``-id``) with sizes and categories.

    ``events`` holds signed storage ids; ``sizes[id]`` the storage bytes; ``categories[id]``
    the role decided so far (absent until a phase end settles it; temporaries by default).
    ``workspace_bytes`` > 0 adds a cuBLAS workspace the first time a matmul runs in forward and
    in backward, as on a GPU, and the scratch CUDA kernels allocate for themselves on ``cuda_target``
    (``memfit.tracing.cuda_scratch``).
    """

    def __init__(
        self,
        *,
        workspace_bytes: int = 0,
        cuda_target: cuda_scratch.CudaTarget | None = None,
    ) -> None:
        super().__init__()
        self.workspace_bytes = workspace_bytes
        self.cuda_target = cuda_target or cuda_scratch.CudaTarget()
        self.events: list[int] = []
        self.sizes: dict[int, int] = {}
        self.categories: dict[int, Category] = {}
        self.alloc_phase: dict[int, int] = {}
        self.marks: list[PhaseMark] = []
        self.ops = 0
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._live: dict[int, int] = {}
        self._next_id = 1
        self._closed = False
        self._workspace_phases: set[Phase] = set()
        # op -> implementation to run instead (a symbolic trace's stand-ins for kernels that read sizes)
        self.decompositions: dict[Any, Any] = {}
        self._off_device: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages outside the device's allocator
        self._allocating_off_device = False
        # Which repeated block each event happened in, for building a deeper model's log from this one's
        # (``memfit.tracing.depth``); ``None`` unless ``record_blocks`` turned it on.
        self.current_block: int | None = None
        self.event_blocks: list[int | None] | None = None
        self._accumulation: tuple[int, int] | None = None  # (sum, old gradient) of the engine's last accumulation
        self.scratch: set[int] = set()  # allocations of a kernel's own scratch (``memfit.tracing.cuda_scratch``)
        # In a log that records blocks: a gradient sum logged as a free of the first gradient and the sum's
        # allocation, which the engine does in place (sum -> first gradient; ``fold_sums_in_place``)
        self.sums_in_place: dict[int, int] = {}
        self.scratch_kinds: dict[str, int] = {}  # how many kernels allocated scratch, by kind
        self.claimed_by: dict[int, int] = {}  # storage -> the storage whose block it belongs to (optimizer state)
        self.derived_from: dict[int, int] = {}  # storage made outside any block -> the storage it was made from
        self.positions = KnownPositions()  # position ids whose values the trace knows (transformers' packing check)
        self.ones = KnownOnes()  # all-ones masks of the sample (transformers' mask-skip checks)

    def record_blocks(self) -> None:
        """Log, with every event from now on, the block running when it happened (``current_block``)."""
        self.event_blocks = [None] * len(self.events)

    def claim(self, tensor: torch.Tensor, owner: torch.Tensor) -> None:
        """Say that ``tensor``'s storage belongs to the block ``owner``'s storage was made in (a parameter's
        optimizer state, which the optimizer may make from nothing, as a step count)."""
        if self.event_blocks is None:
            return
        sid, owner_sid = self.track(tensor), self._ids.get(owner.untyped_storage())
        if sid is not None and owner_sid is not None:
            self.claimed_by[sid] = owner_sid

    # ----------------------------------------------------------------- tracking
    def track(self, tensor: torch.Tensor, category: Category | None = None) -> int | None:
        """Register ``tensor``'s storage (once) and optionally settle its category."""
        if not isinstance(tensor, torch.Tensor):
            return None
        storage = tensor.untyped_storage()
        if self._allocating_off_device:
            self._off_device[storage] = True
        if storage in self._off_device:
            return None
        sid = self._ids.get(storage)
        if sid is None:
            sid = self._new_storage(storage)
        else:
            size = storage_bytes(storage)
            if size != self.sizes[sid]:  # resize_ grew or shrank the storage in place
                self._free(sid)
                self._ids.pop(storage, None)
                sid = self._new_storage(storage)
        if category is not None:
            self.categories[sid] = category
        return sid

    def _new_storage(self, storage: torch.UntypedStorage) -> int:
        sid = self._next_id
        self._next_id += 1
        size = storage_bytes(storage)
        self._ids[storage] = sid
        self.sizes[sid] = size
        self.alloc_phase[sid] = len(self.marks) - 1
        self._live[sid] = size
        self._log(sid)
        self._refs[sid] = weakref.ref(storage, lambda _ref, sid=sid: self._free(sid))
        return sid

    def _log(self, event: int, *, in_block: bool = True) -> None:
        self.events.append(event)
        if self.event_blocks is not None:
            self.event_blocks.append(self.current_block if in_block else None)

    def _free(self, sid: int) -> None:
        if self._closed or sid not in self._live:
            return
        if self._sum_in_place(sid):
            return
        del self._live[sid]
        self._refs.pop(sid, None)
        self._log(-sid)

    @contextlib.contextmanager
    def off_device(self) -> Iterator[None]:
        """Storages created inside are never logged, now or later: memory the device's caching
        allocator does not hold (CUDA unified memory that bitsandbytes' paged optimizers allocate)."""
        self._allocating_off_device = True
        try:
            yield
        finally:
            self._allocating_off_device = False

    def allocate_untracked(self, size: int, category: Category, *, in_block: bool = False) -> int:
        """An allocation that no traced tensor owns (cuBLAS workspace, DDP buckets); it lives until
        ``free_untracked``, or to the end. ``in_block``: it belongs to the repeated block running now (a kernel's
        workspace), not to the run."""
        sid = self._next_id
        self._next_id += 1
        self.sizes[sid] = size
        self.categories[sid] = category
        self.alloc_phase[sid] = len(self.marks) - 1
        self._live[sid] = size
        self._log(sid, in_block=in_block)  # by default the run's, not the block's that happened to need it first
        return sid

    def free_untracked(self, sid: int) -> None:
        self._free(sid)

    def free_on_allocation(self, category: Category) -> None:
        """Move the free of every storage of ``category`` right after its allocation: those tensors
        are copied elsewhere the moment they appear (gradients as DDP bucket views)."""
        doomed = {sid for sid, c in self.categories.items() if c is category}
        events: list[int] = []
        blocks: list[int | None] = []
        moved_to: list[int] = []  # new index of each old one, for the phase marks
        for index, event in enumerate(self.events):
            moved_to.append(len(events))
            if event < 0 and -event in doomed:
                continue
            block = self.event_blocks[index] if self.event_blocks is not None else None
            events.append(event)
            blocks.append(block)
            if event > 0 and event in doomed:
                events.append(-event)
                blocks.append(block)
        moved_to.append(len(events))
        self.marks = [PhaseMark(moved_to[m.event_index], m.step, m.phase) for m in self.marks]
        self.events = events
        if self.event_blocks is not None:
            self.event_blocks = blocks

    # ------------------------------------------------------------------ phases
    def mark(self, step: int, phase: Phase) -> None:
        self.marks.append(PhaseMark(len(self.events), step, phase))
        self.current_block = None  # a phase starts outside every block

    @property
    def current_phase(self) -> Phase | None:
        return self.marks[-1].phase if self.marks else None

    def settle_unclassified(self, category: Category, *, phase_index: int) -> None:
        """Give ``category`` to live storages born in ``phase_index`` that have none yet."""
        for sid in self._live:
            if sid not in self.categories and self.alloc_phase.get(sid) == phase_index:
                self.categories[sid] = category

    def close(self) -> None:
        """Stop logging frees (the trace is over; what dies now is cleanup, not the step)."""
        self._closed = True

    # ---------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.ops += 1
        target = self.cuda_target if self.workspace_bytes else None
        scratch: dict[str, int | None] = {}
        if target is not None:
            self._scratch(cuda_scratch.before_outputs(func, args, target), scratch)
        out = self.decompositions.get(func, func)(*args, **kwargs)
        self.positions.note(func, args, kwargs, out)
        self.ones.note(func, args, kwargs, out)
        flat, _ = tree_flatten(out)
        first_new = self._next_id
        each = cuda_scratch.per_output(func, args, out, target) if target is not None else {}
        for item in cuda_scratch.allocation_order(func, flat) if target is not None else flat:
            if isinstance(item, torch.Tensor):
                self.track(item)
                self._scratch(each.get(id(item)), {})
        if target is not None:
            self._scratch(cuda_scratch.after_outputs(func, args, out, target), scratch)
        if self.workspace_bytes and func.overloadpacket.__name__ in _CUBLAS_OPS:
            self._maybe_allocate_workspace()  # cuBLAS takes it as the kernel runs, after the output is allocated
        accumulation = self._gradient_sum(func, args, kwargs, out)
        if accumulation is not None:  # kept until the next free: ops that log nothing may come in between
            self._accumulation = accumulation
        if self.event_blocks is not None and self._next_id > first_new and self.current_phase is Phase.OPTIMIZER:
            self._note_sources(func, args, kwargs, flat, first_new)
        return out

    def _scratch(self, steps: cuda_scratch.Scratch | None, held: dict[str, int | None]) -> None:
        """Log a kernel's own allocations and frees (``memfit.tracing.cuda_scratch``) in the block running it."""
        if steps is not None and any(size for _, size in steps):
            self.scratch_kinds[steps.kind] = self.scratch_kinds.get(steps.kind, 0) + 1
        for name, size in steps or ():
            if size is None:
                sid = held.pop(name)
                if sid is not None:
                    self.free_untracked(sid)
            elif size != 0:  # a symbolic size may still come to 0 at some batch: ``SymbolicTrace.at`` drops it there
                held[name] = sid = self.allocate_untracked(size, Category.TEMPORARIES, in_block=True)
                self.scratch.add(sid)
            else:
                held[name] = None

    def _gradient_sum(self, func: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int] | None:
        """``(sum, old)`` storages when this op may be the autograd engine adding a second gradient for the same
        input to the first (``InputBuffer::accumulate``): a plain ``add`` of two same-shaped tensors in backward,
        without grad mode. The engine adds in place into the first when it holds its last reference, which a fake
        tensor never lets it do (``can_accumulate_inplace`` refuses tensor subclasses); ``_free`` sees whether the
        first dies right after and, if so, makes the sum the first's storage (``_sum_in_place``)."""
        if func is not _ADD or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return None
        if self.current_phase is not Phase.BACKWARD:
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(out, torch.Tensor)):
            return None
        same = old.dtype == out.dtype and old.dim() == out.dim() and old.is_contiguous()
        if not same or not all(guard_or_false(a == b) for a, b in zip(old.shape, out.shape, strict=True)):
            return None
        old_sid, sum_sid = self._ids.get(old.untyped_storage()), self._ids.get(out.untyped_storage())
        return None if old_sid is None or sum_sid is None else (sum_sid, old_sid)

    def _sum_in_place(self, sid: int) -> bool:
        """Whether freeing ``sid`` ends an in-place gradient accumulation (``_gradient_sum``); if so, the sum becomes
        ``sid``'s storage: its allocation leaves the log and ``sid`` lives on until the sum dies. The engine's
        ``old_var.add_(var)`` writes the sum into the first gradient's block and keeps that block, so no block is
        freed or allocated (a free then an allocation of the same size may land in another block: the caching
        allocator's best fit picks among equal free blocks by address).

        A log that records its repeated blocks (``memfit.tracing.depth`` builds deep logs from one block's) keeps
        every storage in the block that made it: there the first gradient's free is logged right before the sum's
        allocation instead, so that the two never hold memory at once, and the pair is noted (``sums_in_place``):
        ``fold_sums_in_place`` makes the log the engine's once it is built."""
        pending, self._accumulation = self._accumulation, None
        if pending is None or pending[1] != sid or not self.events or self.events[-1] != pending[0]:
            return False
        total = pending[0]
        if not _same_size(self.sizes[total], self.sizes[sid]):
            return False
        if self.event_blocks is not None:
            del self._live[sid]
            self._refs.pop(sid, None)
            self.events[-1] = -sid
            self.events.append(total)
            self.event_blocks.append(self.event_blocks[-1])
            self.sums_in_place[total] = sid
            return True
        ref = self._refs.get(total)
        storage = ref() if ref is not None else None
        if storage is None:
            return False
        self.events.pop()
        del self._live[total]
        del self._refs[total]  # its callback finds it no longer live
        self._ids[storage] = sid
        self._refs[sid] = weakref.ref(storage, lambda _ref, sid=sid: self._free(sid))
        if total in self.categories:
            self.categories[sid] = self.categories[total]
        return True

    def _note_sources(self, func: Any, args: Any, kwargs: Any, outputs: list[Any], first_new: int) -> None:
        """Which input each new storage of an optimizer step was made from: the i-th tensor of a ``_foreach_``
        op's first list for its i-th output, else the first input. A step's temporaries then belong to the
        block of the parameter they were computed for."""
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        foreach = func.overloadpacket.__name__.startswith("_foreach_") and lists
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        for index, item in enumerate(outputs):
            if not isinstance(item, torch.Tensor):
                continue
            sid = self._ids.get(item.untyped_storage())
            if sid is None or sid < first_new:
                continue
            source = lists[0][index] if foreach and index < len(lists[0]) else first
            source_sid = self._ids.get(source.untyped_storage()) if isinstance(source, torch.Tensor) else None
            if source_sid is not None and source_sid != sid:
                self.derived_from[sid] = source_sid

    def _maybe_allocate_workspace(self) -> None:
        # cuBLAS keeps one workspace per (handle, stream); the autograd engine runs backward on
        # its own device thread, which takes its own handle, so forward and backward each add one.
        phase = self.current_phase
        key = Phase.BACKWARD if phase is Phase.BACKWARD else Phase.FORWARD
        if key not in self._workspace_phases:
            self._workspace_phases.add(key)
            self.allocate_untracked(self.workspace_bytes, Category.WORKSPACE)


def fold_sums_in_place(recorder: StorageRecorder) -> StorageRecorder:
    """``recorder``'s log with each gradient sum it kept apart (``sums_in_place``: a free of the first gradient, then
    the sum's allocation) done in place, as the engine does and as a trace that records no blocks logs it: the two
    events leave the log and the first gradient's storage lives on as the sum. A copy; block attribution stays
    with the first gradient's storage."""
    sizes = recorder.sizes
    sums = {total: first for total, first in recorder.sums_in_place.items()
            if total in sizes and first in sizes and _same_size(sizes[total], sizes[first])}  # fmt: skip
    if not sums:
        return recorder
    events, blocks = recorder.events, recorder.event_blocks
    kept: list[int] = []
    kept_blocks: list[int | None] = []
    moved_to: list[int] = []  # new index of each old one, for the phase marks
    renamed: dict[int, int] = {}
    skip = False
    for index, event in enumerate(events):
        moved_to.append(len(kept))
        if skip:
            skip = False
            continue
        following = events[index + 1] if index + 1 < len(events) else 0
        if event < 0 and following > 0 and sums.get(following) == -event:
            renamed[following] = renamed.get(-event, -event)
            skip = True
            continue
        kept.append(-renamed.get(-event, -event) if event < 0 else event)
        if blocks is not None:
            kept_blocks.append(blocks[index])
    moved_to.append(len(kept))
    folded = copy.copy(recorder)
    folded.events = kept
    folded.event_blocks = kept_blocks if blocks is not None else None
    folded.marks = [PhaseMark(moved_to[m.event_index], m.step, m.phase) for m in recorder.marks]
    folded.categories = dict(recorder.categories)
    for total, first in renamed.items():
        if total in recorder.categories:  # the sum is the first's storage now: its category, not a storage of its own
            folded.categories[first] = folded.categories.pop(total)
    folded.sums_in_place = {}
    return folded


def _same_size(a: Any, b: Any) -> bool:
    """Whether two storage sizes are equal (under a symbolic batch, equal sizes may differ in form)."""
    difference = a - b
    return difference == 0 or (isinstance(difference, sympy.Basic) and difference.expand() == 0)
