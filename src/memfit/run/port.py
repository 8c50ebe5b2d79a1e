"""What a training framework hands the run controller: a port, the run's ``RunLayout`` and its ``TrainingStep``.

A port only translates. A ``RunPort`` says where the run is (device, ranks, accumulation, a gather), where its
figures go (its trackers) and how its training step is wrapped for the out-of-memory recovery; a ``PlanningPort``
also says what memfit plans on (one sample batch, the batch size the run is configured with, the framework's
training step as a ``TrainingStep``, a broadcast) and how a plan is applied. Everything a run does with those is
the controller's (``memfit.run.controller.RunController``), the same for every framework.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from memfit.diagnostics import info, is_rank_zero
from memfit.planning.gpus import PlanningTarget
from memfit.planning.planner import Plan
from memfit.precision import Precision
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate, trace
from memfit.prediction.evaluation import EvaluationPeak
from memfit.run.recovery import OOMRecovery
from memfit.tracing.checkpointing import CheckpointTarget
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.tracer import ForwardFn, LossFn, ZeroGrad

__all__ = ["PlanningOnly", "PlanningPort", "RankZeroSpeaker", "RunLayout", "RunPort", "TrainingStep"]

Value = TypeVar("Value")


@dataclass(frozen=True)
class RunLayout:
    """How the framework spreads the step over ranks, as the plan needs it.

    Attributes:
        sharding: what one rank holds (FSDP, ZeRO), or ``None`` when nothing is sharded.
        name: the strategy, for messages (``"DDPStrategy"``); default: what ``sharding`` is.
        data_parallel_size: ranks that each take a micro batch of their own (the effective batch is micro x
            accumulation x this); ``None``: the world size.
        checkpointing: the strategy checkpoints activations itself: the plan keeps it on, memfit wraps nothing.
        checkpoint_modules: the blocks the strategy checkpoints, when it names them.
        units: the blocks FSDP wraps as units, when its policy names them (classes or class names).
        notes: what the prediction should say of options memfit reads but does not model.
    """

    sharding: ShardingConfig | None = None
    name: str = ""
    data_parallel_size: int | None = None
    checkpointing: bool = False
    checkpoint_modules: CheckpointTarget | None = None
    units: CheckpointTarget | None = None
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The strategy as messages name it: ``name``, else FSDP, DeepSpeed or DDP by what is sharded."""
        if self.name:
            return self.name
        if self.sharding is None:
            return "DDP"
        return "DeepSpeed" if self.sharding.is_zero else "FSDP"


def _nothing_held(accumulation_steps: int) -> int:
    return 0


@dataclass(frozen=True)
class TrainingStep:
    """A framework's training step as memfit traces it: all ``memfit.estimate`` takes but what a plan varies
    (micro batch, checkpointing, accumulation). ``held_batches(accumulation)``: batches the loop keeps on the
    device besides the step's own; ``settings()``: the model as the framework will run it, restored after each
    trace (the Trainer's ``use_cache``); ``notes``: what every estimate of this step says."""

    model: nn.Module
    sample: Any
    optimizer: Any
    precision: Precision | str
    target: Target
    forward_fn: ForwardFn | None = None
    loss_fn: LossFn | None = None
    zero_grad: ZeroGrad = "after_step"
    ddp: DDPConfig | None = None
    sharding: ShardingConfig | None = None
    checkpoint_modules: CheckpointTarget | None = None
    held_batches: Callable[[int], int] = _nothing_held
    settings: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    notes: Sequence[str] = field(default=())

    def trace_at(self, micro_batch: int, checkpointing: bool, accumulation_steps: int) -> StepCurve:
        """The step traced at that configuration (``memfit.planning.session.TraceAt``)."""
        loop = TrainingLoop(zero_grad=self.zero_grad, accumulation_steps=accumulation_steps, ddp=self.ddp,
                            sharding=self.sharding, extra_batches=self.held_batches(accumulation_steps))  # fmt: skip
        with self.settings():
            traced = trace(
                self.model, self.sample, optimizer=self.optimizer, precision=self.precision, batch_size=micro_batch,
                loop=loop, target=self.target, gradient_checkpointing=checkpointing,
                checkpoint_modules=self.checkpoint_modules, forward_fn=self.forward_fn, loss_fn=self.loss_fn,
            )  # fmt: skip
        return traced.with_notes(*self.notes)


