"""One rank of a sharded run (FSDP, ZeRO, DDP) from a trace of the step, and how few GPUs a run needs.

Sharding changes what one rank holds of the model states (parameters, gradients, optimizer state),
adds the buffers the collectives work in, and leaves the activations of its own micro batch alone.
This module turns an estimate of the whole step into one rank's by that model, phase by phase, so a
single trace per strategy and checkpointing setting answers every world size: the model states scale
as 1/N analytically, the rest of each phase's peak is the traced one.

The rank's share of each category (``state_shares``), for a shard group of g ranks
(``ShardingConfig.shard_group_size``):

============  ============================  =========================  =================
strategy      parameters                    gradients                  optimizer state
============  ============================  =========================  =================
ddp           1                             1 (+ DDP's buckets, traced) 1
zero1         16-bit copy + fp32 master/g   16-bit, 1                  1/g
zero2         16-bit copy + fp32 master/g   16-bit, 1/g                1/g
zero3         (16-bit copy + fp32 master)/g 16-bit, 1/g                1/g
fsdp, hybrid  1/g                           1/g                        1/g
============  ============================  =========================  =================

The trace keeps fp32 parameters and gradients under a ``*-mixed`` precision (autocast), as FSDP
does with ``MixedPrecisionPolicy``; DeepSpeed keeps 16-bit parameters and gradients and an fp32
master copy in its optimizer partition, hence the 16-bit columns for ZeRO (under fp32 or a
``*-true`` precision there is no master copy and the copy is the parameters themselves). Offloaded
states leave the device: ``offload_optimizer`` takes the optimizer state (and ZeRO's master copy and
fp32 gradient partition), ``offload_params`` the parameters (FSDP's CPU offload moves parameters,
gradients and the optimizer step to the host together). The optimizer step's temporaries (foreach
Adam's) scale with the optimizer state. Under a ``*-mixed`` precision the traced forward holds
autocast's 16-bit copies of the fp32 weights; FSDP (``MixedPrecisionPolicy``) and DeepSpeed compute
on 16-bit parameters directly, so a sharded rank drops them (up to half the traced parameter bytes).
The allocator's pool keeps the traced step's ratio to the largest allocated peak so far (``_reserved``).

Communication buffers added to each phase's peak:

* FSDP (``fully_shard`` per decoder block, the rest in the root unit): the root's gathered parameters
  through forward and backward (FSDP2 keeps the root unsharded after forward), and two blocks'
  gathered parameters (the one running and the one prefetched), in the compute dtype; in backward
  also one block's unsharded gradients before their reduce-scatter.
* ZeRO-3: the largest gathered module (a block, or the embedding / head) plus a prefetched block;
  ``reduce_bucket_size`` elements of 16-bit gradients in backward.
* ZeRO-1/2: ``reduce_bucket_size`` gradient elements in backward, ``allgather_bucket_size`` parameter
  elements in the optimizer step (DeepSpeed's defaults: 5e8 each).

Known limitations: the collectives' own NCCL buffers and the allocator's fragmentation of the
gathered buffers are not modelled; ``stage3_max_live_parameters`` and ``stage3_param_persistence_threshold``
are not; a "fits" is confirmed on the per-rank view of a whole-model trace, not on a trace of the
sharded step itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.categories import Category, Phase
from memfit.precision import Precision
from memfit.prediction.estimator import MemoryEstimate, PhaseModel
from memfit.simulation.replay import PhasePeak
from memfit.tracing.sharding import ShardingConfig

__all__ = [
    "DEEPSPEED_BUCKET_DEFAULT",
    "ModelUnits",
    "candidate_gpu_counts",
    "model_states_per_rank",
    "model_units",
    "per_rank",
    "state_shares",
]

DEEPSPEED_BUCKET_DEFAULT = 500_000_000  # elements: DeepSpeed's reduce_bucket_size and allgather_bucket_size

_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


@dataclass(frozen=True)
class ModelUnits:
    """Parameter counts that decide the gathered buffers: the root unit's own, the largest block's and the
    largest single module's (embedding or head)."""

    root_parameters: int
    block_parameters: int
    largest_module_parameters: int


