"""CUDA behaviour that a CPU-only torch does not have, substituted while tracing for a GPU.

On a machine whose torch cannot create (fake) CUDA tensors, memfit traces on fake CPU tensors.
Most aten ops use the same memory on both devices; the ones that do not are handled here, in one
place, each with the CUDA behaviour it models:

* ``scaled_dot_product_attention``: CUDA picks cuDNN, flash, memory-efficient or math attention per call,
  by dtype, head dim, mask (and whether it needs a gradient), dropout, grouped heads and the GPU; each keeps
  different memory for backward, and the CPU path keeps the seq x seq matrix of none of them
  (``memfit.tracing.sdpa`` makes the choice by torch's rules and runs the chosen kernel's shape-only form).
* ``dropout``: CUDA's fused ``native_dropout`` keeps a 1-byte mask for backward; CPU's keeps a noise tensor
  of the input's dtype (4 bytes an element in fp32).
* Autocast: ``torch.autocast("cuda")`` casts by CUDA's op lists (``aten/src/ATen/autocast_mode.h``),
  which differ from CPU's (CUDA keeps softmax, layer_norm, exp, pow, sum and the losses in fp32).
  CPU autocast would apply CPU's lists to fake CPU tensors, so instead we cast above autograd, as
  autocast does, by CUDA's lists, with autocast's cache of lower-precision weight copies.
* ``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``: CUDA runs cuDNN's RNN, with its workspace and reserve space and,
  under autocast, one fp16 copy of all the weights per call; CPU runs the RNN step by step
  (``memfit.tracing.cudnn_rnn``).
* ``cross_entropy``: CUDA autocast lets its inner ``log_softmax`` run in the input dtype (the dtype
  is passed explicitly) and casts only at ``nll_loss``, which saves an fp32 copy of the log-probs.

Runtime memory outside tensors (CUDA context, cuBLAS workspace) is in ``memfit.simulation.runtime``; what kernels
allocate for themselves (cuDNN workspaces, reductions' staging buffers), on both paths, in
``memfit.tracing.cuda_scratch``.

Known limitations: regions where a model disables autocast itself (``torch.autocast(enabled=False)``) are still
cast; torch's own autocast state on a machine without CUDA cannot be asked for CUDA's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.tracing.cudnn_rnn import cudnn_rnn, cudnn_rnn_mode
from memfit.tracing.sdpa import CudaBuild, attention_like_cuda, fused_dropout, is_fused_dropout

__all__ = ["CudaSemantics"]

# AT_FORALL_LOWER_PRECISION_FP: run in the autocast dtype. Matched by the Python-visible name.
_LOWER_PRECISION = frozenset(
    {
        "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "_convolution", "prelu", "addmm", "addmv", "addr",
        "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot", "linear",
        "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
    }
)  # fmt: skip
# AT_FORALL_FP32: run in fp32.
_FP32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus",
        "layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div",
        "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    }
)  # fmt: skip
# AT_FORALL_FP32_SET_OPT_DTYPE: given a half input and no dtype, produce fp32.
_FP32_SET_OPT_DTYPE = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "linalg_vector_norm", "linalg_matrix_norm"}
)
# AT_FORALL_PROMOTE: run in the widest floating dtype among the inputs.
_PROMOTE = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sample", "index_put",
     "tensordot", "scatter_add"}
)  # fmt: skip

_HALF = (torch.float16, torch.bfloat16)
_RNN_NAMES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


def _eligible(value: Any) -> bool:
    # autocast's is_eligible: a floating tensor that is not float64
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class CudaSemantics(TorchFunctionMode):
    """Make fake CPU tensors use the memory that the same step would use on a CUDA GPU.

    ``autocast_dtype`` emulates ``torch.autocast("cuda", dtype=...)`` (``None``: no autocast).
    ``autocast_active`` is switched by the tracer: on in forward and in checkpointing's
    recomputation, off elsewhere.
    ``cache_casts`` mirrors autocast's weight-cast cache, which lives for one autocast region.
    ``build`` is the target GPU, whose compute capability and cuDNN decide the attention kernel.
    """

    def __init__(self, autocast_dtype: torch.dtype | None = None, build: CudaBuild | None = None) -> None:
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.build = build or CudaBuild()
        self.autocast_active = False
        self.cache_casts = False
        self._cast_cache: dict[int, torch.Tensor] = {}
        self.substitutions: dict[str, int] = {}

    def clear_cast_cache(self) -> None:
        self._cast_cache.clear()

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        """Checkpointing re-runs forward code inside backward, with the forward's autocast state but
        outside every torch-function mode; this puts the substitutions back for it. The recomputation is an
        autocast region of its own (``torch.utils.checkpoint`` enters ``torch.autocast`` for it), so weights
        cast in it are cached until it ends, and freed then unless backward keeps them."""
        previous = self.autocast_active, self.cache_casts, self._cast_cache
        self.autocast_active = self.autocast_dtype is not None
        self.cache_casts, self._cast_cache = self.autocast_active, {}
        try:
            with self:
                yield
        finally:
            self.autocast_active, self.cache_casts, self._cast_cache = previous

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        mode = cudnn_rnn_mode(func, args, kwargs)
        if mode is not None:
            autocast = self.autocast_active and self.autocast_dtype is not None
            return self._count(f"{_RNN_NAMES[mode]} (cuDNN's kernels)", cudnn_rnn(mode, *args, autocast=autocast))
        if self.autocast_active and self.autocast_dtype is not None:
            if name in _LOWER_PRECISION:
                args, kwargs = self._cast_all(args, kwargs, self.autocast_dtype)
            elif name in _FP32:
                args, kwargs = self._cast_all(args, kwargs, torch.float32)
            elif name in _FP32_SET_OPT_DTYPE:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None and first.dtype in _HALF and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif name in _PROMOTE:
                widest = _widest_float(args, kwargs)
                if widest is not None:
                    args, kwargs = self._cast_all(args, kwargs, widest)
            elif name == "cross_entropy":
                return self._count("cross_entropy", _cross_entropy_like_cuda_autocast(*args, **kwargs))
        if func is F.scaled_dot_product_attention:
            out, backend = attention_like_cuda(*args, **kwargs, build=self.build)
            return self._count(backend.value, out)
        if name == "dropout" and is_fused_dropout(*_dropout_arguments(*args, **kwargs)):
            return self._count("dropout", fused_dropout(*_dropout_arguments(*args, **kwargs)[:2]))
        return func(*args, **kwargs)

    def _count(self, key: str, value: Any) -> Any:
        self.substitutions[key] = self.substitutions.get(key, 0) + 1
        return value

    def _cast_all(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
        def cast(value: Any) -> Any:
            if not _eligible(value) or value.dtype == dtype:
                return value
            cacheable = self.cache_casts and dtype in _HALF and value.is_leaf and value.requires_grad
            if cacheable:
                cached = self._cast_cache.get(id(value))
                if cached is None:
                    cached = self._cast_cache[id(value)] = value.to(dtype)
                return cached
            return value.to(dtype)

        # autocast's C++ wrapper casts the arguments in one call expression, which GCC evaluates right to left:
        # a linear layer's bias is cast before its weight, and the allocator sees them in that order
        leaves, spec = tree_flatten((args, kwargs))
        cast_leaves = [cast(leaf) for leaf in reversed(leaves)][::-1]
        return tree_unflatten(cast_leaves, spec)


def _widest_float(args: tuple, kwargs: dict) -> torch.dtype | None:
    widest: torch.dtype | None = None
    for value in [*args, *kwargs.values()]:
        if _eligible(value):
            widest = value.dtype if widest is None else torch.promote_types(widest, value.dtype)
    return widest


def _cross_entropy_like_cuda_autocast(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    # at::cross_entropy_loss calls log_softmax(input, dim, input.dtype): the explicit dtype keeps
    # autocast from promoting it, then nll_loss (fp32 list) casts the log-probs to fp32.
    if input.dtype not in _HALF or target.is_floating_point():
        return F.cross_entropy(input, target, weight, None, ignore_index, None, reduction, label_smoothing)
    class_dim = 1 if input.dim() >= 2 else 0
    log_probs = F.log_softmax(input, dim=class_dim, dtype=input.dtype).float()
    if weight is not None:
        weight = weight.float()
    loss = F.nll_loss(log_probs, target, weight, None, ignore_index, None, reduction)
    if label_smoothing > 0:
        smooth = -log_probs.sum(dim=class_dim)
        smooth = smooth.mean() if reduction == "mean" else smooth.sum() if reduction == "sum" else smooth
        loss = (1 - label_smoothing) * loss + label_smoothing / input.shape[class_dim] * smooth
    return loss


def _dropout_arguments(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, train: bool | None = None
) -> tuple[torch.Tensor, float, bool, bool]:
    """``F.dropout``'s arguments, positional or by name (``torch.dropout`` names ``training`` ``train``)."""
    return input, p, training if train is None else train, inplace
