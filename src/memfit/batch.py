"""The sample batch: find its batch size, and remake it at any batch size as fake tensors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memfit.errors import InvalidInputError

__all__ = ["call_model", "describe", "infer_batch_size", "rebatch"]

Sample = Any  # a tensor, or a dict / list / tuple (possibly nested) of tensors


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


def infer_batch_size(sample: Sample) -> int:
    """The most common leading dimension among the sample's tensors (ties: the larger one)."""
    leading = [t.shape[0] for t in _tensors(sample) if t.dim() > 0]
    if not leading:
        raise InvalidInputError(
            f"the sample holds no tensor with a batch dimension ({describe(sample)}); pass a tensor, "
            "a dict/tuple of tensors, or a callable batch_size -> batch"
        )
    counts = Counter(leading)
    return max(counts, key=lambda size: (counts[size], size))


def rebatch(sample: Sample, old_batch: int, new_batch: int, make: Callable[[torch.Tensor, tuple], Any]) -> Any:
    """Rebuild ``sample`` with ``make(tensor, shape)``; dim 0 equal to ``old_batch`` becomes ``new_batch``."""
    if isinstance(sample, torch.Tensor):
        shape = tuple(sample.shape)
        if shape and shape[0] == old_batch:
            shape = (new_batch, *shape[1:])
        return make(sample, shape)
    if isinstance(sample, Mapping):
        items = {key: rebatch(value, old_batch, new_batch, make) for key, value in sample.items()}
        try:
            return type(sample)(items)
        except Exception:
            return items
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):  # namedtuple
        return type(sample)(*(rebatch(v, old_batch, new_batch, make) for v in sample))
    if isinstance(sample, (list, tuple)):
        return type(sample)(rebatch(v, old_batch, new_batch, make) for v in sample)
    return sample


def call_model(model: torch.nn.Module, batch: Sample) -> Any:
    """Call ``model`` the way a training loop would: ``**dict``, ``*tuple``, or the tensor itself."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def describe(sample: Sample) -> str:
    """A short shape summary for error messages: ``{'input_ids': int64[8, 128]}``."""
    if isinstance(sample, torch.Tensor):
        dtype = str(sample.dtype).replace("torch.", "")
        return f"{dtype}{list(sample.shape)}"
    if isinstance(sample, Mapping):
        inner = ", ".join(f"{key!r}: {describe(value)}" for key, value in sample.items())
        return "{" + inner + "}"
    if isinstance(sample, (list, tuple)):
        inner = ", ".join(describe(value) for value in sample)
        return ("[" + inner + "]") if isinstance(sample, list) else ("(" + inner + ")")
    return type(sample).__name__
