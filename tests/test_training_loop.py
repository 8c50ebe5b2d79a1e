"""The training loop around the step: when gradients are freed, accumulation, and DDP's buckets.

Each prediction is checked against a real run on CPU whose peak comes from the CPU allocator's own
reports to ``torch.profiler`` (``reference.profiled_cpu_peak``), so what a framework or DDP's C++
reducer allocates counts too. CPU tensors are allocated at their exact size, so the figures agree
within a few bytes (scalars) when the model is right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from integrations.accuracy.loops import WIDTH, hand_loop, hf_train, lightning_fit, mlp, predicted, wrap_in_ddp
from integrations.accuracy.reference import profiled_cpu_peak
from memfit import Category, DDPConfig, InvalidInputError
from memfit.ddp import bucket_bytes

MiB = 1024 * 1024
EXACT = 1024  # bytes: CPU tensors are allocated at their size, so a right model is off by a few scalars at most


@pytest.mark.parametrize(
    ("zero_grad", "accumulation"),
    [("after_step", 1), ("before_backward", 1), ("after_step", 3), ("before_backward", 3)],
)
def test_the_predicted_peak_is_the_peak_of_the_real_loop(zero_grad: str, accumulation: int) -> None:
    measured = profiled_cpu_peak(hand_loop(zero_grad, accumulation))
    estimate = predicted(zero_grad=zero_grad, accumulation_steps=accumulation)
    assert abs(estimate.peak_allocated_bytes - measured) <= EXACT
    assert (estimate.zero_grad, estimate.accumulation_steps) == (zero_grad, accumulation)
    loop_blind = predicted()
    if (zero_grad, accumulation) != ("after_step", 1):  # the gradients outlive the step: the blind trace misses them
        assert measured - loop_blind.peak_allocated_bytes > 0.5 * loop_blind.gradient_bytes


def test_bucket_layout_is_ddps() -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 3_000_000, (50,), generator=generator).tolist()
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32]
    params = [torch.empty(size, dtype=dtypes[i % len(dtypes)]) for i, size in enumerate(sizes)]
    for limits in ([sys.maxsize], [MiB, 25 * MiB], [5 * MiB]):
        buckets, _ = torch.distributed._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
        expected = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]
        assert bucket_bytes(params, limits) == expected


def test_ddp_config_reads_the_wrappers_options_and_rejects_bad_ones() -> None:
    config = DDPConfig.from_kwargs({"bucket_cap_mb": 50, "gradient_as_bucket_view": True, "broadcast_buffers": False})
    assert config == DDPConfig(bucket_cap_mb=50, gradient_as_bucket_view=True)
    assert DDPConfig.from_kwargs({}) == DDPConfig()  # DDP's default: 25 MiB after a first bucket of 1 MiB
    assert DDPConfig.from_kwargs({"bucket_cap_mb": 25})._limits == [25 * MiB]  # a cap given drops the small first one
    assert DDPConfig.from_kwargs(None).rebuilds and not DDPConfig(find_unused_parameters=True).rebuilds
    with pytest.raises(InvalidInputError, match="bucket_cap_mb must be a positive"):
        DDPConfig(bucket_cap_mb=0)
    with pytest.raises(InvalidInputError, match="static_graph must be True or False"):
        DDPConfig(static_graph="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"ddp must be True, False, None or a memfit\.DDPConfig"):
        predicted(ddp="ddp")
    with pytest.raises(InvalidInputError, match="zero_grad must be one of after_step, before_backward"):
        predicted(zero_grad="never")
    with pytest.raises(InvalidInputError, match="accumulation_steps must be a positive integer"):
        predicted(accumulation_steps=0)


@pytest.fixture
def process_group(tmp_path: Path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "config",
    [DDPConfig(), DDPConfig(gradient_as_bucket_view=True), DDPConfig(find_unused_parameters=True, bucket_cap_mb=4)],
    ids=["default", "bucket-view", "unused-parameters"],
)
def test_ddp_buckets_are_what_a_real_wrapper_allocates(process_group: None, config: DDPConfig) -> None:
    options = {
        "gradient_as_bucket_view": config.gradient_as_bucket_view,
        "find_unused_parameters": config.find_unused_parameters,
        "bucket_cap_mb": config.bucket_cap_mb or 25,
    }
    measured = profiled_cpu_peak(hand_loop("after_step", 1, wrap_in_ddp(options)))
    estimate = predicted(ddp=config)
    assert abs(estimate.peak_allocated_bytes - measured) <= EXACT
    weights = sum(p.numel() * p.element_size() for p in mlp().parameters())
    assert estimate.breakdown[Category.GRADIENT_BUCKETS] == weights
    if config.gradient_as_bucket_view:  # gradients live in the buckets: at most one fresh one at a time
        assert estimate.breakdown[Category.GRADIENTS] <= WIDTH * WIDTH * 4
    else:
        assert measured - predicted().peak_allocated_bytes > 0.9 * weights  # the buckets, missed without ddp


@pytest.mark.parametrize(("on_oom", "accumulation"), [("raise", 1), ("raise", 2), ("replan", 2)])
def test_lightning_fit_peaks_where_the_callback_predicts(tmp_path: Path, on_oom: str, accumulation: int) -> None:
    """Lightning zeroes gradients between ``training_step`` and ``backward``, so its forward carries them;
    memfit's recovering closure (``on_oom="replan"``) zeroes them before ``training_step`` instead, and
    keeps a window's earlier batches to replay them."""
    fit, callback = lightning_fit(tmp_path, on_oom, accumulation)
    measured = profiled_cpu_peak(fit)
    estimate = callback.estimate
    expected_order = "after_step" if on_oom == "replan" else "before_backward"
    assert (estimate.zero_grad, estimate.accumulation_steps) == (expected_order, accumulation)
    assert abs(estimate.peak_allocated_bytes - measured) <= EXACT
    loop_blind = predicted()
    assert measured - loop_blind.peak_allocated_bytes > 0.5 * loop_blind.gradient_bytes


@pytest.mark.parametrize("accumulation", [1, 2])
def test_hf_train_peaks_where_the_callback_predicts(tmp_path: Path, accumulation: int) -> None:
    train, callback = hf_train(tmp_path, accumulation)
    measured = profiled_cpu_peak(train)
    assert callback.estimate.accumulation_steps == accumulation
    assert abs(callback.estimate.peak_allocated_bytes - measured) <= EXACT
