"""cuDNN's convolution workspaces: device memory a convolution takes for its duration and no tensor owns.

Without ``cudnn.benchmark`` torch runs the first engine cuDNN's heuristics rank for a convolution
(``aten/src/ATen/native/cudnn/Conv_v8.cpp``: ``get_plans_from_heuristics`` then ``try_plans``) and allocates
that engine's workspace from the caching allocator right after the output, freeing it as the kernel returns.
On tensor-core GPUs, for tensors in the default NCHW layout, the engines cuDNN ranks first transform the
operands to NHWC inside that workspace: it holds the input, the output and the filter of the convolution being
run. Measured on an H100 (torch 2.11, cuDNN 9.19; ``benchmarks/results/gpu-truth/snapshot-resnet-*``): every
64-channel 3x3 convolution of a ResNet, forward, backward-data and backward-weight, fp32 (TF32) and bf16 alike,
took a workspace of those three operands' bytes, within 0.02 % (backward-weight adds split partial sums of the
filter gradient, about 1 %, which this model leaves out).

Known limitations: convolutions whose channels do not fill a tensor-core tile (an RGB stem with 3 input
channels), grouped, depthwise and transposed convolutions, and channels-last tensors run other engines, whose
workspaces are not modelled (none is added); ``cudnn.benchmark=True`` chooses engines by timing, whatever
their workspace.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["conv_workspaces"]

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def conv_workspaces(
    func: Any, args: tuple[Any, ...], out: Any, compute_capability: tuple[int, int] = (9, 0)
) -> dict[int, Any]:
    """The workspace each output of a convolution op was computed with, by ``id`` of the output tensor.

    ``func`` and ``args`` are the aten op and its arguments as dispatch sees them, ``out`` its result; sizes are
    bytes (or, under a symbolic batch, expressions in it). Empty for any other op, or a convolution cuDNN runs
    without an NHWC transform.
    """
    if func is _aten.convolution.default:
        input, weight, _bias, _stride, _padding, _dilation, transposed, _output_padding, groups = args[:9]
        if not _transforms_layout(input, weight, transposed, groups, compute_capability):
            return {}
        return {id(out): _nbytes(input) + _nbytes(out) + _nbytes(weight)}
    if func is _aten.convolution_backward.default:
        grad_output, input, weight = args[:3]
        transposed, groups, output_mask = args[7], args[9], args[10]
        if not _transforms_layout(input, weight, transposed, groups, compute_capability):
            return {}
        grad_input, grad_weight, _grad_bias = out
        operands = _nbytes(grad_output) + _nbytes(input) + _nbytes(weight)
        found = {}
        if output_mask[0] and grad_input is not None:
            found[id(grad_input)] = operands
        if output_mask[1] and grad_weight is not None:
            found[id(grad_weight)] = operands
        return found
    return {}


def _transforms_layout(
    input: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int, capability: tuple[int, int]
) -> bool:
    """A dense 2-D or 3-D convolution on NCHW tensors whose channels fill a tensor-core tile: 8 channels in
    fp16/bf16 (tensor cores from sm70, bf16 from sm80), 4 in fp32, which cuDNN runs as TF32 from sm80
    (``torch.backends.cudnn.allow_tf32``, on by default)."""
    if transposed or groups != 1 or input.dim() not in (4, 5) or not input.is_contiguous():
        return False
    out_channels, in_channels = weight.shape[0], weight.shape[1]
    if input.dtype in _HALF:
        tile = 8
        usable = capability >= ((8, 0) if input.dtype == torch.bfloat16 else (7, 0))
    elif input.dtype == torch.float32:
        tile, usable = 4, capability >= (8, 0)
    else:
        return False
    return usable and in_channels % tile == 0 and out_channels % tile == 0


def _nbytes(tensor: torch.Tensor) -> Any:
    size = tensor.numel() * tensor.element_size()
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else expr
    return size
