"""One symbolic trace answers every batch size: ``at(b)`` equals a concrete trace at ``b``, to the byte."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import Case, bert_case, gpt2_case, resnet_case
from torch import nn

import memfit
from memfit.errors import ValueDependentError
from memfit.prediction.estimator import trace_for_runtimes
from memfit.prediction.exact import clear_sessions, kept_sessions


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp_case(batch: int = 4) -> Case:
    torch.manual_seed(0)
    return Case(
        "mlp", MLP(), (torch.randn(batch, 32), torch.randint(0, 10, (batch,))),
        lambda out, b: F.cross_entropy(out, b[1]), lambda model, b: model(b[0]),
    )  # fmt: skip


FAMILIES = {"gpt2": gpt2_case, "bert": bert_case, "cnn-batchnorm": resnet_case, "mlp": mlp_case}


@pytest.fixture(autouse=True)
def _fresh_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMFIT_TRACE", raising=False)
    clear_sessions()


def _estimate(case: Case, **kwargs: Any) -> memfit.MemoryEstimate:
    return _trace(case, **kwargs).estimate


def _trace(case: Case, **kwargs: Any) -> memfit.StepCurve:
    return memfit.trace(case.model, case.batch, loss_fn=case.loss_fn, forward_fn=case.forward_fn, **kwargs)


def _concrete(case: Case, batch: int, fit: memfit.MemoryEstimate, **kwargs: Any) -> memfit.MemoryEstimate:
    """One concrete trace at ``batch`` (``batch_fits`` skips the symbolic path and the second trace)."""
    return trace_for_runtimes(
        case.model, case.batch, batch_size=batch, batch_fits=[fit], loss_fn=case.loss_fn, forward_fn=case.forward_fn,
        **kwargs,
    )[0].estimate  # fmt: skip


def _log(trace: Any) -> list[tuple[str, int, Any]]:
    recorder = trace.recorder
    return [("+" if e > 0 else "-", recorder.sizes[abs(e)], recorder.categories.get(abs(e))) for e in recorder.events]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_the_log_read_at_a_batch_is_the_concrete_log_event_by_event(family: str) -> None:
    """Not only the peaks: every allocation and free, its size and category, in order. (Indexing over a whole
    symbolic dimension, ``hidden[:, keep, :]``, once added a backward copy that eager never runs.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    case = FAMILIES[family]()
    if family == "gpt2":  # the 768-wide model where that copy moved the peak
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (2, 128))
        case = Case("gpt2", GPT2LMHeadModel(GPT2Config(n_layer=2)), {"input_ids": ids, "labels": ids}, None, None)
    _estimate(case, target=memfit.Target("cuda"), precision="bf16-mixed")
    (session,) = kept_sessions()
    (symbolic,) = session.symbolic
    for batch in (3, 21):
        assert _log(symbolic.at(batch)) == _log(session.concrete_trace(batch)), batch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_at_equals_a_concrete_trace_to_the_byte(family: str) -> None:
    case = FAMILIES[family]()
    curve = _trace(case)
    estimate = curve.estimate
    assert any("symbolic" in note for note in estimate.notes), estimate.notes
    traced = _concrete(case, estimate.batch_size, estimate)
    assert estimate.peak_allocated_bytes == traced.peak_allocated_bytes  # the estimate's own batch, unchanged
    assert estimate.peak_reserved_bytes == traced.peak_reserved_bytes
    for batch in (1, 7, 64):
        predicted, concrete = curve.at(batch), _concrete(case, batch, estimate)
        assert predicted.allocated_bytes == concrete.peak_allocated_bytes, (family, batch)
        assert predicted.reserved_bytes == concrete.peak_reserved_bytes, (family, batch)


def test_inference_pass_is_symbolic_too() -> None:
    case = gpt2_case()
    curve = _trace(case, inference=True)
    estimate = curve.estimate
    assert any("symbolic" in note for note in estimate.notes)
    for batch in (3, 32):
        concrete = _concrete(case, batch, estimate, inference=True)
        assert curve.at(batch).allocated_bytes == concrete.peak_allocated_bytes


