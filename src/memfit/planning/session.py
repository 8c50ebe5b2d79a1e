"""One planning session: trace the step at the sizes the planner asks for, plan, confirm, decide.

The Lightning callback, the Hugging Face integration and ``memfit plan`` all plan the same way:
trace the step as configured, let ``memfit.plan`` search micro batch, accumulation and
checkpointing, confirm the choice on a trace of exactly that configuration, and keep that trace as
the prediction the run is measured against. They differ only in how they trace (the framework's
step, a preset on ``meta``) and where the answer goes, so this module takes the tracing as a
function and returns a ``Decision``:

    session = PlanningSession(trace_at, batch_size=8, accumulation_steps=2)
    decision = session.decide(PlanRequest(capacity_bytes=..., target_batch_size=16))
    decision.plan, decision.traced  # the plan, and the trace of the step it will run (a StepCurve)

The plan's micro batch is the largest whose whole-step trace fits: ``memfit.plan`` searches on
``trace_at`` (bracketing from the interpolation's answer) until a micro batch fits and the next one
does not. Traces are cached per ``(micro batch, checkpointing, accumulation)``: the search and the
confirmation often ask for the same one; ``traced`` lists them in the order they were taken.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memfit.diagnostics import warn_once
from memfit.errors import InvalidInputError
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan, plan
from memfit.prediction.curve import StepCurve
from memfit.simulation.allocator import AllocatorConfig
from memfit.units import format_bytes, format_margin

__all__ = ["Decision", "PlanRequest", "PlanningSession", "TraceAt"]

# trace_at(micro_batch, checkpointing, accumulation_steps) -> the step traced at that configuration
TraceAt = Callable[[int, bool, int], StepCurve]


@dataclass(frozen=True)
class PlanRequest:
    """What the plan must satisfy, as the user configured it."""

    capacity_bytes: int
    margin: float = DEFAULT_MARGIN
    target_batch_size: int | Literal["max"] | None = None  # None: the configured batch x world size
    world_size: int = 1
    min_batch_size: int = 1
    max_batch_size: int | None = None
    allow_checkpointing: bool = True
    always_checkpoint: bool = False  # the user already turned checkpointing on: plan with it
    include_context: bool = True  # False when the capacity was measured with the CUDA context already in it
    # the caching allocator's options (None: this process's PYTORCH_ALLOC_CONF); at_limit: fit where the allocator,
    # freeing its cache and retrying, really runs out of memory (False: on the peak with room to spare)
    allocator: AllocatorConfig | None = None
    at_limit: bool = True


@dataclass(frozen=True)
class Decision:
    """The plan and the trace of exactly the step it runs (micro batch, checkpointing, accumulation)."""

    plan: Plan
    traced: StepCurve


class PlanningSession:
    """Plan one training step from traces, each taken once.

    Args:
        trace_at: traces the whole step at ``(micro_batch, checkpointing, accumulation_steps)``.
        batch_size, accumulation_steps: the configuration the run was given; its trace is the
            ``baseline`` (what ``observe`` mode measures against).
        search_at: a cheaper stand-in for ``trace_at`` while searching (e.g. an extrapolation in
            depth); the chosen plan is always confirmed on ``trace_at``. Default: ``trace_at``.
    """

    def __init__(
        self,
        trace_at: TraceAt,
        *,
        batch_size: int,
        accumulation_steps: int = 1,
        search_at: TraceAt | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.accumulation_steps = accumulation_steps
        traced: list[tuple[int, bool, int]] = []
        self._traced = traced

        def traced_once(micro_batch: int, checkpointing: bool, accumulation_steps: int) -> StepCurve:
            # no reference to the session here: a cycle would keep the traced sample batch (real tensors
            # on the run's device) alive into training until the garbage collector ran
            traced.append((micro_batch, checkpointing, accumulation_steps))
            return trace_at(micro_batch, checkpointing, accumulation_steps)

        self._trace_at = functools.cache(traced_once)
        self._search_at = functools.cache(search_at) if search_at is not None else self._trace_at

    @property
    def baseline(self) -> StepCurve:
        """The step as configured (no checkpointing unless the trace itself turns it on)."""
        return self._trace_at(self.batch_size, False, self.accumulation_steps)

    @property
    def traced(self) -> tuple[tuple[int, bool, int], ...]:
        """The configurations ``trace_at`` has traced (each once), in order: what planning cost in traces."""
        return tuple(self._traced)

    def trace_at(self, micro_batch: int, checkpointing: bool, accumulation_steps: int) -> StepCurve:
        """The whole step traced at that configuration (cached)."""
        return self._trace_at(micro_batch, checkpointing, accumulation_steps)

    def search_at(self, micro_batch: int, checkpointing: bool, accumulation_steps: int) -> StepCurve:
        """The estimate the search uses at that configuration (cached; ``trace_at`` unless extrapolated)."""
        return self._search_at(micro_batch, checkpointing, accumulation_steps)

    def decide(self, request: PlanRequest) -> Decision:
        """Search on whole traces, and return the plan with the trace of the step it runs.

        The plan's ``largest_micro_batch`` fits by ``trace_at`` (with the fewest accumulation steps its
        target needs) and the next micro batch does not, unless the target or ``max_batch_size`` caps it;
        its split of the target (``micro_batch_size`` x ``accumulate_grad_batches``) fits by ``trace_at`` too.

        Raises:
            InsufficientMemoryError: not even ``min_batch_size`` fits, with checkpointing if allowed.
        """
        always = request.always_checkpoint
        start = self.search_at(self.batch_size, always, self.accumulation_steps)
        chosen = plan(
            start,
            request.capacity_bytes,
            margin=request.margin,
            target_batch_size=request.target_batch_size,
            world_size=request.world_size,
            min_batch_size=request.min_batch_size,
            max_batch_size=request.max_batch_size,
            allow_checkpointing=request.allow_checkpointing and not always,
            checkpointed=lambda: self.search_at(self.batch_size, True, self.accumulation_steps),
            include_context=request.include_context,
            allocator=request.allocator,
            at_limit=request.at_limit,
            confirm=lambda micro, checkpointing, accumulation: self.trace_at(
                micro, checkpointing or always, accumulation
            ),
        )
        if always and not chosen.gradient_checkpointing:
            chosen = dataclasses.replace(chosen, gradient_checkpointing=True)
        exact = self.trace_at(chosen.micro_batch_size, chosen.gradient_checkpointing, chosen.accumulate_grad_batches)
        return Decision(chosen, exact)

    def decide_run(
        self,
        request: PlanRequest,
        *,
        device: object,
        notes: Sequence[str] = (),
        restored: Mapping[str, Any] | None = None,
    ) -> Decision:
        """What a training run takes, whichever framework runs it: the plan it saved when it resumes (``restored``,
        a ``Plan.to_dict()``) with the trace of its step, else the plan for ``request``; each note the plan rests on
        (what the sample or the device could not tell) becomes one of its reasons.

        Raises:
            InvalidInputError: ``request`` has no capacity (the free memory of ``device`` could not be measured).
            InsufficientMemoryError: as ``decide``.
        """
        if restored is not None:
            chosen = Plan.from_dict(dict(restored)).with_reason("restored from the checkpoint")
            traced = self.trace_at(chosen.micro_batch_size, chosen.gradient_checkpointing,
                                   chosen.accumulate_grad_batches)  # fmt: skip
            over = restored_over_budget(chosen, traced, request.capacity_bytes, request.margin, request.include_context)
            if over is not None:
                warn_once(over, over)
        else:
            if request.capacity_bytes <= 0:
                raise InvalidInputError(
                    f"could not measure free memory on {device}; pass budget= (bytes, '20GiB' or a GPU name)"
                )
            decision = self.decide(request)
            chosen = dataclasses.replace(decision.plan, configured_accumulation=self.accumulation_steps)
            traced = decision.traced
        for note in notes:
            chosen = chosen.with_reason(note)
        return Decision(chosen, traced)


def restored_over_budget(
    restored: Plan, traced: StepCurve, capacity_bytes: int, margin: float, include_context: bool
) -> str | None:
    """Why a plan restored on resume may not fit the budget the run is given now (a warning), or ``None``. The run
    keeps the saved plan, so that its batches stay the ones it started with."""
    budget = int(capacity_bytes * (1 - margin))
    peak = traced.at(restored.micro_batch_size)
    needed = peak.device_bytes if include_context else peak.reserved_bytes
    if capacity_bytes <= 0 or needed <= budget:
        return None
    return (
        f"memfit: the plan restored from the checkpoint (micro batch {restored.micro_batch_size} x "
        f"{restored.accumulate_grad_batches}) is predicted at {format_bytes(needed)}, over the "
        f"{format_bytes(capacity_bytes)} budget given now ({format_bytes(budget)} after its {format_margin(margin)} "
        "margin); the run keeps the saved plan so that its batches stay as they were: resume with a larger budget, "
        "or start afresh to plan for this one"
    )
