"""Read what the Trainer will shard into one rank's ``ShardingConfig``.

Translation only (the reads of transformers' and accelerate's state live in ``internals``):
``fsdp``/``fsdp_config`` (FSDP2 ``reshard_after_forward``, FSDP1 ``full_shard``, ``shard_grad_op``,
``hybrid_shard``, ``no_shard``; ``offload``; ``activation_checkpointing``), a DeepSpeed config
(``deepspeed=`` as a dict or JSON path, or ``accelerate launch --use_deepspeed``; ``"auto"`` bucket
sizes filled in from the model as the Trainer fills them), and what accelerate will actually run:
it applies FSDP only across several GPU-type processes, so ``fsdp=`` under ``torchrun`` on CPU
runs DDP, and that is what is planned then, with a note.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import InvalidInputError, ShardingNotModelledError
from memfit.integrations.huggingface import internals
from memfit.run.port import RunLayout
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.sharding_sources import FSDP1_STRATEGIES, sharding_from_deepspeed

__all__ = ["RunLayout", "run_layout"]

_HALF = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def run_layout(args: Any, model: Any, *, precision: str = "fp32", elsewhere_on_gpus: bool = False) -> RunLayout:
    """The layout one rank of this run will have.

    Args:
        args: the ``TrainingArguments``.
        model: the model (DeepSpeed's ``"auto"`` bucket sizes follow its hidden size).
        precision: the run's precision (``memfit.integrations.huggingface.arguments.run_precision``):
            accelerate gives FSDP a 16-bit ``param_dtype`` under bf16/fp16 mixed precision.
        elsewhere_on_gpus: the plan is for a run on GPUs, not on this machine (``budget="h100"`` on a
            machine without one): the requested FSDP or DeepSpeed applies there as configured.

    Raises:
        ShardingNotModelledError: a DeepSpeed config with tensor parallelism, ZeRO++ or MiCS.
    """
    wants_deepspeed, wants_fsdp = internals.deepspeed_requested(args), internals.fsdp_requested(args)
    if not (wants_deepspeed or wants_fsdp):
        return RunLayout()
    kind = internals.distributed_type(args)
    world, per_node = internals.world_size(args), internals.local_world_size(args)
    if wants_deepspeed:
        if kind != "DEEPSPEED" and not elsewhere_on_gpus:
            note = (f"deepspeed is set, but accelerate runs this process as {kind} (DeepSpeed runs on "
                    "accelerators only, not with use_cpu): planned without DeepSpeed")  # fmt: skip
            return RunLayout(notes=(note,))
        config = internals.deepspeed_config(args) or {}
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        auto = internals.deepspeed_auto_values(model, zero3=stage == 3)
        sharding = sharding_from_deepspeed(config, world_size=world, gpus_per_node=per_node, auto=auto)
        return RunLayout(sharding, data_parallel_size=sharding.world_size)
    if not internals.fsdp_applies(kind) and not elsewhere_on_gpus:
        runs = "DDP" if world > 1 else "one process"
        return RunLayout(notes=(f"fsdp is set, but accelerate applies FSDP only across several GPU processes; this "
                                f"run ({kind}) runs {runs}, and that is what is planned",))  # fmt: skip
    options = internals.fsdp_options(args)
    if options["fsdp_version"] == 2:
        reshard = bool(options["reshard_after_forward"])
        strategy, shard_group = ("fsdp" if reshard else "fsdp-grad-op"), per_node
    else:
        name = options["sharding"]
        if name not in FSDP1_STRATEGIES:
            raise ShardingNotModelledError(f"FSDP sharding strategy {name}")
        strategy, reshard = FSDP1_STRATEGIES[name]
        shard_group = per_node
    offload = options["cpu_offload"] and strategy != "fsdp-no-shard"
    notes = []
    if options["auto_wrap_policy"] == "NO_WRAP":
        notes.append("FSDP auto_wrap_policy NO_WRAP gathers every parameter at once; memfit models its units at "
                     "the repeated blocks, so this rank's gathered parameters are predicted low")  # fmt: skip
    try:
        sharding = ShardingConfig(
            strategy=strategy,  # type: ignore[arg-type]
            world_size=world,
            gpus_per_node=shard_group,
            offload_optimizer=offload,  # FSDP's CPU offload steps the optimizer on the host
            offload_params=offload,
            reshard_after_forward=reshard,
            mixed_precision_param_dtype=_HALF.get(precision),
        )
    except InvalidInputError as error:
        raise ShardingNotModelledError(f"FSDP {strategy} ({error})") from error
    return RunLayout(sharding, data_parallel_size=world, checkpointing=bool(options["activation_checkpointing"]),
                     notes=tuple(notes), units=options["wrap_classes"])  # fmt: skip
