"""The planning session and the run monitor: the orchestration both callbacks and the CLI share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.session import PlanningSession, PlanRequest
from memfit.run.drift import DriftMonitor
from memfit.run.measure import MemorySample
from memfit.run.recovery import OOMRecovery, Recovery
from memfit.run.run_monitor import RunMonitor
from memfit.units import GiB


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def traced_mlp() -> tuple[nn.Module, list[tuple[int, bool, int]]]:
    model, calls = mlp(), []

    def trace_at(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        calls.append((micro, checkpointing, accumulation))
        return memfit.trace(
            model, torch.zeros(micro, 256), optimizer="adamw", target=memfit.Target("cpu"), batch_size=micro,
            gradient_checkpointing=checkpointing, loop=memfit.TrainingLoop(accumulation_steps=accumulation),
            loss_fn=lambda out, batch: out.float().pow(2).mean(),
        )  # fmt: skip

    return trace_at, calls


def test_each_configuration_is_traced_once_and_the_decision_carries_the_trace_of_its_step() -> None:
    trace_at, calls = traced_mlp()
    session = PlanningSession(trace_at, batch_size=16, accumulation_steps=2)
    baseline = session.baseline
    assert calls == [(16, False, 2)] and session.baseline is baseline
    capacity = int(baseline.at(8).device_bytes / 0.95) + 1
    decision = session.decide(PlanRequest(capacity_bytes=capacity, target_batch_size=32, allow_checkpointing=False))
    plan = decision.plan
    assert plan.effective_batch_size == 32
    exact = (plan.micro_batch_size, plan.gradient_checkpointing, plan.accumulate_grad_batches)
    assert exact in calls and len(calls) == len(set(calls))  # nothing traced twice
    assert decision.traced is session.trace_at(*exact)
    assert decision.traced.estimate.peak_reserved_bytes == plan.predicted_reserved_bytes


def test_a_user_who_checkpoints_already_is_planned_with_checkpointing() -> None:
    trace_at, calls = traced_mlp()
    session = PlanningSession(trace_at, batch_size=8)
    decision = session.decide(PlanRequest(capacity_bytes=4 * GiB, always_checkpoint=True))
    assert decision.plan.gradient_checkpointing and decision.traced.estimate.gradient_checkpointing
    assert all(checkpointing for _, checkpointing, _ in calls)


def test_the_search_may_use_a_stand_in_but_the_plan_is_confirmed_on_the_whole_trace() -> None:
    trace_at, calls = traced_mlp()
    searched: list[tuple[int, bool, int]] = []

    def optimistic(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        searched.append((micro, checkpointing, accumulation))
        return trace_at(micro, checkpointing, accumulation)

    session = PlanningSession(trace_at, batch_size=1, search_at=optimistic)
    decision = session.decide(PlanRequest(capacity_bytes=4 * GiB, target_batch_size="max", max_batch_size=64))
    assert searched and searched[0] == (1, False, 1)
    assert decision.traced.estimate.batch_size == decision.plan.micro_batch_size == 64
    assert (64, False, 1) in calls and decision.traced is session.trace_at(64, False, 1)


class FakeSampler:
    """Stands in for PeakSampler with the CUDA peaks of each window."""

    def __init__(self, reserved: list[int]) -> None:
        self.reserved = list(reserved)

    def sample(self) -> MemorySample:
        value = self.reserved.pop(0)
        return MemorySample(value, value, None, None)


def test_the_final_line_compares_the_worst_window_with_the_prediction_it_was_measured_against() -> None:
    """After a recovery the prediction changes; the summary must not mix one window's peak with another's prediction."""
    trace_at, _ = traced_mlp()
    curve = trace_at(32, False, 1)
    first = curve.at(32).reserved_bytes
    drift = DriftMonitor(predicted_allocated_bytes=first, predicted_reserved_bytes=first, margin=0.05)
    warned: list[str] = []
    monitor = RunMonitor(FakeSampler([first, curve.at(8).reserved_bytes * 2]), drift, traced=curve,
                         warn=lambda key, message: warned.append(key))  # fmt: skip
    assert monitor.observe(10)["memfit/drift_reserved_pct"] == 0.0
    recovery = OOMRecovery(reset_gradients=lambda: None, traced=curve)
    record = Recovery(step=11, batch_size=32, chunk_before=32, chunk_after=8, checkpointing_enabled=False,
                      replayed_batches=0, error="injected")  # fmt: skip
    recovery.recoveries.append(record)
    metrics = monitor.recovered(record, recovery)
    assert metrics == {"memfit/oom_recoveries": 1.0, "memfit/micro_batch_size": 8.0,
                       "memfit/gradient_checkpointing": 0.0}  # fmt: skip
    second = monitor.observe(20)
    assert second["memfit/drift_reserved_pct"] == pytest.approx(100.0)
    assert warned == ["over_margin"]
    line = monitor.final_line()
    assert "(+100.0%)" in line and memfit.format_bytes(curve.at(8).reserved_bytes) in line
    steps, predicted, measured = monitor.drift_series()
    assert steps == [10, 20] and predicted == first and measured[1] == 2 * curve.at(8).reserved_bytes


class RssSampler:
    """Stands in for PeakSampler on CPU: the process's peak resident memory of each window."""

    def __init__(self, rss: list[int]) -> None:
        self.rss = list(rss)

    def sample(self) -> MemorySample:
        return MemorySample(None, None, None, self.rss.pop(0))


