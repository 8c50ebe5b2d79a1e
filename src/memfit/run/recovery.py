"""Survive an out-of-memory error inside a training step without changing what is learned.

When a micro batch runs out of memory, memfit retries it split into chunks (``c, c, ..., rest``
samples). Each chunk's loss is weighted by its share of the batch, so for a loss that is a mean
over samples the chunks' gradients add up to the batch's own. The data loader keeps producing the
same batches, so the effective batch, the samples seen and the number of optimizer steps do not
change; the split stays for the rest of the run.

Where the error struck decides what is retried:

* in a chunk's **forward**: no gradient was touched; the rest of the batch is retried in smaller
  chunks (the chunks already done keep their gradients);
* in the middle of a **backward**: part of a gradient was added to some parameters. Gradients are
  cleared and every micro batch of the accumulation window so far is run again (memfit keeps the
  window's batches, which the loader has already moved to the device, until the optimizer step).

The chunk shrinks from the estimate (the largest batch whose predicted peak is ``2 x margin``
below the one that failed), then by halves; below one sample it turns on gradient checkpointing
once, if allowed, and starts again from the whole batch. When the error carries CUDA's figures
(what PyTorch had allocated, what it asked for, what was free), the estimate is scaled by how far
the step had already outgrown it and the chunk is chosen to fit what the device really had, if that
is smaller. If nothing is left to try, memfit raises ``UnrecoverableOutOfMemoryError`` (a
``torch.OutOfMemoryError``).

This module knows nothing of Lightning or Hugging Face: adapters hand ``run_batch`` a function
that runs one chunk's forward and backward and call ``backward_started`` between the two.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from memfit.devices import collective_device, registered_backends
from memfit.diagnostics import degrade
from memfit.errors import InvalidInputError, UnrecoverableOutOfMemoryError
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.prediction.curve import StepCurve
from memfit.tracing.batch import infer_batch_size
from memfit.units import parse_bytes

__all__ = [
    "LossReduction",
    "OOMRecovery",
    "OnOOM",
    "OutOfMemoryFigures",
    "Recovery",
    "batches_held",
    "chunk_runner",
    "is_out_of_memory",
    "out_of_memory_figures",
    "release_memory",
    "split_batch",
]

OnOOM = Literal["replan", "raise"]
LossReduction = Literal["mean", "sum"]
R = TypeVar("R")
ChunkRunner = Callable[[Any, float, bool], R]  # (chunk, loss weight, last chunk of the current batch?) -> result

OPTIMIZER_STEP_OOM = (
    "memfit: out of memory in the optimizer step, after forward and backward had finished. A smaller "
    "micro batch does not change that step's memory (parameters, gradients, optimizer state and the "
    "optimizer's temporaries), so memfit cannot recover from it: use an optimizer with less state or "
    "without foreach temporaries (foreach=False), a lower precision, or a device with more memory."
)
_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def check_on_oom(value: Any) -> OnOOM:
    if value not in ("replan", "raise"):
        raise InvalidInputError(f"`on_oom` must be 'replan' or 'raise', got {value!r}")
    return value


def batches_held(accumulation_steps: int, on_oom: str) -> int:
    """Batches the recovery keeps on the device besides the step's own: a window's earlier micro
    batches, to replay them after an error mid-backward (released after the window's optimizer step)."""
    return accumulation_steps - 1 if on_oom == "replan" else 0


def check_loss_reduction(value: Any) -> LossReduction:
    if value not in ("mean", "sum"):
        raise InvalidInputError(f"`loss_reduction` must be 'mean' or 'sum' over the batch, got {value!r}")
    return value


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a runtime error from a kernel or library that could not allocate."""
    if isinstance(error, UnrecoverableOutOfMemoryError):
        return False
    if any(backend.is_out_of_memory(error) for backend in registered_backends()):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_MESSAGES)


def release_memory() -> None:
    """Give what the failed step held back to the device: collect cycles, then empty the devices' caches (CUDA's)."""
    gc.collect()
    for backend in registered_backends():
        backend.release_cached_memory()


def split_batch(batch: Any, chunk_size: int, batch_size: int | None = None) -> list[tuple[Any, int]]:
    """``batch`` cut along dim 0 into chunks of ``chunk_size`` samples (the last may be smaller).

    Tensors (and lists of plain values) whose length is the batch size are cut; everything else is
    shared by all chunks. Returns ``(chunk, samples)`` pairs.
    """
    if chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be at least 1, got {chunk_size}")
    size = infer_batch_size(batch) if batch_size is None else batch_size
    return [(_slice(batch, size, start, min(start + chunk_size, size)), min(chunk_size, size - start))
            for start in range(0, size, chunk_size)]  # fmt: skip


def _slice(obj: Any, size: int, start: int, stop: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == size else obj
    if isinstance(obj, Mapping):
        items = {key: _slice(value, size, start, stop) for key, value in obj.items()}
        try:
            return type(obj)(items)
        except (TypeError, ValueError):  # a mapping type that cannot be built from a dict: a plain dict
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_slice(v, size, start, stop) for v in obj))
    if isinstance(obj, (list, tuple)):
        if len(obj) == size and all(isinstance(v, (str, int, float, bool, bytes)) for v in obj):
            return obj[start:stop]  # per-sample plain values (ids, texts)
        return type(obj)(_slice(v, size, start, stop) for v in obj)
    return obj


@dataclass(frozen=True)
class Recovery:
    """One recovery: where it happened, the chunk before and after, and what else was done."""

    step: int
    batch_size: int
    chunk_before: int
    chunk_after: int
    checkpointing_enabled: bool
    replayed_batches: int
    error: str

    def describe(self) -> str:
        samples = "sample" if self.chunk_after == 1 else "samples"
        action = f"each batch of {self.batch_size} now runs in chunks of at most {self.chunk_after} {samples}"
        if self.checkpointing_enabled:
            action += " with gradient checkpointing turned on"
        retried = "the failed batch was retried"
        if self.replayed_batches:
            retried = (
                f"the error struck mid-backward, so gradients were cleared and the {self.replayed_batches} earlier "
                f"micro batch(es) of the accumulation window were run again before retrying the failed batch"
            )
        return f"out of memory at step {self.step} ({self.error}); {action}; {retried}"

    def warning(self, *, accumulation: int, world_size: int, rank: int) -> str:
        """The one warning a recovery gives: what happened and the plan before and after."""
        size, chunk = self.batch_size, self.chunk_after
        sizes = [min(chunk, size - start) for start in range(0, size, chunk)]
        shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, ... ({len(sizes)} of them)"
        return (
            f"memfit (rank {rank}): {self.describe()}. Plan: micro batch {self.batch_size} x accumulation "
            f"{accumulation} -> each micro batch of {self.batch_size} in chunks of {shown} samples, x accumulation "
            f"{accumulation}; the effective batch stays {self.batch_size * accumulation * world_size}."
        )


_NO_CHUNK = 2**62  # what a rank that runs whole batches contributes to the all-reduce


class OOMRecovery:
    """Runs micro batches in chunks and shrinks the chunk after an out-of-memory error.

    Args:
        reset_gradients: clear every gradient (``model.zero_grad(set_to_none=True)``); called before
            replaying a window after an error mid-backward.
        on_oom: ``"replan"`` to recover, ``"raise"`` to let the error through untouched.
        traced: the run's step (``memfit.trace``); its batch curve picks the first smaller chunk (halving without).
        margin: the planner's margin; a new chunk must be predicted ``2 x margin`` below the failed one.
        enable_checkpointing: turns gradient checkpointing on (``None``: not possible for this model).
        checkpointing_on: whether it is on already.
        loss_reduction: ``"mean"`` weights chunk losses by their share of the batch, ``"sum"`` adds them.
        distributed: under data parallelism an error in a backward that synchronises gradients
            cannot be undone (other ranks already took part), so it is re-raised.
        on_recovery: called with each ``Recovery`` (to log it).
    """

    def __init__(
        self,
        *,
        reset_gradients: Callable[[], None],
        on_oom: OnOOM = "replan",
        traced: StepCurve | None = None,
        margin: float = DEFAULT_MARGIN,
        enable_checkpointing: Callable[[], None] | None = None,
        checkpointing_on: bool = False,
        loss_reduction: LossReduction = "mean",
        distributed: bool = False,
        on_recovery: Callable[[Recovery], None] | None = None,
    ) -> None:
        self.on_oom = check_on_oom(on_oom)
        self.loss_reduction = check_loss_reduction(loss_reduction)
        self.reset_gradients = reset_gradients
        self.traced = traced
        self.margin = margin
        self.enable_checkpointing = enable_checkpointing
        self.checkpointing_on = checkpointing_on
        self.distributed = distributed
        self.on_recovery = on_recovery
        self.chunk_size: int | None = None  # None: batches run whole
        self.recoveries: list[Recovery] = []
        self._warned: set[str] = set()  # keys this recovery has warned about
        self.window: list[tuple[Any, int, ChunkRunner]] = []
        self._in_backward = False

    # ------------------------------------------------------------ adapters
    def start_window(self) -> None:
        """A new accumulation window begins (gradients were just zeroed): forget the last one's batches."""
        self.window.clear()

    def end_window(self) -> None:
        """The window's optimizer step is done: its batches are no longer needed (release them before
        anything else, a validation pass included, runs)."""
        self.window.clear()

    def backward_started(self) -> None:
        """The current chunk's forward is done and its backward begins."""
        self._in_backward = True

    def adopt(self, chunk_size: int | None) -> bool:
        """Use ``chunk_size`` if it is smaller than the current one (agreement between ranks)."""
        if chunk_size is None or (self.chunk_size is not None and chunk_size >= self.chunk_size):
            return False
        self.chunk_size = chunk_size
        return True

    def agree_across_ranks(self) -> int | None:
        """Take the smallest chunk any rank had to fall back to (one small all-reduce); the new chunk
        size if this rank had to shrink, else ``None``. A no-op outside a process group."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return None
        device = collective_device(torch.distributed.get_backend())
        mine = torch.tensor([self.chunk_size or _NO_CHUNK], device=device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
        smallest = int(mine.item())
        return smallest if smallest < _NO_CHUNK and self.adopt(smallest) else None

    def run_batch(self, batch: Any, run_chunk: ChunkRunner, *, step: int, sync: bool = True) -> list[R]:
        """Run one micro batch as chunks through ``run_chunk(chunk, weight, last)`` and return their results.

        ``last`` is true for the last chunk of this batch only (never for replayed batches): under data
        parallelism that chunk goes through the wrapper that synchronises, the others run the bare
        module, so every rank makes one synchronising forward per batch. ``sync`` says whether this
        batch's backward synchronises gradients across ranks. On an out-of-memory error the chunk
        shrinks and the batch is retried as described in the module docstring; other errors pass through.
        """
        try:
            size = infer_batch_size(batch)
        except InvalidInputError:
            size = 0  # nothing to split: run whole, errors pass through
        self.window.append((batch, size, run_chunk))
        if size == 0 or self.on_oom == "raise":
            return [run_chunk(batch, 1.0, True)]
        done, results = 0, []
        replay: list[tuple[Any, int, ChunkRunner]] = []
        while True:
            sync_now = False
            try:
                for earlier, earlier_size, earlier_run in replay:
                    for chunk, samples, _ in self._chunks(earlier, earlier_size, 0):
                        self._in_backward = False
                        earlier_run(chunk, self._weight(samples, earlier_size), False)
                replay = []
                for chunk, samples, last in self._chunks(batch, size, done):
                    self._in_backward = False
                    sync_now = sync and last
                    results.append(run_chunk(chunk, self._weight(samples, size), last))
                    done += samples
                return results
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                tainted = self._in_backward or bool(replay)
                if tainted and sync_now and self.distributed:
                    raise UnrecoverableOutOfMemoryError(
                        f"out of memory while gradients were being synchronised across ranks ({_first_line(error)}); "
                        "the other ranks already took part in this backward, so it cannot be retried. Lower the "
                        "micro batch or turn on gradient checkpointing and resume from the last checkpoint."
                    ) from error
                failure, figures = _first_line(error), out_of_memory_figures(error)
            # Outside the except block the traceback, and the activations its frames hold, are gone.
            if tainted:
                self.reset_gradients()
                replay, done, results = list(self.window[:-1]), 0, []
            release_memory()
            self._shrink(size, failure, step, replayed=len(replay), figures=figures)

    # ------------------------------------------------------------- inside
    def _weight(self, samples: int, size: int) -> float:
        return samples / size if self.loss_reduction == "mean" else 1.0

    def _chunks(self, batch: Any, size: int, offset: int) -> Iterator[tuple[Any, int, bool]]:
        chunk = self.chunk_size
        if offset == 0 and (chunk is None or chunk >= size):
            yield batch, size, True
            return
        rest = size - offset
        pieces = split_batch(_slice(batch, size, offset, size), chunk or rest, rest)
        for index, (piece, samples) in enumerate(pieces):
            yield piece, samples, index == len(pieces) - 1

    def _shrink(self, size: int, failure: str, step: int, *, replayed: int,
                figures: OutOfMemoryFigures | None = None) -> None:  # fmt: skip
        before = min(self.chunk_size or size, size)
        after = self._smaller_chunk(before, figures)
        enabled = False
        if after < 1:
            if self.enable_checkpointing is None or self.checkpointing_on:
                reason = "with checkpointing" if self.checkpointing_on else "and checkpointing is not available"
                raise UnrecoverableOutOfMemoryError(
                    f"out of memory at step {step} even with chunks of 1 sample {reason} ({failure}). The model, "
                    "its gradients and optimizer state alone do not fit: use a device with more memory, a smaller "
                    "model, lower precision or an optimizer with less state."
                )
            self.enable_checkpointing()
            self.checkpointing_on = enabled = True
            after = size
        self.chunk_size = after
        record = Recovery(step, size, before, after, enabled, replayed, failure)
        self.recoveries.append(record)
        if self.on_recovery is not None:
            try:
                self.on_recovery(record)
            except Exception as error:  # reporting a recovery must not undo it
                degrade(f"memfit could not report a recovery ({type(error).__name__}: {error})", error,
                        key="report-recovery", seen=self._warned, all_ranks=True)  # fmt: skip

    def _smaller_chunk(self, before: int, figures: OutOfMemoryFigures | None = None) -> int:
        """From the estimate the first time (a peak ``2 x margin`` lower), by halves afterwards; smaller still
        if the error's own figures show that the step needs more than the estimate said."""
        traced = self.traced
        if traced is None or before <= 1:
            return before // 2

        def largest(below: int, fits: Callable[[int], bool], otherwise: int) -> int:
            return next((b for b in range(below, 0, -1) if fits(b)), otherwise)

        try:
            after = before // 2
            if not self.recoveries:
                limit = traced.at(before).reserved_bytes * (1 - 2 * self.margin)
                after = largest(before - 1, lambda b: traced.at(b).reserved_bytes <= limit, after)
            if figures is not None:
                scale = max(1.0, figures.needed_bytes / max(1, traced.at(before).allocated_bytes))
                room = figures.room_bytes * (1 - self.margin)
                after = largest(min(after, before - 1), lambda b: scale * traced.at(b).reserved_bytes <= room, 0)
        except Exception as error:  # a step that cannot answer falls back to halving
            degrade(f"memfit's estimate could not size the next chunk ({type(error).__name__}: {error}); halving it",
                    error, key="estimate-chunk", seen=self._warned, all_ranks=True)  # fmt: skip
            return before // 2
        return after


