"""Choose the micro batch, gradient accumulation and checkpointing that fit a memory budget.

Pure arithmetic over traced steps (``StepCurve``: a ``MemoryEstimate`` and its trace read at any batch): no
framework, no device. The rules:

* budget = capacity x (1 - margin); a micro batch fits when its predicted peak is within budget, and
  the plan takes the largest that fits: given traces of the whole step (``confirm``), the largest
  whose trace fits while the next one's does not (the interpolation in the batch is only the guess
  the search starts from);
* the effective batch (micro x accumulation x world size) is a hyperparameter: keep the target
  (by default what the user configured) with the fewest accumulation steps that fit, taking a few
  more steps when that splits the target exactly, and say so when integer arithmetic cannot hit
  it; ``"max"`` instead maximises the micro batch with no accumulation, as Lightning's
  ``BatchSizeFinder`` does;
* activation checkpointing costs time (about 20-30 % per step: a second forward), so it is turned
  on only when the minimum micro batch does not fit without it, or when it buys a markedly larger
  micro batch for a run that would otherwise crawl (``CHECKPOINTING_MIN_GAIN``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from memfit.categories import Category, Phase
from memfit.devices import find_backend
from memfit.devices.catalog import capacity_bytes
from memfit.errors import CheckpointingUnavailableError, InsufficientMemoryError, InvalidInputError
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import BatchPeak, MemoryEstimate
from memfit.simulation.allocator import SMALL_BUFFER, AllocatorConfig
from memfit.units import format_bytes, format_margin

__all__ = ["CHECKPOINTING_MIN_GAIN", "SMALL_MICRO_BATCH", "Plan", "plan"]

# Checkpointing is worth its recompute when the micro batch without it would be below
# SMALL_MICRO_BATCH and checkpointing makes it at least CHECKPOINTING_MIN_GAIN times larger.
SMALL_MICRO_BATCH = 4
CHECKPOINTING_MIN_GAIN = 4.0
_UNBOUNDED = 1 << 31
_UNBOUNDED_BYTES = 1 << 62  # a capacity no step reaches: the allocator replayed with room to spare


@dataclass(frozen=True)
class Plan:
    """What to run with, the prediction behind it, and why, in plain words."""

    micro_batch_size: int
    accumulate_grad_batches: int
    gradient_checkpointing: bool
    world_size: int
    effective_batch_size: int
    target_batch_size: int | None
    predicted_peak_bytes: int
    capacity_bytes: int
    budget_bytes: int
    margin: float
    largest_micro_batch: int
    predicted_allocated_bytes: int = 0
    predicted_reserved_bytes: int = 0
    reasons: tuple[str, ...] = field(default=())
    alloc_retries: int = 0  # allocator retries (cache freed, device synchronized) a step needs on the capacity
    allocator_settings: str = ""  # the PYTORCH_ALLOC_CONF options planned for ("" for torch's defaults)
    # the least memory the step runs in, the allocator freeing its cache and retrying at its limit: the figure
    # compared with the budget (0: ``predicted_peak_bytes``, planned without the allocator's limit)
    needed_bytes: int = 0
    # the accumulation the run was configured with, where a framework's run was planned (None: not known)
    configured_accumulation: int | None = None

    @property
    def fit_bytes(self) -> int:
        """The figure the plan compares with the budget."""
        return self.needed_bytes or self.predicted_peak_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.fit_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "gradient_checkpointing": self.gradient_checkpointing,
            "world_size": self.world_size,
            "effective_batch_size": self.effective_batch_size,
            "target_batch_size": self.target_batch_size,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "budget_bytes": self.budget_bytes,
            "margin": self.margin,
            "largest_micro_batch": self.largest_micro_batch,
            "predicted_allocated_bytes": self.predicted_allocated_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "alloc_retries": self.alloc_retries,
            "allocator_settings": self.allocator_settings,
            "needed_bytes": self.needed_bytes,
            "configured_accumulation": self.configured_accumulation,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan ``to_dict()`` gave (e.g. saved in a checkpoint); ``reasons`` may be a list."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if unknown or missing:
            raise InvalidInputError(f"not a memfit plan: unknown keys {unknown}, missing keys {missing}")
        return cls(**{**data, "reasons": tuple(data.get("reasons", ()))})

    def with_reason(self, reason: str) -> Plan:
        """This plan with one more reason at the end (e.g. "restored from the checkpoint"), unless it has that one
        already (a plan restored again on a later resume)."""
        if reason in self.reasons:
            return self
        return dataclasses.replace(self, reasons=(*self.reasons, reason))

    def summary(self) -> str:
        """One line for logs: ``micro 12 x accumulation 3 x 1 device = 36 (target 36), peak ...``.

        The peak is ``predicted_peak_bytes``, what the run reaches on its capacity; where it includes the CUDA
        context, its reserved part (what ``max_memory_reserved`` measures, and what the run's drift is measured
        against) is named beside it. Where the step needs less at the allocator's limit (``needed_bytes``, the
        figure compared with the budget), that is named too.
        """
        target = ""
        if self.target_batch_size and self.target_batch_size != self.effective_batch_size:
            target = f", not the target {self.target_batch_size}"
        elif self.target_batch_size:
            target = f" (target {self.target_batch_size})"
        ckpt = ", checkpointing on" if self.gradient_checkpointing else ""
        context = self.predicted_peak_bytes - self.predicted_reserved_bytes
        parts = (
            f" (reserved {format_bytes(self.predicted_reserved_bytes)} + CUDA context {format_bytes(context)})"
            if self.predicted_reserved_bytes and context > 0
            else ""
        )
        needs = (
            f"; needs {format_bytes(self.fit_bytes)} at the allocator's limit,"
            if self.fit_bytes < self.predicted_peak_bytes
            else ""
        )
        return (
            f"micro batch {self.micro_batch_size} x accumulation {self.accumulate_grad_batches} x "
            f"{self.world_size} device(s) = {self.effective_batch_size}{target}{ckpt}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}{parts}{needs} of "
            f"{budget_phrase(self.capacity_bytes, self.margin, self.budget_bytes)}"
        )


EstimateSource = StepCurve | Callable[[], StepCurve] | None
Confirm = Callable[[int, bool, int], StepCurve]


def plan(
    curve: StepCurve,
    capacity_bytes: int | str,
    *,
    margin: float = DEFAULT_MARGIN,
    target_batch_size: int | Literal["max"] | None = None,
    world_size: int = 1,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    allow_checkpointing: bool = True,
    checkpointed: EstimateSource = None,
    include_context: bool = True,
    confirm: Confirm | None = None,
    allocator: AllocatorConfig | None = None,
    at_limit: bool = True,
) -> Plan:
    """Pick the plan for the step ``curve`` traced (``memfit.trace``, no checkpointing) within ``capacity_bytes``.

    Args:
        capacity_bytes: memory the run may use on each device: bytes, a size such as ``"20GiB"``, or a GPU name
            such as ``"h100"`` (that card's memory).
        margin: fraction of the capacity kept free, for what no prediction covers.
        target_batch_size: effective batch to keep across micro batches, accumulation and devices;
            ``None`` keeps the traced batch x ``world_size``; ``"max"`` maximises the micro batch.
        min_batch_size / max_batch_size: bounds on the micro batch.
        checkpointed: the same step traced with checkpointing, or a callable that traces it on
            demand (only called when checkpointing is considered, at most once).
        include_context: ``False`` when ``capacity_bytes`` was measured after CUDA started in this
            process, so the context is already outside it.
        confirm: ``confirm(micro_batch, checkpointing, accumulation_steps)`` traces the whole step at that
            configuration. The plan then decides on these traces alone, the interpolation only giving the
            first guess: ``largest_micro_batch`` fits once traced (with the fewest accumulation steps its
            target needs) and the next micro batch does not, unless the target or ``max_batch_size`` caps
            it; the split of the target is traced and fits too. The interpolation errs both ways (below
            the traced batch it can underestimate; the allocator's rounding is not linear) and accumulation
            keeps gradients alive through later micro batches. Each configuration is traced once per call.
            Without it, a plan that accumulates from an estimate traced without accumulation keeps
            room for the gradients on top (an upper bound).
        allocator: the caching allocator's options the run will have (default: this process's
            ``PYTORCH_ALLOC_CONF``); a plan may choose them (``expandable_segments``).
        at_limit: a micro batch fits when its step runs within the budget as the allocator behaves at its
            limit (it frees its cached blocks and retries before it runs out of memory; ``least_device_bytes``),
            not only when its peak with room to spare does. ``False`` plans on that peak, as before.

    The steps: the question (budget, bounds, target), the candidates (without checkpointing, and with
    it when it is needed or pays), the fit of the chosen one's split (with ``confirm``: a bracketing
    search over full traces, ``_largest_confirmed``), checkpointing as the fallback when that fit misses,
    and the reasons.

    Raises:
        InsufficientMemoryError: not even ``min_batch_size`` fits, with checkpointing if allowed.
        InvalidInputError: an argument cannot be used (a ``MemoryEstimate`` for ``curve``: plan on ``memfit.trace``).
    """
    curve = _curve_of(curve, "plan(curve)")
    if isinstance(capacity_bytes, str):
        capacity_bytes = _capacity_of(capacity_bytes)
    question = _question(
        curve.estimate,
        capacity_bytes,
        margin,
        target_batch_size,
        world_size,
        min_batch_size,
        max_batch_size,
        include_context,
    )
    config = allocator if allocator is not None else AllocatorConfig.from_environment()
    question = dataclasses.replace(question, allocator=config if at_limit else None)
    unavailable: list[str] = []  # why checkpointing could not be tried, said with a miss

    def checkpointed_estimate() -> StepCurve | None:
        try:
            return _resolve(checkpointed) if allow_checkpointing else None
        except CheckpointingUnavailableError as error:
            unavailable.append(f"checkpointing could not be tried: {error}")
            return None

    with_checkpointing = functools.cache(checkpointed_estimate)
    confirm = _confirming(confirm) if confirm is not None else None  # the search and the split share traces
    candidates = _candidates(question, curve, allow_checkpointing, with_checkpointing)
    if isinstance(candidates, _Miss):
        raise InsufficientMemoryError(_said_with(candidates.message, unavailable))
    used, split, reasons = _fitted(question, candidates, with_checkpointing, confirm, unavailable)
    if not split.checkpointing and confirm is not None:
        # the traces found a smaller micro batch than the interpolation (the loop's accumulation keeps more than the
        # traced step did): checkpointing is weighed on that one, as it would have been had the trace said so first
        better = _checkpointing_pays(question, split, candidates, with_checkpointing, confirm)
        if better is not None:
            split, more = better
            reasons.extend(more)
    chosen = _chosen_plan(question, split, [*reasons, *_explain(question, split)])
    if question.allocator is None:
        return chosen
    if confirm is not None:
        source = confirm(split.micro, split.checkpointing, split.accumulation)
    elif split.accumulation == 1 or used.source.estimate.accumulation_steps == split.accumulation:
        source = used.source
    else:  # the chosen loop keeps gradients the trace freed: its log is not at hand to replay
        return chosen
    return _at_the_limit(question, chosen, split, source)


def _fitted(
    question: _Question,
    candidates: _Candidates,
    with_checkpointing: Callable[[], StepCurve | None],
    confirm: Confirm | None,
    unavailable: list[str],
) -> tuple[_Candidate, _Split, list[str]]:
    """The chosen candidate's split of the target, fitted (``_fit``); checkpointing as the fallback when the fit
    misses without it. Raises ``InsufficientMemoryError`` when nothing fits."""
    used = candidates.chosen
    fit = _fit(question, used, confirm)
    reasons = [*candidates.reasons, *fit.reasons]
    if isinstance(fit.outcome, _Miss):
        fallback = _checkpointing_fallback(question, candidates, with_checkpointing)
        if fallback is None:
            raise InsufficientMemoryError(_said_with(fit.outcome.message, unavailable))
        reasons.append(
            f"micro batch {question.min_batch_size} does not fit once traced at its size; checkpointing brings it "
            "within (about 20-30 % slower per step)"
        )
        used = fallback
        fit = _fit(question, used, confirm)
        reasons.extend(fit.reasons)
        if isinstance(fit.outcome, _Miss):
            raise InsufficientMemoryError(fit.outcome.message)
    return used, fit.outcome, reasons


@dataclass(frozen=True)
class _Question:
    """What ``plan`` was asked, resolved: the budget, the micro-batch bounds and the target to split."""

    capacity_bytes: int
    margin: float
    budget: int
    world_size: int
    min_batch_size: int
    cap: int  # largest micro batch considered (the bound and the per-device target)
    per_device_target: int | None  # None: "max", no accumulation
    target_batch_size: int | None  # the effective batch to keep; None: "max"
    include_context: bool
    allocator: AllocatorConfig | None = None  # set: fit at the allocator's limit, under these options
    max_batch_size: int | None = None  # the caller's bound on the micro batch

    def largest_said(self, largest: int) -> str:
        """Why ``largest`` is the largest micro batch: what fits, or the caller's bound where it stopped the search."""
        if largest == self.max_batch_size:
            return f"micro batch {largest} fits and is the max_batch_size bound (larger ones were not tried)"
        return f"micro batch {largest} is the largest that fits"

    def largest(self, source: StepCurve) -> int:
        """Largest micro batch within the budget by ``source``'s interpolation (0: none)."""
        fit = source.max_batch_size(
            self.budget, include_context=self.include_context, at_limit=self.allocator is not None,
            allocator=self.allocator,
        )  # fmt: skip
        return 0 if fit is None else min(fit, self.cap)

    def at(self, curve: StepCurve, batch: int) -> BatchPeak:
        """The step's peaks at ``batch``, with the least it runs in at the allocator's limit where planned so."""
        return _with_least(curve.at(batch), curve, self.allocator)

    def predicted(self, peak: BatchPeak) -> int:
        """The figure compared with the budget: what the step needs at the allocator's limit (or its peak, where
        not planned so), with the CUDA context unless it is outside the capacity."""
        if self.allocator is not None and peak.least_reserved_bytes is not None:
            needed = peak.least_reserved_bytes
            return needed + (peak.device_bytes - peak.reserved_bytes) if self.include_context else needed
        return peak.device_bytes if self.include_context else peak.reserved_bytes

    def peak(self, curve: StepCurve, batch: int) -> str:
        return format_bytes(self.predicted(self.at(curve, batch)))

    def against(self) -> str:
        return f"a {budget_phrase(self.capacity_bytes, self.margin, self.budget)}"


