"""The sample batch: pick it from a dataset, find its batch size, and remake it at any batch size as fake tensors."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from memfit.errors import InvalidInputError

__all__ = [
    "batch_examples",
    "call_model",
    "dataset_length",
    "describe",
    "infer_batch_size",
    "longest_batch",
    "longest_examples",
    "planning_batch",
    "rebatch",
    "resequenced",
    "sequence_length",
]

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
        except (TypeError, ValueError):  # a mapping type that cannot be built from a dict: a plain dict
            return items
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):  # namedtuple
        return type(sample)(*(rebatch(v, old_batch, new_batch, make) for v in sample))
    if isinstance(sample, (list, tuple)):
        return type(sample)(rebatch(v, old_batch, new_batch, make) for v in sample)
    return sample


def sequence_length(sample: Sample, sample_batch: int) -> int | None:
    """The sample's sequence length: the most common dimension 1 of its integer tensors of two or more dimensions
    that carry the batch (token ids, labels, masks); ``None`` for a sample without one (images, features)."""
    lengths: list[int] = []

    def note(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
        if tensor.dim() >= 2 and tensor.shape[0] == sample_batch and not tensor.is_floating_point():
            lengths.append(int(tensor.shape[1]))
        return tensor

    rebatch(sample, sample_batch, sample_batch, note)
    if not lengths:
        return None
    return max(set(lengths), key=lambda length: (lengths.count(length), length))


def resequenced(sample: Sample, sample_batch: int, length: int, new_length: int) -> Sample:
    """``sample`` (meta or real tensors) as meta tensors with every dimension 1 of ``length`` made ``new_length``."""

    def remake(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
        if tensor.dim() >= 2 and shape[1] == length:
            shape = (shape[0], new_length, *shape[2:])
        return torch.empty(shape, dtype=tensor.dtype, device="meta")

    return rebatch(sample, sample_batch, sample_batch, remake)


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


LENGTH_SCAN_LIMIT = 20_000  # examples whose length is read at most; larger datasets are read evenly spaced
LENGTH_SCAN_SECONDS = 2.0  # about how long reading lengths may take; slow datasets are read more sparsely
_LENGTH_PROBE = 64  # examples read first, to time one read


def longest_examples(
    dataset: Any, count: int, length_column: str | None = "length", *, notes: list[str] | None = None
) -> list[int]:
    """Indices of ``count`` examples with the longest sequences, the first ``count`` if all are as long.

    A collator that pads to the longest example in the batch makes the run's peak at its longest
    batch, wherever that falls in the epoch; this is the batch to plan on. An example's length is
    its ``length_column`` where the dataset has that column (Hugging Face's ``group_by_length``
    convention), else the elements of its sequences (``_example_length``: a bare tensor or list of
    ids, a tuple, a dict, nested). At most 20,000 examples are read, evenly spaced, and fewer where
    reading takes long (about 2 seconds in all), so a rare longer example can be missed.

    When no example holds a sequence to measure, the first ``count`` are used and a sentence saying
    so is appended to ``notes`` (for the estimate's notes: the plan rests on an assumption there).
    """
    size = len(dataset)
    if size == 0:
        raise InvalidInputError("the dataset is empty: memfit needs examples to build a batch from")
    columns = getattr(dataset, "column_names", None) or []
    if length_column and length_column in columns:
        stride = max(1, -(-size // LENGTH_SCAN_LIMIT))
        column = dataset[length_column][0:size:stride]  # one slice: `datasets` reads a column's items slowly
        lengths = {i: int(value) for i, value in zip(range(0, size, stride), column, strict=True)}
    else:
        lengths = _scanned_lengths(dataset, size)
    found = {i: length for i, length in lengths.items() if length is not None}
    if not found and notes is not None:
        notes.append(
            f"no example length found (the examples hold no tensor or list, e.g. {describe(dataset[0])}): the batch "
            f"traced is the dataset's first {count} example(s); a longer batch in the epoch would need more memory"
        )
    if len(set(found.values())) <= 1:
        return [i % size for i in range(count)]
    longest = sorted(found, key=lambda i: (-found[i], i))[:count]  # the earlier of equals first
    return [longest[i % len(longest)] for i in range(count)]


def _scanned_lengths(dataset: Any, size: int) -> dict[int, int | None]:
    """Lengths of evenly spaced examples: as many as the time of the first reads says fit in the budget."""
    started = time.perf_counter()
    probe = _evenly_spaced(size, min(size, _LENGTH_PROBE))
    lengths = {i: _example_length(dataset[i]) for i in probe}
    per_example = (time.perf_counter() - started) / len(probe)
    affordable = int(LENGTH_SCAN_SECONDS / per_example) if per_example > 0 else LENGTH_SCAN_LIMIT
    for i in _evenly_spaced(size, min(size, LENGTH_SCAN_LIMIT, max(len(probe), affordable))):
        if i not in lengths:
            lengths[i] = _example_length(dataset[i])
    return lengths


def _evenly_spaced(size: int, count: int) -> list[int]:
    return sorted({i * size // count for i in range(count)}) if count else []


_SCALARS = (int, float, complex, bool, str, bytes, type(None))


def _is_scalar(value: Any) -> bool:
    """One item of a sequence: a number, a string, a 0-d tensor or NumPy scalar."""
    shape = getattr(value, "shape", None)
    return isinstance(value, _SCALARS) or (shape is not None and len(shape) == 0)


def _example_length(example: Any) -> int | None:
    """The elements of an example's sequences, ``None`` when it holds none.

    A tensor or array of one or more dimensions counts its elements; a list or tuple of scalars
    (token ids) its items; a dict, list or tuple of anything else the sum of its parts; a scalar
    (a label, a 0-d tensor, a string id) nothing. The sum orders examples by how much a padding
    collator makes of them: ``(ids, labels)`` and ``{"input_ids", "attention_mask"}`` grow with the
    sequence, an image beside a caption adds the same to every example.
    """
    shape = getattr(example, "shape", None)
    if shape is not None:  # a tensor, or a NumPy-like array
        return math.prod(shape) if len(shape) > 0 else None
    if isinstance(example, Mapping):
        parts = [_example_length(value) for value in example.values()]
    elif isinstance(example, (list, tuple)):
        if all(_is_scalar(value) for value in example):
            return len(example)
        parts = [_example_length(value) for value in example]
    else:
        return None
    found = [part for part in parts if part is not None]
    return sum(found) if found else None


def batch_examples(
    dataset: Any, count: int, length_column: str | None = "length", *, notes: list[str] | None = None
) -> list[Any]:
    """``count`` examples to build the plan's batch from: the longest of a dataset read by index
    (``longest_examples``), the first of a stream, repeated if it holds fewer. ``notes`` gets a
    sentence when the choice rests on no length (a stream, examples without sequences)."""
    if _readable_by_index(dataset):
        return [dataset[i] for i in longest_examples(dataset, count, length_column, notes=notes)]
    if iter(dataset) is dataset:
        raise InvalidInputError(
            f"the dataset is a one-shot iterator ({type(dataset).__name__}); reading a batch from it would take "
            "that batch from training. Pass a dataset that can be iterated again, or a sample batch"
        )
    examples = list(itertools.islice(iter(dataset), count))  # a stream: its first examples
    if not examples:
        raise InvalidInputError("the dataset is empty: memfit needs examples to build a batch from")
    if notes is not None:
        notes.append(
            f"the dataset is a stream ({type(dataset).__name__}), whose lengths cannot be read ahead: the batch "
            f"traced is its first {count} example(s); a longer batch later in the epoch would need more memory"
        )
    return [examples[i % len(examples)] for i in range(count)]


def is_stream(dataset: Any) -> bool:
    """A dataset read only in order (an ``IterableDataset``, a generator-backed one): its lengths cannot be read
    ahead, so its longest batch is not among the first examples."""
    return not _readable_by_index(dataset)


def stretched(batch: Any, length: int) -> Any:
    """``batch`` with every ``[batch, seq, ...]`` tensor of its token sequence's length made ``length`` long by
    repeating its last position: the ids, masks and labels stay valid values, and the step sees the longest batch
    a stream can produce. The token sequence is ``input_ids`` in a mapping, else the first integer tensor of two
    or more dimensions (a tuple or list batch). ``None`` when there is none, or it is already that long."""
    values = (
        list(batch.values()) if isinstance(batch, Mapping) else list(batch) if isinstance(batch, (tuple, list)) else []
    )
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if ids is None:
        ids = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point()),
                   None)  # fmt: skip
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[1] >= length:
        return None
    current = ids.shape[1]

    def grow(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != current:
            return value
        tail = value[:, -1:].expand(value.shape[0], length - current, *value.shape[2:])
        return torch.cat([value, tail], dim=1)

    if isinstance(batch, Mapping):
        return {key: grow(value) for key, value in batch.items()}
    return type(batch)(grow(value) for value in batch) if isinstance(batch, tuple) else [grow(v) for v in batch]


def sequence_limit(
    model: torch.nn.Module, data_collator: Any = None, processing_class: Any = None, max_length: int | None = None
) -> tuple[int, str] | None:
    """The longest sequence a batch can have, and where that bound comes from: ``max_length`` as given, the
    collator's ``max_length``, the tokenizer's ``model_max_length`` (when it is a real bound, not the tokenizer's
    "unset"), the model's table of learned positions, the positions its config declares (a model inside a
    LightningModule included)."""
    from memfit.tracing.model_limits import position_limit

    if max_length is not None:
        return int(max_length), f"max_length={max_length}"
    if isinstance(bound := getattr(data_collator, "max_length", None), int) and bound > 0:
        return bound, "the collator's max_length"
    tokenizer = processing_class if processing_class is not None else getattr(data_collator, "tokenizer", None)
    if isinstance(bound := getattr(tokenizer, "model_max_length", None), int) and 0 < bound < 1_000_000:
        return bound, "the tokenizer's model_max_length"
    if (table := position_limit(model)) is not None:
        return table[0], f"the model's {table[0]} positions ({table[1]})"
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(bound := getattr(config, name, None), int) and bound > 0:
            return bound, f"the model's {name}"
    return None


def longest_of_a_stream(
    batch: Any, model: torch.nn.Module, data_collator: Any, processing_class: Any, max_length: int | None,
    notes: list[str],
) -> tuple[Any, list[str]]:  # fmt: skip
    """A stream's first examples stretched to the longest sequence its batches can have (``sequence_limit``),
    with a note that says so in place of the first-examples one; as it was when no bound is known."""
    limit = sequence_limit(model, data_collator, processing_class, max_length)
    longer = stretched(batch, limit[0]) if limit is not None else None
    if limit is None or longer is None:
        return batch, notes
    first = _token_ids(batch).shape[1]
    kept = [note for note in notes if not note.startswith("the dataset is")]
    return longer, [*kept, (
        f"the dataset is a stream, whose lengths cannot be read ahead: its first examples ({first} tokens) are "
        f"planned stretched to {limit[0]} tokens, {limit[1]}, the longest batch it can produce"
        + ("" if max_length is not None else " (max_length= plans for another longest batch)")
    )]  # fmt: skip


def _token_ids(batch: Any) -> torch.Tensor | None:
    """A batch's token sequence: ``input_ids`` in a mapping, else its first integer tensor of two or more
    dimensions."""
    if isinstance(batch, Mapping) and isinstance(ids := batch.get("input_ids"), torch.Tensor) and ids.dim() >= 2:
        return ids
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    integer = (v for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point())
    return next(integer, None)


def _readable_by_index(dataset: Any) -> bool:
    if isinstance(dataset, IterableDataset):  # it inherits a __getitem__ that raises
        return False
    kind = type(dataset)
    return hasattr(kind, "__len__") and hasattr(kind, "__getitem__")


def longest_batch(loader: DataLoader, *, notes: list[str] | None = None) -> Any:
    """One batch as ``loader`` builds it, of the longest examples its dataset holds.

    Only a custom ``collate_fn`` can batch examples of different lengths (``default_collate``
    needs equal shapes), so a loader with the default one, an iterable dataset, or a custom batch
    sampler gives its first batch, as does a dataset that cannot be read by index. ``notes`` gets a
    sentence when the batch rests on no length: a first batch where another could be longer, or
    examples that hold no sequence (``longest_examples``).
    """
    with _generators_kept(loader):
        return _longest_batch(loader, notes)


@contextlib.contextmanager
def _generators_kept(loader: DataLoader) -> Iterator[None]:
    """Reading a batch draws from the loader's own generators (a shuffling sampler seeds each pass from them),
    which the global RNG state does not cover: put them back, so the run shuffles as it would have."""
    generators = {id(g): g for g in (getattr(loader, "generator", None), getattr(loader.sampler, "generator", None),
                                      getattr(getattr(loader, "batch_sampler", None), "generator", None))
                  if isinstance(g, torch.Generator)}  # fmt: skip
    states = {key: generator.get_state() for key, generator in generators.items()}
    try:
        yield
    finally:
        for key, generator in generators.items():
            generator.set_state(states[key])


def _longest_batch(loader: DataLoader, notes: list[str] | None) -> Any:
    dataset, batch_size = loader.dataset, loader.batch_size
    if loader.collate_fn is default_collate:
        return next(iter(loader))  # every batch as long as the first
    if not (isinstance(dataset, IterableDataset) or batch_size is None):
        found: list[str] = []
        try:
            examples = [dataset[i] for i in longest_examples(dataset, batch_size, length_column=None, notes=found)]
        except (LookupError, TypeError, ValueError, NotImplementedError):  # not readable by position: its first batch
            pass
        else:
            if notes is not None:
                notes.extend(found)
            return loader.collate_fn(examples)
    if notes is not None:
        how = "a stream" if isinstance(dataset, IterableDataset) else (
            "batched by its own sampler" if batch_size is None else "not readable by position"
        )  # fmt: skip
        notes.append(
            f"the dataset is {how}, so the batch traced is the loader's first; a longer batch later in the epoch "
            "would need more memory"
        )
    return next(iter(loader))


def planning_batch(
    loader: DataLoader, model: torch.nn.Module, notes: list[str], *, max_length: int | None = None
) -> Any:
    """The batch a run over ``loader`` peaks on: its longest (``longest_batch``), or a stream's first stretched to
    the longest it can produce (``longest_of_a_stream``); ``notes`` gets what the choice could not know. Taking it
    leaves the run's random streams (its shuffling, its random transforms) where they were."""
    from memfit.tracing.model_state import preserved_rng_state  # it imports the device backends

    with preserved_rng_state():
        sample = longest_batch(loader, notes=notes)
    if is_stream(loader.dataset):
        sample, notes[:] = longest_of_a_stream(sample, model, loader.collate_fn, None, max_length, notes)
    return sample


def dataset_length(dataset: Any) -> int | None:
    """How many samples ``dataset`` holds; ``None`` for a stream (no length)."""
    try:
        return len(dataset)
    except TypeError:
        return None
