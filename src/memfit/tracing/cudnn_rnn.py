"""cuDNN's recurrent kernels (LSTM, GRU, tanh/ReLU RNN), as a CUDA training step runs them: the allocations of
``_cudnn_rnn`` and ``_cudnn_rnn_backward``.

On CUDA, ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``at::lstm`` / ``at::gru`` / ``at::rnn_tanh`` /
``at::rnn_relu``, which run cuDNN (``_cudnn_impl``, ``aten/src/ATen/native/cudnn/RNN.cpp``). Neither trace path can
run it: a CPU-only torch computes the RNN step by step in the trace's dtype and keeps every step's gates, and
``_cudnn_rnn``'s fake kernel (``torch/_meta_registrations.py``) returns a 0-byte reserve space and the weight buffer
it was given. So a trace for a CUDA target runs this shape-only stand-in instead, which allocates and frees what
torch 2.11 and cuDNN 9.19 do, in their order:

* Under autocast, ``_cudnn_rnn_cast_reflatten`` (``aten/src/ATen/cudnn/AutocastRNN.cpp``) copies the fp32 weights into
  one new **fp16** flat buffer on every call (fp16 whatever the autocast dtype, bf16 too; no autocast cache), then
  casts ``cx`` (LSTM), ``hx`` and the input to fp16 (right to left, as the call's arguments are evaluated); the fp32
  ``hx``/``cx`` zeros that the module made are then dropped. Backward casts the fp16 flat gradient back, one fp32
  copy per weight, last weight first. Without autocast the weights are already one flat buffer
  (``flatten_parameters`` when the module moved to the GPU) and are used in place.
* ``_cudnn_rnn``: the input made sequence-major (``input.transpose(0, 1).contiguous()``: a copy when
  ``batch_first``), the output (returned as a batch-first view of sequence-major storage), ``hy``, ``cy`` (LSTM),
  then the workspace and the reserve space (``cudnnGetRNNTempSpaceSizes``); the workspace and the copy are freed as
  it returns. Autograd keeps the (cast) input, ``hx``, ``cx``, the output, the reserve and the weight buffer.
* ``_cudnn_rnn_backward``: zeros for the missing ``hy``/``cy`` gradients; ``_cudnn_rnn_backward_input`` copies
  the input and the output gradient sequence-major (no copy when they already are), allocates ``dx``, ``dhx``,
  ``dcx`` and the workspace; ``_cudnn_rnn_backward_weight`` copies the input again, allocates the flat weight
  gradient (``at::zeros``, whose slices become the parameters' gradients) and the workspace once more. ``dx`` is a
  batch-first view of sequence-major storage, so a leaf input's gradient is cloned into its layout.

The two cuDNN sizes come from a closed library. They were read off 107 shapes measured on an H100 (torch 2.11, cuDNN
9.19; ``benchmarks/gpu_cudnn_rnn.py``, ``benchmarks/results/gpu-truth/h100-2026-11-27/cudnn_rnn.json.gz``: LSTM, GRU
and tanh RNN; fp32 and fp16/bf16 autocast; batch N 1-64, steps T 1-512, input I 64-2048, hidden H 128-2048, layers
L 1-4, one or two directions D, batch- or sequence-first). With e the element size of the RNN's dtype:

* reserve = N T H D e ((k + 1) L - 1) + 256 bytes, with k = 5 for the LSTM (4 gates and the cell state), 6 for the
  GRU and 1 for the RNN (its activation): k H-wide values per step, sample, layer and direction, and the hidden
  output of every layer but the last (whose output is ``y`` itself). Exact, to the byte, on all 107 shapes.
* LSTM workspace = 8 MiB L D + the weight matrices (biases left out) + N T I e + (9 D - 4) N T H e
  + (10 L + [L = 1]) N H e (one direction; 24 L N H e with two) + 8 N rounded up to 32 + 256 bytes: 8 MiB per
  layer and direction, a copy of the weights, one sequence-long input, five H-wide sequence-long buffers (fourteen
  with two directions) and a few H-wide states per layer. To the byte on 28 of the 56 LSTM shapes, all with one
  direction, H >= 1000, 32 <= T <= 128 and I <= H. Elsewhere cuDNN sizes it otherwise (read off the single-field
  variations of the base shape N 8, T 128, I = H = 1024, L 2): T <= 16 takes 2 N H e more, T = 257 4 N H e less and
  T = 512 14.4 MiB less (the sequence term stops growing linearly); I = 2048 > H 5.6 MiB more; H = 768, 512, 256
  0.2, 2.8 and 5.4 MiB more (linear in H below about 785); two directions at H <= 640 up to 25 MiB more. The
  formula is within 5% on 45 of the 56 shapes, at worst 16 MiB under and 14.4 MiB over.
* GRU and RNN workspace: no formula holds across the grid. At the base shape both take the same workspace,
  4.45 N T H e where the LSTM takes 5; the stand-in uses the LSTM's form with four sequence-long buffers (eleven
  with two directions), which is within 5% on 20 of the 28 GRU and 18 of the 23 RNN shapes and under by at
  most 22.5 MiB (GRU) and 8.2 MiB (RNN), at small H, where cuDNN takes more.

What bounds the error: the workspace lives only while a kernel runs, and the step's peak is in the backward-weight
kernel, so an error in it moves the peak byte for byte.

Dropout between layers (``dropout > 0`` in training; 64 more shapes, ``cudnn_rnn-workspace.json.gz``): the reserve
space holds its mask, one bit per value of each layer's output but the last (exact on all six dropout shapes). The
workspace then grows by N T H e for the LSTM (exact on both; the stand-in adds it), by 2.0-2.5 MiB for the GRU
(left out) and not at all for the RNN, at the base shape.

Known limitations: packed sequences and projections (``proj_size``) keep the trace's own kernels. cuDNN's dropout
state (``cudnnDropoutGetStatesSize``, allocated once per process at the first RNN with dropout) is left out: the one
card measured, an H100 with 132 multiprocessors, took 6,488,064 bytes, and how that size scales with a card is
unknown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "CudnnRNNs",
    "cudnn_rnn",
    "cudnn_rnn_mode",
    "flatten_rnn_weights",
    "reserve_bytes",
    "workspace_bytes",
]

_MiB = 2**20
# torch's function name -> (gates, what the reserve space keeps per step, sample, layer and direction, in H widths)
_MODES = {"lstm": (4, 5), "gru": (3, 6), "rnn_tanh": (1, 1), "rnn_relu": (1, 1)}


def cudnn_rnn_mode(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str | None:
    """``"lstm"``, ``"gru"``, ``"rnn_tanh"`` or ``"rnn_relu"`` when ``func(*args)`` is that torch function on a
    padded (not packed) batch, without projections, that this module stands in for; ``None`` otherwise."""
    mode = getattr(func, "__name__", "")
    if mode not in _MODES or kwargs or len(args) != 9:
        return None
    input, hx, params = args[:3]
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        return None
    states = tuple(hx) if mode == "lstm" and isinstance(hx, (list, tuple)) else (hx,)
    if len(states) != (2 if mode == "lstm" else 1) or not all(isinstance(s, torch.Tensor) for s in states):
        return None
    if not isinstance(params, (list, tuple)) or len(params) < 2:
        return None
    if not all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in params):
        return None
    hidden = states[0].shape[-1]
    if any(s.shape[-1] != hidden for s in states) or params[1].shape != (_MODES[mode][0] * hidden, hidden):
        return None  # projections: w_hh is (gates H, P)
    return mode


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


def reserve_bytes(
    batch: Any,
    steps: Any,
    hidden: int,
    layers: int,
    directions: int,
    element: int,
    mode: str = "lstm",
    dropout: bool = False,
) -> Any:
    """cuDNN's reserve space: per step, sample, layer and direction what backward needs of the gates (5 H-wide
    values for the LSTM, 6 for the GRU, 1 for the RNN), and the hidden output of every layer but the last; with
    dropout between layers, also its mask, one bit per value of every layer's output but the last."""
    kept = _MODES[mode][1]
    mask = batch * steps * hidden * directions * (layers - 1) // 8 if dropout else 0
    return batch * steps * hidden * directions * element * ((kept + 1) * layers - 1) + mask + 256


