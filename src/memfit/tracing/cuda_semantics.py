"""CUDA behaviour that a CPU-only torch does not have, substituted while tracing for a GPU.

On a machine whose torch cannot create (fake) CUDA tensors, memfit traces on fake CPU tensors.
Most aten ops use the same memory on both devices; the ones that do not are handled here, in one
place, each with the CUDA behaviour it models:

* ``scaled_dot_product_attention``: CUDA runs the flash kernel (fp16/bf16, no explicit mask) or the
  memory-efficient kernel (masks, fp32), which never materialise the seq x seq score matrix. The CPU
  path keeps it (GPT-2 124M at seq 1024: 28 GiB traced instead of 14 GiB). We call the CUDA
  kernels' shape-only implementations so outputs and saved ``logsumexp`` have CUDA's sizes.
* Autocast: ``torch.autocast("cuda")`` casts by CUDA's op lists (``aten/src/ATen/autocast_mode.h``),
  which differ from CPU's (CUDA keeps softmax, layer_norm, exp, pow, sum and the losses in fp32).
  CPU autocast would apply CPU's lists to fake CPU tensors, so instead we cast above autograd, as
  autocast does, by CUDA's lists, with autocast's cache of lower-precision weight copies.
* ``cross_entropy``: CUDA autocast lets its inner ``log_softmax`` run in the input dtype (the dtype
  is passed explicitly) and casts only at ``nll_loss``, which saves an fp32 copy of the log-probs.

Runtime memory outside tensors (CUDA context, cuBLAS workspace) is in ``memfit.simulation.runtime``.

Known limitations: cuDNN convolution and RNN workspaces, and regions where a model disables
autocast itself (``torch.autocast(enabled=False)``), are not modelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

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
_FLASH_MAX_HEAD_DIM = 256


def _eligible(value: Any) -> bool:
    # autocast's is_eligible: a floating tensor that is not float64
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class CudaSemantics(TorchFunctionMode):
    """Make fake CPU tensors use the memory that the same step would use on a CUDA GPU.

    ``autocast_dtype`` emulates ``torch.autocast("cuda", dtype=...)`` (``None``: no autocast).
    ``autocast_active`` is switched by the tracer: on in forward and in checkpointing's
    recomputation, off elsewhere.
    ``cache_casts`` mirrors autocast's weight-cast cache, which lives for one autocast region.
    """

    def __init__(self, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.autocast_active = False
        self.cache_casts = False
        self._cast_cache: dict[int, torch.Tensor] = {}
        self.substitutions: dict[str, int] = {}

    def clear_cast_cache(self) -> None:
        self._cast_cache.clear()

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        """Checkpointing re-runs forward code inside backward, with the forward's autocast state but
        outside every torch-function mode; this puts the substitutions back for it."""
        previous = self.autocast_active
        self.autocast_active = self.autocast_dtype is not None
        try:
            with self:
                yield
        finally:
            self.autocast_active = previous

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
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
            return _sdpa_like_cuda(self, *args, **kwargs)
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

        return tree_map(cast, args), tree_map(cast, kwargs)


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


def _sdpa_like_cuda(
    mode: CudaSemantics,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Pick the kernel CUDA's ``_fused_sdp_choice`` would pick on sm80+ and run its shape-only form."""
    head_dim = query.shape[-1]
    same_dims = key.shape[-1] == head_dim and value.shape[-1] == head_dim
    grouped = query.dim() == 4 and key.shape[-3] != query.shape[-3]
    needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
    kernel: Callable[..., Any]
    if (
        query.dtype in _HALF
        and attn_mask is None
        and same_dims
        and head_dim <= _FLASH_MAX_HEAD_DIM
        and query.dim() == 4
    ):
        # Flash attention: output + fp32 logsumexp (B, H, S); handles grouped-query heads natively.
        kernel = torch.ops.aten._scaled_dot_product_flash_attention
        out = kernel(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return mode._count("flash_attention", out)
    if query.dim() == 4 and same_dims and not grouped and query.dtype in (*_HALF, torch.float32):
        # Memory-efficient attention: supports an additive/boolean mask, fp32, no seq x seq matrix.
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        if bias is not None:
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        kernel = torch.ops.aten._scaled_dot_product_efficient_attention
        out = kernel(query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]
        return mode._count("efficient_attention", out)
    # Anything else falls back to the math path on CUDA as well.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return mode._count("math_attention", out)
