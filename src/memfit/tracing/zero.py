"""DeepSpeed ZeRO stages 1, 2 and 3 as one rank sees them, applied to the traced single-process step.

Checked against ``deepspeed/runtime/zero/{config,stage_1_and_2,stage3}.py`` of DeepSpeed 0.19.8. ``N`` is the
data-parallel world size, ``T`` the trainable elements, ``P`` all elements, ``h`` the bytes of a traced
parameter element (2 when DeepSpeed runs the model in bf16/fp16, its ``bf16``/``fp16`` sections, which memfit
traces as ``*-true``: DeepSpeed converts the module, it does not autocast). Every term, per rank:

* **parameters** (traced storages): full for stages 1 and 2; stage 3 keeps ``1/N`` of each parameter (its
  ``ds_tensor``) and whole copies of those of at most ``stage3_param_persistence_threshold`` elements (default
  1e5), whose partition also stays on the device (``partition_parameters.py``); ``offload_param`` moves the
  other partitions to the host.
* **gradients** (traced storages): full for stage 1; ``1/N`` for stages 2 and 3 (the 16-bit partition each
  rank owns, ``averaged_gradients`` / ``grad_partitions_flat_buffer``); none on the device with
  ``offload_optimizer`` in stages 2 and 3 (they are copied to pinned host buffers from the reduce bucket).
* **optimizer state** (traced storages): ``1/N``, always fp32 (a 16-bit trace's states are scaled by ``4/h``);
  on the host with ``offload_optimizer``.
* **fp32 master weights** (added, kept): ``4 T / N`` (``single_partition_of_fp32_groups`` /
  ``fp32_partitioned_groups_flat``; DeepSpeed clones the partition to fp32 even in an fp32 run); on the
  host with ``offload_optimizer``.
* **fp32 gradient partition** (added, optimizer phase): ``4 T / N`` in stages 1 and 2 (the flattened partition
  handed to the optimizer), ``4 min(sub_group_size, T / N)`` in stage 3 (``_prepare_fp32_grad_for_sub_group``).
* **reduce buckets** (added, kept): ``reduce_bucket_size`` elements (default 5e8), fp32 in stage 1 (its
  accumulator), ``h`` bytes in stages 2 and 3, twice with ``overlap_comm`` (default: on for stage 3 only);
  allocated whole whatever the model's size, stage 1/2 at the first backward, stage 3 at start.
* **gathered parameters** (added, forward and backward, stage 3): ``min(stage3_max_live_parameters, partitioned
  elements, largest module + stage3_prefetch_bucket_size)`` elements of ``h`` bytes: the module running and
  what is prefetched for the next ones.
* ``allgather_bucket_size`` adds nothing in stages 1 and 2: the updated partitions are gathered in place into
  the flat 16-bit groups the parameters are views of.

Model states sum, for full fine-tuning in 16-bit with Adam: stage 2 ``2 P + 18 P / N`` (DeepSpeed's
``estimate_zero2_model_states_mem_needs``); stage 3 ``20 P / N`` plus the gathered parameters, where
DeepSpeed's ``estimate_zero3_model_states_mem_needs`` counts ``18 P / N + 4 x largest layer`` (it leaves out
the 16-bit parameter partition). Frozen parameters (LoRA) have no gradients, state or master copy here;
DeepSpeed's estimators count every parameter (DeepSpeed #5304).

Host RAM per rank with ``offload_optimizer``: master weights, optimizer state and the pinned fp32 gradient
partition; with ``offload_param`` also the parameter partitions. Not modelled: the 16-bit copies of
DeepSpeed's pinned swap buffers, NVMe offload, ZeRO++ (hpZ, qwZ), and the fragmentation of the reduce bucket
copies.
"""

from __future__ import annotations

from collections.abc import Mapping

from memfit.categories import Category, Phase
from memfit.tracing.shard_log import Buffer, ModelFacts, RankPlan, shard_bytes
from memfit.tracing.sharding import ShardingConfig

__all__ = ["DEEPSPEED_DEFAULTS", "zero_rank_plan"]

# deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig field defaults, 0.19.8)
DEEPSPEED_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "sub_group_size": 1_000_000_000,
}
_FP32 = 4


def option(sharding: ShardingConfig, name: str) -> int:
    """A ``zero_optimization`` option: the config's, or DeepSpeed's default."""
    value = getattr(sharding, name, None)
    return DEEPSPEED_DEFAULTS[name] if value is None else int(value)