def workspace_bytes(
    batch: Any,
    steps: Any,
    input_size: int,
    hidden: int,
    layers: int,
    directions: int,
    element: int,
    mode: str = "lstm",
    dropout: bool = False,
) -> Any:
    """cuDNN's training workspace (``cudnnGetRNNTempSpaceSizes``, forward and both backward kernels alike); an
    LSTM with dropout between layers takes one more sequence-long buffer of a layer's output."""
    gates = _MODES[mode][0]
    widths = [input_size] + [hidden * directions] * (layers - 1)
    weights = sum(gates * hidden * (width + hidden) * directions for width in widths)
    buffers = 5 if mode == "lstm" else 4
    sequence = (buffers * directions + (buffers - 1) * (directions - 1)) * batch * steps * hidden * element
    if dropout and mode == "lstm" and layers > 1:
        sequence += batch * steps * hidden * directions * element
    states = (10 * layers + (layers == 1) if directions == 1 else 24 * layers) * batch * hidden * element
    per_sample = -(-8 * batch // 32) * 32 if isinstance(batch, int) else 8 * batch
    return (
        8 * _MiB * layers * directions
        + weights * element
        + batch * steps * input_size * element
        + sequence
        + states
        + per_sample
        + 256
    )


def cudnn_rnn(
    mode: str,
    input: torch.Tensor,
    hx: torch.Tensor | Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    *,
    autocast: bool,
) -> tuple[torch.Tensor, ...]:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``'s result, allocated as cuDNN allocates it
    (``autocast``: inside ``torch.autocast("cuda")``): ``(output, hy, cy)`` for the LSTM, ``(output, hy)`` else."""
    weights = list(params)
    states = list(hx) if mode == "lstm" else [hx]
    layout = (mode, has_biases, num_layers, bidirectional, batch_first, train, train and dropout > 0)
    half = autocast and weights[0].dtype != torch.float16 and weights[0].dtype != torch.float64
    if half:
        flat = _FlatCast.apply(*weights)
        states = [_cast(state) for state in reversed(states)][::-1]  # arguments evaluated right to left
        input = _cast(input)
        outputs = _CudnnRNN.apply(layout, input, *states, flat)
    else:
        outputs = _CudnnRNN.apply(layout, input, *states, None, *weights)
    return tuple(outputs)


def _cast(tensor: torch.Tensor) -> torch.Tensor:
    eligible = tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float64)
    return tensor.to(torch.float16) if eligible else tensor


class _FlatCast(torch.autograd.Function):
    """``copy_weights_to_flat_buf_views`` under autocast: every weight copied into one new fp16 buffer. In
    backward each weight's copy node casts its slice of the flat gradient, the last weight first."""

    @staticmethod
    def forward(ctx: Any, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        total = sum(w.numel() for w in weights)
        return weights[0].new_empty(total, dtype=torch.float16)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        offsets, offset = [], 0
        for shape, _dtype in ctx.shapes:
            offsets.append(offset)
            offset += shape.numel()
        grads: list[Any] = [None] * len(ctx.shapes)
        for index in reversed(range(len(ctx.shapes))):
            shape, dtype = ctx.shapes[index]
            start = offsets[index]
            grads[index] = grad[start : start + shape.numel()].view(shape).to(dtype)
        return tuple(grads)


class _CudnnRNN(torch.autograd.Function):
    """``_cudnn_rnn`` and ``_cudnn_rnn_backward`` (``aten/src/ATen/native/cudnn/RNN.cpp``), shape only. The states
    are ``hx`` and, for the LSTM, ``cx``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, layout: tuple[str, bool, int, bool, bool, bool, bool], input: torch.Tensor, *rest: Any
    ) -> tuple[torch.Tensor, ...]:
        mode, _has_biases, layers, bidirectional, batch_first, train, dropout = layout
        count = 2 if mode == "lstm" else 1
        states: list[torch.Tensor] = list(rest[:count])
        flat: torch.Tensor | None = rest[count]
        weights: tuple[torch.Tensor, ...] = rest[count + 1 :]
        ctx.set_materialize_grads(False)
        directions = 2 if bidirectional else 1
        hidden = states[0].shape[-1]
        seq_major = input.transpose(0, 1) if batch_first else input
        steps, batch, input_size = seq_major.shape
        element = input.element_size()
        x = seq_major.contiguous()
        output = input.new_empty((steps, batch, hidden * directions))
        finals = [state.new_empty(state.shape) for state in states]
        sizes = (batch, steps, input_size, hidden, layers, directions, element)
        workspace = input.new_empty(workspace_bytes(*sizes, mode=mode, dropout=dropout), dtype=torch.uint8)
        reserve_size = reserve_bytes(batch, steps, hidden, layers, directions, element, mode, dropout) if train else 0
        reserve = input.new_empty(reserve_size, dtype=torch.uint8)
        del workspace, x
        if batch_first:
            output = output.transpose(0, 1)
        ctx.layout, ctx.sizes, ctx.count = layout, sizes, count
        ctx.weights = [(w.shape, w.dtype) for w in weights]
        ctx.flat_numel = flat.numel() if flat is not None else sum(w.numel() for w in weights)
        ctx.flat_dtype = flat.dtype if flat is not None else (weights[0].dtype if weights else input.dtype)
        ctx.save_for_backward(*states, input, output, reserve, flat)
        return (output, *finals)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None, *grad_finals: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        *states, input, output, _reserve, flat = ctx.saved_tensors
        mode, _has_biases, _layers, _bidirectional, batch_first, _train, dropout = ctx.layout
        if grad_output is None:
            grad_output = torch.zeros_like(output)
        grads = [torch.zeros_like(s) if g is None else g for s, g in zip(states, grad_finals, strict=True)]

        def seq_major(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.transpose(0, 1) if batch_first else tensor

        # _cudnn_rnn_backward_input
        x = seq_major(input).contiguous()
        dy = seq_major(grad_output).contiguous()
        dx = input.new_empty(seq_major(input).shape)
        _dfinals = [g.contiguous() for g in grads]  # held, with the zeros, until the backward returns
        dstates = [s.new_empty(s.shape) for s in states]
        workspace = input.new_empty(workspace_bytes(*ctx.sizes, mode=mode, dropout=dropout), dtype=torch.uint8)
        del workspace, dy, x
        if batch_first:
            dx = dx.transpose(0, 1)
        # _cudnn_rnn_backward_weight: the flat gradient, whose slices are the weights' gradients
        x = seq_major(input).contiguous()
        dw = input.new_zeros(ctx.flat_numel, dtype=ctx.flat_dtype)
        workspace = input.new_empty(workspace_bytes(*ctx.sizes, mode=mode, dropout=dropout), dtype=torch.uint8)
        del workspace, x
        if flat is not None:
            return (None, dx, *dstates, dw, *[None] * len(ctx.weights))
        weight_grads, offset = [], 0
        for shape, _dtype in ctx.weights:
            weight_grads.append(dw[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return (None, dx, *dstates, None, *weight_grads)


class CudnnRNNs(TorchFunctionMode):
    """Run ``torch.lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu`` as cuDNN does (``cudnn_rnn``) on fake CUDA
    tensors, under the real ``torch.autocast``. ``calls`` counts the RNNs so run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @contextlib.contextmanager
    def again(self) -> Iterator[None]:
        """The mode once more, for checkpointing's recomputation, which runs in backward outside it."""
        with self:
            yield

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        mode = cudnn_rnn_mode(func, args, kwargs)
        if mode is not None:
            self.calls += 1
            return cudnn_rnn(mode, *args, autocast=torch.is_autocast_enabled("cuda"))
        return func(*args, **(kwargs or {}))
