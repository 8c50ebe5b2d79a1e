"""One rank of a sharded run (``TrainingLoop(sharding=ShardingConfig(...))``): how ``estimate`` answers for it.

The step is traced once as a single process would run it; the trace's storage log is then rewritten to what
one rank holds (``memfit.tracing.shard_log``) by the documented models of FSDP (``memfit.tracing.fsdp``) and
DeepSpeed ZeRO (``memfit.tracing.zero``), and replayed through the allocator as any trace is. Activations,
temporaries and the batch are one rank's already: each rank runs the micro batch the trace ran. The step is
traced with the weights the rank computes on (``sharded_settings``): DeepSpeed's 16-bit module under ZeRO, FSDP's
16-bit gathered parameters under a 16-bit ``mixed_precision_param_dtype``; the stored fp32 shards are the
rank plans' (``ModelFacts.stored_element_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from memfit.prediction.estimator import MemoryEstimate

from memfit.categories import Category
from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.tracing.checkpointing import CheckpointTarget, find_blocks
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.fsdp import fsdp_rank_plan
from memfit.tracing.recorder import fold_sums_in_place
from memfit.tracing.shard_log import ModelFacts, RankPlan, Unit, apply_rank_plan
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.tracer import StepTrace, TraceSettings
from memfit.tracing.zero import zero_rank_plan

__all__ = [
    "ANALYTIC_PATH",
    "RankModel",
    "fsdp_compute_dtype",
    "model_facts",
    "rank_plan",
    "shard_trace",
    "sharded_settings",
    "traced_bytes",
    "traced_step",
]

ANALYTIC_PATH = "sharding modelled on the traced single-process step (memfit.tracing.{})"
_HALF_OF = {Precision.BF16_MIXED: Precision.BF16_TRUE, Precision.FP16_MIXED: Precision.FP16_TRUE}


def sharded_settings(settings: TraceSettings, sharding: ShardingConfig) -> TraceSettings:
    """The trace settings one rank's step runs with: DDP's buckets under ``"ddp"``; DeepSpeed's 16-bit model
    (its ``bf16``/``fp16`` sections convert the module, they do not autocast) under ZeRO; under FSDP with a
    16-bit ``mixed_precision_param_dtype``, parameters (and floating inputs) in that dtype, as FSDP gathers and
    computes on them, with the precision's autocast kept as it is (Lightning's ``FSDPPrecision`` and accelerate
    autocast on top of FSDP's mixed precision; bare ``fully_shard`` with ``precision="32-true"`` does not).
    The fp32 shards the run keeps are the rank plan's (``memfit.tracing.fsdp``). An FSDP trace records which
    block runs at each event: FSDP gathers and reduces by block."""
    if settings.inference:
        raise InvalidInputError("sharding plans a training step; estimate a forward-only pass without sharding")
    if sharding.strategy == "ddp" and settings.ddp is None:
        return dataclasses.replace(settings, ddp=DDPConfig())
    if sharding.strategy != "ddp" and settings.ddp is not None:
        raise InvalidInputError(
            f"give ddp= or a {sharding.strategy} ShardingConfig, not both: a sharded run has no DDP buckets"
        )
    if sharding.is_zero and settings.precision in _HALF_OF:
        return dataclasses.replace(settings, precision=_HALF_OF[settings.precision])
    if _gathers_by_unit(sharding):
        settings = dataclasses.replace(settings, record_blocks=True)  # the rank's units run where the blocks run
    half = fsdp_compute_dtype(sharding)
    if half is not None and not settings.precision.converts_to_half:
        return dataclasses.replace(settings, parameter_dtype=half)
    return settings


def traced_step(sharding: ShardingConfig) -> tuple[bool, bool, bool, torch.dtype | None]:
    """What of ``sharding`` the step a rank is rewritten from depends on (``sharded_settings``): DDP's buckets,
    DeepSpeed's 16-bit module, FSDP's units and the dtype it gathers in. Two shardings alike in it rewrite one
    traced step, so one rank's estimate can be read at the other's terms; FSDP on a shard group of one (NO_SHARD)
    is not alike the sharded FSDP of more ranks: its step is the plain one, on the stored weights."""
    return sharding.strategy == "ddp", sharding.is_zero, _gathers_by_unit(sharding), fsdp_compute_dtype(sharding)


def _gathers_by_unit(sharding: ShardingConfig) -> bool:
    """FSDP that shards: its units gather and reduce where the trace's blocks run."""
    return sharding.is_fsdp and sharding.shard_group_size > 1 and sharding.strategy != "fsdp-no-shard"


