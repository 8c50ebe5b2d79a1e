"""``scaled_dot_product_attention`` as CUDA runs it, for a trace on fake CPU tensors.

On CUDA, ``F.scaled_dot_product_attention`` picks one of four kernels per call and each keeps different
memory for backward: cuDNN's and flash attention's keep the output and an fp32 logsumexp, the
memory-efficient kernel keeps those and the bias it was given, the math fallback keeps the full
seq x seq softmax, its dropout mask and the dropped-out matrix. A CPU-only torch picks CPU's kernels,
so memfit makes CUDA's choice here, by CUDA's rules, and runs the chosen kernel's shape-only form.

The rules are torch 2.13's (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``
and the ``can_use_*`` filters, with the shared filters of ``sdp_utils_cpp.h`` that the wheel ships in
``torch/include``); the kernels' memory is ``aten/src/ATen/native/transformers/attention.cpp``'s
``scaled_dot_product_attention`` (mask conversion, the memory-efficient kernel's bias padding, flash's
head-dim padding) and ``_scaled_dot_product_attention_math``, which :func:`_math_attention` follows op by
op. Each rule below names the filter it models. torch 2.11 makes the same choices for every call the
committed GPU measurements make.

Known limitations: nested (jagged) tensors, user-set backend priorities and ``sdpa_kernel`` contexts, and
``torch.backends.cuda.enable_*_sdp(False)`` on the target machine are not seen; the cuDNN version is taken
as the default CUDA 13 wheel's (see ``CudaBuild``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_true

__all__ = ["Backend", "CudaBuild", "attention_like_cuda", "choose_backend", "fused_dropout", "is_fused_dropout"]

_HALF = (torch.float16, torch.bfloat16)


class Backend(str, Enum):
    """SDPA kernels CUDA chooses from, in torch's names (``torch.nn.attention.SDPBackend``)."""

    CUDNN = "cudnn_attention"
    FLASH = "flash_attention"
    EFFICIENT = "efficient_attention"
    MATH = "math_attention"


@dataclass(frozen=True)
class CudaBuild:
    """The target GPU and the CUDA build of torch that runs on it.

    ``cudnn_version`` is cuDNN's runtime version as ``torch.backends.cudnn.version()`` reports it. The default
    is the cuDNN that torch's default CUDA 13 wheels load (9.19 on the measured H100, torch 2.11+cu130); it
    decides whether cuDNN attention comes first on Hopper and Blackwell.
    """

    compute_capability: tuple[int, int] = (9, 0)
    cudnn_version: int = 91900
    cuda_major: int = 13

    def prefers_cudnn(self) -> bool:
        """``check_prefer_cudnn_attention``: cuDNN first on sm90 and sm10x with cuDNN newer than 9.15 (on CUDA 12
        builds, only minor versions 0 and 3 of those)."""
        major, minor = self.compute_capability
        if self.cudnn_version <= 91500 or major not in (9, 10):
            return False
        return self.cuda_major >= 13 or minor in (0, 3)


@dataclass(frozen=True)
class _Call:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool

    @property
    def dense_4d(self) -> bool:  # check_tensor_shapes
        return self.query.dim() == self.key.dim() == self.value.dim() == 4

    @property
    def requires_grad(self) -> bool:  # input_requires_grad
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.query, self.key, self.value))

    def heads_ok(self, supports_gqa: bool) -> bool:
        """``check_batch_size_and_num_heads_dense<supports_gqa>``."""
        q, k, v = self.query, self.key, self.value
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            return False
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if self.enable_gqa and supports_gqa:  # check_grouped_query_attention
            return hk == hv and hq % hk == 0
        return hq == hk == hv

    def last_dim_contiguous(self, ignore_singleton_dim: bool) -> bool:
        """``check_last_dim_stride_equals_1_dense``: on CUDA the mask's last stride must be 1 too."""
        qkv = all(t.stride(-1) == 1 for t in (self.query, self.key, self.value))
        if ignore_singleton_dim:
            qkv = qkv or self.query.shape[-1] == 1
        mask = self.attn_mask is None or self.attn_mask.stride(-1) == 1
        return qkv and mask

    def nonzero_lengths(self) -> bool:  # check_nonzero_sequence_lengths_dense
        return self.query.shape[-2] != 0 and self.key.shape[-2] != 0


