"""Choose the micro batch, gradient accumulation and checkpointing that fit a memory budget.

Pure arithmetic over ``MemoryEstimate`` objects: no framework, no device. The rules:

* budget = capacity x (1 - margin); a micro batch fits when its predicted peak is within budget;
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

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from memfit.categories import Phase
from memfit.errors import InsufficientMemoryError, InvalidInputError
from memfit.prediction.estimator import BatchPeak, MemoryEstimate
from memfit.simulation.allocator import SMALL_BUFFER
from memfit.units import format_bytes

__all__ = ["CHECKPOINTING_MIN_GAIN", "SMALL_MICRO_BATCH", "Plan", "plan"]

# Checkpointing is worth its recompute when the micro batch without it would be below
# SMALL_MICRO_BATCH and checkpointing makes it at least CHECKPOINTING_MIN_GAIN times larger.
SMALL_MICRO_BATCH = 4
CHECKPOINTING_MIN_GAIN = 4.0
_UNBOUNDED = 1 << 31


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

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.predicted_peak_bytes

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
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The inverse of ``to_dict`` (a plan read back from a checkpoint or JSON)."""
        return cls(**{**data, "reasons": tuple(data.get("reasons", ()))})

    def summary(self) -> str:
        """One line for logs: ``micro 12 x accumulation 3 x 1 device = 36 (target 36), peak ...``."""
        target = f" (target {self.target_batch_size})" if self.target_batch_size else ""
        ckpt = ", checkpointing on" if self.gradient_checkpointing else ""
        return (
            f"micro batch {self.micro_batch_size} x accumulation {self.accumulate_grad_batches} x "
            f"{self.world_size} device(s) = {self.effective_batch_size}{target}{ckpt}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)} budget"
        )


EstimateSource = MemoryEstimate | Callable[[], MemoryEstimate] | None


