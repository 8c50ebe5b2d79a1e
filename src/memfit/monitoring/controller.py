"""``RunController``: what memfit does while a run trains, whichever loop runs it.

A training framework (Lightning, the Hugging Face Trainer, a custom ``accelerate`` loop) knows where its
device, its processes and its trackers are; memfit knows what to do with them. The framework's adapter
hands the controller a small ``RunPort`` and calls it at the loop's moments: measuring starts, a
logging step ends a window, an optimizer step ends an accumulation window, training ends. The controller
measures each window against the prediction (``RunMonitor``), gathers every rank's peaks to the rank
that logs, sends scalars and pictures to the port's trackers, raises each warning once, and owns the
out-of-memory recovery (``OOMRecovery``): its construction, the chunked step's order of calls through a
data-parallel wrapper, the ranks' agreement on a chunk, and the warning and metrics of each recovery.
Nothing here imports a framework.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from memfit.diagnostics import degrade
from memfit.monitoring.ranks import per_rank_metrics
from memfit.monitoring.recovery import LossReduction, OnOOM, OOMRecovery, Recovery
from memfit.monitoring.run_monitor import RunMonitor
from memfit.prediction.estimator import MemoryEstimate
from memfit.reporting.figures import drawn, matplotlib_available

__all__ = ["ControlledRun", "RunController", "RunPort"]

Result = TypeVar("Result")


class RunPort(Protocol):
    """What one framework hands the controller: where the run is, and where its figures go."""

    def device(self) -> torch.device:
        """The device this process trains on."""

    def world_size(self) -> int:
        """Processes in the job (1 without a process group)."""

    def rank(self) -> int:
        """This process's rank."""

    def accumulation(self) -> int:
        """Micro batches per optimizer step, as the loop now runs them."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` in rank order (every rank calls it)."""

    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        """Send ``memfit/*`` metrics to the trackers the run uses (``step`` ``None``: the loop's current one)."""

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """Send a drawn figure to the trackers that take pictures."""

    def warn(self, message: str) -> None:
        """A warning, on the rank that speaks for the run."""

    def info(self, message: str) -> None:
        """A line for the user, on the rank that speaks for the run."""


class RunController:
    """Measures a run against its prediction, logs through a ``RunPort``, and recovers from out-of-memory errors.

    Args:
        port: the framework's side (see ``RunPort``).
        margin: drift above this fraction of the prediction raises a warning (once).
        on_oom: ``"replan"``: recover from an out-of-memory error in a step; ``"raise"``: let it end the run.
        loss_reduction: how the loss reduces a batch (``"mean"`` or ``"sum"``): it weights the chunks' losses.
        verbose: print the final drift line.
    """

    def __init__(
        self,
        port: RunPort,
        *,
        margin: float,
        on_oom: OnOOM = "replan",
        loss_reduction: LossReduction = "mean",
        verbose: bool = True,
    ) -> None:
        self.port = port
        self.margin = margin
        self.on_oom = on_oom
        self.loss_reduction = loss_reduction
        self.verbose = verbose
        self.monitor: RunMonitor | None = None
        self.recovery: OOMRecovery | None = None
        self.warned: set[str] = set()
        self.measuring = False  # every rank measures once the decision says so: window ends then gather
        self._last_window = -1

    # ------------------------------------------------------------------ saying things
    def warn(self, key: str, message: str) -> None:
        """One warning per kind of event and run."""
        if key not in self.warned:
            self.warned.add(key)
            self.port.warn(message)

    def info(self, message: str) -> None:
        self.port.info(message)

    # ------------------------------------------------------------------ measuring
    def start_measuring(
        self,
        *,
        predicted_allocated_bytes: int | None,
        predicted_reserved_bytes: int | None,
        estimate: MemoryEstimate | None,
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
                estimate=estimate,
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
    def install_recovery(
        self,
        *,
        estimate: MemoryEstimate | None,
        reset_gradients: Callable[[], None],
        enable_checkpointing: Callable[[], Any] | None,
        checkpointing_on: bool,
    ) -> OOMRecovery:
        """The recovery the framework's step runs each batch through; each recovery is one warning with the old
        and new plan, and its metrics go to the trackers."""
        self.recovery = OOMRecovery(
            reset_gradients=reset_gradients,
            estimate=estimate,
            margin=self.margin,
            enable_checkpointing=enable_checkpointing,
            checkpointing_on=checkpointing_on,
            loss_reduction=self.loss_reduction,
            distributed=self.port.world_size() > 1,
            on_recovery=self._recovered,
        )
        return self.recovery

    def end_accumulation_window(self) -> None:
        """After the optimizer step: the window's kept batches are done with."""
        if self.recovery is not None:
            self.recovery.end_window()

    def agree_across_ranks(self) -> None:
        """Before the optimizer step, with several ranks: every rank takes the smallest chunk any rank needed."""
        if self.recovery is not None and self.port.world_size() > 1 and (chunk := self.recovery.agree_across_ranks()):
            self.info(f"memfit: every rank now runs chunks of at most {chunk} samples, as another rank had to")

    @staticmethod
    def chunk_runner(
        wrapper: Any,
        through_wrapper: Callable[[Any, float], Result],
        bare: Callable[[Any, float], Result],
    ) -> Callable[[Any, float, bool], Result]:
        """``run_chunk(chunk, weight, last)`` for ``OOMRecovery.run_batch``: the last chunk of a batch goes through
        the data-parallel ``wrapper`` (its gradient all-reduce, once per batch on every rank), the others through
        the bare module (no collective this rank alone would start). A batch retried after an out-of-memory error
        goes through the wrapper a second time: DDP must not broadcast its buffers again then, as the failed
        attempt already did."""
        forwarded = False

        def run_chunk(chunk: Any, weight: float, last: bool) -> Result:
            nonlocal forwarded
            if not last:
                return bare(chunk, weight)
            if forwarded and hasattr(wrapper, "require_forward_param_sync"):
                wrapper.require_forward_param_sync = False
            forwarded = True
            return through_wrapper(chunk, weight)

        return run_chunk

    def _recovered(self, record: Recovery) -> None:
        port = self.port
        message = record.warning(accumulation=port.accumulation(), world_size=port.world_size(), rank=port.rank())
        warnings.warn(message, UserWarning, stacklevel=3)
        if self.monitor is not None and self.recovery is not None:
            port.log_scalars(self.monitor.recovered(record, self.recovery), None)


class ControlledRun:
    """What a framework's callback shows of the run its ``controller`` measures."""

    controller: RunController

    @property
    def monitor(self) -> RunMonitor | None:
        """What the run measured, window by window (``None`` before it trains or where nothing is measured)."""
        return self.controller.monitor

    @property
    def recovery(self) -> OOMRecovery | None:
        """The out-of-memory recovery of the run (``None`` when it is off)."""
        return self.controller.recovery


def _plot(function: str, *args: Any, **kwargs: Any) -> Any:
    from memfit.reporting import plots

    return getattr(plots, function)(*args, **kwargs)
