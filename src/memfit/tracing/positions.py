"""How long a sequence a model can take: learned absolute position embeddings hold one row per position.

A model with a table of positions (GPT-2's ``wpe``, BERT's ``position_embeddings``, OPT's ``embed_positions``)
fails on a longer sequence (an ``IndexError`` in the embedding lookup), so a plan for one is refused; rotary,
relative and ALiBi positions (Llama, T5, BLOOM) have no table and no such limit.
"""

from __future__ import annotations

from torch import nn

from memfit.errors import InvalidInputError

__all__ = ["check_sequence_length", "position_limit"]

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
