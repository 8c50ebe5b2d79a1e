"""What each byte of a training step is for."""

from __future__ import annotations

from enum import Enum

__all__ = ["Category", "Phase"]


class Category(str, Enum):
    """Role of a block of device memory at a moment of the step.

    ``RUNTIME`` is memory outside the tensors: the CUDA context, and caching-allocator
    rounding and fragmentation (reserved minus allocated). ``GRADIENT_BUCKETS`` are the flat
    buffers ``DistributedDataParallel`` all-reduces gradients in.
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    GRADIENT_BUCKETS = "gradient_buckets"
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
