"""cuDNN's LSTM, as a CUDA training step runs it: the allocations of ``_cudnn_rnn`` and ``_cudnn_rnn_backward``.

On CUDA, ``nn.LSTM`` calls ``at::lstm``, which runs cuDNN (``_cudnn_impl``, ``aten/src/ATen/native/cudnn/RNN.cpp``).
Neither trace path can run it: a CPU-only torch computes the LSTM step by step in the trace's dtype and keeps every
step's gates, and ``_cudnn_rnn``'s fake kernel (``torch/_meta_registrations.py``) returns a 0-byte reserve space
and the weight buffer it was given. So a trace for a CUDA target runs this shape-only stand-in instead, which
allocates and frees what torch 2.11 and cuDNN 9.19 do, in their order:

* Under autocast, ``_cudnn_rnn_cast_reflatten`` (``aten/src/ATen/cudnn/AutocastRNN.cpp``) copies the fp32 weights into
  one new **fp16** flat buffer on every call (fp16 whatever the autocast dtype, bf16 too; no autocast cache), then
  casts ``cx``, ``hx`` and the input to fp16 (right to left, as the call's arguments are evaluated). Backward
  gives each fp32 weight its own fp32 copy of its slice of the flat gradient. Without autocast the weights are
  already one flat buffer (``flatten_parameters`` when the module moved to the GPU) and are used in place.
* ``_cudnn_rnn``: the input made sequence-major (``input.transpose(0, 1).contiguous()``: a copy when
  ``batch_first``), the output (returned as a batch-first view of sequence-major storage), ``hy``, ``cy``, then
  the workspace and the reserve space (``cudnnGetRNNTempSpaceSizes``); the workspace and the copy are freed as
  it returns. Autograd keeps the (cast) input, ``hx``, ``cx``, the output, the reserve and the weight buffer.
* ``_cudnn_rnn_backward``: zeros for the missing ``hy``/``cy`` gradients; ``_cudnn_rnn_backward_input`` copies
  the input and the output gradient sequence-major, allocates ``dx``, ``dhx``, ``dcx`` and the workspace;
  ``_cudnn_rnn_backward_weight`` copies the input again, allocates the flat weight gradient (``at::zeros``,
  whose slices become the parameters' gradients) and the workspace once more.

The two cuDNN sizes come from a closed library. Measured in four H200 allocator snapshots (cuDNN 9.19; an LSTM of
2 layers, hidden and input 1024, 128 steps; fp16 at batch 16 and 32, fp32 at 8 and 16;
``benchmarks/results/gpu-truth/h200-2026-11-27/snapshot-lstm-*``), to the byte:

* reserve = N T H e (5 L + (L - 1)) + 256 bytes: per step, sample and layer the four gates and the cell state, and
  the hidden output of every layer but the last (whose output is ``y`` itself);
* workspace = 16 MiB + the weight matrices (biases left out) + 6 N T H e + 20 N H e + 8 N + 256 bytes, with N the
  batch, T the steps, H the hidden size, L the layers and e the element size of the RNN's dtype.

Which of T, L and H the workspace's fixed 16 MiB, its six sequence-long buffers and its 20 H-wide ones per sample
scale with is not told apart by those snapshots (all have T = 128, H = 1024, L = 2): other shapes extrapolate.
What bounds it: the workspace lives only while a kernel runs, and the step's peak is in the backward-weight kernel,
so an error in it moves the peak byte for byte.

Known limitations: GRU and plain RNNs, packed sequences, projections (``proj_size``) and bidirectional LSTMs are not
measured (bidirectional ones scale the H-wide terms by two directions; the others keep the trace's own kernels);
cuDNN's dropout state between layers (allocated once per process) is left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["CudnnLSTMs", "cudnn_lstm", "flatten_rnn_weights", "is_cudnn_lstm", "reserve_bytes", "workspace_bytes"]

_MiB = 2**20
_GATES = 4  # CUDNN_LSTM


def is_cudnn_lstm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``func(*args)`` is ``torch.lstm`` on a padded (not packed) batch that this module stands in for."""
    if getattr(func, "__name__", "") != "lstm" or kwargs or len(args) != 9:
        return False
    input, hx, params = args[:3]
    if not isinstance(input, torch.Tensor) or input.dim() != 3 or not isinstance(hx, (list, tuple)) or len(hx) != 2:
        return False
    if not params or not all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in params):
        return False
    hidden = hx[0].shape[-1]
    return hx[1].shape[-1] == hidden and params[1].shape[-1] == hidden  # no projections: w_hh is (4H, H)


