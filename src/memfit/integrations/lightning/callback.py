"""The Lightning callback's logic, shared by the ``lightning`` and ``pytorch_lightning`` namespaces.

The two public modules (``memfit.lightning``, ``memfit.pytorch_lightning``) subclass this with
their namespace's ``Callback``. This module only translates: it reads the trainer's loop, batch,
optimizer, precision and strategy into a ``PlanningSession`` (``memfit.planning.session``), applies
the decision, and forwards what the ``RunMonitor`` (``memfit.monitoring.run_monitor``) measures to
``trainer.loggers``. Lightning privates are reached through ``internals.LightningInternals`` only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from memfit.diagnostics import degrade, raise_if_strict
from memfit.errors import (
    InsufficientMemoryError,
    InvalidInputError,
    MemfitError,
    ShardingNotModelledError,
    ValueDependentError,
)
from memfit.integrations.lightning.internals import LightningInternals
from memfit.integrations.lightning.recovery import RecoveringStep
from memfit.integrations.lightning.sharding import StrategyLayout, sharding_strategy_name, strategy_layout
from memfit.monitoring.controller import ControlledRun, RunController
from memfit.monitoring.recovery import (
    OPTIMIZER_STEP_OOM,
    LossReduction,
    OnOOM,
    batches_held,
    check_loss_reduction,
    check_on_oom,
    is_out_of_memory,
)
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
)
from memfit.planning.session import PlanningSession, restored_over_budget
from memfit.planning.unmodelled import not_modelled
from memfit.precision import Precision
from memfit.prediction.estimator import MemoryEstimate, estimate
from memfit.prediction.evaluation import EvaluationPeak, evaluation_peak
from memfit.reporting.figures import log_figure
from memfit.tracing.batch import dataset_length, infer_batch_size, is_stream, longest_batch, longest_of_a_stream
from memfit.tracing.checkpointing import CheckpointTarget, enable_checkpointing
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.model_state import preserved_rng_state
from memfit.units import format_bytes, format_margin

# The callback's docstring, shared by memfit.lightning and memfit.pytorch_lightning (neither imports the other)
_DOC = """Plan micro batch, gradient accumulation and checkpointing before the first batch; log drift.

    At ``setup`` (stage ``"fit"``) the callback takes one batch from the train dataloader (or
    ``sample``): where the dataloader's ``collate_fn`` pads batches of a map-style dataset, the
    batch of its longest examples, since the longest batch makes the peak (``memfit.tracing.batch.longest_batch``).
    It traces two training steps of the real LightningModule (its ``training_step``, the
    first optimizer from ``configure_optimizers``, the trainer's precision) on fake tensors, and
    plans with ``memfit.plan``: the largest micro batch whose predicted peak fits the budget minus
    the margin, the accumulation that keeps the effective batch, and checkpointing only if needed.
    In ``mode="plan"`` it applies the plan: the micro batch through ``lightning_setattr`` on the
    module, its hparams or the datamodule (attribute ``batch_arg_name``, as ``BatchSizeFinder``),
    ``trainer.accumulate_grad_batches``, and checkpointing (Hugging Face models inside the module
    use their own switch; other modules get ``torch.utils.checkpoint`` around ``checkpoint_modules``
    or the longest list of identical blocks). In ``mode="observe"`` it changes nothing and only
    logs drift. Under DDP, the smallest free memory of all ranks is used, rank 0 decides and every
    rank applies the same plan. Under ``FSDPStrategy``, ``ModelParallelStrategy`` (``fully_shard``
    over its data-parallel dimension) and ``DeepSpeedStrategy`` the strategy's options are read into a
    ``memfit.ShardingConfig`` (``memfit.integrations.lightning.sharding``) and the plan is one rank's:
    the effective batch counts micro x accumulation x data-parallel ranks. What memfit cannot model
    per rank (tensor parallelism, DeepSpeed's ZeRO++ or tensor parallelism) is named in one warning;
    memfit then predicts and plans nothing and logs the measured peaks only.

    The trace follows the loop the step runs in: Lightning's closure zeroes gradients between
    ``training_step`` and ``backward``, so its forward carries the last step's gradients (memfit's
    recovering closure, ``on_oom="replan"``, zeroes them first instead and keeps an accumulation
    window's earlier batches to replay them); accumulation keeps gradients through a window; a
    ``DDPStrategy`` adds DDP's gradient buckets (see ``memfit.tracing.ddp``).

    The trace calls ``training_step`` on fake tensors (``torch._subclasses.fake_tensor.is_fake``
    tells them apart), with ``self.log`` silenced; Python side effects of ``training_step``
    (counters, lists) happen for those calls too.

    An out-of-memory error in a training step (``on_oom="replan"``, the default, also in observe
    mode) does not end the run: the failed batch is retried in chunks whose losses are weighted by
    their share of the batch, and later batches run in the same chunks, so the effective batch,
    the samples seen and the optimizer steps stay as configured (see ``memfit.monitoring.recovery``). Each
    recovery is one warning with the old and new plan and the metrics ``memfit/oom_recoveries`` and
    ``memfit/micro_batch_size``; under DDP every rank takes the smallest chunk any rank needed.

    If the plan cannot be made (a model the trace cannot run, no batch-size attribute, ...), the
    callback warns once and training runs exactly as configured, its measured peaks still logged. A budget
    too small for ``min_batch_size`` even with checkpointing raises ``memfit.InsufficientMemoryError``
    before training starts, with the numbers.

    Args:
        budget: memory per device: bytes, a size (``"20GiB"``) or a GPU name (``"h100"``). Default: the
            device's free memory at setup (CUDA) or the machine's available RAM (CPU); with a GPU
            name in ``target``, that GPU's memory.
        target: the device the plan is for: ``"cuda"``, ``"cpu"`` or a GPU name (``"h100"``: CUDA
            semantics with that card's compute capability). Default: the device the run uses, or the
            GPU ``budget`` names, so ``budget="h100"`` plans for an H100 even on a machine without one
            (the run itself trains where the trainer puts it). A device other than the run's needs a
            budget or a GPU name.
        margin: fraction of the budget kept free (default ``DEFAULT_MARGIN``, 1.5 %: the prediction's measured error).
        target_batch_size: effective batch to keep (micro x accumulation x devices). Default: the batch
            size configured x ``accumulate_grad_batches`` x world size. ``"max"``: the largest micro
            batch, no accumulation.
        batch_arg_name: attribute holding the batch size on the module, hparams or datamodule.
        allow_checkpointing: whether checkpointing may be turned on.
        checkpoint_modules: block classes or qualified names to checkpoint in plain (non-HF) modules.
        mode: ``"plan"`` to apply the plan, ``"observe"`` to only predict and log drift.
        sample: a batch (or callable ``batch_size -> batch``) to trace instead of the dataloader's.
        min_batch_size, max_batch_size: bounds on the micro batch.
        log_every_n_steps: drift logging cadence in optimizer steps (default: the trainer's).
        on_oom: ``"replan"`` to recover from out-of-memory errors in a step, ``"raise"`` to let them end the run.
        loss_reduction: how ``training_step``'s loss reduces a batch, ``"mean"`` (the usual) or ``"sum"``;
            it decides how chunk losses are weighted after a recovery.
        verbose: print the plan and the final drift line.

    Logged metrics (every ``log_every_n_steps`` and at the end of training, through
    ``trainer.loggers``, rank 0 only; peaks are per window, the counters reset after each read):

    * ``memfit/predicted_peak_allocated_bytes``: predicted ``max_memory_allocated`` (CPU: tensor bytes)
    * ``memfit/predicted_peak_reserved_bytes`` (CUDA): predicted ``max_memory_reserved``, the plan's peak
      without the CUDA context
    * ``memfit/measured_peak_allocated_bytes``, ``memfit/measured_peak_reserved_bytes`` (CUDA)
    * ``memfit/drift_allocated_pct``, ``memfit/drift_reserved_pct`` (CUDA): 100 x (measured - predicted) / predicted
    * ``memfit/measured_device_used_bytes`` (CUDA with ``nvidia-ml-py``): NVML used memory of the device
    * ``memfit/measured_peak_rss_bytes`` (CPU): the process's peak resident memory (interpreter, libraries and
      data included): not comparable with the predicted tensor bytes, so no drift is computed on CPU
    * ``memfit/rank{r}/<key>`` (more than one rank): each rank's own predicted and measured peaks (the keys
      above that a rank measures), gathered to rank 0 at the same steps

    With manual optimization (``automatic_optimization = False``) nothing is predicted yet: the
    callback warns once, plans nothing, and logs the measured keys only (``MANUAL_OPTIMIZATION`` says why).

    Lightning privates (the loop's closure, the dataloader source) are used through
    ``memfit.integrations.lightning.internals`` only; on a Lightning release it was not tested on,
    the callback warns once and leaves the out-of-memory recovery off.

    The plan is logged once as hyperparameters ``memfit/micro_batch_size``,
    ``memfit/accumulate_grad_batches``, ``memfit/gradient_checkpointing``, ``memfit/effective_batch_size``,
    ``memfit/target_batch_size``, ``memfit/predicted_peak_bytes``, ``memfit/budget_bytes``, ... Warnings
    (rank 0, once each): measured reserved above predicted by more than the margin (CUDA); peaks
    growing in each of three windows in a row after the first window (a leak; on CPU by 64 MiB at
    least, as the process's resident memory moves with its allocator), each with the step range,
    the figures and a metric (``memfit/alarm_over_margin``, ``memfit/alarm_leak``). The plan is
    saved in checkpoints and restored on resume.
    """

__all__ = ["MANUAL_OPTIMIZATION", "MemoryPlannerBase"]

# Why a module with manual optimization is measured, not planned. Tracing it would take fake copies
# of every optimizer behind ``self.optimizers()``, ``self.manual_backward`` running backward inside
# the traced ``training_step``, and a trace whose backward and optimizer steps happen inside the
# forward call (the tracer marks phases and counts gradients and optimizer state around them).
MANUAL_OPTIMIZATION = (
    "memfit does not trace manual optimization yet (automatic_optimization=False: training_step steps its "
    "optimizers itself): it plans and predicts nothing for this run and logs the measured peaks only "
    "(memfit/measured_peak_*). Set the batch size yourself."
)

Mode = Literal["plan", "observe"]


@dataclass
class _Decision:
    """What every rank applies: the plan (or ``None``), and the predictions drift is measured against."""

    plan: dict[str, Any] | None
    predicted_allocated_bytes: int | None
    predicted_reserved_bytes: int | None
    error: str | None = None
    insufficient_memory: bool = False  # the error is the verdict that nothing fits: it stops the fit
    measured_only: bool = False  # nothing predicted (manual optimization): log the measured peaks alone
    # the predicted (allocated, reserved) peak of the run as configured: what is measured against if the plan
    # cannot be applied and the run trains as configured
    as_configured: tuple[int, int] | None = None


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
        self.budget_bytes = parse_budget(budget)
        self.target = check_target(target, budget)
        self._budget = budget
        self.options = RunOptions(margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing)
        _check_arguments(batch_arg_name, mode, log_every_n_steps)
        check_flag("verbose", verbose)
        self.on_oom = check_on_oom(on_oom)
        self.loss_reduction = check_loss_reduction(loss_reduction)
        self.margin, self.allow_checkpointing = self.options.margin, self.options.allow_checkpointing
        self.batch_arg_name = batch_arg_name
        self.checkpoint_modules = checkpoint_modules
        self.mode = mode
        self.sample = sample
        self.log_every_n_steps = log_every_n_steps
        self.verbose = verbose
        self.plan: Plan | None = None
        self.estimate: MemoryEstimate | None = None
        self.validation: EvaluationPeak | None = None
        self.controller = RunController(_LightningPort(self), margin=self.margin, on_oom=self.on_oom,
                                        loss_reduction=self.loss_reduction, verbose=verbose)  # fmt: skip
        self._internals = LightningInternals(self._pl)
        self._decision: _Decision | None = None
        self._session: PlanningSession | None = None  # rank 0's, kept to trace a plan restored on resume
        self._configured_estimate: MemoryEstimate | None = None  # rank 0's trace of the run as configured
        self._train_samples: int | None = None  # the training set's length, where the loader's dataset has one
        self._include_context = True  # whether the plan counted the CUDA context within the budget
        self._restored_plan: dict[str, Any] | None = None
        self._trainer_module: tuple[Any, Any] | None = None
        self._steps_seen = 0
        self._hparams_logged = False
        self._recovering: RecoveringStep | None = None  # the training step while recovery is on
        self._sample_notes: list[str] = []  # what the choice of the traced batch could not know

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._plan_and_apply(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._session = None  # a restored plan has been traced by now; the session holds the sample batch
        self._steps_seen = trainer.global_step  # a resumed run starts counting where it left off
        self._start_measuring(trainer, pl_module)
        self._install_recovery(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.controller.agree_across_ranks()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        closure_finished = self._recovering is not None and self._recovering.closure_finished
        if self.recovery is not None and closure_finished and is_out_of_memory(exception):
            self._warn("optimizer-oom", OPTIMIZER_STEP_OOM)
        self.teardown(trainer, pl_module, "fit")  # Lightning skips callbacks' teardown after an exception

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped = trainer.global_step != self._steps_seen  # an optimizer step ended a window
        if stepped:
            self.controller.end_accumulation_window()
        self._steps_seen = trainer.global_step
        if stepped:
            self._maybe_log_drift(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._log_final_drift(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._internals.uninstall_step(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_plan = state_dict.get("plan")
        if self._restored_plan and self._trainer_module is not None:
            self._reapply_restored(*self._trainer_module)

    # --------------------------------------------------------------- planning
    def _plan_and_apply(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 decides on the smallest capacity of all ranks; every rank applies the same plan."""
        self._trainer_module = (trainer, pl_module)
        planning = self._planning_target(trainer)
        capacity = planning.capacity_bytes(trainer.strategy.root_device) if isinstance(planning, PlanningTarget) else 0
        smallest = min(_all_gather_ints(trainer.strategy, capacity))
        decision = self._decide_on_rank_zero(trainer, pl_module, smallest) if trainer.is_global_zero else None
        decision = trainer.strategy.broadcast(decision, src=0)
        self._decision = decision
        if decision.insufficient_memory:
            raise InsufficientMemoryError(decision.error)
        if decision.error is not None:
            self._warn("plan", f"memfit could not plan this run ({decision.error}); training continues as configured.")
        elif decision.plan is not None and self.mode == "plan":
            if self._apply(trainer, pl_module, decision.plan):
                self.plan = self.plan or Plan.from_dict(decision.plan)  # every rank holds the plan it runs
                return
            # the run trains as configured: nothing says otherwise, and drift is measured against its own prediction
            self.plan, decision.plan = None, None
            if decision.as_configured is not None:
                decision.predicted_allocated_bytes, decision.predicted_reserved_bytes = decision.as_configured
                self.estimate = self._configured_estimate

    def _decide_on_rank_zero(self, trainer: Any, pl_module: Any, capacity: int) -> _Decision:
        try:
            return self._decide(trainer, pl_module, capacity)
        except InsufficientMemoryError as error:
            return _Decision(None, None, None, error=str(error), insufficient_memory=True)
        except Exception as error:  # never let memfit end the run (one warning once every rank knows)
            reason = str(error) if isinstance(error, MemfitError) else f"{type(error).__name__}: {error}"
            if isinstance(error, ValueDependentError):
                reason += (" In a LightningModule, skip such reads while memfit traces: they see fake tensors, "
                           "which `torch._subclasses.fake_tensor.is_fake(tensor)` tells apart.")  # fmt: skip
            raise_if_strict(f"memfit could not plan this run ({reason})", error)
            return _Decision(None, None, None, error=reason, measured_only=True)  # the run is still measured

    def _decide(self, trainer: Any, pl_module: Any, capacity: int) -> _Decision:
        device = trainer.strategy.root_device
        planning = self._planning_target(trainer)
        if isinstance(planning, InvalidInputError):  # a target the run cannot be planned for: warn, train as configured
            raise planning
        if not getattr(pl_module, "automatic_optimization", True):
            self._warn("manual-optimization", MANUAL_OPTIMIZATION)
            return _Decision(None, None, None, measured_only=True)
        try:
            layout = strategy_layout(trainer, self._internals)
        except ShardingNotModelledError as error:
            self._warn("sharding", not_modelled(str(error)))
            return _Decision(None, None, None, measured_only=True)
        planning.check_precision(str(trainer.precision))
        self._sample_notes = [note] if (note := planning.note(device)) else []
        self._sample_notes += layout.notes
        sample = self.sample if self.sample is not None else self._sample_batch(trainer)
        configured = self._configured_batch(pl_module) or (infer_batch_size(sample) if not callable(sample) else None)
        if configured is None:
            raise InvalidInputError(
                f"cannot tell the batch size: the module has no `{self.batch_arg_name}` attribute and the sample "
                "is a callable; set batch_arg_name"
            )
        session = PlanningSession(
            self._step_tracer(trainer, pl_module, sample, planning.target, layout),
            batch_size=configured,
            accumulation_steps=trainer.accumulate_grad_batches,
        )
        always = layout.checkpointing
        self._session = session
        self.estimate = session.trace_at(configured, always, trainer.accumulate_grad_batches)
        include_context = self._include_context = planning.include_context
        if self.mode == "observe":
            if capacity > 0:
                self._check_validation(trainer, pl_module, self.estimate, capacity, include_context)
            peak = self.estimate.at(configured)
            needed = peak.device_bytes if include_context else peak.reserved_bytes
            if self.verbose:  # the prediction, and what it rests on that can change it
                self._info(f"memfit: predicted peak {format_bytes(needed)} at micro batch {configured} (observe mode: "
                           "the run trains as configured)")  # fmt: skip
                for note in self._sample_notes:
                    self._info(f"memfit: {note}")
            budget = int(capacity * (1 - self.margin))
            if 0 < budget < needed:
                self._warn("observe-over", f"memfit: the predicted peak, {format_bytes(needed)} at micro batch "
                           f"{configured}, is over the {format_bytes(capacity)} budget ({format_bytes(budget)} after "
                           f"its {format_margin(self.margin)} margin): this run may run out of memory; mode='plan' "
                           "picks a micro batch that fits")  # fmt: skip
            return _Decision(None, peak.allocated_bytes, peak.reserved_bytes)
        request = self.options.request(capacity_bytes=capacity, configured=configured,
                                       accumulation=trainer.accumulate_grad_batches,
                                       ranks=layout.data_parallel_size, include_context=include_context,
                                       always_checkpoint=always, samples=self._train_samples)  # fmt: skip
        as_configured = self.estimate.at(configured)
        self._configured_estimate = self.estimate
        decision = session.decide_run(request, device=device, notes=self._sample_notes)
        self.plan, self.estimate = decision.plan, decision.estimate
        self._check_validation(trainer, pl_module, self.estimate, capacity, include_context)
        return _Decision(self.plan.to_dict(), self.plan.predicted_allocated_bytes, self.plan.predicted_reserved_bytes,
                         as_configured=(as_configured.allocated_bytes, as_configured.reserved_bytes))  # fmt: skip

    def _planning_target(self, trainer: Any) -> PlanningTarget | InvalidInputError:
        """The device the plan is for (``target=``, ``budget=``, the run's device), or why there is none."""
        try:
            return planning_target(self.target, self._budget, trainer.strategy.root_device)
        except InvalidInputError as error:
            return error

    def _step_tracer(self, trainer: Any, pl_module: Any, sample: Any, target: Target, layout: StrategyLayout) -> Any:
        """``trace_at(micro, checkpointing, accumulation)``: the module's ``training_step`` in Lightning's loop,
        on one rank of the strategy's layout."""
        device = trainer.strategy.root_device
        optimizer = self._first_optimizer(pl_module)
        precision = Precision.parse(str(trainer.precision))
        sharding = layout.sharding
        ddp = self._ddp_config(trainer.strategy) if sharding is None else None
        blocks = layout.checkpoint_modules or self.checkpoint_modules or layout.unit_modules
        forward = functools.partial(_training_step, device=device, internals=self._internals)
        # Lightning's closure runs training_step, zero_grad, backward; memfit's recovering closure (on_oom=
        # "replan") zeroes before training_step, so the forward no longer carries the last gradients.
        zero_grad = "after_step" if self.on_oom == "replan" else "before_backward"

        def trace_at(micro: int, checkpointing: bool, accumulation: int) -> MemoryEstimate:
            loop = TrainingLoop(zero_grad=zero_grad, accumulation_steps=accumulation, ddp=ddp, sharding=sharding,
                                extra_batches=batches_held(accumulation, self.on_oom))  # fmt: skip
            traced = estimate(
                pl_module, sample, optimizer=optimizer, precision=precision, batch_size=micro, loop=loop, target=target,
                gradient_checkpointing=checkpointing, checkpoint_modules=blocks,
                forward_fn=forward, loss_fn=_loss_of_training_step,
            )  # fmt: skip
            return traced.with_notes(*self._sample_notes)

        return trace_at

    def _check_validation(
        self, trainer: Any, pl_module: Any, training: MemoryEstimate, capacity: int, include_context: bool
    ) -> None:
        """Warn when the validation pass, beside the optimizer state, would not fit where training does."""
        self.validation = _validation_peak(self._pl, self._internals, trainer, pl_module, training)
        if self.validation is None:
            return
        budget = int(capacity * (1 - self.margin))
        needed = self.validation.device_bytes if include_context else self.validation.reserved_bytes
        if needed > budget:
            self._warn("validation",
                f"memfit: validation may run out of memory where training fits: {self.validation.summary()}, over "
                f"the {format_bytes(budget)} budget ({format_bytes(capacity)} with a {format_margin(self.margin)} "
                "margin). "
                "Lower the validation batch size.")  # fmt: skip

    def _ddp_config(self, strategy: Any) -> DDPConfig | None:
        """DDP's bucket options when the strategy wraps the model in ``DistributedDataParallel``."""
        deepspeed = getattr(self._pl.strategies, "DeepSpeedStrategy", ())
        if not isinstance(strategy, self._pl.strategies.DDPStrategy) or isinstance(strategy, deepspeed):
            return None
        return DDPConfig.from_kwargs(self._internals.ddp_kwargs(strategy))

    def _apply(self, trainer: Any, pl_module: Any, plan_dict: dict[str, Any]) -> bool:
        """Set micro batch, accumulation and checkpointing, all or nothing; whether the plan was applied."""
        micro = plan_dict["micro_batch_size"]
        parsing = self._pl.utilities.parsing
        if not parsing.lightning_hasattr(pl_module, self.batch_arg_name):
            message = (
                f"memfit planned micro batch {micro} x {plan_dict['accumulate_grad_batches']} accumulation steps but "
                f"found no `{self.batch_arg_name}` on the module, its hparams or the datamodule to set it; nothing "
                "was changed and the run trains as configured. Expose the batch size there (or set batch_arg_name) "
                "to let memfit apply its plan."
            )
            self._warn("no-batch-attribute", message)
            return False
        previous_batch = parsing.lightning_getattr(pl_module, self.batch_arg_name)
        previous_accumulation = trainer.accumulate_grad_batches
        try:
            parsing.lightning_setattr(pl_module, self.batch_arg_name, micro)
            trainer.accumulate_grad_batches = plan_dict["accumulate_grad_batches"]
            if plan_dict["gradient_checkpointing"] and not self._internals.fsdp_checkpointing(trainer.strategy)[0]:
                enable_checkpointing(pl_module, self.checkpoint_modules)  # not where FSDP wraps the blocks itself
        except Exception as error:
            parsing.lightning_setattr(pl_module, self.batch_arg_name, previous_batch)
            trainer.accumulate_grad_batches = previous_accumulation
            degrade(f"memfit could not apply its plan ({type(error).__name__}: {error}); nothing was changed.", error,
                    key="apply", seen=self.controller.warned)  # fmt: skip
            return False
        self._warn_of_dropped_samples(trainer, previous_batch, micro)
        configured = (previous_batch, previous_accumulation) if isinstance(previous_batch, int) else None
        planned = (micro, plan_dict["accumulate_grad_batches"])
        warning = configured and last_window_warning("Lightning", self._train_samples, trainer.world_size,
                                                     configured, planned)  # fmt: skip
        if warning:
            self._warn("last-window", warning)
        self._internals.forget_train_loader(trainer)
        self._internals.record_initial_hparam(trainer, pl_module, self.batch_arg_name, micro)
        if self.verbose:
            plan = Plan.from_dict(plan_dict)
            self._info("memfit plan: " + plan.summary() + "".join(f"\n  - {r}" for r in plan.reasons))
        return True

    def _warn_of_dropped_samples(self, trainer: Any, configured: Any, micro: int) -> None:
        """A loader that drops its last incomplete batch drops another number of samples at the planned batch size:
        the batch size is all memfit sets, so it says what changes."""
        try:
            loader = self._internals.train_dataloader(trainer)
            samples = len(loader.sampler) if getattr(loader, "drop_last", False) else None
        except Exception:  # no loader memfit can read: nothing to say
            return
        if isinstance(configured, int) and configured > 0:
            warning = dropped_samples_warning("drop_last", samples, configured, micro)
            if warning is not None:
                self._warn("drop-last", warning)

    def _reapply_restored(self, trainer: Any, pl_module: Any) -> None:
        """On resume, keep the plan the run started with instead of whatever a fresh plan says."""
        saved = self._restored_plan
        if saved is None or self.mode != "plan":
            return
        current = self.plan.to_dict() if self.plan else None
        keys = ("micro_batch_size", "accumulate_grad_batches", "gradient_checkpointing")
        if current is not None and all(current[k] == saved[k] for k in keys):
            return
        if current is not None and current["gradient_checkpointing"] and not saved["gradient_checkpointing"]:
            self._warn("resume", "memfit: resuming without checkpointing as the run started, though a fresh plan "
                       "would use it")  # fmt: skip
        self.plan = Plan.from_dict(saved).with_reason("restored from the checkpoint")
        if self.verbose and current is not None:
            self._info("memfit: the checkpoint holds the plan the run started with; it replaces the plan above")
        self._apply(trainer, pl_module, self.plan.to_dict())  # printed with the reason it was restored
        if self._session is not None:  # rank 0 planned: the trace of the step the restored plan runs
            micro, checkpointing = saved["micro_batch_size"], saved["gradient_checkpointing"]
            self.estimate = self._session.trace_at(micro, checkpointing, saved["accumulate_grad_batches"])
            capacity = current["capacity_bytes"] if current is not None else 0
            over = restored_over_budget(self.plan, self.estimate, capacity, self.margin, self._include_context)
            if over is not None:
                self._warn("restored-over-budget", over)
        if self._decision is not None:  # every rank measures against the restored plan's own prediction
            self._decision.plan = saved
            self._decision.predicted_allocated_bytes = saved["predicted_allocated_bytes"]
            self._decision.predicted_reserved_bytes = saved["predicted_reserved_bytes"]

    def _sample_batch(self, trainer: Any) -> Any:
        loader = self._internals.train_dataloader(trainer)
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise InvalidInputError(
                f"the train dataloader is a {type(loader).__name__}; pass sample= (one batch) to MemoryPlanner"
            )
        self._train_samples = dataset_length(loader.dataset)
        with preserved_rng_state():  # taking a batch must not shift the run's shuffling
            sample = longest_batch(loader, notes=self._sample_notes)
        if is_stream(loader.dataset):  # its longest batch is not among its first: planned at the longest it can be
            sample, self._sample_notes = longest_of_a_stream(sample, trainer.lightning_module, loader.collate_fn, None,
                                                             None, self._sample_notes)  # fmt: skip
        return sample

    def _configured_batch(self, pl_module: Any) -> int | None:
        parsing = self._pl.utilities.parsing
        if parsing.lightning_hasattr(pl_module, self.batch_arg_name):
            value = parsing.lightning_getattr(pl_module, self.batch_arg_name)
            return value if isinstance(value, int) and value > 0 else None
        return None

    def _first_optimizer(self, pl_module: Any) -> Any:
        optimizers = self._internals.optimizers(pl_module)
        if len(optimizers) > 1:
            self._warn("optimizers", "memfit plans with the first of several optimizers")
        return optimizers[0] if optimizers else None

    # --------------------------------------------------------- OOM recovery
    def _install_recovery(self, trainer: Any, pl_module: Any) -> None:
        """Route each training step through ``OOMRecovery``: the loop's closure runs the batch in chunks."""
        if self.on_oom != "replan":
            return
        if not getattr(pl_module, "automatic_optimization", True):
            self._warn("manual", "memfit recovers from out-of-memory errors under automatic optimization only; "
                       "with manual optimization an out-of-memory error ends the run as usual.")  # fmt: skip
            return
        unsupported = self._internals.recovery_supported(trainer)
        if (sharded := sharding_strategy_name(trainer.strategy, self._internals)) is not None:
            unsupported = (f"under {sharded} every forward gathers parameters with the other ranks, so one rank "
                           "cannot rerun a batch in chunks alone")  # fmt: skip
        if unsupported is not None:
            self._warn("recovery", f"{unsupported}: memfit leaves its out-of-memory recovery off in this run; an "
                       "out-of-memory error will end it as usual.")  # fmt: skip
            return
        self.controller.install_recovery(
            estimate=self.estimate,
            reset_gradients=lambda: pl_module.zero_grad(set_to_none=True),
            enable_checkpointing=(
                functools.partial(enable_checkpointing, pl_module, self.checkpoint_modules)
                if self.allow_checkpointing
                else None
            ),
            checkpointing_on=bool(self.mode == "plan" and self.plan and self.plan.gradient_checkpointing),
        )
        self._recovering = RecoveringStep(trainer, pl_module, self._internals, self.controller)
        self._internals.install_step(trainer, self._recovering)

    # -------------------------------------------------------------- measuring
    def _start_measuring(self, trainer: Any, pl_module: Any) -> None:
        decision = self._decision
        if decision is None or (decision.predicted_allocated_bytes is None and not decision.measured_only):
            return
        if not self.controller.start_measuring(
            predicted_allocated_bytes=decision.predicted_allocated_bytes,
            predicted_reserved_bytes=decision.predicted_reserved_bytes,
            estimate=self.estimate,
        ):
            return
        if not trainer.is_global_zero:
            return
        if self.estimate is not None:
            capacity = (decision.plan or {}).get("budget_bytes")
            self.controller.figure("memfit/timeline", lambda: _plot("plot_timeline", self.estimate,
                                   capacity_bytes=capacity), self._internals.logging_step(trainer))  # fmt: skip
        if decision.plan is not None and not self._hparams_logged:
            self._hparams_logged = True
            _log_plan(trainer, decision.plan, self.mode, self.controller.warned)

    def _maybe_log_drift(self, trainer: Any) -> None:
        """After an optimizer step, on the steps Lightning logs the module's metrics at: it logs when the batches
        that stepped, this one included, are a multiple of ``log_every_n_steps``."""
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        counted = self._internals.logging_step(trainer) + 1
        self.controller.optimizer_step_ended(trainer.global_step, every=every, counted=counted)

    def _log_final_drift(self, trainer: Any) -> None:
        self.controller.training_ended(trainer.global_step, speaker=trainer.is_global_zero,
                                       figure_step=self._internals.logging_step(trainer))  # fmt: skip

    # ------------------------------------------------------------------ utils
    def _warn(self, key: str, message: str) -> None:
        """One rank-zero warning per kind of event and callback."""
        self.controller.warn(key, message)

    def _info(self, message: str) -> None:
        self._pl.utilities.rank_zero_info(message)


class _LightningPort:
    """The trainer's side of the run for ``RunController``: its strategy, loggers and rank-zero messages."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def _trainer(self) -> Any:
        if self.callback._trainer_module is None:
            raise RuntimeError("the trainer has not set memfit up")
        return self.callback._trainer_module[0]

    def device(self) -> torch.device:
        return self._trainer().strategy.root_device

    def world_size(self) -> int:
        return int(self._trainer().world_size)

    def rank(self) -> int:
        return int(self._trainer().global_rank)

    def accumulation(self) -> int:
        return int(self._trainer().accumulate_grad_batches)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._trainer().strategy.all_gather(tensor)

    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        """To every logger, on rank 0, on the step Lightning logs the module's metrics at; a logger that fails
        costs one warning."""
        trainer = self._trainer()
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=self.callback._internals.logging_step(trainer))
            except Exception as error:
                name = type(logger).__name__
                degrade(f"memfit could not log to {name} ({error})", error, key=f"logger-{name}",
                        seen=self.callback.controller.warned)  # fmt: skip

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """To every logger that takes pictures (TensorBoard, MLflow) or has a folder."""
        loggers = self.callback._pl.loggers
        for logger in self._trainer().loggers:
            if isinstance(logger, loggers.TensorBoardLogger):
                log_figure(figure, name, tensorboard=logger.experiment, step=step)
            elif isinstance(logger, loggers.MLFlowLogger):
                log_figure(figure, name, mlflow_client=logger.experiment, mlflow_run_id=logger.run_id)
            elif getattr(logger, "log_dir", None):
                log_figure(figure, name, folder=logger.log_dir)

    def warn(self, message: str) -> None:
        self.callback._pl.utilities.rank_zero_warn(message)

    def info(self, message: str) -> None:
        self.callback._pl.utilities.rank_zero_info(message)


def _validation_peak(pl: ModuleType, internals: LightningInternals, trainer: Any, pl_module: Any,
                     training: MemoryEstimate) -> EvaluationPeak | None:  # fmt: skip
    """The validation pass's peak beside what training leaves, or ``None`` when the fit runs none or it could not
    be estimated (the plan stands; only this check is lost)."""
    try:
        sample = _validation_sample(pl, internals, trainer, pl_module)
        if sample is None:
            return None
        device = trainer.strategy.root_device
        forward = functools.partial(_validation_step, device=device, internals=internals)
        evaluation = estimate(pl_module, sample, inference=True, precision=Precision.parse(str(trainer.precision)),
                              target=Target(training.device), forward_fn=forward)  # fmt: skip
        return evaluation_peak(training, evaluation)
    except Exception as error:
        degrade(f"memfit could not check the validation pass ({type(error).__name__}: {error})", error, quiet=True)
        return None


def _validation_sample(pl: ModuleType, internals: LightningInternals, trainer: Any, pl_module: Any) -> Any:
    """One batch of the first validation dataloader, or ``None`` when the fit runs no validation."""
    overridden = pl.utilities.model_helpers.is_overridden("validation_step", pl_module)
    if not trainer.limit_val_batches or not overridden:
        return None
    loaders = internals.val_dataloaders(trainer)
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


def _log_plan(trainer: Any, plan: dict[str, Any], mode: str, warned: set[str]) -> None:
    """The plan as each logger's hyperparameters; a logger that refuses them is named once, and the run goes on."""
    params = {f"memfit/{k}": v for k, v in plan.items() if k != "reasons"}
    params["memfit/mode"] = mode
    for logger in trainer.loggers:
        try:
            logger.log_hyperparams(params)
        except Exception as error:
            name = type(logger).__name__
            degrade(f"memfit could not log its plan to {name} ({error})", error, key=f"hparams-{name}",
                    seen=warned)  # fmt: skip


def _plot(function: str, *args: Any, **kwargs: Any) -> Any:
    from memfit.reporting import plots

    return getattr(plots, function)(*args, **kwargs)


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


def _all_gather_ints(strategy: Any, value: int) -> Sequence[int]:
    if getattr(strategy, "world_size", 1) <= 1:
        return [value]
    gathered = strategy.all_gather(torch.tensor([value], dtype=torch.int64, device=strategy.root_device))
    return [int(v) for v in gathered.flatten().tolist()]


def _check_arguments(batch_arg_name: Any, mode: Any, log_every_n_steps: Any) -> None:
    """Refuse a bad argument when the callback is made, not at the first batch (the plan's options are checked by
    ``RunOptions``)."""
    if not isinstance(batch_arg_name, str) or not batch_arg_name:
        raise InvalidInputError(f"`batch_arg_name` must be an attribute name, got {batch_arg_name!r}")
    if mode not in ("plan", "observe"):
        raise InvalidInputError(f"`mode` must be one of 'plan', 'observe', got {mode!r}")
    if log_every_n_steps is not None:
        check_positive("log_every_n_steps", log_every_n_steps)
