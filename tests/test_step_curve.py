"""A ``MemoryEstimate`` is a value; the step read at other batches is a ``StepCurve`` (``memfit.trace``)."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import memfit
from memfit.devices import gpu_by_name


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_an_estimate_is_the_curves_value_and_holds_no_model() -> None:
    model = _mlp()
    estimate = memfit.estimate(model, torch.randn(8, 64), loss_fn=_loss)
    curve = memfit.trace(model, torch.randn(8, 64), loss_fn=_loss)
    assert estimate == curve.estimate  # the same prediction, however long each trace took
    assert pickle.loads(pickle.dumps(estimate)) == estimate
    assert not hasattr(estimate, "at") and curve.exact
    gone = weakref.ref(model)
    del model, curve
    gc.collect()
    assert gone() is None  # the value kept nothing of the model alive


def test_reading_an_estimate_at_another_batch_says_where_that_moved() -> None:
    estimate = memfit.estimate(_mlp(), torch.randn(8, 64), loss_fn=_loss)
    for read in ("at", "max_batch_size", "for_seq_len", "least_device_bytes", "at_limit", "rebuilt_at"):
        with pytest.raises(memfit.InvalidInputError, match=rf"MemoryEstimate\.{read}\(\) moved: .*memfit\.trace"):
            getattr(estimate, read)
    with pytest.raises(memfit.InvalidInputError, match=r"^plan\(curve\) must be the traced step, not a MemoryEst"):
        memfit.plan(estimate, "20GiB")


def test_a_confirm_that_returns_an_estimate_is_refused_in_one_line() -> None:
    model, sample = _mlp(), torch.randn(8, 64)
    curve = memfit.trace(model, sample, loss_fn=_loss)

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> memfit.MemoryEstimate:
        return memfit.estimate(model, sample, batch_size=micro, loss_fn=_loss)

    with pytest.raises(memfit.InvalidInputError, match=r"^what plan\(confirm=\) returns must be the traced step"):
        memfit.plan(curve, "20GiB", target_batch_size=32, confirm=confirm)


def test_a_curve_takes_its_capacity_as_plan_does() -> None:
    curve = memfit.trace(_mlp(), torch.randn(8, 64), loss_fn=_loss)
    assert curve.max_batch_size("20GiB") == curve.max_batch_size(memfit.parse_bytes("20GiB"))
    assert curve.max_batch_size("t4") == curve.max_batch_size(gpu_by_name("t4").memory_bytes)
    limited = curve.at_limit(16, "20GiB")
    assert limited is not None and limited == curve.at_limit(16, memfit.parse_bytes("20GiB"))
    with pytest.raises(memfit.InvalidInputError, match=r"^capacity_bytes could not read '3Gx' as a size"):
        curve.max_batch_size("3Gx")


def test_a_length_beyond_the_models_positions_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128, vocab_size=100))
    ids = torch.randint(0, 100, (2, 64))
    curve = memfit.trace(model, {"input_ids": ids, "labels": ids})
    assert curve.at(4, seq_len=128).device_bytes > curve.at(4).device_bytes
    for read in (lambda: curve.at(4, seq_len=4096), lambda: curve.for_seq_len(4096)):
        with pytest.raises(memfit.InvalidInputError, match="longer than the model's 128 positions"):
            read()


def test_pictures_of_other_batches_need_the_curve(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from memfit.plot import plot_batch_curve, plot_timeline

    curve = memfit.trace(_mlp(), torch.randn(8, 64), loss_fn=_loss)
    with pytest.raises(memfit.InvalidInputError, match=r"^plot_batch_curve draws the step at other batches"):
        plot_batch_curve(curve.estimate)
    plot_batch_curve(curve, path=tmp_path / "curve.png")
    plot_timeline(curve, path=tmp_path / "timeline.png")  # the value's timeline
    assert (tmp_path / "curve.png").stat().st_size and (tmp_path / "timeline.png").stat().st_size


def test_an_evaluation_beside_a_training_curve_reads_its_value() -> None:
    model, sample = _mlp(), torch.randn(8, 64)
    training = memfit.trace(model, sample, loss_fn=_loss)
    forward = memfit.trace(model, sample, inference=True, forward_fn=lambda m, b: m(b))
    assert memfit.evaluation_peak(training, forward) == memfit.evaluation_peak(training.estimate, forward.estimate)