class RunPort(Protocol):
    """What one framework hands the controller to measure a run and recover from its out-of-memory errors. Every
    method may be called on every rank unless it says."""

    # ------------------------------------------------------------------ where the run is
    def device(self) -> torch.device:
        """The device this process trains on."""

    def world_size(self) -> int:
        """Processes in the job (1 without a process group)."""

    def rank(self) -> int:
        """This process's rank."""

    def accumulation(self) -> int:
        """Micro batches per optimizer step, as the loop now runs them."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` in rank order (every rank calls it)."""

    # ------------------------------------------------------------------ the step, for out-of-memory recovery
    def recovery_unsupported(self) -> str | None:
        """Why the step cannot be wrapped for the recovery in this run (the whole warning), or ``None``."""

    def install_step(self, recovery: OOMRecovery) -> None:
        """Run each training batch through ``recovery.run_batch`` (``memfit.run.recovery``)."""

    def uninstall_step(self) -> None:
        """The framework's own step again (called also when nothing was installed)."""

    def trained_module(self) -> nn.Module:
        """The model being trained, unwrapped (a recovery frees its gradients, or turns its checkpointing on)."""

    # ------------------------------------------------------------------ where figures go
    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        """Send ``memfit/*`` metrics to the trackers the run uses (``step`` ``None``: the loop's current one)."""

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """Send a drawn figure to the trackers that take pictures."""

    def log_plan(self, params: dict[str, Any]) -> None:
        """The plan as the trackers' hyperparameters (rank 0)."""

    def warn(self, message: str) -> None:
        """A warning, on the rank that speaks for the run."""

    def info(self, message: str) -> None:
        """A line for the user, on the rank that speaks for the run."""


class PlanningPort(RunPort, Protocol):
    """A ``RunPort`` the controller also plans through (``RunController.plan_run``)."""

    loop_name: str  # the loop as warnings name it ("Lightning", "accelerate")
    every_rank_decides: bool  # every rank plans from the same capacity (else rank 0 plans and broadcasts)

    def broadcast(self, value: Value) -> Value:
        """Rank 0's ``value`` on every rank (every rank calls it)."""

    def planning_target(self) -> PlanningTarget:
        """The device the plan is for and its capacity (``memfit.planning.gpus.planning_target``)."""

    def precision(self) -> Precision | str:
        """The precision the run trains in."""

    def layout(self) -> RunLayout:
        """How the step is spread over ranks. Raises ``ShardingNotModelledError`` for what memfit cannot model."""

    def unplannable(self) -> str | None:
        """Why this run cannot be planned at all (it is then only measured), or ``None``; rank 0."""

    def sample_batch(self, notes: list[str]) -> Any:
        """One batch to plan on, the longest the run will see; ``notes`` gets what the choice could not know."""

    def configured_batch(self, sample: Any) -> int:
        """The micro batch the run is configured with (raises ``InvalidInputError`` when it cannot be told)."""

    def training_samples(self) -> int | None:
        """The training set's length (a rank's share bounds the micro batch), ``None`` for a stream."""

    def training_step(self, sample: Any, target: Any, layout: RunLayout, notes: Sequence[str]) -> TrainingStep:
        """The framework's training step on ``sample``, for ``target`` (a ``memfit.Target``), on one rank of
        ``layout``."""

    def evaluation(self, training: MemoryEstimate) -> EvaluationPeak | None:
        """The evaluation pass beside what ``training`` leaves (``None``: the run evaluates nothing, or it could
        not be predicted)."""

    def apply(self, plan: Plan) -> bool:
        """Set the plan's micro batch, accumulation and checkpointing, all or nothing; whether it was applied."""


class PlanningOnly:
    """The part of a ``RunPort`` a port that only plans leaves out: no step to wrap, no trackers."""

    def recovery_unsupported(self) -> str | None:
        return "nothing trains here: this port only plans"

    def install_step(self, recovery: OOMRecovery) -> None:
        raise NotImplementedError(self.recovery_unsupported())

    def uninstall_step(self) -> None:
        return None

    def trained_module(self) -> nn.Module:
        raise NotImplementedError(self.recovery_unsupported())

    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        return None

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        return None

    def log_plan(self, params: dict[str, Any]) -> None:
        return None


class RankZeroSpeaker:
    """A port's warnings and lines said through memfit's own logger and ``warnings``, on rank 0 only
    (``memfit.diagnostics``), for a framework without its own rank-zero helpers."""

    def warn(self, message: str) -> None:
        if is_rank_zero():
            warnings.warn(message, UserWarning, stacklevel=4)

    def info(self, message: str) -> None:
        info(message)
