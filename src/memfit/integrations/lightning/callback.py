"""The Lightning port: the callback shared by the ``lightning`` and ``pytorch_lightning`` namespaces.

The two public modules (``memfit.lightning``, ``memfit.pytorch_lightning``) subclass ``MemoryPlannerBase`` with
their namespace's ``Callback``. Its hooks hand off to the run controller (``memfit.run.controller``); the
``LightningPort`` only translates the trainer's loop, batch, optimizer, precision, strategy and loggers. Lightning
privates are reached through ``internals`` only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from memfit.diagnostics import degrade
from memfit.errors import InvalidInputError
from memfit.integrations.lightning.internals import LightningInternals, RecoveringStep
from memfit.integrations.lightning.sharding import sharding_strategy_name, strategy_layout
from memfit.planning.capacity import parse_budget
from memfit.planning.gpus import PlanningTarget, check_target, planning_target
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.run_options import (
    RunOptions,
    check_flag,
    check_positive,
    dropped_samples_warning,
    last_window_warning,
    summed_loss_warning,
)
from memfit.precision import Precision
from memfit.prediction.estimator import MemoryEstimate, trace
from memfit.prediction.evaluation import EvaluationPeak, evaluation_peak
from memfit.reporting.figures import log_figure
from memfit.run.controller import ControlledRun, RunController
from memfit.run.port import RunLayout, TrainingStep
from memfit.run.recovery import LossReduction, OnOOM, OOMRecovery, batches_held, check_loss_reduction, check_on_oom
from memfit.tracing.batch import dataset_length, infer_batch_size, longest_batch, planning_batch
from memfit.tracing.checkpointing import CheckpointTarget, enable_checkpointing
from memfit.tracing.config import Target
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.model_state import preserved_rng_state

# The callback's docstring, shared by memfit.lightning and memfit.pytorch_lightning (neither imports the other)
_DOC = """Plan micro batch, gradient accumulation and checkpointing before the first batch; log drift.

    At ``setup`` (stage ``"fit"``) the callback traces two training steps of the real LightningModule (its
    ``training_step``, the first optimizer, the trainer's precision and strategy) on fake tensors, on the longest
    batch of the train dataloader (or ``sample``), and plans the largest micro batch whose predicted peak fits the
    budget minus the margin, the accumulation that keeps the effective batch, and checkpointing only if needed. In
    ``mode="plan"`` it applies the plan: the micro batch through ``lightning_setattr`` (attribute
    ``batch_arg_name`` on the module, its hparams or the datamodule, as ``BatchSizeFinder``),
    ``trainer.accumulate_grad_batches``, and checkpointing; ``mode="observe"`` changes nothing. Under DDP rank 0
    plans on the smallest free memory of all ranks and every rank applies the plan; under FSDP, ModelParallel and
    DeepSpeed strategies the plan is one rank's. ``training_step`` runs on fake tensors during the trace
    (``torch._subclasses.fake_tensor.is_fake`` tells them apart), with ``self.log`` silenced. An out-of-memory
    error in a step (``on_oom="replan"``) is retried in chunks, so the effective batch, the samples and the
    optimizer steps stay as configured (``memfit.run.recovery``). A plan that cannot be made is one warning and
    the run trains as configured; a budget too small even for ``min_batch_size`` with checkpointing raises
    ``memfit.InsufficientMemoryError`` before training starts. The plan is saved in checkpoints and kept on
    resume. What each step does, and why: docs/lightning.md.

    Args:
        budget: memory per device: bytes, a size (``"20GiB"``) or a GPU name (``"h100"``). Default: the device's
            free memory at setup (CUDA) or the available RAM (CPU); with a GPU name in ``target``, its memory.
        target: the device the plan is for: ``"cuda"``, ``"cpu"`` or a GPU name; default: the run's device, or the
            GPU ``budget`` names (``budget="h100"`` plans for an H100 on a machine without one).
        margin: fraction of the budget kept free (default ``DEFAULT_MARGIN``, 1.5 %: the prediction's measured error).
        target_batch_size: effective batch to keep (micro x accumulation x devices); default: as configured;
            ``"max"``: the largest micro batch, no accumulation.
        batch_arg_name: attribute holding the batch size on the module, hparams or datamodule.
        allow_checkpointing: whether checkpointing may be turned on.
        checkpoint_modules: block classes or qualified names to checkpoint in plain (non-HF) modules.
        mode: ``"plan"`` to apply the plan, ``"observe"`` to only predict and log drift.
        sample: a batch (or callable ``batch_size -> batch``) to trace instead of the dataloader's.
        min_batch_size, max_batch_size: bounds on the micro batch.
        log_every_n_steps: drift logging cadence in optimizer steps (default: the trainer's).
        on_oom: ``"replan"`` to recover from out-of-memory errors in a step, ``"raise"`` to let them end the run.
        loss_reduction: how ``training_step``'s loss reduces a batch, ``"mean"`` or ``"sum"`` (chunk weights).
        verbose: print the plan and the final drift line.

    Logged metrics (rank 0, through ``trainer.loggers``, every ``log_every_n_steps`` and at the end; peaks per
    window): ``memfit/predicted_peak_allocated_bytes``, ``memfit/predicted_peak_reserved_bytes`` (CUDA: without the
    context), ``memfit/measured_peak_allocated_bytes``, ``memfit/measured_peak_reserved_bytes``,
    ``memfit/drift_allocated_pct``, ``memfit/drift_reserved_pct`` (CUDA), ``memfit/measured_device_used_bytes``
    (CUDA with ``nvidia-ml-py``), ``memfit/measured_peak_rss_bytes`` (CPU: the whole process, not compared with the
    predicted tensor bytes), ``memfit/rank{r}/<key>`` (each rank's own, with several), ``memfit/alarm_over_margin``
    and ``memfit/alarm_leak`` (1 in a window that warned), ``memfit/oom_recoveries`` and
    ``memfit/micro_batch_size`` after a recovery. The plan is logged once as hyperparameters (``memfit/<field>``).
    With manual optimization nothing is predicted (``MANUAL_OPTIMIZATION``); on a Lightning release memfit was not
    tested on, the out-of-memory recovery stays off (``memfit.integrations.lightning.internals``).
    """

__all__ = ["MANUAL_OPTIMIZATION", "LightningPort", "MemoryPlannerBase"]

# Why a module with manual optimization is measured, not planned. Tracing it would take fake copies
# of every optimizer behind ``self.optimizers()``, ``self.manual_backward`` running backward inside
# the traced ``training_step``, and a trace whose backward and optimizer steps happen inside the
# forward call (the tracer marks phases and counts gradients and optimizer state around them).
MANUAL_OPTIMIZATION = (
    "memfit does not trace manual optimization yet (automatic_optimization=False: training_step steps its "
    "optimizers itself): it plans and predicts nothing for this run and logs the measured peaks only "
    "(memfit/measured_peak_*). Set the batch size yourself."
)
# The library's advice in a planning error, as a LightningModule's author acts on it (memfit calls training_step)
_ADVICE = {
    "pass forward_fn=lambda model, batch: ... if the model is called another way": "memfit calls training_step(batch, "
    "0) with one batch of the train dataloader, or with sample= when given",
    "pass a forward_fn/loss_fn that avoids it, or use memfit.estimate_from_counts() for a formula estimate.": "or, "
    "in a LightningModule, skip such reads while memfit traces: they see fake tensors, which "
    "`torch._subclasses.fake_tensor.is_fake(tensor)` tells apart.",
    "pass loss_fn=lambda output, batch: <scalar loss>": "return the loss from training_step (a tensor, or a dict "
    "with 'loss')",
}

Mode = Literal["plan", "observe"]
Value = TypeVar("Value")


class MemoryPlannerBase(ControlledRun):
    """See ``memfit.lightning.MemoryPlanner`` for the documentation."""

    _pl: ModuleType  # lightning.pytorch or pytorch_lightning, set by the subclass

    def __init__(
        self,
        budget: int | str | None = None,
        margin: float = DEFAULT_MARGIN,
        target_batch_size: int | Literal["max"] | None = None,
        batch_arg_name: str = "batch_size",
        allow_checkpointing: bool = True,
        checkpoint_modules: CheckpointTarget | None = None,
        mode: Mode = "plan",
        sample: Any = None,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        log_every_n_steps: int | None = None,
        on_oom: OnOOM = "replan",
        loss_reduction: LossReduction = "mean",
        verbose: bool = True,
        target: str | None = None,
    ) -> None:
        super().__init__()
        self.budget_bytes = parse_budget(budget)  # a bad budget is named now, not at setup
        options = RunOptions(margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing)
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise InvalidInputError(f"`batch_arg_name` must be an attribute name, got {batch_arg_name!r}")
        if mode not in ("plan", "observe"):
            raise InvalidInputError(f"`mode` must be one of 'plan', 'observe', got {mode!r}")
        if log_every_n_steps is not None:
            check_positive("log_every_n_steps", log_every_n_steps)
        check_flag("verbose", verbose)
        self.budget, self.target = budget, check_target(target, budget)
        self.batch_arg_name, self.checkpoint_modules, self.mode = batch_arg_name, checkpoint_modules, mode
        self.sample, self.log_every_n_steps, self.verbose = sample, log_every_n_steps, verbose
        self.on_oom, self.allow_checkpointing = check_on_oom(on_oom), options.allow_checkpointing
        self.port = LightningPort(self, LightningInternals(self._pl))
        self.controller = RunController(self.port, options=options, mode=mode, on_oom=self.on_oom,
                                        loss_reduction=check_loss_reduction(loss_reduction), verbose=verbose,
                                        advice=_ADVICE, checkpoint_modules=checkpoint_modules)  # fmt: skip

    @property
    def validation(self) -> EvaluationPeak | None:
        """The validation pass predicted beside what training leaves (``None``: the fit runs none)."""
        return self.controller.evaluation

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.port.trainer, self.port.module = trainer, pl_module
            self.controller.plan_run()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.controller.training_started(trainer.global_step, figure_step=self.port.internals.logging_step(trainer))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.controller.agree_across_ranks()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        step = self.port.recovering
        self.controller.failed(exception, in_optimizer_step=step is not None and step.closure_finished)
        self.teardown(trainer, pl_module, "fit")  # Lightning skips callbacks' teardown after an exception

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning logs the module's metrics when the batches that stepped, this one included, are a multiple of
        # log_every_n_steps: memfit's windows end on the same steps
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        counted = self.port.internals.logging_step(trainer) + 1
        self.controller.batch_ended(trainer.global_step, every=every, counted=counted)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.controller.training_ended(trainer.global_step, speaker=trainer.is_global_zero,
                                       figure_step=self.port.internals.logging_step(trainer))  # fmt: skip

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.controller.port.uninstall_step()

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict)


class LightningPort:
    """The trainer's side of the run for ``RunController``: its strategy, loop, module, loggers and messages."""

    loop_name = "Lightning"
    every_rank_decides = False

    def __init__(self, callback: MemoryPlannerBase, internals: LightningInternals) -> None:
        self.callback, self.internals, self.pl = callback, internals, internals.pl
        self.trainer: Any = None  # set at setup
        self.module: Any = None
        self.recovering: RecoveringStep | None = None  # the training step while recovery is on
        self._samples: int | None = None

    # ------------------------------------------------------------------ where the run is
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device

    def world_size(self) -> int:
        return int(self.trainer.world_size)

    def rank(self) -> int:
        return int(self.trainer.global_rank)

    def accumulation(self) -> int:
        return int(self.trainer.accumulate_grad_batches)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.all_gather(tensor)

    def broadcast(self, value: Value) -> Value:
        return self.trainer.strategy.broadcast(value, src=0)

    # ------------------------------------------------------------------ what memfit plans on
    def planning_target(self) -> PlanningTarget:
        return planning_target(self.callback.target, self.callback.budget, self.device())

    def precision(self) -> str:
        return str(self.trainer.precision)

    def layout(self) -> RunLayout:
        return strategy_layout(self.trainer, self.internals)

    def unplannable(self) -> str | None:
        return None if getattr(self.module, "automatic_optimization", True) else MANUAL_OPTIMIZATION

    def sample_batch(self, notes: list[str]) -> Any:
        if self.callback.sample is not None:
            return self.callback.sample
        loader = self.internals.train_dataloader(self.trainer)
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise InvalidInputError(
                f"the train dataloader is a {type(loader).__name__}; pass sample= (one batch) to MemoryPlanner"
            )
        self._samples = dataset_length(loader.dataset)
        return planning_batch(loader, self.module, notes)

    def configured_batch(self, sample: Any) -> int:
        configured = self._batch_attribute() or (infer_batch_size(sample) if not callable(sample) else None)
        if configured is None:
            raise InvalidInputError(
                f"cannot tell the batch size: the module has no `{self.callback.batch_arg_name}` attribute and the "
                "sample is a callable; set batch_arg_name"
            )
        return configured

    def training_samples(self) -> int | None:
        return self._samples

    def training_step(self, sample: Any, target: Target, layout: RunLayout, notes: Sequence[str]) -> TrainingStep:
        """The module's ``training_step`` in Lightning's loop, on one rank of the strategy's layout. Lightning's
        closure runs training_step, zero_grad, backward; memfit's recovering closure (``on_oom="replan"``) zeroes
        before training_step, so the forward no longer carries the last gradients."""
        on_oom, strategy = self.callback.on_oom, self.trainer.strategy
        deepspeed = getattr(self.pl.strategies, "DeepSpeedStrategy", ())
        plain_ddp = isinstance(strategy, self.pl.strategies.DDPStrategy) and not isinstance(strategy, deepspeed)
        ddp = DDPConfig.from_kwargs(self.internals.ddp_kwargs(strategy)) if plain_ddp and not layout.sharding else None
        return TrainingStep(
            self.module, sample, optimizer=self._first_optimizer(), precision=Precision.parse(self.precision()),
            target=target, forward_fn=functools.partial(_training_step, device=self.device(), internals=self.internals),
            loss_fn=_loss_of_training_step, zero_grad="after_step" if on_oom == "replan" else "before_backward",
            ddp=ddp, sharding=layout.sharding, held_batches=functools.partial(batches_held, on_oom=on_oom),
            checkpoint_modules=layout.checkpoint_modules or self.callback.checkpoint_modules or layout.units,
            notes=notes,
        )  # fmt: skip

    def evaluation(self, training: MemoryEstimate) -> EvaluationPeak | None:
        """The validation pass's peak beside what training leaves, or ``None`` when the fit runs none or it could
        not be estimated (the plan stands; only this check is lost)."""
        try:
            sample = self._validation_sample()
            if sample is None:
                return None
            forward = functools.partial(_validation_step, device=self.device(), internals=self.internals)
            evaluation = trace(self.module, sample, inference=True, precision=Precision.parse(self.precision()),
                                  target=Target(training.device), forward_fn=forward)  # fmt: skip
            return evaluation_peak(training, evaluation)
        except Exception as error:
            degrade(f"memfit could not check the validation pass ({type(error).__name__}: {error})", error, quiet=True)
            return None

    def apply(self, plan: Plan) -> bool:
        """Set micro batch, accumulation and checkpointing, all or nothing; whether the plan was applied."""
        trainer, module, name = self.trainer, self.module, self.callback.batch_arg_name
        micro, accumulation, parsing = plan.micro_batch_size, plan.accumulate_grad_batches, self.pl.utilities.parsing
        if not parsing.lightning_hasattr(module, name):
            if (self._loader_batch_size(), trainer.accumulate_grad_batches) == (micro, accumulation):
                return True  # the plan is the run as configured: nothing to set
            self._warn("no-batch-attribute", (
                f"memfit planned micro batch {micro} x {accumulation} accumulation steps but found no `{name}` on the "
                "module, its hparams or the datamodule to set it; nothing was changed and the run trains as "
                "configured. Expose the batch size there (or set batch_arg_name) to let memfit apply its plan."
            ))  # fmt: skip
            return False
        previous_batch, previous_accumulation = parsing.lightning_getattr(module, name), trainer.accumulate_grad_batches
        try:
            parsing.lightning_setattr(module, name, micro)
            trainer.accumulate_grad_batches = accumulation
            if plan.gradient_checkpointing and not self.internals.fsdp_checkpointing(trainer.strategy)[0]:
                enable_checkpointing(module, self.callback.checkpoint_modules)  # not where FSDP wraps blocks itself
        except Exception as error:
            parsing.lightning_setattr(module, name, previous_batch)
            trainer.accumulate_grad_batches = previous_accumulation
            degrade(f"memfit could not apply its plan ({type(error).__name__}: {error}); nothing was changed.", error,
                    key="apply", seen=self.callback.controller.warned)  # fmt: skip
            return False
        if isinstance(previous_batch, int) and previous_batch > 0:
            trained = self._warn_of_dropped_samples(previous_batch, micro)
            warning = last_window_warning("Lightning", trained, trainer.world_size,
                                          (previous_batch, previous_accumulation), (micro, accumulation))  # fmt: skip
            if warning:
                self._warn("last-window", warning)
            summed = self.callback.controller.loss_reduction == "sum" and summed_loss_warning(
                "Lightning", (previous_batch, previous_accumulation), (micro, accumulation))  # fmt: skip
            if summed:
                self._warn("summed-loss", summed)
        self.internals.forget_train_loader(trainer)
        self.internals.record_initial_hparam(trainer, module, name, micro)
        return True

    # ------------------------------------------------------------------ the step, for out-of-memory recovery
    def recovery_unsupported(self) -> str | None:
        if not getattr(self.module, "automatic_optimization", True):
            return ("memfit recovers from out-of-memory errors under automatic optimization only; with manual "
                    "optimization an out-of-memory error ends the run as usual.")  # fmt: skip
        unsupported = self.internals.recovery_supported(self.trainer)
        if (sharded := sharding_strategy_name(self.trainer.strategy, self.internals)) is not None:
            unsupported = (f"under {sharded} every forward gathers parameters with the other ranks, so one rank "
                           "cannot rerun a batch in chunks alone")  # fmt: skip
        if unsupported is None:
            return None
        return f"{unsupported}: memfit leaves its out-of-memory recovery off in this run; an out-of-memory error " \
            "will end it as usual."  # fmt: skip

    def install_step(self, recovery: OOMRecovery) -> None:
        self.recovering = RecoveringStep(self.trainer, self.module, self.internals, recovery)
        self.internals.install_step(self.trainer, self.recovering)

    def uninstall_step(self) -> None:
        if self.trainer is not None:
            self.internals.uninstall_step(self.trainer)

    def trained_module(self) -> nn.Module:
        return self.module

    # ------------------------------------------------------------------ where figures go
    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        """To every logger, on rank 0, on the step Lightning logs the module's metrics at; a logger that fails
        costs one warning."""
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=self.internals.logging_step(trainer))
            except Exception as error:
                name = type(logger).__name__
                degrade(f"memfit could not log to {name} ({error})", error, key=f"logger-{name}",
                        seen=self.callback.controller.warned)  # fmt: skip

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """To every logger that takes pictures (TensorBoard, MLflow) or has a folder."""
        loggers = self.pl.loggers
        for logger in self.trainer.loggers:
            if isinstance(logger, loggers.TensorBoardLogger):
                log_figure(figure, name, tensorboard=logger.experiment, step=step)
            elif isinstance(logger, loggers.MLFlowLogger):
                log_figure(figure, name, mlflow_client=logger.experiment, mlflow_run_id=logger.run_id)
            elif getattr(logger, "log_dir", None):
                log_figure(figure, name, folder=logger.log_dir)

    def log_plan(self, params: dict[str, Any]) -> None:
        """As each logger's hyperparameters; a logger that refuses them is named once, and the run goes on."""
        for logger in self.trainer.loggers:
            try:
                logger.log_hyperparams(params)
            except Exception as error:
                name = type(logger).__name__
                degrade(f"memfit could not log its plan to {name} ({error})", error, key=f"hparams-{name}",
                        seen=self.callback.controller.warned)  # fmt: skip

    def warn(self, message: str) -> None:
        self.pl.utilities.rank_zero_warn(message)

    def info(self, message: str) -> None:
        self.pl.utilities.rank_zero_info(message)

    # ------------------------------------------------------------------ reading the trainer
    def _warn(self, key: str, message: str) -> None:
        self.callback.controller.warn(key, message)

    def _batch_attribute(self) -> int | None:
        parsing = self.pl.utilities.parsing
        if parsing.lightning_hasattr(self.module, self.callback.batch_arg_name):
            value = parsing.lightning_getattr(self.module, self.callback.batch_arg_name)
            return value if isinstance(value, int) and value > 0 else None
        return None

    def _first_optimizer(self) -> Any:
        optimizers = self.internals.optimizers(self.module)
        if len(optimizers) > 1:
            self._warn("optimizers", "memfit plans with the first of several optimizers")
        return optimizers[0] if optimizers else None

    def _loader_batch_size(self) -> int | None:
        try:
            return self.internals.train_dataloader(self.trainer).batch_size
        except Exception:  # no loader memfit can read
            return None

    def _warn_of_dropped_samples(self, configured: int, micro: int) -> int | None:
        """A loader that drops its last incomplete batch drops another number of samples at the planned batch size:
        the batch size is all memfit sets, so it says what changes. Returns the samples the run as configured
        trains on an epoch (``None`` where that cannot be read)."""
        try:
            loader = self.internals.train_dataloader(self.trainer)
            samples = len(loader.sampler) if getattr(loader, "drop_last", False) else None
        except Exception:  # no loader memfit can read: nothing to say
            return self._samples
        warning = dropped_samples_warning("drop_last", samples, configured, micro)
        if warning is not None:
            self._warn("drop-last", warning)
        return self._samples if samples is None else samples // configured * configured

    def _validation_sample(self) -> Any:
        """One batch of the first validation dataloader, or ``None`` when the fit runs no validation."""
        overridden = self.pl.utilities.model_helpers.is_overridden("validation_step", self.module)
        if not self.trainer.limit_val_batches or not overridden:
            return None
        loaders = self.internals.val_dataloaders(self.trainer)
        loader = loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders
        if isinstance(loader, dict):
            loader = next(iter(loader.values()), None)
        if not isinstance(loader, torch.utils.data.DataLoader):
            return None
        with preserved_rng_state():
            try:
                return longest_batch(loader)
            except StopIteration:  # an empty loader: no batch to check
                return None


def _training_step(module: nn.Module, batch: Any, *, device: torch.device, internals: LightningInternals) -> Any:
    """Call ``training_step`` as the loop would: ``self.log`` silenced (no loop to log to yet) and
    ``self.device`` already the training device (the strategy moves the module only after setup)."""
    with _logging_silenced(module), internals.device_reported_as(module, device):
        return module.training_step(batch, 0)


def _validation_step(module: nn.Module, batch: Any, *, device: torch.device, internals: LightningInternals) -> Any:
    with _logging_silenced(module), internals.device_reported_as(module, device):
        return module.validation_step(batch, 0)


def _loss_of_training_step(output: Any, batch: Any) -> torch.Tensor:
    if isinstance(output, dict):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise InvalidInputError("training_step must return the loss (a tensor or a dict with 'loss') to be planned")
    return output


@contextlib.contextmanager
def _logging_silenced(module: Any) -> Iterator[None]:
    def silent(*args: Any, **kwargs: Any) -> None:
        return None

    had = {name: name in vars(module) for name in ("log", "log_dict")}
    module.log, module.log_dict = silent, silent
    try:
        yield
    finally:
        for name, present in had.items():
            if not present:
                vars(module).pop(name, None)