@dataclass(frozen=True)
class _Candidate:
    """A traced step to plan from, and the largest micro batch its interpolation fits."""

    source: StepCurve
    largest_micro: int
    checkpointing: bool


@dataclass(frozen=True)
class _Candidates:
    """The candidate chosen first, the checkpointed one if it was traced, and why."""

    chosen: _Candidate
    checkpointed: _Candidate | None
    hopeless: bool  # the optimizer step alone is over budget: checkpointing cannot help
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Split:
    """A micro batch and accumulation that fit, with the largest micro batch found and its peak."""

    micro: int
    accumulation: int
    largest_micro: int
    peak: BatchPeak
    checkpointing: bool


@dataclass(frozen=True)
class _Miss:
    """Why nothing fits: the message of the final ``InsufficientMemoryError``."""

    message: str


@dataclass(frozen=True)
class _Fit:
    """A candidate's split that fits, or why none does, and the reasons found on the way."""

    outcome: _Split | _Miss
    reasons: tuple[str, ...] = ()


def _question(
    estimate: MemoryEstimate,
    capacity_bytes: int,
    margin: float,
    target_batch_size: int | Literal["max"] | None,
    world_size: int,
    min_batch_size: int,
    max_batch_size: int | None,
    include_context: bool,
) -> _Question:
    """Validate the arguments and resolve the target: ``None`` keeps the estimate's batch on every device."""
    _validate(capacity_bytes, margin, target_batch_size, world_size, min_batch_size, max_batch_size)
    cap = max_batch_size or _UNBOUNDED
    per_device_target = None
    target: int | None = None
    if isinstance(target_batch_size, int):
        target, per_device_target = target_batch_size, math.ceil(target_batch_size / world_size)
    elif target_batch_size is None:
        target, per_device_target = estimate.batch_size * world_size, estimate.batch_size
    if per_device_target is not None:
        cap = min(cap, per_device_target)
    return _Question(
        capacity_bytes=capacity_bytes,
        margin=margin,
        budget=int(capacity_bytes * (1.0 - margin)),
        world_size=world_size,
        min_batch_size=min_batch_size,
        cap=cap,
        per_device_target=per_device_target,
        target_batch_size=target,
        include_context=include_context,
        max_batch_size=max_batch_size,
    )


