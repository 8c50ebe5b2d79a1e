"""How a step is sharded across ranks: the one settings object FSDP, ZeRO and the CLI share.

A sharded run splits parameters, gradients and optimizer state across the ranks of a shard group,
so what one rank holds depends on the strategy, the group's size and what is offloaded to the host.
``ShardingConfig`` names those choices with the vocabulary of the frameworks that make them
(``torch.distributed.fsdp``'s ``fully_shard`` and ``ShardingStrategy``, DeepSpeed's ZeRO stages and
their ``zero_optimization`` options), so adapters only translate, and the trace reads one object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from memfit.errors import InvalidInputError

__all__ = ["STRATEGIES", "ShardingConfig", "ShardingStrategy"]

ShardingStrategy = Literal[
    "ddp",  # every rank holds everything; DDP's buckets (memfit.DDPConfig) on top
    "fsdp",  # FSDP2 fully_shard / FSDP1 FULL_SHARD: parameters, gradients, optimizer state sharded
    "fsdp-grad-op",  # FSDP1 SHARD_GRAD_OP (FSDP2: reshard_after_forward=False): parameters stay gathered
    "fsdp-hybrid",  # FSDP1 HYBRID_SHARD / FSDP2 2-D mesh: sharded within a node, replicated across nodes
    "fsdp-no-shard",  # FSDP1 NO_SHARD: DDP-like
    "zero1",  # DeepSpeed ZeRO stage 1: optimizer state sharded
    "zero2",  # ZeRO stage 2: + gradients sharded
    "zero3",  # ZeRO stage 3: + parameters sharded
]
STRATEGIES: tuple[str, ...] = get_args(ShardingStrategy)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class ShardingConfig:
    """A sharded (or replicated) data-parallel run, as one rank sees it.

    Attributes:
        strategy: one of ``STRATEGIES``.
        world_size: ranks in the job (all nodes).
        gpus_per_node: ranks per node; decides the shard group of ``"fsdp-hybrid"`` and the host RAM
            per node for offload. Default: ``world_size`` (one node).
        offload_optimizer: optimizer state (and its step) lives on the host (FSDP ``CPUOffload`` /
            ``CPUOffloadPolicy``, ZeRO ``offload_optimizer``).
        offload_params: parameters live on the host between uses (FSDP CPU offload, ZeRO-3 ``offload_param``).
        reshard_after_forward: FSDP frees gathered parameters after each unit's forward.
        mixed_precision_param_dtype: FSDP ``MixedPrecisionPolicy(param_dtype=...)`` / ``MixedPrecision``
            as a dtype name (``"bfloat16"``, ``"float16"``), or ``None`` for the parameters' own dtype.
        reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size,
        stage3_max_live_parameters, stage3_param_persistence_threshold: DeepSpeed ``zero_optimization``
            options, in elements as DeepSpeed counts them; ``None`` is DeepSpeed's default.
        overlap_comm: DeepSpeed's double-buffered reduce buckets; ``None`` is its default (on for stage 3).
    """

    strategy: ShardingStrategy
    world_size: int
    gpus_per_node: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    reshard_after_forward: bool = True
    mixed_precision_param_dtype: str | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_param_persistence_threshold: int | None = None
    overlap_comm: bool | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidInputError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        for name in ("world_size", "gpus_per_node"):
            value = getattr(self, name)
            if value is None and name == "gpus_per_node":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
        nodes_per = self.gpus_per_node
        if nodes_per is not None and self.world_size % nodes_per:
            raise InvalidInputError(f"world_size ({self.world_size}) must be a multiple of gpus_per_node ({nodes_per})")
        for name in (
            "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters", "stage3_param_persistence_threshold",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidInputError(f"{name} must be a non-negative number of elements or None, got {value!r}")
        if self.overlap_comm is not None and not isinstance(self.overlap_comm, bool):
            raise InvalidInputError(f"overlap_comm must be True, False or None, got {self.overlap_comm!r}")
        dtype = self.mixed_precision_param_dtype
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        dtype = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        object.__setattr__(self, "mixed_precision_param_dtype", dtype)
        if dtype is not None and dtype not in ("bfloat16", "float16", "float32"):
            raise InvalidInputError(
                f"mixed_precision_param_dtype must be 'bfloat16', 'float16', 'float32' or None, got {dtype!r}"
            )
        for name in ("offload_optimizer", "offload_params", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.offload_params and self.strategy not in ("fsdp", "fsdp-grad-op", "fsdp-hybrid", "zero3"):
            raise InvalidInputError(
                f"offload_params needs sharded parameters (fsdp or zero3), got strategy {self.strategy!r}; "
                "offload the optimizer instead"
            )
        if self.offload_optimizer and self.strategy in ("ddp", "fsdp-no-shard"):
            raise InvalidInputError(
                f"offload_optimizer needs a sharded strategy (fsdp*, zero1/2/3), got {self.strategy!r}"
            )

    @property
    def nodes(self) -> int:
        """Nodes in the job."""
        return self.world_size // (self.gpus_per_node or self.world_size)

    @property
    def shard_group_size(self) -> int:
        """Ranks that split one copy of the sharded states between them."""
        if self.strategy in ("ddp", "fsdp-no-shard"):
            return 1
        if self.strategy == "fsdp-hybrid":
            return self.gpus_per_node or self.world_size
        return self.world_size

    @property
    def is_zero(self) -> bool:
        return self.strategy.startswith("zero")

    @property
    def is_fsdp(self) -> bool:
        return self.strategy.startswith("fsdp")

    def describe(self) -> str:
        """``"per rank of 8, zero3 (offload optimizer)"``: what an estimate of one rank says it is."""
        extras = [name for name, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
        nodes = f", {self.nodes} nodes x {self.gpus_per_node}" if self.nodes > 1 else ""
        offload = f" (offload {' and '.join(extras)})" if extras else ""
        return f"per rank of {self.world_size}{nodes}, {self.strategy}{offload}"
