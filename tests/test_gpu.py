"""Prediction vs a real GPU. Skipped without CUDA (CI has none); run on a GPU machine with pytest -m gpu."""

from __future__ import annotations

import pytest
import torch

import memfit
import zoo

pytestmark = pytest.mark.gpu


def _measure(case: zoo.Case, steps: int = 2) -> tuple[int, int]:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    model = case.model.to(device).train()
    batch = {k: v.to(device) for k, v in case.batch.items()}
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def test_native_fake_cuda_trace_is_within_ten_percent_of_measured() -> None:
    case = zoo.gpt2_case(batch=8, seq=128)
    estimate = memfit.estimate(case.model, case.batch, target=memfit.Target("cuda"), optimizer="adamw")
    assert not any("fake CPU" in note for note in estimate.notes)  # the native path
    allocated, reserved = _measure(case)
    assert abs(estimate.peak_allocated_bytes - allocated) <= 0.1 * allocated, (
        estimate.peak_allocated_bytes,
        allocated,
    )
    assert abs(estimate.peak_reserved_bytes - reserved) <= 0.1 * reserved, (
        estimate.peak_reserved_bytes,
        reserved,
    )


def test_measured_context_is_close_to_the_default() -> None:
    pytest.importorskip("pynvml")
    from memfit.run.measure import nvml_device_used_bytes

    torch.zeros(1, device="cuda")
    used = nvml_device_used_bytes(torch.cuda.current_device())
    assert used is not None
    context = used - torch.cuda.memory_reserved()
    assert 100 * 2**20 < context < 2 * memfit.CudaRuntime().cuda_context_bytes


def test_an_lstm_traces_on_fake_cuda_tensors() -> None:
    """cuDNN's RNN kernels have no fake kernel that knows their memory; the trace runs memfit's stand-in for them."""
    model = zoo.LSTMClassifier(vocab=1000, hidden=256, layers=2, classes=10)
    batch = (torch.randint(0, 1000, (16, 64)), torch.zeros(16, dtype=torch.long))
    estimate = memfit.estimate(
        model,
        batch,
        target=memfit.Target("cuda"),
        forward_fn=lambda m, b: m(b[0]),
        loss_fn=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
    )
    device = torch.device("cuda")
    model = model.to(device).train()
    inputs, labels = (t.to(device) for t in batch)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    predicted = estimate.peak_allocated_bytes
    assert abs(predicted - allocated) <= 0.25 * allocated, (predicted, allocated)
