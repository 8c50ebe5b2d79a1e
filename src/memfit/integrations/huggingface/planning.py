"""``plan_training_arguments``: plan the batch before the ``Trainer`` exists, which copies it in ``__init__``."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

try:
    from transformers import TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.huggingface needs transformers and accelerate: pip install 'memfit[hf]'") from error

from memfit.errors import InvalidInputError, ShardingNotModelledError
from memfit.integrations.huggingface.arguments import (
    checkpointing_switch,
    collated_sample,
    ddp_config,
    held_batches,
    run_device,
    run_notes,
    run_precision,
    trainer_model_config,
    trainer_optimizer,
)
from memfit.integrations.huggingface.evaluation import planned_evaluation
from memfit.integrations.huggingface.internals import changed_arguments
from memfit.integrations.huggingface.sharding import RunLayout, run_layout
from memfit.planning.gpus import PlanningTarget, planning_target
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.run_options import RunOptions, dropped_samples_warning
from memfit.planning.session import PlanningSession, PlanRequest
from memfit.prediction.estimator import MemoryEstimate, estimate
from memfit.prediction.evaluation import EvaluationPeak
from memfit.tracing.batch import dataset_length
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.positions import check_sequence_length
from memfit.tracing.sharding import ShardingConfig

PLAN_FILE = "memfit_plan.json"  # written into each checkpoint folder, read back on resume


class PlannedArguments(NamedTuple):
    """``TrainingArguments`` with the plan applied, the plan, the trace of the step the plan runs (its
    micro batch, accumulation and checkpointing), the predicted evaluation pass (``None`` without
    an ``eval_dataset``), and what one rank holds under FSDP or DeepSpeed (``None``: not sharded)."""

    args: TrainingArguments
    plan: Plan
    estimate: MemoryEstimate
    evaluation: EvaluationPeak | None = None
    sharding: ShardingConfig | None = None


def plan_training_arguments(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    *,
    data_collator: Any = None,
    processing_class: Any = None,
    budget: int | str | None = None,
    margin: float = DEFAULT_MARGIN,
    target_batch_size: int | Literal["max"] | None = None,
    allow_checkpointing: bool = True,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    resume_from_checkpoint: str | bool | None = None,
    eval_dataset: Any = None,
    compute_metrics: Any = None,
    preprocess_logits_for_metrics: Any = None,
    target: str | None = None,
    max_length: int | None = None,
) -> PlannedArguments:
    """Plan micro batch, accumulation and checkpointing for a Trainer that is about to be built.

    With an ``eval_dataset`` the evaluation pass is predicted too, beside the optimizer state
    training leaves, with the outputs the Trainer collects for ``compute_metrics``. When it would
    not fit, ``eval_accumulation_steps`` (if you left it unset) is set to the most batches whose
    outputs fit on the GPU before they move to the CPU; otherwise a warning says what to change.

    Under FSDP or DeepSpeed (``fsdp``/``fsdp_config``, ``deepspeed``, or ``accelerate launch``) the plan is
    one rank's, with the ``ShardingConfig`` read from the arguments (``PlannedArguments.sharding``; see
    ``memfit.integrations.huggingface.sharding``): what accelerate will actually run, so ``fsdp=`` under
    ``torchrun`` on CPU, where accelerate runs DDP, is planned as DDP, with a note. Under ``torchrun``
    every process plans from the smallest capacity of all ranks, so all ranks get the same plan.

    Args:
        model, args, train_dataset, data_collator, processing_class, eval_dataset, compute_metrics,
            preprocess_logits_for_metrics: what you will pass to ``Trainer``.
        budget: memory per device: bytes, ``"20GiB"`` or a GPU name; default: the free memory of the
            device the run will use (the CUDA GPU if there is one, else the available RAM), or the memory
            of the GPU ``target`` names.
        target: the device the plan is for: ``"cuda"``, ``"cpu"`` or a GPU name (``"h100"``: CUDA semantics
            with that card's compute capability). Default: the device the run will use, or the GPU
            ``budget`` names, so ``budget="h100"`` plans for an H100 even on a machine without one. A
            device other than the run's needs a budget or a GPU name.
        margin: fraction of the budget kept free.
        target_batch_size: effective batch to keep; default ``per_device_train_batch_size x
            gradient_accumulation_steps x world_size``; ``"max"`` for the largest micro batch.
        max_length: the longest sequence a streamed dataset's batches have (default: the collator's
            ``max_length``, the tokenizer's ``model_max_length``, else the model's positions): a stream's first
            examples are planned stretched to it, as its lengths cannot be read ahead.
        resume_from_checkpoint: as for ``Trainer.train``: when the checkpoint holds a memfit plan,
            that plan is returned unchanged so a resumed run keeps its batch.

    Returns:
        ``PlannedArguments(args, plan, estimate, evaluation, sharding)``; ``args`` is a copy, the input is
        not changed.

    Raises:
        ShardingNotModelledError: a layout memfit cannot predict per rank (DeepSpeed tensor parallelism,
            ZeRO++, MiCS), named in the message.
    """
    if not isinstance(args, TrainingArguments):
        raise InvalidInputError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    options = RunOptions(margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing)
    runs_on = run_device(args)
    planning = planning_target(target, budget, runs_on)
    device = planning.target.torch_device  # the device planned for: where batches and the evaluation live
    precision = run_precision(args)
    planning.check_precision(precision)
    layout = _layout(args, model, precision, elsewhere_on_gpus=device.type == "cuda" and runs_on.type != "cuda")
    configured, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    sample_notes = run_notes(args) + ([note] if (note := planning.note(runs_on)) else []) + list(layout.notes)
    sample = collated_sample(model, args, train_dataset, configured, data_collator, processing_class,
                             notes=sample_notes, max_length=max_length)  # fmt: skip
    _check_sample_length(model, sample)
    trace_at = _step_tracer(model, args, sample, precision, planning.target, layout, sample_notes)
    session = PlanningSession(trace_at, batch_size=configured, accumulation_steps=accumulation)
    include_context = planning.include_context
    restored = _saved_plan(args, resume_from_checkpoint)
    request = _plan_request(planning, args, layout, configured, accumulation, options, dataset_length(train_dataset))
    decision = session.decide_run(request, device=device, notes=sample_notes, restored=restored)
    chosen, planned = decision.plan, decision.estimate
    _warn_of_dropped_samples(args, train_dataset, chosen.micro_batch_size)
    changes = _planned_changes(args, chosen, layout.checkpointing)
    evaluation = None
    if eval_dataset is not None:
        evaluation, flush_every = planned_evaluation(
            model, args, eval_dataset, planned, device, chosen.budget_bytes, include_context=include_context,
            data_collator=data_collator, processing_class=processing_class, compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        if flush_every is not None:
            changes["eval_accumulation_steps"] = flush_every
            chosen = chosen.with_reason(f"eval_accumulation_steps={flush_every}: the outputs collected for "
                                        "compute_metrics move to the CPU before they fill the GPU")  # fmt: skip
    return PlannedArguments(changed_arguments(args, changes), chosen, planned, evaluation, layout.sharding)


def _warn_of_dropped_samples(args: TrainingArguments, dataset: Any, micro: int) -> None:
    """With ``dataloader_drop_last`` the planned batch size drops another number of samples an epoch: say so."""
    samples = dataset_length(dataset) if args.dataloader_drop_last else None
    ranks = args.world_size
    warning = dropped_samples_warning("dataloader_drop_last", samples, args.per_device_train_batch_size * ranks,
                                      micro * ranks)  # fmt: skip
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=3)


def _layout(args: TrainingArguments, model: torch.nn.Module, precision: str, *, elsewhere_on_gpus: bool) -> RunLayout:
    """The run's layout as accelerate will run it; one memfit cannot predict per rank is refused with what to do."""
    try:
        return run_layout(args, model, precision=precision, elsewhere_on_gpus=elsewhere_on_gpus)
    except ShardingNotModelledError as error:
        raise ShardingNotModelledError(
            f"memfit cannot predict one rank's memory under {error}, so it cannot plan these arguments: set the "
            "batch size yourself; MemoryPlannerCallback, attached, still logs the measured peaks"
        ) from error


