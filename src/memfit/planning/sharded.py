"""How few GPUs a sharded run needs: one rank's estimate at a world size it was not traced at.

``--gpus auto`` asks the same question at many GPU counts. It answers each with the per-rank estimate that
``memfit.estimate`` makes for that strategy (``TrainingLoop(sharding=...)``: the single-process step's log
rewritten to one rank's by ``memfit.tracing.zero`` / ``memfit.tracing.fsdp`` and replayed), made once per strategy
at a reference count and read at the others by the same documented model (``rescaled``): the rank's model-state
terms at the other count (``RankModel.terms``, the very terms the reference's log was rewritten with) replace the
reference's, category by category at each phase's peak. What does not depend on the count (activations,
temporaries, gathered parameters, buckets) stays as the reference's replay has it. At the reference count the
screen is the per-rank estimate itself; the count ``--gpus auto`` chooses is then planned on its own per-rank
estimate, which the table and the breakdown show.

A count is read off the reference only where its rank is rewritten from the same traced step
(``memfit.prediction.sharded.traced_step``). FSDP on one GPU is not: its shard group of one is NO_SHARD, whose
step is the plain one on the stored (fp32 under ``*-mixed``) weights with the precision's autocast copies, where the
reference's step computes on FSDP's gathered 16-bit parameters; its terms are that step's own bytes, and it
gathers nothing. ``rescaled`` refuses such a count, and the screen answers it with its own per-rank estimate
(the plain step's trace, which one GPU's DDP line reads too, replayed).

Known limitations of the reading at other counts: an FSDP unit's whole gradients awaiting their reduce-scatter
are scaled with the sharded ones (one unit's gradients; with the parameters offloaded, whose sharded gradients go
to the host, they go with them, though a rank keeps them: Mistral-7B at seq 2048 under ``fsdp+offload-all``,
checkpointed, reads 2.94 GiB at 4 to 16 GPUs where the estimate says 4.13 GiB), and the allocator's pool moves by
the bytes the states move (``_reserved``), not by a replay.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate, PhaseModel
from memfit.prediction.sharded import rank_plan, traced_step
from memfit.simulation.replay import PhasePeak
from memfit.tracing.sharding import ShardingConfig

__all__ = ["candidate_gpu_counts", "describe", "reads_reference", "rescaled"]

# the rank's model-state term each category of a phase's peak scales with
_SCALED = {
    Category.PARAMETERS: "parameters",
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer_state",
}


def rescaled(traced: StepCurve, config: ShardingConfig) -> StepCurve:
    """One rank under ``config`` read off ``traced``, a per-rank step of the same strategy (another world size,
    nodes or offload; module docstring). Its ``at()`` answers from the phase fits, which move by the bytes the
    model states move (the reference's replays are not this rank's); the timeline is dropped (the reference's)."""
    reference = traced.estimate
    if reference.sharding is None or reference.rank_model is None:
        raise InvalidInputError("rescaled() reads a per-rank estimate: estimate with TrainingLoop(sharding=...)")
    if reference.sharding.strategy != config.strategy:
        raise InvalidInputError(f"a {reference.sharding.strategy} estimate cannot answer for {config.strategy}")
    if traced_step(config) != traced_step(reference.sharding):
        raise InvalidInputError(
            f"{describe(config)} runs another step than {describe(reference.sharding)} (module docstring): estimate "
            "it with TrainingLoop(sharding=...)"
        )
    if config == reference.sharding:
        return traced
    before, after = reference.rank_model.terms(reference.sharding), reference.rank_model.terms(config)
    ratios = {category: _ratio(after, before, term) for category, term in _SCALED.items()}
    master = _moved(reference.rank_terms, after, before, "fp32_master_weights")
    partition = _moved(reference.rank_terms, after, before, "fp32_gradient_partition")
    moved = _Moved(ratios, master, partition)
    phases, deltas = moved.phases(reference.phases)
    models = tuple(
        PhaseModel(m.step, m.phase, m.fixed_bytes + deltas.get((m.step, m.phase), 0), m.per_sample_bytes)
        for m in reference.phase_models
    )
    top = max(phases, key=lambda p: p.allocated_bytes)
    top_model = next((m for m in models if (m.step, m.phase) == (top.step, top.phase)), models[0])
    terms = {key: _scaled_term(reference.rank_terms, after, before, key) for key in reference.rank_terms}
    host = _host_per_node(reference, config, before)
    value = dataclasses.replace(
        reference,
        peak_allocated_bytes=top.allocated_bytes,
        peak_reserved_bytes=max(p.reserved_bytes for p in phases),
        peak_step=top.step,
        peak_phase=top.phase,
        breakdown=dict(top.breakdown),
        fixed_bytes=top_model.fixed_bytes,
        per_sample_bytes=math.ceil(top_model.per_sample_bytes),
        phases=tuple(phases),
        phase_models=models,
        timeline=(),
        sharding=config,
        rank_terms=terms,
        host_bytes_per_node=host,
        notes=(*reference.notes, f"{describe(config)} read off the estimate of {describe(reference.sharding)}"),
    )
    return StepCurve(value)  # at() reads the phase fits with the reference's allocator ratios


class _Moved:
    """Phase peaks of the reference with the model states moved to another rank's: its own, or those a replay of
    the reference's log gives at another batch (``reading``)."""

    def __init__(self, ratios: Mapping[Category, float], master: int, partition: int) -> None:
        self._ratios, self._master, self._partition = ratios, master, partition

    def phases(self, reference: Sequence[PhasePeak]) -> tuple[list[PhasePeak], dict[tuple[int, Phase], int]]:
        out, deltas = [], {}
        for peak in reference:
            extra = self._master + (self._partition if peak.phase is Phase.OPTIMIZER else 0)
            phase, delta = _rank_phase(peak, self._ratios, extra)
            out.append(phase)
            deltas[(peak.step, peak.phase)] = delta
        return _reserved(reference, out), deltas


def _ratio(after: Mapping[str, int], before: Mapping[str, int], term: str) -> float:
    return after.get(term, 0) / before[term] if before.get(term) else 1.0


def _scaled_term(actual: Mapping[str, int], after: Mapping[str, int], before: Mapping[str, int], term: str) -> int:
    """The estimate's own ``term`` (a depth-extrapolated one's is not its facts') moved as the model moves it."""
    return round(actual.get(term, 0) * _ratio(after, before, term))


def _moved(actual: Mapping[str, int], after: Mapping[str, int], before: Mapping[str, int], term: str) -> int:
    return _scaled_term(actual, after, before, term) - actual.get(term, 0)


def _host_per_node(reference: MemoryEstimate, config: ShardingConfig, before: Mapping[str, int]) -> int:
    """Host RAM of a node's ranks under ``config``, by the facts' model, in the proportion of the reference's own
    terms to its facts' (a depth-extrapolated estimate's facts are a shallower model's)."""
    assert reference.rank_model is not None
    plan = rank_plan(config, reference.rank_model.facts, reference.rank_model.traced)
    scale = sum(reference.rank_terms.values()) / max(1, sum(before.values()))
    return round(plan.host_bytes * scale) * (config.gpus_per_node or config.world_size)


def _rank_phase(peak: PhasePeak, ratios: Mapping[Category, float], extra: int) -> tuple[PhasePeak, int]:
    """The phase's peak with the model states scaled and ``extra`` sharding-buffer bytes; how much it moved."""
    breakdown = dict(peak.breakdown)
    delta = 0
    for category, ratio in ratios.items():
        held = breakdown.get(category, 0)
        kept = round(held * ratio)
        breakdown[category] = kept
        delta += kept - held
    held = breakdown.get(Category.TEMPORARIES, 0)
    if peak.phase is Phase.OPTIMIZER and held:
        # the optimizer step's temporaries (foreach Adam's) are the size of the state shard it updates
        kept = round(held * ratios[Category.OPTIMIZER_STATE])
        breakdown[Category.TEMPORARIES] = kept
        delta += kept - held
    buffers = breakdown.get(Category.SHARDING_BUFFERS, 0)
    if buffers and extra:
        moved = max(-buffers, extra)
        breakdown[Category.SHARDING_BUFFERS] = buffers + moved
        delta += moved
    allocated = max(0, peak.allocated_bytes + delta)
    tensors = max(0, peak.tensor_bytes + delta)
    return dataclasses.replace(peak, allocated_bytes=allocated, breakdown=breakdown, tensor_bytes=tensors), delta


def _reserved(reference: Sequence[PhasePeak], ranked: Sequence[PhasePeak]) -> list[PhasePeak]:
    """The rank's reserved bytes, phase by phase. The caching allocator keeps what it reserved, so a phase's pool
    is the largest allocated peak so far times the reference's own ratio of its pool to its largest allocated peak
    so far (a step-2 forward reserves what step 1's optimizer step needed)."""
    out: list[PhasePeak] = []
    top = top_rank = reserved = 0
    for peak, rank in zip(reference, ranked, strict=True):
        top, top_rank = max(top, peak.allocated_bytes), max(top_rank, rank.allocated_bytes)
        reserved = max(reserved, math.ceil(top_rank * peak.reserved_bytes / max(1, top)), rank.allocated_bytes)
        out.append(dataclasses.replace(rank, reserved_bytes=reserved))
    return out


def reads_reference(reference: ShardingConfig, config: ShardingConfig) -> bool:
    """Whether ``rescaled`` reads one rank of ``config`` off a per-rank estimate made under ``reference``: the same
    strategy, its rank rewritten from the same traced step."""
    return reference.strategy == config.strategy and traced_step(reference) == traced_step(config)


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
    """The GPU counts ``--gpus auto`` considers, up to ``most``: powers of two up to a node, then whole nodes."""
    counts = []
    n = 1
    while n < gpus_per_node and n <= most:
        counts.append(n)
        n *= 2
    counts.extend(range(gpus_per_node, most + 1, gpus_per_node))
    return counts
