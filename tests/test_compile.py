"""A torch.compile'd model keeps compiling after memfit traced it, in the core API and in both frameworks.

Dynamo skips a frame it meets under a non-infra dispatch mode (memfit's fake tensors) and caches the
skip on the code object, so a trace that reached compiled code would leave that code eager for the rest
of the process. Each test runs the same real training with and without memfit, from a reset dynamo, and
compares what dynamo compiled. The framework tests use the ``aot_eager`` backend: the skip is decided in
dynamo's frame conversion, before any backend, and inductor's code generation would multiply the run time
on a CPU without changing what is compared; the core test uses inductor on a tiny MLP.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from transformers import Trainer

import memfit
from lightning_models import SEQ, TinyGPT
from memfit.huggingface import MemoryPlannerCallback
from memfit.lightning import MemoryPlanner
from test_huggingface import Tokens, tiny_gpt2, training_args

FRAMEWORK_BACKEND = "aot_eager"
COMPILED_NOTE = "torch.compile'd"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Every test starts from, and leaves, a dynamo with no compiled or skipped code, and the environment
    as it found it: transformers 4.x sets accelerate's ACCELERATE_DYNAMO_* variables for the whole process
    from ``torch_compile=True``, which would compile every later Trainer's model."""
    environment = dict(os.environ)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()
    os.environ.clear()
    os.environ.update(environment)


def compiled(run: Callable[[], object]) -> dict[str, int]:
    """What dynamo compiled while ``run`` ran, from a reset dynamo."""
    torch._dynamo.reset()
    counters.clear()
    run()
    return {
        "frames": counters["frames"]["ok"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "calls_captured": counters["stats"]["calls_captured"],
    }


def warm(model: nn.Module) -> None:
    """One eager forward, so that once-only code (transformers' ``warning_once``) runs before either count."""
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    model(input_ids=ids, labels=ids)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Holder(nn.Module):
    """A compiled model somewhere down the tree, as a LightningModule holds one."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def sum_loss(output: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
    return output.sum()


def test_estimate_of_a_compiled_module_leaves_its_compilation_alone() -> None:
    x = torch.randn(8, 16)

    def train(with_memfit: bool) -> None:
        model = torch.compile(MLP(), backend="inductor")
        if with_memfit:
            memfit.estimate(model, x, loss_fn=sum_loss, target=memfit.Target("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        fresh = torch.compile(MLP(), backend="inductor")  # the same class: the same code objects
        fresh(x + 1).sum().backward()

    without = compiled(lambda: train(False))
    assert without["unique_graphs"] > 0
    assert compiled(lambda: train(True)) == without


def test_compiled_and_eager_models_have_the_same_estimate_and_tree() -> None:
    x = torch.randn(8, 16)
    eager = MLP()
    wrapped = Holder(torch.compile(MLP(), backend=FRAMEWORK_BACKEND))
    in_place = MLP()
    in_place.compile(backend=FRAMEWORK_BACKEND)
    wrapper, inner = wrapped.inner, wrapped.inner._orig_mod
    compiled_call = in_place._compiled_call_impl

    for inference in (False, True):
        reference = memfit.estimate(eager, x, loss_fn=sum_loss, inference=inference)
        assert not any(COMPILED_NOTE in note for note in reference.notes)
        for model in (wrapped, torch.compile(eager, backend=FRAMEWORK_BACKEND), in_place):
            estimate = memfit.estimate(model, x, loss_fn=sum_loss, inference=inference)
            assert estimate.peak_allocated_bytes == reference.peak_allocated_bytes
            assert estimate.peak_reserved_bytes == reference.peak_reserved_bytes
            assert estimate.breakdown == reference.breakdown
            assert estimate.fixed_bytes == reference.fixed_bytes
            assert estimate.per_sample_bytes == reference.per_sample_bytes
            assert [n for n in estimate.notes if COMPILED_NOTE not in n] == list(reference.notes)
            assert any(COMPILED_NOTE in note and "eager" in note for note in estimate.notes)

    # the user's tree is as it was: the wrapper in its place, the in-place compilation kept
    assert wrapped.inner is wrapper and wrapper._orig_mod is inner
    assert dict(wrapped.named_children()) == {"inner": wrapper}
    assert in_place._compiled_call_impl is compiled_call
    assert all(not torch._subclasses.fake_tensor.is_fake(p) for p in wrapped.parameters())


class CompiledGPT(TinyGPT):
    """TinyGPT whose inner model is wrapped in torch.compile, as users of Lightning write it."""

    def __init__(self) -> None:
        super().__init__(batch_size=4, samples=16)
        warm(self.model)
        self.model = torch.compile(self.model, backend=FRAMEWORK_BACKEND)


def test_lightning_fit_with_memory_planner_compiles_as_without() -> None:
    planners: list[MemoryPlanner] = []

    def fit(with_memfit: bool) -> None:
        callbacks = [MemoryPlanner()] if with_memfit else []
        planners.extend(callbacks)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=2, callbacks=callbacks, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            default_root_dir=tempfile.mkdtemp(),
        )  # fmt: skip
        trainer.fit(CompiledGPT())

    without = compiled(lambda: fit(False))
    assert without["unique_graphs"] > 0
    assert compiled(lambda: fit(True)) == without
    (planner,) = planners
    assert planner.estimate is not None
    assert any(COMPILED_NOTE in note for note in planner.estimate.notes)


@pytest.mark.parametrize("in_place", [False, True], ids=["torch_compile-argument", "and-model.compile"])
def test_hf_trainer_with_torch_compile_and_planner_compiles_as_without(tmp_path: Path, in_place: bool) -> None:
    """``torch_compile=True``: accelerate wraps the model; a model compiled in place (``model.compile()``)
    is the one memfit's callback traces."""
    callbacks: list[MemoryPlannerCallback] = []

    def train(with_memfit: bool) -> None:
        model = tiny_gpt2()
        warm(model)
        if in_place:
            model.compile(backend=FRAMEWORK_BACKEND)
        args = training_args(
            tmp_path, max_steps=2, per_device_train_batch_size=4, logging_steps=1,
            torch_compile=True, torch_compile_backend=FRAMEWORK_BACKEND,
        )  # fmt: skip
        added = [MemoryPlannerCallback(verbose=False)] if with_memfit else []
        callbacks.extend(added)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(16), callbacks=added)
        trainer.train()
        assert trainer.state.global_step == 2

    without = compiled(lambda: train(False))
    assert without["unique_graphs"] > 0
    assert compiled(lambda: train(True)) == without
    (callback,) = callbacks
    assert callback.estimate is not None
    if in_place:  # with the argument alone the Trainer compiles a wrapper the callback does not trace
        assert any(COMPILED_NOTE in note for note in callback.estimate.notes)
