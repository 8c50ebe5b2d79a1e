"""What a prediction is, as values: ``MemoryEstimate`` (the peaks of one traced step, where and why it peaks),
``BatchPeak`` (its peaks at one batch size) and ``PhaseModel`` (a phase's peak as a line in the batch).

They hold figures only, never the model or the trace, so they can be kept, compared, saved with a checkpoint and
sent between ranks. Reading a step at another batch or sequence length needs the trace it came from: that is a
``memfit.prediction.curve.StepCurve`` (``memfit.trace``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.simulation.replay import PhasePeak, TimelinePoint
from memfit.tracing.config import TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.tracer import ZeroGrad

if TYPE_CHECKING:
    from memfit.prediction.sharded import RankModel

__all__ = ["BatchPeak", "MemoryEstimate", "MovedToCurveError", "PhaseModel"]


class MovedToCurveError(InvalidInputError, AttributeError):
    """A reading of other batches asked of a ``MemoryEstimate``, which holds no trace (``hasattr`` is false)."""


class _ReadOnTheCurve:
    """A reading at another batch, which needs the trace: ``MemoryEstimate`` is a value, so it says in one line
    where the reading went (``StepCurve``, what ``memfit.trace`` returns)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        raise MovedToCurveError(
            f"MemoryEstimate.{self._name}() moved: an estimate is a value now; read the step at other batches from "
            f"its trace, curve = memfit.trace(model, sample, ...) (a StepCurve), then curve.{self._name}(...) "
            "(curve.estimate is this estimate)"
        )


@dataclass(frozen=True)
class BatchPeak:
    """Predicted peaks at one batch size. ``device_bytes`` adds the CUDA context to reserved.

    ``least_reserved_bytes``, where it was asked for (``StepCurve.least_device_bytes``), is the least the
    allocator must be allowed to reserve for the step to run: at its limit it frees its cache and retries."""

    batch_size: int
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    least_reserved_bytes: int | None = None

    @property
    def least_device_bytes(self) -> int:
        """The least memory the step runs in, CUDA context included (``device_bytes`` where not known)."""
        if self.least_reserved_bytes is None:
            return self.device_bytes
        return self.least_reserved_bytes + self.device_bytes - self.reserved_bytes


