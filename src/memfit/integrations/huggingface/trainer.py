"""Hugging Face ``transformers.Trainer``: plan the batch before the Trainer exists, log drift while it trains.

``Trainer.__init__`` copies ``per_device_train_batch_size`` into the Trainer before any callback
runs and never hands callbacks the Trainer, so no callback can change the micro batch. memfit
therefore plans in two places:

    from memfit.integrations.huggingface.trainer import MemoryPlannerCallback, plan_training_arguments

    planned = plan_training_arguments(model, args, train_dataset, budget="h100")  # batch, accumulation, ckpt
    trainer = Trainer(model=model, args=planned.args, train_dataset=train_dataset,
                      callbacks=[MemoryPlannerCallback(plan=planned.plan)])      # drift to every report_to tracker

``plan_training_arguments`` traces the real model with the optimizer ``args.optim`` names, the
precision of ``args.bf16`` / ``args.fp16`` and a batch collated from ``train_dataset`` as the
Trainer would collate it, and returns a copy of ``args`` with ``per_device_train_batch_size``,
``gradient_accumulation_steps`` and ``activation_checkpointing`` planned. ``MemoryPlannerCallback``
predicts the peak of what actually runs at ``on_train_begin`` and logs measured vs predicted
memory every ``logging_steps``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

try:
    from transformers import PreTrainedModel, TrainerCallback, TrainingArguments
    from transformers.trainer import Trainer
    from transformers.trainer_utils import get_last_checkpoint
    from transformers.utils import find_labels
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "memfit.integrations.huggingface.trainer needs transformers and accelerate: pip install 'memfit[hf]'"
    ) from error

from memfit.errors import InvalidInputError, MemfitError
from memfit.monitoring.drift import DriftMonitor
from memfit.monitoring.measure import PeakSampler, current_rss_bytes
from memfit.monitoring.recovery import (
    OPTIMIZER_STEP_OOM,
    LossReduction,
    OnOOM,
    OOMRecovery,
    Recovery,
    check_loss_reduction,
    check_on_oom,
    is_out_of_memory,
)
from memfit.planning.capacity import free_device_bytes, parse_budget
from memfit.planning.planner import Plan, plan
from memfit.prediction.estimator import MemoryEstimate, estimate
from memfit.prediction.evaluation import CollectedOutputs, EvaluationPeak, evaluation_peak, largest_flush_every
from memfit.reporting.figures import log_figure, matplotlib_available
from memfit.tracing.batch import batch_examples, longest_examples
from memfit.tracing.checkpointing import enable_checkpointing
from memfit.tracing.ddp import SHARDING_NOT_MODELLED, DDPConfig
from memfit.tracing.model_state import preserved_rng_state
from memfit.units import format_bytes

__all__ = [
    "PLAN_FILE",
    "MemoryPlannerCallback",
    "PlannedArguments",
    "longest_examples",
    "plan_training_arguments",
    "predict_evaluation",
    "predict_trainer_pass",
]

PLAN_FILE = "memfit_plan.json"  # written into each checkpoint folder, read back on resume


class PlannedArguments(NamedTuple):
    """``TrainingArguments`` with the plan applied, the plan, the estimate behind it, and the predicted
    evaluation pass (``None`` without an ``eval_dataset``)."""

    args: TrainingArguments
    plan: Plan
    estimate: MemoryEstimate
    evaluation: EvaluationPeak | None = None


def plan_training_arguments(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    *,
    data_collator: Any = None,
    processing_class: Any = None,
    budget: int | str | None = None,
    margin: float = 0.05,
    target_batch_size: int | Literal["max"] | None = None,
    allow_checkpointing: bool = True,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    resume_from_checkpoint: str | bool | None = None,
    eval_dataset: Any = None,
    compute_metrics: Any = None,
    preprocess_logits_for_metrics: Any = None,
) -> PlannedArguments:
    """Plan micro batch, accumulation and checkpointing for a Trainer that is about to be built.

    With an ``eval_dataset`` the evaluation pass is predicted too, beside the optimizer state
    training leaves, with the outputs the Trainer collects for ``compute_metrics``. When it would
    not fit, ``eval_accumulation_steps`` (if you left it unset) is set to the most batches whose
    outputs fit on the GPU before they move to the CPU; otherwise a warning says what to change.

    Args:
        model, args, train_dataset, data_collator, processing_class, eval_dataset, compute_metrics,
            preprocess_logits_for_metrics: what you will pass to ``Trainer``.
        budget: memory per device: bytes, ``"20GiB"`` or a GPU name; default: the free memory of the
            device the run will use (the CUDA GPU if there is one, else the available RAM).
        margin: fraction of the budget kept free.
        target_batch_size: effective batch to keep; default ``per_device_train_batch_size x
            gradient_accumulation_steps x world_size``; ``"max"`` for the largest micro batch.
        resume_from_checkpoint: as for ``Trainer.train``: when the checkpoint holds a memfit plan,
            that plan is returned unchanged so a resumed run keeps its batch.

    Returns:
        ``PlannedArguments(args, plan, estimate)``; ``args`` is a copy, the input is not changed.
    """
    if not isinstance(args, TrainingArguments):
        raise InvalidInputError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    if sharded_by := sharding(args):
        raise InvalidInputError(
            f"these arguments shard the model with {sharded_by}, which memfit does not model yet: its plan would "
            f"be {SHARDING_NOT_MODELLED}. Set the batch size yourself; MemoryPlannerCallback still logs measured memory"
        )
    budget_bytes = parse_budget(budget)
    configured = args.per_device_train_batch_size
    device = _run_device(args)
    sample = collated_sample(model, args, train_dataset, configured, data_collator, processing_class)
    optimizer = _trainer_optimizer(args, model)
    kwargs: dict[str, Any] = {"optimizer": optimizer, "precision": _precision(args), "device": device.type}
    kwargs["ddp"] = ddp_config(args, model)
    accumulation = args.gradient_accumulation_steps
    traced = estimate(
        model, sample, batch_size=configured, accumulation_steps=accumulation,
        extra_batches=held_batches(accumulation, device), **kwargs,
    )  # fmt: skip

    @functools.cache  # the planner and the confirmation may ask for the same trace
    def traced_at(micro: int, checkpointing: bool, accumulation_steps: int = accumulation) -> MemoryEstimate:
        if (micro, checkpointing, accumulation_steps) == (configured, False, accumulation):
            return traced
        return estimate(
            model, sample, batch_size=micro, gradient_checkpointing=checkpointing,
            accumulation_steps=accumulation_steps, extra_batches=held_batches(accumulation_steps, device), **kwargs,
        )  # fmt: skip

    restored = _saved_plan(args, resume_from_checkpoint)
    if restored is not None:
        chosen = Plan(**{**restored, "reasons": (*restored["reasons"], "restored from the checkpoint")})
    else:
        capacity = budget_bytes or free_device_bytes(device)
        if capacity <= 0:
            raise InvalidInputError(f"could not measure free memory on {device}; pass budget=")
        target = target_batch_size or configured * accumulation * args.world_size
        chosen = plan(
            traced,
            capacity,
            margin=margin,
            target_batch_size=target,
            world_size=args.world_size,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            allow_checkpointing=allow_checkpointing,
            checkpointed=lambda: traced_at(configured, True),
            include_context=device.type == "cuda" and budget_bytes is not None,
            confirm=traced_at,
        )
    switch = checkpointing_switch(args)
    changes: dict[str, Any] = {
        "per_device_train_batch_size": chosen.micro_batch_size,
        "gradient_accumulation_steps": chosen.accumulate_grad_batches,
        switch: chosen.gradient_checkpointing or bool(getattr(args, switch)),
    }
    evaluation = None
    if eval_dataset is not None:
        training = traced_at(chosen.micro_batch_size, chosen.gradient_checkpointing, chosen.accumulate_grad_batches)
        evaluation, flush_every = _planned_evaluation(
            model, args, eval_dataset, training, device, chosen.budget_bytes,
            include_context=device.type == "cuda" and budget_bytes is not None, data_collator=data_collator,
            processing_class=processing_class, compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        if flush_every is not None:
            changes["eval_accumulation_steps"] = flush_every
            chosen = dataclasses.replace(chosen, reasons=(
                *chosen.reasons, f"eval_accumulation_steps={flush_every}: the outputs collected for compute_metrics "
                "move to the CPU before they fill the GPU",
            ))  # fmt: skip
    return PlannedArguments(dataclasses.replace(args, **changes), chosen, traced, evaluation)


def _planned_evaluation(
    model: torch.nn.Module,
    args: TrainingArguments,
    eval_dataset: Any,
    training: MemoryEstimate,
    device: torch.device,
    budget_bytes: int,
    *,
    include_context: bool,
    **trainer_inputs: Any,
) -> tuple[EvaluationPeak | None, int | None]:
    """The predicted evaluation pass and, when it does not fit and the user left it unset, the
    ``eval_accumulation_steps`` that makes it fit. The training plan stands whatever happens here."""
    try:
        evaluation = predict_evaluation(model, args, eval_dataset, training, device=device, **trainer_inputs)
    except Exception as error:
        _info(f"memfit could not check the evaluation pass ({type(error).__name__}: {error})")
        return None, None
    if _needed(evaluation, include_context) <= budget_bytes:
        return evaluation, None
    steps = _fitting_flush(evaluation, training, device, budget_bytes, include_context)
    if steps is not None:
        collected = evaluation.collected.flushed_every(steps)
        return evaluation_peak(training, evaluation.forward, collected=collected, keeps_training_batches=True), steps
    warnings.warn(_evaluation_warning(evaluation, budget_bytes), UserWarning, stacklevel=3)
    return evaluation, None


def predict_evaluation(
    model: torch.nn.Module,
    args: TrainingArguments,
    eval_dataset: Any,
    training: MemoryEstimate | None,
    *,
    loop: Literal["evaluate", "predict"] = "evaluate",
    during_training: bool = True,
    device: torch.device | None = None,
    data_collator: Any = None,
    processing_class: Any = None,
    compute_metrics: Any = None,
    preprocess_logits_for_metrics: Any = None,
) -> EvaluationPeak:
    """The Trainer's evaluation pass beside what ``training`` (its training estimate) leaves on the device.

    The forward is ``prediction_step``'s: eval mode, no gradients, the loss computed when the batch
    has labels. Every batch's predictions (the outputs but the loss and
    ``config.keys_to_ignore_at_inference``, after ``preprocess_logits_for_metrics``) and labels stay
    on the device, concatenated, until ``eval_accumulation_steps`` batches have run or the pass
    ends; the losses always do. ``Trainer.evaluate`` keeps predictions only with
    ``compute_metrics``; ``Trainer.predict`` (``loop="predict"``) always does, unless
    ``prediction_loss_only``. A dict of evaluation sets is predicted set by set; the largest pass
    is returned.

    Args:
        training: the training step's estimate, whose optimizer state stays on the device (after
            ``train()`` returns too: the Trainer keeps its optimizer); ``None`` when the Trainer has
            not trained.
        during_training: the pass runs inside ``train()`` (``eval_strategy``), where the window's
            training batches stay alive; outside it, ``fp16_full_eval``/``bf16_full_eval`` cast the
            model to half precision first (and leave it so).
    """
    if loop not in ("evaluate", "predict"):
        raise InvalidInputError(f"loop must be 'evaluate' or 'predict', got {loop!r}")
    if device is None:
        device = _run_device(args)
    if isinstance(eval_dataset, dict):
        if not eval_dataset:
            raise InvalidInputError("eval_dataset is an empty dict")
        passes = [
            predict_evaluation(
                model, args, one, training, loop=loop, during_training=during_training, device=device,
                data_collator=data_collator, processing_class=processing_class, compute_metrics=compute_metrics,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            )
            for one in eval_dataset.values()
        ]  # fmt: skip
        return max(passes, key=lambda peak: peak.allocated_bytes)
    try:
        samples = len(eval_dataset)
    except TypeError:
        raise InvalidInputError("eval_dataset has no length: memfit cannot tell how many batches it collects") from None
    batch = args.per_device_eval_batch_size
    sample = collated_sample(model, args, eval_dataset, batch, data_collator, processing_class)
    wants_predictions = loop == "predict" or compute_metrics is not None  # evaluate() is loss-only without metrics
    step = _PredictionStep(
        model, args, collect_predictions=wants_predictions and not args.prediction_loss_only,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )  # fmt: skip
    precision = _precision(args) if during_training else _evaluation_precision(args)
    forward = estimate(
        model, sample, batch_size=batch, inference=True, precision=precision, device=device.type,
        forward_fn=step, extra_batches=1 if device.type == "cpu" else 0,  # the loader reads one batch ahead
    )  # fmt: skip
    collected = None
    if step.bytes_per_sample and not args.batch_eval_metrics:
        collected = CollectedOutputs(
            bytes_per_sample=step.bytes_per_sample,
            samples=samples,
            samples_per_batch=batch * args.world_size,  # every process gathers every process's outputs
            # On the CPU the collection moves nowhere: eval_accumulation_steps only turns it into numpy arrays.
            flush_every=args.eval_accumulation_steps if device.type == "cuda" else None,
            concatenated=bool(getattr(args, "eval_do_concat_batches", True)),
            # The float32 copies are made in host memory: the device's own only on the CPU.
            end_copy_bytes_per_sample=step.numpy_copy_bytes_per_sample if device.type == "cpu" else {},
        )
    return evaluation_peak(training, forward, collected=collected, keeps_training_batches=during_training)


def predict_trainer_pass(
    trainer: Any,
    dataset: Any = None,
    *,
    loop: Literal["evaluate", "predict"] = "evaluate",
    training: MemoryEstimate | None = None,
) -> EvaluationPeak:
    """Predict ``trainer.evaluate(dataset)`` (or ``trainer.predict(dataset)``) before running it.

    Everything is read from the Trainer: model, arguments, collator, ``compute_metrics``, whether it
    is inside ``train()``. What training leaves on the device is the optimizer state: ``training``
    (a training estimate) if given, else, once the Trainer's optimizer has stepped, the estimate of
    the ``MemoryPlannerCallback`` in the Trainer. ``dataset`` defaults to ``trainer.eval_dataset``.
    """
    if dataset is None:
        if loop == "predict":
            raise InvalidInputError("trainer.predict needs a dataset: pass the one you will predict on")
        dataset = trainer.eval_dataset
        if dataset is None:
            raise InvalidInputError("the Trainer has no eval_dataset: pass the dataset you will evaluate on")
    optimizer = getattr(trainer, "optimizer", None)
    has_state = optimizer is not None and any(len(state) for state in optimizer.state.values())
    if training is None and has_state:
        training = next(
            (c.estimate for c in trainer.callback_handler.callbacks if isinstance(c, MemoryPlannerCallback)), None
        )
        if training is None:
            raise InvalidInputError(
                "the Trainer's optimizer holds state from training, and memfit has no estimate of it: add "
                "MemoryPlannerCallback to the Trainer before train(), or pass training=memfit.estimate(...)"
            )
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    return predict_evaluation(
        model, trainer.args, dataset, training, loop=loop,
        during_training=bool(getattr(trainer, "is_in_train", False)), data_collator=trainer.data_collator,
        compute_metrics=trainer.compute_metrics, preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
    )  # fmt: skip


def _evaluation_precision(args: TrainingArguments) -> str:
    """The precision of an evaluation outside ``train()``: ``*_full_eval`` casts the whole model."""
    if args.fp16_full_eval:
        return "16-true"
    if args.bf16_full_eval:
        return "bf16-true"
    return _precision(args)


class _PredictionStep:
    """The forward of ``Trainer.prediction_step``, noting the bytes each batch leaves collected."""

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, *, collect_predictions: bool,
                 preprocess_logits_for_metrics: Any) -> None:  # fmt: skip
        from transformers.utils import can_return_loss

        self.label_names = _label_names(model, args)
        self.returns_loss = can_return_loss(type(model))
        config = getattr(model, "config", None)
        self.ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"])) if config else []
        self.collect_predictions = collect_predictions
        self.preprocess = preprocess_logits_for_metrics
        self.eval_batch_size = args.eval_batch_size
        self.per_device_eval_batch_size = args.per_device_eval_batch_size
        self.collect_inputs = "inputs" in (getattr(args, "include_for_metrics", None) or [])
        self.main_input_name = getattr(model, "main_input_name", "input_ids")
        self.bytes_per_sample: dict[str, float] = {}
        self.numpy_copy_bytes_per_sample: dict[str, float] = {}

    def __call__(self, module: torch.nn.Module, batch: Any) -> Any:
        if not isinstance(batch, dict):
            raise InvalidInputError(f"the Trainer passes dict batches; the evaluation batch is {type(batch).__name__}")
        outputs = module(**batch)
        has_labels = bool(self.label_names) and all(batch.get(name) is not None for name in self.label_names)
        with_loss = has_labels or (not self.label_names and self.returns_loss)
        samples = _leading_dim(batch)  # the trace runs this at more than one batch size
        kept: dict[str, Any] = {}
        collected: dict[str, float] = {}
        if with_loss:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            kept["losses"] = loss
            # loss.repeat(eval_batch_size): per batch, not per sample; a batch holds per_device_eval_batch_size
            collected["losses"] = loss.element_size() * self.eval_batch_size / self.per_device_eval_batch_size
        if self.collect_predictions:
            ignored = [*self.ignore_keys, "loss"] if with_loss else self.ignore_keys
            if isinstance(outputs, dict):
                predictions: Any = tuple(v for k, v in outputs.items() if k not in ignored)
            else:
                predictions = outputs[1:] if with_loss else outputs
            if isinstance(predictions, tuple) and len(predictions) == 1:
                predictions = predictions[0]
            labels: Any = None
            if with_loss and has_labels:
                labels = tuple(batch.get(name) for name in self.label_names)
                labels = labels[0] if len(labels) == 1 else labels
            if self.preprocess is not None:
                try:
                    predictions = self.preprocess(predictions, labels)
                except Exception as error:
                    raise InvalidInputError(
                        f"preprocess_logits_for_metrics failed on shape-only tensors ({type(error).__name__}: "
                        f"{error}); memfit cannot size what it keeps"
                    ) from error
            kept["predictions"] = predictions
            collected["predictions"] = _tensor_bytes(predictions) / samples
            if labels is not None:
                kept["labels"] = labels
                collected["labels"] = _tensor_bytes(labels) / samples
            if self.collect_inputs and isinstance(batch.get(self.main_input_name), torch.Tensor):
                kept["inputs"] = batch[self.main_input_name]
                collected["inputs"] = _tensor_bytes(batch[self.main_input_name]) / samples
        self.bytes_per_sample = collected
        # numpy has no bfloat16: the Trainer hands such collections to compute_metrics as float32 copies
        copies = {name: _tensor_bytes(value, only=torch.bfloat16) * 2 for name, value in kept.items()}
        self.numpy_copy_bytes_per_sample = {
            name: copy * (collected[name] / _tensor_bytes(kept[name])) for name, copy in copies.items() if copy
        }
        return outputs


def _leading_dim(batch: dict[str, Any]) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise InvalidInputError("the evaluation batch holds no tensor with a batch dimension")


def _tensor_bytes(value: Any, only: torch.dtype | None = None) -> int:
    """Bytes of the tensors in ``value`` (nested in dicts, lists and tuples), of dtype ``only`` if given."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if only in (None, value.dtype) else 0
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, only) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, only) for v in value)
    return 0


