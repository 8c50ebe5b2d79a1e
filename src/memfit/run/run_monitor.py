"""One run monitor: measured peaks per window, drift against the prediction, alarms, recovery metrics.

Both callbacks measure a run the same way; they differ only in when a window ends (a framework's
step and logging cadence) and where the metrics go (``trainer.loggers``, the HF ``logs`` dict).
So they hand this class the step number and forward what it returns:

    monitor = RunMonitor.start(device, predicted_allocated_bytes=..., predicted_reserved_bytes=...,
                               traced=traced, margin=0.05, warn=warn)
    metrics = monitor.observe(step)     # at the end of a logging window: the memfit/* metrics, or None
    metrics = monitor.recovered(record, recovery)   # after an out-of-memory recovery
    line = monitor.final_line()         # "memfit drift: predicted peak reserved ..., measured ..."

The predictions are ``None`` for a run memfit measures without predicting (measured peaks only).
On CPU the measure is the process's resident memory, which is never presented as drift (see
``memfit.run.drift``). A failure to measure stops measuring (one warning), never the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.diagnostics import degrade
from memfit.prediction.curve import StepCurve
from memfit.run.drift import Drift, DriftMonitor
from memfit.run.measure import PeakSampler
from memfit.run.recovery import OOMRecovery, Recovery
from memfit.units import format_bytes

__all__ = ["RunMonitor"]

Warn = Callable[[str, str], None]  # warn(key, message): the adapter's once-per-key, rank-zero warning


class RunMonitor:
    """Sample peaks, compare them with the prediction and keep the history of a run.

    Use ``start`` (it reads the process's memory before training as the CPU baseline).
    """

    def __init__(
        self,
        sampler: PeakSampler,
        drift: DriftMonitor,
        *,
        traced: StepCurve | None,
        warn: Warn,
    ) -> None:
        self.sampler: PeakSampler | None = sampler
        self.drift = drift
        self.traced = traced  # the step that runs, read at the chunk a recovery leaves
        self._warn = warn
        self._seen: set[str] = set()

    @classmethod
    def start(
        cls,
        device: torch.device | str,
        *,
        predicted_allocated_bytes: int | None,
        predicted_reserved_bytes: int | None,
        traced: StepCurve | None,
        margin: float,
        warn: Warn,
    ) -> RunMonitor:
        """Start measuring on ``device`` against the predicted peaks at the micro batch that runs
        (``None``: no prediction, the measured peaks only)."""
        if predicted_reserved_bytes is None:
            predicted_reserved_bytes = predicted_allocated_bytes
        drift = DriftMonitor(
            predicted_allocated_bytes=predicted_allocated_bytes,
            predicted_reserved_bytes=predicted_reserved_bytes,
            margin=margin,
        )
        return cls(PeakSampler(device), drift, traced=traced, warn=warn)

    @property
    def measuring(self) -> bool:
        return self.sampler is not None

    @property
    def history(self) -> list[Drift]:
        return self.drift.history

    def observe(self, step: int) -> dict[str, float] | None:
        """End a window at ``step``: the ``memfit/*`` metrics to log, with its alarms warned once each."""
        if self.sampler is None:
            return None
        try:
            record = self.drift.observe(step, self.sampler.sample())
        except Exception as error:  # measuring must never end the run
            self.sampler = None
            degrade(f"memfit stopped measuring ({type(error).__name__}: {error}); training goes on.", error,
                    key="measure", seen=self._seen)  # fmt: skip
            return None
        for kind, alarm in zip(record.alarm_kinds, record.alarms, strict=True):
            self._warn(kind, "memfit: " + alarm)
        return record.metrics()

    def recovered(self, record: Recovery, recovery: OOMRecovery) -> dict[str, float]:
        """After an out-of-memory recovery: measure against the new chunk's prediction; its metrics."""
        if self.traced is not None:
            self.drift.repredict(self.traced, record.chunk_after)
        return recovery_metrics(record, recovery)

    def final_line(self) -> str | None:
        """The run in one line: on CUDA with a prediction, the worst window against the prediction in
        force in that window; otherwise the highest measured peak, named for what it is."""
        records = [d for d in self.history if d.compared_bytes is not None]
        if not records:
            return None
        compared = [d for d in records if d.drift_pct is not None]
        if compared:
            worst = max(compared, key=lambda d: d.drift_pct)
            return (
                f"memfit drift: predicted peak reserved {format_bytes(worst.predicted_reserved_bytes)}, measured peak "
                f"reserved up to {format_bytes(worst.compared_bytes)} ({worst.drift_pct:+.1f}%) over "
                f"{len(compared)} window(s)"
            )
        highest = max(records, key=lambda d: d.compared_bytes)
        windows = f"over {len(records)} window(s)"
        if highest.sample.reserved_bytes is not None:
            return f"memfit: peak reserved up to {format_bytes(highest.compared_bytes)} {windows} (no prediction)"
        predicted = highest.predicted_reserved_bytes
        planned_for_cuda = self.traced is not None and self.traced.estimate.device == "cuda"
        what = "reserved on the CUDA device the plan was made for" if planned_for_cuda else "of tensors"
        against = (
            f"so it is not compared with the predicted peak {format_bytes(predicted)} {what}"
            if predicted is not None
            else "no prediction"
        )
        return (
            f"memfit: process RSS up to {format_bytes(highest.compared_bytes)} {windows} (CPU: the whole process's "
            f"resident memory, interpreter, libraries and data included, {against})"
        )

    def drift_series(self) -> tuple[list[int], int | None, list[int | None]] | None:
        """``(steps, predicted, measured)`` for ``memfit.plot.plot_drift``: each window's measured peak and
        the plan's prediction (the first window's), or ``None`` for it where the two measure different
        things (CPU's process RSS) or nothing was predicted; ``None`` before any window."""
        records = self.history
        if not records:
            return None
        first = records[0]
        predicted = first.predicted_reserved_bytes if first.sample.reserved_bytes is not None else None
        return [d.step for d in records], predicted, [d.compared_bytes for d in records]


def recovery_metrics(record: Recovery, recovery: OOMRecovery) -> dict[str, float]:
    """What a recovery logs: how many so far, the new chunk, and whether checkpointing is on now."""
    return {
        "memfit/oom_recoveries": float(len(recovery.recoveries)),
        "memfit/micro_batch_size": float(record.chunk_after),
        "memfit/gradient_checkpointing": float(recovery.checkpointing_on),
    }