@dataclass(frozen=True)
class OutOfMemoryFigures:
    """What CUDA's caching allocator says when it fails: the request and the device's state at that moment."""

    requested_bytes: int
    total_bytes: int
    free_bytes: int
    allocated_bytes: int  # by PyTorch, when the request failed
    reserved_unallocated_bytes: int  # cached by PyTorch but not handed out

    @property
    def needed_bytes(self) -> int:
        """A lower bound of the step's allocated peak: it got this far and asked for more."""
        return self.allocated_bytes + self.requested_bytes

    @property
    def room_bytes(self) -> int:
        """What PyTorch could have handed out: its own cache plus the device's free memory."""
        return self.allocated_bytes + self.reserved_unallocated_bytes + self.free_bytes


_SIZE = r"([0-9.]+ (?:bytes|KiB|MiB|GiB|TiB))"
_FIGURES = re.compile(
    rf"Tried to allocate {_SIZE}\. GPU \S+ has a total capacity of {_SIZE} of which {_SIZE} is free\..*?"
    rf"Of the allocated memory {_SIZE} is allocated by PyTorch, and {_SIZE} is reserved by PyTorch but unallocated",
    re.DOTALL,
)


def out_of_memory_figures(error: BaseException) -> OutOfMemoryFigures | None:
    """The figures in a CUDA out-of-memory message (PyTorch 2.1 and later), ``None`` if it has none."""
    match = _FIGURES.search(str(error))
    if match is None:
        return None
    requested, total, free, allocated, unallocated = (parse_bytes(size) for size in match.groups())
    return OutOfMemoryFigures(requested, total, free, allocated, unallocated)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def chunk_runner(
    wrapper: Any,
    through_wrapper: Callable[[Any, float], R],
    bare: Callable[[Any, float], R],
) -> Callable[[Any, float, bool], R]:
    """``run_chunk(chunk, weight, last)`` for ``OOMRecovery.run_batch``: the last chunk of a batch goes through
    the data-parallel ``wrapper`` (its gradient all-reduce, once per batch on every rank), the others through
    the bare module (no collective this rank alone would start). A batch retried after an out-of-memory error
    goes through the wrapper a second time: DDP must not broadcast its buffers again then, as the failed
    attempt already did."""
    forwarded = False

    def run_chunk(chunk: Any, weight: float, last: bool) -> R:
        nonlocal forwarded
        if not last:
            return bare(chunk, weight)
        if forwarded and hasattr(wrapper, "require_forward_param_sync"):
            wrapper.require_forward_param_sync = False
        forwarded = True
        return through_wrapper(chunk, weight)

    return run_chunk