def fsdp_compute_dtype(sharding: ShardingConfig) -> torch.dtype | None:
    """The 16-bit dtype FSDP gathers a sharded run's parameters in (``MixedPrecisionPolicy`` / ``MixedPrecision``
    ``param_dtype``); ``None`` where the parameters are gathered as stored or not sharded (NO_SHARD)."""
    name = sharding.mixed_precision_param_dtype
    if not sharding.is_fsdp or sharding.shard_group_size == 1 or name in (None, "float32"):
        return None
    return getattr(torch, name)  # type: ignore[no-any-return]


def model_facts(model: nn.Module, settings: TraceSettings, checkpoint_modules: CheckpointTarget | None) -> ModelFacts:
    """Element counts of ``model`` by unit (its repeated blocks, then the root), as the trace holds them."""
    params = _unique_parameters(model.parameters())
    try:
        blocks = find_blocks(model, checkpoint_modules)
    except InvalidInputError:
        blocks = []
    unit_of: dict[int, int] = {}  # id of a parameter -> the block unit that holds it (absent: the root)
    units = []
    for number, block in enumerate(blocks):
        own = [p for p in _unique_parameters(block.parameters()) if id(p) not in unit_of]
        unit_of.update((id(p), number) for p in own)
        units.append(_unit(f"{type(block).__name__}[{number}]", own))
    root = _unit("root", [p for p in params if id(p) not in unit_of])
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    stored = _element_bytes(params, settings.precision)
    trainable_stored = _element_bytes([p for p in params if p.requires_grad], settings.precision)
    return ModelFacts(
        numel=sum(p.numel() for p in params),
        trainable_numel=sum(p.numel() for p in params if p.requires_grad),
        element_bytes=settings.parameter_dtype.itemsize if settings.parameter_dtype is not None else stored,
        units=tuple(units),
        root=root,
        largest_module_numel=largest,
        parameter_numels=tuple(p.numel() for p in params),
        trainable=tuple((unit_of.get(id(p), len(units)), tuple(p.shape)) for p in params if p.requires_grad),
        stored_element_bytes=stored,
        trainable_stored_element_bytes=trainable_stored,
        trainable_element_bytes=settings.parameter_dtype.itemsize if settings.parameter_dtype else trainable_stored,
    )


def traced_bytes(trace: StepTrace) -> dict[Category, int]:
    """Bytes per category of one step of the trace (the larger step's): the model states a rank shards."""
    recorder = trace.recorder
    per_step: dict[tuple[Category, int], int] = {}
    for sid, category in recorder.categories.items():
        phase = recorder.alloc_phase.get(sid, -1)
        step = recorder.marks[phase].step if 0 <= phase < len(recorder.marks) else 0
        per_step[category, step] = per_step.get((category, step), 0) + recorder.sizes[sid]
    out: dict[Category, int] = {}
    for (category, _), size in per_step.items():
        out[category] = max(out.get(category, 0), size)
    return out


@dataclasses.dataclass(frozen=True)
class RankModel:
    """What a per-rank estimate was made from: the model's facts and the traced step's model states. With them
    the same documented strategy model answers for another world size or offload (``terms``)."""

    facts: ModelFacts
    traced: Mapping[Category, int]

    def terms(self, sharding: ShardingConfig) -> dict[str, int]:
        """One rank's model-state terms under ``sharding`` (``RankPlan.terms``): right for a sharding whose step is
        traced alike the one these facts came from (``traced_step``), the trace's own bytes otherwise."""
        return dict(rank_plan(sharding, self.facts, self.traced).terms)


def rank_plan(sharding: ShardingConfig, facts: ModelFacts, traced: Mapping[Category, int]) -> RankPlan:
    """The documented model of ``sharding``'s strategy for one rank (DDP: nothing changes but its buckets)."""
    if sharding.is_zero:
        return zero_rank_plan(sharding, facts, traced)
    if sharding.is_fsdp:
        return fsdp_rank_plan(sharding, facts, traced)
    return RankPlan(
        sharding.strategy, sharding.world_size, terms=_whole(traced), notes=("DDP: every rank holds everything",)
    )


def _whole(traced: Mapping[Category, int]) -> dict[str, int]:
    """Model-state terms of a rank that holds everything."""
    return {
        "parameters": traced.get(Category.PARAMETERS, 0),
        "gradients": traced.get(Category.GRADIENTS, 0),
        "optimizer_state": traced.get(Category.OPTIMIZER_STATE, 0),
    }


def shard_trace(trace: StepTrace, plan: RankPlan) -> StepTrace:
    """``trace`` as one rank of ``plan`` sees it (a new log; ``trace`` is untouched). A trace that recorded blocks
    (FSDP gathers by unit) kept the engine's in-place gradient sums apart; the rank's log has them in place, as the
    run does (``fold_sums_in_place``)."""
    rewritten = apply_rank_plan(trace.recorder, plan)
    rewritten.sums_in_place = dict(trace.recorder.sums_in_place)
    return dataclasses.replace(trace, recorder=fold_sums_in_place(rewritten))