def flatten_rnn_weights(model: nn.Module, track: Callable[[torch.Tensor], Any]) -> int:
    """Put each RNN module's weights in one buffer, as moving the module to a GPU does: ``RNNBase._apply`` calls
    ``flatten_parameters``, whose ``_cudnn_rnn_flatten_weight`` allocates the flat buffer after the weights were
    copied to the GPU one by one and points every weight into it, so the separate copies are freed (their blocks
    stay cached). ``track`` registers the flat buffer as parameters. Returns how many modules were flattened."""
    flattened = 0
    for module in model.modules():
        if not isinstance(module, nn.RNNBase):
            continue
        weights = [w for w in module._flat_weights if isinstance(w, torch.Tensor)]
        if len(weights) != len(module._flat_weights) or not weights:
            continue
        dtype = weights[0].dtype
        storages = {w.untyped_storage()._cdata for w in weights}
        if not dtype.is_floating_point or any(w.dtype != dtype for w in weights) or len(storages) != len(weights):
            continue
        with torch.no_grad():
            flat = weights[0].new_empty(sum(w.numel() for w in weights))
            track(flat)
            offset = 0
            for weight in weights:
                weight.set_(flat[offset : offset + weight.numel()].view_as(weight))
                offset += weight.numel()
        flattened += 1
    return flattened


def reserve_bytes(batch: Any, steps: Any, hidden: int, layers: int, directions: int, element: int) -> Any:
    """cuDNN's LSTM reserve space: the gates and cell state of every step and layer, and the hidden output of every
    layer but the last."""
    per_position = hidden * directions * element * ((_GATES + 1) * layers + (layers - 1))
    return batch * steps * per_position + 256


def workspace_bytes(
    batch: Any, steps: Any, input_size: int, hidden: int, layers: int, directions: int, element: int
) -> Any:
    """cuDNN's LSTM training workspace (``cudnnGetRNNTempSpaceSizes``, forward and both backward kernels alike)."""
    weights = sum(
        _GATES * hidden * (width + hidden) * directions for width in [input_size] + [hidden * directions] * (layers - 1)
    )
    width = hidden * directions * element
    return 16 * _MiB + weights * element + 6 * batch * steps * width + 20 * batch * width + 8 * batch + 256


def cudnn_lstm(
    input: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    *,
    autocast: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.lstm``'s result, allocated as cuDNN allocates it (``autocast``: inside ``torch.autocast("cuda")``)."""
    weights = list(params)
    h0, c0 = hx
    layout = (has_biases, num_layers, bidirectional, batch_first, train)
    half = autocast and weights[0].dtype != torch.float16 and weights[0].dtype != torch.float64
    if half:
        flat = _FlatCast.apply(*weights)
        c0 = _cast(c0)  # cached_cast(kHalf, ...): arguments evaluated right to left
        h0 = _cast(h0)
        input = _cast(input)
        output, hy, cy = _CudnnLSTM.apply(layout, input, h0, c0, flat)
    else:
        output, hy, cy = _CudnnLSTM.apply(layout, input, h0, c0, None, *weights)
    return output, hy, cy


def _cast(tensor: torch.Tensor) -> torch.Tensor:
    eligible = tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float64)
    return tensor.to(torch.float16) if eligible else tensor


