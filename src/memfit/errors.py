"""Exceptions memfit raises. Each message says what failed, where, and what to do about it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "EstimationError",
    "InsufficientMemoryError",
    "InvalidInputError",
    "MemfitError",
    "ShardingNotModelledError",
    "StrictModeError",
    "TraceError",
    "UnrecoverableOutOfMemoryError",  # noqa: F822 (made on first use: see __getattr__)
    "ValueDependentError",
]


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose."""


class InvalidInputError(MemfitError, ValueError):
    """An argument memfit was given cannot be used (wrong type, unknown name, impossible value)."""


class EstimationError(MemfitError):
    """An estimate could not be produced."""


class TraceError(EstimationError):
    """The traced training step failed: the model, the sample, the loss or the optimizer raised."""


class ValueDependentError(TraceError):
    """The model reads tensor *values* (``.item()``, ``nonzero``, masks) that a fake-tensor trace lacks."""


class ShardingNotModelledError(MemfitError):
    """A distributed strategy memfit cannot predict per rank (tensor or pipeline parallelism, ZeRO++'s
    quantized or hierarchical partitions): the message names it; the callbacks then plan nothing."""


class InsufficientMemoryError(MemfitError):
    """Not even the smallest allowed micro batch fits the memory budget."""


class CheckpointingUnavailableError(InvalidInputError):
    """Checkpointing was asked of a model with no blocks memfit can find to checkpoint (none repeated, none named)."""


class NoCountFitsError(InvalidInputError):
    """``--gpus auto`` searched every count of GPUs up to its limit and the step fits on none: the answer is "no",
    with the figures of the counts it tried (an ``InvalidInputError`` for callers that catch those).

    ``considered``: each count's figures, as ``--json`` prints them; ``lines``: each count's line, as the text answer
    prints them; ``budget_bytes``: the budget they were weighed against."""

    def __init__(
        self,
        message: str,
        considered: tuple[dict, ...] = (),
        budget_bytes: int | None = None,
        lines: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.considered, self.budget_bytes, self.lines = considered, budget_bytes, lines


class StrictModeError(Exception):
    """A failure memfit would have turned into a warning, raised because ``MEMFIT_STRICT=1``.

    Chained to the original exception. Deliberately not a :class:`MemfitError`, so that the handlers
    that turn memfit's own errors into a decision or a warning cannot swallow it again.
    """


def __getattr__(name: str) -> Any:
    """``UnrecoverableOutOfMemoryError`` is made when first asked for: it is also torch's out-of-memory error, and
    the rest of this module is imported where torch is not (a kept answer replayed by the command line)."""
    if name != "UnrecoverableOutOfMemoryError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    class UnrecoverableOutOfMemoryError(MemfitError, torch.cuda.OutOfMemoryError):
        """Out of memory in a training step that memfit could not recover from (it says why and what to do).

        Also a ``torch.OutOfMemoryError``, so code that handles PyTorch's error handles this one too.
        """

    UnrecoverableOutOfMemoryError.__module__ = __name__
    UnrecoverableOutOfMemoryError.__qualname__ = name
    globals()[name] = UnrecoverableOutOfMemoryError
    return UnrecoverableOutOfMemoryError