def choose_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    build: CudaBuild | None = None,
) -> Backend:
    """The kernel ``select_sdp_backend`` runs this call with on ``build``'s GPU (no nested tensors)."""
    build = build or CudaBuild()
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    order = [Backend.FLASH, Backend.EFFICIENT, Backend.MATH]
    if build.prefers_cudnn():
        order.insert(0, Backend.CUDNN)
    usable = {
        Backend.CUDNN: _cudnn_usable,
        Backend.FLASH: _flash_usable,
        Backend.EFFICIENT: _efficient_usable,
        Backend.MATH: lambda _call, _build: True,
    }
    return next(backend for backend in order if usable[backend](call, build))


def _sm_between(build: CudaBuild, low: tuple[int, int], high: tuple[int, int]) -> bool:  # check_sm_version
    return low <= build.compute_capability <= high


def _flash_usable(call: _Call, build: CudaBuild) -> bool:
    """``can_use_flash_attention``."""
    q, k, v = call.query, call.key, call.value
    if not call.dense_4d or call.attn_mask is not None:  # check_tensor_shapes, check_for_attn_mask
        return False
    head_dim = q.shape[-1]
    if not (head_dim == k.shape[-1] == v.shape[-1] and head_dim <= 256):  # check_head_dim_size_flash
        return False
    if not _sm_between(build, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    ampere_consumer = _sm_between(build, (8, 6), (8, 9)) or _sm_between(build, (12, 0), (12, 1))
    trainable_head_dim = head_dim <= 192 or (call.dropout_p == 0.0 and head_dim > 224)
    if call.requires_grad and ampere_consumer and not trainable_head_dim:
        return False
    if call.is_causal and q.shape[-2] != k.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    if q.dtype not in _HALF:  # check_dtypes_low_precision (sm80+)
        return False
    return call.heads_ok(supports_gqa=True) and call.nonzero_lengths() and call.last_dim_contiguous(True)


def _efficient_usable(call: _Call, build: CudaBuild) -> bool:
    """``can_use_mem_efficient_attention`` (grouped-query heads are not among its dense shapes in torch 2.13)."""
    q, k, v = call.query, call.key, call.value
    if not call.dense_4d or not _sm_between(build, (5, 0), (12, 1)):
        return False
    # check_head_dim_size_mem_efficient: minimum_gemm_alignment, 4 (fp32) or 8 (16-bit) elements from sm80
    half = q.dtype in _HALF
    alignment = (8 if half else 4) if build.compute_capability[0] >= 8 else (8 if half else 1)
    if not (q.shape[-1] == k.shape[-1] and q.shape[-1] % alignment == 0 and v.shape[-1] % alignment == 0):
        return False
    if not (call.nonzero_lengths() and call.last_dim_contiguous(False) and call.heads_ok(supports_gqa=False)):
        return False
    return q.dtype in (torch.float16, torch.float32) or (q.dtype == torch.bfloat16 and build.compute_capability[0] >= 8)


def _cudnn_usable(call: _Call, build: CudaBuild) -> bool:
    """``can_use_cudnn_attention``."""
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    if call.dropout_p > 0.0 and 91100 < build.cudnn_version < 91400:
        return False
    if not call.dense_4d or q.dtype not in _HALF:  # check_tensor_shapes, check_dtypes_low_precision
        return False
    if mask is not None and not _cudnn_mask_shape_ok(call):  # check_attn_mask_shape
        return False
    if not _sm_between(build, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if call.dropout_p * 16.0 != math.floor(call.dropout_p * 16.0):  # check_cudnn_dropout: steps of 1/16
        return False
    if not (call.nonzero_lengths() and call.last_dim_contiguous(True) and call.heads_ok(supports_gqa=True)):
        return False
    # check_cudnn_tensor_shapes, check_cudnn_d256_bprop_head_dim
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return False
    d_qk, d_v, s_q, s_k = q.shape[3], v.shape[3], q.shape[2], k.shape[2]
    major, minor = build.compute_capability
    sm90_or_sm10x = (major == 9 and minor == 0) or major == 10
    d256 = sm90_or_sm10x and build.cudnn_version > 92200
    limit = 256 if d256 else 128
    if sm90_or_sm10x and build.cudnn_version >= 91100 and (d_qk, d_v) == (192, 128):
        limit = max(limit, 192)
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or s_k == 1:
        return False
    if call.dropout_p != 0.0 and s_q == 1:
        return False
    backward_dims = max(d_qk, d_v) <= 128 or (d_qk, d_v) in ((192, 128), (256, 256))
    return not (d256 and call.requires_grad and not backward_dims)


def _cudnn_mask_shape_ok(call: _Call) -> bool:
    """``check_attn_mask_shape``: a mask cuDNN can read, and one it need not differentiate."""
    mask, q, k = call.attn_mask, call.query, call.key
    assert mask is not None
    if mask.requires_grad:
        return False

    def fits(size: int, target: int) -> bool:
        return size == target or size == 1

    if not (fits(mask.shape[-2], q.shape[2]) and fits(mask.shape[-1], k.shape[2])):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and fits(mask.shape[0], q.shape[0]) and fits(mask.shape[1], q.shape[1])


def attention_like_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    build: CudaBuild | None = None,
) -> tuple[torch.Tensor, Backend]:
    """Run ``F.scaled_dot_product_attention`` as CUDA would: the kernel it chooses, with that kernel's memory."""
    backend = choose_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, build)
    # should_compute_logsumexp
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    mask = _additive_mask(attn_mask, query.dtype)
    if backend is Backend.CUDNN:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, needs_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    elif backend is Backend.FLASH:
        out = _flash(query, key, value, dropout_p, is_causal, scale)
    elif backend is Backend.EFFICIENT:
        if mask is not None:
            mask = _efficient_bias(mask, query, key)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, needs_lse, dropout_p, is_causal, scale=scale
        )[0]
    else:
        out = _math_attention(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)
    return out, backend


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 / -inf in the query's dtype, a new tensor."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: a bias whose strides are not multiples of 16 is copied into a padded one (kept for
    backward), then broadcast to (batch, heads, q, k) as a view."""
    aligned = all(stride % 16 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 16 - last % 16))[..., :last]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """Flash attention as ``scaled_dot_product_attention`` calls it on CUDA: head dims padded to a multiple of 8
    (``pad_last_dim<8>``), the scale from the unpadded one, the output sliced back."""
    head_dim = query.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    pad = (8 - head_dim % 8) % 8
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, False, scale=scale
    )[0]
    return out[..., :head_dim] if pad else out


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math``, op for op: 16-bit inputs computed in fp32 (torch's default,
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)``), the mask added in place, CUDA's fused
    dropout (a 1-byte mask kept for backward, where CPU's keeps a noise tensor of the input's dtype), and the
    weights it also returns cast back and dropped by ``scaled_dot_product_attention``."""
    origin = query.dtype
    if origin in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query, key, value = (t.float() for t in (query, key, value))
    head_dim = query.shape[-1]
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(head_dim))
    query = query * factor
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        mask = _additive_mask(causal, query.dtype)
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # pre_process_group_query_attention_input
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1) * factor)
    if mask is not None:  # in place, as torch does for plain tensors, where the mask broadcasts to the scores
        in_place = scores.shape == torch.broadcast_shapes(scores.shape, mask.shape)
        scores = scores.add_(mask) if in_place else scores + mask
    weights = torch.ops.aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = fused_dropout(weights, dropout_p)
    returned_weights = weights.to(origin)  # noqa: F841 -- the second output, alive until the call returns
    return torch.matmul(weights, value).to(origin)


def fused_dropout(input: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode ``at::dropout`` on CUDA: ``native_dropout``, which keeps a boolean mask for backward."""
    return torch.ops.aten.native_dropout(input, p, True)[0]


def is_fused_dropout(input: Any, p: float, training: bool, inplace: bool) -> bool:
    """``is_fused_kernel_acceptable``: CUDA runs an out-of-place training dropout of 0 < p < 1 fused (an empty input
    is the one case that is not; a symbolic size is taken as not empty, without a guard)."""
    if not (isinstance(input, torch.Tensor) and training and not inplace and 0.0 < p < 1.0):
        return False
    return guard_or_true(input.numel() > 0)