def test_on_cpu_the_final_line_names_the_process_rss_and_quotes_the_plans_peak() -> None:
    """CPU measures the whole process, not tensors: the line says so and shows no drift percentage."""
    plan_peak = 300 * 2**20
    drift = DriftMonitor(predicted_allocated_bytes=plan_peak, predicted_reserved_bytes=plan_peak, margin=0.05)
    monitor = RunMonitor(RssSampler([2 * GiB, 3 * GiB]), drift, traced=None, warn=lambda key, message: None)
    assert "memfit/drift_rss_pct" not in monitor.observe(5) and monitor.observe(10)
    line = monitor.final_line()
    assert line.startswith("memfit: process RSS up to 3.00 GiB over 2 window(s)")
    assert "drift" not in line and "%" not in line and memfit.format_bytes(plan_peak) in line
    steps, predicted, measured = monitor.drift_series()
    assert steps == [5, 10] and predicted is None and measured == [2 * GiB, 3 * GiB]


def test_without_a_prediction_the_monitor_logs_and_summarises_the_measured_peaks() -> None:
    drift = DriftMonitor(predicted_allocated_bytes=None, predicted_reserved_bytes=None, margin=0.05)
    monitor = RunMonitor(FakeSampler([GiB, 2 * GiB]), drift, traced=None, warn=lambda key, message: None)
    measured = {"memfit/measured_peak_allocated_bytes": GiB, "memfit/measured_peak_reserved_bytes": GiB}
    assert monitor.observe(5) == measured
    monitor.observe(10)
    assert monitor.final_line() == "memfit: peak reserved up to 2.00 GiB over 2 window(s) (no prediction)"
    assert monitor.drift_series()[1] is None


def test_a_failing_sampler_stops_measuring_and_raises_under_the_strict_switch() -> None:
    class Broken:
        def sample(self) -> MemorySample:
            raise RuntimeError("counter gone")

    drift = DriftMonitor(predicted_allocated_bytes=1, predicted_reserved_bytes=1, margin=0.05)
    monitor = RunMonitor(Broken(), drift, traced=None, warn=lambda key, message: None)
    with pytest.raises(memfit.errors.StrictModeError, match="stopped measuring"):
        monitor.observe(1)
    assert not monitor.measuring


def test_a_finished_session_lets_go_of_the_sample_at_once() -> None:
    """The sample batch is real memory on the run's device: nothing may keep it past planning but the caller."""
    import gc
    import weakref

    model = mlp()

    def plan_once() -> weakref.ref:
        sample = torch.zeros(4, 256)

        def trace_at(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
            return memfit.trace(model, sample, target=memfit.Target("cpu"), batch_size=micro, optimizer="sgd",
                                loss_fn=lambda out, batch: out.sum())  # fmt: skip

        PlanningSession(trace_at, batch_size=4).decide(PlanRequest(capacity_bytes=1 * GiB, max_batch_size=8))
        return weakref.ref(sample)

    plan_once()  # torch keeps the stack of its first fake-tensor mode alive once per process (a cached import error)
    gc.collect()
    gc.disable()  # freed by reference counting when planning returns, not by a later collection
    try:
        assert plan_once()() is None
    finally:
        gc.enable()


def test_a_cpu_run_planned_for_a_gpu_names_what_its_prediction_is() -> None:
    """A plan for a named GPU on a CPU box: the final line must not call the GPU's reserved peak "tensors"."""
    curve = memfit.trace(mlp(), torch.zeros(8, 256), target=memfit.Target("cuda"), optimizer="adamw",
                         loss_fn=lambda out, batch: out.float().pow(2).mean())  # fmt: skip
    peak = curve.at(8)
    drift = DriftMonitor(predicted_allocated_bytes=peak.allocated_bytes, predicted_reserved_bytes=peak.reserved_bytes,
                         margin=0.05)  # fmt: skip

    class CpuSampler:
        def sample(self) -> MemorySample:
            return MemorySample(None, None, None, 600 * 2**20)

    monitor = RunMonitor(CpuSampler(), drift, traced=curve, warn=lambda key, message: None)
    monitor.observe(1)
    line = monitor.final_line()
    assert "process RSS" in line and "reserved on the CUDA device the plan was made for" in line
    assert "of tensors" not in line