def model_units(model: nn.Module) -> ModelUnits:
    """The wrap units FSDP's transformer auto-wrap (and Lightning / accelerate's) makes of ``model``: one
    per module of a class the model names in ``_no_split_modules`` (Hugging Face models' decoder blocks),
    the root unit holding the rest; a model naming none is one unit."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    leaves = [m for m in model.modules() if not list(m.children())]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves), default=0)
    return ModelUnits(root, block, max(largest, block))


def state_shares(config: ShardingConfig, precision: Precision) -> dict[Category, float]:
    """The share of each traced model-state category one rank holds on the device (module docstring)."""
    g = config.shard_group_size
    strategy = config.strategy
    sixteen = 0.5 if precision.is_mixed else 1.0  # a 16-bit copy of an fp32 traced tensor
    master = 1.0 if precision.is_mixed else 0.0  # ZeRO's fp32 master copy, per fp32 traced byte
    if strategy in ("ddp", "fsdp-no-shard"):
        return {c: 1.0 for c in _STATES}
    if config.is_fsdp:
        everything = 1.0 / g
        if config.offload_params:  # CPUOffload / CPUOffloadPolicy: sharded states and the step live on the host
            return {c: 0.0 for c in _STATES}
        shares = {c: everything for c in _STATES}
        if strategy == "fsdp-grad-op":
            shares[Category.PARAMETERS] = 1.0  # gathered from forward to the end of backward
        return shares
    # ZeRO
    copy = sixteen / g if strategy == "zero3" else sixteen
    if config.offload_params:
        copy = 0.0
    parameters = copy + (0.0 if config.offload_optimizer else master / g)
    gradients = sixteen if strategy == "zero1" else sixteen / g
    if config.offload_optimizer and strategy != "zero1":
        gradients = 0.0  # reduced straight into the host's fp32 partition (buckets only on the device)
    optimizer = 0.0 if config.offload_optimizer else 1.0 / g
    return {Category.PARAMETERS: parameters, Category.GRADIENTS: gradients, Category.OPTIMIZER_STATE: optimizer}


def _buffers(config: ShardingConfig, phase: Phase, units: ModelUnits, precision: Precision) -> tuple[int, int]:
    """Communication buffers one rank holds at the peak of ``phase`` (module docstring): gathered
    parameters (counted as parameters) and gradient buckets / unsharded gradients awaiting their
    reduction (counted as gradient buckets)."""
    compute = 2 if precision.is_mixed or precision in (Precision.BF16_TRUE, Precision.FP16_TRUE) else 4
    reduce = (config.reduce_bucket_size or DEEPSPEED_BUCKET_DEFAULT) * compute
    if config.strategy in ("ddp", "fsdp-no-shard") or (
        phase is Phase.FORWARD and not (config.is_fsdp or config.strategy == "zero3")
    ):
        return 0, 0
    if config.is_fsdp:
        if phase is Phase.OPTIMIZER:
            return 0, 0
        # fsdp-grad-op keeps parameters gathered: counted in full as parameters already
        gathered = 0 if config.strategy == "fsdp-grad-op" else units.root_parameters + 2 * units.block_parameters
        grads = units.block_parameters * compute if phase is Phase.BACKWARD else 0
        return gathered * compute, grads
    if config.strategy == "zero3":
        if phase is Phase.OPTIMIZER:
            return 0, 0
        gathered = (units.largest_module_parameters + units.block_parameters) * compute
        return gathered, reduce if phase is Phase.BACKWARD else 0
    if phase is Phase.BACKWARD:
        return 0, reduce
    return (config.allgather_bucket_size or DEEPSPEED_BUCKET_DEFAULT) * compute, 0  # the optimizer step's all-gather


def _rank_phase(
    peak: PhasePeak, shares: Mapping[Category, float], extra: tuple[int, int], mixed: bool
) -> tuple[PhasePeak, int]:
    """The phase's peak on one rank, and how much it moved (negative: smaller)."""
    breakdown = dict(peak.breakdown)
    weight_casts = breakdown.get(Category.PARAMETERS, 0) // 2 if mixed else 0
    gathered, buckets = extra
    delta = gathered + buckets
    for category in _STATES:
        held = breakdown.get(category, 0)
        kept = round(held * shares[category])
        breakdown[category] = kept
        delta += kept - held
    held = breakdown.get(Category.TEMPORARIES, 0)
    if peak.phase is Phase.OPTIMIZER and held:
        # the optimizer step's temporaries (foreach Adam's, the size of the states it updates) shrink with them
        kept = round(held * shares[Category.OPTIMIZER_STATE])
        breakdown[Category.TEMPORARIES] = kept
        delta += kept - held
    elif peak.phase is Phase.FORWARD and held and weight_casts:
        # autocast's cached 16-bit copies of the fp32 weights: FSDP's MixedPrecisionPolicy gathers 16-bit
        # parameters and DeepSpeed keeps them 16-bit, so a sharded run computes on them without a copy
        dropped = min(held, weight_casts)
        breakdown[Category.TEMPORARIES] = held - dropped
        delta -= dropped
    breakdown[Category.PARAMETERS] += gathered
    if buckets:
        breakdown[Category.GRADIENT_BUCKETS] = breakdown.get(Category.GRADIENT_BUCKETS, 0) + buckets
    allocated = max(0, peak.allocated_bytes + delta)
    tensors = max(0, peak.tensor_bytes + delta)
    # reserved is set by per_rank, which needs the phases before this one
    return dataclasses.replace(peak, allocated_bytes=allocated, breakdown=breakdown, tensor_bytes=tensors), delta


def _reserved(traced: Sequence[PhasePeak], ranked: Sequence[PhasePeak]) -> list[PhasePeak]:
    """The rank's reserved bytes, phase by phase. The caching allocator keeps what it reserved, so a
    phase's pool is the largest allocated peak so far times the allocator's overhead on it; that overhead
    is the traced step's own ratio of the pool to the largest allocated peak so far (not to the phase's
    own allocated bytes: a step-2 forward reserves what step 1's optimizer needed, which the rank's share
    shrinks)."""
    out: list[PhasePeak] = []
    top = top_rank = reserved = 0
    for peak, rank in zip(traced, ranked, strict=True):
        top, top_rank = max(top, peak.allocated_bytes), max(top_rank, rank.allocated_bytes)
        reserved = max(reserved, math.ceil(top_rank * peak.reserved_bytes / max(1, top)), rank.allocated_bytes)
        out.append(dataclasses.replace(rank, reserved_bytes=reserved))
    return out


