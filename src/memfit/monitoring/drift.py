"""Compare measured peaks with the prediction, window by window, and raise alarms worth a warning."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from memfit.monitoring.measure import MemorySample
from memfit.prediction.estimator import MemoryEstimate
from memfit.units import format_bytes

__all__ = ["Drift", "DriftMonitor"]

# Peaks that grow this many windows in a row, each by more than LEAK_MIN_GROWTH, look like a leak.
LEAK_WINDOWS = 3
LEAK_MIN_GROWTH = 0.01
# On CPU the process also holds the interpreter, allocator arenas and the loop's own objects, so
# the comparison is coarse: it alarms only past this many bytes above the prediction as well.
CPU_MIN_EXCESS_BYTES = 256 * 1024**2


def _pct(measured: int | None, predicted: int) -> float | None:
    if measured is None or predicted <= 0:
        return None
    return 100.0 * (measured - predicted) / predicted


@dataclass(frozen=True)
class Drift:
    """One logging window: what was measured, against what was predicted, and the alarms raised."""

    step: int
    sample: MemorySample
    predicted_allocated_bytes: int
    predicted_reserved_bytes: int
    compared_bytes: int | None
    drift_pct: float | None
    alarms: tuple[str, ...] = field(default=())
    alarm_kinds: tuple[str, ...] = field(default=())  # "over_margin", "leak": the kinds raised in this window

    def metrics(self) -> dict[str, float]:
        """The ``memfit/*`` metrics of this window (keys for quantities not measured are left out)."""
        sample = self.sample
        out: dict[str, float] = {"memfit/predicted_peak_allocated_bytes": float(self.predicted_allocated_bytes)}
        for kind in self.alarm_kinds:  # 1 in the window an alarm is raised (each kind once per run)
            out[f"memfit/alarm_{kind}"] = 1.0
        if sample.reserved_bytes is not None:  # CUDA
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
        elif sample.rss_bytes is not None:  # CPU
            out["memfit/measured_peak_rss_bytes"] = float(sample.rss_bytes)
            if self.compared_bytes is not None:
                out["memfit/measured_tensor_bytes_from_rss"] = float(self.compared_bytes)
            if self.drift_pct is not None:
                out["memfit/drift_rss_pct"] = self.drift_pct
        return out


class DriftMonitor:
    """Turn samples into ``Drift`` records and alarms (each kind of alarm once per run).

    On CUDA the reserved peak is compared with the predicted reserved peak. On CPU the process's
    peak RSS growth over ``baseline_rss_bytes`` (taken before training, with the model already
    resident) plus ``resident_bytes`` (the model's own bytes) is compared with the predicted tensor
    bytes: a coarse check, since the CPU allocator and the interpreter also use memory.
    """

    def __init__(
        self,
        *,
        predicted_allocated_bytes: int,
        predicted_reserved_bytes: int,
        margin: float,
        baseline_rss_bytes: int = 0,
        resident_bytes: int = 0,
    ) -> None:
        self.predicted_allocated_bytes = predicted_allocated_bytes
        self.predicted_reserved_bytes = predicted_reserved_bytes
        self.margin = margin
        self.baseline_rss_bytes = baseline_rss_bytes
        self.resident_bytes = resident_bytes
        self.history: list[Drift] = []
        self._raised: set[str] = set()

    def repredict(self, estimate: MemoryEstimate, batch_size: int) -> None:
        """Measure against the prediction at ``batch_size`` from now on (after an out-of-memory recovery)."""
        peak = estimate.at(batch_size)
        self.predicted_allocated_bytes, self.predicted_reserved_bytes = peak.allocated_bytes, peak.reserved_bytes

    def observe(self, step: int, sample: MemorySample) -> Drift:
        if sample.reserved_bytes is not None:
            compared, predicted, what = sample.reserved_bytes, self.predicted_reserved_bytes, "reserved"
        elif sample.rss_bytes is not None:
            compared = max(0, sample.rss_bytes - self.baseline_rss_bytes) + self.resident_bytes
            predicted, what = self.predicted_allocated_bytes, "process memory"
        else:
            compared, predicted, what = None, self.predicted_reserved_bytes, ""
        drift = _pct(compared, predicted)
        alarms = self._alarms(step, compared, predicted, drift, what)
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

    def _alarms(
        self, step: int, measured: int | None, predicted: int, drift: float | None, what: str
    ) -> list[tuple[str, str]]:
        alarms: list[tuple[str, str]] = []
        if measured is None:
            return alarms
        coarse = what == "process memory" and measured - predicted <= CPU_MIN_EXCESS_BYTES
        if drift is not None and drift > 100 * self.margin and not coarse and "over" not in self._raised:
            self._raised.add("over")
            first = self.history[-1].step + 1 if self.history else 0
            alarms.append(("over_margin",
                f"measured peak {what} {format_bytes(measured)} in steps {first}-{step} is {drift:.1f}% above the "
                f"prediction {format_bytes(predicted)}, more than the {self.margin:.0%} margin: the run is "
                "closer to out-of-memory than planned. Likely causes: an op the trace does not see (custom "
                "CUDA kernels, cuDNN workspaces), other processes on the GPU, or batches longer than the "
                "sample."
            ))  # fmt: skip
        recent = [d.compared_bytes for d in self.history[-LEAK_WINDOWS:]] + [measured]
        complete = len(recent) == LEAK_WINDOWS + 1 and all(r is not None for r in recent)
        growing = complete and all(b > a * (1 + LEAK_MIN_GROWTH) for a, b in itertools.pairwise(recent))
        if growing and "leak" not in self._raised:
            self._raised.add("leak")
            first = self.history[-LEAK_WINDOWS].step
            alarms.append(("leak",
                f"peak {what} grew in each of the last {LEAK_WINDOWS} logging windows (steps "
                f"{first}-{step}: {format_bytes(recent[0])} -> {format_bytes(recent[-1])}); this looks "
                "like a leak: tensors kept across steps, such as losses stored without .detach() or "
                ".item(), outputs appended to a list, or a cache that grows."
            ))  # fmt: skip
        return alarms