def _candidates(
    question: _Question,
    curve: StepCurve,
    allow_checkpointing: bool,
    with_checkpointing: Callable[[], StepCurve | None],
) -> _Candidates | _Miss:
    """Start without checkpointing; trace with it only when the minimum micro batch does not fit
    without it, or when it buys a markedly larger micro batch for a run that would otherwise crawl."""
    plain = _Candidate(curve, question.largest(curve), False)
    micro, minimum = plain.largest_micro, question.min_batch_size
    estimate = curve.estimate
    context = (estimate.cuda_context_bytes or 0) if question.include_context else 0
    floor = _optimizer_step_floor(estimate, minimum) + context
    hopeless = floor > question.budget  # checkpointing saves activations, not what the optimizer step holds
    chosen, checkpointed, reasons = plain, None, []
    small = allow_checkpointing and micro < SMALL_MICRO_BATCH and micro < question.cap
    if not hopeless and (micro < minimum or small):
        checkpointed = _candidate_with_checkpointing(question, with_checkpointing)
        micro_ckpt = checkpointed.largest_micro if checkpointed is not None else 0
        if checkpointed is not None and micro < minimum <= micro_ckpt:
            reasons.append(
                f"micro batch {minimum} needs {question.peak(curve, minimum)} without checkpointing, over "
                f"{question.against()}; checkpointing brings it within (about 20-30 % slower per "
                "step)"
            )
            chosen = checkpointed
        elif checkpointed is not None and minimum <= micro and micro_ckpt >= CHECKPOINTING_MIN_GAIN * max(micro, 1):
            reasons.append(
                f"without checkpointing only micro batch {micro} fits; with it {micro_ckpt} fits, worth its "
                "recompute (about 20-30 % slower per step)"
            )
            chosen = checkpointed
    if chosen.largest_micro >= minimum:
        return _Candidates(chosen, checkpointed, hopeless, tuple(reasons))
    peaks = f"predicted peak {question.peak(curve, minimum)}"
    if checkpointed is not None:
        peaks += f" ({question.peak(checkpointed.source, minimum)} with checkpointing)"
    tried = " even with checkpointing" if checkpointed is not None else ""
    if hopeless and allow_checkpointing:
        tried = " and checkpointing cannot help"
        peaks += f"; the optimizer step alone holds {format_bytes(floor)} ({_floor_parts(estimate, floor, context)})"
    advice = _advice(estimate)
    if context >= question.budget:
        advice = (
            f"The CUDA context alone takes {format_bytes(context)} in every GPU process: "
            "no step fits a budget below that; plan for a GPU or a larger budget."
        )
    return _Miss(f"micro batch {minimum} does not fit{tried}: {peaks} against {question.against()}. {advice}")