class _FlatCast(torch.autograd.Function):
    """``copy_weights_to_flat_buf_views`` under autocast: every weight copied into one new fp16 buffer."""

    @staticmethod
    def forward(ctx: Any, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        total = sum(w.numel() for w in weights)
        return weights[0].new_empty(total, dtype=torch.float16)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grads, offset = [], 0
        for shape, dtype in ctx.shapes:
            size = shape.numel()
            grads.append(grad[offset : offset + size].view(shape).to(dtype))
            offset += size
        return tuple(grads)


class _CudnnLSTM(torch.autograd.Function):
    """``_cudnn_rnn`` and ``_cudnn_rnn_backward`` (``aten/src/ATen/native/cudnn/RNN.cpp``), shape only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        layout: tuple[bool, int, bool, bool, bool],
        input: torch.Tensor,
        hx: torch.Tensor,
        cx: torch.Tensor,
        flat: torch.Tensor | None,
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _has_biases, layers, bidirectional, batch_first, train = layout
        ctx.set_materialize_grads(False)
        directions = 2 if bidirectional else 1
        hidden = hx.shape[-1]
        seq_major = input.transpose(0, 1) if batch_first else input
        steps, batch, input_size = seq_major.shape
        element = input.element_size()
        x = seq_major.contiguous()
        output = input.new_empty((steps, batch, hidden * directions))
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape)
        sizes = (batch, steps, input_size, hidden, layers, directions, element)
        workspace = input.new_empty(workspace_bytes(*sizes), dtype=torch.uint8)
        reserve = input.new_empty(reserve_bytes(batch, steps, hidden, layers, directions, element) if train else 0,
                                  dtype=torch.uint8)  # fmt: skip
        del workspace, x
        if batch_first:
            output = output.transpose(0, 1)
        ctx.layout, ctx.sizes, ctx.weights = layout, sizes, [(w.shape, w.dtype) for w in weights]
        ctx.flat_numel = flat.numel() if flat is not None else sum(w.numel() for w in weights)
        ctx.flat_dtype = flat.dtype if flat is not None else (weights[0].dtype if weights else input.dtype)
        ctx.save_for_backward(input, hx, cx, output, reserve, flat)
        return output, hy, cy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor | None, grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None
    ) -> tuple[Any, ...]:
        input, hx, cx, output, _reserve, flat = ctx.saved_tensors
        _has_biases, _layers, _bidirectional, batch_first, _train = ctx.layout
        if grad_output is None:
            grad_output = torch.zeros_like(output)
        grad_hy = torch.zeros_like(hx) if grad_hy is None else grad_hy
        grad_cy = torch.zeros_like(cx) if grad_cy is None else grad_cy

        def seq_major(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.transpose(0, 1) if batch_first else tensor

        # _cudnn_rnn_backward_input
        x = seq_major(input).contiguous()
        dy = seq_major(grad_output).contiguous()
        dx = input.new_empty(seq_major(input).shape)
        dhy, dcy = grad_hy.contiguous(), grad_cy.contiguous()
        dhx, dcx = hx.new_empty(hx.shape), cx.new_empty(cx.shape)
        workspace = input.new_empty(workspace_bytes(*ctx.sizes), dtype=torch.uint8)
        del workspace, dy, x, dhy, dcy
        if batch_first:
            dx = dx.transpose(0, 1)
        # _cudnn_rnn_backward_weight: the flat gradient, whose slices are the weights' gradients
        x = seq_major(input).contiguous()
        dw = input.new_zeros(ctx.flat_numel, dtype=ctx.flat_dtype)
        workspace = input.new_empty(workspace_bytes(*ctx.sizes), dtype=torch.uint8)
        del workspace, x
        if flat is not None:
            return (None, dx, dhx, dcx, dw, *[None] * len(ctx.weights))
        grads, offset = [], 0
        for shape, _dtype in ctx.weights:
            grads.append(dw[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return (None, dx, dhx, dcx, None, *grads)


class CudnnLSTMs(TorchFunctionMode):
    """Run ``torch.lstm`` as cuDNN does (``cudnn_lstm``) on fake CUDA tensors, under the real ``torch.autocast``.
    ``calls`` counts the LSTMs so run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @contextlib.contextmanager
    def again(self) -> Iterator[None]:
        """The mode once more, for checkpointing's recomputation, which runs in backward outside it."""
        with self:
            yield

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if is_cudnn_lstm(func, args, kwargs):
            self.calls += 1
            return cudnn_lstm(*args, autocast=torch.is_autocast_enabled("cuda"))
        return func(*args, **(kwargs or {}))
