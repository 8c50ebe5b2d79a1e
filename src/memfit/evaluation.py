"""The evaluation pass in the middle of training: a forward beside the training state.

A validation pass runs in eval mode without gradients, but not on an empty device: the optimizer
state (and DDP's gradient buckets) stay from training. Lightning releases the gradients before
its validation loop (``on_validation_model_zero_grad``) and the Hugging Face Trainer after every
optimizer step, so the gradients are gone. A validation batch larger than the training batch, a
common setting, can run out of memory where training did not; this tells before the run starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.estimate import MemoryEstimate
from memfit.units import format_bytes

__all__ = ["EvaluationPeak", "evaluation_peak"]

_CARRIED = (Category.OPTIMIZER_STATE, Category.GRADIENT_BUCKETS)


@dataclass(frozen=True)
class EvaluationPeak:
    """Predicted peaks of an evaluation pass during training (allocated, reserved, with the context)."""

    batch_size: int
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    carried_bytes: int  # optimizer state and DDP buckets kept from training

    def summary(self) -> str:
        return (
            f"evaluation at batch {self.batch_size} needs {format_bytes(self.device_bytes)} "
            f"({format_bytes(self.carried_bytes)} of it optimizer state kept from training)"
        )


def evaluation_peak(training: MemoryEstimate, evaluation: MemoryEstimate) -> EvaluationPeak:
    """Peaks of the forward-only pass ``evaluation`` (``estimate(..., inference=True)``) run beside
    what ``training`` (the run's training estimate) keeps between steps.

    The carried state is added to both peaks at its traced block sizes; the reserved figure assumes
    it sits in segments of its own, which holds for state allocated by the first optimizer step.
    """
    if evaluation.optimizer != "none (inference)":
        raise InvalidInputError("evaluation must be an estimate of a forward-only pass: estimate(..., inference=True)")
    optimizer_phases = [p for p in training.phases if p.phase is Phase.OPTIMIZER]
    if not optimizer_phases:
        raise InvalidInputError("training must be an estimate of a training step (it has no optimizer step)")
    state = optimizer_phases[-1].breakdown
    carried = sum(state.get(category, 0) for category in _CARRIED)
    reserved = evaluation.peak_reserved_bytes + carried
    return EvaluationPeak(
        batch_size=evaluation.batch_size,
        allocated_bytes=evaluation.peak_allocated_bytes + carried,
        reserved_bytes=reserved,
        device_bytes=reserved + (evaluation.cuda_context_bytes or 0),
        carried_bytes=carried,
    )