@dataclass(frozen=True)
class PhaseModel:
    """Tensor-bytes peak of one phase as ``fixed_bytes + per_sample_bytes x batch``."""

    step: int
    phase: Phase
    fixed_bytes: int
    per_sample_bytes: float

    def at(self, batch_size: int) -> int:
        return max(0, round(self.fixed_bytes + self.per_sample_bytes * batch_size))


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one training step, with where and why it peaks.

    ``peak_allocated_bytes`` predicts ``torch.cuda.max_memory_allocated()``,
    ``peak_reserved_bytes`` predicts ``torch.cuda.max_memory_reserved()``, and ``peak_bytes``
    adds the CUDA context: what ``nvidia-smi`` shows for the process. On a CPU target the three
    are the tensor bytes. ``breakdown`` splits the allocated peak by category.
    ``fixed_bytes + per_sample_bytes x batch`` is the allocated peak of the peak phase, and ``phase_models`` every
    phase's (the fit between the two traced batches). ``activation_bytes`` is what one forward keeps
    for backward (saved tensors and the loss), in tensor bytes before allocator rounding.
    ``zero_grad``, ``accumulation_steps`` and ``ddp`` are the training loop the step was traced in;
    ``inference`` marks a forward-only pass (``optimizer`` is then ``"none"``).

    A value: it holds no model and no trace. The step at other batches is read from a ``StepCurve``
    (``memfit.trace``), whose ``estimate`` this is.
    """

    batch_size: int
    device: str
    precision: Precision
    optimizer: str
    gradient_checkpointing: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    cuda_context_bytes: int | None
    peak_step: int
    peak_phase: Phase
    breakdown: Mapping[Category, int]
    fixed_bytes: int
    per_sample_bytes: int
    phases: tuple[PhasePeak, ...]
    phase_models: tuple[PhaseModel, ...]
    trace_seconds: float = field(compare=False)  # how long tracing took: not part of the prediction
    activation_bytes: int = 0
    allocated_to_tensor_ratio: float = 1.0
    reserved_to_allocated_ratio: float = 1.0
    notes: tuple[str, ...] = field(default=())
    timeline: tuple[TimelinePoint, ...] = field(default=(), repr=False)
    zero_grad: ZeroGrad = "after_step"
    accumulation_steps: int = 1
    ddp: DDPConfig | None = None
    extra_batches: int = 0
    inference: bool = False
    sharding: ShardingConfig | None = None
    rank_terms: Mapping[str, int] = field(default_factory=dict)  # one rank's model-state terms (sharded runs)
    rank_model: RankModel | None = field(default=None, repr=False)  # what the terms were made from (sharded runs)
    host_bytes_per_node: int | None = None  # offloaded states and pinned buffers of a node's ranks
    seq_len: int | None = None  # the sample's sequence length, where it has one (its token ids' dimension 1)

    @property
    def peak_bytes(self) -> int:
        """Device memory the step needs: reserved peak plus CUDA context."""
        return self.peak_reserved_bytes + (self.cuda_context_bytes or 0)

    @property
    def loop(self) -> TrainingLoop:
        """The training loop the step was traced in."""
        return TrainingLoop(self.zero_grad, self.accumulation_steps, self.extra_batches, self.ddp, self.sharding)

    @property
    def gradient_bytes(self) -> int:
        """The gradients' own blocks at their largest (none when they are DDP bucket views)."""
        return max((p.breakdown.get(Category.GRADIENTS, 0) for p in self.phases), default=0)

    @property
    def allocator_overhead_bytes(self) -> int:
        """Reserved minus allocated: caching-allocator rounding and fragmentation."""
        return self.peak_reserved_bytes - self.peak_allocated_bytes

    # read from the step's trace, which a value does not hold (StepCurve)
    at = _ReadOnTheCurve()
    least_device_bytes = _ReadOnTheCurve()
    at_limit = _ReadOnTheCurve()
    max_batch_size = _ReadOnTheCurve()
    for_seq_len = _ReadOnTheCurve()
    rebuilt_at = _ReadOnTheCurve()

    def with_notes(self, *notes: str) -> MemoryEstimate:
        """This estimate with more notes (what the caller knows that the trace cannot show), each once."""
        added = tuple(note for note in dict.fromkeys(notes) if note not in self.notes)
        return dataclasses.replace(self, notes=(*self.notes, *added)) if added else self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view: integer bytes, names as strings."""
        return {
            "batch_size": self.batch_size,
            "device": self.device,
            "precision": self.precision.short_name,
            "optimizer": self.optimizer,
            "gradient_checkpointing": self.gradient_checkpointing,
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "cuda_context_bytes": self.cuda_context_bytes,
            "peak_step": self.peak_step,
            "peak_phase": self.peak_phase.value,
            "breakdown_bytes": {category.value: size for category, size in self.breakdown.items()},
            "allocator_overhead_bytes": self.allocator_overhead_bytes,
            "fixed_bytes": self.fixed_bytes,
            "per_sample_bytes": self.per_sample_bytes,
            "activation_bytes": self.activation_bytes,
            "trace_seconds": round(self.trace_seconds, 3),
            "zero_grad": self.zero_grad,
            "accumulation_steps": self.accumulation_steps,
            "ddp": dataclasses.asdict(self.ddp) if self.ddp is not None else None,
            "extra_batches": self.extra_batches,
            "inference": self.inference,
            "sharding": dataclasses.asdict(self.sharding) if self.sharding is not None else None,
            "rank_terms_bytes": dict(self.rank_terms),
            "host_bytes_per_node": self.host_bytes_per_node,
            "notes": list(self.notes),
        }
