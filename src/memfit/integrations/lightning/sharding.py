"""Read a Lightning strategy into the ``RunLayout`` memfit plans one rank with: a ``ShardingConfig`` and the
data-parallel size the effective batch is counted over.

Translation only: ``FSDPStrategy`` (FSDP1: ``sharding_strategy``, ``cpu_offload``, mixed precision,
``auto_wrap_policy``, activation checkpointing), ``ModelParallelStrategy`` (FSDP2 ``fully_shard``
over the data-parallel dimension of its device mesh) and ``DeepSpeedStrategy`` (its ZeRO config,
read by ``memfit.tracing.sharding_sources``). DDP and single-device strategies shard nothing
(``sharding=None``; DDP keeps its ``DDPConfig``). What memfit cannot model per rank raises
``ShardingNotModelledError`` naming it. Lightning privates go through ``LightningInternals``.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import InvalidInputError, ShardingNotModelledError
from memfit.integrations.lightning.internals import LightningInternals
from memfit.run.port import RunLayout
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.sharding_sources import FSDP1_STRATEGIES, sharding_from_deepspeed

__all__ = ["SHARDING_STRATEGIES", "sharding_strategy_name", "strategy_layout"]

SHARDING_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


def sharding_strategy_name(strategy: Any, internals: LightningInternals) -> str | None:
    """The class name of a strategy whose ranks share the model's state (so every forward runs collectives),
    else ``None``."""
    kinds = tuple(
        getattr(internals.pl.strategies, n) for n in SHARDING_STRATEGIES if hasattr(internals.pl.strategies, n)
    )
    return type(strategy).__name__ if isinstance(strategy, kinds) else None


def strategy_layout(trainer: Any, internals: LightningInternals) -> RunLayout:
    """The layout of ``trainer.strategy`` (called in a callback's ``setup``, after the strategy set up
    its environment, before ``configure_model`` shards anything).

    Raises:
        ShardingNotModelledError: tensor parallelism, or a DeepSpeed config memfit cannot model.
    """
    strategy, strategies = trainer.strategy, internals.pl.strategies
    name = type(strategy).__name__
    world_size, per_node = int(trainer.world_size), int(trainer.num_devices) or 1
    per_node = per_node if world_size % per_node == 0 else world_size
    deepspeed = getattr(strategies, "DeepSpeedStrategy", None)
    if deepspeed is not None and isinstance(strategy, deepspeed):  # before DDP: it subclasses DDPStrategy
        config = getattr(strategy, "config", None) or {}
        try:
            sharding = sharding_from_deepspeed(config, world_size=world_size, gpus_per_node=per_node)
        except ShardingNotModelledError as error:
            raise ShardingNotModelledError(f"{error} in {name}") from error
        return RunLayout(sharding, name, world_size)
    fsdp = getattr(strategies, "FSDPStrategy", None)
    if fsdp is not None and isinstance(strategy, fsdp):
        return _fsdp1(strategy, name, world_size, per_node, internals)
    model_parallel = getattr(strategies, "ModelParallelStrategy", None)
    if model_parallel is not None and isinstance(strategy, model_parallel):
        return _fsdp2(strategy, name, world_size, per_node)
    return RunLayout(None, name, world_size)


def _fsdp1(strategy: Any, name: str, world_size: int, per_node: int, internals: LightningInternals) -> RunLayout:
    kind = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy)).upper()
    if kind not in FSDP1_STRATEGIES:
        raise ShardingNotModelledError(f"FSDP sharding_strategy {kind} in {name}")
    sharded, reshard = FSDP1_STRATEGIES[kind]
    shard_group = per_node
    mesh = (getattr(strategy, "kwargs", None) or {}).get("device_mesh")
    if sharded == "fsdp-hybrid" and mesh is not None:  # (replicas, shard size) or a 2-D DeviceMesh
        shard_group = int(mesh[1]) if isinstance(mesh, tuple) else int(mesh.size(1))
    offload = bool(getattr(strategy.cpu_offload, "offload_params", False))
    mixed = strategy.mixed_precision_config
    param_dtype = getattr(mixed, "param_dtype", None)
    notes = []
    if (strategy.kwargs or {}).get("auto_wrap_policy") is None:
        notes.append(f"{name} has no auto_wrap_policy, so FSDP gathers every parameter at once; memfit models its "
                     "units at the repeated blocks, so this rank's gathered parameters are predicted low")  # fmt: skip
    checkpointing, blocks = internals.fsdp_checkpointing(strategy)
    try:
        sharding = ShardingConfig(
            strategy=sharded,  # type: ignore[arg-type]
            world_size=world_size,
            gpus_per_node=shard_group if sharded == "fsdp-hybrid" else per_node,
            offload_optimizer=offload and sharded != "fsdp-no-shard",  # FSDP1 steps offloaded parameters on the host
            offload_params=offload and sharded != "fsdp-no-shard",
            reshard_after_forward=reshard,
            mixed_precision_param_dtype=_dtype_name(param_dtype),
        )
    except InvalidInputError as error:
        raise ShardingNotModelledError(f"{name} with {kind} ({error})") from error
    units = internals.fsdp_wrap_classes(strategy)
    return RunLayout(sharding, name, world_size, checkpointing, blocks, units, tuple(notes))


def _fsdp2(strategy: Any, name: str, world_size: int, per_node: int) -> RunLayout:
    mesh = strategy.device_mesh  # set up in setup_environment, before callbacks' setup
    data_parallel, tensor_parallel = mesh["data_parallel"].size(), mesh["tensor_parallel"].size()
    if tensor_parallel > 1:
        raise ShardingNotModelledError(
            f"tensor parallelism ({name} with tensor_parallel_size={tensor_parallel}, data_parallel_size="
            f"{data_parallel}; on one node it defaults to tensor parallelism across all devices)"
        )
    note = (
        f"{name}: planned as fully_shard over the data-parallel dimension ({data_parallel} ranks) with its defaults "
        "(reshard_after_forward=True, the trainer's precision, no offload), as configure_model usually applies it"
    )
    per_node = per_node if data_parallel % per_node == 0 else data_parallel
    sharding = ShardingConfig("fsdp", world_size=data_parallel, gpus_per_node=per_node)
    return RunLayout(sharding, name, data_parallel, notes=(note,))


def _dtype_name(dtype: Any) -> str | None:
    """A 16-bit ``param_dtype`` by name; ``None`` for float32 (what Lightning's 32-bit plugins set) or none."""
    if not isinstance(dtype, torch.dtype) or dtype == torch.float32:
        return None
    return str(dtype).removeprefix("torch.")
