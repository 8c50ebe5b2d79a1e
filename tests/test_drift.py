"""Measured-vs-predicted records, alarms and the CPU peak sampler, without any framework."""

from __future__ import annotations

import sys

import pytest
import torch

from memfit.monitoring.drift import CPU_MIN_EXCESS_BYTES, DriftMonitor
from memfit.monitoring.measure import MemorySample, PeakSampler
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
        for step, reserved in zip((10, 20, 30, 40), (10, 11, 12, 13), strict=True)
    ]
    alarms = [alarm for record in records for alarm in record.alarms]
    assert len(alarms) == 1
    assert "steps 10-40" in alarms[0] and "leak" in alarms[0] and "10.00 GiB -> 13.00 GiB" in alarms[0]
    assert [r.metrics().get("memfit/alarm_leak") for r in records] == [None, None, None, 1.0]


def test_flat_peaks_raise_nothing() -> None:
    monitor = DriftMonitor(predicted_allocated_bytes=8 * GiB, predicted_reserved_bytes=20 * GiB, margin=0.05)
    records = [monitor.observe(step, cuda_sample(8 * GiB, 10 * GiB)) for step in range(1, 10)]
    assert all(r.alarms == () for r in records)


def test_cpu_drift_is_measured_from_rss_growth_and_alarms_only_past_the_coarse_threshold() -> None:
    monitor = DriftMonitor(
        predicted_allocated_bytes=100 * MiB,
        predicted_reserved_bytes=100 * MiB,
        margin=0.05,
        baseline_rss_bytes=1 * GiB,
        resident_bytes=40 * MiB,
    )
    small = monitor.observe(5, MemorySample(None, None, None, 1 * GiB + 160 * MiB))
    assert small.compared_bytes == 200 * MiB  # 160 MiB growth + 40 MiB model
    assert small.metrics()["memfit/drift_rss_pct"] == pytest.approx(100.0)
    assert small.alarms == ()  # 100 MiB over: below the CPU threshold
    big = monitor.observe(10, MemorySample(None, None, None, 1 * GiB + CPU_MIN_EXCESS_BYTES + 200 * MiB))
    assert len(big.alarms) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-window peak RSS needs Linux")
def test_cpu_peak_sampler_sees_a_transient_allocation_and_resets() -> None:
    sampler = PeakSampler("cpu")
    block = torch.ones(64 * MiB // 4)  # 64 MiB, touched
    del block
    first = sampler.sample()
    second = sampler.sample()
    assert first.rss_bytes is not None and second.rss_bytes is not None
    assert first.rss_bytes >= second.rss_bytes + 48 * MiB
    assert first.allocated_bytes is None and first.reserved_bytes is None