def zero_rank_plan(sharding: ShardingConfig, facts: ModelFacts, traced: Mapping[Category, int]) -> RankPlan:
    """One rank's ``RankPlan`` under ``sharding`` (a ``zero*`` strategy); ``traced`` is the traced step's largest
    bytes per category (the host RAM of offloaded state is read from it)."""
    stage = int(sharding.strategy[-1])
    n, h = sharding.world_size, facts.element_bytes
    trainable, offload = facts.trainable_numel, sharding.offload_optimizer
    state_scale = _FP32 / h  # DeepSpeed's optimizer state is fp32 whatever the model runs in
    threshold = option(sharding, "stage3_param_persistence_threshold")

    def parameter(size: int) -> int:
        if stage < 3:
            return size
        if size // h <= threshold:  # kept whole, and its partition (``ds_tensor``) on the device too
            return size + shard_bytes(size, n, h)
        return 0 if sharding.offload_params else shard_bytes(size, n, h)

    def gradient(size: int) -> int:
        if stage < 2:
            return size
        return 0 if offload else shard_bytes(size, n, h)

    def state(size: int) -> int:
        return 0 if offload else shard_bytes(round(size * state_scale), n, _FP32)

    master = shard_bytes(trainable * _FP32, n, _FP32)
    partition = trainable * _FP32 // n if stage < 3 else min(option(sharding, "sub_group_size"), trainable // n) * _FP32
    overlap = sharding.overlap_comm if sharding.overlap_comm is not None else stage == 3
    bucket = option(sharding, "reduce_bucket_size") * (_FP32 if stage == 1 else h)
    buffers = [Buffer("reduce buckets", bucket, Phase.FORWARD if stage == 3 else Phase.BACKWARD, persistent=True)]
    if overlap:
        buffers.append(Buffer("reduce buckets", bucket, buffers[0].start, persistent=True))
    if not offload:
        buffers.append(Buffer("fp32 master weights", master, Phase.FORWARD, persistent=True))
        buffers.append(Buffer("fp32 gradient partition", partition, Phase.OPTIMIZER))
    gathered = 0
    if stage == 3:
        partitioned = facts.numel - facts.persistent_numel(threshold)
        live = min(
            option(sharding, "stage3_max_live_parameters"),
            partitioned,
            facts.largest_module_numel + option(sharding, "stage3_prefetch_bucket_size"),
        )
        gathered = live * h
        buffers.append(Buffer("gathered parameters", gathered, Phase.FORWARD, end=Phase.OPTIMIZER))
    params_bytes = traced.get(Category.PARAMETERS, 0)
    grads_bytes = traced.get(Category.GRADIENTS, 0)
    state_bytes = traced.get(Category.OPTIMIZER_STATE, 0)
    persistent = facts.persistent_numel(threshold) * h if stage == 3 else 0
    terms = {
        "parameters": params_bytes if stage < 3 else persistent + shard_bytes(params_bytes, n, h),
        "gradients": grads_bytes if stage < 2 else shard_bytes(grads_bytes, n, h),
        "optimizer_state": shard_bytes(round(state_bytes * state_scale), n, _FP32),
        "fp32_master_weights": master,
        "fp32_gradient_partition": partition,
    }
    host = 0
    if offload:
        host += terms["optimizer_state"] + master + trainable * _FP32 // n  # pinned fp32 gradient partition
        if stage >= 2:
            terms["gradients"] = 0
        terms["optimizer_state"] = terms["fp32_master_weights"] = terms["fp32_gradient_partition"] = 0
    if sharding.offload_params:
        partitions = shard_bytes(params_bytes - persistent, n, h)
        host += partitions
        terms["parameters"] -= partitions
    notes = [
        f"ZeRO-{stage}: {_describe(stage, offload, sharding.offload_params)}; reduce buckets "
        f"{option(sharding, 'reduce_bucket_size'):,} elements x{2 if overlap else 1}"
        + (f", {gathered // h:,} elements gathered at most" if stage == 3 else "")
    ]
    return RankPlan(
        strategy=sharding.strategy,
        world_size=n,
        resize={Category.PARAMETERS: parameter, Category.GRADIENTS: gradient, Category.OPTIMIZER_STATE: state},
        buffers=tuple(buffers),
        step_temporaries=state,
        terms=terms,
        host_bytes=host,
        notes=tuple(notes),
    )


def _describe(stage: int, offload_optimizer: bool, offload_params: bool) -> str:
    sharded = ["optimizer state", "gradients", "parameters"][:stage]
    text = ", ".join(sharded) + " partitioned"
    if offload_optimizer:
        text += ", optimizer state and fp32 master weights on the host"
    if offload_params:
        text += ", parameter partitions on the host"
    return text