def _fitting_flush(
    evaluation: EvaluationPeak, training: MemoryEstimate, device: torch.device, budget_bytes: int,
    include_context: bool,
) -> int | None:  # fmt: skip
    """The most batches of collected outputs that fit before they move to the CPU, when moving them helps."""
    collected = evaluation.collected
    if collected is None or collected.flush_every is not None or device.type != "cuda" or evaluation.forward is None:
        return None
    return largest_flush_every(
        training, evaluation.forward, collected, budget_bytes, include_context=include_context,
        keeps_training_batches=True,
    )  # fmt: skip


def _needed(evaluation: EvaluationPeak, include_context: bool) -> int:
    return evaluation.device_bytes if include_context else evaluation.reserved_bytes


def _evaluation_warning(evaluation: EvaluationPeak, budget_bytes: int, flush_every: int | None = None) -> str:
    advice = ["lower per_device_eval_batch_size"]
    if flush_every is not None:
        advice.insert(0, f"set eval_accumulation_steps={flush_every} (the most batches of outputs that fit)")
    if evaluation.collected is not None and evaluation.collected.bytes_per_sample.get("predictions"):
        advice.append("pass preprocess_logits_for_metrics that keeps less than the logits (their argmax, say)")
    return (
        f"memfit: evaluation may run out of memory where training fits: {evaluation.summary()}, over the "
        f"{format_bytes(budget_bytes)} budget. To fit: {'; or '.join(advice)}."
    )


