"""Compare measured peaks with the prediction, window by window, and raise alarms worth a warning."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from memfit.measure import MemorySample
from memfit.units import format_bytes

__all__ = ["Drift", "DriftMonitor"]

# Peaks that grow this many windows in a row, each by more than LEAK_MIN_GROWTH, look like a leak.
LEAK_WINDOWS = 3
LEAK_MIN_GROWTH = 0.01


@dataclass(frozen=True)
class Drift:
    """One window: measured vs predicted, drift in percent (positive: more than predicted)."""

    step: int
    measured_bytes: int | None
    predicted_bytes: int
    drift_pct: float | None
    sample: MemorySample
    alarms: tuple[str, ...] = field(default=())

    def metrics(self) -> dict[str, float]:
        """The documented ``memfit/*`` metric keys for this window (only those measured here)."""
        out: dict[str, float] = {"memfit/predicted_peak_bytes": float(self.predicted_bytes)}
        sample = self.sample
        for key, value in (
            ("memfit/measured_peak_allocated_bytes", sample.allocated_bytes),
            ("memfit/measured_peak_reserved_bytes", sample.reserved_bytes),
            ("memfit/measured_device_used_bytes", sample.device_used_bytes),
            ("memfit/measured_peak_rss_bytes", sample.rss_bytes),
        ):
            if value is not None:
                out[key] = float(value)
        if self.drift_pct is not None:
            out["memfit/drift_pct"] = self.drift_pct
        return out


class DriftMonitor:
    """Turn samples into ``Drift`` records and alarms (each kind of alarm is raised once).

    ``predicted_bytes`` is compared with what ``measured_of`` picks from a sample: reserved bytes
    on CUDA; on CPU, the growth of the process's peak RSS over ``baseline_rss_bytes`` (measured
    before training) plus the model's resident bytes.
    """

    def __init__(
        self,
        predicted_bytes: int,
        *,
        margin: float,
        cuda: bool,
        baseline_rss_bytes: int = 0,
        resident_bytes: int = 0,
    ) -> None:
        self.predicted_bytes = predicted_bytes
        self.margin = margin
        self.cuda = cuda
        self.baseline_rss_bytes = baseline_rss_bytes
        self.resident_bytes = resident_bytes
        self.history: list[Drift] = []
        self._raised: set[str] = set()

    def measured_of(self, sample: MemorySample) -> int | None:
        if self.cuda:
            return sample.reserved_bytes
        if sample.rss_bytes is None:
            return None
        return max(0, sample.rss_bytes - self.baseline_rss_bytes) + self.resident_bytes

    def observe(self, step: int, sample: MemorySample) -> Drift:
        measured = self.measured_of(sample)
        drift = None
        if measured is not None and self.predicted_bytes > 0:
            drift = 100.0 * (measured - self.predicted_bytes) / self.predicted_bytes
        alarms = self._alarms(step, measured, drift)
        record = Drift(step, measured, self.predicted_bytes, drift, sample, tuple(alarms))
        self.history.append(record)
        return record

    def _alarms(self, step: int, measured: int | None, drift: float | None) -> list[str]:
        alarms: list[str] = []
        if measured is None:
            return alarms
        what = "reserved" if self.cuda else "process memory"
        if drift is not None and drift > 100 * self.margin and "over" not in self._raised:
            self._raised.add("over")
            alarms.append(
                f"measured peak {what} {format_bytes(measured)} at step {step} is {drift:.1f}% above the "
                f"prediction {format_bytes(self.predicted_bytes)}, more than the {self.margin:.0%} margin; "
                "the run is closer to out-of-memory than planned. Likely causes: an op the trace does not "
                "see (custom CUDA kernels, cuDNN workspaces), other processes on the GPU, or variable-length "
                "batches longer than the sample."
            )
        recent = [d.measured_bytes for d in self.history[-LEAK_WINDOWS:]] + [measured]
        if (
            len(recent) == LEAK_WINDOWS + 1
            and all(r is not None for r in recent)
            and "leak" not in self._raised
        ):
            growing = all(b > a * (1 + LEAK_MIN_GROWTH) for a, b in itertools.pairwise(recent))
            if growing:
                self._raised.add("leak")
                first = self.history[-LEAK_WINDOWS].step
                alarms.append(
                    f"peak {what} grew in each of the last {LEAK_WINDOWS} logging windows (steps "
                    f"{first}-{step}: {format_bytes(recent[0])} -> {format_bytes(recent[-1])}); this looks "
                    "like a leak: tensors kept across steps, such as losses stored without .detach() or "
                    ".item(), outputs appended to a list, or a cache that grows."
                )
        return alarms
