"""The staging buffer CUDA's reduction kernels take when they split one reduction across thread blocks.

``gpu_reduce_kernel`` (``aten/src/ATen/native/cuda/Reduce.cuh``, shipped in torch's wheel under ``torch/include``)
sums a long reduction in several thread blocks per output when there are few outputs and many values each
(``setReduceConfig``: ``ctas_per_output`` > 1), and then allocates, from the caching allocator, a buffer of the
blocks' partial results and an ``int`` semaphore per block column, freed as the kernel returns. A linear layer's
bias gradient, ``grad.sum(0)`` over batch x sequence rows, is the common case: in ViT-Base at batch 32 on an H100
each 3072-wide bias gradient took a 132 MiB buffer (``benchmarks/results/gpu-truth/snapshot-vit-*``), exactly the
size :func:`staging_bytes` computes. The launch geometry depends on the GPU's multiprocessor count and threads
per multiprocessor, so the buffer does too.

Handled: ``sum`` and ``mean`` (``sum_functor``, ``MeanOps``) of one contiguous input, as TensorIterator lays it out
(reduced dimensions first, then coalesced). Known limitations: other reductions (``amax``, ``var``, norms) and
inputs over 2**31 elements (split into 32-bit-indexable pieces) are not modelled.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch

__all__ = ["GridLimits", "ReductionStaging", "reduction_workspaces", "staging_bytes"]

_aten = torch.ops.aten
_MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (not complex double)
_WARP = 32
_MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD = 16, 256


@dataclass(frozen=True)
class GridLimits:
    """What a kernel's launch geometry reads from ``cudaDeviceProp``."""

    multiprocessors: int = 132  # an H100 SXM
    max_threads_per_multiprocessor: int = 2048


