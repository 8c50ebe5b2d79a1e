"""The Hugging Face Trainer port: ``attach`` and ``MemoryPlannerCallback``.

Callbacks are never handed the ``Trainer``, and HF calls its ``report_to`` trackers before user callbacks, so the
callback holds the Trainer and runs first (``attach``, or the callback finding the Trainer that calls it). Its
events hand off to the run controller (``memfit.run.controller``); ``_TrainerPort`` translates the Trainer's
arguments, process group, step and trackers; the Trainer's privates are in ``internals``.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any, Literal

import torch

try:
    from transformers import TrainerCallback, TrainingArguments
    from transformers.trainer import Trainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.huggingface needs transformers and accelerate: pip install 'memfit[hf]'") from error

from memfit.diagnostics import degrade, info
from memfit.errors import InvalidInputError, MemfitError, ShardingNotModelledError
from memfit.integrations.huggingface import internals
from memfit.integrations.huggingface.arguments import (
    checkpointing_switch,
    ddp_config,
    held_batches,
    run_notes,
    run_precision,
    running_optimizer,
)
from memfit.integrations.huggingface.evaluation import evaluation_warning, predict_evaluation
from memfit.integrations.huggingface.planning import PLAN_FILE, PlannedArguments, plan_training_arguments
from memfit.integrations.huggingface.sharding import run_layout
from memfit.planning.capacity import free_device_bytes
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.run_options import RunOptions, check_flag
from memfit.planning.unmodelled import not_modelled
from memfit.prediction.evaluation import EvaluationPeak, fitting_flush
from memfit.reporting.figures import log_figure
from memfit.run.controller import ControlledRun, RunController
from memfit.run.port import RankZeroSpeaker, RunLayout, TrainingStep
from memfit.run.ranks import gathered, process_group_size
from memfit.run.recovery import (
    OPTIMIZER_STEP_OOM,
    LossReduction,
    OnOOM,
    OOMRecovery,
    check_loss_reduction,
    check_on_oom,
)
from memfit.tracing.batch import batch_examples, is_stream, longest_of_a_stream
from memfit.tracing.config import Target
from memfit.tracing.model_state import preserved_rng_state

__all__ = ["MemoryPlannerCallback", "attach"]

NOT_ATTACHED = (
    "MemoryPlannerCallback is not attached (its events do not come from a transformers.Trainer): its metrics reach "
    "only the callbacks after it (not the report_to trackers), and out-of-memory recovery and the evaluation check "
    "are off. Use memfit.huggingface.attach(trainer) before train()."
)

_UNSET: Any = object()
_PLANNING = ("budget", "target", "target_batch_size")


def attach(
    trainer: Trainer,
    callback: MemoryPlannerCallback | None = None,
    *,
    budget: int | str | None = _UNSET,
    target: str | None = None,
    target_batch_size: int | Literal["max"] | None = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    resume_from_checkpoint: str | bool | None = None,
    max_length: int | None = None,
    **options: Any,
) -> MemoryPlannerCallback:
    """Plan a built ``Trainer``'s batch and attach memfit to it: one line before ``train()``.

        trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
        attach(trainer, budget="h100")  # or budget=None: the free memory of the device the run uses
        trainer.train()

    With ``budget``, ``target`` or ``target_batch_size`` it plans what ``plan_training_arguments`` plans, on what
    the Trainer was built with, and applies it to the Trainer (``trainer.args`` becomes the planned copy); without
    them it attaches only, with the ``plan`` you give or none. Attached, the callback runs first, so its
    ``memfit/*`` keys reach every ``report_to`` tracker, and it can wrap the Trainer's step for the out-of-memory
    recovery and check the evaluation pass (docs/huggingface.md).

    Args:
        trainer: the ``transformers.Trainer`` about to train.
        callback: the callback to attach; default: the one the Trainer has, else a new one.
        budget, target, target_batch_size, min_batch_size, max_batch_size, resume_from_checkpoint, max_length:
            as for ``plan_training_arguments`` (``resume_from_checkpoint``: the one you will pass to ``train``).
        options: ``MemoryPlannerCallback`` arguments for a new one; ``margin`` and ``allow_checkpointing`` also
            apply to the plan.

    Returns:
        The attached callback (``callback.plan`` is the plan applied; ``estimate``, ``monitor`` and ``recovery``
        are filled in by ``train()``).
    """
    if not isinstance(trainer, Trainer):
        raise InvalidInputError(f"attach() takes a transformers.Trainer, got {type(trainer).__name__}")
    planning = budget is not _UNSET or target is not None or target_batch_size is not None
    if planning and options.get("plan") is not None:
        raise InvalidInputError("give attach() either plan= (a plan you made) or budget=/target= to plan, not both")
    present = [c for c in trainer.callback_handler.callbacks if isinstance(c, MemoryPlannerCallback)]
    if callback is None and present:
        if set(options) - {"plan"} or (options.get("plan") is not None and present[0].plan is not None):
            raise InvalidInputError(
                f"the Trainer already has a MemoryPlannerCallback; give it {sorted(options)} where you built it, "
                "or do not pass it to the Trainer"
            )
        callback = present[0]
        if options.get("plan") is not None:
            callback.plan = options["plan"]
    elif callback is None:
        unknown = sorted(set(options) - set(inspect.signature(MemoryPlannerCallback).parameters))
        if unknown:
            known = ", ".join(p for p in inspect.signature(MemoryPlannerCallback).parameters if p != "plan")
            raise InvalidInputError(f"attach() got unknown option(s) {unknown}; it passes on those of "
                                    f"MemoryPlannerCallback ({known}) and plan=")  # fmt: skip
        callback = MemoryPlannerCallback(**options)
    elif options:
        raise InvalidInputError(f"pass {sorted(options)} to the MemoryPlannerCallback, not to attach()")
    if planning:
        planned = _plan_built_trainer(
            trainer, callback, budget=None if budget is _UNSET else budget, target=target,
            target_batch_size=target_batch_size, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            resume_from_checkpoint=resume_from_checkpoint, max_length=max_length,
        )  # fmt: skip
        fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "eval_accumulation_steps",
                  checkpointing_switch(trainer.args))  # fmt: skip
        internals.apply_arguments(trainer, {name: getattr(planned.args, name) for name in fields})
        callback.plan = planned.plan
        if (kept := internals.keep_configured_loss(trainer, callback.plan)) is not None:
            callback.plan = callback.plan.with_reason(kept)
        callback.controller.say_plan(callback.plan)
    _put_first(trainer, callback)
    return callback


def _plan_built_trainer(trainer: Trainer, callback: MemoryPlannerCallback, **planning: Any) -> PlannedArguments:
    """``plan_training_arguments`` on what the Trainer was built with."""
    if trainer.train_dataset is None:
        raise InvalidInputError("the Trainer has no train_dataset to plan on: build it with train_dataset=...")
    if trainer.args.auto_find_batch_size:
        raise InvalidInputError(
            "the Trainer has auto_find_batch_size=True, which would replace memfit's batch: turn one of them off"
        )
    return plan_training_arguments(
        trainer.model, trainer.args, trainer.train_dataset, data_collator=trainer.data_collator,
        processing_class=trainer.processing_class, margin=callback.margin,
        allow_checkpointing=callback.allow_checkpointing, eval_dataset=trainer.eval_dataset,
        compute_metrics=trainer.compute_metrics, preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
        **planning,
    )  # fmt: skip


def _put_first(trainer: Trainer, callback: MemoryPlannerCallback) -> None:
    """Make ``callback`` the Trainer's first (and only) memfit callback and hand it the Trainer. The list is
    replaced, not changed in place, so an event being dispatched over the old one goes on undisturbed."""
    handler = trainer.callback_handler
    others = [c for c in handler.callbacks if not isinstance(c, MemoryPlannerCallback)]
    handler.callbacks = [callback, *others]
    callback._trainer = trainer


class MemoryPlannerCallback(ControlledRun, TrainerCallback):
    """Measure peak memory while the Trainer trains and log it against memfit's prediction.

    Attach it with ``memfit.huggingface.attach(trainer, budget=...)`` (passed in ``Trainer(callbacks=[...])`` it
    attaches itself). At ``on_train_begin`` it traces the step that is about to run, in the Trainer's loop, and
    every ``logging_steps`` adds the window's figures to the Trainer's logs before the ``report_to`` trackers see
    them. The plan is saved into each checkpoint (``memfit_plan.json``) so a resumed run keeps it. Under FSDP or
    DeepSpeed the model it is handed is sharded already: each rank is measured against the per-rank prediction of
    the ``plan`` from ``plan_training_arguments``. An out-of-memory error in a step (``on_oom="replan"``) is
    recovered as in every port (``memfit.run.recovery``); any failure inside memfit is one warning.

    Logged keys (those measured on the device): ``memfit/predicted_peak_allocated_bytes``,
    ``memfit/predicted_peak_reserved_bytes``, ``memfit/measured_peak_allocated_bytes``,
    ``memfit/measured_peak_reserved_bytes``, ``memfit/drift_allocated_pct``, ``memfit/drift_reserved_pct``,
    ``memfit/measured_device_used_bytes`` (CUDA; NVML with ``nvidia-ml-py``); ``memfit/measured_peak_rss_bytes``
    (CPU: the whole process, not compared with the predicted tensor bytes); ``memfit/alarm_over_margin``,
    ``memfit/alarm_leak``; with a plan, in the first log, ``memfit/micro_batch_size``,
    ``memfit/accumulate_grad_batches``, ``memfit/gradient_checkpointing``, ``memfit/effective_batch_size``; after a
    recovery, ``memfit/oom_recoveries``; with several processes, each rank's own as ``memfit/rank{r}/<key>``.

    Args:
        plan: the ``Plan`` from ``plan_training_arguments`` (optional; logged and checkpointed).
        margin: drift above this fraction of the prediction raises a warning (once).
        on_oom: ``"replan"`` to recover from out-of-memory errors in a step, ``"raise"`` to let them end the run.
        loss_reduction: how the model's loss reduces a batch (``"mean"``, what HF models return, or ``"sum"``).
        allow_checkpointing: whether a recovery may turn on gradient checkpointing.
        verbose: log the prediction and the final drift line.
    """

    def __init__(
        self,
        plan: Plan | None = None,
        margin: float = DEFAULT_MARGIN,
        on_oom: OnOOM = "replan",
        loss_reduction: LossReduction = "mean",
        allow_checkpointing: bool = True,
        verbose: bool = True,
    ) -> None:
        if plan is not None and not isinstance(plan, Plan):
            raise InvalidInputError(f"`plan` must be a memfit.Plan or None, got {type(plan).__name__}")
        options = RunOptions(margin=margin, allow_checkpointing=allow_checkpointing)  # refused in every port's words
        check_flag("verbose", verbose)
        self.on_oom, self.allow_checkpointing, self.verbose = check_on_oom(on_oom), allow_checkpointing, verbose
        self.port = _TrainerPort(self)
        reduction = check_loss_reduction(loss_reduction)
        self.controller = RunController(self.port, options=options, on_oom=self.on_oom, loss_reduction=reduction,
                                        verbose=verbose)  # fmt: skip
        self.plan = plan
        self.evaluation: EvaluationPeak | None = None
        self._args: TrainingArguments | None = None  # the arguments of the run under way
        self._trainer: Trainer | None = None  # set by attach()
        self._pending: dict[str, float] = {}
        self._first_log = True
        self._layout: RunLayout | None = None
        self._timeline_logged = False

    # ---------------------------------------------------------------- events
    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None and (trainer := internals.calling_trainer(Trainer)) is not None:
            _put_first(trainer, self)  # passed in Trainer(callbacks=[...]): attached as attach() would
        self._check_runs_the_plan(args)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.port.model = kwargs.get("model")
        self._args = args
        self.controller.monitor = self.controller.recovery = None
        self.controller.measuring = False
        if self._trainer is None and (trainer := internals.calling_trainer(Trainer)) is not None:
            _put_first(trainer, self)  # added with trainer.add_callback(...): attached as attach() would
        if self._trainer is None:
            self.controller.warn("not-attached", NOT_ATTACHED)
        runs_the_plan = self._check_runs_the_plan(args)  # a plan given to attach() after the Trainer was built
        kept = internals.keep_configured_loss(self._trainer, self.plan) if self._trainer and runs_the_plan else None
        if kept is not None:
            self.plan = self.plan.with_reason(kept)
            if self.verbose:
                info(f"memfit: {kept}")
        try:
            self._predict(args, model, kwargs.get("train_dataloader"), kwargs.get("optimizer"))
        except Exception as error:  # never let memfit end the run
            reason = str(error) if isinstance(error, MemfitError) else f"{type(error).__name__}: {error}"
            degrade(f"memfit could not predict this run ({reason}); no drift is logged", error, key="predict",
                    seen=self.controller.warned)  # fmt: skip
        if self._trainer is None:
            return
        if self.estimate is not None:
            try:
                self._check_evaluation(args, model)
            except Exception as error:  # never let memfit end the run
                degrade(f"memfit could not check evaluation ({type(error).__name__}: {error})", error,
                        key="evaluation", seen=self.controller.warned)  # fmt: skip
        self.controller.install_recovery(checkpointing_on=bool(getattr(args, checkpointing_switch(args), False)))

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.controller.end_accumulation_window()  # after the optimizer step
        self.controller.agree_across_ranks()
        every = max(1, int(state.logging_steps or args.logging_steps))
        self.controller.optimizer_step_ended(state.global_step, every=every)

    def on_log(
        self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        if logs is None or not self._pending or "loss" not in logs:
            return  # only training logs carry memory metrics
        added = dict(self._pending)
        if not self._timeline_logged and self.estimate is not None and state.is_world_process_zero:
            self._timeline_logged = True  # the trackers are set up by now (their on_train_begin ran after ours)
            self.controller.figure("memfit/timeline", lambda: _plot("plot_timeline", self.estimate), state.global_step)
        if self._first_log and self.plan is not None:
            for key in ("micro_batch_size", "accumulate_grad_batches", "effective_batch_size"):
                added[f"memfit/{key}"] = getattr(self.plan, key)
            added["memfit/gradient_checkpointing"] = int(self.plan.gradient_checkpointing)
        loss = logs["loss"]
        logs.update(added)
        # The Trainer appended a copy of these logs to ``log_history`` (``trainer_state.json``) before calling the
        # callbacks: the keys go into that entry too, so the saved history holds them.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step and history[-1].get("loss") == loss:
            history[-1].update(added)
        self._first_log = False
        self._pending = {}

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.plan is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / PLAN_FILE).write_text(json.dumps(self.plan.to_dict(), indent=2))

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.port.uninstall_step()
        if state.is_world_process_zero:
            self.controller.finish(state.global_step)

    # --------------------------------------------------------------- helpers
    def _check_runs_the_plan(self, args: TrainingArguments) -> bool:
        """Whether the Trainer's arguments run the plan; one warning when they do not (built with the arguments
        planned from)."""
        if self.plan is None:
            return False
        runs = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
        planned = (self.plan.micro_batch_size, self.plan.accumulate_grad_batches)
        if runs != planned:
            self.controller.warn(
                "mismatch",
                f"the Trainer runs per_device_train_batch_size={runs[0]} x gradient_accumulation_steps={runs[1]}, not "
                f"the planned {planned[0]} x {planned[1]}: pass the args plan_training_arguments returned to Trainer, "
                "or plan with attach(trainer, budget=...)",
            )
        return runs == planned

    def _predict(self, args: TrainingArguments, model: Any, loader: Any, optimizer: Any) -> None:
        """Trace the step that is about to run (its batch, accumulation, precision and optimizer) and measure the
        run against it; under FSDP or DeepSpeed the model is sharded already, and the plan's per-rank figures are
        measured against."""
        if model is None or loader is None:
            raise InvalidInputError("the Trainer passed no model or train dataloader")
        try:
            self._layout = run_layout(args, model, precision=run_precision(args))
        except ShardingNotModelledError as error:
            self.controller.warn("sharding", not_modelled(str(error)))
            self._layout = RunLayout()
            self.controller.start_measuring(predicted_allocated_bytes=None, predicted_reserved_bytes=None,
                                            traced=None)  # fmt: skip
            return
        if self._layout.sharding is not None:
            self.controller.measure_against_plan(self._layout, without_plan="the Trainer hands callbacks the model "
                                                 "sharded: pass plan= from plan_training_arguments")  # fmt: skip
            return
        micro, device, found = args.per_device_train_batch_size, next(model.parameters()).device, []
        with preserved_rng_state():
            sample = loader.collate_fn(batch_examples(loader.dataset, micro, args.length_column_name, notes=found))
        if is_stream(loader.dataset):  # planned, as plan_training_arguments does, at the longest it can produce
            sample, found = longest_of_a_stream(sample, model, loader.collate_fn, None, None, found)
        if self.verbose and self.plan is None:
            for note in found:
                info(f"memfit: {note}")
        step = TrainingStep(
            model, dict(sample) if isinstance(sample, dict) else sample, running_optimizer(args, model, optimizer),
            run_precision(args), Target("cuda" if device.type == "cuda" else "cpu"), ddp=ddp_config(args, model),
            held_batches=functools.partial(held_batches, device=device), notes=(*run_notes(args), *found),
        )  # fmt: skip
        self.controller.measure_configured(step, micro, args.gradient_accumulation_steps)

    def _check_evaluation(self, args: TrainingArguments, model: Any) -> None:
        """Predict the Trainer's evaluation pass beside this run's training state; warn when it would not fit."""
        self.evaluation = None
        trainer = self._trainer
        if model is None or trainer.eval_dataset is None:
            return
        device = next(model.parameters()).device
        try:
            self.evaluation = predict_evaluation(
                trainer.accelerator.unwrap_model(model), args, trainer.eval_dataset, self.estimate, device=device,
                data_collator=trainer.data_collator, compute_metrics=trainer.compute_metrics,
                preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
            )  # fmt: skip
        except Exception as error:  # the run goes on; only this check is lost
            degrade(f"memfit could not check the evaluation pass ({type(error).__name__}: {error})", error, quiet=True)
            return
        free = free_device_bytes(device) if self.plan is None else 0
        budget = self.plan.budget_bytes if self.plan is not None else int(free * (1 - self.margin))
        if budget > 0 and self.evaluation.reserved_bytes > budget:
            steps = fitting_flush(self.evaluation, self.estimate, budget, include_context=False)
            self.controller.warn("evaluation", evaluation_warning(self.evaluation, budget, steps))


class _TrainerPort(RankZeroSpeaker):
    """The Trainer's side of the run for ``RunController``: its arguments, process group, step and trackers. The
    Trainer's trackers read the training logs, so scalars wait for the next ``on_log`` to join them."""

    def __init__(self, callback: MemoryPlannerCallback) -> None:
        self.callback = callback
        self.model: Any = None  # the wrapped model the Trainer trains, at on_train_begin
        self._replaced: list[internals.Replaced] = []

    def _args(self) -> TrainingArguments:
        args = self.callback._args
        if args is None:
            raise RuntimeError("the Trainer has not started training")
        return args

    def device(self) -> torch.device:
        return self._args().device

    def world_size(self) -> int:
        return process_group_size()

    def rank(self) -> int:
        return self._args().process_index

    def accumulation(self) -> int:
        return self._args().gradient_accumulation_steps

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return gathered(tensor)

    def recovery_unsupported(self) -> str | None:
        layout = self.callback._layout
        if layout is not None and layout.sharding is not None:
            return (f"memfit's out-of-memory recovery runs chunks beside the {layout.label} wrapper, which a sharded "
                    "model cannot do: it stays off in this run")  # fmt: skip
        return None

    def install_step(self, recovery: OOMRecovery) -> None:
        """Each batch of the Trainer's step in chunks through ``recovery`` (``internals.install_chunked_step``)."""
        trainer, controller = self.callback._trainer, self.callback.controller
        if self.model is None or trainer is None:
            raise InvalidInputError("the Trainer passed no model")
        inner = trainer.accelerator.unwrap_model(self.model)
        internals.install_chunked_step(trainer, self.model, inner, recovery,
                                       lambda: controller.warn("optimizer-oom", OPTIMIZER_STEP_OOM),
                                       self._replaced)  # fmt: skip

    def uninstall_step(self) -> None:
        internals.restore_attributes(self._replaced)

    def trained_module(self) -> torch.nn.Module:
        return self.callback._trainer.accelerator.unwrap_model(self.model)

    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        self.callback._pending.update(metrics)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """To the TensorBoard writer of HF's TensorBoard callback, the active MLflow run and ``output_dir``."""
        trainer = self.callback._trainer
        callbacks = trainer.callback_handler.callbacks if trainer is not None else []
        writer = next((getattr(cb, "tb_writer", None) for cb in callbacks if hasattr(cb, "tb_writer")), None)
        mlflow_module = None
        if any(type(cb).__name__ == "MLflowCallback" for cb in callbacks):
            import mlflow as mlflow_module
        log_figure(figure, name, tensorboard=writer, mlflow_module=mlflow_module, folder=self._args().output_dir,
                   step=step)  # fmt: skip

    def log_plan(self, params: dict[str, Any]) -> None:
        return None  # the plan joins the first training log (on_log)


def _plot(function: str, *args: Any) -> Any:
    from memfit.reporting import plots

    return getattr(plots, function)(*args)
