"""FSDP (``fully_shard``, FSDP1's ``ShardingStrategy``) as one rank sees it, applied to the traced step.

The documented model used when the step is not traced under real ``fully_shard`` (FSDP1 always; FSDP2 where
the fake-process-group trace is unavailable). Units are the model's repeated blocks (found as activation
checkpointing finds them, ``memfit.tracing.checkpointing.find_blocks``), each wrapped, then the root, as
``fully_shard`` / an auto-wrap policy on the block class is applied in practice. ``G`` is the shard group:
the world size, the ranks of a node for ``fsdp-hybrid`` (HYBRID_SHARD, a 2-D mesh), 1 for NO_SHARD. ``g``
is the bytes of a gathered element (``mixed_precision_param_dtype`` or the parameter's own). Per rank:

* **parameters, gradients, optimizer state** (traced storages): ``1/G`` each, padded to ``G`` (FSDP2 pads
  dim 0 of each parameter, FSDP1 each flat parameter); frozen parameters are sharded and have neither
  gradients nor state. ``offload_params`` (``CPUOffloadPolicy`` / ``CPUOffload(offload_params=True)``)
  moves all three to the host; ``offload_optimizer`` the optimizer state only.
* **gathered parameters** (added, forward to the optimizer step): with ``reshard_after_forward`` (FULL_SHARD,
  HYBRID_SHARD): the root's parameters (FSDP does not reshard the root after forward) plus two units'
  (the one running and the one prefetched); without it (SHARD_GRAD_OP): every parameter stays gathered
  from its forward to its backward.
* **reduce-scatter** (added, backward, from the first gradient the step produces): a unit's unsharded
  gradients and the reduce-scatter input they are copied into, in ``g`` bytes, for the largest trainable
  unit. They appear once the first unit's backward is done (its activations freed), not at the start of
  backward, where a transformer's step peaks.
* NO_SHARD all-reduces each unit's flat gradient in place: nothing changes but the collective.

``use_orig_params`` and FSDP1's flat parameters hold the same bytes; the trace's autocast copies of weights
stand for the gathered low-precision copies of a ``MixedPrecisionPolicy`` when the step is traced in
``*-mixed`` precision (which it should be whenever ``param_dtype`` is 16-bit).
"""

from __future__ import annotations

from collections.abc import Mapping

from memfit.categories import Category, Phase
from memfit.tracing.shard_log import Buffer, ModelFacts, RankPlan, shard_bytes
from memfit.tracing.sharding import ShardingConfig

__all__ = ["fsdp_rank_plan"]

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def fsdp_rank_plan(sharding: ShardingConfig, facts: ModelFacts, traced: Mapping[Category, int]) -> RankPlan:
    """One rank's ``RankPlan`` under an ``fsdp*`` strategy; ``traced``: the traced step's bytes per category."""
    group = sharding.shard_group_size
    h = facts.element_bytes
    g = _BYTES.get(sharding.mixed_precision_param_dtype or "", h)
    if sharding.strategy == "fsdp-no-shard" or group == 1:
        whole = {"parameters": traced.get(Category.PARAMETERS, 0), "gradients": traced.get(Category.GRADIENTS, 0),
                 "optimizer_state": traced.get(Category.OPTIMIZER_STATE, 0)}  # fmt: skip
        return RankPlan(sharding.strategy, sharding.world_size, terms=whole,
                        notes=("FSDP NO_SHARD: every rank holds everything",))  # fmt: skip
    on_host = sharding.offload_params

    def shard(size: int) -> int:
        return 0 if on_host else shard_bytes(size, group, h)

    def state(size: int) -> int:
        return 0 if on_host or sharding.offload_optimizer else shard_bytes(size, group, 4)

    units = facts.units
    largest = max((u.numel for u in units), default=0)
    reshard = sharding.reshard_after_forward and sharding.strategy != "fsdp-grad-op"
    gathered = (facts.root.numel + 2 * largest) * g if reshard and units else facts.numel * g
    gathered = min(gathered, facts.numel * g)
    reducing = max((u.trainable_numel for u in (*units, facts.root)), default=0)
    buffers = (
        Buffer("gathered parameters", gathered, Phase.FORWARD, end=Phase.OPTIMIZER),
        Buffer("reduce-scatter", 2 * reducing * g, Phase.BACKWARD, end=Phase.OPTIMIZER, after=Category.GRADIENTS),
    )
    params = shard_bytes(traced.get(Category.PARAMETERS, 0), group, h)
    grads = shard_bytes(traced.get(Category.GRADIENTS, 0), group, h)
    states = shard_bytes(traced.get(Category.OPTIMIZER_STATE, 0), group, 4)
    terms = {
        "parameters": 0 if on_host else params,
        "gradients": 0 if on_host else grads,
        "optimizer_state": 0 if on_host or sharding.offload_optimizer else states,
        "gathered_parameters": gathered,
    }
    host = (params + grads + states) if on_host else (states if sharding.offload_optimizer else 0)
    kind = "gathered per unit, resharded after forward" if reshard else "kept gathered from forward to backward"
    note = (
        f"FSDP over a shard group of {group}: {len(units)} block unit(s) + root, parameters {kind}"
        + (f", gathered in {sharding.mixed_precision_param_dtype}" if sharding.mixed_precision_param_dtype else "")
        + (", parameters, gradients and optimizer state on the host" if on_host else "")
    )
    return RankPlan(
        strategy=sharding.strategy,
        world_size=sharding.world_size,
        resize={Category.PARAMETERS: shard, Category.GRADIENTS: shard, Category.OPTIMIZER_STATE: state},
        buffers=buffers,
        step_temporaries=state,
        terms=terms,
        host_bytes=host,
        notes=(note,),
    )
