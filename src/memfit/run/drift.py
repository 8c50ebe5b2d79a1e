"""Compare measured peaks with the prediction, window by window, and raise alarms worth a warning.

What is compared depends on what can be measured. On CUDA, ``max_memory_reserved`` is the quantity
the prediction models, so drift is measured against it. On CPU only the process's resident memory
(RSS) can be read: it holds the interpreter, the libraries, the allocator's arenas and the data
loader besides the training step's tensors, so it is logged as what it is, ``measured_peak_rss_bytes``,
and never as drift against the predicted tensor bytes. Without a prediction (a run memfit could not
trace, such as Lightning's manual optimization) the measured peaks are logged alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from memfit.prediction.curve import StepCurve
from memfit.run.measure import MemorySample
from memfit.units import MiB, format_bytes, format_margin

__all__ = ["Drift", "DriftMonitor"]

# A leak is a peak that grows in each of LEAK_WINDOWS windows in a row, by more than LEAK_MIN_GROWTH
# each time. The first LEAK_WARMUP_WINDOWS windows never count: they create the optimizer state and
# fill the allocator's caches, so a short run (four steps logged one by one) grows without leaking.
LEAK_WINDOWS = 3
LEAK_WARMUP_WINDOWS = 1
LEAK_MIN_GROWTH = 0.01
# On CPU the resident memory also moves with the allocator's arenas and the interpreter: a leak must
# add at least this much over its windows as well.
CPU_LEAK_MIN_BYTES = 64 * MiB


def _pct(measured: int | None, predicted: int | None) -> float | None:
    if measured is None or predicted is None or predicted <= 0:
        return None
    return 100.0 * (measured - predicted) / predicted


@dataclass(frozen=True)
class Drift:
    """One logging window: what was measured, against what was predicted, and the alarms raised.

    ``compared_bytes`` is the measured peak that windows are compared by (reserved on CUDA, the
    process's RSS on CPU); ``drift_pct`` compares it with the prediction where the two measure the
    same thing (CUDA with a prediction), else it is ``None``.
    """

    step: int
    sample: MemorySample
    predicted_allocated_bytes: int | None
    predicted_reserved_bytes: int | None
    compared_bytes: int | None
    drift_pct: float | None
    alarms: tuple[str, ...] = field(default=())
    alarm_kinds: tuple[str, ...] = field(default=())  # "over_margin", "leak": the kinds raised in this window

    def metrics(self) -> dict[str, float]:
        """The ``memfit/*`` metrics of this window (keys for quantities not measured or not predicted are left out)."""
        sample = self.sample
        out: dict[str, float] = {}
        if self.predicted_allocated_bytes is not None:
            out["memfit/predicted_peak_allocated_bytes"] = float(self.predicted_allocated_bytes)
        for kind in self.alarm_kinds:  # 1 in the window an alarm is raised (each kind once per run)
            out[f"memfit/alarm_{kind}"] = 1.0
        if sample.reserved_bytes is not None:  # CUDA
            if self.predicted_reserved_bytes is not None:
                out["memfit/predicted_peak_reserved_bytes"] = float(self.predicted_reserved_bytes)
            out["memfit/measured_peak_allocated_bytes"] = float(sample.allocated_bytes or 0)
            out["memfit/measured_peak_reserved_bytes"] = float(sample.reserved_bytes)
            allocated_drift = _pct(sample.allocated_bytes, self.predicted_allocated_bytes)
            if allocated_drift is not None:
                out["memfit/drift_allocated_pct"] = allocated_drift
            if self.drift_pct is not None:
                out["memfit/drift_reserved_pct"] = self.drift_pct
            if sample.device_used_bytes is not None:
                out["memfit/measured_device_used_bytes"] = float(sample.device_used_bytes)
        elif sample.rss_bytes is not None:  # CPU: the whole process's resident memory, no drift
            out["memfit/measured_peak_rss_bytes"] = float(sample.rss_bytes)
        return out


class DriftMonitor:
    """Turn samples into ``Drift`` records and alarms (each kind of alarm once per run).

    On CUDA the reserved peak is compared with the predicted reserved peak: drift, and an alarm when
    it is above the margin. On CPU the process's peak RSS is recorded for the leak alarm only. The
    predictions are ``None`` when there is none (measured peaks only).
    """

    def __init__(
        self,
        *,
        predicted_allocated_bytes: int | None,
        predicted_reserved_bytes: int | None,
        margin: float,
    ) -> None:
        self.predicted_allocated_bytes = predicted_allocated_bytes
        self.predicted_reserved_bytes = predicted_reserved_bytes
        self.margin = margin
        self.history: list[Drift] = []
        self._raised: set[str] = set()

    def repredict(self, traced: StepCurve, batch_size: int) -> None:
        """Measure against the prediction at ``batch_size`` from now on (after an out-of-memory recovery)."""
        peak = traced.at(batch_size)
        self.predicted_allocated_bytes, self.predicted_reserved_bytes = peak.allocated_bytes, peak.reserved_bytes

    def observe(self, step: int, sample: MemorySample) -> Drift:
        if sample.reserved_bytes is not None:
            compared, what = sample.reserved_bytes, "reserved"
            drift = _pct(compared, self.predicted_reserved_bytes)
        else:
            compared, what, drift = sample.rss_bytes, "process RSS", None
        alarms = self._alarms(step, compared, drift, what)
        record = Drift(
            step,
            sample,
            self.predicted_allocated_bytes,
            self.predicted_reserved_bytes,
            compared,
            drift,
            tuple(message for _, message in alarms),
            tuple(kind for kind, _ in alarms),
        )
        self.history.append(record)
        return record

    def _alarms(self, step: int, measured: int | None, drift: float | None, what: str) -> list[tuple[str, str]]:
        alarms: list[tuple[str, str]] = []
        if measured is None:
            return alarms
        if drift is not None and drift > 100 * self.margin and "over" not in self._raised:
            self._raised.add("over")
            first = self.history[-1].step + 1 if self.history else 0
            alarms.append(("over_margin",
                f"measured peak {what} {format_bytes(measured)} in steps {first}-{step} is {drift:.1f}% above the "
                f"prediction {format_bytes(self.predicted_reserved_bytes or 0)}, more than the "
                f"{format_margin(self.margin)} margin: the run is closer to out-of-memory than planned. Likely "
                "causes: an op the trace does not see (custom CUDA kernels), other processes on the GPU, or "
                "batches longer than the sample."
            ))  # fmt: skip
        if self._leaking(measured, what) and "leak" not in self._raised:
            self._raised.add("leak")
            recent = [d.compared_bytes for d in self.history[-LEAK_WINDOWS:]]
            first = self.history[-LEAK_WINDOWS].step
            alarms.append(("leak",
                f"peak {what} grew in each of the last {LEAK_WINDOWS} logging windows (steps "
                f"{first}-{step}: {format_bytes(recent[0] or 0)} -> {format_bytes(measured)}); this looks "
                "like a leak: tensors kept across steps, such as losses stored without .detach() or "
                ".item(), outputs appended to a list, or a cache that grows."
            ))  # fmt: skip
        return alarms

    def _leaking(self, measured: int, what: str) -> bool:
        """Whether ``measured`` ends LEAK_WINDOWS growing windows after the warm-up ones, by enough to mean it."""
        counted = self.history[LEAK_WARMUP_WINDOWS:]
        if len(counted) < LEAK_WINDOWS:
            return False
        recent = [d.compared_bytes for d in counted[-LEAK_WINDOWS:]] + [measured]
        if any(r is None for r in recent):
            return False
        growing = all(b > a * (1 + LEAK_MIN_GROWTH) for a, b in itertools.pairwise(recent))
        enough = what != "process RSS" or recent[-1] - recent[0] >= CPU_LEAK_MIN_BYTES
        return growing and enough