def plan(
    estimate: MemoryEstimate,
    capacity_bytes: int,
    *,
    margin: float = 0.05,
    target_batch_size: int | Literal["max"] | None = None,
    world_size: int = 1,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    allow_checkpointing: bool = True,
    checkpointed: EstimateSource = None,
    include_context: bool = True,
    confirm: Callable[[int, bool, int], MemoryEstimate] | None = None,
) -> Plan:
    """Pick the plan for ``estimate`` (traced without checkpointing) within ``capacity_bytes``.

    Args:
        capacity_bytes: memory the run may use on each device.
        margin: fraction of the capacity kept free, for what no prediction covers.
        target_batch_size: effective batch to keep across micro batches, accumulation and devices;
            ``None`` keeps the estimate's batch x ``world_size``; ``"max"`` maximises the micro batch.
        min_batch_size / max_batch_size: bounds on the micro batch.
        checkpointed: the same step traced with checkpointing, or a callable that traces it on
            demand (only called when checkpointing is considered).
        include_context: ``False`` when ``capacity_bytes`` was measured after CUDA started in this
            process, so the context is already outside it.
        confirm: ``confirm(micro_batch, checkpointing, accumulation_steps)`` traces the step at the chosen
            micro batch and accumulation; the plan then uses that exact prediction instead of the
            interpolation, and steps down while it is over budget (interpolating below the traced batch
            can underestimate, and accumulation keeps gradients alive through later micro batches).
            Without it, a plan that accumulates from an estimate traced without accumulation keeps
            room for the gradients on top (an upper bound).

    Raises:
        InsufficientMemoryError: not even ``min_batch_size`` fits, with checkpointing if allowed.
    """
    _validate(capacity_bytes, margin, target_batch_size, world_size, min_batch_size, max_batch_size)
    budget = int(capacity_bytes * (1.0 - margin))
    cap = max_batch_size or _UNBOUNDED
    per_device_target = None
    if isinstance(target_batch_size, int):
        per_device_target = math.ceil(target_batch_size / world_size)
        cap = min(cap, per_device_target)
    elif target_batch_size is None:
        target_batch_size = estimate.batch_size * world_size
        per_device_target = estimate.batch_size
        cap = min(cap, per_device_target)
    reasons: list[str] = []

    def largest(source: MemoryEstimate) -> int:
        fit = source.max_batch_size(budget, include_context=include_context)
        return 0 if fit is None else min(fit, cap)

    chosen = estimate
    micro = largest(estimate)
    use_checkpointing = False
    with_ckpt: MemoryEstimate | None = None
    floor = _optimizer_step_floor(estimate) + ((estimate.cuda_context_bytes or 0) if include_context else 0)
    hopeless = floor > budget  # checkpointing saves activations, not what the optimizer step holds
    if not hopeless and (micro < min_batch_size or (allow_checkpointing and micro < SMALL_MICRO_BATCH and micro < cap)):
        with_ckpt = _resolve(checkpointed) if allow_checkpointing else None
        micro_ckpt = largest(with_ckpt) if with_ckpt is not None else 0
        if micro < min_batch_size and micro_ckpt >= min_batch_size:
            reasons.append(
                f"micro batch {min_batch_size} needs {_peak(estimate, min_batch_size, include_context)} "
                f"without checkpointing, over the {format_bytes(budget)} budget; checkpointing brings it "
                "within (about 20-30 % slower per step)"
            )
            chosen, micro, use_checkpointing = with_ckpt, micro_ckpt, True
        elif micro >= min_batch_size and micro_ckpt >= CHECKPOINTING_MIN_GAIN * max(micro, 1):
            reasons.append(
                f"without checkpointing only micro batch {micro} fits; with it {micro_ckpt} fits, worth its "
                "recompute (about 20-30 % slower per step)"
            )
            chosen, micro, use_checkpointing = with_ckpt, micro_ckpt, True
    if micro < min_batch_size:
        peaks = f"predicted peak {_peak(estimate, min_batch_size, include_context)}"
        if with_ckpt is not None:
            peaks += f" ({_peak(with_ckpt, min_batch_size, include_context)} with checkpointing)"
        tried = " even with checkpointing" if with_ckpt is not None else ""
        if hopeless and allow_checkpointing:
            tried = " and checkpointing cannot help"
            peaks += f"; the optimizer step alone holds {format_bytes(floor)} (parameters, gradients, optimizer state)"
        raise InsufficientMemoryError(
            f"micro batch {min_batch_size} does not fit{tried}: {peaks} against a budget of {format_bytes(budget)} "
            f"({format_bytes(capacity_bytes)} capacity, {margin:.0%} margin). Use a smaller model or "
            "sequence, lower precision, a lighter optimizer, sharding (FSDP/ZeRO), or a larger GPU."
        )

    def settle(source: MemoryEstimate, largest_micro: int, checkpointing: bool) -> tuple[int, int, int, BatchPeak]:
        """Split the largest micro batch against the target and make sure the split fits: on a trace at
        its size and accumulation (``confirm``), else with room for gradients that accumulation keeps."""
        kept = 0  # reserved bytes held for gradients that accumulation keeps and the estimate freed
        while True:
            micro, accumulation = _split(per_device_target, largest_micro)
            if confirm is None:
                if accumulation > 1 and source.accumulation_steps == 1 and not kept:
                    kept = _kept_gradient_bytes(source)
                    if kept:
                        refit = source.max_batch_size(budget - kept, include_context=include_context) or 0
                        if refit < min_batch_size:
                            raise InsufficientMemoryError(
                                f"micro batch {min_batch_size} does not fit with gradient accumulation, which keeps "
                                f"the gradients ({format_bytes(kept)}) alive through every micro batch; "
                                f"budget {format_bytes(budget)}. Plan with confirm= for an exact answer."
                            )
                        largest_micro = min(refit, cap)
                        reasons.append(
                            f"accumulation keeps the gradients ({format_bytes(kept)}) alive through "
                            "every micro batch; room is kept for them"
                        )
                        continue
                peak = source.at(micro)
                return micro, accumulation, largest_micro, BatchPeak(
                    micro, peak.allocated_bytes + min(kept, source.gradient_bytes), peak.reserved_bytes + kept,
                    peak.device_bytes + kept,
                )  # fmt: skip
            exact = confirm(micro, checkpointing, accumulation)
            traced = BatchPeak(micro, exact.peak_allocated_bytes, exact.peak_reserved_bytes, exact.peak_bytes)
            predicted = traced.device_bytes if include_context else traced.reserved_bytes
            if predicted <= budget:
                return micro, accumulation, largest_micro, traced
            if micro - 1 < min_batch_size:
                raise InsufficientMemoryError(
                    f"micro batch {micro} does not fit: a trace at that size predicts {format_bytes(predicted)} "
                    f"against a budget of {format_bytes(budget)} ({format_bytes(capacity_bytes)} capacity, "
                    f"{margin:.0%} margin)."
                )
            # Step down by the overshoot over the per-sample growth, at least one sample at a time.
            low = source.at(1)
            growth = (source.at(micro).reserved_bytes - low.reserved_bytes) / max(1, micro - 1)
            step = max(1, math.ceil((predicted - budget) / growth)) if growth > 0 else 1
            next_micro = max(min_batch_size, micro - step)
            reasons.append(
                f"a trace at micro batch {micro} predicts {format_bytes(predicted)}, over the budget the "
                f"interpolation allowed; trying {next_micro}"
            )
            largest_micro = next_micro

    try:
        micro, accumulation, largest_micro, peak = settle(chosen, micro, use_checkpointing)
    except InsufficientMemoryError:
        # The split (or its accumulation) did not fit once traced: checkpointing may still make it fit.
        if use_checkpointing or not allow_checkpointing or hopeless:
            raise
        with_ckpt = with_ckpt if with_ckpt is not None else _resolve(checkpointed)
        micro_ckpt = largest(with_ckpt) if with_ckpt is not None else 0
        if with_ckpt is None or micro_ckpt < min_batch_size:
            raise
        reasons.append(
            f"micro batch {min_batch_size} does not fit once traced at its size; checkpointing brings it within "
            "(about 20-30 % slower per step)"
        )
        chosen, use_checkpointing = with_ckpt, True
        micro, accumulation, largest_micro, peak = settle(with_ckpt, micro_ckpt, True)
    allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
    predicted = peak.device_bytes if include_context else peak.reserved_bytes

    if per_device_target is None:
        reasons.append(f"largest micro batch that fits: {micro}")
    elif accumulation > 1:
        reasons.append(
            f"micro batch {largest_micro} is the largest that fits; {accumulation} accumulation "
            f"steps of {micro} keep the effective batch"
        )
    else:
        reasons.append(f"the target fits in one micro batch of {micro}")
    effective = micro * accumulation * world_size
    if isinstance(target_batch_size, int) and effective != target_batch_size:
        reasons.append(
            f"effective batch {effective} differs from the target {target_batch_size}: integer micro "
            f"batches x {accumulation} steps x {world_size} device(s) cannot hit it exactly"
        )
    return Plan(
        micro_batch_size=micro,
        accumulate_grad_batches=accumulation,
        gradient_checkpointing=use_checkpointing,
        world_size=world_size,
        effective_batch_size=effective,
        target_batch_size=target_batch_size if isinstance(target_batch_size, int) else None,
        predicted_peak_bytes=predicted,
        capacity_bytes=capacity_bytes,
        budget_bytes=budget,
        margin=margin,
        largest_micro_batch=largest_micro,
        predicted_allocated_bytes=allocated,
        predicted_reserved_bytes=reserved,
        reasons=tuple(reasons),
    )


