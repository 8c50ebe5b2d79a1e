"""The storage log of a model many blocks deep, built from traces of the same model a few blocks deep.

A deep model repeats one block: what its step allocates and frees in one block's forward, backward and
optimizer step is what every other block's does, only at another place in the log. So the log of a model
``N`` blocks deep is the log of the same model ``d`` blocks deep with ``N - d`` copies of one inner block's
events inserted where that block's events are (``deepen``), each copy speaking of its own storages and of its
neighbours' as the original speaks of its own (a block's backward frees the gradient the block after it made).
Tracing two blocks instead of eighty, the replay of that log is what a trace of the whole model gives.

The traces record which block each event happened in (``TraceSettings.record_blocks``,
``memfit.tracing.blocks``). An event belongs to the block running when it happened, or, outside every block
(the optimizer step, ``zero_grad``), to the block of the storage it allocates or frees. A maximal run of one
block's events is that block's share of one stretch of the step; the copies of the template block's runs go
after it where blocks run in ascending order (forward, the optimizer step) and before it where they run in
descending order (backward). A storage is named in a copy by its block, relative to the run's, and its role,
its place among its block's storages allocated in the same phase, in the order they were allocated.

Nothing here assumes that the model's blocks are alike: ``deepen`` first builds the log one block deeper than
a shallow trace and requires it to equal, event for event, a trace one block deeper; only then does it build
the deep one. A model whose blocks differ (alternating layer types, a first block of its own kind)
fails that check and is traced whole instead.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from memfit.tracing.blocks import storage_blocks
from memfit.tracing.paged import PagedState
from memfit.tracing.recorder import PhaseMark, StorageRecorder, fold_sums_in_place
from memfit.tracing.symbolic import SymbolicTrace
from memfit.tracing.tracer import StepTrace

__all__ = ["TEMPLATE_BLOCK", "DepthMismatch", "deepen", "deepen_symbolic", "log_difference"]

# The block whose events are repeated: the first inner block (a block with blocks on both sides of it).
TEMPLATE_BLOCK = 2


class DepthMismatch(Exception):
    """The deeper log cannot be built from the shallow one; ``reason`` says why in plain words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _BlockLog:
    """A trace's events with the block each belongs to, and each block's storages by role."""

    owners: list[int | None]
    blocks: dict[int, int | None]
    roles: dict[int, tuple[int, int]]  # storage -> (phase it was allocated in, place among its block's there)
    by_role: dict[tuple[int, tuple[int, int]], int]


def deepen(base: StepTrace, depth: int, *, check: tuple[StepTrace, StepTrace]) -> StepTrace:
    """The log of the model ``depth`` blocks deep, built from ``base``, a trace of it a few blocks deep.

    ``check`` is the same step traced at ``base``'s depth and one block deeper (at one batch size; ``base``
    itself where it is concrete): the build is only made if one block more than ``check[0]`` gives
    ``check[1]``, event for event, and the ops, the CUDA substitutions and a paged optimizer's bytes grow by
    what that block adds.

    Raises:
        DepthMismatch: the traces did not record their blocks, or one block more does not give ``check[1]``.
    """
    shallow, deeper = check
    if base.blocks < TEMPLATE_BLOCK + 1 or shallow.blocks != base.blocks or deeper.blocks != shallow.blocks + 1:
        raise DepthMismatch(
            f"needs traces at {TEMPLATE_BLOCK + 1} or more blocks and one block more (got {shallow.blocks} and "
            f"{deeper.blocks} blocks)"
        )
    if depth < base.blocks:
        raise DepthMismatch(f"the model is {depth} blocks deep, shallower than the traces")
    try:
        difference = log_difference(_repeat(shallow.recorder, deeper.blocks), deeper.recorder)
    except DepthMismatch as mismatch:
        difference = mismatch.reason
    if difference is not None:
        raise DepthMismatch(
            f"its blocks do not repeat one another: the trace at {deeper.blocks} blocks is not the one at "
            f"{shallow.blocks} with a block more; {difference}"
        )
    added = depth - base.blocks
    recorder = _repeat(base.recorder, depth) if added else base.recorder
    return dataclasses.replace(
        base,
        # the engine's in-place gradient sums, which a log recording blocks keeps apart: the step as traced whole
        recorder=fold_sums_in_place(recorder),
        substitutions={
            name: count + added * (deeper.substitutions.get(name, 0) - shallow.substitutions.get(name, 0))
            for name, count in base.substitutions.items()
        },
        ops=base.ops + added * (deeper.ops - shallow.ops),
        paged=_paged(base.paged, shallow.paged, deeper.paged, added),
        blocks=depth,
    )


