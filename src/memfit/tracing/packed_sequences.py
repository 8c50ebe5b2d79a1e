"""Position ids whose values a trace knows, and the eager branch transformers takes on them.

transformers 5 checks, before it builds a causal mask, whether the position ids pack several sequences into one row
(``masking_utils.find_packed_sequence_indices``: a step other than 1 between neighbouring positions). The check reads
values, so on a fake tensor it takes its traced branch (``is_tracing(tensor)`` is true for fake tensors, as under
torch.compile): it reports the rows as packed, which turns off the skip of the causal mask
(``allow_is_causal_skip``). The trace then builds a (batch, 1, seq, seq) boolean mask, attention gets ``attn_mask``
instead of ``is_causal``, grouped key/value heads are repeated for it (``sdpa_attention.use_gqa_in_sdpa`` refuses
``enable_gqa`` with a mask) and SDPA converts the mask to an additive one: none of which an eager run on the GPU
allocates for a batch of whole sequences, where the check returns ``None``.

The position ids of such a batch are the model's own, ``torch.arange(seq) + past_seen_tokens`` (Llama and the other
models of transformers 5 when the batch has no ``position_ids``): values a trace knows without reading them.
:class:`KnownPositions` follows them from the ``arange`` through constant shifts, copies and views, and
:func:`eager_packing_check` answers the check as eager does for them (``None``: one sequence per row). Position ids
from the batch (a packing collator's) are values the trace does not know; the check keeps its traced branch there.

Tested on transformers 5.17; where ``find_packed_sequence_indices`` does not exist, nothing is changed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.utils.weak import WeakIdKeyDictionary

from memfit.tracing.rebinding import rebound

__all__ = ["KnownPositions", "eager_packing_check"]

_aten = torch.ops.aten
_ARANGES = frozenset({_aten.arange.default, _aten.arange.start, _aten.arange.start_step})
_SHIFTS = frozenset({_aten.add.Tensor, _aten.sub.Tensor, _aten.add.Scalar, _aten.sub.Scalar})
_COPIES = frozenset({_aten.clone.default, _aten._to_copy.default, _aten.contiguous.default})
_WATCHED = _ARANGES | _SHIFTS | _COPIES
_INTEGER = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class KnownPositions:
    """Storages that hold runs of consecutive integers (step 1), each ``run`` elements long, in storage order: an
    ``arange``'s output (one run), or a copy or constant shift of tensors whose rows are such runs."""

    def __init__(self) -> None:
        self._runs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # untyped storage -> run length

    def note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Learn from one op of the trace (the recorder calls this with every op it dispatches)."""
        if func not in _WATCHED or not isinstance(out, torch.Tensor) or out.dtype not in _INTEGER:
            return
        if func in _ARANGES:
            step = args[2] if len(args) > 2 else kwargs.get("step", 1)
            if step == 1 and out.dim() == 1:
                self._runs[out.untyped_storage()] = out.shape[0]
            return
        source = args[0] if args else None
        if not (isinstance(source, torch.Tensor) and self.consecutive_rows(source)):
            return
        if func in _SHIFTS:  # the same constant added to every position: an int, or a 0-dim tensor; alpha 1
            other = args[1] if len(args) > 1 else kwargs.get("other")
            constant = isinstance(other, int) or (isinstance(other, torch.Tensor) and other.dim() == 0)
            if not constant or kwargs.get("alpha", 1) != 1 or (len(args) > 2 and args[2] != 1):
                return
        if out.dim() >= 1 and _dense(out):  # an elementwise op keeps every row consecutive; rows lie end to end
            self._runs[out.untyped_storage()] = out.shape[-1]

    def consecutive_rows(self, tensor: torch.Tensor) -> bool:
        """Whether every row (along the last dimension) of ``tensor`` is consecutive integers, as the trace knows:
        its storage holds runs, each row lies inside one run, and rows start at the same place in theirs."""
        run = self._runs.get(tensor.untyped_storage())
        if run is None or tensor.dim() == 0:
            return False
        start = tensor.storage_offset()
        inside = guard_or_false(tensor.stride(-1) == 1) and guard_or_false(start % run + tensor.shape[-1] <= run)
        aligned = all(
            guard_or_false(size == 1) or guard_or_false(stride % run == 0)
            for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1], strict=True)
        )
        return inside and aligned


def _dense(tensor: torch.Tensor) -> bool:
    """Contiguous from the storage's start, decided without installing a guard on a symbolic size."""
    expected: Any = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        if not (guard_or_false(size == 1) or guard_or_false(stride == expected)):
            return False
        expected = expected * size
    return guard_or_false(tensor.storage_offset() == 0)


@contextlib.contextmanager
def eager_packing_check(known: KnownPositions) -> Iterator[None]:
    """Answer transformers' ``find_packed_sequence_indices`` as an eager run does wherever ``known`` knows the
    position ids: consecutive in every row, so not packed (``None``); elsewhere the function runs as it is."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, torch.Tensor) and known.consecutive_rows(position_ids):
            return None  # every step is 1: (diff != 1).cumsum(-1) is all 0, and eager returns None
        return original(position_ids)

    with rebound("find_packed_sequence_indices", original, find_packed_sequence_indices):
        yield
