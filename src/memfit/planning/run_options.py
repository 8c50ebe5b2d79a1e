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

__all__ = [
    "RunOptions",
    "check_flag",
    "check_positive",
    "dropped_samples_warning",
    "last_window_scale",
    "last_window_warning",
    "summed_loss_warning",
]


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


def last_window_scale(
    samples: int | None, ranks: int, configured: tuple[int, int], planned: tuple[int, int]
) -> tuple[int, float] | None:
    """The samples in an epoch's last, incomplete accumulation window and how its update compares with the run as
    configured, for loops that divide every micro batch's loss by the full accumulation steps (Lightning,
    ``accelerate``); ``None`` when the windows come out whole or the update is the same.

    ``configured`` and ``planned`` are (micro batch, accumulation). A micro batch's mean loss weighs the same
    whatever its size, so the last window's update is (its micro batches / accumulation) x the mean: the plan
    changes it when the two splits cut the window's samples into other numbers of micro batches."""
    tails = _last_windows(samples, ranks, configured, planned)
    if tails is None or tails[0] == 0:
        return None
    tail = tails[0]
    ratio = _update_share(tail, planned) / _update_share(tail, configured)
    return None if abs(ratio - 1) < 1e-9 else (tail, ratio)


def _last_windows(
    samples: int | None, ranks: int, configured: tuple[int, int], planned: tuple[int, int]
) -> tuple[int, int] | None:
    """The samples a rank's epoch leaves in its last, incomplete accumulation window, as configured and as planned
    (0: the windows come out whole); ``None`` without a length."""
    if not samples:
        return None
    per_rank = -(-samples // ranks)
    return per_rank % (configured[0] * configured[1]), per_rank % (planned[0] * planned[1])


def _update_share(tail: int, split: tuple[int, int]) -> float:
    """A window of ``tail`` samples' update under ``split`` (micro batch, accumulation), as a share of a full one."""
    return -(-tail // split[0]) / split[1]


def _new_incomplete_window(
    samples: int | None, ranks: int, configured: tuple[int, int], planned: tuple[int, int]
) -> tuple[int, float] | None:
    """The samples of the incomplete last window the plan brings to an epoch the configured run splits into whole
    windows, and that window's update as a share of a full one; ``None`` otherwise."""
    tails = _last_windows(samples, ranks, configured, planned)
    if tails is None or tails[0] or not tails[1]:
        return None
    share = _update_share(tails[1], planned)
    return None if abs(share - 1) < 1e-9 else (tails[1], share)


def last_window_warning(
    loop: str, samples: int | None, ranks: int, configured: tuple[int, int], planned: tuple[int, int]
) -> str | None:
    """The warning a ``loop`` that divides by the full accumulation steps gets when the plan changes the update
    of each epoch's last, incomplete window (``last_window_scale``); ``None`` when it does not."""
    per_rank = " a rank" if ranks > 1 else ""
    new_tail = _new_incomplete_window(samples, ranks, configured, planned)
    if new_tail is not None:
        tail, share = new_tail
        return (
            f"memfit: at {planned[0]} x {planned[1]} each epoch ends with an incomplete accumulation window of {tail} "
            f"samples{per_rank}, which the run as configured ({configured[0]} x {configured[1]}) does not have; {loop} "
            f"divides every micro batch's loss by the full accumulation steps, so that window's update is {share:.2f} "
            "x a full one; a training set whose length is a multiple of both effective batches keeps every update "
            "whole"
        )
    found = last_window_scale(samples, ranks, configured, planned)
    if found is None:
        return None
    tail, ratio = found
    effective = configured[0] * configured[1] * ranks
    return (
        f"memfit: each epoch ends with an incomplete accumulation window of {tail} samples{per_rank}; {loop} divides "
        f"every micro batch's loss by the full accumulation steps, so at {planned[0]} x {planned[1]} that window's "
        f"update is {ratio:.2f} x the one the run as configured ({configured[0]} x {configured[1]}) makes; a "
        f"training set whose length is a multiple of the effective batch ({effective}) keeps every update as "
        "configured"
    )


def dropped_samples_warning(setting: str, samples: int | None, configured: int, planned: int) -> str | None:
    """The warning a loader that drops its last incomplete batch (``setting``, as the framework names it) gets when
    the planned batch size drops another number of its ``samples`` than the configured one; ``None`` otherwise."""
    if not samples or samples % configured == samples % planned:
        return None
    before, after = samples % configured, samples % planned
    change = f"{abs(before - after)} {'more' if before > after else 'fewer'}"
    return (
        f"memfit: {setting}=True drops the last incomplete batch: of the {samples} training samples an epoch, batches "
        f"of {configured} dropped {before}, the planned {planned} drop {after}, so each epoch trains on {change} "
        f"samples; use {setting}=False, or a training set whose length both batch sizes divide, to keep the epoch as "
        "configured"
    )


def summed_loss_warning(loop: str, configured: tuple[int, int], planned: tuple[int, int]) -> str | None:
    """The warning a ``loop`` that divides every micro batch's loss by the accumulation steps gets when its loss is a
    sum over the batch (``loss_reduction="sum"``) and the plan changes the accumulation: each update then scales by
    configured / planned steps. ``None`` when the accumulation stays."""
    (micro_c, steps_c), (micro_p, steps_p) = configured, planned
    if steps_c == steps_p:
        return None
    return (
        f"memfit: loss_reduction='sum': {loop} divides every micro batch's loss by the accumulation steps, so at "
        f"{micro_p} x {steps_p} each update is {steps_c / steps_p:.2f} x the one the run as configured "
        f"({micro_c} x {steps_c}) makes; multiply the loss by the accumulation steps in training_step, or average it "
        "over the batch, to keep the updates as configured"
    )
