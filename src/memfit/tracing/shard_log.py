"""One rank's storage log, rewritten from the traced single-process step.

A sharded run computes the same forward and backward as one process does; what differs is which
bytes a rank holds. A ``RankPlan`` says it in three ways: a resize of each traced storage by its
category (a parameter becomes its shard, a gradient its partition, a state tensor its slice), buffers
the sharded runtime adds at phase boundaries (gathered parameters in forward and backward, bucket
buffers, fp32 master weights), and, for FSDP, a ``UnitSchedule``: each block's parameters gathered
while it runs and each unit's gradients whole until its reduce-scatter, placed by the gradients' births.
``apply_rank_plan`` writes the rewritten log; the allocator replay then runs on it unchanged, so
fragmentation and the per-phase fit in the batch come out as for any other trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from memfit.categories import Category, Phase
from memfit.tracing.recorder import PhaseMark, StorageRecorder

__all__ = ["Buffer", "RankPlan", "UnitSchedule", "apply_rank_plan", "shard_bytes"]

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
class UnitSchedule:
    """FSDP's units as one rank runs them: each block's parameters gathered while it runs, each unit's gradients
    reduce-scattered when its backward is done (FSDP2's ``FSDPParamGroup`` ``pre_forward``, ``post_forward``,
    ``pre_backward``, ``post_backward`` and ``foreach_reduce``; FSDP1's handles and post-backward hooks).

    Where the log says when things happen. The trace records which of the model's repeated blocks runs at each event
    (``TraceSettings.record_blocks``, ``StorageRecorder.event_blocks``; a log built deeper by
    ``memfit.tracing.depth`` keeps it), and gives birth to each gradient where autograd computes it: a gradient born
    while block ``b`` runs is unit ``b - 1``'s, one born outside every block the root's (``root``). A block's
    post-backward runs when the gradient reaches its inputs, right after its last parameter gradient is born; the
    root's, whose inputs (token ids) need no gradient, at the end of backward. The last block's backward starts at
    the first event of backward that a block runs; the last block's forward ends where the first tensor the root's
    tail (final norm, output projection, loss) saves for its backward is born: the earliest-born storage of the
    forward that backward frees before any block runs.

    Gathered parameters (``SHARDING_BUFFERS``): the root's (``root_bytes``) from the start of forward to the end
    of backward (FSDP keeps the root unsharded after forward); two blocks' (``unit_bytes``, the largest) while
    blocks run forward (the one running and the previous one's all-gather output, kept until the next copy-out
    for overlap), one after the last block's forward (its all-gather output, released when the root's forward
    returns, which for a model that computes its loss is after the loss); in backward one block's from its
    start (the root's pre-backward prefetches the last block), two from the last block's backward (the one
    running and the next one prefetched) until the second-to-last block in backward order is reduced, then one
    until the first block is reduced.

    Gradients: a unit's stay whole, as traced, until its post-backward. There, in order: the previous unit's
    reduce-scatter input is released (FSDP2 keeps one in flight), this unit's is allocated (``input_bytes``:
    its trainable elements padded to the shard group, in the reduce dtype), the whole gradients are freed, and
    the reduce-scatter output (``output_bytes``, a ``1/G`` flat tensor in the reduce dtype) is the unit's
    sharded gradients, which stay until the traced gradients would have been freed; with ``cast`` (a 16-bit
    ``param_dtype`` over fp32 shards, or gradients offloaded) it is cast or copied to them (``sharded_bytes``, 0
    when they go to the host) and goes. The last reduce-scatter input is released at the end of backward.

    A backward in which no gradient is born, its gradients kept from an earlier step (accumulation, ``zero_grad``
    in place), allocates what the earlier one did, one storage for one, size for size: autograd's fresh gradient
    is born where the earlier backward gave birth to the kept one, and FSDP keeps it whole to the unit's
    post-backward, where the reduce-scatter output (and its cast) is added into the kept sharded gradients and
    goes. Where the two do not align, the backward holds the root's and two blocks' gathered parameters and
    ``fallback_bytes`` (a unit's whole gradients and a reduce-scatter input) from its start to its end, and its
    forward two blocks' to the end.
    """

    root: int
    input_bytes: Mapping[int, int]
    output_bytes: Mapping[int, int]
    sharded_bytes: Mapping[int, int]
    cast: bool = False
    root_bytes: int = 0
    unit_bytes: int = 0
    fallback_bytes: int = 0


@dataclass(frozen=True)
class RankPlan:
    """How one rank's step differs from the traced one.

    ``resize`` maps a category to the new size of each of its storages (absent: unchanged; 0: not on the
    device). ``step_temporaries`` resizes the temporaries the optimizer step allocates: each rank steps only its
    own shard (FSDP's local shards, ZeRO's partition), so a ``foreach`` optimizer's temporaries shrink with
    the state. ``units``: FSDP's gathered parameters and gradients, unit by unit (``UnitSchedule``); the
    gradients it places are not resized (those of a log that does not say whose gradient a storage is are).
    ``terms`` are the documented per-rank model-state terms, in bytes (reports and tests read them);
    ``host_bytes`` is what one rank keeps in host RAM (offloaded states, pinned buffers).
    """

    strategy: str
    world_size: int
    resize: Mapping[Category, Resize] = field(default_factory=dict)
    buffers: tuple[Buffer, ...] = ()
    step_temporaries: Resize | None = None
    units: UnitSchedule | None = None
    terms: Mapping[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    notes: tuple[str, ...] = ()
    # trainable parameters stored in another dtype than the frozen ones (fp32 LoRA adapters on a 16-bit base):
    # that many parameter storages of each traced size take this resize instead of ``resize``'s (parameters live
    # through the whole step, so which storages of one size they are does not change any moment's bytes)
    trainable_parameter_sizes: Mapping[int, int] = field(default_factory=dict)
    resize_trainable_parameters: Resize | None = None


def apply_rank_plan(recorder: StorageRecorder, plan: RankPlan) -> StorageRecorder:
    """A new log: ``recorder``'s with every storage resized by ``plan``, FSDP's units scheduled (``plan.units``)
    and its buffers inserted at the phase marks. ``recorder`` is left as it was (the same
    trace may serve other ranks or plans)."""
    log = _Insertions(recorder)
    reduced = _schedule_units(recorder, plan.units, log) if plan.units is not None else set()
    sizes = log.sizes
    trainable_left = dict(plan.trainable_parameter_sizes) if plan.resize_trainable_parameters is not None else {}
    for sid in recorder.sizes:
        category = recorder.categories.get(sid, Category.TEMPORARIES)  # uncategorized: temporaries, as replayed
        resize = plan.resize.get(category)
        if sid in reduced:
            continue
        if category is Category.PARAMETERS and trainable_left.get(sizes[sid], 0) > 0:
            trainable_left[sizes[sid]] -= 1
            resize = plan.resize_trainable_parameters
        if resize is not None:
            sizes[sid] = max(0, int(resize(sizes[sid])))
        elif (
            plan.step_temporaries is not None
            and category is Category.TEMPORARIES
            and recorder.alloc_phase.get(sid, -1) >= 0
            and recorder.marks[recorder.alloc_phase[sid]].phase is Phase.OPTIMIZER
        ):
            sizes[sid] = max(0, int(plan.step_temporaries(sizes[sid])))
    dropped = {sid for sid in recorder.sizes if sizes[sid] == 0 and recorder.sizes[sid] > 0}
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
            sid = log.new(buffer.size_bytes, Category.SHARDING_BUFFERS, number)
            log.put(at, sid, _ALLOCATE)
            if buffer.persistent:
                continue
            end = next(
                (m.event_index for m in marks[number + 1 :] if m.step == mark.step and m.phase is buffer.end), None
            )
            log.put(end if end is not None and buffer.end is not None else ends[mark.step], -sid, _RELEASE)
    events, moved_to = log.merged(recorder.events, {*dropped, *(-sid for sid in dropped | log.moved_frees)},
                                  [m.event_index for m in marks])  # fmt: skip
    rewritten = StorageRecorder(
        workspace_bytes=recorder.workspace_bytes,
        cuda_target=recorder.cuda_target,
    )
    rewritten.events = events
    rewritten.sizes = sizes
    rewritten.scratch = recorder.scratch & set(sizes)
    rewritten.categories = log.categories
    rewritten.alloc_phase = log.alloc_phase
    # a mark points at the first event of its phase: the buffers allocated there belong to it
    rewritten.marks = [PhaseMark(moved_to[m.event_index] - log.after_mark(m.event_index), m.step, m.phase)
                       for m in marks]  # fmt: skip
    rewritten.ops = recorder.ops
    rewritten.close()
    return rewritten


# order of the events inserted at one index of the log: a buffer's release ends the phase before the mark (and
# a unit is resharded before it is reduced), the reductions of the backward then run (before the mark too: the
# root's ends the backward), and the buffers a phase allocates at its start come after the mark
_RELEASE, _REDUCE, _ALLOCATE = 0, 1, 2


class _Insertions:
    """Events to insert into a log, by the index of the traced event they go in front of, and the new storages."""

    def __init__(self, recorder: StorageRecorder) -> None:
        self.sizes = dict(recorder.sizes)
        self.categories = dict(recorder.categories)
        self.alloc_phase = dict(recorder.alloc_phase)
        self.moved_frees: set[int] = set()  # traced storages freed elsewhere than the trace frees them
        self._next_id = max(self.sizes, default=0) + 1
        self._at: dict[int, list[tuple[int, int, int]]] = {}

    def new(self, size: int, category: Category, phase_number: int) -> int:
        sid = self._next_id
        self._next_id += 1
        self.sizes[sid] = size
        self.categories[sid] = category
        self.alloc_phase[sid] = phase_number
        return sid

    def put(self, index: int, event: int, kind: int) -> None:
        queue = self._at.setdefault(index, [])
        queue.append((kind, len(queue), event))

    def events_at(self, index: int) -> list[int]:
        return [event for _, _, event in sorted(self._at.get(index, ()))]

    def merged(self, traced: list[int], removed: set[int], wanted: list[int]) -> tuple[list[int], dict[int, int]]:
        """The log: ``traced``'s events but ``removed`` with these inserted in front of theirs; and where, for each
        index of ``wanted``, the traced event there (or the end) lands once its insertions are in."""
        events: list[int] = []
        landed: dict[int, int] = {}
        done = 0  # traced events copied so far
        for index in sorted({*self._at, *wanted}):
            chunk = traced[done:index]
            events.extend([event for event in chunk if event not in removed] if removed else chunk)
            done = max(done, index)
            events.extend(self.events_at(index))
            landed[index] = len(events)
        chunk = traced[done:]
        events.extend([event for event in chunk if event not in removed] if removed else chunk)
        return events, landed

    def after_mark(self, index: int) -> int:
        return sum(1 for kind, _, _ in self._at.get(index, ()) if kind == _ALLOCATE)


def _schedule_units(recorder: StorageRecorder, units: UnitSchedule, log: _Insertions) -> set[int]:
    """Place each step's gathered parameters and reduce-scatters (``UnitSchedule``); the gradient storages
    placed."""
    placed: set[int] = set()
    marks = recorder.marks
    events, running = recorder.events, recorder.event_blocks
    born_at = {event: i for i, event in enumerate(events) if event > 0}
    free_at = {-event: i for i, event in enumerate(events) if event < 0}

    def hold(size: int, start: int, end: int, phase_number: int) -> None:
        if size > 0 and end > start:
            sid = log.new(size, Category.SHARDING_BUFFERS, phase_number)
            log.put(start, sid, _ALLOCATE)
            log.put(end, -sid, _RELEASE)

    template: tuple[list[int], dict[int, list[tuple[int, int]]]] | None = None  # the last backward placed by births
    for number, mark in enumerate(marks):
        if mark.phase is not Phase.BACKWARD:
            continue
        forward = next((n for n in range(number - 1, -1, -1) if marks[n].step == mark.step
                        and marks[n].phase is Phase.FORWARD), None)  # fmt: skip
        start = marks[forward].event_index if forward is not None else mark.event_index
        end = marks[number + 1].event_index if number + 1 < len(marks) else len(events)
        # what the step allocates (not the cuBLAS workspace its first backward adds)
        allocations = [i for i in range(mark.event_index, end)
                       if events[i] > 0 and recorder.categories.get(events[i]) is not Category.WORKSPACE]  # fmt: skip
        born: dict[int, list[tuple[int, int]]] = {}  # unit -> (index, gradient storage) born in this backward
        for index in allocations if running is not None else ():
            if recorder.categories.get(events[index]) is Category.GRADIENTS:
                block = running[index]
                born.setdefault(units.root if block is None else block - 1, []).append((index, events[index]))
        kept = not born and template is not None and _aligned(recorder, template[0], allocations)
        if born:
            template = allocations, born
        elif kept and template is not None:
            # the gradients exist already (accumulation, zero_grad in place): autograd's fresh gradient is born
            # where the earlier backward gave birth to it and added into the kept one; FSDP keeps it whole
            position = {index: k for k, index in enumerate(template[0])}
            born = {u: [(allocations[position[i]], events[allocations[position[i]]]) for i, _ in births]
                    for u, births in template[1].items()}  # fmt: skip
        blocks = sorted((u for u in born if u != units.root), key=lambda u: born[u][-1][0])
        backward_start = next((i for i in range(mark.event_index, end) if running is not None
                               and running[i] is not None), mark.event_index)  # fmt: skip
        # the last block's forward ends with the first tensor the root's tail saves for its backward
        saved = [born_at[sid] for sid, i in free_at.items() if mark.event_index <= i < backward_start
                 and start <= born_at.get(sid, -1) < mark.event_index]  # fmt: skip
        forward_end = min(saved) if saved and blocks else mark.event_index
        hold(units.root_bytes, start, end, forward if forward is not None else number)
        hold(units.unit_bytes, start, mark.event_index, forward if forward is not None else number)
        hold(units.unit_bytes, start, forward_end, forward if forward is not None else number)
        if not blocks:  # nothing says where the blocks run backward
            hold(2 * units.unit_bytes, mark.event_index, end, number)
            if not born:
                hold(units.fallback_bytes, mark.event_index, end, number)
                continue
        else:
            ends = [born[u][-1][0] + 1 for u in blocks]
            hold(units.unit_bytes, mark.event_index, ends[-1], number)
            hold(units.unit_bytes, backward_start, ends[-2] if len(ends) > 1 else backward_start, number)
        # post-backward: after the unit's last gradient is born, or at the end of backward
        previous = None
        for unit in [*blocks, *(u for u in born if u == units.root)]:
            at = end if unit == units.root else born[unit][-1][0] + 1
            if previous is not None:
                log.put(at, -previous, _REDUCE)
                previous = None
            if units.input_bytes.get(unit, 0) > 0:
                previous = log.new(units.input_bytes[unit], Category.SHARDING_BUFFERS, number)
                log.put(at, previous, _REDUCE)
            for _, sid in born[unit]:
                log.put(at, -sid, _REDUCE)
                log.moved_frees.add(sid)
                placed.add(sid)
            _reduce(units, unit, at, number, kept, [free_at.get(sid) for _, sid in born[unit]], log)
        if previous is not None:
            log.put(end, -previous, _REDUCE)
    return placed


def _aligned(recorder: StorageRecorder, earlier: list[int], allocations: list[int]) -> bool:
    """Whether a backward allocates what an earlier one did, one storage for one, size for size (the same
    graph run again), so the earlier one's births place this one's."""
    sizes, events = recorder.sizes, recorder.events
    return len(earlier) == len(allocations) and all(
        sizes[events[a]] == sizes[events[b]] for a, b in zip(earlier, allocations, strict=True)
    )


def _reduce(
    units: UnitSchedule, unit: int, at: int, number: int, kept: bool, frees: list[int | None], log: _Insertions
) -> None:
    """A unit's reduce-scatter output at ``at``: its sharded gradients from there to the gradients' last free
    (``frees``), or, where they are ``kept`` from an earlier step, added into them and gone."""
    output, shard = units.output_bytes.get(unit, 0), units.sharded_bytes.get(unit, 0)
    if output <= 0:
        return
    if not units.cast and not kept and shard:  # the output is the sharded gradients
        out = log.new(output, Category.GRADIENTS, number)
        log.put(at, out, _REDUCE)
        if all(index is not None for index in frees):
            log.put(max(frees), -out, _RELEASE)  # type: ignore[type-var]
        return
    out = log.new(output, Category.SHARDING_BUFFERS, number)
    log.put(at, out, _REDUCE)
    if shard and (units.cast or not kept):
        held = log.new(shard, Category.GRADIENTS if not kept else Category.SHARDING_BUFFERS, number)
        log.put(at, held, _REDUCE)
        if kept:  # the cast, added into the kept sharded gradients
            log.put(at, -held, _REDUCE)
        elif all(index is not None for index in frees):
            log.put(max(frees), -held, _RELEASE)  # type: ignore[type-var]
    log.put(at, -out, _REDUCE)


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
    ``persistent_numel``: elements of parameters at or under ZeRO-3's persistence threshold; ``trainable``: the
    unit (an index into ``units``; ``len(units)`` for the root) and shape of each trainable parameter;
    ``stored_element_bytes``: bytes of an element as the run
    stores it where the trace computes on other copies (FSDP's fp32 shards under a 16-bit ``param_dtype``), and
    ``trainable_stored_element_bytes`` the same of the trainable parameters alone.
    """

    numel: int
    trainable_numel: int
    element_bytes: int
    units: tuple[Unit, ...]
    root: Unit
    largest_module_numel: int
    parameter_numels: tuple[int, ...] = ()
    trainable: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (unit, shape) of each trainable parameter
    stored_element_bytes: int = 0  # bytes of a parameter element as the run keeps it; 0: as traced
    # the same for the trainable parameters (LoRA keeps fp32 adapters on a 16-bit base): their gradients and
    # optimizer state are stored in it; 0: ``stored_bytes``
    trainable_stored_element_bytes: int = 0
    # bytes of a trainable parameter's element in the trace (FSDP's ``param_dtype`` where it casts them, else their
    # own dtype); 0: ``element_bytes``
    trainable_element_bytes: int = 0

    @property
    def stored_bytes(self) -> int:
        return self.stored_element_bytes or self.element_bytes

    @property
    def trainable_stored_bytes(self) -> int:
        return self.trainable_stored_element_bytes or self.stored_bytes

    @property
    def trainable_traced_bytes(self) -> int:
        return self.trainable_element_bytes or self.element_bytes

    def trainable_storage_sizes(self) -> dict[int, int]:
        """How many trainable parameter storages of each traced size (bytes) the trace holds."""
        sizes: dict[int, int] = {}
        for _, shape in self.trainable:
            size = math.prod(shape) * self.trainable_traced_bytes
            sizes[size] = sizes.get(size, 0) + 1
        return sizes

    def persistent_numel(self, threshold: int) -> int:
        return sum(n for n in self.parameter_numels if n <= threshold)