def _kept_gradient_bytes(estimate: MemoryEstimate) -> int:
    """Room for gradients kept alive through every micro batch, in reserved bytes: their blocks at the
    allocator's traced ratio, rounded up to whole segments plus one (on CUDA they may open new ones)."""
    gradients = estimate.gradient_bytes
    if not gradients or estimate.device != "cuda":
        return gradients
    scaled = math.ceil(gradients * estimate.reserved_to_allocated_ratio)
    return -(-scaled // SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER


def _split(per_device_target: int | None, largest: int) -> tuple[int, int]:
    """Micro batch and accumulation for a per-device target (``None``: "max", no accumulation)."""
    if per_device_target is None:
        return largest, 1
    accumulation = _accumulation_steps(per_device_target, largest)
    return math.ceil(per_device_target / accumulation), accumulation  # same steps, smallest micro batch


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


def _optimizer_step_floor(estimate: MemoryEstimate) -> int:
    """Allocated bytes of the optimizer step: no checkpointing or smaller batch brings a step below them."""
    return max((p.allocated_bytes for p in estimate.phases if p.phase is Phase.OPTIMIZER), default=0)


def _resolve(source: EstimateSource) -> MemoryEstimate | None:
    return source() if callable(source) and not isinstance(source, MemoryEstimate) else source


def _peak(estimate: MemoryEstimate, batch: int, include_context: bool) -> str:
    peak = estimate.at(batch)
    return format_bytes(peak.device_bytes if include_context else peak.reserved_bytes)


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
