"""Attention masks whose values a trace knows, and the eager branch transformers takes on them.

Before it builds an attention mask for SDPA, transformers asks whether the batch's padding mask masks anything
(``masking_utils._ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa``: ``padding_mask.all()``). An
all-ones mask masks nothing, so an eager run on the GPU skips the mask and calls SDPA with ``is_causal`` (or with no
mask at all). The check reads values, so on a fake tensor it takes its traced branch (``is_tracing(tensor)`` is true
for fake tensors, as under torch.compile) and builds a (batch, 1, seq, seq) mask the eager run never allocates, with
what follows from it (grouped key/value heads repeated, an additive mask): 64 MiB more for a two-layer Llama at
batch 4 and sequence 2048.

The sample is real: its all-ones integer tensors (a tokenizer's ``attention_mask`` of a batch without padding) are
read once, before the trace. :class:`KnownOnes` marks their fake stand-ins and follows them through copies and casts
(views share the storage), and :func:`eager_mask_skip` answers both checks as eager does for them: a padding mask
of all ones is no padding mask. Any other padding mask keeps the traced branch.

Tested on transformers 5.17; where the checks do not exist, nothing is changed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from memfit.tracing.rebinding import rebound

__all__ = ["KnownOnes", "eager_mask_skip", "holds_only_ones", "shape_only"]

_aten = torch.ops.aten
_COPIES = frozenset({_aten.clone.default, _aten._to_copy.default, _aten.contiguous.default})
_CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


_ONES_ON_META: WeakIdKeyDictionary = WeakIdKeyDictionary()  # shape-only stand-ins of all-ones sample tensors


def holds_only_ones(tensor: torch.Tensor) -> bool:
    """Whether an integer or boolean tensor of the sample is all ones: read on a real tensor, remembered for its
    shape-only stand-in (``shape_only``)."""
    if tensor.device.type == "meta":
        return tensor in _ONES_ON_META
    if tensor.is_floating_point() or tensor.is_complex() or tensor.numel() == 0 or is_fake(tensor):
        return False
    with _disable_current_modes():  # read outside the trace: neither faked nor recorded
        return bool((tensor == 1).all())


def shape_only(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``tensor`` as a meta tensor of ``shape`` (the sample a kept session holds: no values, no device memory) that
    still says whether it was all ones."""
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    if holds_only_ones(tensor):
        _ONES_ON_META[meta] = True
    return meta


class KnownOnes:
    """Storages the trace knows hold only ones: the sample's all-ones tensors' stand-ins, and copies or casts of
    them."""

    def __init__(self) -> None:
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark(self, tensor: torch.Tensor) -> None:
        self._storages[tensor.untyped_storage()] = True

    def note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Learn from one op of the trace (the recorder calls this with every op it dispatches)."""
        copied = func in _COPIES and isinstance(out, torch.Tensor) and args and self.all_ones(args[0])
        if copied and not out.is_complex():  # 1 stays 1 in every integer, boolean and floating dtype
            self.mark(out)

    def all_ones(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.untyped_storage() in self._storages


@contextlib.contextmanager
def eager_mask_skip(known: KnownOnes) -> Iterator[None]:
    """Answer transformers' mask-skip checks as an eager run does wherever ``known`` knows the padding mask is all
    ones (no padding mask); elsewhere the checks run as they are."""
    masking = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        for name in _CHECKS:
            original = getattr(masking, name, None)
            if original is not None:
                stack.enter_context(rebound(name, original, _answered(original, known)))
        yield


def _answered(original: Any, known: KnownOnes) -> Any:
    def check(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
        return original(None if known.all_ones(padding_mask) else padding_mask, *args, **kwargs)

    return check
