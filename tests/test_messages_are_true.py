"""What a plan says is what holds the memory: the CUDA context named where it dominates, the budget as given."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.tracing.config import Target
from memfit.units import format_margin


def small_mlp_estimate() -> memfit.StepCurve:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    return memfit.trace(model, torch.randn(8, 64), target=Target(device="cuda"), loss_fn=lambda out, _: out.mean())


def test_a_step_that_cannot_fit_names_the_cuda_context_not_the_model_states() -> None:
    """A 17k-parameter model's optimizer step on a GPU is mostly the CUDA context: the refusal says so, and does
    not call it parameters, gradients and optimizer state."""
    estimate = small_mlp_estimate()
    context = estimate.estimate.cuda_context_bytes
    assert context and context > 100 * 2**20
    with pytest.raises(memfit.MemfitError) as error:
        memfit.plan(estimate, 500 * 2**20, target_batch_size=8)
    message = str(error.value)
    assert f"the CUDA context {memfit.format_bytes(context)}" in message
    states = re.search(r"parameters, gradients and optimizer state ([\d.]+) KiB", message)
    assert states and float(states.group(1)) < 1024  # about 200 KiB of model states, named as such
    assert f"CUDA context alone takes {memfit.format_bytes(context)}" in message


def test_the_budget_is_quoted_as_given_with_the_margin_beside_it() -> None:
    estimate = small_mlp_estimate()
    chosen = memfit.plan(estimate, 2 * 2**30, target_batch_size=8)
    share = format_margin(DEFAULT_MARGIN)
    kept = memfit.format_bytes(round(2 * 2**30 * (1 - DEFAULT_MARGIN)))
    assert f"of 2.00 GiB budget ({kept} after its {share} margin)" in chosen.summary()
    kept = memfit.format_bytes(round(40 * 2**20 * (1 - DEFAULT_MARGIN)))
    with pytest.raises(memfit.MemfitError, match=re.escape(f"a 40.00 MiB budget ({kept} after its {share} margin)")):
        memfit.plan(estimate, 40 * 2**20, target_batch_size=8)