def deepen_symbolic(base: SymbolicTrace, depth: int, *, check: SymbolicTrace) -> SymbolicTrace:
    """``deepen`` for traces with the batch (and sequence length) symbolic: ``base`` built to ``depth`` blocks,
    checked against ``check``, the same step one block deeper, at ``base``'s batch. (A concrete trace is no check:
    a symbolic trace keeps a few views that a concrete one elides, such as a slice whose end it cannot prove is
    the size.) Valid where both traces are."""
    if (base.seq is None) != (check.seq is None):
        raise DepthMismatch("one trace has a symbolic sequence length and the other not")
    rename = {check.symbol: base.symbol}
    if base.seq is not None and check.seq is not None:
        rename[check.seq.symbol] = base.seq.symbol
    if not check.valid(base.hint):
        raise DepthMismatch(f"the deeper trace does not cover batch {base.hint}, where the shallow one was traced")
    trace = deepen(base.trace, depth, check=(base.at(base.hint), check.at(base.hint)))
    guards = tuple(dict.fromkeys([*base.guards, *(guard.xreplace(rename) for guard in check.guards)]))
    seq = base.seq
    if seq is not None and check.seq is not None:
        uppers = [u for u in (seq.upper, check.seq.upper) if u is not None]
        seq = dataclasses.replace(seq, lower=max(seq.lower, check.seq.lower), upper=min(uppers) if uppers else None)
    uppers = [u for u in (base.upper, check.upper) if u is not None]
    return SymbolicTrace(
        trace, base.symbol, base.hint, guards, max(base.lower, check.lower), min(uppers) if uppers else None,
        seq, base.seq_len,
    )  # fmt: skip


def _paged(
    base: PagedState | None, shallow: PagedState | None, deeper: PagedState | None, added: int
) -> PagedState | None:
    if base is None or deeper is None:
        return base
    per_block = deeper.total_bytes - (shallow.total_bytes if shallow is not None else 0)
    return PagedState(total_bytes=base.total_bytes + added * per_block, largest_bytes=base.largest_bytes)


def _block_log(recorder: StorageRecorder) -> _BlockLog:
    if recorder.event_blocks is None:
        raise DepthMismatch("the trace did not record which block each event is in")
    blocks = storage_blocks(recorder)
    owners = [
        running if running is not None else blocks.get(abs(event))
        for event, running in zip(recorder.events, recorder.event_blocks, strict=True)
    ]
    roles: dict[int, tuple[int, int]] = {}
    by_role: dict[tuple[int, tuple[int, int]], int] = {}
    counts: dict[tuple[int, int], int] = {}
    for event in recorder.events:
        block = blocks.get(event) if event > 0 else None
        if block is not None:
            phase = recorder.alloc_phase.get(event, -1)
            place = counts.get((block, phase), 0)
            counts[block, phase] = place + 1
            roles[event] = (phase, place)
            by_role[block, (phase, place)] = event
    return _BlockLog(owners, blocks, roles, by_role)


def _repeat(recorder: StorageRecorder, depth: int) -> StorageRecorder:
    """``recorder``'s log with copies of the template block's events, for a model ``depth`` blocks deep."""
    log = _block_log(recorder)
    present = max((b for b in log.blocks.values() if b is not None), default=0)
    template, added = TEMPLATE_BLOCK, depth - present
    if present <= template:
        raise DepthMismatch(f"the trace has {present} blocks: the template block {template} has no block after it")
    sizes, categories, alloc_phase = dict(recorder.sizes), dict(recorder.categories), dict(recorder.alloc_phase)
    next_id = max(sizes, default=0) + 1
    copies: dict[tuple[int, int], int] = {}
    scratch = set(recorder.scratch)  # a kernel's scratch, in the copies too (``SymbolicTrace.at`` drops a 0 one)

    def storage(block: int, role: tuple[int, int]) -> int:
        """The storage with ``role`` in block ``block`` of the deep model."""
        if template < block <= template + added:  # a copy of the template block
            original = log.by_role.get((template, role))
            if original is None:
                raise DepthMismatch(f"block {template} lacks a tensor the block after it allocates")
            key = (block, original)
            if key not in copies:
                nonlocal next_id
                copies[key] = next_id
                sizes[next_id] = sizes[original]
                if original in categories:
                    categories[next_id] = categories[original]
                alloc_phase[next_id] = alloc_phase[original]
                if original in recorder.scratch:
                    scratch.add(next_id)
                next_id += 1
            return copies[key]
        real = block if block <= template else block - added
        found = log.by_role.get((real, role))
        if found is None:
            raise DepthMismatch(f"block {real} lacks a tensor the blocks around it allocate")
        return found

    def moved(event: int, owner: int | None, placed_as: int | None) -> int:
        """``event`` of a run of block ``owner``, emitted as block ``placed_as``'s."""
        sid = abs(event)
        block = log.blocks.get(sid)
        if block is None or owner is None or placed_as is None:
            return event
        sid = storage(placed_as + block - owner, log.roles[sid])
        return sid if event > 0 else -sid

    events, running = recorder.events, recorder.event_blocks
    runs = _runs(log.owners)
    out: list[int] = []
    out_blocks: list[int | None] = []  # the block running at each event of ``out`` (a copy's is its own)
    starts = [0] * (len(events) + 1)  # where the events emitted for each original event start in ``out``

    sums: dict[int, int] = {}  # the gradient sums done in place (``StorageRecorder.sums_in_place``), as emitted
    last = [-1]  # the event of ``events`` emitted last

    def emit(begin: int, end: int, owner: int | None, placed_as: int | None) -> None:
        for index in range(begin, end):
            event = moved(events[index], owner, placed_as)
            first = recorder.sums_in_place.get(events[index])
            if first is not None and last[0] == index - 1 and events[index - 1] == -first:
                sums[event] = -out[-1]
            out.append(event)
            last[0] = index
        out_blocks.extend(None if running[i] is None or owner is None or placed_as is None
                          else running[i] + placed_as - owner for i in range(begin, end))  # fmt: skip

    for number, (owner, begin, end) in enumerate(runs):
        starts[begin] = len(out)
        placed = owner if owner is None or owner <= template else owner + added
        if owner == template and added:
            ascending = _ascending(runs, number)
            order = range(1, added + 1) if ascending else range(added, 0, -1)
            if not ascending:
                for copy_number in order:
                    emit(begin, end, owner, template + copy_number)
            first = len(out)
            emit(begin, end, owner, placed)
            for index in range(begin + 1, end):
                starts[index] = first + index - begin
            if ascending:
                for copy_number in order:
                    emit(begin, end, owner, template + copy_number)
        else:
            for index in range(begin, end):
                starts[index] = len(out)
                emit(index, index + 1, owner, placed)
    starts[len(events)] = len(out)
    _check_pairs(out)
    deep = copy.copy(recorder)
    deep.events, deep.sizes, deep.categories, deep.alloc_phase = out, sizes, categories, alloc_phase
    deep.scratch = scratch
    deep.sums_in_place = sums
    deep.marks = [PhaseMark(starts[m.event_index], m.step, m.phase) for m in recorder.marks]
    deep.event_blocks = out_blocks  # which block ran each event, as a trace of the deep model records it
    deep.claimed_by, deep.derived_from = {}, {}  # the shallow trace's storages: not the deep log's to resolve
    return deep