def test_batch_one_is_traced_concretely_and_the_symbolic_trace_taken_when_needed() -> None:
    case = mlp_case()
    curve = _trace(case, batch_size=1)
    estimate = curve.estimate
    assert any("traced at batch sizes 1 and 2" in note for note in estimate.notes), estimate.notes
    assert estimate.peak_allocated_bytes == _concrete(case, 1, estimate).peak_allocated_bytes
    (session,) = kept_sessions()
    assert not session.symbolic and sorted(session.concrete) == [1, 2]
    assert curve.at(2).allocated_bytes == _concrete(case, 2, estimate).peak_allocated_bytes
    assert not session.symbolic  # batch 2 was traced: no symbolic trace yet
    assert curve.at(13).allocated_bytes == _concrete(case, 13, estimate).peak_allocated_bytes
    assert len(session.symbolic) == 1


def test_an_estimate_of_a_model_the_caller_let_go_still_replays_its_trace() -> None:
    """``estimate(build(), ...)``: nothing but the estimate holds the model, whose symbolic trace at() takes
    later (after batch 1's concrete traces). at() must be that trace's replay, as when the caller kept the
    model, not the fit in the batch from batches 1 and 2."""
    import gc

    twin = mlp_case()  # the same step, kept here for the concrete traces
    curve = _trace(mlp_case(), batch_size=1)
    estimate = curve.estimate
    gc.collect()
    for batch in (13, 200):
        predicted, concrete = curve.at(batch), _concrete(twin, batch, estimate)
        assert (predicted.allocated_bytes, predicted.reserved_bytes) == (
            concrete.peak_allocated_bytes, concrete.peak_reserved_bytes), batch  # fmt: skip
    (session,) = kept_sessions()
    assert len(session.symbolic) == 1


