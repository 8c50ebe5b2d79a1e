"""Measured-vs-predicted records, alarms and the CPU peak sampler, without any framework."""

from __future__ import annotations

import mmap
import sys

import pytest

from memfit.run.drift import CPU_LEAK_MIN_BYTES, LEAK_WARMUP_WINDOWS, LEAK_WINDOWS, DriftMonitor
from memfit.run.measure import MemorySample, PeakSampler
from memfit.units import GiB, MiB


def cuda_sample(allocated: int, reserved: int, used: int | None = None) -> MemorySample:
    return MemorySample(allocated, reserved, used, None)


def test_cuda_window_metrics_and_drift() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=10 * GiB, margin=0.05)
    record = monitor.observe(50, cuda_sample(8 * GiB, 10 * GiB + 256 * MiB, used=11 * GiB))
    metrics = record.metrics()
    assert metrics["memfit/drift_reserved_pct"] == pytest.approx(2.5)
    assert metrics["memfit/drift_allocated_pct"] == pytest.approx(0.0)
    assert metrics["memfit/measured_device_used_bytes"] == 11 * GiB
    assert metrics["memfit/predicted_peak_reserved_bytes"] == 10 * GiB
    assert "memfit/measured_peak_rss_bytes" not in metrics
    assert record.alarms == ()


def test_over_margin_alarm_is_raised_once_with_the_figures() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=10 * GiB, margin=0.05)
    monitor.observe(5, cuda_sample(8 * GiB, 10 * GiB))
    first = monitor.observe(10, cuda_sample(9 * GiB, 11 * GiB))
    assert len(first.alarms) == 1
    assert "10.0% above the prediction 10.00 GiB" in first.alarms[0] and "steps 6-10" in first.alarms[0]
    assert first.metrics()["memfit/alarm_over_margin"] == 1.0
    again = monitor.observe(20, cuda_sample(9 * GiB, 11 * GiB))
    assert again.alarms == () and "memfit/alarm_over_margin" not in again.metrics()


def test_growing_peaks_raise_a_leak_alarm_naming_the_steps() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=20 * GiB, margin=0.05)
    records = [
        monitor.observe(step, cuda_sample(8 * GiB, reserved * GiB))
        for step, reserved in zip((5, 10, 20, 30, 40), (10, 10, 11, 12, 13), strict=True)
    ]
    alarms = [alarm for record in records for alarm in record.alarms]
    assert len(alarms) == 1
    assert "steps 10-40" in alarms[0] and "leak" in alarms[0] and "10.00 GiB -> 13.00 GiB" in alarms[0]
    assert [r.metrics().get("memfit/alarm_leak") for r in records] == [None, None, None, None, 1.0]


def test_a_short_run_whose_first_windows_grow_raises_no_leak_alarm() -> None:
    """A 4-step run logged every step: the first window creates the optimizer state and fills the
    caches, so peaks that grow through it are warm-up, not a leak."""
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=20 * GiB, margin=0.05)
    windows = LEAK_WARMUP_WINDOWS + LEAK_WINDOWS
    records = [monitor.observe(step, cuda_sample(8 * GiB, (10 + step) * GiB)) for step in range(1, windows + 1)]
    assert all(r.alarms == () for r in records)
    assert monitor.observe(windows + 1, cuda_sample(8 * GiB, (11 + windows) * GiB)).alarm_kinds == ("leak",)


def test_flat_peaks_raise_nothing() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=20 * GiB, margin=0.05)
    records = [monitor.observe(step, cuda_sample(8 * GiB, 10 * GiB)) for step in range(1, 10)]
    assert all(r.alarms == () for r in records)


def rss_sample(rss: int) -> MemorySample:
    return MemorySample(None, None, None, rss)


def test_cpu_windows_log_the_process_rss_as_what_it_is_and_never_as_drift() -> None:
    """The process's resident memory (interpreter, libraries, data) is not the predicted tensor bytes:
    no drift against the prediction, no over-margin alarm however far above it the RSS is."""
    monitor = DriftMonitor(predicted_allocated_bytes=100 * MiB, predicted_reserved_bytes=100 * MiB, margin=0.05)
    record = monitor.observe(5, rss_sample(2 * GiB))
    metrics = record.metrics()
    assert metrics == {"memfit/predicted_peak_allocated_bytes": 100 * MiB, "memfit/measured_peak_rss_bytes": 2 * GiB}
    assert record.drift_pct is None and record.compared_bytes == 2 * GiB and record.alarms == ()


def test_cpu_leak_alarm_needs_the_rss_to_grow_by_a_meaningful_amount() -> None:
    def run(growth_bytes: int) -> list[str]:
        monitor = DriftMonitor(predicted_allocated_bytes=100 * MiB, predicted_reserved_bytes=100 * MiB, margin=0.05)
        windows = LEAK_WARMUP_WINDOWS + LEAK_WINDOWS + 1
        records = [monitor.observe(step, rss_sample(GiB + step * growth_bytes)) for step in range(windows)]
        return [alarm for record in records for alarm in record.alarms]

    assert run(12 * MiB) == []  # +2.4% a window: an allocator arena, not a leak
    (alarm,) = run(CPU_LEAK_MIN_BYTES // LEAK_WINDOWS + MiB)
    assert "peak process RSS grew" in alarm


def test_without_a_prediction_the_measured_peaks_are_logged_alone_and_leaks_still_alarm() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=None, predicted_reserved_bytes=None, margin=0.05)
    records = [monitor.observe(step, cuda_sample(GiB, (10 + step) * GiB)) for step in range(5)]
    assert set(records[0].metrics()) == {"memfit/measured_peak_allocated_bytes", "memfit/measured_peak_reserved_bytes"}
    assert [kind for r in records for kind in r.alarm_kinds] == ["leak"]
    cpu = DriftMonitor(predicted_allocated_bytes=None, predicted_reserved_bytes=None, margin=0.05)
    assert cpu.observe(1, rss_sample(GiB)).metrics() == {"memfit/measured_peak_rss_bytes": GiB}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-window peak RSS needs Linux")
def test_cpu_peak_sampler_sees_a_transient_allocation_and_resets() -> None:
    sampler = PeakSampler("cpu")
    # 64 MiB of fresh pages, touched and unmapped: a tensor could reuse heap the process already holds
    # (after earlier tests freed theirs), which raises no resident peak
    block = mmap.mmap(-1, 64 * MiB)
    block.write(b"\x01" * (64 * MiB))
    block.close()
    first = sampler.sample()
    second = sampler.sample()
    assert first.rss_bytes is not None and second.rss_bytes is not None
    assert first.rss_bytes >= second.rss_bytes + 48 * MiB
    assert first.allocated_bytes is None and first.reserved_bytes is None