def rank_notes(sharding: ShardingConfig, plan: RankPlan) -> tuple[str, ...]:
    """What an estimate of one rank says about itself."""
    module = "zero" if sharding.is_zero else "fsdp" if sharding.is_fsdp else "ddp"
    notes = [sharding.describe(), *plan.notes]
    if module != "ddp":
        notes.append(ANALYTIC_PATH.format(module))
    if plan.host_bytes:
        ranks = sharding.gpus_per_node or sharding.world_size
        notes.append(f"host RAM per node for offload: {ranks} rank(s) x {plan.host_bytes:,} B (pinned included)")
    return tuple(notes)


def _unit(name: str, params: list[torch.Tensor]) -> Unit:
    return Unit(name, sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))


def _unique_parameters(params: object) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for p in params:  # type: ignore[attr-defined]
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _element_bytes(params: list[torch.Tensor], precision: Precision) -> int:
    """Bytes of a floating parameter element as traced (the most common floating dtype's)."""
    if precision.converts_to_half:
        return precision.parameter_dtype.itemsize
    counts: dict[int, int] = {}
    for p in params:
        if p.is_floating_point():
            counts[p.element_size()] = counts.get(p.element_size(), 0) + p.numel()
    return max(counts, key=lambda size: counts[size]) if counts else 4


def traced_fsdp2_peak(
    model: nn.Module,
    sample: object,
    sample_batch: int,
    batch_size: int,
    settings: TraceSettings,
    sharding: ShardingConfig,
    checkpoint_modules: CheckpointTarget | None,
) -> int | None:
    """Rank 0's peak tensor bytes from real ``fully_shard`` on a fake process group (``memfit.tracing.fsdp2_fake``),
    where that trace measures what the estimate predicts: a CPU target, a plain fp32 loop, an optimizer named as
    a string, no checkpointing, no default process group. ``None`` elsewhere: the documented model stands."""
    from memfit.tracing.batch import call_model, rebatch
    from memfit.tracing.fsdp2_fake import fake_rank_peak
    from memfit.tracing.optimizers import build_optimizer
    from memfit.tracing.tracer import _loss_of

    plain = settings.precision is Precision.FP32 and not settings.gradient_checkpointing
    plain = plain and settings.accumulation_steps == 1 and settings.zero_grad == "after_step"
    if settings.target.type != "cpu" or not plain or not isinstance(settings.optimizer, str) or callable(sample):
        return None
    try:
        blocks = find_blocks(model, checkpoint_modules)
    except InvalidInputError:
        blocks = []
    batch = rebatch(sample, sample_batch, batch_size, lambda t, shape: torch.zeros(shape, dtype=t.dtype))  # type: ignore[arg-type]

    def loss_of(module: nn.Module, data: object) -> torch.Tensor:
        output = settings.forward_fn(module, data) if settings.forward_fn else call_model(module, data)
        return _loss_of(output, data, settings.loss_fn)

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        built = build_optimizer(settings.optimizer, {}, params, kwargs=settings.optimizer_kwargs)
        assert built is not None
        return built

    try:
        peak = fake_rank_peak(model, batch, sharding, blocks=blocks, loss_of=loss_of, optimizer=optimizer)
    except Exception:  # any failure of the private pieces: the documented model answers instead
        return None
    return peak.peak_bytes if peak is not None else None


def with_traced_fsdp2(estimate: MemoryEstimate, traced: int | None) -> MemoryEstimate:
    """``estimate`` (the documented model) with its peak replaced by FSDP2's own, traced on the fake process group,
    where that trace ran; each phase's fit in the batch moves by the same bytes, so ``at()`` agrees at the traced
    batch. The notes say which path answered."""
    if traced is None:
        return estimate.with_notes("FSDP2 not traced under a fake process group here: the documented model answers")
    shift = traced - estimate.peak_allocated_bytes
    models = tuple(dataclasses.replace(m, fixed_bytes=m.fixed_bytes + shift) for m in estimate.phase_models)
    return dataclasses.replace(
        estimate.with_notes(
            f"FSDP2 traced with real fully_shard on a fake process group (rank 0): peak {traced:,} B, "
            f"the documented model's {estimate.peak_allocated_bytes:,} B"
        ),
        peak_allocated_bytes=traced, peak_reserved_bytes=traced, fixed_bytes=estimate.fixed_bytes + shift,
        phase_models=models, allocated_to_tensor_ratio=1.0, reserved_to_allocated_ratio=1.0,
    )  # fmt: skip
