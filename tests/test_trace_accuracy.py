"""The trace counts what real tensors hold: checked against autograd's saved tensors and MemTracker."""

from __future__ import annotations

import pytest
import torch

import memfit
import zoo


@pytest.mark.parametrize("name", sorted(zoo.CASES))
def test_traced_activations_match_saved_tensors_of_a_real_cpu_step(name: str) -> None:
    case = zoo.CASES[name]()
    estimate = memfit.estimate(
        case.model,
        case.batch,
        device="cpu",
        optimizer="adamw",
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )
    counted = zoo.saved_activation_bytes(case)
    assert counted > 0
    assert abs(estimate.activation_bytes - counted) <= 0.01 * counted, (estimate.activation_bytes, counted)


@pytest.mark.parametrize("name", sorted(zoo.CASES))
def test_traced_peak_agrees_with_pytorch_memtracker_on_real_tensors(name: str) -> None:
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    case = zoo.CASES[name]()
    estimate = memfit.estimate(
        case.model,
        case.batch,
        device="cpu",
        optimizer="adamw",
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )
    model = case.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)  # CPU default: single-tensor
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer)
    with zoo.onednn_off(), tracker:
        for _ in range(2):
            output = case.forward_fn(model, case.batch) if case.forward_fn else model(**case.batch)
            loss = case.loss_fn(output, case.batch) if case.loss_fn else output.loss
            del output
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()
            tracker.reset_mod_stats()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(estimate.peak_allocated_bytes - measured) <= 0.02 * measured, (
        estimate.peak_allocated_bytes,
        measured,
    )


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_per_sample_model_predicts_a_fresh_trace_at_another_batch(name: str) -> None:
    case = zoo.CASES[name]()
    kwargs = {"optimizer": "adamw", "loss_fn": case.loss_fn, "forward_fn": case.forward_fn}
    small = memfit.estimate(case.model, case.batch, **kwargs)
    for batch in (1, 3 * small.batch_size):
        traced = memfit.estimate(case.model, case.batch, batch_size=batch, **kwargs)
        predicted = small.at(batch).allocated_bytes
        assert abs(predicted - traced.peak_allocated_bytes) <= 0.01 * traced.peak_allocated_bytes
