"""Every port takes the plan's options the same way (``memfit.planning.run_options.RunOptions``): a bad one is
refused in the same line, naming the argument, when the callback or planner is made, before any data is read."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate import Accelerator

import memfit
from memfit.accelerate import MemoryPlanner as AcceleratePlanner
from memfit.huggingface import plan_training_arguments
from memfit.lightning import MemoryPlanner as LightningPlanner
from memfit.planning.run_options import RunOptions
from test_huggingface import tiny_gpt2, training_args

BAD = [
    ({"margin": 1.5}, "`margin` must be a fraction in [0, 1), got 1.5"),
    ({"target_batch_size": 0}, "`target_batch_size` must be a positive integer, 'max' or None, got 0"),
    ({"min_batch_size": 0}, "`min_batch_size` must be a positive integer, got 0"),
    ({"max_batch_size": "8"}, "`max_batch_size` must be a positive integer, got '8'"),
    ({"min_batch_size": 4, "max_batch_size": 2},
     "`max_batch_size` (2), `min_batch_size` (4): the largest micro batch must be at least the smallest"),
]  # fmt: skip


class _Untouchable:
    """A dataset that fails the test if a port reads it before refusing its options."""

    def __len__(self) -> int:
        raise AssertionError("the dataset was read before the options were checked")

    def __getitem__(self, index: int) -> None:
        raise AssertionError("the dataset was read before the options were checked")


@pytest.mark.parametrize(("options", "message"), BAD)
def test_every_port_refuses_a_bad_option_in_the_same_line(options: dict, message: str, tmp_path: Path) -> None:
    makers = [
        lambda: RunOptions(**options),
        lambda: LightningPlanner(**options),
        lambda: AcceleratePlanner(Accelerator(cpu=True), **options),
        lambda: plan_training_arguments(tiny_gpt2(), training_args(tmp_path), _Untouchable(), **options),
    ]
    for make in makers:
        with pytest.raises(memfit.InvalidInputError) as raised:
            make()
        assert str(raised.value) == message


def test_the_request_keeps_the_configured_effective_batch_unless_one_is_asked() -> None:
    request = RunOptions().request(capacity_bytes=2**30, configured=8, accumulation=2, ranks=4, include_context=True)
    assert (request.target_batch_size, request.world_size, request.capacity_bytes) == (64, 4, 2**30)
    asked = RunOptions(target_batch_size="max", max_batch_size=16)
    request = asked.request(capacity_bytes=2**30, configured=8, accumulation=2, ranks=1, include_context=False)
    assert (request.target_batch_size, request.max_batch_size, request.include_context) == ("max", 16, False)


def test_every_port_refuses_bf16_on_a_card_without_it_as_the_cli_does(tmp_path: Path) -> None:
    """A T4 has no bf16: planned for one, each port says so in the CLI's words (Lightning as its one warning)."""
    import torch

    from test_accelerate import token_loader

    said = r"^T4 \(Turing\) has no bf16, so bf16-mixed would run emulated"
    with pytest.raises(memfit.InvalidInputError, match=said):
        model = tiny_gpt2()
        AcceleratePlanner(Accelerator(cpu=True, mixed_precision="bf16"), budget="t4").plan(
            model, torch.optim.AdamW(model.parameters()), token_loader()
        )
    with pytest.raises(memfit.InvalidInputError, match=said):
        plan_training_arguments(tiny_gpt2(), training_args(tmp_path, bf16=True), _Untouchable(), budget="t4")
