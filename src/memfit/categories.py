"""What each byte of a training step is for."""

from __future__ import annotations

from enum import Enum

__all__ = ["Category", "Phase"]


class Category(str, Enum):
    """Role of a block of device memory at a moment of the step.

    ``RUNTIME`` is memory outside the tensors: the CUDA context, and caching-allocator
    rounding and fragmentation (reserved minus allocated). ``GRADIENT_BUCKETS`` are the flat
    buffers ``DistributedDataParallel`` all-reduces gradients in. ``SHARDING_BUFFERS`` are what a sharded
    run (FSDP, ZeRO) holds besides its shards: gathered parameters, reduce-scatter and bucket buffers, the
    fp32 master weights and gradient partitions of a 16-bit run.
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    GRADIENT_BUCKETS = "gradient_buckets"
    SHARDING_BUFFERS = "sharding_buffers"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    WORKSPACE = "workspace"


class Phase(str, Enum):
    """Part of a training step."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