def _advice(estimate: MemoryEstimate) -> str:
    """What shrinks the step: a forward-only pass has no optimizer or gradients to lighten."""
    if estimate.inference:
        return (
            "Use a smaller model or sequence, half-precision or quantized weights, weights split across GPUs "
            "(tensor or pipeline parallelism), or a larger GPU."
        )
    precision = "" if estimate.precision.converts_to_half else " lower precision,"  # 16-bit weights already
    sharding = estimate.sharding
    if sharding is not None and sharding.shard_group_size > 1:  # sharded already: more ranks, or states offloaded
        offload = "" if sharding.offload_optimizer and sharding.offload_params else ", CPU offload"
        return (
            f"Use more GPUs than {sharding.world_size} (`memfit plan --gpus auto` finds the fewest){offload}, a "
            f"smaller model or sequence,{precision} a lighter optimizer, or a larger GPU."
        )
    return f"Use a smaller model or sequence,{precision} a lighter optimizer, sharding (FSDP/ZeRO), or a larger GPU."


def _candidate_with_checkpointing(
    question: _Question, with_checkpointing: Callable[[], StepCurve | None]
) -> _Candidate | None:
    traced = with_checkpointing()
    return None if traced is None else _Candidate(traced, question.largest(traced), True)


def _checkpointing_fallback(
    question: _Question, candidates: _Candidates, with_checkpointing: Callable[[], StepCurve | None]
) -> _Candidate | None:
    """When the chosen split did not fit once traced: the checkpointed candidate, if it may still fit."""
    if candidates.chosen.checkpointing or candidates.hopeless:
        return None
    checkpointed = candidates.checkpointed or _candidate_with_checkpointing(question, with_checkpointing)
    if checkpointed is None or checkpointed.largest_micro < question.min_batch_size:
        return None
    return checkpointed


def _checkpointing_pays(
    question: _Question,
    split: _Split,
    candidates: _Candidates,
    with_checkpointing: Callable[[], StepCurve | None],
    confirm: Confirm,
) -> tuple[_Split, list[str]] | None:
    """The checkpointed split, where the confirmed micro batch without checkpointing is small and checkpointing
    buys a markedly larger one once traced too (``_candidates``' rule, on the traced answer)."""
    largest = split.largest_micro
    if candidates.hopeless or largest >= SMALL_MICRO_BATCH or largest >= question.cap:
        return None
    checkpointed = _candidate_with_checkpointing(question, with_checkpointing)
    if checkpointed is None or checkpointed.largest_micro < CHECKPOINTING_MIN_GAIN * max(largest, 1):
        return None
    fit = _fit(question, checkpointed, confirm)
    if isinstance(fit.outcome, _Miss) or fit.outcome.largest_micro < CHECKPOINTING_MIN_GAIN * max(largest, 1):
        return None
    reason = (
        f"without checkpointing only micro batch {largest} fits once traced; with it {fit.outcome.largest_micro} "
        "fits, worth its recompute (about 20-30 % slower per step)"
    )
    return fit.outcome, [*fit.reasons, reason]


def _fit(question: _Question, candidate: _Candidate, confirm: Confirm | None) -> _Fit:
    """Split the candidate's largest micro batch against the target and make sure the split fits: on a
    trace at its size and accumulation (``confirm``), else with room for gradients that accumulation keeps."""
    if confirm is None:
        return _fit_keeping_gradients(question, candidate)
    return _fit_confirmed(question, candidate, confirm)