def _run_device(args: TrainingArguments) -> torch.device:
    """Where the Trainer will train: the CUDA GPU if there is one and ``use_cpu`` is off."""
    return torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")


def _precision(args: TrainingArguments) -> str:
    """The mixed precision the Trainer's accelerator will run: the ``bf16``/``fp16`` flags, else
    accelerate's ``ACCELERATE_MIXED_PRECISION`` (``accelerate launch --mixed_precision bf16`` sets it;
    transformers 4.x also sets it for the whole process from any earlier fp16/bf16 arguments)."""
    if args.bf16:
        return "bf16-mixed"
    if args.fp16:
        return "16-mixed"
    mode = getattr(args, "mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(str(mode).lower(), "fp32")


def held_batches(accumulation_steps: int, device: torch.device) -> int:
    """Batches alive on the device besides the step's own.

    The Trainer fetches a whole accumulation window before its first micro batch runs
    (``get_batch_samples``) and keeps it to the optimizer step; memfit's recovery replays those same
    batches, so it holds nothing more (``memfit.recovery.batches_held`` counts the same ones).
    accelerate's loader also reads the next batch ahead; that one stays in host memory, which is the
    device's own only when training on the CPU.
    """
    lookahead = 1 if device.type == "cpu" else 0
    return accumulation_steps - 1 + lookahead


def checkpointing_switch(args: Any) -> str:
    """The ``TrainingArguments`` field that turns checkpointing on: ``activation_checkpointing`` in
    recent transformers (5.23), ``gradient_checkpointing`` in older ones (4.x, 5.17)."""
    return "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"


def model_checkpointing(model: Any) -> bool:
    """Whether a ``PreTrainedModel`` has checkpointing on, under either name its transformers uses."""
    names = ("is_activation_checkpointing", "is_gradient_checkpointing")
    return any(bool(getattr(model, name, False)) for name in names)


def sharding(args: TrainingArguments) -> str | None:
    """``"FSDP"`` or ``"DeepSpeed"`` when the run shards the model's state across processes (from the
    arguments, or from what ``accelerate launch --use_fsdp/--use_deepspeed`` sets), else ``None``."""
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "FSDP"
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return "DeepSpeed"
    return None


def ddp_config(args: TrainingArguments, model: torch.nn.Module) -> DDPConfig | None:
    """The ``DistributedDataParallel`` options the Trainer (through accelerate) will wrap ``model`` with,
    or ``None`` when it will not (one process, FSDP, DeepSpeed)."""
    if args.world_size <= 1 or sharding(args):
        return None
    if args.ddp_find_unused_parameters is not None:
        find_unused = bool(args.ddp_find_unused_parameters)
    elif isinstance(model, PreTrainedModel):  # as Trainer._build_accelerator_args decides it
        find_unused = not (model_checkpointing(model) or getattr(args, checkpointing_switch(args), False))
    else:
        find_unused = True
    return DDPConfig(
        bucket_cap_mb=args.ddp_bucket_cap_mb,
        find_unused_parameters=find_unused,
        static_graph=bool(getattr(args, "ddp_static_graph", None)),
    )


def collated_sample(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    batch_size: int,
    data_collator: Any = None,
    processing_class: Any = None,
) -> Any:
    """One batch as the Trainer would build it (unused columns dropped, the Trainer's default collator),
    of the longest examples: a collator that pads to the longest in the batch makes its peak there."""
    if train_dataset is None:
        raise InvalidInputError("train_dataset is None: memfit needs one batch of it to plan")
    if data_collator is None:
        from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator

        use_padding = isinstance(processing_class, PreTrainedTokenizerBase)
        data_collator = DataCollatorWithPadding(processing_class) if use_padding else default_data_collator
    with preserved_rng_state():  # random transforms and collators (MLM masking) must not shift the run
        examples = batch_examples(train_dataset, batch_size, args.length_column_name)
        if args.remove_unused_columns:  # before collating, as the Trainer does: text columns would not collate
            kept = _signature_columns(model, args)
            examples = [{k: v for k, v in e.items() if k in kept} if isinstance(e, dict) else e for e in examples]
        try:
            batch = data_collator(examples)
        except Exception as error:
            raise InvalidInputError(
                f"the data collator cannot batch {len(examples)} examples of this dataset ({type(error).__name__}: "
                f"{error}); the Trainer would fail the same way. Check the dataset's columns against the collator"
                + ("" if args.remove_unused_columns else ", or leave remove_unused_columns=True")
            ) from error
    return dict(batch) if isinstance(batch, Mapping) else batch


def _signature_columns(model: torch.nn.Module, args: TrainingArguments) -> set[str]:
    """The example keys the Trainer keeps under ``remove_unused_columns``: the forward's parameters
    (of the base model under PEFT) and the label names."""
    forward = _base_model(model).forward
    return set(inspect.signature(forward).parameters) | {"label", "label_ids", *_label_names(model, args)}


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model the Trainer inspects: under PEFT, the base model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _label_names(model: torch.nn.Module, args: TrainingArguments) -> list[str]:
    """``args.label_names``, else the labels the model's forward takes, as the Trainer decides them."""
    return list(args.label_names) if args.label_names is not None else find_labels(type(_base_model(model)))


def _trainer_optimizer(args: TrainingArguments, model: torch.nn.Module) -> Any:
    """The optimizer ``args.optim`` names, built as ``Trainer.create_optimizer`` builds it: weights
    with weight decay in one group, biases and norms without in another (single-tensor optimizers
    step group by group, which changes the step's peak). Nothing is allocated until its first step."""
    try:
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as error:
        raise InvalidInputError(f"cannot build the optimizer {args.optim!r} to trace it: {error}") from error
    if not {"params", "model"} & set(optimizer_kwargs) and isinstance(optimizer_cls, type):
        try:
            decay = set(Trainer.get_decay_parameter_names(None, model))  # reads nothing of the Trainer
            trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            return optimizer_cls(
                [
                    {"params": [p for name, p in trainable if name in decay], "weight_decay": args.weight_decay},
                    {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0},
                ],
                **optimizer_kwargs,
            )
        except Exception:  # the class over all parameters, as before; only the grouping is lost
            pass

    def build(params: Any) -> torch.optim.Optimizer:
        return optimizer_cls(params, **optimizer_kwargs)

    build.__name__ = getattr(optimizer_cls, "__name__", str(args.optim))
    return build


def _running_optimizer(args: TrainingArguments, model: torch.nn.Module, optimizer: Any) -> Any:
    """The optimizer the Trainer created (unwrapped from accelerate), else the one ``args`` names."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else _trainer_optimizer(args, model)


def _saved_plan(args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> dict[str, Any] | None:
    if not resume_from_checkpoint:
        return None
    folder = get_last_checkpoint(args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    if folder is None:
        return None
    path = Path(folder) / PLAN_FILE
    return json.loads(path.read_text()) if path.exists() else None


class MemoryPlannerCallback(TrainerCallback):
    """Measure peak memory while the Trainer trains and log it against memfit's prediction.

    At ``on_train_begin`` the callback traces the model with the batch size, accumulation,
    precision, optimizer and checkpointing that are about to run (one batch built from the train
    dataloader's dataset and collator), in the Trainer's loop: gradients freed after the optimizer
    step, kept through an accumulation window, DDP's gradient buckets when the Trainer wraps the
    model in ``DistributedDataParallel``, the window's batches the recovery keeps. Every
    ``logging_steps`` it reads the peaks of the window and adds the metrics below to the Trainer's
    logs *before* the ``report_to`` trackers see them (it moves itself to the front of the Trainer's
    callback list for that), so TensorBoard, MLflow, W&B and the rest all receive them. The plan
    from ``plan_training_arguments`` is saved into each checkpoint (``memfit_plan.json``) so a
    resumed run keeps it.

    Logged keys (only those measured on the device): ``memfit/predicted_peak_allocated_bytes``,
    ``memfit/predicted_peak_reserved_bytes``, ``memfit/measured_peak_allocated_bytes``,
    ``memfit/measured_peak_reserved_bytes``, ``memfit/drift_allocated_pct``,
    ``memfit/drift_reserved_pct``, ``memfit/measured_device_used_bytes`` (CUDA; NVML with
    ``nvidia-ml-py``); ``memfit/measured_peak_rss_bytes``, ``memfit/measured_tensor_bytes_from_rss``,
    ``memfit/drift_rss_pct`` (CPU). With a plan, the first log also carries ``memfit/micro_batch_size``,
    ``memfit/accumulate_grad_batches``, ``memfit/gradient_checkpointing`` and
    ``memfit/effective_batch_size``.

    Out-of-memory errors in a training step (``on_oom="replan"``, the default): the failed batch
    is retried in chunks whose losses are weighted by their share of the batch, and later batches
    run in the same chunks, so the effective batch, the samples seen and the optimizer steps stay
    as configured (see ``memfit.recovery``). Each recovery is one warning and the metrics
    ``memfit/oom_recoveries`` and ``memfit/micro_batch_size`` (the chunk) in the next log. An
    out-of-memory error in the optimizer step is not recoverable this way and ends the run, with a
    warning that says why and what helps.

    Any failure inside memfit becomes one warning and training goes on untouched.

    Args:
        plan: the ``Plan`` returned by ``plan_training_arguments`` (optional; logged and checkpointed).
        margin: drift above this fraction of the prediction raises a warning (once).
        on_oom: ``"replan"`` to recover from out-of-memory errors in a step, ``"raise"`` to let them end the run.
        loss_reduction: how the model's loss reduces a batch (``"mean"``, what HF models return, or
            ``"sum"``); it decides how chunk losses are weighted.
        allow_checkpointing: whether a recovery may turn on gradient checkpointing once chunks of
            one sample still run out of memory.
        verbose: log the prediction and the final drift line.
    """

    def __init__(
        self,
        plan: Plan | None = None,
        margin: float = 0.05,
        on_oom: OnOOM = "replan",
        loss_reduction: LossReduction = "mean",
        allow_checkpointing: bool = True,
        verbose: bool = True,
    ) -> None:
        if plan is not None and not isinstance(plan, Plan):
            raise InvalidInputError(f"`plan` must be a memfit.Plan or None, got {type(plan).__name__}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise InvalidInputError(f"`margin` must be a fraction in [0, 1), got {margin!r}")
        self.plan = plan
        self.margin = float(margin)
        self.on_oom = check_on_oom(on_oom)
        self.loss_reduction = check_loss_reduction(loss_reduction)
        self.allow_checkpointing = bool(allow_checkpointing)
        self.verbose = verbose
        self.recovery: OOMRecovery | None = None
        self._handler: Any = None
        self._restore: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held before; _UNSET: nothing)
        self.estimate: MemoryEstimate | None = None
        self.evaluation: EvaluationPeak | None = None
        self.monitor: DriftMonitor | None = None
        self._sampler: PeakSampler | None = None
        self._pending: dict[str, float] = {}
        self._first_log = True
        self._warned: set[str] = set()
        self._callbacks: list[Any] = []
        self._timeline_logged = False

    # ---------------------------------------------------------------- events
    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._move_to_front():
            self._warn(
                "front",
                "memfit could not place its callback before the report_to trackers; its metrics reach only "
                "trackers that run after it (and the logs printed to the console)",
            )
        if self.plan is not None and args.per_device_train_batch_size != self.plan.micro_batch_size:
            self._warn(
                "mismatch",
                f"the Trainer runs per_device_train_batch_size={args.per_device_train_batch_size}, not the planned "
                f"{self.plan.micro_batch_size}: pass the args returned by plan_training_arguments to Trainer",
            )

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            self._predict(args, kwargs.get("model"), kwargs.get("train_dataloader"), kwargs.get("optimizer"))
        except MemfitError as error:
            self._warn("predict", f"memfit could not predict this run ({error}); no drift is logged")
        except Exception as error:  # never let memfit end the run
            self._warn("predict", f"memfit could not predict this run ({type(error).__name__}: {error})")
        if self.estimate is not None:
            try:
                self._check_evaluation(args, kwargs.get("model"))
            except Exception as error:  # never let memfit end the run
                self._warn("evaluation", f"memfit could not check evaluation ({type(error).__name__}: {error})")
        if self.on_oom == "replan":
            try:
                self._install_recovery(args, kwargs.get("model"))
            except Exception as error:  # never let memfit end the run
                self._uninstall_recovery()
                self._warn(
                    "recovery",
                    f"memfit cannot recover from out-of-memory errors in this run ({type(error).__name__}: {error}); "
                    "an out-of-memory error will end it as usual",
                )

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recovery is not None:
            self.recovery.end_window()  # after the optimizer step: the window's batches are done with
            if args.world_size > 1:
                self._agree_on_chunk()
        every = state.logging_steps or args.logging_steps
        if self._sampler is None or not state.global_step or state.global_step % max(1, int(every)):
            return
        try:
            drift = self.monitor.observe(state.global_step, self._sampler.sample())
        except Exception as error:
            self._sampler = None
            self._warn("measure", f"memfit stopped measuring ({type(error).__name__}: {error})")
            return
        for alarm in drift.alarms:
            self._warn(alarm, "memfit: " + alarm)
        self._pending.update(drift.metrics())

    def on_log(
        self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        if logs is None or not self._pending or "loss" not in logs:
            return  # only training logs carry memory metrics
        logs.update(self._pending)
        if not self._timeline_logged and self.estimate is not None and state.is_world_process_zero:
            self._timeline_logged = True  # the trackers are set up by now (their on_train_begin ran after ours)
            self._figure(args, "memfit/timeline", lambda: _plot("plot_timeline", self.estimate), state.global_step)
        if self._first_log and self.plan is not None:
            for key in ("micro_batch_size", "accumulate_grad_batches", "effective_batch_size"):
                logs[f"memfit/{key}"] = getattr(self.plan, key)
            logs["memfit/gradient_checkpointing"] = int(self.plan.gradient_checkpointing)
        self._first_log = False
        self._pending = {}

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.plan is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / PLAN_FILE).write_text(json.dumps(self.plan.to_dict(), indent=2))

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._uninstall_recovery()
        if self.monitor is None or not state.is_world_process_zero:
            return
        records = self.monitor.history
        if records:
            cuda = records[0].sample.reserved_bytes is not None
            predicted = self.monitor.predicted_reserved_bytes if cuda else self.monitor.predicted_allocated_bytes
            steps, measured = [d.step for d in records], [d.compared_bytes for d in records]
            self._figure(
                args, "memfit/drift", lambda: _plot("plot_drift", steps, predicted, measured), state.global_step
            )
        if not self.verbose:
            return
        measured = [d for d in self.monitor.history if d.drift_pct is not None]
        if measured:
            worst = max(measured, key=lambda d: d.drift_pct)
            predicted = self.monitor.predicted_reserved_bytes if worst.sample.reserved_bytes is not None else (
                self.monitor.predicted_allocated_bytes
            )  # fmt: skip
            _info(
                f"memfit drift: predicted peak {format_bytes(predicted)}, measured up to "
                f"{format_bytes(worst.compared_bytes)} ({worst.drift_pct:+.1f}%) over {len(measured)} window(s)"
            )

    # --------------------------------------------------------------- helpers
    def _predict(self, args: TrainingArguments, model: Any, loader: Any, optimizer: Any) -> None:
        if model is None or loader is None:
            raise InvalidInputError("the Trainer passed no model or train dataloader")
        micro = args.per_device_train_batch_size
        with preserved_rng_state():
            sample = loader.collate_fn(batch_examples(loader.dataset, micro, args.length_column_name))
        device = next(model.parameters()).device
        traced = estimate(
            model,
            dict(sample) if isinstance(sample, dict) else sample,
            batch_size=micro,
            optimizer=_running_optimizer(args, model, optimizer),
            precision=_precision(args),
            device="cuda" if device.type == "cuda" else "cpu",
            accumulation_steps=args.gradient_accumulation_steps,
            extra_batches=held_batches(args.gradient_accumulation_steps, device),
            ddp=ddp_config(args, model),
        )
        sharded_by = sharding(args)
        if sharded_by:
            traced = dataclasses.replace(traced, notes=(*traced.notes, f"{sharded_by}: {SHARDING_NOT_MODELLED}"))
            self._warn("sharding", f"memfit does not model {sharded_by} sharding yet: drift is against a "
                       f"prediction {SHARDING_NOT_MODELLED}")  # fmt: skip
        self.estimate = traced
        resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        self.monitor = DriftMonitor(
            predicted_allocated_bytes=traced.peak_allocated_bytes,
            predicted_reserved_bytes=traced.peak_reserved_bytes,
            margin=self.margin,
            baseline_rss_bytes=current_rss_bytes(),
            resident_bytes=resident,
        )
        self._sampler = PeakSampler(device)
        if self.verbose:
            _info(
                f"memfit: predicted peak {format_bytes(traced.peak_reserved_bytes)} reserved, "
                f"{format_bytes(traced.peak_allocated_bytes)} allocated at micro batch {micro}"
                + (f" (plan: {self.plan.summary()})" if self.plan else "")
            )

    def _check_evaluation(self, args: TrainingArguments, model: Any) -> None:
        """Predict the Trainer's evaluation pass beside this run's training state; warn when it would not fit."""
        self.evaluation = None
        trainer = self._find_trainer()
        if trainer is None or model is None or trainer.eval_dataset is None:
            return
        device = next(model.parameters()).device
        try:
            self.evaluation = predict_evaluation(
                trainer.accelerator.unwrap_model(model), args, trainer.eval_dataset, self.estimate, device=device,
                data_collator=trainer.data_collator, compute_metrics=trainer.compute_metrics,
                preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
            )  # fmt: skip
        except Exception as error:  # the run goes on; only this check is lost
            if self.verbose:
                _info(f"memfit could not check the evaluation pass ({type(error).__name__}: {error})")
            return
        free = free_device_bytes(device) if self.plan is None else 0
        budget = self.plan.budget_bytes if self.plan is not None else int(free * (1 - self.margin))
        if budget > 0 and self.evaluation.reserved_bytes > budget:
            steps = _fitting_flush(self.evaluation, self.estimate, device, budget, include_context=False)
            self._warn("evaluation", _evaluation_warning(self.evaluation, budget, steps))

    def _install_recovery(self, args: TrainingArguments, model: Any) -> None:
        """Wrap the Trainer's ``training_step`` (run the batch in chunks through ``OOMRecovery``) and its
        ``compute_loss`` (weight each chunk's loss; mark where the backward begins)."""
        self._uninstall_recovery()  # a run that ended in an error left its wrappers: never wrap them twice
        trainer = self._find_trainer()
        if trainer is None or model is None:
            raise InvalidInputError("the Trainer could not be found from its callback handler")
        original_step, original_loss = trainer.training_step, trainer.compute_loss
        inner = trainer.accelerator.unwrap_model(model)
        switch = checkpointing_switch(args)
        recovery = OOMRecovery(
            reset_gradients=lambda: model.zero_grad(set_to_none=True),
            estimate=self.estimate,
            margin=self.margin,
            enable_checkpointing=functools.partial(enable_checkpointing, inner) if self.allow_checkpointing else None,
            checkpointing_on=bool(getattr(args, switch, False)),
            loss_reduction=self.loss_reduction,
            distributed=args.world_size > 1,
            on_recovery=functools.partial(self._on_recovery, args),
        )
        chunk_state = {"weight": 1.0, "in_step": False, "window_done": True}

        def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            output = original_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            if not chunk_state["in_step"]:
                return output  # evaluation
            recovery.backward_started()
            weight = chunk_state["weight"]
            if weight == 1.0:
                return output
            return (output[0] * weight, *output[1:]) if return_outputs else output * weight

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            if chunk_state["window_done"]:
                recovery.start_window()
            sync = bool(trainer.accelerator.gradient_state.sync_gradients)
            # a loss divided by the window's item count already adds up over chunks
            additive = (num_items_in_batch is not None and trainer.model_accepts_loss_kwargs) or (
                trainer.compute_loss_func is not None
            )
            through_wrapper = False

            def run_chunk(chunk: Any, weight: float, last: bool) -> torch.Tensor:
                nonlocal through_wrapper
                chunk_state["weight"], chunk_state["in_step"] = (1.0 if additive else weight), True
                try:
                    if last:  # through the DDP wrapper, once per batch on every rank
                        if through_wrapper and hasattr(model, "require_forward_param_sync"):
                            model.require_forward_param_sync = False  # the failed attempt broadcast buffers
                        through_wrapper = True
                        return original_step(model, chunk, num_items_in_batch)
                    return original_step(inner, chunk, num_items_in_batch)  # bare module: no collective
                finally:
                    chunk_state["in_step"] = False

            losses = recovery.run_batch(inputs, run_chunk, step=trainer.state.global_step, sync=sync)
            chunk_state["window_done"] = sync
            return sum(losses[1:], losses[0])

        optimizer = trainer.optimizer
        original_optimizer_step = getattr(optimizer, "step", None)

        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original_optimizer_step(*args, **kwargs)
            except Exception as error:  # the Trainer has no exception hook: say why memfit cannot help, re-raise
                if is_out_of_memory(error):
                    self._warn("optimizer-oom", OPTIMIZER_STEP_OOM)
                raise

        self._patch(trainer, "training_step", training_step)
        self._patch(trainer, "compute_loss", compute_loss)
        if original_optimizer_step is not None:
            if hasattr(original_optimizer_step, "_wrapped_by_lr_sched"):
                # the LR scheduler's own wrapper still runs inside: keep it from warning that step was replaced
                optimizer_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            self._patch(optimizer, "step", optimizer_step)
        self.recovery = recovery

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, vars(owner).get(name, _UNSET)))
        setattr(owner, name, value)

    def _uninstall_recovery(self) -> None:
        for owner, name, before in reversed(self._restore):
            if before is _UNSET:
                vars(owner).pop(name, None)  # the class's own method shows through again
            else:
                setattr(owner, name, before)
        self._restore = []

    def _on_recovery(self, args: TrainingArguments, record: Recovery) -> None:
        message = record.warning(
            accumulation=args.gradient_accumulation_steps, world_size=args.world_size, rank=args.process_index
        )
        warnings.warn(message, UserWarning, stacklevel=2)
        if self.monitor is not None and self.estimate is not None:
            self.monitor.repredict(self.estimate, record.chunk_after)
        self._pending["memfit/oom_recoveries"] = float(len(self.recovery.recoveries) if self.recovery else 1)
        self._pending["memfit/micro_batch_size"] = float(record.chunk_after)

    def _agree_on_chunk(self) -> None:
        """Every rank takes the smallest chunk any rank had to fall back to (one small all-reduce a step)."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        backend_cuda = torch.distributed.get_backend() == "nccl"
        mine = torch.tensor([self.recovery.chunk_size or 2**62], device="cuda" if backend_cuda else "cpu")
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
        smallest = int(mine.item())
        if smallest < 2**62 and self.recovery.adopt(smallest):
            _info(f"memfit: every rank now runs chunks of at most {smallest} samples, as another rank had to")

    def _find_trainer(self) -> Any:
        """The Trainer that owns the callback handler (callbacks are never handed the Trainer)."""
        handler = self._handler
        if handler is None:
            return None
        for holder in gc.get_referrers(handler):
            if getattr(holder, "callback_handler", None) is handler:
                return holder
            if isinstance(holder, dict) and holder.get("callback_handler") is handler:
                for owner in gc.get_referrers(holder):
                    if getattr(owner, "__dict__", None) is holder:
                        return owner
        return None

    def _move_to_front(self) -> bool:
        """Put this callback first in the Trainer's CallbackHandler so ``on_log`` can add keys the trackers see.

        Callbacks are never handed the Trainer or its handler; the handler is found as the owner of
        the list that holds this callback.
        """
        for holder in gc.get_referrers(self):
            if not isinstance(holder, list):
                continue
            for owner in gc.get_referrers(holder):
                if type(owner).__name__ == "CallbackHandler" and getattr(owner, "callbacks", None) is holder:
                    holder.remove(self)
                    holder.insert(0, self)
                    self._callbacks = holder
                    self._handler = owner
                    return True
        return False

    def _figure(self, args: TrainingArguments, name: str, make: Any, step: int) -> None:
        """Draw and send to the TensorBoard writer of HF's TensorBoard callback, the active MLflow run and
        ``output_dir``; skipped without matplotlib."""
        if not matplotlib_available():
            return
        try:
            figure = make()
        except Exception as error:
            self._warn("figure", f"memfit could not draw {name} ({type(error).__name__}: {error})")
            return
        writer = next((getattr(cb, "tb_writer", None) for cb in self._callbacks if hasattr(cb, "tb_writer")), None)
        mlflow_module = None
        if any(type(cb).__name__ == "MLflowCallback" for cb in self._callbacks):
            import mlflow as mlflow_module
        log_figure(figure, name, tensorboard=writer, mlflow_module=mlflow_module, folder=args.output_dir, step=step)

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)


_UNSET = object()


def _plot(function: str, *args: Any) -> Any:
    from memfit import plot

    return getattr(plot, function)(*args)


def _info(message: str) -> None:
    print(message, flush=True)