class Branching(nn.Module):
    """Branches on the batch size, as real code does (``cdist`` itself switches kernels above 25 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if x.shape[0] > 16:  # a larger batch takes a path that keeps a wider intermediate
            h = torch.cat([h, h * 2], dim=1).sum(dim=1, keepdim=True) + h
        return h


def _branching_case(batch: int = 8) -> Case:
    torch.manual_seed(0)
    return Case("branching", Branching(), torch.randn(batch, 16), lambda out, b: out.pow(2).mean(), None)


def test_guards_limit_the_batches_one_trace_answers() -> None:
    case = _branching_case()
    curve = _trace(case)
    estimate = curve.estimate
    assert any("the batch size is at most 16" in note for note in estimate.notes), estimate.notes
    for batch in (5, 16, 17, 40):  # both sides of the branch, each equal to its own concrete trace
        assert curve.at(batch).allocated_bytes == _concrete(case, batch, estimate).peak_allocated_bytes
    assert curve.at(17).allocated_bytes > curve.at(16).allocated_bytes


class ReadsBatchAsNumber(nn.Module):
    """Turns the batch size into a plain number (a tensor's value read back): the trace pins the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(torch.tensor(x.shape[0]).item())
        return self.proj(x) + torch.zeros(rows, 1)


def test_a_pinned_batch_is_traced_per_batch_size_and_still_exact() -> None:
    torch.manual_seed(0)
    case = Case("pinned", ReadsBatchAsNumber(), torch.randn(6, 16), lambda out, b: out.sum(), None)
    curve = _trace(case)
    estimate = curve.estimate
    assert any("reads it as a plain number" in note for note in estimate.notes), estimate.notes
    for batch in (3, 11):
        assert curve.at(batch).allocated_bytes == _concrete(case, batch, estimate).peak_allocated_bytes


class ValueDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[(x.sum(dim=1) > 0).nonzero().squeeze(1)]  # rows chosen by value
        return self.proj(kept)


def test_value_dependent_shapes_fall_back_to_the_concrete_trace() -> None:
    """nonzero runs under a symbolic batch but sizes its output by values: the concrete trace decides, and it
    refuses with the same actionable error as with MEMFIT_TRACE=concrete."""
    torch.manual_seed(0)
    case = Case("values", ValueDependent(), torch.randn(4, 16), lambda out, b: out.sum(), None)
    with pytest.raises(ValueDependentError, match="reads tensor values"):
        _estimate(case)


def test_a_sample_factory_whose_shapes_change_falls_back_and_says_why() -> None:
    """A sample whose sequence grows with the batch cannot be one symbolic trace: two concrete traces and the
    fit, as before, with the reason in the notes."""
    model = MLP()

    def sample(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 32 + 0 * batch), torch.randint(0, 10, (batch, 1 + batch % 2))

    curve = memfit.trace(
        model, sample, batch_size=4, forward_fn=lambda m, b: m(b[0]), loss_fn=lambda out, b: out.float().mean()
    )
    estimate = curve.estimate
    assert any("interpolated" in note and "beyond their first dimension" in note for note in estimate.notes), (
        estimate.notes
    )
    assert not curve.exact


def test_concrete_environment_switch_keeps_the_two_trace_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    case = mlp_case()
    monkeypatch.setenv("MEMFIT_TRACE", "concrete")
    curve = _trace(case)
    estimate = curve.estimate
    assert not curve.exact
    assert not any("symbolic" in note for note in estimate.notes)


def test_planning_session_traces_the_step_once() -> None:
    """A session asking estimate() at many micro batches replays one trace (plus batch 1's own if asked)."""
    from memfit.planning.session import PlanningSession, PlanRequest

    case = gpt2_case()

    def trace_at(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        return _trace(case, batch_size=micro, gradient_checkpointing=checkpointing)

    session = PlanningSession(trace_at, batch_size=4)
    budget = session.baseline.at(37).device_bytes + 1
    decision = session.decide(PlanRequest(capacity_bytes=budget, margin=0.0, target_batch_size="max"))
    micro, base = decision.plan.micro_batch_size, session.baseline
    assert micro >= 37 and base.at(micro).device_bytes <= budget < base.at(micro + 1).device_bytes
    (only,) = [s for s in kept_sessions() if not s.settings.gradient_checkpointing]
    assert len(only.symbolic) == 1 and not only.concrete


# ----------------------------------------------------------------------- the sequence length, a second symbol


def _peak_of(case: Case, batch: int) -> tuple[int, int]:
    """Allocated and reserved peaks of one concrete trace of ``case`` at ``batch`` (CUDA semantics, bf16-mixed)."""
    options: dict[str, Any] = {"target": memfit.Target("cuda"), "precision": "bf16-mixed"}
    fit = trace_for_runtimes(case.model, case.batch, batch_size=batch, loss_fn=case.loss_fn,
                             forward_fn=case.forward_fn, **options)[0].estimate  # fmt: skip
    clear_sessions()
    traced = _concrete(case, batch, fit, **options)
    return traced.peak_allocated_bytes, traced.peak_reserved_bytes


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_one_trace_answers_other_sequence_lengths_to_the_byte(family: str) -> None:
    build = FAMILIES[family]
    points = ((2, 17), (7, 64), (5, 128), (1, 33))
    expected = {(batch, seq): _peak_of(build(batch=batch, seq=seq), batch) for batch, seq in points}
    clear_sessions()
    curve = _trace(build(batch=2, seq=64), target=memfit.Target("cuda"), precision="bf16-mixed")
    estimate = curve.estimate
    assert estimate.seq_len == 64
    (session,) = kept_sessions()
    assert session.with_length is None  # the sample's own length needs no second symbol
    for (batch, seq), peaks in expected.items():
        got = curve.at(batch, seq)
        assert (got.allocated_bytes, got.reserved_bytes) == peaks, (batch, seq)
    # one more symbolic trace, the length symbolic too, answered every batch of 2 and up at every length; batch 1
    # took a trace of its own
    assert session.with_length is not None and session.with_length.seq is not None
    assert len(session.symbolic) == 1 and list(session.other_lengths) == [(1, 33)]


class ReadsTheLength(nn.Module):
    """Reads the sequence length as a plain number (``int(...)``), which pins it in a symbolic trace."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 32), nn.Linear(32, 100)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids) + torch.zeros(int(input_ids.shape[1]), 32)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def test_a_pinned_sequence_length_is_traced_at_each_length_and_still_exact() -> None:
    def build(batch: int = 2, seq: int = 16) -> Case:
        torch.manual_seed(0)
        ids = torch.randint(0, 100, (batch, seq))
        return Case("pinned", ReadsTheLength(), {"input_ids": ids, "labels": ids}, None, None)

    expected = {(batch, seq): _peak_of(build(batch, seq), batch) for batch, seq in ((3, 16), (3, 40))}
    clear_sessions()
    curve = memfit.trace(build().model, build().batch, target=memfit.Target("cuda"), precision="bf16-mixed")
    for (batch, seq), peaks in expected.items():
        got = curve.at(batch, seq)
        assert (got.allocated_bytes, got.reserved_bytes) == peaks, (batch, seq)


def test_a_sample_without_a_sequence_says_so() -> None:
    curve = _trace(resnet_case())
    estimate = curve.estimate
    assert estimate.seq_len is None
    with pytest.raises(memfit.InvalidInputError, match="no sequence dimension"):
        curve.at(2, 128)
