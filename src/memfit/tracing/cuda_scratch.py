"""Memory CUDA kernels allocate inside one op and free before it returns: scratch no tensor of the trace owns.

A fake tensor runs an op's shape function, not its kernel, so what a CUDA kernel allocates from the caching
allocator for itself never reaches the trace. For a CUDA target the recorder asks this module, op by op, which
scratch allocations the kernel makes and in which order around its outputs, and logs them (category
``temporaries``). Each model is read from the kernel's source in torch 2.13 and checked against allocator
snapshots of real steps (``benchmarks/results/gpu-truth/``):

* cuDNN convolutions' workspaces (``memfit.tracing.cudnn``);
* reductions split across thread blocks: a staging buffer and semaphores (``memfit.tracing.cuda_reductions``);
* embedding backward (``aten/src/ATen/native/cuda/Embedding.cu``, ``EmbeddingBackwardKernel.cu``): the indices
  sorted with their positions, segment offsets and counts, and a partial sum per index of the gradient row in
  the accumulation type (fp32 for a 16-bit gradient);
* cuDNN attention's backward: its graph's workspace, the query gradient accumulated in fp32.

The cuBLAS workspace, which a handle keeps for the whole run, is the recorder's own (``_CUBLAS_OPS``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from memfit.tracing.cuda_reductions import GridLimits, reduction_workspaces
from memfit.tracing.cudnn import conv_workspaces

__all__ = ["CudaTarget", "Scratch", "after_outputs", "before_outputs", "per_output"]

_aten = torch.ops.aten
_FEATURE_KERNEL_MAX_INDICES = 3072  # embedding_dense_backward_cuda: at most this many indices skip the sort


@dataclass(frozen=True)
class CudaTarget:
    """The GPU facts kernels size their scratch by."""

    compute_capability: tuple[int, int] = (9, 0)
    grid: GridLimits = field(default_factory=GridLimits)


@dataclass(frozen=True)
class Scratch:
    """Allocations and frees a kernel makes, in order: ``(name, bytes)`` allocates, ``(name, None)`` frees. A name
    allocated before the outputs may be freed after them."""

    steps: tuple[tuple[str, Any], ...]
    kind: str = "kernel scratch"  # what it is, for the estimate's notes

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.steps)


def before_outputs(func: Any, args: tuple[Any, ...], target: CudaTarget) -> Scratch | None:
    """Scratch the kernel allocates before its outputs (and may free before them too)."""
    if func is _aten.embedding_dense_backward.default:
        return _embedding_backward(args)[0]
    return None


def allocation_order(func: Any, outputs: list[Any]) -> list[Any]:
    """The op's outputs in the order its CUDA kernel allocates them, where that is not the order it returns them."""
    if func is _aten.native_dropout.default and len(outputs) == 2:
        return [outputs[1], outputs[0]]
    return outputs


def per_output(func: Any, args: tuple[Any, ...], out: Any, target: CudaTarget) -> dict[int, Scratch]:
    """Scratch the kernel allocates and frees right after one of its outputs, by ``id`` of that output."""
    found = conv_workspaces(func, args, out, target.compute_capability)
    return {
        key: Scratch((("workspace", size), ("workspace", None)), "cuDNN convolution workspace")
        for key, size in found.items()
    }


def after_outputs(func: Any, args: tuple[Any, ...], out: Any, target: CudaTarget) -> Scratch | None:
    """Scratch the kernel allocates after its outputs, and the frees of everything it still holds."""
    if func is _aten.embedding_dense_backward.default:
        return _embedding_backward(args)[1]
    if func is _aten._scaled_dot_product_cudnn_attention_backward.default:
        return _cudnn_attention_backward(args)
    staging = reduction_workspaces(func, args, out, target.grid)
    if staging is not None:
        buffer, semaphores = staging
        steps = (("buffer", buffer), ("semaphores", semaphores), ("semaphores", None), ("buffer", None))
        return Scratch(steps, "reduction staging buffer")
    return None


def _cudnn_attention_backward(args: tuple[Any, ...]) -> Scratch:
    """cuDNN's attention backward (``run_cudnn_SDP_bprop``, ``aten/src/ATen/native/cudnn/MHA.cpp``) runs with the
    workspace its graph asks for, allocated after dQ, dK and dV: the query gradient accumulated in fp32 and a row sum
    of ``dO * O`` per query position in fp32. Measured in ViT-Base's backward on an H100 (cuDNN 9.19): those two,
    within 256 bytes."""
    query = args[1]
    batch, heads, length, head_dim = (_expr(size) for size in query.shape)
    workspace = _plain(4 * batch * heads * length * head_dim + 4 * batch * heads * length)
    return Scratch((("workspace", workspace), ("workspace", None)), "cuDNN attention backward workspace")


def _embedding_backward(args: tuple[Any, ...]) -> tuple[Scratch | None, Scratch | None]:
    """``embedding_dense_backward_cuda``: up to 3072 indices (without ``scale_grad_by_freq``) go straight to a
    kernel; more are sorted (``radix_sort_pairs`` of the indices and their positions, whose temporary storage holds
    the other half of cub's double buffers), then ``embedding_backward_cuda_kernel`` makes segment offsets and
    counts and one partial sum of a gradient row per index, and frees them all as it returns."""
    grad, indices = args[0], args[1]
    scale_grad_by_freq = bool(args[4]) if len(args) > 4 else False
    count = _expr(indices.numel())
    if scale_grad_by_freq:
        sorted_path: Any = sympy.Integer(1)
    elif count.is_number:
        if int(count) <= _FEATURE_KERNEL_MAX_INDICES:
            return None, None
        sorted_path = sympy.Integer(1)
    else:  # a symbolic batch: the sort happens at the batch sizes whose index count exceeds 3072
        sorted_path = sympy.Piecewise((0, count <= _FEATURE_KERNEL_MAX_INDICES), (1, True))
    index = _plain(sorted_path * count * indices.element_size())
    width = int(grad.shape[-1])
    accumulate = 4 if grad.dtype in (torch.float16, torch.bfloat16, torch.float32) else grad.element_size()
    before = (
        ("sorted_indices", index),
        ("orig_indices", index),
        ("range", index),
        ("sort_storage", _plain(2 * index)),  # cub's alternate key and value buffers
        ("sort_storage", None),
        ("range", None),
    )
    after = (
        ("segment_offsets", index),
        ("num_of_segments", _plain(8 * sorted_path)),
        ("partials_per_segment", index),
        ("partials_per_segment_offset", index),
        ("num_of_partial_segments", _plain(8 * sorted_path)),
        ("partial_segment_offset", index),
        ("grad_weight_per_segment", _plain(sorted_path * count * width * accumulate)),
        ("grad_weight_per_segment", None),
        ("partial_segment_offset", None),
        ("num_of_partial_segments", None),
        ("partials_per_segment_offset", None),
        ("partials_per_segment", None),
        ("num_of_segments", None),
        ("segment_offsets", None),
        ("orig_indices", None),
        ("sorted_indices", None),
    )
    return Scratch(before, "embedding backward sort"), Scratch(after, "embedding backward sort")


def _expr(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return sympy.Integer(int(expr)) if expr.is_number else expr
    return sympy.Integer(size)


def _plain(expr: Any) -> Any:
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_number else expr
