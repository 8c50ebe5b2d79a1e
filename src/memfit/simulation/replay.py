"""Turn a storage log into peaks: per phase, allocated and reserved, with a breakdown by category."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.simulation.allocator import AllocatorConfig, CachingAllocatorSimulator, round_size
from memfit.tracing.recorder import PhaseMark, StorageRecorder

__all__ = [
    "LimitFit",
    "LimitReplayer",
    "PhasePeak",
    "TimelinePoint",
    "extrapolate_timeline",
    "least_reserved",
    "replay",
    "replay_at_limit",
]

MAX_TIMELINE_POINTS = 1500
MAX_STEADY_REPEATS = 8
"""How many times ``replay`` runs the last traced step again, at most, for the caching allocator to settle."""


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


StepReplays = tuple[tuple[PhasePeak, ...], tuple[TimelinePoint, ...], tuple[PhasePeak, ...] | None]
"""What an estimate is built from: the traced batch's phase peaks and timeline, and another batch's phase peaks."""


def replay_step(
    primary: StorageRecorder, secondary: StorageRecorder | None, simulate_cuda_allocator: bool
) -> StepReplays:
    """The replays an estimate is built from: ``primary``'s peaks and timeline, and ``secondary``'s peaks (if any)."""
    timeline: list[TimelinePoint] = []
    peaks = replay(primary, simulate_cuda_allocator=simulate_cuda_allocator, timeline=timeline)
    other = None if secondary is None else replay(secondary, simulate_cuda_allocator=simulate_cuda_allocator)
    return tuple(peaks), tuple(timeline), None if other is None else tuple(other)


def replay(
    recorder: StorageRecorder, *, simulate_cuda_allocator: bool, timeline: list[TimelinePoint] | None = None
) -> list[PhasePeak]:
    """Replay the log in order; with ``simulate_cuda_allocator`` sizes are CUDA blocks and reserved
    comes from the caching-allocator simulation, else sizes are raw and reserved equals allocated.
    A ``timeline`` list receives up to ``MAX_TIMELINE_POINTS`` samples (peaks always included).

    The caching allocator does not always settle in the second step: the blocks the first step leaves cached are
    carved differently by the second, and a third step may find no cached block for a request the second served
    (BERT with checkpointing at batch 16 on an H200 reserves a new 132 MiB segment in its third step,
    ``benchmarks/results/gpu-truth/h200-2026-11-27/``). With the allocator simulated, the last traced step (the
    steady one) is therefore run again until a run reserves nothing new (at most ``MAX_STEADY_REPEATS`` times); its
    phases' peaks are the highest of all its runs (``_steady_step``)."""
    allocator = CachingAllocatorSimulator() if simulate_cuda_allocator else None
    ledger = _Ledger(recorder, allocator)
    apply = ledger.apply
    by_category = ledger.by_category
    marks = recorder.marks
    boundaries = [mark.event_index for mark in marks[1:]] + [len(recorder.events)]
    peaks: list[PhasePeak] = []
    events = recorder.events
    first = marks[0].event_index if marks else len(events)
    for event in events[:first]:  # parameters, buffers and inputs made before the first step
        apply(event)
    position = first
    every = max(1, (len(events) - first) // MAX_TIMELINE_POINTS)
    categories_order = list(Category)

    assert list(by_category) == categories_order  # a timeline point's bytes are in Category order

    def sample(index: int, mark: PhaseMark) -> None:
        if timeline is not None:
            reserved = allocator.reserved_bytes if allocator else ledger.allocated
            timeline.append(TimelinePoint(index, mark.step, mark.phase, tuple(by_category.values()), reserved))

    for mark, end in zip(marks, boundaries, strict=True):
        peak_allocated = ledger.allocated
        peak_tensors = ledger.tensors
        peak_reserved = allocator.reserved_bytes if allocator else ledger.allocated
        breakdown = dict(by_category)
        for index in range(position, end):
            apply(events[index])
            if ledger.allocated > peak_allocated:
                peak_allocated = ledger.allocated
                breakdown = dict(by_category)
                sample(index, mark)
            elif index % every == 0:
                sample(index, mark)
            if ledger.tensors > peak_tensors:
                peak_tensors = ledger.tensors
            if allocator is not None and allocator._reserved > peak_reserved:
                peak_reserved = allocator._reserved
        if not allocator:
            peak_reserved = peak_allocated
        peaks.append(PhasePeak(mark.step, mark.phase, peak_allocated, peak_reserved, breakdown, peak_tensors))
        position = end
    steady = _steady_step(recorder) if allocator else None
    if steady is not None and allocator is not None:
        _settle(ledger, allocator, recorder, boundaries, peaks, steady)
    return peaks


class _Ledger:
    """What the replay holds after each event: each live storage's size, the bytes by category, the allocated and
    tensor totals; with ``allocator``, sizes are its blocks."""

    __slots__ = ("allocated", "allocator", "by_category", "held", "storages", "tensors")

    def __init__(self, recorder: StorageRecorder, allocator: CachingAllocatorSimulator | None) -> None:
        self.allocator = allocator
        # each storage's (size, its block's size, category), checked and rounded once for the whole log
        categories, temporaries = recorder.categories, Category.TEMPORARIES
        self.storages: dict[int, tuple[int, int, Category]] = {
            sid: (size, round_size(size) if allocator is not None else size, categories.get(sid, temporaries))
            for sid, size in recorder.sizes.items()
        }
        self.held: dict[int, int] = {}
        self.by_category: dict[Category, int] = dict.fromkeys(Category, 0)
        self.allocated = 0
        self.tensors = 0

    def apply(self, event: int, key: int | None = None) -> None:
        """One event of storage ``abs(event)``, held under ``key`` (the storage itself unless a repeated step's)."""
        allocator = self.allocator
        sid = event if event > 0 else -event
        if key is None:
            key = sid
        nbytes, rounded, category = self.storages[sid]
        if event > 0:
            if allocator is None:
                size = nbytes
            else:
                if key in allocator._live:  # as malloc refuses it
                    raise InvalidInputError(f"storage {key!r} is already allocated; free it before allocating it again")
                size = allocator.allocate_rounded(key, nbytes, rounded)
            self.held[key] = size
            self.allocated += size
            self.tensors += rounded
            self.by_category[category] += size
        else:
            size = self.held.pop(key, None)
            if size is None:
                return
            if allocator is not None:
                allocator.free(key)
            self.allocated -= size
            self.tensors -= rounded
            self.by_category[category] -= size


def _settle(
    ledger: _Ledger,
    allocator: CachingAllocatorSimulator,
    recorder: StorageRecorder,
    boundaries: list[int],
    peaks: list[PhasePeak],
    steady: tuple[int, dict[int, int]],
) -> None:
    """Run the steady step again until a run reserves nothing new (at most ``MAX_STEADY_REPEATS`` times), raising
    each of its phases' peaks in ``peaks`` to the highest of all its runs."""
    marks, events = recorder.marks, recorder.events
    start, successors = steady
    stride = max(recorder.sizes, default=0) + 1  # keys of a repeated run's storages, apart from every traced one
    first = next(i for i, mark in enumerate(marks) if mark.event_index >= start)
    again = _RunAgain(events[start:], successors, stride)
    for run in range(1, MAX_STEADY_REPEATS + 1):
        reserved_before = allocator.reserved_bytes
        for index in range(first, len(marks)):
            end = boundaries[index]
            peak_allocated, peak_tensors, breakdown = ledger.allocated, ledger.tensors, None
            for event, key in again.run(run, marks[index].event_index - start, end - start):
                ledger.apply(event, key)
                if ledger.allocated > peak_allocated:
                    peak_allocated, breakdown = ledger.allocated, dict(ledger.by_category)
                peak_tensors = max(peak_tensors, ledger.tensors)
            old = peaks[index]
            peaks[index] = PhasePeak(
                old.step, old.phase, max(old.allocated_bytes, peak_allocated),
                max(old.reserved_bytes, allocator.reserved_bytes),
                breakdown if breakdown is not None and peak_allocated > old.allocated_bytes else old.breakdown,
                max(old.tensor_bytes, peak_tensors),
            )  # fmt: skip
        if allocator.reserved_bytes == reserved_before:
            break


class _RunAgain:
    """The keys of the steady step's events when it runs again: in its ``run``-th run, its own storages under keys
    apart from every earlier run's (``key + run * stride``), what the run before left for it to free
    (``_steady_step``) under that run's keys, anything else under its own. Worked out once per log: the runs differ
    only in ``run``."""

    __slots__ = ("events", "keys", "moves", "stride")

    def __init__(self, events: Sequence[int], successors: dict[int, int], stride: int) -> None:
        self.events, self.stride = events, stride
        self.keys: list[int] = []
        self.moves: list[bool] = []  # whether the event's key moves on by ``stride`` with each run
        made: set[int] = set()
        for event in events:
            sid = abs(event)
            if event > 0:
                made.add(sid)
                key, moves = sid, True
            elif sid in made:
                key, moves = sid, True
            elif sid in successors:
                key, moves = successors[sid] - stride, True  # the run before's: successors[sid] + (run - 1) * stride
            else:
                key, moves = sid, False
            self.keys.append(key)
            self.moves.append(moves)

    def run(self, number: int, begin: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
        """``(event, key)`` of events ``begin:end`` of the ``number``-th run again."""
        shift = number * self.stride
        stop = len(self.events) if end is None else end
        events, keys, moves = self.events, self.keys, self.moves
        for index in range(begin, stop):
            yield events[index], keys[index] + shift if moves[index] else keys[index]


def _steady_step(recorder: StorageRecorder) -> tuple[int, dict[int, int]] | None:
    """Where the last traced step starts, and what it leaves for a next run of itself to free: each storage an
    earlier step made that this one frees, paired with this step's own storage alive at its end that takes its
    part (in the order they were made; same sizes). ``None`` when the log has no second step or when the step
    does not hand over like that (a forward-only trace keeps its outputs, and a next run would not free them)."""
    marks = recorder.marks
    if not marks or marks[-1].step < 2:
        return None
    last = marks[-1].step
    start = next(mark.event_index for mark in marks if mark.step == last)
    alive: set[int] = set()
    inherited: list[int] = []
    for event in recorder.events[start:]:
        if event > 0:
            alive.add(event)
        elif -event in alive:
            alive.discard(-event)
        else:
            inherited.append(-event)
    inherited.sort()
    left = sorted(alive)
    sizes = recorder.sizes
    if len(inherited) != len(left) or any(sizes[a] != sizes[b] for a, b in zip(inherited, left, strict=True)):
        return None
    return start, dict(zip(inherited, left, strict=True))


@dataclass(frozen=True)
class LimitFit:
    """A step replayed with the caching allocator held to ``limit_bytes`` of reserved memory.

    ``fits``: no allocation ran out of memory after the allocator freed its cache and retried;
    ``alloc_retries``: how many times it had to (``num_alloc_retries``: each one synchronizes the device, so a
    step that needs them runs slower); the peaks are those under the limit."""

    limit_bytes: int
    fits: bool
    alloc_retries: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int


def replay_at_limit(
    recorder: StorageRecorder, limit_bytes: int, config: AllocatorConfig | None = None, *, until_oom: bool = False
) -> LimitFit:
    """Replay the log with the allocator's reserved memory held to ``limit_bytes``, as on a device (or under
    ``set_per_process_memory_fraction``) with that much for the allocator. The steady step runs again, as in
    ``replay``, until a run takes no segment from the driver and needs no retry (at most ``MAX_STEADY_REPEATS``).
    ``until_oom`` stops at the first allocation that fails (the peaks are then those up to it): enough for a caller
    that asks only whether it fits."""
    allocator = CachingAllocatorSimulator(capacity_bytes=max(0, limit_bytes), config=config)
    return _replay_from(allocator, recorder, 0, limit_bytes, until_oom)


RESERVE_RESOLUTION = 2 * 1024 * 1024
"""How finely ``least_reserved`` finds the limit: the allocator's own rounding of large segments."""


class LimitReplayer:
    """One step's log replayed at many allocator limits, each replay starting from a checkpoint of the unlimited one.

    Without a limit the allocator never gives a segment back, so its reserved memory only grows; and a limit acts
    only when a new segment would take reserved memory past it (garbage collection aside). So a replay held to
    ``L`` is the unlimited replay, state for state, up to the first event after which the unlimited one reserves
    more than ``L``: it can start from the last checkpoint taken at or below ``L``. The answers are those of
    ``replay_at_limit`` exactly; a garbage-collection threshold, which reads the limit throughout, replays whole.
    """

    CHECKPOINTS = 16

    def __init__(self, recorder: StorageRecorder, config: AllocatorConfig | None = None) -> None:
        self._recorder, self._config = recorder, config
        self._rounded = _rounded_sizes(recorder)
        allocator = CachingAllocatorSimulator(config=config)
        self._checkpoints: list[tuple[int, int, CachingAllocatorSimulator]] = []  # (event index, reserved, state)
        if allocator.config.garbage_collection_threshold > 0:  # the limit acts throughout: nothing to resume
            self.unlimited = replay_at_limit(recorder, 1 << 62, config)
            return
        every = max(1, len(recorder.events) // self.CHECKPOINTS)
        self.unlimited = _replay_from(allocator, recorder, 0, 1 << 62, False, (every, self._checkpoints), self._rounded)

    def at(self, limit_bytes: int, *, until_oom: bool = False) -> LimitFit:
        """``replay_at_limit(recorder, limit_bytes, config, until_oom=until_oom)``, from the latest checkpoint that
        holds for ``limit_bytes``."""
        start, allocator = 0, None
        for index, reserved, state in reversed(self._checkpoints):
            if reserved <= limit_bytes:
                start, allocator = index, state.clone()
                break
        if allocator is None:
            return replay_at_limit(self._recorder, limit_bytes, self._config, until_oom=until_oom)
        allocator.set_capacity(max(0, limit_bytes))
        return _replay_from(allocator, self._recorder, start, limit_bytes, until_oom, rounded=self._rounded)

    def least(self) -> int:
        """``least_reserved``: bisected between the peak of the blocks and the unlimited reserved peak."""
        low = self.unlimited.peak_allocated_bytes - 1  # below the blocks themselves nothing runs
        high = self.unlimited.peak_reserved_bytes
        while high - low > RESERVE_RESOLUTION:
            middle = (low + high) // 2
            if self.at(middle, until_oom=True).fits:
                high = middle
            else:
                low = middle
        return high


def _replay_from(
    allocator: CachingAllocatorSimulator,
    recorder: StorageRecorder,
    start: int,
    limit_bytes: int,
    until_oom: bool,
    checkpoints: tuple[int, list[tuple[int, int, CachingAllocatorSimulator]]] | None = None,
    rounded: dict[int, int] | None = None,
) -> LimitFit:
    """The log from event ``start`` on, then the steady step until the allocator settles; with ``checkpoints``
    (every, into), a copy of the allocator every ``every`` events of the log, with its reserved bytes then."""
    sizes = recorder.sizes
    rounded = rounded if rounded is not None else _rounded_sizes(recorder)
    live = allocator._live
    malloc, free = allocator.allocate_rounded, allocator.free
    every, into = checkpoints if checkpoints is not None else (0, [])
    for index, event in enumerate(recorder.events[start:], start):
        if every and index and index % every == 0:
            into.append((index, allocator.reserved_bytes, allocator.clone()))
        if event > 0:
            if event in live:  # as malloc refuses it
                raise InvalidInputError(f"storage {event!r} is already allocated; free it before allocating it again")
            malloc(event, sizes[event], rounded[event])
            if until_oom and allocator._num_ooms:
                break
        else:
            free(-event)
    steady = None if until_oom and allocator.oom else _steady_step(recorder)
    if steady is not None:  # run again until the allocator settles, as ``replay`` does
        start, successors = steady
        again = _RunAgain(recorder.events[start:], successors, max(sizes, default=0) + 1)
        for run in range(1, MAX_STEADY_REPEATS + 1):
            before = (allocator.segments_made, allocator.peak_reserved_bytes, allocator.num_alloc_retries)
            reserved_before = allocator.reserved_bytes
            for event, key in again.run(run):
                if event > 0:
                    if key in live:
                        raise InvalidInputError(f"storage {key!r} is already allocated; free it before allocating "
                                                "it again")  # fmt: skip
                    malloc(key, sizes[event], rounded[event])
                    if until_oom and allocator._num_ooms:
                        break
                else:
                    free(key)
            if until_oom and allocator.oom:
                break
            after = (allocator.segments_made, allocator.peak_reserved_bytes, allocator.num_alloc_retries)
            if after == before and allocator.reserved_bytes == reserved_before:
                break
    return LimitFit(
        limit_bytes, not allocator.oom, allocator.num_alloc_retries, allocator.peak_allocated_bytes,
        allocator.peak_reserved_bytes,
    )  # fmt: skip


def _rounded_sizes(recorder: StorageRecorder) -> dict[int, int]:
    """Each storage's block size (``round_size``), checked once for the whole log."""
    return {sid: round_size(size) for sid, size in recorder.sizes.items()}


def least_reserved(recorder: StorageRecorder, config: AllocatorConfig | None = None) -> int:
    """The least reserved memory the step runs in when the allocator may free its cache and retry at the limit
    (to ``RESERVE_RESOLUTION``): between the peak of its blocks and the peak it reserves with no limit."""
    return LimitReplayer(recorder, config).least()


def extrapolate_timeline(
    shallow: Sequence[TimelinePoint], deeper: Sequence[TimelinePoint], t: float
) -> tuple[TimelinePoint, ...]:
    """The timeline of a deeper model from the timelines of the same model at two smaller depths.

    ``t`` places the target on the line through the two depths (0: ``shallow``, 1: ``deeper``).
    Each phase of each step is stretched to its extrapolated number of events and aligned on its
    peak, so the peak lands where ``extrapolate_depth`` puts it. The deeper trace gives the shape
    (per-op spikes are not amplified); what grows with depth is added as a difference that is
    linear from the phase's start to its peak and from its peak to its end. If the two timelines
    do not have the same phases, the deeper one is returned as it is.
    """
    parts_a, parts_b = _phase_parts(shallow), _phase_parts(deeper)
    if not parts_b or [key for key, _ in parts_a] != [key for key, _ in parts_b]:
        return tuple(deeper)
    spans = [
        max(1, round(_span(a) + (_span(b) - _span(a)) * t)) for (_, a), (_, b) in zip(parts_a, parts_b, strict=True)
    ]
    scale = min(1.0, 2 * MAX_TIMELINE_POINTS / sum(spans))
    out: list[TimelinePoint] = []
    event = deeper[0].event_index
    for (_, a), (_, b), span in zip(parts_a, parts_b, spans, strict=True):
        out.extend(_stretch(a, b, t, span, max(1, round(span * scale)), event))
        event += span
    return tuple(out)


def _phase_parts(points: Sequence[TimelinePoint]) -> list[tuple[tuple[int, Phase], list[TimelinePoint]]]:
    parts: list[tuple[tuple[int, Phase], list[TimelinePoint]]] = []
    for point in points:
        key = (point.step, point.phase)
        if not parts or parts[-1][0] != key:
            parts.append((key, []))
        parts[-1][1].append(point)
    return parts


def _span(points: Sequence[TimelinePoint]) -> int:
    return points[-1].event_index - points[0].event_index + 1


def _position(points: Sequence[TimelinePoint], index: int) -> float:
    """Where ``points[index]`` sits in its phase, from 0 (first sample) to 1 (last)."""
    return (points[index].event_index - points[0].event_index) / max(1, _span(points) - 1)


def _peak_index(points: Sequence[TimelinePoint]) -> int:
    return max(range(len(points)), key=lambda i: sum(points[i].category_bytes))


def _stretch(a: Sequence[TimelinePoint], b: Sequence[TimelinePoint], t: float, span: int, count: int,
             first_event: int) -> list[TimelinePoint]:  # fmt: skip
    """One phase at the new depth: ``count`` points over ``span`` events, aligned on both traces' peaks."""
    peak_a, peak_b = _peak_index(a), _peak_index(b)
    at_a, at_b = _position(a, peak_a), _position(b, peak_b)
    events_a, events_b = at_a * (_span(a) - 1), at_b * (_span(b) - 1)
    at_d = min(1.0, max(0.0, (events_a + (events_b - events_a) * t) / max(1, span - 1)))
    grid = sorted({*(i / max(1, count - 1) for i in range(count)), at_d}) if count > 1 else [0.0]

    def source(anchor: float, u: float) -> float:
        """Output position ``u`` in a source's own positions, piecewise linear through the peaks."""
        if u <= at_d:
            return anchor * (u / at_d) if at_d > 0 else anchor
        return u if u == math.inf else anchor + (1 - anchor) * (u - at_d) / (1 - at_d)

    positions = [_position(b, i) for i in range(len(b))]

    def pick(low: float, high: float) -> TimelinePoint:
        """The deeper trace's highest sample in ``[low, high)``, else the last one before it."""
        start, end = source(at_b, low), source(at_b, high)
        first, last = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
        if last > first:
            return max(b[first:last], key=lambda p: sum(p.category_bytes))
        return b[max(0, bisect.bisect_right(positions, start) - 1)]

    def gap(shallow: TimelinePoint, deeper: TimelinePoint) -> list[int]:
        return [y - x for x, y in zip((*shallow.category_bytes, shallow.reserved_bytes),
                                      (*deeper.category_bytes, deeper.reserved_bytes), strict=True)]  # fmt: skip

    anchors = [(0.0, gap(a[0], b[0])), (at_d, gap(a[peak_a], b[peak_b])), (1.0, gap(a[-1], b[-1]))]

    def difference(u: float) -> list[float]:
        """What the deeper trace adds over the shallow one at ``u``: linear between start, peak and end."""
        (u0, d0), (u1, d1) = anchors[:2] if u <= at_d else anchors[1:]
        w = 0.0 if u1 == u0 else (u - u0) / (u1 - u0)
        return [x + (y - x) * w for x, y in zip(d0, d1, strict=True)]

    points = []
    for i, u in enumerate(grid):
        high = grid[i + 1] if i + 1 < len(grid) else math.inf
        shape = pick(u, high)
        *extra, extra_reserved = difference(u)
        sizes = tuple(max(0, c + round(d * (t - 1))) for c, d in zip(shape.category_bytes, extra, strict=True))
        reserved = max(sum(sizes), shape.reserved_bytes + round(extra_reserved * (t - 1)))
        points.append(TimelinePoint(first_event + round(u * (span - 1)), shape.step, shape.phase, sizes, reserved))
    return points