def _check_sample_length(model: torch.nn.Module, sample: Any) -> None:
    """Refuse token ids longer than the model's positions before the trace fails on them."""
    ids = sample.get("input_ids") if isinstance(sample, dict) else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        check_sequence_length(model, ids.shape[1], fix="truncate them (the tokenizer's or collator's max_length="
                              "{positions}), or pass max_length= for a stream")  # fmt: skip


def _step_tracer(
    model: torch.nn.Module,
    args: TrainingArguments,
    sample: Any,
    precision: str,
    target: Target,
    layout: RunLayout,
    sample_notes: list[str],
) -> Callable[[int, bool, int], MemoryEstimate]:
    """``trace_at(micro, checkpointing, accumulation)``: the step the Trainer will run, with its optimizer, DDP
    buckets and the batches it holds, on one rank of ``layout``."""
    device = target.torch_device
    optimizer = trainer_optimizer(args, model)
    ddp = ddp_config(args, model, sharded=layout.sharding is not None)

    def trace_at(micro: int, checkpointing: bool, accumulation_steps: int) -> MemoryEstimate:
        held = held_batches(accumulation_steps, device)
        loop = TrainingLoop(accumulation_steps=accumulation_steps, extra_batches=held, ddp=ddp,
                            sharding=layout.sharding)  # fmt: skip
        with trainer_model_config(model, args):  # use_cache as the Trainer will set it
            traced = estimate(model, sample, optimizer=optimizer, precision=precision, batch_size=micro,
                              gradient_checkpointing=checkpointing, loop=loop, target=target,
                              checkpoint_modules=layout.units)  # fmt: skip
        return traced.with_notes(*sample_notes)

    return trace_at


