"""``RunController``: everything memfit does in a training run, whichever loop runs it.

A training framework (Lightning, the Hugging Face Trainer, a custom ``accelerate`` loop) knows where its device,
its processes and its trackers are, and how to read its batch and step; memfit knows what to do with them. The
framework's port (``memfit.run.port.RunPort``) translates, and calls the controller at the loop's moments:

* ``plan_run()`` at setup: every rank's capacity, the smallest taken; one rank decides (``memfit.run.deciding``),
  every rank applies the same plan through the port, or trains as configured when it cannot;
* ``load_state_dict`` on resume: the plan saved in the checkpoint replaces a fresh one;
* ``training_started`` before the first batch: measuring against the prediction, the timeline and the plan sent
  to the trackers, the training step wrapped for the out-of-memory recovery;
* ``optimizer_step_ended`` / ``batch_ended`` after each step: windows measured on the loop's cadence, every
  rank's peaks gathered, drift logged, alarms warned; ``training_ended``: the last window, the drift picture and
  the final line.

It owns the out-of-memory recovery (``OOMRecovery``: its construction, the chunked step's order of calls through
a data-parallel wrapper, the ranks' agreement on a chunk, each recovery's warning and metrics) and says each
warning once. Nothing here imports a framework.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from memfit.diagnostics import degrade, raise_if_strict
from memfit.errors import InsufficientMemoryError, InvalidInputError, MemfitError
from memfit.planning.planner import Plan
from memfit.planning.run_options import RunOptions
from memfit.planning.session import PlanningSession, restored_over_budget
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate
from memfit.prediction.evaluation import EvaluationPeak
from memfit.reporting.figures import drawn, matplotlib_available
from memfit.run import deciding
from memfit.run.deciding import RunDecision
from memfit.run.port import PlanningPort, RunLayout, RunPort, TrainingStep
from memfit.run.ranks import per_rank_metrics
from memfit.run.recovery import OPTIMIZER_STEP_OOM, LossReduction, OnOOM, OOMRecovery, Recovery, is_out_of_memory
from memfit.run.run_monitor import RunMonitor
from memfit.tracing.checkpointing import CheckpointTarget, enable_checkpointing
from memfit.units import format_bytes

__all__ = ["ControlledRun", "PlanningPort", "RunController", "RunDecision", "RunPort"]

_PLAN_KEYS = ("micro_batch_size", "accumulate_grad_batches", "gradient_checkpointing")


class RunController:
    """Plans a run through its ``RunPort``, measures it against the prediction, and recovers from OOM errors.

    Args:
        port: the framework's side (``RunPort``; ``PlanningPort`` for ``plan_run``).
        options: what the plan must satisfy (``RunOptions``); its margin is also the drift alarm's.
        mode: ``"plan"`` applies the plan; ``"observe"`` only predicts the run as configured.
        on_oom: ``"replan"``: recover from an out-of-memory error in a step; ``"raise"``: let it end the run.
        loss_reduction: how the loss reduces a batch (``"mean"`` or ``"sum"``): it weights the chunks' losses.
        verbose: say the plan and the final drift line.
        advice: the library's advice in planning errors (``forward_fn=``, ``loss_fn=``), as this framework says it.
        checkpoint_modules: the blocks a recovery checkpoints in a model without a switch of its own.
    """

    def __init__(
        self,
        port: RunPort,
        *,
        options: RunOptions | None = None,
        mode: str = "plan",
        on_oom: OnOOM = "replan",
        loss_reduction: LossReduction = "mean",
        verbose: bool = True,
        advice: Mapping[str, str] | None = None,
        checkpoint_modules: CheckpointTarget | None = None,
    ) -> None:
        self.port = port
        self.options = options or RunOptions()
        self.mode, self.on_oom, self.loss_reduction, self.verbose = mode, on_oom, loss_reduction, verbose
        self.advice = dict(advice or {})
        self.checkpoint_modules = checkpoint_modules
        self.raise_errors = False  # planning raises what fails (a loop that plans in a call of its own)
        self.plan: Plan | None = None
        self.traced: StepCurve | None = None  # the step that runs (rank 0's trace)
        self.evaluation: EvaluationPeak | None = None
        self.decision: RunDecision | None = None
        self.session: PlanningSession | None = None  # rank 0's, kept to trace a plan restored on resume
        self.configured_traced: StepCurve | None = None  # rank 0's trace of the run as configured
        self.notes: list[str] = []  # what the choice of the traced batch could not know
        self.samples: int | None = None  # the training set's length, where it has one
        self.include_context = True  # whether the plan counted the CUDA context within the budget
        self.restored: dict[str, Any] | None = None  # the plan a checkpoint holds
        self.capacity = 0  # the smallest capacity of all ranks, planned for
        self.pending: InsufficientMemoryError | None = None  # nothing fits: raised when training starts
        self.monitor: RunMonitor | None = None
        self.recovery: OOMRecovery | None = None
        self.warned: set[str] = set()
        self.measuring = False  # every rank measures once the decision says so: window ends then gather
        self._last_window = -1
        self._steps_seen = 0
        self._plan_logged = False

    @property
    def margin(self) -> float:
        return self.options.margin

    # ------------------------------------------------------------------ saying things
    def warn(self, key: str, message: str) -> None:
        """One warning per kind of event and run."""
        if key not in self.warned:
            self.warned.add(key)
            self.port.warn(message)

    def info(self, message: str) -> None:
        self.port.info(message)

    def say_plan(self, plan: Plan) -> None:
        if self.verbose:
            self.info("memfit plan: " + plan.summary() + "".join(f"\n  - {r}" for r in plan.reasons))

    # ------------------------------------------------------------------ planning
    def plan_run(self, *, raise_errors: bool = False) -> None:
        """At setup, on every rank: the smallest capacity of all ranks, one decision (rank 0's, broadcast, or every
        rank's own where the port says so), applied on every rank. A budget nothing fits in raises
        ``InsufficientMemoryError`` when training starts (a run resumed from a checkpoint takes the checkpoint's plan
        instead); any other failure is one warning and the run trains as configured. With ``raise_errors`` (a loop
        that plans in a call of its own) both are raised at once, on every rank."""
        port = cast(PlanningPort, self.port)
        self.raise_errors = raise_errors
        try:
            capacity = port.planning_target().capacity_bytes(port.device())
        except InvalidInputError:  # no device to plan for: the decision says why
            capacity = 0
        self.capacity = smallest = min(self._gather_ints(capacity))
        decides_here = port.every_rank_decides or port.rank() == 0
        decision = self._decide_or_say_why(smallest, raise_errors) if decides_here else None
        self.decision = decision = decision if port.every_rank_decides else port.broadcast(decision)
        if decision.insufficient_memory and raise_errors:
            raise InsufficientMemoryError(decision.error)
        if decision.insufficient_memory:  # raised before the first batch, unless a checkpoint's plan replaces it
            self.pending = InsufficientMemoryError(decision.error)
            return
        if decision.failure is not None:
            raise decision.failure
        if decision.error is not None:
            self.warn("plan", f"memfit could not plan this run ({decision.error}); training continues as configured.")
        elif decision.plan is not None and self.mode == "plan":
            if self.apply(decision.plan):
                self.plan = self.plan or Plan.from_dict(decision.plan)  # every rank holds the plan it runs
                return
            # the run trains as configured: nothing says otherwise, and drift is measured against its own prediction
            self.plan, decision.plan = None, None
            if decision.as_configured is not None:
                decision.predicted_allocated_bytes, decision.predicted_reserved_bytes = decision.as_configured
                self.traced = self.configured_traced

    @property
    def estimate(self) -> MemoryEstimate | None:
        """The prediction of the step that runs, as a value (``traced.estimate``)."""
        return self.traced.estimate if self.traced is not None else None

    def _decide_or_say_why(self, capacity: int, raise_errors: bool) -> RunDecision:
        try:
            return deciding.decide(self, capacity)
        except InsufficientMemoryError as error:
            return RunDecision(None, None, None, error=str(error), insufficient_memory=True)
        except Exception as error:  # never let memfit end the run (one warning once every rank knows)
            if raise_errors:
                return RunDecision(None, None, None, error=str(error), failure=error)
            reason = str(error) if isinstance(error, MemfitError) else f"{type(error).__name__}: {error}"
            for library, framework in self.advice.items():
                reason = reason.replace(library, framework)
            raise_if_strict(f"memfit could not plan this run ({reason})", error)
            return RunDecision(None, None, None, error=reason, measured_only=True)  # the run is still measured

    def apply(self, plan: dict[str, Any]) -> bool:
        """The plan through the port, all or nothing, and said; whether the run now runs it."""
        if not self.port.apply(Plan.from_dict(plan)):
            return False
        self.say_plan(Plan.from_dict(plan))
        return True

    def _gather_ints(self, value: int) -> Sequence[int]:
        if self.port.world_size() <= 1:
            return [value]
        gathered = self.port.all_gather(torch.tensor([value], dtype=torch.int64, device=self.port.device()))
        return [int(v) for v in gathered.flatten().tolist()]

    # ------------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The plan a checkpoint holds: kept for the decision when it comes before it, applied at once after."""
        self.restored = state.get("plan")
        if self.restored and self.decision is not None:
            self.restore(self.restored)

    def restore(self, saved: dict[str, Any]) -> None:
        """On resume, keep the plan the run started with instead of whatever a fresh plan says."""
        if self.mode != "plan":
            return
        self.pending = None  # the run takes the plan it started with, whatever a fresh plan says
        current = self.plan.to_dict() if self.plan else None
        if current is not None and all(current[k] == saved[k] for k in _PLAN_KEYS):
            return
        if current is not None and current["gradient_checkpointing"] and not saved["gradient_checkpointing"]:
            self.warn("resume", "memfit: resuming without checkpointing as the run started, though a fresh plan "
                      "would use it")  # fmt: skip
        self.plan = Plan.from_dict(saved).with_reason("restored from the checkpoint")
        if self.verbose and current is not None:
            self.info("memfit: the checkpoint holds the plan the run started with; it replaces the plan above")
        self.apply(self.plan.to_dict())  # said with the reason it was restored
        if self.session is not None:  # rank 0 planned: the trace of the step the restored plan runs
            micro, checkpointing = saved["micro_batch_size"], saved["gradient_checkpointing"]
            self.traced = self.session.trace_at(micro, checkpointing, saved["accumulate_grad_batches"])
            over = restored_over_budget(self.plan, self.traced, self.capacity, self.margin, self.include_context)
            if over is not None:
                self.warn("restored-over-budget", over)
        if self.decision is not None:  # every rank measures against the restored plan's own prediction
            self.decision.plan = saved
            self.decision.predicted_allocated_bytes = saved["predicted_allocated_bytes"]
            self.decision.predicted_reserved_bytes = saved["predicted_reserved_bytes"]

    # ------------------------------------------------------------------ measuring
    def training_started(self, step: int, *, figure_step: int | None = None) -> None:
        """Before the first batch, on every rank: measuring against the decision's prediction, the timeline and the
        plan sent to the trackers (rank 0), and the step wrapped for the out-of-memory recovery."""
        if self.pending is not None:  # nothing fits, and no checkpoint's plan replaced the verdict
            raise self.pending
        self.session = None  # a restored plan has been traced by now; the session holds the sample batch
        self._steps_seen = step
        decision = self.decision
        measured = decision is not None and (decision.predicted_allocated_bytes is not None or decision.measured_only)
        if (
            measured
            and self.start_measuring(
                predicted_allocated_bytes=decision.predicted_allocated_bytes,
                predicted_reserved_bytes=decision.predicted_reserved_bytes,
                traced=self.traced,
            )
            and self.port.rank() == 0
        ):
            if self.estimate is not None:
                capacity = (decision.plan or {}).get("budget_bytes")
                self.figure("memfit/timeline", lambda: _plot("plot_timeline", self.estimate, capacity_bytes=capacity),
                            step if figure_step is None else figure_step)  # fmt: skip
            if not self._plan_logged and (decision.plan is not None or self.mode == "observe"):
                self._plan_logged = True  # the plan, or in observe mode the prediction of the run as configured
                params = {f"memfit/{k}": v for k, v in (decision.plan or {}).items() if k != "reasons"} or {
                    "memfit/predicted_allocated_bytes": decision.predicted_allocated_bytes,
                    "memfit/predicted_reserved_bytes": decision.predicted_reserved_bytes,
                }
                self.port.log_plan({**params, "memfit/mode": self.mode})
        self.install_recovery(checkpointing_on=bool(self.mode == "plan" and self.plan and
                                                    self.plan.gradient_checkpointing))  # fmt: skip

    def measure_configured(self, step: TrainingStep, micro_batch: int, accumulation: int) -> None:
        """Trace the step about to run, as configured, and measure the run against it; against the figures the plan
        quotes where the run runs the plan (traced on the batch it was planned on, the longest, so the two agree
        whatever batch the loader hands out first). Says the prediction."""
        self.traced = traced = step.trace_at(micro_batch, False, accumulation)
        peak, plan = traced.at(micro_batch), self.plan
        allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
        runs_plan = plan is not None and (plan.micro_batch_size, plan.accumulate_grad_batches) == (
            micro_batch,
            accumulation,
        )
        # a CPU run is measured by its process's RSS, never against a prediction: where the plan's figures are a CUDA
        # device's (budget="h100" on a laptop: its peak holds the CUDA context), its own trace's tensors are its figure
        cuda_plan = plan is not None and plan.predicted_peak_bytes > plan.predicted_reserved_bytes
        if plan is not None and runs_plan and (traced.estimate.device == "cuda" or not cuda_plan):
            allocated = plan.predicted_allocated_bytes or allocated
            reserved = plan.predicted_reserved_bytes or reserved
        self.start_measuring(predicted_allocated_bytes=allocated, predicted_reserved_bytes=reserved, traced=traced)
        if self.verbose:
            on_cuda = traced.estimate.device == "cuda"
            figure = f"reserved {format_bytes(reserved)} (allocated {format_bytes(allocated)})" if on_cuda else \
                f"{format_bytes(allocated)} of tensors"  # fmt: skip
            said = ""
            if plan is not None:
                budget = plan.budget_bytes
                over = f", over the {format_bytes(budget)} it planned within" if reserved > budget else ""
                said = f"; the plan it runs: {plan.summary()}" if runs_plan else \
                    f" accumulating {accumulation}, not the plan ({plan.summary()}){over}"  # fmt: skip
            self.info(f"memfit: predicted peak of this {self.port.device().type.upper()} run {figure} at micro batch "
                      f"{micro_batch}{said}")  # fmt: skip

    def measure_against_plan(self, layout: RunLayout, *, without_plan: str) -> None:
        """A sharded run whose model is sharded by the time memfit sees it (nothing whole is left to trace): measured
        against the plan's per-rank prediction, or its measured peaks alone, with one warning (``without_plan``: how
        to give it a plan), without a plan."""
        plan = self.plan
        if plan is None:
            self.warn("sharding", f"memfit: under {layout.label} the model is already sharded here, so there is no "
                      f"whole model to predict from; {without_plan} to measure each rank against its prediction. "
                      "Logging the measured peaks only.")  # fmt: skip
        self.start_measuring(predicted_allocated_bytes=plan.predicted_allocated_bytes if plan else None,
                             predicted_reserved_bytes=plan.predicted_reserved_bytes if plan else None,
                             traced=None)  # fmt: skip
        if self.verbose and plan is not None:
            self.info(f"memfit: measuring each rank of this {layout.label} run against the plan's per-rank "
                      f"prediction: {plan.summary()}")  # fmt: skip

    def start_measuring(
        self,
        *,
        predicted_allocated_bytes: int | None,
        predicted_reserved_bytes: int | None,
        traced: StepCurve | None,
    ) -> bool:
        """Start measuring windows against these predicted peaks (``None``: measured peaks only). A device memfit
        cannot measure costs one warning and ``False``; the run goes on, and its windows still end on every rank
        (their gather is a collective)."""
        self.measuring, self._last_window = True, -1
        try:
            self.monitor = RunMonitor.start(
                self.port.device(),
                predicted_allocated_bytes=predicted_allocated_bytes,
                predicted_reserved_bytes=predicted_reserved_bytes,
                traced=traced,
                margin=self.margin,
                warn=self.warn,
            )
        except Exception as error:
            degrade(f"memfit cannot measure memory here ({type(error).__name__}: {error}); no drift is logged.", error,
                    key="measure", seen=self.warned)  # fmt: skip
            return False
        return True

    def end_window(self, step: int) -> dict[str, float]:
        """End the measuring window at ``step`` on every rank (the gather is a collective); log and return its
        metrics, with every rank's own peaks as ``memfit/rank{r}/<key>`` when there are several."""
        metrics = (self.monitor.observe(step) if self.monitor is not None else None) or {}
        if self.port.world_size() > 1:
            metrics = {**metrics, **per_rank_metrics(metrics, self.port.all_gather, device=self.port.device())}
        if metrics:
            self.port.log_scalars(metrics, step)
        return metrics

    def batch_ended(self, step: int, *, every: int, counted: int | None = None) -> None:
        """After each training batch, with ``step`` the optimizer steps so far: when one ran, the accumulation
        window is done with and a measuring window may end (``optimizer_step_ended``)."""
        stepped, self._steps_seen = step != self._steps_seen, step
        if stepped:
            self.end_accumulation_window()
            self.optimizer_step_ended(step, every=every, counted=counted)

    def optimizer_step_ended(self, step: int, *, every: int, counted: int | None = None) -> None:
        """After an optimizer step, on every rank: end the window when ``counted`` (default ``step``; a loop that
        counts its logging steps otherwise passes its own count) is a multiple of ``every``."""
        if (
            not self.measuring
            or step == 0
            or step == self._last_window
            or (step if counted is None else counted) % every
        ):
            return
        self._last_window = step
        self.end_window(step)

    def training_ended(self, step: int, *, speaker: bool, figure_step: int | None = None) -> None:
        """After training, on every rank: the last window if it has not ended at ``step``; then, on the rank that
        speaks for the run, the drift picture (at ``figure_step``, default ``step``) and the final line."""
        if not self.measuring:
            return
        if step != self._last_window:
            self._last_window = step
            self.end_window(step)
        if speaker:
            self.finish(step if figure_step is None else figure_step)

    def figure(self, name: str, make: Callable[[], Any], step: int) -> None:
        """Draw (with matplotlib, else nothing) and send to the port's trackers; a drawing that fails warns once."""
        if not matplotlib_available():
            return
        drawing = drawn(make, name, seen=self.warned)
        if drawing is not None:
            self.port.log_figure(name, drawing, step)

    def finish(self, step: int) -> None:
        """At the end of training: the drift picture and the final line."""
        if self.monitor is None:
            return
        series = self.monitor.drift_series()
        if series is not None:
            self.figure("memfit/drift", lambda: _plot("plot_drift", *series), step)
        line = self.monitor.final_line()
        if line is not None and self.verbose:
            self.info(line)

    # ------------------------------------------------------------------ out-of-memory recovery
    def install_recovery(self, *, checkpointing_on: bool) -> None:
        """Wrap the framework's step so each batch runs through ``OOMRecovery`` (``on_oom="replan"``): each recovery
        is one warning with the old and new plan, and its metrics go to the trackers. A step the port cannot wrap
        costs one warning and leaves the run as it is."""
        self.port.uninstall_step()  # a run that ended in an error left its wrapper: never wrap it twice
        if self.on_oom != "replan":
            return
        unsupported = self.port.recovery_unsupported()
        if unsupported is not None:
            self.warn("recovery", unsupported)
            return
        self.recovery = OOMRecovery(
            reset_gradients=lambda: self.port.trained_module().zero_grad(set_to_none=True),
            traced=self.traced,
            margin=self.margin,
            enable_checkpointing=self._enable_checkpointing if self.options.allow_checkpointing else None,
            checkpointing_on=checkpointing_on,
            loss_reduction=self.loss_reduction,
            distributed=self.port.world_size() > 1,
            on_recovery=self._recovered,
        )
        try:
            self.port.install_step(self.recovery)
        except Exception as error:  # never let memfit end the run
            self.port.uninstall_step()
            self.recovery = None
            degrade(f"memfit cannot recover from out-of-memory errors in this run ({type(error).__name__}: {error}); "
                    "an out-of-memory error will end it as usual", error, key="recovery", seen=self.warned)  # fmt: skip

    def _enable_checkpointing(self) -> Any:
        return enable_checkpointing(self.port.trained_module(), self.checkpoint_modules)

    def failed(self, error: BaseException, *, in_optimizer_step: bool) -> None:
        """The run stopped on ``error``: say why memfit could not help when it was the optimizer step's OOM."""
        if self.recovery is not None and in_optimizer_step and is_out_of_memory(error):
            self.warn("optimizer-oom", OPTIMIZER_STEP_OOM)

    def end_accumulation_window(self) -> None:
        """After the optimizer step: the window's kept batches are done with."""
        if self.recovery is not None:
            self.recovery.end_window()

    def agree_across_ranks(self) -> None:
        """Before the optimizer step, with several ranks: every rank takes the smallest chunk any rank needed."""
        if self.recovery is not None and self.port.world_size() > 1 and (chunk := self.recovery.agree_across_ranks()):
            self.info(f"memfit: every rank now runs chunks of at most {chunk} samples, as another rank had to")

    def _recovered(self, record: Recovery) -> None:
        port = self.port
        message = record.warning(accumulation=port.accumulation(), world_size=port.world_size(), rank=port.rank())
        warnings.warn(message, UserWarning, stacklevel=3)
        if self.monitor is not None and self.recovery is not None:
            port.log_scalars(self.monitor.recovered(record, self.recovery), None)


class ControlledRun:
    """What a framework's callback shows of the run its ``controller`` plans and measures."""

    controller: RunController

    @property
    def plan(self) -> Plan | None:
        """The plan the run trains with (``None`` before planning, in observe mode, or where none was applied)."""
        return self.controller.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self.controller.plan = plan

    @property
    def estimate(self) -> MemoryEstimate | None:
        """The prediction of the step the run trains with (the rank that planned; ``None`` elsewhere)."""
        return self.controller.estimate

    @property
    def traced(self) -> StepCurve | None:
        """The step the run trains with, read at any batch (``StepCurve``; the rank that planned, else ``None``)."""
        return self.controller.traced

    @traced.setter
    def traced(self, traced: StepCurve | None) -> None:
        self.controller.traced = traced

    @property
    def monitor(self) -> RunMonitor | None:
        """What the run measured, window by window (``None`` before it trains or where nothing is measured)."""
        return self.controller.monitor

    @property
    def recovery(self) -> OOMRecovery | None:
        """The out-of-memory recovery of the run (``None`` when it is off)."""
        return self.controller.recovery

    @property
    def margin(self) -> float:
        return self.controller.margin


def _plot(function: str, *args: Any, **kwargs: Any) -> Any:
    from memfit.reporting import plots

    return getattr(plots, function)(*args, **kwargs)
