"""Read the frameworks' own sharding vocabulary into a ``ShardingConfig``: a DeepSpeed config (the
``ds_config`` dict or JSON file) and ``torch.distributed.fsdp.ShardingStrategy`` names.

Lightning's ``DeepSpeedStrategy`` and the Hugging Face Trainer both hand DeepSpeed one config in
DeepSpeed's own vocabulary (``zero_optimization.stage``, ``offload_optimizer.device``, bucket sizes
in elements), so both adapters translate through this one function. It reads the config as
DeepSpeed's ``DeepSpeedZeroConfig`` does (missing keys take DeepSpeed's defaults, ``None`` here)
and refuses, with ``ShardingNotModelledError``, what memfit's per-rank model does not cover:
tensor parallelism (``tensor_parallel.autotp_size``), ZeRO++ (quantized weights or gradients,
hierarchical partitions) and MiCS shard groups.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.errors import InvalidInputError, ShardingNotModelledError
from memfit.tracing.sharding import ShardingConfig

__all__ = ["BUCKET_KEYS", "FSDP1_STRATEGIES", "load_deepspeed_config", "sharding_from_deepspeed"]

# torch.distributed.fsdp.ShardingStrategy names -> (ShardingConfig.strategy, reshard_after_forward)
FSDP1_STRATEGIES = {
    "FULL_SHARD": ("fsdp", True),
    "SHARD_GRAD_OP": ("fsdp-grad-op", False),
    "HYBRID_SHARD": ("fsdp-hybrid", True),
    "_HYBRID_SHARD_ZERO2": ("fsdp-hybrid", False),
    "NO_SHARD": ("fsdp-no-shard", True),
}

# zero_optimization options ShardingConfig carries, in elements as DeepSpeed counts them
BUCKET_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_param_persistence_threshold",
)
_OFFLOADED = ("cpu", "nvme")


def load_deepspeed_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The config as a dict: a mapping as it is, a path read as JSON."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise InvalidInputError(f"DeepSpeed config {str(config)!r} is not a file; pass a dict or a JSON file path")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise InvalidInputError(f"DeepSpeed config {str(config)!r} is not valid JSON ({error})") from error
    raise InvalidInputError(f"a DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}")


def sharding_from_deepspeed(
    config: Mapping[str, Any] | str | Path,
    *,
    world_size: int,
    gpus_per_node: int | None = None,
    auto: Mapping[str, int] | None = None,
) -> ShardingConfig:
    """The ``ShardingConfig`` one rank of a DeepSpeed run sees.

    Args:
        config: the DeepSpeed config (dict or JSON path).
        world_size, gpus_per_node: the job's ranks, and ranks per node.
        auto: values for options left ``"auto"`` (the Hugging Face integration fills them from the
            model's hidden size); an ``"auto"`` without one takes DeepSpeed's default.

    Raises:
        ShardingNotModelledError: the config asks for tensor parallelism, ZeRO++ or MiCS.
    """
    config = load_deepspeed_config(config)
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise InvalidInputError(f"zero_optimization must be a dict in a DeepSpeed config, got {zero!r}")
    _refuse_unmodelled(config, zero)
    stage = _number(zero.get("stage", 0), "zero_optimization.stage")
    if stage not in (0, 1, 2, 3):
        raise InvalidInputError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}")
    strategy = "ddp" if stage == 0 else f"zero{stage}"
    options = {key: _bucket(zero, key, auto) for key in BUCKET_KEYS}
    overlap = zero.get("overlap_comm")
    if overlap is not None and not isinstance(overlap, bool):
        raise InvalidInputError(f"zero_optimization.overlap_comm must be true or false, got {overlap!r}")
    return ShardingConfig(
        strategy=strategy,  # type: ignore[arg-type]
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        offload_optimizer=stage > 0 and _device(zero, "offload_optimizer") in _OFFLOADED,
        offload_params=stage == 3 and _device(zero, "offload_param") in _OFFLOADED,
        overlap_comm=overlap,
        **options,
    )


def _refuse_unmodelled(config: Mapping[str, Any], zero: Mapping[str, Any]) -> None:
    tensor_parallel = config.get("tensor_parallel") or {}
    size = tensor_parallel.get("autotp_size", 1) if isinstance(tensor_parallel, Mapping) else 1
    if isinstance(size, int) and size > 1:
        raise ShardingNotModelledError(f"DeepSpeed tensor parallelism (tensor_parallel.autotp_size={size})")
    zero_pp = [key for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                               "zero_quantized_gradients") if zero.get(key)]  # fmt: skip
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, int) and hpz > 1:
        zero_pp.append(f"zero_hpz_partition_size={hpz}")
    if zero_pp:
        raise ShardingNotModelledError(f"DeepSpeed ZeRO++ ({', '.join(zero_pp)})")
    mics = zero.get("mics_shard_size", -1)
    if isinstance(mics, int) and mics > 0:
        raise ShardingNotModelledError(f"DeepSpeed MiCS (zero_optimization.mics_shard_size={mics})")


def _device(zero: Mapping[str, Any], key: str) -> str:
    section = zero.get(key)
    if not section:
        return "none"
    if not isinstance(section, Mapping):
        raise InvalidInputError(f"zero_optimization.{key} must be a dict with a 'device', got {section!r}")
    return str(section.get("device", "none")).lower()


def _bucket(zero: Mapping[str, Any], key: str, auto: Mapping[str, int] | None) -> int | None:
    value = zero.get(key)
    if value is None:
        return None
    if value == "auto":
        return (auto or {}).get(key)
    return _number(value, f"zero_optimization.{key}")


def _number(value: Any, name: str) -> int:
    """DeepSpeed configs write sizes as ints or floats (``5e8``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise InvalidInputError(f"{name} must be a non-negative whole number, got {value!r}")
    return int(value)
