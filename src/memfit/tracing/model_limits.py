"""What a model's own sizes allow of a batch: its sequence length, its token ids, its labels.

A model with a table of positions (GPT-2's ``wpe``, BERT's ``position_embeddings``, OPT's ``embed_positions``)
fails on a longer sequence (an ``IndexError`` in the embedding lookup), so a plan for one is refused; rotary,
relative and ALiBi positions (Llama, T5, BLOOM) have no table and no such limit. Token ids outside the input
embedding's rows, and labels outside what the head's loss takes, fail the step the same way: a plan on such a
batch is refused before the trace fails on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memfit.errors import InvalidInputError

__all__ = ["check_sequence_length", "check_token_ranges", "position_limit"]

_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings", "pos_embed", "position_embedding")


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """The most positions ``model``'s learned position table holds, and the module holding it; ``None`` when it
    has none. OPT-style tables keep ``offset`` extra rows before the first position."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            return module.num_embeddings - int(getattr(module, "offset", 0) or 0), name
    return None


def check_sequence_length(model: nn.Module, length: int, *, fix: str) -> None:
    """Refuse a plan for sequences of ``length`` tokens the model cannot take; ``fix`` says how to shorten them
    (``--seq-len``, the tokenizer's ``max_length``)."""
    limit = position_limit(model)
    if limit is not None and length > limit[0]:
        positions, where = limit
        raise InvalidInputError(
            f"sequences of {length} tokens are longer than the model's {positions} positions ({where} holds one "
            f"embedding per position), so its forward would fail; {fix.format(positions=positions)}"
        )


def check_token_ranges(model: torch.nn.Module, batch: Any) -> None:
    """Refuse a batch the model's step would fail on: ``input_ids`` outside its vocabulary (the embedding
    lookup raises, or reads out of bounds on a GPU), ``labels`` outside what its loss takes (the vocabulary for
    a language-model head, ``num_labels`` for a classification head; -100 marks positions the loss ignores).
    Only concrete tensors are read: a fake or ``meta`` batch has no values."""
    if not isinstance(batch, Mapping):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT, the base model
    ids = _values(batch.get("input_ids"))
    vocabulary = _input_vocabulary(base)
    if ids is not None and vocabulary is not None and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocabulary:
            raise InvalidInputError(
                f"the batch's input_ids hold token id {high if high >= vocabulary else low}, outside the model's "
                f"vocabulary of {vocabulary} tokens (ids 0 to {vocabulary - 1}), so its embedding lookup would fail; "
                "tokenize with the model's own tokenizer, or resize its embeddings to the tokenizer's "
                "(model.resize_token_embeddings(len(tokenizer)))"
            )
    labels = _values(batch.get("labels"))
    bound = _label_bound(base, labels)
    if labels is None or bound is None:
        return
    counted = labels[labels != _IGNORED_LABEL]
    if not counted.numel():
        return
    low, high = int(counted.min()), int(counted.max())
    if low < 0 or high >= bound[0]:
        raise InvalidInputError(
            f"the batch's labels hold {high if high >= bound[0] else low}, outside the {bound[0]} {bound[1]} the "
            f"model's loss takes (0 to {bound[0] - 1}, and {_IGNORED_LABEL} for positions it ignores), so its "
            f"loss would fail; {bound[2]}"
        )


_IGNORED_LABEL = -100  # the ignore_index of every transformers loss (and torch's cross entropy's default)


def _values(tensor: Any) -> torch.Tensor | None:
    """An integer tensor whose values can be read, else ``None`` (a fake or ``meta`` tensor has none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
        return None
    return tensor if not tensor.dtype.is_floating_point and not tensor.dtype.is_complex else None


def _input_vocabulary(model: torch.nn.Module) -> int | None:
    """The rows of the model's input embedding table (after ``resize_token_embeddings``), else its config's
    ``vocab_size``."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, torch.nn.Embedding):
        return embeddings.num_embeddings
    vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocabulary if isinstance(vocabulary, int) and vocabulary > 0 else None


def _label_bound(model: torch.nn.Module, labels: torch.Tensor | None) -> tuple[int, str, str] | None:
    """How many values ``labels`` can take, what they are, and what to do about one out of range: the output
    vocabulary of a language-model head, the classes of a single-label classification head; ``None`` when the
    model's loss is something else (regression, multi-label) or unknown."""
    if labels is None:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
    if isinstance(rows, int) and rows > 0:
        return rows, "token ids", "make the labels with the model's own tokenizer, -100 where the loss skips"
    config = getattr(model, "config", None)
    classes = getattr(config, "num_labels", None)
    classifier = type(model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification"))
    single_label = getattr(config, "problem_type", None) in (None, "single_label_classification")
    if classifier and single_label and isinstance(classes, int) and classes > 1:
        return classes, "classes", f"set num_labels (it is {classes}) to the dataset's number of classes"
    return None