def per_rank(
    estimate: MemoryEstimate, config: ShardingConfig, units: ModelUnits, *, traced_as: ShardingConfig | None = None
) -> MemoryEstimate:
    """One rank's estimate under ``config`` from ``estimate``, a trace of the step unsharded (``traced_as``
    ``None``) or already sharded as ``traced_as`` (only the model states are then rescaled to ``config``).

    Each phase's peak keeps its activations and temporaries and trades the model states for the rank's
    share of them plus the communication buffers of that phase; the fit in the batch moves by the same
    bytes (``fixed_bytes``), the slope stays. The peak phase is chosen again, as the optimizer step
    shrinks most. The timeline is dropped: it is the unsharded step's.
    """
    if config.strategy == "ddp":
        return estimate
    shares = state_shares(config, estimate.precision)
    if traced_as is not None:
        before = state_shares(traced_as, estimate.precision)
        shares = {c: (shares[c] / before[c] if before[c] else 1.0) for c in _STATES}
    phases, deltas = [], {}
    for peak in estimate.phases:
        extra = (0, 0) if traced_as is not None else _buffers(config, peak.phase, units, estimate.precision)
        phase, delta = _rank_phase(peak, shares, extra, estimate.precision.is_mixed and traced_as is None)
        phases.append(phase)
        deltas[(peak.step, peak.phase)] = delta
    phases = _reserved(estimate.phases, phases)
    models = tuple(
        PhaseModel(m.step, m.phase, m.fixed_bytes + deltas.get((m.step, m.phase), 0), m.per_sample_bytes)
        for m in estimate.phase_models
    )
    top = max(phases, key=lambda p: p.allocated_bytes)
    top_model = next((m for m in models if (m.step, m.phase) == (top.step, top.phase)), models[0])
    reserved = max(p.reserved_bytes for p in phases)
    tensors = max(1, max(m.at(estimate.batch_size) for m in models))
    allocated_ratio = max(1.0, max(p.allocated_bytes / max(1, p.tensor_bytes) for p in phases),
                          top.allocated_bytes / tensors)  # fmt: skip
    reserved_ratio = max(1.0, reserved / max(1, math.ceil(tensors * allocated_ratio)))
    return dataclasses.replace(
        estimate,
        peak_allocated_bytes=top.allocated_bytes,
        peak_reserved_bytes=reserved,
        peak_step=top.step,
        peak_phase=top.phase,
        breakdown=dict(top.breakdown),
        fixed_bytes=top_model.fixed_bytes,
        per_sample_bytes=math.ceil(top_model.per_sample_bytes),
        phases=tuple(phases),
        phase_models=models,
        allocated_to_tensor_ratio=allocated_ratio,
        reserved_to_allocated_ratio=reserved_ratio,
        timeline=(),
        exact_peaks=None,  # the whole step's replays are not one rank's: at() reads the rank's phase models
        notes=(*estimate.notes, f"one rank of {describe(config)}"),
    )


def model_states_per_rank(estimate: MemoryEstimate, config: ShardingConfig) -> dict[str, int]:
    """The model states one rank holds on the device, from ``estimate`` (the step traced unsharded): each
    category at its largest over the step, times the rank's share."""
    shares = state_shares(config, estimate.precision)
    out = {}
    for category in _STATES:
        whole = max((p.breakdown.get(category, 0) for p in estimate.phases), default=0)
        out[category.value] = round(whole * shares[category])
    return out


def describe(config: ShardingConfig) -> str:
    """``"zero3 over 16 GPUs (2 nodes), optimizer offloaded"``."""
    text = f"{config.strategy} over {config.world_size} GPU{'s' if config.world_size > 1 else ''}"
    if config.nodes > 1:
        text += f" ({config.nodes} nodes)"
    offloaded = [name for name, on in (("optimizer", config.offload_optimizer), ("parameters", config.offload_params))
                 if on]  # fmt: skip
    if offloaded:
        text += f", {' and '.join(offloaded)} offloaded"
    return text


def candidate_gpu_counts(gpus_per_node: int = 8, most: int = 1024) -> list[int]:
    """The GPU counts ``--gpus auto`` considers: powers of two up to a node, then whole nodes."""
    counts = []
    n = 1
    while n < gpus_per_node:
        counts.append(n)
        n *= 2
    counts.extend(range(gpus_per_node, most + 1, gpus_per_node))
    return counts


def first_fitting(counts: Iterable[int], fits: Callable[[int], Any]) -> tuple[int | None, list[tuple[int, Any]]]:
    """The first count whose ``fits(count)`` is truthy, and what each count considered said."""
    said = []
    for count in counts:
        answer = fits(count)
        said.append((count, answer))
        if answer:
            return count, said
    return None, said
