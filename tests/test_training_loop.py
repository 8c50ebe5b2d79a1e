"""The training loop around the step: when gradients are freed, accumulation, and DDP's buckets.

Each prediction is checked against a real run on CPU whose peak comes from the CPU allocator's own
reports to ``torch.profiler`` (``reference.profiled_cpu_peak``), so what a framework or DDP's C++
reducer allocates counts too. CPU tensors are allocated at their exact size, so the figures agree
within a few bytes (scalars) when the model is right.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import memfit
from harness.accuracy.loops import (
    BATCH,
    WIDTH,
    hand_loop,
    hf_train,
    lightning_fit,
    lightning_fit_variable_lengths,
    mlp,
    predicted,
    wrap_in_ddp,
)
from harness.accuracy.reference import profiled_cpu_peak
from memfit import Category, DDPConfig, InvalidInputError
from memfit.tracing.ddp import bucket_bytes

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


@pytest.mark.parametrize(("on_oom", "accumulation"), [("replan", 1), ("replan", 2), ("raise", 2)])
def test_hf_train_peaks_where_the_callback_predicts(tmp_path: Path, on_oom: str, accumulation: int) -> None:
    """The Trainer holds a whole accumulation window's batches whether or not memfit's recovery is on."""
    train, callback = hf_train(tmp_path, accumulation, on_oom=on_oom)
    measured = profiled_cpu_peak(train)
    assert callback.estimate.accumulation_steps == accumulation
    assert abs(callback.estimate.peak_allocated_bytes - measured) <= EXACT


def test_lightning_plans_on_the_longest_batch_its_collate_fn_pads(tmp_path: Path) -> None:
    """The dataloader pads each batch to its longest example; the third batch holds the long one."""
    fit, callback, first_batch = lightning_fit_variable_lengths(tmp_path)
    measured = profiled_cpu_peak(fit)
    assert abs(callback.estimate.peak_allocated_bytes - measured) <= EXACT
    assert first_batch().peak_allocated_bytes < 0.5 * measured  # what the dataloader's first batch would say


def test_lightning_validation_beside_the_optimizer_state_is_predicted_and_warned(tmp_path: Path) -> None:
    """Validation runs without gradients (Lightning releases them first) but beside the optimizer state."""
    budget = 100 * MiB
    fit, callback = lightning_fit(tmp_path, "replan", 1, validation_batch=8 * BATCH, budget="100MiB")
    with pytest.warns(UserWarning, match="validation may run out of memory where training fits: evaluation at batch"
                      ) as caught:  # fmt: skip
        measured = profiled_cpu_peak(fit)
    # the budget as given, then what its margin leaves: the plan line's figures, in its order
    assert "over the 100.00 MiB budget (98.50 MiB after its 1.5% margin)" in str(caught[0].message)
    validation, training = callback.validation, callback.estimate
    assert training.peak_allocated_bytes < budget < validation.allocated_bytes  # the case the warning is for
    assert abs(validation.allocated_bytes - measured) <= EXACT  # the run's peak is the validation pass
    momentum = sum(p.numel() * p.element_size() for p in mlp().parameters())
    assert validation.carried_bytes == momentum

    roomy, callback = lightning_fit(tmp_path / "roomy", "replan", 1, validation_batch=8 * BATCH, budget="1GiB")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*validation may run out of memory.*")
        roomy()
    assert callback.validation.allocated_bytes == validation.allocated_bytes


@pytest.mark.usefixtures("lenient")
def test_a_validation_step_memfit_cannot_trace_costs_only_the_check(tmp_path: Path) -> None:
    import lightning as L

    from memfit.lightning import MemoryPlanner

    class ReadsValues(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch: list[torch.Tensor], _index: int) -> None:
            if self.net(batch[0]).mean().item() > 1e9:  # a value a fake tensor does not have
                raise AssertionError

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    callback = MemoryPlanner(mode="observe", budget="1GiB", verbose=False)
    trainer = L.Trainer(max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memfit.*")
        trainer.fit(ReadsValues(), data, data)
    assert trainer.global_step == 2 and callback.estimate is not None and callback.validation is None


def test_evaluation_peak_needs_a_training_and_a_forward_only_estimate() -> None:
    training, forward_only = predicted(), predicted(inference=True)
    peak = memfit.evaluation_peak(training, forward_only)
    assert peak.carried_bytes == 0 and peak.allocated_bytes == forward_only.peak_allocated_bytes  # plain SGD
    with pytest.raises(InvalidInputError, match=r"estimate\(\.\.\., inference=True\)"):
        memfit.evaluation_peak(training, training)
    with pytest.raises(InvalidInputError, match="has no optimizer step"):
        memfit.evaluation_peak(forward_only, forward_only)


def test_the_reference_peak_ignores_blocks_an_earlier_measurement_saw_allocated() -> None:
    """The CPU allocator remembers blocks across profiles: one allocated while an earlier profile ran
    and freed in this one is reported as a free here, and must not lower this measurement's peak."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        left_over = [torch.empty(16384)]  # 64 KiB, alive after that profile ends

    def run() -> None:
        first = torch.empty(1 << 18)  # 1 MiB
        left_over.clear()
        second = torch.empty(1 << 18)
        del first, second

    assert profiled_cpu_peak(run) == 2 * 1024 * 1024
