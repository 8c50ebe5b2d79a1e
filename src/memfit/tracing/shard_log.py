"""One rank's storage log, rewritten from the traced single-process step.

A sharded run computes the same forward and backward as one process does; what differs is which
bytes a rank holds. A ``RankPlan`` says it in two ways: a resize of each traced storage by its
category (a parameter becomes its shard, a gradient its partition, a state tensor its slice), and
buffers the sharded runtime adds at phase boundaries (gathered parameters in forward and backward,
reduce-scatter and bucket buffers, fp32 master weights). ``apply_rank_plan`` writes the rewritten log;
the allocator replay then runs on it unchanged, so fragmentation and the per-phase fit in the batch
come out as for any other trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from memfit.categories import Category, Phase
from memfit.tracing.recorder import PhaseMark, StorageRecorder

__all__ = ["Buffer", "RankPlan", "apply_rank_plan", "shard_bytes"]

Resize = Callable[[int], int]


def shard_bytes(size_bytes: int, ranks: int, element_bytes: int = 4) -> int:
    """One rank's share of ``size_bytes`` split ``ranks`` ways, padded to whole elements as FSDP and ZeRO pad
    (every rank holds the same number of elements)."""
    if ranks <= 1 or size_bytes <= 0:
        return size_bytes
    elements = math.ceil(size_bytes / element_bytes)
    return math.ceil(elements / ranks) * element_bytes


@dataclass(frozen=True)
class Buffer:
    """Memory the sharded runtime allocates that no traced tensor owns.

    ``start``: the phase at whose start it is allocated; ``end``: the phase of the same step at whose start
    it is freed (``None``: at the end of the step). ``persistent``: allocated once, at ``start`` of the first
    step, and kept (DeepSpeed's fp32 master weights and reduce buckets). ``after``: allocated at the first
    storage of that category born in the phase instead of at its start (FSDP's reduce-scatter buffers appear
    with the first unit's gradients, once that unit's activations are freed, not at the start of backward).
    """

    what: str
    size_bytes: int
    start: Phase
    end: Phase | None = None
    persistent: bool = False
    after: Category | None = None


@dataclass(frozen=True)
class RankPlan:
    """How one rank's step differs from the traced one.

    ``resize`` maps a category to the new size of each of its storages (absent: unchanged; 0: not on the
    device). ``step_temporaries`` resizes the temporaries the optimizer step allocates: each rank steps only its
    own shard (FSDP's local shards, ZeRO's partition), so a ``foreach`` optimizer's temporaries shrink with
    the state. ``terms`` are the documented per-rank model-state terms, in bytes (reports and tests read
    them); ``host_bytes`` is what one rank keeps in host RAM (offloaded states, pinned buffers).
    """

    strategy: str
    world_size: int
    resize: Mapping[Category, Resize] = field(default_factory=dict)
    buffers: tuple[Buffer, ...] = ()
    step_temporaries: Resize | None = None
    terms: Mapping[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    notes: tuple[str, ...] = ()

    def buffer_bytes(self, what: str) -> int:
        return sum(b.size_bytes for b in self.buffers if b.what == what)


def apply_rank_plan(recorder: StorageRecorder, plan: RankPlan) -> StorageRecorder:
    """A new log: ``recorder``'s with every storage resized by ``plan`` and its buffers inserted at the
    phase marks. ``recorder`` is left as it was (the same trace may serve other ranks or plans)."""
    sizes = dict(recorder.sizes)
    for sid, category in recorder.categories.items():
        resize = plan.resize.get(category)
        if resize is not None:
            sizes[sid] = max(0, int(resize(sizes[sid])))
        elif (
            plan.step_temporaries is not None
            and category is Category.TEMPORARIES
            and recorder.alloc_phase.get(sid, -1) >= 0
            and recorder.marks[recorder.alloc_phase[sid]].phase is Phase.OPTIMIZER
        ):
            sizes[sid] = max(0, int(plan.step_temporaries(sizes[sid])))
    dropped = {sid for sid, size in sizes.items() if size == 0 and recorder.sizes.get(sid, 0) > 0}
    next_id = max(sizes, default=0) + 1
    categories = dict(recorder.categories)
    alloc_phase = dict(recorder.alloc_phase)
    # (event index, order) -> inserted events; frees sort before allocations at the same index
    inserted: dict[int, list[tuple[int, int]]] = {}
    marks = recorder.marks
    ends = _step_ends(marks, len(recorder.events))
    for buffer in plan.buffers:
        if buffer.size_bytes <= 0:
            continue
        for number, mark in enumerate(marks):
            if mark.phase is not buffer.start or (buffer.persistent and mark.step != marks[0].step):
                continue
            phase_end = marks[number + 1].event_index if number + 1 < len(marks) else len(recorder.events)
            at = mark.event_index
            if buffer.after is not None:
                at = next(
                    (i for i in range(at, phase_end) if recorder.events[i] > 0
                     and recorder.categories.get(recorder.events[i]) is buffer.after),
                    phase_end,
                )  # fmt: skip
            sid = next_id
            next_id += 1
            sizes[sid] = buffer.size_bytes
            categories[sid] = Category.SHARDING_BUFFERS
            alloc_phase[sid] = number
            inserted.setdefault(at, []).append((1, sid))
            if buffer.persistent:
                continue
            end = next(
                (m.event_index for m in marks[number + 1 :] if m.step == mark.step and m.phase is buffer.end), None
            )
            free_at = end if end is not None and buffer.end is not None else ends[mark.step]
            inserted.setdefault(free_at, []).append((0, -sid))
    events: list[int] = []
    moved_to: list[int] = []
    for index in range(len(recorder.events) + 1):
        for _, event in sorted(inserted.get(index, ()), key=lambda item: item[0]):
            events.append(event)
        moved_to.append(len(events))
        if index < len(recorder.events):
            event = recorder.events[index]
            if abs(event) not in dropped:
                events.append(event)
    rewritten = StorageRecorder(workspace_bytes=recorder.workspace_bytes)
    rewritten.events = events
    rewritten.sizes = sizes
    rewritten.categories = categories
    rewritten.alloc_phase = alloc_phase
    # a mark points at the first event of its phase: the buffers allocated there belong to it
    rewritten.marks = [PhaseMark(_first_of(moved_to, m.event_index, inserted), m.step, m.phase) for m in marks]
    rewritten.ops = recorder.ops
    rewritten.close()
    return rewritten


def _first_of(moved_to: list[int], index: int, inserted: dict[int, list[tuple[int, int]]]) -> int:
    """New position of old event ``index``, before the events inserted in front of it."""
    return moved_to[index] - len(inserted.get(index, ()))


def _step_ends(marks: list[PhaseMark], total: int) -> dict[int, int]:
    """Event index where each step ends: the next step's first mark, or the end of the log."""
    ends: dict[int, int] = {}
    for number, mark in enumerate(marks):
        later = next((m.event_index for m in marks[number + 1 :] if m.step != mark.step), total)
        ends[mark.step] = later
    return ends


@dataclass(frozen=True)
class Unit:
    """A group of parameters gathered together (an FSDP unit): its elements, and those that train."""

    name: str
    numel: int
    trainable_numel: int


@dataclass(frozen=True)
class ModelFacts:
    """What the sharding models read of the model, as the trace holds it.

    ``element_bytes``: bytes of a parameter element as traced (2 under ``*-true`` half precision);
    ``units``: the repeated blocks (FSDP units, in order); ``root``: the parameters outside them;
    ``largest_module_numel``: the most parameters one module holds directly (DeepSpeed's "largest layer");
    ``persistent_numel``: elements of parameters at or under ZeRO-3's persistence threshold.
    """

    numel: int
    trainable_numel: int
    element_bytes: int
    units: tuple[Unit, ...]
    root: Unit
    largest_module_numel: int
    parameter_numels: tuple[int, ...] = ()

    @property
    def frozen_numel(self) -> int:
        return self.numel - self.trainable_numel

    def persistent_numel(self, threshold: int) -> int:
        return sum(n for n in self.parameter_numels if n <= threshold)
