"""What a user asks of a run's plan, whichever framework runs it, checked when the callback is made.

The Lightning callback, the Hugging Face planning and the ``accelerate`` planner take the same options (margin,
effective batch, bounds on the micro batch, whether checkpointing may be turned on). ``RunOptions`` holds them,
refuses a bad one in one line naming the argument, and turns them into the ``PlanRequest`` of a run:

    options = RunOptions(margin=0.05, target_batch_size=64)
    request = options.request(capacity_bytes=..., configured=8, accumulation=2, ranks=4, include_context=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from memfit.errors import InvalidInputError
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.session import PlanRequest

__all__ = ["RunOptions", "check_flag", "check_positive"]


@dataclass(frozen=True)
class RunOptions:
    """The plan's options; ``target_batch_size`` ``None`` keeps the effective batch the run is configured with."""

    margin: float = DEFAULT_MARGIN
    target_batch_size: int | Literal["max"] | None = None
    min_batch_size: int = 1
    max_batch_size: int | None = None
    allow_checkpointing: bool = True

    def __post_init__(self) -> None:
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise InvalidInputError(f"`margin` must be a fraction in [0, 1), got {margin!r}")
        if self.target_batch_size is not None and self.target_batch_size != "max":
            check_positive("target_batch_size", self.target_batch_size, extra=", 'max' or None")
        check_positive("min_batch_size", self.min_batch_size)
        if self.max_batch_size is not None:
            check_positive("max_batch_size", self.max_batch_size)
            if self.max_batch_size < self.min_batch_size:
                bounds = f"`max_batch_size` ({self.max_batch_size}), `min_batch_size` ({self.min_batch_size})"
                raise InvalidInputError(f"{bounds}: the largest micro batch must be at least the smallest")
        check_flag("allow_checkpointing", self.allow_checkpointing)
        object.__setattr__(self, "margin", float(margin))

    def request(
        self,
        *,
        capacity_bytes: int,
        configured: int,
        accumulation: int,
        ranks: int,
        include_context: bool,
        always_checkpoint: bool = False,
        samples: int | None = None,
    ) -> PlanRequest:
        """The run's question: by default the effective batch it is configured with (micro batch x accumulation x
        data-parallel ranks) within ``capacity_bytes``, checkpointed throughout when the run already is. ``samples``
        (the training set's length, where it has one) bounds the largest micro batch (``target_batch_size="max"``):
        no batch holds more than a rank's share of it."""
        largest = self.max_batch_size
        if samples and self.target_batch_size == "max":
            share = max(self.min_batch_size, -(-samples // ranks))
            largest = share if largest is None else min(largest, share)
        return PlanRequest(
            capacity_bytes=capacity_bytes,
            margin=self.margin,
            target_batch_size=self.target_batch_size or configured * accumulation * ranks,
            world_size=ranks,
            min_batch_size=self.min_batch_size,
            max_batch_size=largest,
            allow_checkpointing=self.allow_checkpointing,
            always_checkpoint=always_checkpoint,
            include_context=include_context,
        )


def check_positive(name: str, value: Any, extra: str = "") -> None:
    """Refuse ``value`` of argument ``name`` unless it is a positive integer (``extra``: what else it may be)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"`{name}` must be a positive integer{extra}, got {value!r}")


def check_flag(name: str, value: Any) -> None:
    """Refuse ``value`` of a yes/no argument unless it is ``True`` or ``False`` (``"no"`` would read as yes)."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"`{name}` must be True or False, got {value!r}")
