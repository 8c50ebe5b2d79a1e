"""What a run takes at its start, decided on one rank from the port's batch, step and layout.

``decide`` is the rank-zero half of ``RunController.plan_run``: it reads what the port knows (the device
planned for, the layout over ranks, one sample batch, the batch the run is configured with, the framework's
training step), traces the step as configured, and either only predicts it (``mode="observe"``) or plans it
through a ``PlanningSession`` (``mode="plan"``). What it returns, a ``RunDecision``, holds no tensor, so a
framework can broadcast it to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from memfit.errors import InsufficientMemoryError, ShardingNotModelledError
from memfit.planning.planner import budget_phrase
from memfit.planning.session import PlanningSession
from memfit.planning.unmodelled import not_modelled
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.run.controller import RunController
    from memfit.run.port import PlanningPort

__all__ = ["RunDecision", "check_evaluation", "decide"]


@dataclass
class RunDecision:
    """What every rank applies: the plan (``Plan.to_dict()``, or ``None``), and the predictions drift is measured
    against."""

    plan: dict[str, Any] | None
    predicted_allocated_bytes: int | None
    predicted_reserved_bytes: int | None
    error: str | None = None
    insufficient_memory: bool = False  # the error is the verdict that nothing fits: it stops the run
    failure: BaseException | None = None  # what planning raised, for a port whose planning call raises it
    measured_only: bool = False  # nothing predicted: log the measured peaks alone
    # the predicted (allocated, reserved) peak of the run as configured: what is measured against if the plan
    # cannot be applied and the run trains as configured
    as_configured: tuple[int, int] | None = None


def decide(controller: RunController, capacity: int) -> RunDecision:
    """Plan (or, in observe mode, predict) the run on this rank for ``capacity`` bytes a device; the controller
    keeps the session, the estimate and the plan. Raises what planning raises (the controller says it once)."""
    port, options = cast("PlanningPort", controller.port), controller.options
    planning = port.planning_target()
    unplannable = port.unplannable()
    if unplannable is not None:
        controller.warn("unplannable", unplannable)
        return RunDecision(None, None, None, measured_only=True)
    try:
        layout = port.layout()
    except ShardingNotModelledError as error:
        if controller.raise_errors:
            raise
        controller.warn("sharding", not_modelled(str(error)))
        return RunDecision(None, None, None, measured_only=True)
    device = port.device()
    planning.check_precision(port.precision())
    notes = [note] if (note := planning.note(device)) else []
    notes += layout.notes
    sample = port.sample_batch(notes)
    configured = port.configured_batch(sample)
    accumulation = port.accumulation()
    step = port.training_step(sample, planning.target, layout, tuple(notes))
    session = PlanningSession(step.trace_at, batch_size=configured, accumulation_steps=accumulation)
    controller.session, controller.notes = session, notes
    controller.include_context = planning.include_context
    controller.traced = session.trace_at(configured, layout.checkpointing, accumulation)
    if controller.mode == "observe":
        return _observed(controller, capacity, configured)
    controller.samples = port.training_samples()
    request = options.request(capacity_bytes=capacity, configured=configured, accumulation=accumulation,
                              ranks=layout.data_parallel_size or port.world_size(),
                              include_context=planning.include_context, always_checkpoint=layout.checkpointing,
                              samples=controller.samples)  # fmt: skip
    as_configured = controller.traced.at(configured)
    controller.configured_traced = controller.traced
    try:
        decision = session.decide_run(request, device=device, notes=notes, restored=controller.restored)
    except InsufficientMemoryError as error:  # what the traced batch rests on can be why: said with the verdict
        if not notes:
            raise
        raise InsufficientMemoryError(f"{error} (planned on: {'; '.join(notes)})") from error
    plan = controller.plan = decision.plan
    controller.traced = decision.traced
    check_evaluation(controller, capacity)
    return RunDecision(plan.to_dict(), plan.predicted_allocated_bytes, plan.predicted_reserved_bytes,
                       as_configured=(as_configured.allocated_bytes, as_configured.reserved_bytes))  # fmt: skip


def _observed(controller: RunController, capacity: int, configured: int) -> RunDecision:
    """Observe mode: the run as configured, predicted and said; a warning when it is over the budget."""
    assert controller.traced is not None
    if capacity > 0:
        check_evaluation(controller, capacity)
    peak = controller.traced.at(configured)
    needed = peak.device_bytes if controller.include_context else peak.reserved_bytes
    if controller.verbose:  # the prediction, and what it rests on that can change it
        controller.info(f"memfit: predicted peak {format_bytes(needed)} at micro batch {configured} (observe mode: "
                        "the run trains as configured)")  # fmt: skip
        for note in controller.notes:
            controller.info(f"memfit: {note}")
    margin = controller.options.margin
    budget = int(capacity * (1 - margin))
    if 0 < budget < needed:
        controller.warn("observe-over", f"memfit: the predicted peak, {format_bytes(needed)} at micro batch "
                        f"{configured}, is over the {budget_phrase(capacity, margin, budget)}: this run may run out "
                        "of memory; mode='plan' picks a micro batch that fits")  # fmt: skip
    return RunDecision(None, peak.allocated_bytes, peak.reserved_bytes)


def check_evaluation(controller: RunController, capacity: int) -> None:
    """Warn when the run's evaluation pass, beside the optimizer state training leaves, would not fit where
    training does (the port predicts the pass; ``None`` when the run evaluates nothing)."""
    assert controller.traced is not None
    controller.evaluation = evaluation = cast("PlanningPort", controller.port).evaluation(controller.traced.estimate)
    if evaluation is None:
        return
    margin = controller.options.margin
    budget = int(capacity * (1 - margin))
    needed = evaluation.device_bytes if controller.include_context else evaluation.reserved_bytes
    if needed > budget:
        controller.warn("validation",
            f"memfit: validation may run out of memory where training fits: {evaluation.summary()}, over the "
            f"{budget_phrase(capacity, margin, budget)}. Lower the validation batch size.")  # fmt: skip