def _runs(owners: list[int | None]) -> list[tuple[int | None, int, int]]:
    """Maximal runs of one owner: ``(owner, first event, end)``."""
    runs: list[tuple[int | None, int, int]] = []
    begin = 0
    for index in range(1, len(owners) + 1):
        if index == len(owners) or owners[index] != owners[begin]:
            runs.append((owners[begin], begin, index))
            begin = index
    return runs


def _ascending(runs: list[tuple[int | None, int, int]], number: int) -> bool:
    """Whether blocks run in ascending order around run ``number`` (forward, the optimizer step), by the nearest
    runs of other blocks before and after it; backward runs them in descending order."""
    owner = runs[number][0]
    assert owner is not None
    before = next((r[0] for r in reversed(runs[:number]) if r[0] is not None and r[0] != owner), None)
    after = next((r[0] for r in runs[number + 1 :] if r[0] is not None and r[0] != owner), None)
    descending = (before is not None and before > owner) or (after is not None and after < owner)
    return not descending


def _check_pairs(events: list[int]) -> None:
    """Every storage allocated once, and freed at most once, after its allocation."""
    live: set[int] = set()
    seen: set[int] = set()
    for event in events:
        if event > 0:
            if event in seen:
                raise DepthMismatch("the copied blocks would allocate a tensor twice")
            seen.add(event)
            live.add(event)
        elif -event in live:
            live.remove(-event)
        else:
            raise DepthMismatch("the copied blocks would free a tensor before allocating it, or twice")


def log_difference(built: StorageRecorder, traced: StorageRecorder) -> str | None:
    """Where ``built`` and ``traced`` differ (storages compared by size, category and allocation phase, frees by
    which allocation they free, and the phase marks), or ``None`` if they log the same step."""
    if len(built.events) != len(traced.events):
        return (
            f"{len(traced.events)} allocations and frees against {len(built.events)} in the shallower trace "
            "with a block added"
        )
    if [(m.event_index, m.step, m.phase) for m in built.marks] != [
        (m.event_index, m.step, m.phase) for m in traced.marks
    ]:
        return "the step's phases start at other points"
    order_built: dict[int, int] = {}
    order_traced: dict[int, int] = {}
    for index, (a, b) in enumerate(zip(built.events, traced.events, strict=True)):
        if (a > 0) != (b > 0):
            return f"event {index} allocates in one log and frees in the other"
        if a > 0:
            order_built[a], order_traced[b] = len(order_built), len(order_traced)
            size = built.sizes[a]
            if size != traced.sizes[b]:
                return f"allocation {index} is {traced.sizes[b]} bytes traced against {size} built"
            if built.categories.get(a) != traced.categories.get(b):
                return f"allocation {index} is of another kind (parameters, gradients, activations, ...)"
            if built.alloc_phase.get(a) != traced.alloc_phase.get(b):
                return f"allocation {index} is made in another phase of the step"
        elif order_built.get(-a) != order_traced.get(-b):
            return f"event {index} frees another tensor"
    return None
