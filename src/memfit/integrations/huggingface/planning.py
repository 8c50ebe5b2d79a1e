"""``plan_training_arguments``: plan the batch before the ``Trainer`` exists, which copies it in ``__init__``."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

try:
    from transformers import TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.huggingface needs transformers and accelerate: pip install 'memfit[hf]'") from error

from memfit.errors import InvalidInputError, ShardingNotModelledError
from memfit.integrations.huggingface import internals
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
from memfit.integrations.huggingface.sharding import run_layout
from memfit.planning.gpus import PlanningTarget, planning_target
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.run_options import RunOptions, dropped_samples_warning
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate
from memfit.prediction.evaluation import EvaluationPeak
from memfit.run.controller import RunController
from memfit.run.port import PlanningOnly, RankZeroSpeaker, RunLayout, TrainingStep
from memfit.run.ranks import gathered, process_group_rank
from memfit.tracing.batch import dataset_length
from memfit.tracing.config import Target
from memfit.tracing.model_limits import check_sequence_length
from memfit.tracing.sharding import ShardingConfig

PLAN_FILE = "memfit_plan.json"  # written into each checkpoint folder, read back on resume


class PlannedArguments(NamedTuple):
    """``TrainingArguments`` with the plan applied, the plan, the prediction of the step the plan runs (its
    micro batch, accumulation and checkpointing), the predicted evaluation pass (``None`` without
    an ``eval_dataset``), what one rank holds under FSDP or DeepSpeed (``None``: not sharded), and the step
    traced (``traced.at(batch)`` reads it at any other batch)."""

    args: TrainingArguments
    plan: Plan
    estimate: MemoryEstimate
    evaluation: EvaluationPeak | None = None
    sharding: ShardingConfig | None = None
    traced: StepCurve | None = None


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

    The step the Trainer will run is traced on the longest batch its collator builds of ``train_dataset``, with
    its optimizer, precision and loop; the plan is one rank's under FSDP or DeepSpeed, as accelerate will run it.
    Under ``torchrun`` every process plans from the smallest capacity of all ranks. With an ``eval_dataset`` the
    evaluation pass is predicted too, and ``eval_accumulation_steps`` (if you left it unset) is set to the most
    batches of collected outputs that fit (docs/huggingface.md).

    Args:
        model, args, train_dataset, data_collator, processing_class, eval_dataset, compute_metrics,
            preprocess_logits_for_metrics: what you will pass to ``Trainer``.
        budget: memory per device: bytes, ``"20GiB"`` or a GPU name; default: the free memory of the device the
            run will use, or the memory of the GPU ``target`` names.
        target: the device the plan is for: ``"cuda"``, ``"cpu"`` or a GPU name (``"h100"``); default: the run's,
            or the GPU ``budget`` names.
        margin, target_batch_size, allow_checkpointing, min_batch_size, max_batch_size: as for every port;
            the effective batch kept by default is ``per_device_train_batch_size x gradient_accumulation_steps x
            world_size``.
        max_length: the longest sequence a streamed dataset's batches have (default: the collator's, the
            tokenizer's ``model_max_length``, else the model's positions).
        resume_from_checkpoint: as for ``Trainer.train``: a memfit plan in the checkpoint is returned unchanged.

    Returns:
        ``PlannedArguments(args, plan, estimate, evaluation, sharding)``; ``args`` is a copy.

    Raises:
        ShardingNotModelledError: a layout memfit cannot predict per rank (DeepSpeed tensor parallelism, ZeRO++,
            MiCS), named in the message.
    """
    if not isinstance(args, TrainingArguments):
        raise InvalidInputError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    options = RunOptions(margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing)
    port = _ArgumentsPort(model, args, train_dataset, data_collator, processing_class, target, budget, max_length)
    controller = RunController(port, options=options, verbose=False)
    controller.restored = _saved_plan(args, resume_from_checkpoint)
    controller.plan_run(raise_errors=True)
    chosen, planned, changes = controller.plan, controller.estimate, port.changes
    assert chosen is not None and planned is not None
    evaluation = None
    if eval_dataset is not None:
        evaluation, flush_every = planned_evaluation(
            model, args, eval_dataset, planned, port.planned_for(), chosen.budget_bytes,
            include_context=controller.include_context, data_collator=data_collator,
            processing_class=processing_class, compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        if flush_every is not None:
            changes["eval_accumulation_steps"] = flush_every
            chosen = chosen.with_reason(f"eval_accumulation_steps={flush_every}: the outputs collected for "
                                        "compute_metrics move to the CPU before they fill the GPU")  # fmt: skip
    sharding = port.read_layout.sharding if port.read_layout is not None else None
    return PlannedArguments(changed_arguments(args, changes), chosen, planned, evaluation, sharding, controller.traced)


class _ArgumentsPort(PlanningOnly, RankZeroSpeaker):
    """The run a ``Trainer`` will train, read from what it is about to be built with: its arguments, model,
    datasets, collator and processing class. Under ``torchrun`` every process plans, from the smallest capacity of
    all of them, so the deterministic search gives every rank the same plan."""

    loop_name = "the Trainer"
    every_rank_decides = True

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, dataset: Any, collator: Any,
                 processing_class: Any, target: str | None, budget: int | str | None,
                 max_length: int | None) -> None:  # fmt: skip
        self.model, self.args, self.dataset, self.collator = model, args, dataset, collator
        self.processing_class, self.target, self.budget, self.max_length = processing_class, target, budget, max_length
        self.runs_on = run_device(args)
        self.read_layout: RunLayout | None = None
        self.changes: dict[str, Any] = {}

    def device(self) -> torch.device:
        return self.runs_on

    def planned_for(self) -> torch.device:
        """The device planned for: where batches and the evaluation live."""
        return self.planning_target().target.torch_device

    def world_size(self) -> int:
        return internals.world_size(self.args)  # the process group's: DeepSpeed on CPU misreports args.world_size

    def rank(self) -> int:
        return process_group_rank()

    def accumulation(self) -> int:
        return self.args.gradient_accumulation_steps

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return gathered(tensor)

    def broadcast(self, value: Any) -> Any:
        return value

    def planning_target(self) -> PlanningTarget:
        return planning_target(self.target, self.budget, self.runs_on)

    def precision(self) -> str:
        return run_precision(self.args)

    def layout(self) -> RunLayout:
        """The run's layout as accelerate will run it; one memfit cannot predict per rank is refused with what to
        do."""
        elsewhere = self.planned_for().type == "cuda" and self.runs_on.type != "cuda"
        try:
            layout = run_layout(self.args, self.model, precision=self.precision(), elsewhere_on_gpus=elsewhere)
        except ShardingNotModelledError as error:
            raise ShardingNotModelledError(
                f"memfit cannot predict one rank's memory under {error}, so it cannot plan these arguments: set the "
                "batch size yourself; MemoryPlannerCallback, attached, still logs the measured peaks"
            ) from error
        self.read_layout = layout = dataclasses.replace(layout, notes=(*run_notes(self.args), *layout.notes))
        return layout

    def unplannable(self) -> None:
        return None

    def sample_batch(self, notes: list[str]) -> Any:
        sample = collated_sample(self.model, self.args, self.dataset, self.args.per_device_train_batch_size,
                                 self.collator, self.processing_class, notes=notes,
                                 max_length=self.max_length)  # fmt: skip
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:  # refused before the trace fails on them
            check_sequence_length(self.model, ids.shape[1], fix="truncate them (the tokenizer's or collator's "
                                  "max_length={positions}), or pass max_length= for a stream")  # fmt: skip
        return sample

    def configured_batch(self, sample: Any) -> int:
        return self.args.per_device_train_batch_size

    def training_samples(self) -> int | None:
        return dataset_length(self.dataset)

    def training_step(self, sample: Any, target: Target, layout: RunLayout, notes: Sequence[str]) -> TrainingStep:
        """The step the Trainer will run: its optimizer, DDP buckets, the batches it holds, ``use_cache`` as it
        sets it, on one rank of ``layout``."""
        model, args = self.model, self.args
        return TrainingStep(
            model, sample, trainer_optimizer(args, model), self.precision(), target,
            ddp=ddp_config(args, model, sharded=layout.sharding is not None), sharding=layout.sharding,
            checkpoint_modules=layout.units, held_batches=functools.partial(held_batches, device=target.torch_device),
            settings=functools.partial(trainer_model_config, model, args), notes=notes,
        )  # fmt: skip

    def evaluation(self, training: MemoryEstimate) -> None:
        return None  # plan_training_arguments plans the evaluation pass itself, after the training plan

    def apply(self, plan: Plan) -> bool:
        """The arguments the plan sets (into a copy); FSDP's own activation checkpointing excludes the Trainer's
        (the Trainer refuses both). With ``dataloader_drop_last`` the planned batch size drops another number of
        samples an epoch: said."""
        args, switch = self.args, checkpointing_switch(self.args)
        layout_checkpoints = self.read_layout is not None and self.read_layout.checkpointing
        self.changes = {
            "per_device_train_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.accumulate_grad_batches,
            switch: (plan.gradient_checkpointing and not layout_checkpoints) or bool(getattr(args, switch)),
        }
        samples = dataset_length(self.dataset) if args.dataloader_drop_last else None
        ranks = args.world_size
        warning = dropped_samples_warning("dataloader_drop_last", samples, args.per_device_train_batch_size * ranks,
                                          plan.micro_batch_size * ranks)  # fmt: skip
        if warning is not None:
            self.warn(warning)
        return True


def _saved_plan(args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> dict[str, Any] | None:
    if not resume_from_checkpoint:
        return None
    folder = get_last_checkpoint(args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    if folder is None:
        return None
    path = Path(folder) / PLAN_FILE
    return json.loads(path.read_text()) if path.exists() else None
