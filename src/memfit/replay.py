"""Turn a storage log into peaks: per phase, allocated and reserved, with a breakdown by category."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.allocator import CachingAllocatorSimulator, round_size
from memfit.categories import Category, Phase
from memfit.recorder import PhaseMark, StorageRecorder

__all__ = ["PhasePeak", "TimelinePoint", "replay"]

MAX_TIMELINE_POINTS = 1500


@dataclass(frozen=True)
class PhasePeak:
    """The highest memory reached in one phase of one traced step.

    ``step`` 1 is the warm-up step (optimizer state appears during it), 2 the steady step.
    ``breakdown`` splits ``allocated_bytes`` by category at the moment of the peak.
    ``tensor_bytes`` is the peak of the storages' own sizes (rounded to 512 B on CUDA) without the
    allocator's whole-block handouts: it grows linearly with the batch, ``allocated_bytes`` nearly so.
    """

    step: int
    phase: Phase
    allocated_bytes: int
    reserved_bytes: int
    breakdown: dict[Category, int]
    tensor_bytes: int = 0


@dataclass(frozen=True)
class TimelinePoint:
    """Memory after one event of the traced steps: bytes per category (``Category`` order) and reserved."""

    event_index: int
    step: int
    phase: Phase
    category_bytes: tuple[int, ...]
    reserved_bytes: int


def replay(
    recorder: StorageRecorder, *, simulate_cuda_allocator: bool, timeline: list[TimelinePoint] | None = None
) -> list[PhasePeak]:
    """Replay the log in order; with ``simulate_cuda_allocator`` sizes are CUDA blocks and reserved
    comes from the caching-allocator simulation, else sizes are raw and reserved equals allocated.
    A ``timeline`` list receives up to ``MAX_TIMELINE_POINTS`` samples (peaks always included)."""
    allocator = CachingAllocatorSimulator() if simulate_cuda_allocator else None
    categories = recorder.categories
    sizes = recorder.sizes
    held: dict[int, int] = {}
    by_category: dict[Category, int] = dict.fromkeys(Category, 0)
    allocated = 0
    tensors = 0
    marks = recorder.marks
    boundaries = [mark.event_index for mark in marks[1:]] + [len(recorder.events)]
    peaks: list[PhasePeak] = []
    position = 0

    def apply(event: int) -> None:
        nonlocal allocated, tensors
        sid = abs(event)
        category = categories.get(sid, Category.TEMPORARIES)
        if event > 0:
            size = allocator.malloc(sid, sizes[sid]) if allocator else sizes[sid]
            held[sid] = size
            allocated += size
            tensors += round_size(sizes[sid]) if allocator else sizes[sid]
            by_category[category] += size
        else:
            size = held.pop(sid, None)
            if size is None:
                return
            if allocator:
                allocator.free(sid)
            allocated -= size
            tensors -= round_size(sizes[sid]) if allocator else sizes[sid]
            by_category[category] -= size

    events = recorder.events
    first = marks[0].event_index if marks else len(events)
    for event in events[:first]:  # parameters, buffers and inputs made before the first step
        apply(event)
    position = first
    every = max(1, (len(events) - first) // MAX_TIMELINE_POINTS)
    categories_order = list(Category)

    def sample(index: int, mark: PhaseMark) -> None:
        if timeline is not None:
            reserved = allocator.reserved_bytes if allocator else allocated
            snapshot = tuple(by_category[c] for c in categories_order)
            timeline.append(TimelinePoint(index, mark.step, mark.phase, snapshot, reserved))

    for mark, end in zip(marks, boundaries, strict=True):
        peak_allocated = allocated
        peak_tensors = tensors
        peak_reserved = allocator.reserved_bytes if allocator else allocated
        breakdown = dict(by_category)
        for index in range(position, end):
            apply(events[index])
            if allocated > peak_allocated:
                peak_allocated = allocated
                breakdown = dict(by_category)
                sample(index, mark)
            elif index % every == 0:
                sample(index, mark)
            peak_tensors = max(peak_tensors, tensors)
            if allocator:
                peak_reserved = max(peak_reserved, allocator.reserved_bytes)
        if not allocator:
            peak_reserved = peak_allocated
        peaks.append(PhasePeak(mark.step, mark.phase, peak_allocated, peak_reserved, breakdown, peak_tensors))
        position = end
    return peaks