def staging_bytes(
    inputs_per_output: int,
    num_outputs: int,
    *,
    on_fastest_dim: bool,
    input_vec_size: int,
    accumulate_bytes: int,
    limits: GridLimits,
) -> tuple[int, int]:
    """``(buffer, semaphores)`` bytes ``gpu_reduce_kernel`` allocates for one reduction, ``(0, 0)`` when it needs none.

    A port of ``setReduceConfig`` for a reduction TensorIterator has coalesced to one reduced and at most one kept
    dimension: ``on_fastest_dim`` is ``reduction_on_fastest_striding_dimension``; both dimensions are contiguous, so
    the input is vectorized along it when it reduces 128 values or more, and along the outputs otherwise, 4 at a
    time, halved until the vector divides the output count (``get_output_vec_size``, the data pointer aligned as the
    caching allocator aligns it). An input of 2**31 elements or more runs in 32-bit-indexable pieces, each with its
    own buffer, which this does not model (``(0, 0)``).
    """
    if inputs_per_output <= 0 or num_outputs <= 0 or inputs_per_output * num_outputs > 2**31 - 1:
        return 0, 0
    output_vec_size = 1
    if on_fastest_dim:
        dim0, dim1 = inputs_per_output, num_outputs
        if dim0 >= 128:
            dim0 //= input_vec_size
    else:
        output_vec_size = 4
        while num_outputs % output_vec_size:
            output_vec_size //= 2
        dim0, dim1 = num_outputs // output_vec_size, inputs_per_output
    # set_block_dimension
    max_threads = _MAX_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, _WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    if on_fastest_dim:  # split the input across the lanes of a warp (block_x_reduce), else the outputs
        step_input *= block_width
    else:
        step_output *= block_width
    split_across_warps = _div_up(inputs_per_output, step_input) >= min(block_height * 16, _MAX_VALUES_PER_THREAD)
    if split_across_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    target_grid_size = limits.multiprocessors * (limits.max_threads_per_multiprocessor // num_threads)
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    values_per_thread = _div_up(inputs_per_output, step_input)
    if not (split_across_warps and values_per_thread >= _MAX_VALUES_PER_THREAD and grid_x <= target_grid_size):
        return 0, 0
    ctas = max(
        min(_div_up(target_grid_size, grid_x), _div_up(values_per_thread, _MIN_VALUES_PER_THREAD)),
        _div_up(values_per_thread, _MAX_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return 0, 0
    buffer = accumulate_bytes * num_outputs * ctas
    if not on_fastest_dim:
        buffer *= block_width * output_vec_size
    return buffer, 4 * grid_x


class ReductionStaging(sympy.Function):
    """:func:`staging_bytes` of the buffer (``part`` 0) or the semaphores (``part`` 1) as a sympy expression, so that
    a trace with the batch symbolic sizes them at any batch: it evaluates once its sizes are numbers. Its arguments
    are ``part, inputs_per_output, num_outputs, on_fastest_dim, input_vec_size, accumulate_bytes, multiprocessors,
    max_threads_per_multiprocessor``."""

    @classmethod
    def eval(cls, *args: Any) -> Any:
        if not all(isinstance(value, sympy.Integer) for value in args):
            return None
        part, inputs, outputs, fastest, input_vec, accumulate, multiprocessors, threads = (int(v) for v in args)
        sizes = staging_bytes(
            inputs,
            outputs,
            on_fastest_dim=bool(fastest),
            input_vec_size=input_vec,
            accumulate_bytes=accumulate,
            limits=GridLimits(multiprocessors, threads),
        )
        return sympy.Integer(sizes[part])


def reduction_workspaces(func: Any, args: tuple[Any, ...], out: Any, limits: GridLimits) -> tuple[Any, Any] | None:
    """``(buffer, semaphores)`` sizes (bytes, or expressions in a symbolic batch) a ``sum``/``mean`` call allocates on
    CUDA after its output, or ``None`` when it certainly allocates nothing or is not one this models."""
    if func not in _REDUCTIONS or not isinstance(out, torch.Tensor):
        return None
    input = args[0]
    if not isinstance(input, torch.Tensor) or not input.is_floating_point() or not input.is_contiguous():
        return None
    layout = _iteration_layout(input, _reduced_dims(func, args, input.dim()))
    if layout is None:
        return None
    reduced, kept, on_fastest = layout
    is_sum = func in (_aten.sum.dim_IntList, _aten.sum.default)
    input_vec_size = 8 if is_sum and input.element_size() == 2 else 4  # sum_functor's 16-bit case, else vt0
    accumulate = 8 if input.dtype == torch.float64 else 4  # opmath: float for 16-bit and fp32 inputs
    flags = (int(on_fastest), input_vec_size, accumulate, limits.multiprocessors, limits.max_threads_per_multiprocessor)
    buffer = ReductionStaging(0, reduced, kept, *flags)
    if buffer == 0:
        return None
    return _plain(buffer), _plain(ReductionStaging(1, reduced, kept, *flags))


_REDUCTIONS = frozenset({_aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim, _aten.mean.default})


def _reduced_dims(func: Any, args: tuple[Any, ...], ndim: int) -> set[int]:
    if func in (_aten.sum.default, _aten.mean.default) or len(args) < 2 or not args[1]:
        return set(range(ndim))
    return {d % ndim for d in args[1]}


def _iteration_layout(input: torch.Tensor, dims: set[int]) -> tuple[Any, Any, bool] | None:
    """TensorIterator's view of a reduction of a contiguous input, ``(values per output, outputs, on the fastest
    dimension)``, where it coalesces to one reduced and at most one kept dimension; ``None`` otherwise.

    ``reorder_dimensions`` puts the reduced dimensions first, each group from its fastest-striding dimension, and
    ``coalesce_dimensions`` merges neighbours in memory: a group is one iteration dimension when its dimensions are
    adjacent in memory. Dimensions of size 1 drop out (a symbolic one is taken as larger).
    """
    sizes = [_expr(s) for s in input.shape]
    present = [d for d in range(input.dim()) if not (sizes[d].is_number and int(sizes[d]) == 1)]
    reduced_dims = [d for d in present if d in dims]
    kept_dims = [d for d in present if d not in dims]
    if not reduced_dims or not _one_run(reduced_dims) or not _one_run(kept_dims):
        return None
    reduced = math.prod((sizes[d] for d in reduced_dims), start=sympy.Integer(1))
    kept = math.prod((sizes[d] for d in kept_dims), start=sympy.Integer(1))
    on_fastest = not kept_dims or reduced_dims[-1] > kept_dims[-1]
    return reduced, kept, on_fastest


def _one_run(dims: list[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(dims))


def _expr(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return sympy.Integer(int(expr)) if expr.is_number else expr
    return sympy.Integer(size)


def _plain(expr: Any) -> Any:
    return int(expr) if isinstance(expr, sympy.Integer) else expr


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)