def _plan_request(
    planning: PlanningTarget,
    args: TrainingArguments,
    layout: RunLayout,
    configured: int,
    accumulation: int,
    options: RunOptions,
    samples: int | None = None,
) -> PlanRequest:
    """What every rank asks alike: the smallest capacity of all ranks, over the data-parallel ranks the layout
    runs (a restored plan is held to it too)."""
    capacity = _smallest_of_all_ranks(planning.capacity_bytes(planning.target.torch_device), args)
    ranks = layout.sharding.world_size if layout.sharding is not None else args.world_size
    return options.request(capacity_bytes=capacity, configured=configured, accumulation=accumulation, ranks=ranks,
                           include_context=planning.include_context, always_checkpoint=layout.checkpointing,
                           samples=samples)  # fmt: skip


def _planned_changes(args: TrainingArguments, chosen: Plan, layout_checkpoints: bool) -> dict[str, Any]:
    """The arguments the plan sets; FSDP's own activation checkpointing excludes the Trainer's (the Trainer
    refuses both)."""
    switch = checkpointing_switch(args)
    return {
        "per_device_train_batch_size": chosen.micro_batch_size,
        "gradient_accumulation_steps": chosen.accumulate_grad_batches,
        switch: (chosen.gradient_checkpointing and not layout_checkpoints) or bool(getattr(args, switch)),
    }


def _smallest_of_all_ranks(capacity: int, args: TrainingArguments) -> int:
    """Under ``torchrun`` every process plans: from the smallest capacity of all of them, so the
    deterministic search gives every rank the same plan (``TrainingArguments`` set up the process group)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() <= 1:
        return capacity
    value = torch.tensor([capacity], dtype=torch.int64, device=args.device)
    distributed.all_reduce(value, op=distributed.ReduceOp.MIN)
    return int(value.item())


def _saved_plan(args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> dict[str, Any] | None:
    if not resume_from_checkpoint:
        return None
    folder = get_last_checkpoint(args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    if folder is None:
        return None
    path = Path(folder) / PLAN_FILE
    return json.loads(path.read_text()) if path.exists() else None
