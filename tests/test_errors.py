"""Bad input gets a memfit error that says what failed, where, and what to do; the model survives it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
import zoo
from memfit import InvalidInputError, TraceError, ValueDependentError
from memfit.huggingface import model_checkpointing


class ReadsValues(nn.Module):
    """Branches on a tensor value, which a fake tensor does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.encoder(x)).sum()


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # data-dependent control flow
            return x * 2
        return x


def test_value_dependent_model_names_the_module_and_the_ways_out() -> None:
    model = ReadsValues()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueDependentError) as error:
        memfit.estimate(model, torch.randn(4, 8))
    message = str(error.value)
    assert "`gate`" in message
    assert "fake tensors" in message and "estimate_from_counts" in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(type(p) is nn.Parameter for p in model.parameters())  # no fake tensor left behind


def test_sample_that_does_not_fit_the_model_names_module_and_shapes() -> None:
    model = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(TraceError) as error:
        memfit.estimate(model, torch.randn(3, 7), loss_fn=lambda out, batch: out.sum())
    message = str(error.value)
    assert "forward" in message and "`0`" in message
    assert "float32[3, 7]" in message
    assert isinstance(error.value.__cause__, RuntimeError)


def test_output_that_is_not_a_loss_asks_for_loss_fn() -> None:
    with pytest.raises(TraceError, match="loss_fn"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4))


def test_loss_without_grad_is_reported() -> None:
    with pytest.raises(TraceError, match="does not require grad"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), loss_fn=lambda out, batch: out.detach().sum())


def test_failing_loss_fn_is_reported_as_loss() -> None:
    def broken(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(TraceError, match=r"the loss of Linear failed: KeyError"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), loss_fn=broken)


def test_frozen_model_has_nothing_to_train() -> None:
    model = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(InvalidInputError, match="requires grad"):
        memfit.estimate(model, torch.randn(3, 4), loss_fn=lambda out, batch: out.sum())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "tpu"}, "device must be 'cuda' or 'cpu'"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"optimizer": "adam-8bit"}, "estimate_from_counts"),
        ({"optimizer": 3}, "optimizer must be"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be True or False"),
        ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    kwargs.setdefault("loss_fn", lambda out, batch: out.sum())
    with pytest.raises(InvalidInputError, match=match):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), **kwargs)


def test_not_a_module_and_no_batch_dimension() -> None:
    with pytest.raises(InvalidInputError, match=r"torch\.nn\.Module"):
        memfit.estimate(lambda x: x, torch.randn(3, 4))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="no tensor with a batch dimension"):
        memfit.estimate(nn.Linear(4, 2), {"x": 3})


def test_optimizer_over_other_parameters_is_rejected() -> None:
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(InvalidInputError, match="holds none of the model's parameters"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), optimizer=other, loss_fn=lambda o, b: o.sum())


def test_checkpoint_modules_that_match_nothing() -> None:
    case = zoo.resnet_case()
    with pytest.raises(InvalidInputError, match="matches no submodule"):
        memfit.estimate(
            case.model,
            case.batch,
            gradient_checkpointing=True,
            checkpoint_modules=[nn.LSTM],
            loss_fn=case.loss_fn,
            forward_fn=case.forward_fn,
        )


def test_model_is_restored_after_a_failure_mid_trace() -> None:
    case = zoo.gpt2_case()
    parameters = {name: id(p) for name, p in case.model.named_parameters()}
    with pytest.raises(TraceError):
        memfit.estimate(case.model, case.batch, loss_fn=lambda out, batch: out.logits)  # not a scalar
    assert {name: id(p) for name, p in case.model.named_parameters()} == parameters
    assert not model_checkpointing(case.model)
