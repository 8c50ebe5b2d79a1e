"""A GPU-name budget plans for that GPU (CUDA semantics), whatever this machine has; ``target=`` names the device.

Real ``lightning.Trainer.fit`` and ``transformers.Trainer.train`` on CPU: the plan is made for the GPU and
the run still trains on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer

from lightning_models import TinyGPT
from memfit import InvalidInputError, MemoryEstimate, Plan
from memfit.huggingface import attach, plan_training_arguments
from memfit.lightning import MemoryPlanner
from memfit.planning.gpus import gpu_by_name
from test_huggingface import BatchSizes, Tokens, tiny_gpt2, training_args
from test_lightning import trainer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a GPU this machine does not have")


def assert_planned_for_cuda(estimate: MemoryEstimate, plan: Plan, gpu: str) -> None:
    """CUDA semantics: the estimate is for CUDA, its context counts against the GPU's memory."""
    assert estimate.device == "cuda" and estimate.cuda_context_bytes
    assert plan.capacity_bytes == gpu_by_name(gpu).memory_bytes
    assert plan.predicted_peak_bytes >= estimate.peak_reserved_bytes + estimate.cuda_context_bytes
    assert any(f"planned for the {gpu_by_name(gpu).name}" in note for note in estimate.notes)


def test_lightning_plans_a_gpu_name_budget_for_that_gpu_and_trains_on_cpu(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget="h100")
    fit = trainer(tmp_path, callback, max_steps=2)
    fit.fit(module)
    assert_planned_for_cuda(callback.estimate, callback.plan, "H100")
    assert fit.strategy.root_device.type == "cpu" and fit.global_step == 2
    assert set(module.seen_batch_sizes) == {callback.plan.micro_batch_size}


def test_lightning_target_names_the_device_planned_for(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(target="t4")  # the budget is the T4's memory
    trainer(tmp_path, callback, max_steps=1).fit(module)
    assert_planned_for_cuda(callback.estimate, callback.plan, "T4")

    explicit = MemoryPlanner(budget="h100", target="cpu")  # asked for: CPU semantics against 80 GB
    trainer(tmp_path, explicit, max_steps=1).fit(TinyGPT(batch_size=12))
    assert explicit.estimate.device == "cpu" and not explicit.estimate.cuda_context_bytes


@pytest.mark.usefixtures("lenient")
def test_lightning_cuda_target_without_a_budget_on_cpu_warns_and_trains_as_configured(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    fit = trainer(tmp_path, MemoryPlanner(target="cuda"), max_steps=2)
    with pytest.warns(UserWarning, match="target='cuda' plans for cuda but the run uses cpu.*pass budget="):
        fit.fit(module)
    assert fit.global_step == 2 and set(module.seen_batch_sizes) == {12}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": "tpu"}, r"`target` must be 'cuda', 'cpu', a GPU name such as 'h100', or None, got 'tpu'"),
        ({"target": 0}, r"`target` must be 'cuda', 'cpu', a GPU name such as 'h100', or None, got 0"),
        ({"target": "a100"}, r"got 'a100': GPU 'a100' is ambiguous"),
        ({"target": "h100", "budget": "t4"}, r"`budget` names the T4 and `target` the H100"),
    ],
)
def test_target_is_validated_when_built(kwargs: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=match):
        MemoryPlanner(**kwargs)
    with pytest.raises(InvalidInputError, match=match):
        plan_training_arguments(tiny_gpt2(), training_args(tmp_path), Tokens(), **kwargs)


def test_hf_plans_a_gpu_name_budget_for_that_gpu_and_trains_on_cpu(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path, max_steps=2)
    planned = plan_training_arguments(model, args, data, budget="h100")
    assert_planned_for_cuda(planned.estimate, planned.plan, "H100")
    sizes = BatchSizes(model)
    run = Trainer(model=model, args=planned.args, train_dataset=data)
    attach(run, plan=planned.plan)
    run.train()
    assert run.args.device.type == "cpu" and run.state.global_step == 2
    assert set(sizes.seen) == {planned.plan.micro_batch_size}

    on_t4 = plan_training_arguments(model, args, data, target="t4")
    assert_planned_for_cuda(on_t4.estimate, on_t4.plan, "T4")
    cpu = plan_training_arguments(model, args, data, budget="h100", target="cpu")
    assert cpu.estimate.device == "cpu" and not cpu.estimate.cuda_context_bytes
    with pytest.raises(InvalidInputError, match="target='cuda' plans for cuda but the run uses cpu"):
        plan_training_arguments(model, args, data, target="cuda")