def _fit_keeping_gradients(question: _Question, candidate: _Candidate) -> _Fit:
    """The interpolated split; accumulating from a trace without accumulation keeps room for the gradients
    (``_kept_gradient_bytes``), which later micro batches run with."""
    source, largest = candidate.source, candidate.largest_micro
    micro, accumulation = _split(question.per_device_target, largest)
    kept = 0  # reserved bytes held for gradients that accumulation keeps and the estimate freed
    reasons = []
    if accumulation > 1 and source.estimate.accumulation_steps == 1:
        kept = _kept_gradient_bytes(source.estimate)
        if kept:
            refit = source.max_batch_size(
                question.budget - kept, include_context=question.include_context,
                at_limit=question.allocator is not None, allocator=question.allocator,
            ) or 0  # fmt: skip
            if refit < question.min_batch_size:
                return _Fit(_Miss(
                    f"micro batch {question.min_batch_size} does not fit with gradient accumulation, which keeps "
                    f"the gradients ({format_bytes(kept)}) alive through every micro batch; "
                    f"{question.against()}. Plan with confirm= for an exact answer."
                ))  # fmt: skip
            largest = min(refit, question.cap)
            reasons.append(
                f"accumulation keeps the gradients ({format_bytes(kept)}) alive through every micro batch; "
                "room is kept for them"
            )
            micro, accumulation = _split(question.per_device_target, largest)
    peak = question.at(source, micro)
    least = peak.least_reserved_bytes + kept if peak.least_reserved_bytes is not None else None
    with_kept = BatchPeak(
        micro, peak.allocated_bytes + min(kept, source.estimate.gradient_bytes), peak.reserved_bytes + kept,
        peak.device_bytes + kept, least,
    )  # fmt: skip
    return _Fit(_Split(micro, accumulation, largest, with_kept, candidate.checkpointing), tuple(reasons))


def _fit_confirmed(question: _Question, candidate: _Candidate, confirm: Confirm) -> _Fit:
    """The largest micro batch that fits by a full trace, split against the target.

    ``_largest_confirmed`` finds it (it fits once traced, the next does not, unless the cap stops it);
    the split of the target it gives (``_split``: an exact split may take a smaller micro batch and more
    steps) is traced too. Should that split not fit once traced (it holds more batches), the fewest
    steps are tried, then the search goes on below the micro batch found.
    """
    cap, reasons = question.cap, []
    while True:
        found = _largest_confirmed(question, candidate, confirm, cap, reasons)
        if isinstance(found, _Miss):
            return _Fit(found, tuple(reasons))
        largest = found
        splits = dict.fromkeys([
            _split(question.per_device_target, largest), _fewest_steps_split(question.per_device_target, largest)
        ])  # fmt: skip
        for micro, accumulation in splits:
            traced = _traced(question, confirm, micro, candidate.checkpointing, accumulation)
            if question.predicted(traced) <= question.budget:
                return _Fit(_Split(micro, accumulation, largest, traced, candidate.checkpointing), tuple(reasons))
        reasons.append(
            f"micro batch {largest} fits, but not its split of the target once traced "
            f"({' or '.join(f'{m} x {a}' for m, a in splits)}); searching below it"
        )
        if largest - 1 < question.min_batch_size:
            message = f"micro batch {largest} does not fit once split against the target; {question.against()}."
            return _Fit(_Miss(message), tuple(reasons))
        cap = largest - 1


def _largest_confirmed(
    question: _Question, candidate: _Candidate, confirm: Confirm, cap: int, reasons: list[str]
) -> int | _Miss:
    """The largest micro batch up to ``cap`` whose full trace fits: it fits and the next one does not (or it
    is ``cap``). Each micro batch runs with the fewest accumulation steps its target needs.

    A bracketing search over full traces (``_Bracket``): it starts at the interpolation's answer, steps by
    the room left or the overshoot over the per-sample growth (the interpolation's at first, then the
    traces' own) until a trace fits and a larger one does not, then closes the bracket the same way,
    bisecting where that does not converge. A handful of traces: where the interpolation is right, two
    (its answer and the one above).
    """
    search = _Bracket(question, candidate, confirm, cap)
    guess = probe = min(max(candidate.largest_micro, question.min_batch_size), cap)
    while True:
        fits = search.trace(probe)
        if search.done():
            break
        if search.fits is None and search.over is not None and search.over <= question.min_batch_size:
            break
        following = search.next_probe()
        if not fits and len(search.peaks) == 1:
            reasons.append(
                f"a trace at micro batch {probe} predicts {format_bytes(search.peaks[probe])}, over the budget the "
                f"interpolation allowed; trying {following}"
            )
        probe = following
    if search.fits is None:
        over = search.over
        accumulation = _fewest_steps(question.per_device_target, over)
        held = confirm(over, candidate.checkpointing, accumulation).estimate.extra_batches  # cached: traced just now
        holding = (
            f" (with {accumulation} accumulation steps, the loop holds {held} more batch(es) on the device: "
            "an out-of-memory recovery that replays the window keeps them, on_oom='raise' keeps none; a smaller target "
            "batch holds fewer)"
            if held
            else ""
        )
        # the same micro batch traced without accumulation: whether accumulating is what misses (a failure's one trace)
        alone = (
            question.predicted(_traced(question, confirm, over, candidate.checkpointing, 1))
            if accumulation > 1
            else None
        )
        accumulation_misses = alone is not None and alone <= question.budget
        accumulating = (
            f", accumulating {accumulation} steps toward the target of {question.per_device_target},"
            if accumulation_misses
            else ""
        )
        why = (
            f" Without accumulation it needs {format_bytes(alone)}: accumulation keeps every gradient from one micro "
            "batch to the next and adds each new one to it. Lower the target batch or raise the budget."
            if accumulation_misses
            else ""
        )
        return _Miss(
            f"micro batch {over} does not fit: a trace at that size{accumulating} predicts "
            f"{format_bytes(search.peaks[over])}{holding} against {question.against()}.{why}"
        )
    largest, budget = search.fits, question.budget
    if search.over is not None:
        interpolated = "" if largest == guess else f" (the interpolation said {guess})"
        reasons.append(
            f"micro batch {largest} fits once traced ({format_bytes(search.peaks[largest])}); {largest + 1} does "
            f"not ({format_bytes(search.peaks[largest + 1])}, {format_bytes(search.peaks[largest + 1] - budget)} "
            f"over){interpolated}"
        )
    return largest


