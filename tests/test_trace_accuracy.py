"""The trace counts what real tensors hold: checked against autograd's saved tensors and MemTracker."""

from __future__ import annotations

import pytest
import torch

import memfit
import zoo
from harness.accuracy import reference


def _cpu_estimate(case: zoo.Case) -> memfit.MemoryEstimate:
    return memfit.estimate(
        case.model,
        case.batch,
        target=memfit.Target("cpu"),
        optimizer="adamw",
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )


@pytest.mark.parametrize("name", sorted(zoo.CASES))
def test_traced_activations_match_saved_tensors_of_a_real_cpu_step(name: str) -> None:
    case = zoo.CASES[name]()
    estimate = _cpu_estimate(case)
    counted = zoo.saved_activation_bytes(case)
    assert counted > 0
    assert abs(estimate.activation_bytes - counted) <= 0.01 * counted, (estimate.activation_bytes, counted)


@pytest.mark.parametrize("name", sorted(zoo.CASES))
def test_traced_peak_agrees_with_pytorch_memtracker_on_real_tensors(name: str) -> None:
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    case = zoo.CASES[name]()
    estimate = _cpu_estimate(case)
    optimizer = torch.optim.AdamW(case.model.parameters(), foreach=False)  # CPU default: single-tensor
    measured = reference.memtracker_peak(case.model, optimizer, case.batch, case.loss_of)
    assert abs(estimate.peak_allocated_bytes - measured) <= 0.02 * measured, (estimate.peak_allocated_bytes, measured)


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_per_sample_model_predicts_a_fresh_trace_at_another_batch(name: str) -> None:
    case = zoo.CASES[name]()
    kwargs = {"optimizer": "adamw", "loss_fn": case.loss_fn, "forward_fn": case.forward_fn}
    small_curve = memfit.trace(case.model, case.batch, **kwargs)
    small = small_curve.estimate
    for batch in (1, 3 * small.batch_size):
        traced = memfit.estimate(case.model, case.batch, batch_size=batch, **kwargs)
        predicted = small_curve.at(batch).allocated_bytes
        assert abs(predicted - traced.peak_allocated_bytes) <= 0.01 * traced.peak_allocated_bytes
