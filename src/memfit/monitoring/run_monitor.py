"""One run monitor: measured peaks per window, drift against the prediction, alarms, recovery metrics.

Both callbacks measure a run the same way; they differ only in when a window ends (a framework's
step and logging cadence) and where the metrics go (``trainer.loggers``, the HF ``logs`` dict).
So they hand this class the step number and forward what it returns:

    monitor = RunMonitor.start(device, predicted_allocated_bytes=..., predicted_reserved_bytes=...,
                               estimate=estimate, margin=0.05, resident_bytes=model_bytes, warn=warn)
    metrics = monitor.observe(step)     # at the end of a logging window: the memfit/* metrics, or None
    metrics = monitor.recovered(record, recovery)   # after an out-of-memory recovery
    line = monitor.final_line()         # "memfit drift: predicted peak ..., measured up to ..."

A failure to measure stops measuring (one warning), never the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.diagnostics import degrade
from memfit.monitoring.drift import Drift, DriftMonitor
from memfit.monitoring.measure import PeakSampler, current_rss_bytes
from memfit.monitoring.recovery import OOMRecovery, Recovery
from memfit.prediction.estimator import MemoryEstimate
from memfit.units import format_bytes

__all__ = ["RunMonitor", "resident_bytes"]

Warn = Callable[[str, str], None]  # warn(key, message): the adapter's once-per-key, rank-zero warning


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers: on CPU they are resident before training starts,
    so the process's memory growth plus these is what compares with the predicted tensor bytes."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class RunMonitor:
    """Sample peaks, compare them with the prediction and keep the history of a run.

    Use ``start`` (it reads the process's memory before training as the CPU baseline).
    """

    def __init__(
        self,
        sampler: PeakSampler,
        drift: DriftMonitor,
        *,
        estimate: MemoryEstimate | None,
        warn: Warn,
    ) -> None:
        self.sampler: PeakSampler | None = sampler
        self.drift = drift
        self.estimate = estimate
        self._warn = warn
        self._seen: set[str] = set()

    @classmethod
    def start(
        cls,
        device: torch.device | str,
        *,
        predicted_allocated_bytes: int,
        predicted_reserved_bytes: int | None,
        estimate: MemoryEstimate | None,
        margin: float,
        resident_bytes: int,
        warn: Warn,
    ) -> RunMonitor:
        """Start measuring on ``device`` against the predicted peaks at the micro batch that runs."""
        drift = DriftMonitor(
            predicted_allocated_bytes=predicted_allocated_bytes,
            predicted_reserved_bytes=predicted_reserved_bytes or predicted_allocated_bytes,
            margin=margin,
            baseline_rss_bytes=current_rss_bytes(),
            resident_bytes=resident_bytes,
        )
        return cls(PeakSampler(device), drift, estimate=estimate, warn=warn)

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
        if self.estimate is not None:
            self.drift.repredict(self.estimate, record.chunk_after)
        return recovery_metrics(record, recovery)

    def final_line(self) -> str | None:
        """The run in one line: the worst window against the prediction in force in that window."""
        measured = [d for d in self.history if d.drift_pct is not None]
        if not measured:
            return None
        worst = max(measured, key=lambda d: d.drift_pct)
        predicted = _compared_prediction(worst)
        return (
            f"memfit drift: predicted peak {format_bytes(predicted)}, measured up to "
            f"{format_bytes(worst.compared_bytes)} ({worst.drift_pct:+.1f}%) over {len(measured)} window(s)"
        )

    def drift_series(self) -> tuple[list[int], int, list[int | None]] | None:
        """``(steps, predicted, measured)`` for ``memfit.plot.plot_drift``: the plan's prediction (the
        first window's) against each window's measured peak; ``None`` before any window."""
        records = self.history
        if not records:
            return None
        return [d.step for d in records], _compared_prediction(records[0]), [d.compared_bytes for d in records]


def recovery_metrics(record: Recovery, recovery: OOMRecovery) -> dict[str, float]:
    """What a recovery logs: how many so far, the new chunk, and whether checkpointing is on now."""
    return {
        "memfit/oom_recoveries": float(len(recovery.recoveries)),
        "memfit/micro_batch_size": float(record.chunk_after),
        "memfit/gradient_checkpointing": float(recovery.checkpointing_on),
    }


def _compared_prediction(record: Drift) -> int:
    """The prediction a window was compared with: reserved on CUDA, tensor bytes elsewhere."""
    return record.predicted_reserved_bytes if record.sample.reserved_bytes is not None else (
        record.predicted_allocated_bytes
    )  # fmt: skip
