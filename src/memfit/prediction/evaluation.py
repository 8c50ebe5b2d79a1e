"""The evaluation pass in the middle of training: a forward beside the training state.

A validation pass runs in eval mode without gradients, but not on an empty device: the optimizer
state (and DDP's gradient buckets) stay from training. Lightning releases the gradients before
its validation loop (``on_validation_model_zero_grad``) and the Hugging Face Trainer after every
optimizer step, so the gradients are gone. A validation batch larger than the training batch, a
common setting, can run out of memory where training did not; this tells before the run starts.

An evaluation loop may also collect each batch's outputs on the device for its metrics: the
Hugging Face Trainer keeps every batch's loss, logits and labels there until
``eval_accumulation_steps`` batches have run (by default until the end of the evaluation set),
and grows them by concatenation, which copies everything collected so far at every batch. For a
language model the logits alone are ``batch x sequence x vocabulary`` numbers per batch, so this,
not the forward, is what runs out of memory. ``CollectedOutputs`` describes that collection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate
from memfit.units import format_bytes

__all__ = [
    "CollectedOutputs",
    "EvaluationPeak",
    "evaluation_peak",
    "fitted_evaluation",
    "largest_flush_every",
    "nested_tensor_bytes",
]

_CARRIED = (Category.OPTIMIZER_STATE, Category.GRADIENT_BUCKETS)


@dataclass(frozen=True)
class CollectedOutputs:
    """Outputs an evaluation loop collects on the device from every batch, for its metrics.

    Args:
        bytes_per_sample: bytes per sample of each collection (e.g. ``{"predictions": ..., "labels": ...}``);
            each is grown on its own, so a concatenation copies one collection at a time.
        samples: samples collected over the whole pass (with several processes gathering their
            outputs, all processes' samples).
        samples_per_batch: samples added by one evaluation batch (the batch size, times the number
            of processes when outputs are gathered).
        flush_every: batches after which the collection leaves the device (the HF Trainer's
            ``eval_accumulation_steps``); ``None``: it stays to the end of the pass.
        concatenated: each batch is concatenated to what was collected (a copy of it all) rather
            than appended to a list.
        end_copy_bytes_per_sample: bytes per sample of the copy each collection gets as it leaves at
            the end of the pass, while it is still held, where that copy takes the same memory (the
            HF Trainer converts bfloat16 to float32 for numpy; on the CPU that is the device's memory).
            Collections are converted one after the other, in the order of ``bytes_per_sample``.
    """

    bytes_per_sample: Mapping[str, float]
    samples: int
    samples_per_batch: int
    flush_every: int | None = None
    concatenated: bool = True
    end_copy_bytes_per_sample: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("samples", "samples_per_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
        if self.flush_every is not None and (
            isinstance(self.flush_every, bool) or not isinstance(self.flush_every, int) or self.flush_every < 1
        ):
            raise InvalidInputError(f"flush_every must be a positive integer or None, got {self.flush_every!r}")
        for name in ("bytes_per_sample", "end_copy_bytes_per_sample"):
            # sizes read off a symbolic trace arrive as sympy numbers: plain floats keep the sums plain ints
            sizes = {key: float(size) for key, size in getattr(self, name).items()}
            object.__setattr__(self, name, sizes)
            if any(size < 0 for size in sizes.values()):
                raise InvalidInputError(f"{name} must not be negative, got {dict(sizes)}")
        if unknown := set(self.end_copy_bytes_per_sample) - set(self.bytes_per_sample):
            raise InvalidInputError(f"end_copy_bytes_per_sample names collections not collected: {sorted(unknown)}")

    @property
    def batches(self) -> int:
        return math.ceil(self.samples / self.samples_per_batch)

    @property
    def total_bytes_per_sample(self) -> float:
        return float(sum(self.bytes_per_sample.values()))

    def flushed_every(self, batches: int | None) -> CollectedOutputs:
        return replace(self, flush_every=batches)


@dataclass(frozen=True)
class EvaluationPeak:
    """Predicted peaks of an evaluation pass during training (allocated, reserved, with the context)."""

    batch_size: int
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    carried_bytes: int  # optimizer state and DDP buckets kept from training
    collected_bytes: int = 0  # outputs collected for the metrics, at the peak
    collected: CollectedOutputs | None = field(default=None, repr=False)
    forward: MemoryEstimate | None = field(default=None, repr=False)  # the forward-only estimate
    traced: StepCurve | None = field(default=None, repr=False, compare=False)  # the same pass, read at any batch

    def summary(self) -> str:
        parts = [f"{format_bytes(self.carried_bytes)} of it kept from training"] if self.carried_bytes else []
        if self.collected is not None and self.collected_bytes:
            window = self.collected.flush_every
            over = f"every {window} batches" if window else f"all {self.collected.batches} batches"
            parts.append(f"{format_bytes(self.collected_bytes)} outputs collected for metrics ({over})")
        detail = f" ({'; '.join(parts)})" if parts else ""
        return f"evaluation at batch {self.batch_size} needs {format_bytes(self.device_bytes)}{detail}"


def evaluation_peak(
    training: MemoryEstimate | StepCurve | None,
    evaluation: StepCurve | MemoryEstimate,
    *,
    collected: CollectedOutputs | None = None,
    keeps_training_batches: bool = False,
) -> EvaluationPeak:
    """Peaks of the forward-only pass ``evaluation`` (``memfit.trace(..., inference=True)``, or its estimate, whose
    ``collected`` outputs over a last, smaller batch are then read off the fit between its traced batches) run beside
    what ``training`` (the run's training estimate) keeps between steps; ``None`` for a pass with
    nothing kept from training (a model that has not trained, or a fresh process).

    Args:
        collected: outputs the loop collects on the device batch after batch, if any.
        keeps_training_batches: the training loop's batches stay alive through the evaluation (the
            HF Trainer evaluates inside its step loop, which still holds the window's batches).

    The carried state is added to both peaks at its traced block sizes; the reserved figure assumes
    it sits in segments of its own, which holds for state allocated by the first optimizer step.
    Collected outputs are added at their tensor bytes and assumed to reuse cached blocks: growing
    tensors leave freed blocks behind, which the caching allocator releases and retries with
    before it reports out of memory.
    """
    curve = evaluation if isinstance(evaluation, StepCurve) else StepCurve(evaluation)
    evaluation = curve.estimate
    if isinstance(training, StepCurve):  # what training keeps is its value's
        training = training.estimate
    if not evaluation.inference:
        raise InvalidInputError("evaluation must be an estimate of a forward-only pass: estimate(..., inference=True)")
    carried = 0
    if training is not None:
        optimizer_phases = [p for p in training.phases if p.phase is Phase.OPTIMIZER]
        if not optimizer_phases:
            raise InvalidInputError("training must be an estimate of a training step (it has no optimizer step)")
        state = optimizer_phases[-1].breakdown
        carried_categories = (*_CARRIED, Category.INPUTS) if keeps_training_batches else _CARRIED
        carried = sum(state.get(category, 0) for category in carried_categories)
    allocated, collected_at_peak = evaluation.peak_allocated_bytes, 0
    if collected is not None:
        allocated, collected_at_peak = _peak_with_collection(curve, collected)
    reserved = allocated + evaluation.allocator_overhead_bytes + carried
    return EvaluationPeak(
        batch_size=evaluation.batch_size,
        allocated_bytes=allocated + carried,
        reserved_bytes=reserved,
        device_bytes=reserved + (evaluation.cuda_context_bytes or 0),
        carried_bytes=carried,
        collected_bytes=collected_at_peak,
        collected=collected,
        forward=evaluation,
        traced=curve,
    )


def largest_flush_every(
    training: MemoryEstimate | None,
    evaluation: StepCurve,
    collected: CollectedOutputs,
    budget_bytes: int,
    *,
    include_context: bool = False,
    keeps_training_batches: bool = False,
) -> int | None:
    """The most batches the collection may stay on the device with the pass within ``budget_bytes``
    (the HF Trainer's ``eval_accumulation_steps``); ``None`` when even one batch does not fit."""

    def needed(batches: int) -> int:
        peak = evaluation_peak(
            training, evaluation, collected=collected.flushed_every(batches),
            keeps_training_batches=keeps_training_batches,
        )  # fmt: skip
        return peak.device_bytes if include_context else peak.reserved_bytes

    low, high = 1, collected.batches
    if needed(low) > budget_bytes:
        return None
    while low < high:  # the peak grows with the batches kept
        middle = (low + high + 1) // 2
        low, high = (middle, high) if needed(middle) <= budget_bytes else (low, middle - 1)
    return low


def fitted_evaluation(
    evaluation: EvaluationPeak, training: MemoryEstimate | None, budget_bytes: int, *, include_context: bool
) -> tuple[EvaluationPeak, int | None, bool]:
    """The pass within ``budget_bytes`` inside training: as it is where it fits, else with its collected outputs moved
    off the device every ``flush`` batches, the most that fit (a CUDA pass collecting on the device and flushing
    nothing yet). Returns ``(pass, flush, fits)``; ``flush`` is ``None`` where nothing is to be moved."""
    needed = evaluation.device_bytes if include_context else evaluation.reserved_bytes
    if needed <= budget_bytes:
        return evaluation, None, True
    flush = fitting_flush(evaluation, training, budget_bytes, include_context=include_context)
    if flush is None or evaluation.collected is None or evaluation.traced is None:
        return evaluation, flush, False
    collected = evaluation.collected.flushed_every(flush)
    return evaluation_peak(training, evaluation.traced, collected=collected, keeps_training_batches=True), flush, True


def fitting_flush(
    evaluation: EvaluationPeak, training: MemoryEstimate | None, budget_bytes: int, *, include_context: bool
) -> int | None:
    """The most batches of collected outputs that fit before they move off the device, where moving them helps (a
    CUDA pass that collects on the device and flushes nothing yet); ``None`` otherwise."""
    collected, forward = evaluation.collected, evaluation.traced
    if collected is None or collected.flush_every is not None or forward is None or forward.estimate.device != "cuda":
        return None
    return largest_flush_every(training, forward, collected, budget_bytes, include_context=include_context,
                               keeps_training_batches=True)  # fmt: skip


def nested_tensor_bytes(value: Any, only: torch.dtype | None = None) -> int:
    """Bytes of the tensors in ``value`` (nested in dicts, lists and tuples), of dtype ``only`` if given."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if only in (None, value.dtype) else 0
    if isinstance(value, dict):
        return sum(nested_tensor_bytes(v, only) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nested_tensor_bytes(v, only) for v in value)
    return 0


def _peak_with_collection(curve: StepCurve, collected: CollectedOutputs) -> tuple[int, int]:
    """Allocated peak of the pass and the collected bytes at that moment, batch by batch.

    Before batch ``k``'s forward the collection holds the window's earlier batches, and with
    concatenation the loop's variables still hold batch ``k - 1``'s outputs apart from it (except
    right after the window's first batch, which the collection holds as is). Concatenating batch
    ``k`` keeps the old collection, the batch and the result alive at once: twice the grown
    collection for the collection being copied. Input batches scale with their size, and a loader
    reading ahead (``evaluation.extra_batches``) has nothing left to read at the end, where each
    collection's end copy (if any) is made beside what is still held.
    """
    evaluation = curve.estimate
    per_sample = collected.total_bytes_per_sample
    largest = max(collected.bytes_per_sample.values(), default=0.0)
    fixed = sum(evaluation.breakdown.get(category, 0) for category in (Category.PARAMETERS, Category.BUFFERS))
    traced_inputs = evaluation.breakdown.get(Category.INPUTS, 0)
    one_batch_inputs = traced_inputs / (1 + evaluation.extra_batches)  # at the traced batch size
    window = collected.flush_every or collected.batches
    sizes = [
        min(collected.samples_per_batch, collected.samples - index * collected.samples_per_batch)
        for index in range(collected.batches)
    ]
    forward_batches = [max(1, math.ceil(size * evaluation.batch_size / collected.samples_per_batch)) for size in sizes]
    peak, collected_at_peak = 0, 0
    held = previous = 0
    for index, (size, forward_batch) in enumerate(zip(sizes, forward_batches, strict=True)):
        position = index % window  # 0 for the window's first batch
        if position == 0:
            held = previous = 0
        ahead = forward_batches[index + 1 : index + 1 + evaluation.extra_batches]
        inputs = one_batch_inputs * (forward_batch + sum(ahead)) / evaluation.batch_size
        if forward_batch == evaluation.batch_size:
            forward, inputs_in_forward = evaluation.peak_allocated_bytes, traced_inputs
        else:  # the linear model scales every input batch with this one
            forward = curve.at(forward_batch).allocated_bytes
            inputs_in_forward = traced_inputs * forward_batch / evaluation.batch_size
        forward += round(inputs - inputs_in_forward)
        carried_over = previous if collected.concatenated and position >= 2 else 0
        outputs = round(per_sample * (held + carried_over))
        if forward + outputs > peak:
            peak, collected_at_peak = forward + outputs, outputs
        if collected.concatenated and position >= 1:
            outputs = round((held + size) * (per_sample + largest))
            if fixed + inputs + outputs > peak:
                peak, collected_at_peak = round(fixed + inputs) + outputs, outputs
        held += size
        previous = size
    if collected.end_copy_bytes_per_sample:
        last_position = (collected.batches - 1) % window
        inputs = one_batch_inputs * forward_batches[-1] / evaluation.batch_size  # the loop's last batch
        outputs, copied_at_peak = _end_copies(collected, held, previous, bound_apart=last_position >= 1)
        if round(fixed + inputs) + outputs > peak:
            peak, collected_at_peak = round(fixed + inputs) + outputs, copied_at_peak
    return peak, collected_at_peak


def _end_copies(collected: CollectedOutputs, held: int, last: int, *, bound_apart: bool) -> tuple[int, int]:
    """Bytes of outputs alive at the most crowded moment of the end-of-pass conversion, and of it
    the collections'. ``held`` samples are collected, ``last`` of them the last batch's, whose outputs
    the loop's variables still hold: apart from the collection (``bound_apart``, after a
    concatenation) or as part of it, in which case they outlive its conversion."""
    sizes = {name: per_sample * held for name, per_sample in collected.bytes_per_sample.items()}
    bound = collected.total_bytes_per_sample * last if bound_apart else 0.0
    most = 0.0
    for name, per_sample in collected.bytes_per_sample.items():
        copy = collected.end_copy_bytes_per_sample.get(name, 0.0) * held
        if copy:
            most = max(most, sum(sizes.values()) + copy)
            sizes[name] = copy + (0.0 if bound_apart else per_sample * last)
    return round(bound + most), round(most)
