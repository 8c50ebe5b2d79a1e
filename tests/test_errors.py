"""Bad input gets a memfit error that says what failed, where, and what to do; the model survives it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
import zoo
from memfit import InvalidInputError, TraceError, ValueDependentError
from memfit.integrations.huggingface.arguments import model_checkpointing
from memfit.lightning import MemoryPlanner as LightningPlanner
from memfit.planning.gpus import gpu_by_name


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


class MaskedScores(nn.Module):
    """transformers 4.x's BERT pattern (``guard="compiling"``): drop an all-ones attention mask in eager
    mode, a value read, but build it when ``is_torchdynamo_compiling()`` says a compiler is tracing."""

    def __init__(self, guard: str) -> None:
        super().__init__()
        self.embed, self.guard = nn.Embedding(50, 16), guard

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from transformers.utils import is_torchdynamo_compiling

        hidden = self.embed(ids)
        scores = hidden @ hidden.transpose(1, 2)
        if self.guard == "always" or (self.guard == "compiling" and is_torchdynamo_compiling()):
            expand = True  # what an eager run does for a batch with padding
        else:
            expand = not torch.all(mask == 1)
        if expand:
            scores = scores + (1.0 - mask[:, None, :].float()) * -1e4
        return scores.softmax(-1).sum()


def test_a_guarded_value_read_is_traced_through_the_branch_kept_for_torch_compile() -> None:
    import transformers.utils.import_utils as import_utils

    ids, mask = torch.randint(0, 50, (4, 32)), torch.ones(4, 32, dtype=torch.long)

    def traced(guard: str) -> memfit.MemoryEstimate:
        return memfit.estimate(
            MaskedScores(guard), (ids, mask), loss_fn=lambda out, _b: out, target=memfit.Target("cpu")
        )

    guarded, expanded = traced("compiling"), traced("always")
    assert any("torch.compile" in note for note in guarded.notes)
    assert not any("torch.compile" in note for note in expanded.notes)
    assert guarded.peak_allocated_bytes == expanded.peak_allocated_bytes
    assert guarded.breakdown == expanded.breakdown
    assert import_utils.is_torchdynamo_compiling() is False  # put back after the trace
    with pytest.raises(ValueDependentError, match="reads tensor values"):  # unguarded: the eager error stands
        traced("eager")


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
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"optimizer": 3}, "optimizer must be"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be True or False"),
        ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    kwargs.setdefault("loss_fn", lambda out, batch: out.sum())
    with pytest.raises(InvalidInputError, match=match):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), **kwargs)


def test_a_bad_device_raises_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="device must be 'cuda' or 'cpu'"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), target=memfit.Target("tpu"), loss_fn=lambda o, b: o.sum())


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


def test_a_failing_op_is_one_error_not_a_logged_torch_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """torch's fake-tensor module logs a traceback for an op that fails on fake tensors; memfit says it in one error."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 2))  # the second layer does not take the first's output
    with caplog.at_level("DEBUG", logger="torch._subclasses.fake_tensor"), pytest.raises(TraceError, match="forward"):
        memfit.estimate(model, torch.zeros(2, 8), target=memfit.Target("cpu"), loss_fn=lambda out, batch: out.sum())
    logged = [r for r in caplog.records if r.name.startswith("torch._subclasses") and r.levelname == "ERROR"]
    assert not logged


def test_sizes_that_cannot_be_read_are_memfit_input_errors() -> None:
    for bad in ("12 gigs", -1, "1.5.2GiB"):
        with pytest.raises(InvalidInputError):
            memfit.parse_bytes(bad)


def test_a_fraction_of_a_byte_is_refused_with_the_unit_it_likely_meant() -> None:
    """``budget=3.5`` read as 3 bytes would plan for nothing; a whole float (``8e9``) is still bytes."""
    with pytest.raises(InvalidInputError, match=r"whole number, got 3\.5; .* such as '3\.5GiB'"):
        memfit.parse_bytes(3.5)
    with pytest.raises(InvalidInputError, match="non-negative number, got inf"):
        memfit.parse_bytes(float("inf"))
    assert memfit.parse_bytes(8e9) == 8_000_000_000


def test_plan_takes_a_size_or_a_gpu_name_and_refuses_other_strings_in_one_line() -> None:
    """``memfit.plan(estimate, "h100")`` plans for that card's memory, ``"20GiB"`` for that size, as budgets do."""
    est_curve = memfit.trace(nn.Linear(8, 8), torch.randn(4, 8), batch_size=4, loss_fn=lambda out, batch: out.sum())
    h100 = gpu_by_name("h100").memory_bytes
    assert memfit.plan(est_curve, "h100").budget_bytes == memfit.plan(est_curve, h100).budget_bytes
    assert memfit.plan(est_curve, "20GiB").budget_bytes == memfit.plan(est_curve, 20 * 2**30).budget_bytes
    with pytest.raises(InvalidInputError, match="unknown GPU 'h1000'; did you mean H100"):
        memfit.plan(est_curve, "h1000")
    with pytest.raises(InvalidInputError, match=r"^capacity_bytes must be positive, got '-3GiB'"):
        memfit.plan(est_curve, "-3GiB")  # a size, but negative: said so, not "could not read it"
    with pytest.raises(InvalidInputError, match=r"^capacity_bytes could not read '3Gx' as a size"):
        memfit.plan(est_curve, "3Gx")


def test_a_sample_longer_than_the_learned_positions_is_refused_before_tracing() -> None:
    """On fake tensors an embedding lookup past the table reads no value, so it would trace; the run would fail."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=100))
    ids = torch.randint(0, 100, (2, 65))
    with pytest.raises(InvalidInputError, match=r"^sequences of 65 tokens are longer than the model's 64 positions"):
        memfit.estimate(model, {"input_ids": ids, "labels": ids})
    fits = ids[:, :64]
    assert memfit.estimate(model, {"input_ids": fits, "labels": fits}).seq_len == 64


def test_a_forward_pass_says_which_training_options_of_its_loop_did_not_apply() -> None:
    model, sample = nn.Linear(8, 8), torch.randn(4, 8)
    loop = memfit.TrainingLoop(accumulation_steps=4, ddp=True, extra_batches=1)
    forward = memfit.estimate(model, sample, inference=True, loop=loop)
    said = [note for note in forward.notes if note.startswith("a forward pass has no gradients")]
    assert len(said) == 1 and "accumulation_steps=4, ddp=DDPConfig(" in said[0] and "extra_batches does" in said[0]
    plain = memfit.estimate(model, sample, inference=True, loop=memfit.TrainingLoop(extra_batches=1))
    assert not any(note.startswith("a forward pass") for note in plain.notes)
    assert plain.peak_allocated_bytes == forward.peak_allocated_bytes


def test_a_budget_that_is_neither_a_size_nor_a_gpu_names_the_argument_and_both_forms() -> None:
    with pytest.raises(InvalidInputError, match=r"^`budget` is neither a size such as '20GiB' nor a known GPU: "):
        LightningPlanner(budget="lots of memory")
    with pytest.raises(InvalidInputError, match=r"^GPU 'a100' is ambiguous"):  # a card's name, only incomplete
        LightningPlanner(budget="a100")