class _Bracket:
    """The traces of a search for the largest micro batch that fits: ``fits`` is the largest traced within
    the budget, ``over`` the smallest over it; every probe lies strictly between them, so the search ends."""

    RUN_BEFORE_DOUBLING = 3  # probes the same way (all fit, or none) after which the step at least doubles

    def __init__(self, question: _Question, candidate: _Candidate, confirm: Confirm, cap: int) -> None:
        self.question, self.candidate, self.confirm, self.cap = question, candidate, confirm, cap
        self.peaks: dict[int, int] = {}  # micro batch -> the figure compared with the budget
        self.fits: int | None = None
        self.over: int | None = None
        self._order: list[int] = []
        self._inside: list[bool] = []  # whether each probe inside the bracket fitted
        self._last_step = 0

    def trace(self, micro: int) -> bool:
        accumulation = _fewest_steps(self.question.per_device_target, micro)
        peak = _traced(self.question, self.confirm, micro, self.candidate.checkpointing, accumulation)
        self.peaks[micro] = self.question.predicted(peak)
        self._order.append(micro)
        fits = self._fits(micro)
        if self.fits is not None and self.over is not None:
            self._inside.append(fits)
        if fits:
            self.fits = max(micro, self.fits or 0)
        else:
            self.over = micro if self.over is None else min(micro, self.over)
        return fits

    def done(self) -> bool:
        return self.fits is not None and (self.fits >= self.cap or self.over == self.fits + 1)

    def next_probe(self) -> int:
        """Inside the bracket, where the growth between its ends reaches the budget, or its middle when the
        last two probes there fell on the same side (a curve far from linear); outside, step up or down by
        the room or the overshoot over the growth, at most doubling or halving the micro batch."""
        budget, fits, over = self.question.budget, self.fits, self.over
        growth = self._growth()
        if fits is not None and over is not None:
            stuck = len(self._inside) >= 2 and self._inside[-1] == self._inside[-2]
            if stuck or growth <= 0:
                probe = (fits + over) // 2
            else:
                probe = fits + math.floor((budget - self.peaks[fits]) / growth)
            return min(max(probe, fits + 1), over - 1)
        doubling = 2 * self._last_step if self._run() >= self.RUN_BEFORE_DOUBLING else 0
        if fits is not None:  # everything traced fits: step up
            room = (budget - self.peaks[fits]) / growth if growth > 0 else fits
            self._last_step = min(max(1, math.floor(room), doubling), max(1, fits))
            return min(fits + self._last_step, self.cap)
        assert over is not None  # everything traced is over: step down
        overshoot = (self.peaks[over] - budget) / growth if growth > 0 else over
        self._last_step = min(max(1, math.ceil(overshoot), doubling), over // 2 or 1)
        return max(over - self._last_step, self.question.min_batch_size)

    def _fits(self, micro: int) -> bool:
        return self.peaks[micro] <= self.question.budget

    def _run(self) -> int:
        """How many of the last probes went the same way (all fit, or none did)."""
        outcomes = [self._fits(micro) for micro in reversed(self._order)]
        return next((i for i, outcome in enumerate(outcomes) if outcome != outcomes[0]), len(outcomes))

    def _growth(self) -> float:
        """Bytes per sample: between the traces nearest the budget once there are two, else the interpolation's."""
        points = [p for p in (self.fits, self.over) if p is not None]
        if len(points) < 2 and len(self._order) >= 2:
            points = self._order[-2:]
        if len(points) == 2:
            low, high = sorted(points)
            return (self.peaks[high] - self.peaks[low]) / (high - low)
        source, micro = self.candidate.source, self._order[-1]
        question = self.question
        larger, smaller = question.at(source, 2 * micro + 1), question.at(source, micro)
        return (question.predicted(larger) - question.predicted(smaller)) / (micro + 1)


def _traced(question: _Question, confirm: Confirm, micro: int, checkpointing: bool, accumulation: int) -> BatchPeak:
    exact = confirm(micro, checkpointing, accumulation)
    traced = exact.estimate
    peak = BatchPeak(micro, traced.peak_allocated_bytes, traced.peak_reserved_bytes, traced.peak_bytes)
    return _with_least(peak, exact, question.allocator)


def _with_least(peak: BatchPeak, curve: StepCurve, allocator: AllocatorConfig | None) -> BatchPeak:
    """``peak`` with the least reserved memory its step runs in at the allocator's limit, where planned so
    (``allocator`` set) and the step's log can be replayed."""
    if allocator is None:
        return peak
    least = curve.least_device_bytes(peak.batch_size, allocator=allocator)
    if least is None:
        return peak
    return dataclasses.replace(peak, least_reserved_bytes=least - (curve.estimate.cuda_context_bytes or 0))


def _explain(question: _Question, split: _Split) -> list[str]:
    """How the split keeps the target, or, where it does not, what it runs instead and why."""
    effective = split.micro * split.accumulation * question.world_size
    target = question.target_batch_size
    if question.per_device_target is None or target is None:
        if split.micro == question.max_batch_size:
            return [question.largest_said(split.micro)]
        return [f"largest micro batch that fits: {split.micro}"]
    if effective != target:
        return [
            f"{question.largest_said(split.largest_micro)}; with {split.accumulation} accumulation "
            f"step(s) of {split.micro} x {question.world_size} device(s) the effective batch {effective} differs "
            f"from the target {target}: {_why_not_exact(target, question.world_size, split.largest_micro)}"
        ]
    if split.accumulation > 1:
        per_device = target // question.world_size
        fewest = -(-per_device // split.largest_micro)
        why = (
            f" ({fewest} steps of {split.largest_micro} would run {fewest * split.largest_micro * question.world_size}"
            " samples, not the target)"
            if split.micro < split.largest_micro and per_device % split.largest_micro
            else ""
        )
        return [
            f"{question.largest_said(split.largest_micro)}; {split.accumulation} accumulation "
            f"steps of {split.micro} keep the effective batch of {target}{why}"
        ]
    return [f"the target fits in one micro batch of {split.micro}"]


def _why_not_exact(target: int, world_size: int, largest: int) -> str:
    """Why no split hits ``target`` exactly: the devices do not divide it, or the exact split is too slow."""
    if target % world_size:
        return f"{target} is not a multiple of {world_size} devices"
    per_device = target // world_size
    micro = max(d for d in range(1, min(largest, per_device) + 1) if per_device % d == 0)
    exact = f"micro batch {micro} x {per_device // micro} steps"
    if 2 * micro < largest:
        return f"hitting it exactly takes {exact}, under half the largest that fits, so a few more samples run instead"
    return f"the exact split, {exact}, does not fit"


def _chosen_plan(question: _Question, split: _Split, reasons: list[str]) -> Plan:
    return Plan(
        micro_batch_size=split.micro,
        accumulate_grad_batches=split.accumulation,
        gradient_checkpointing=split.checkpointing,
        world_size=question.world_size,
        effective_batch_size=split.micro * split.accumulation * question.world_size,
        target_batch_size=question.target_batch_size,
        # the peak with room to spare (what _at_the_limit replaces by the peak on the capacity, where it can replay
        # the log), and what the step needs at the allocator's limit, the figure compared with the budget
        predicted_peak_bytes=split.peak.device_bytes if question.include_context else split.peak.reserved_bytes,
        needed_bytes=question.predicted(split.peak),
        capacity_bytes=question.capacity_bytes,
        budget_bytes=question.budget,
        margin=question.margin,
        largest_micro_batch=split.largest_micro,
        predicted_allocated_bytes=split.peak.allocated_bytes,
        predicted_reserved_bytes=split.peak.reserved_bytes,
        reasons=tuple(reasons),
    )


def _at_the_limit(question: _Question, chosen: Plan, split: _Split, source: StepCurve) -> Plan:
    """What the allocator does on the device with the chosen micro batch: the peak the run reaches there (what it
    measures), whether it must free its cache and retry (slower steps), and, where the step fits only at the
    allocator's limit, what it needs there and what expandable segments would change."""
    config = question.allocator
    assert config is not None
    value = source.estimate
    context = (value.cuda_context_bytes or 0) if question.include_context else 0
    at_capacity = source.at_limit(
        split.micro, question.capacity_bytes, include_context=question.include_context, allocator=config
    )
    free_running = source.at_limit(split.micro, _UNBOUNDED_BYTES, include_context=False, allocator=config)
    if at_capacity is None or free_running is None:
        return chosen
    reasons = list(chosen.reasons)
    settings = config.setting() or "torch's defaults"
    needed = chosen.needed_bytes
    with_room = free_running.peak_reserved_bytes + context
    tight = with_room > question.budget or at_capacity.alloc_retries > 0
    if with_room > question.budget:
        reasons.append(
            f"it fits only with the allocator at its limit ({settings}): with room to spare the step would reserve "
            f"{format_bytes(with_room)}, over {_over(question)}; it needs "
            f"{format_bytes(needed)}, where the caching allocator frees its cached blocks and retries instead of "
            f"running out of memory; on {format_bytes(question.capacity_bytes)} it reserves up to "
            f"{format_bytes(at_capacity.peak_reserved_bytes + context)} (the predicted peak)"
        )
    if at_capacity.alloc_retries:
        reasons.append(
            f"on {format_bytes(question.capacity_bytes)} the allocator frees its cache and retries "
            f"{at_capacity.alloc_retries} time(s) {'in one forward pass' if value.inference else 'in two steps'} "
            "(each a device synchronization: slower steps; "
            "torch.cuda.memory_stats()['num_alloc_retries'] counts them)"
        )
    if tight and not config.expandable_segments:
        expandable = dataclasses.replace(config, expandable_segments=True)
        least = source.least_device_bytes(split.micro, allocator=expandable)
        if least is not None and least < needed:
            reasons.append(
                f"with PYTORCH_ALLOC_CONF=expandable_segments:True the step would need {format_bytes(least)} "
                f"({format_bytes(needed - least)} less: segments grow in place, with less fragmentation)"
            )
    if config.unmodelled:
        reasons.append(f"allocator options not modelled, planned as torch's defaults: {', '.join(config.unmodelled)}")
    return dataclasses.replace(
        chosen,
        predicted_peak_bytes=at_capacity.peak_reserved_bytes + context,
        predicted_reserved_bytes=at_capacity.peak_reserved_bytes,
        # the least is found to RESERVE_RESOLUTION; the step ran within the peak it reached on the capacity, and a
        # limit acts only past what the step reserves, so it needs no more than that peak
        needed_bytes=min(needed, at_capacity.peak_reserved_bytes + context),
        alloc_retries=at_capacity.alloc_retries,
        allocator_settings=config.setting(),
        reasons=tuple(reasons),
    )


def _kept_gradient_bytes(estimate: MemoryEstimate) -> int:
    """Room for gradients kept alive through every micro batch, in reserved bytes: their blocks at the
    allocator's traced ratio, rounded up to whole segments plus one (a simulated caching allocator, CUDA's, may
    open new ones for them)."""
    gradients = estimate.gradient_bytes
    backend = find_backend(estimate.device)
    if not gradients or backend is None or not backend.simulates_caching_allocator:
        return gradients
    scaled = math.ceil(gradients * estimate.reserved_to_allocated_ratio)
    return -(-scaled // SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER


def _split(per_device_target: int | None, largest: int) -> tuple[int, int]:
    """Micro batch and accumulation for a per-device target (``None``: "max", no accumulation)."""
    if per_device_target is None:
        return largest, 1
    accumulation = _accumulation_steps(per_device_target, largest)
    return math.ceil(per_device_target / accumulation), accumulation  # same steps, smallest micro batch


def _fewest_steps(per_device_target: int | None, micro: int) -> int:
    """Accumulation steps micro batch ``micro`` needs on its own to reach the target (1 for "max")."""
    return 1 if per_device_target is None else math.ceil(per_device_target / micro)


def _fewest_steps_split(per_device_target: int | None, largest: int) -> tuple[int, int]:
    """The split with the fewest steps (no exact-split preference): the one holding the fewest batches."""
    accumulation = _fewest_steps(per_device_target, largest)
    return (largest if per_device_target is None else math.ceil(per_device_target / accumulation)), accumulation


def _accumulation_steps(per_device_target: int, largest: int) -> int:
    """Fewest steps whose micro batch fits; a few more steps if that hits the target exactly.

    The effective batch is a hyperparameter, so an exact split (32 = 4 x 8) is preferred to the
    fewest steps (7 x 5 = 35), as long as the micro batch stays at least half the largest that fits.
    """
    fewest = math.ceil(per_device_target / largest)
    for steps in range(fewest, 2 * fewest + 1):
        if per_device_target % steps == 0 and per_device_target // steps >= largest / 2:
            return steps
    return fewest


def _optimizer_step_floor(estimate: MemoryEstimate, batch_size: int) -> int:
    """Allocated bytes of the optimizer step at ``batch_size``: checkpointing does not bring a step below them.

    At that batch, not the traced one: the step also holds what scales with the batch (the batch itself,
    batches the loop keeps), so the traced batch's figure can exceed the whole peak at a smaller one."""
    fitted = [m.at(batch_size) for m in estimate.phase_models if m.phase is Phase.OPTIMIZER]
    if fitted:
        return max(fitted)
    return max((p.allocated_bytes for p in estimate.phases if p.phase is Phase.OPTIMIZER), default=0)


_MODEL_STATES = (
    Category.PARAMETERS,
    Category.BUFFERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.SHARDING_BUFFERS,
    Category.GRADIENT_BUCKETS,
)


def _floor_parts(estimate: MemoryEstimate, floor: int, context: int) -> str:
    """What the optimizer step's ``floor`` is made of, largest first: the model's states, the CUDA context (a
    small model's floor is mostly the context and cuBLAS's workspace), and the rest of the step."""
    steps = [p for p in estimate.phases if p.phase is Phase.OPTIMIZER] or list(estimate.phases)
    top = max(steps, key=lambda p: p.allocated_bytes, default=None)
    states = sum(top.breakdown.get(c, 0) for c in _MODEL_STATES) if top is not None else 0
    states = min(states, floor - context)
    parts = [
        (states, "parameters, gradients and optimizer state"),
        (context, "the CUDA context"),
        (floor - context - states, "workspace, inputs and temporaries"),
    ]
    return ", ".join(f"{what} {format_bytes(size)}" for size, what in sorted(parts, reverse=True) if size > 0)


def _over(question: _Question) -> str:
    """What a figure is over: the budget after its margin, first (a figure between the two is over the one and
    under the other)."""
    if not question.margin or question.budget >= question.capacity_bytes:
        return question.against()
    return (
        f"the {format_bytes(question.budget)} a {format_bytes(question.capacity_bytes)} budget leaves after its "
        f"{format_margin(question.margin)} margin"
    )


def budget_phrase(capacity_bytes: int, margin: float, budget_bytes: int) -> str:
    """The budget as it was given, the margin kept free of it beside: ``40.00 MiB budget (39.00 MiB after its
    1.5% margin)``."""
    if not margin or budget_bytes >= capacity_bytes:
        return f"{format_bytes(capacity_bytes)} budget"
    return (
        f"{format_bytes(capacity_bytes)} budget ({format_bytes(budget_bytes)} after its {format_margin(margin)} margin)"
    )


def _resolve(source: EstimateSource) -> StepCurve | None:
    resolved = source() if callable(source) and not isinstance(source, StepCurve) else source
    return None if resolved is None else _curve_of(resolved, "plan(checkpointed=)")


def _confirming(confirm: Confirm) -> Confirm:
    """``confirm``, each configuration traced once, each answer checked to be a traced step."""

    @functools.cache
    def confirmed(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        return _curve_of(confirm(micro, checkpointing, accumulation), "what plan(confirm=) returns")

    return confirmed


def _curve_of(given: Any, what: str) -> StepCurve:
    """``given`` as the traced step a plan searches on; a ``MemoryEstimate`` (a value, no trace) says where to go."""
    if isinstance(given, StepCurve):
        return given
    if isinstance(given, MemoryEstimate):
        raise InvalidInputError(
            f"{what} must be the traced step, not a MemoryEstimate (a value, read at its own batch only): use "
            "memfit.trace(model, sample, ...), which takes memfit.estimate's arguments"
        )
    raise InvalidInputError(f"{what} must be a memfit.StepCurve (memfit.trace(...)), got {type(given).__name__}")


def _said_with(message: str, more: list[str]) -> str:
    """``message`` and what else the user should know of the miss, in one line."""
    return "; ".join([message.rstrip("."), *more]) + "." if more else message


def _capacity_of(text: str) -> int:
    """A size or a GPU name, as bytes; a string that is neither is refused in one line saying what is taken."""
    return capacity_bytes(text, "capacity_bytes")


def _validate(
    capacity_bytes: Any,
    margin: Any,
    target_batch_size: Any,
    world_size: Any,
    min_batch_size: Any,
    max_batch_size: Any,
) -> None:
    def positive_int(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")

    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise InvalidInputError(f"capacity_bytes must be a positive number of bytes, got {capacity_bytes!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InvalidInputError(f"margin must be a fraction in [0, 1), got {margin!r}")
    if target_batch_size is not None and target_batch_size != "max":
        positive_int("target_batch_size", target_batch_size)
    positive_int("world_size", world_size)
    positive_int("min_batch_size", min_batch_size)
    if max_batch_size is not None:
        positive_int("max_batch_size", max_batch_size)
        if max_batch_size < min_batch_size:
            raise InvalidInputError(
                f"max_batch_size ({max_batch_size}) must be at least min_batch_size ({min_batch_size})"
            )
