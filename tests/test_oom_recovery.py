"""Out-of-memory recovery: the core on a plain loop, then a real Lightning fit and a real HF Trainer.

Each model raises a real ``torch.OutOfMemoryError`` from inside forward (or backward) when the micro
batch is above a threshold. A recovered run must end where an undisturbed run ends: the same
optimizer steps, every sample seen once, and the same parameters.
"""

from __future__ import annotations

import csv
import inspect
import warnings
from collections import namedtuple
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from transformers import TrainerCallback

import memfit
from fault_models import (
    DictData,
    DictRegression,
    FailingSGD,
    Regression,
    ceiling,
    flat_parameters,
    regression_data,
    regression_net,
)
from memfit import UnrecoverableOutOfMemoryError
from memfit.lightning import MemoryPlanner
from memfit.run.recovery import (
    OOMRecovery,
    OutOfMemoryFigures,
    Recovery,
    is_out_of_memory,
    out_of_memory_figures,
    split_batch,
)
from memfit.units import GiB, KiB, MiB

# ---------------------------------------------------------------------------------------------- core


def test_split_batch_cuts_per_sample_leaves_and_shares_the_rest() -> None:
    Pair = namedtuple("Pair", "x y")
    shared = torch.ones(3)
    batch = {"x": torch.arange(10).view(5, 2), "pair": Pair(torch.arange(5), shared), "names": list("abcde")}
    chunks = split_batch(batch, 2)
    assert [samples for _, samples in chunks] == [2, 2, 1]
    assert torch.equal(torch.cat([c["x"] for c, _ in chunks]), batch["x"])
    assert [c["names"] for c, _ in chunks] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(isinstance(c["pair"], Pair) and c["pair"].y is shared for c, _ in chunks)
    assert torch.equal(chunks[2][0]["pair"].x, torch.tensor([4]))


def test_out_of_memory_errors_are_told_apart_from_others() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of range"))
    assert not is_out_of_memory(UnrecoverableOutOfMemoryError("gave up"))


def plain_loop(net: nn.Module, recovery: OOMRecovery | None, *, steps: int = 4, accumulation: int = 2) -> list[int]:
    """SGD over ``regression_data`` in micro batches of 12; returns the sample ids seen by finished forwards."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y, ids = regression_data().tensors
    seen: list[int] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if recovery:
            recovery.start_window()
        for micro in range(accumulation):
            start = (step * accumulation + micro) * 12
            batch = (x[start : start + 12], y[start : start + 12], ids[start : start + 12])

            def run(chunk: tuple, weight: float, last: bool) -> torch.Tensor:
                loss = nn.functional.mse_loss(net(chunk[0]), chunk[1]) / accumulation
                seen.extend(chunk[2].tolist())
                if recovery:
                    recovery.backward_started()
                (loss * weight).backward()
                return loss.detach() * weight

            if recovery:
                ceiling(net).armed = step * accumulation + micro >= 3  # from the 2nd batch of the 2nd window
                recovery.run_batch(batch, run, step=step, sync=micro == accumulation - 1)
            else:
                run(batch, 1.0, True)
        optimizer.step()
    return seen


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_recovered_loop_matches_the_undisturbed_one(where: str) -> None:
    reference = regression_net(None, where)
    plain_loop(reference, None)
    net = regression_net(5, where)
    recovery = OOMRecovery(reset_gradients=lambda: net.zero_grad(set_to_none=True))
    seen = plain_loop(net, recovery)
    assert torch.allclose(flat_parameters(net), flat_parameters(reference), atol=1e-6)
    assert recovery.chunk_size is not None and recovery.chunk_size <= 5
    first = recovery.recoveries[0]
    assert (first.step, first.batch_size, first.chunk_before, first.chunk_after) == (1, 12, 12, 6)
    if where == "forward":  # nothing replayed: each sample's forward finished once
        assert sorted(seen) == list(range(96)) and first.replayed_batches == 0
    else:  # mid-backward: the window's first batch ran again
        assert first.replayed_batches == 1 and len(seen) > 96


def test_nothing_left_to_try_raises_with_what_to_do() -> None:
    net = regression_net(0, "forward")
    enabled: list[bool] = []
    recovery = OOMRecovery(reset_gradients=lambda: None, enable_checkpointing=lambda: enabled.append(True))
    with pytest.raises(UnrecoverableOutOfMemoryError, match="chunks of 1 sample with checkpointing") as caught:
        plain_loop(net, recovery)
    assert isinstance(caught.value, torch.OutOfMemoryError)  # user code that catches torch's error still does
    assert enabled == [True]  # checkpointing was tried once before giving up
    assert [r.chunk_after for r in recovery.recoveries] == [6, 3, 1, 12, 6, 3, 1]


def test_raise_mode_and_other_errors_pass_through() -> None:
    net = regression_net(5, "forward")
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        plain_loop(net, OOMRecovery(reset_gradients=lambda: None, on_oom="raise"))
    recovery = OOMRecovery(reset_gradients=lambda: None)

    def broken(chunk: object, weight: float, last: bool) -> None:
        raise KeyError("not memory")

    with pytest.raises(KeyError):
        recovery.run_batch(torch.zeros(4, 2), broken, step=0)
    assert recovery.recoveries == []


CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of 79.19 GiB of which {free} is "
    "free. Including non-PyTorch memory, this process has 41.07 GiB memory in use. Of the allocated memory "
    "{allocated} is allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_cuda_out_of_memory_figures_are_read_from_the_message() -> None:
    message = CUDA_MESSAGE.format(tried="20.00 MiB", free="0 bytes", allocated="40.50 GiB", unallocated="512.00 KiB")
    figures = out_of_memory_figures(torch.OutOfMemoryError(message))
    assert figures == OutOfMemoryFigures(20 * MiB, int(79.19 * GiB), 0, int(40.5 * GiB), 512 * KiB)
    assert figures.needed_bytes == int(40.5 * GiB) + 20 * MiB
    assert figures.room_bytes == int(40.5 * GiB) + 512 * KiB
    assert out_of_memory_figures(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None


def test_the_first_chunk_fits_the_room_the_error_reports() -> None:
    # Planned for a whole card, but something else took half of it: the error's figures say how much room
    # there really was, and the first chunk is chosen for that room, not just 2 x margin below the plan.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256))
    curve = memfit.trace(net, torch.zeros(16, 256), loss_fn=lambda out, batch: out.float().pow(2).mean())
    planned = curve.at(16384)
    room = planned.reserved_bytes // 2

    def failing_at(limit: int, message: str) -> tuple[OOMRecovery, list[int]]:
        recovery = OOMRecovery(reset_gradients=lambda: None, traced=curve, margin=0.05)
        sizes: list[int] = []

        def run(chunk: torch.Tensor, weight: float, last: bool) -> None:
            sizes.append(chunk.shape[0])
            if chunk.shape[0] > limit:
                raise torch.OutOfMemoryError(message)

        recovery.run_batch(torch.zeros(16384, 256), run, step=0)
        return recovery, sizes

    figures = CUDA_MESSAGE.format(tried="64.00 MiB", free=f"{room // 2 / MiB:.2f} MiB",
                                  allocated=f"{room // 2 / MiB:.2f} MiB", unallocated="0 bytes")  # fmt: skip
    reported = out_of_memory_figures(torch.OutOfMemoryError(figures)).room_bytes  # about `room`, as printed
    expected = max(b for b in range(1, 16384) if curve.at(b).reserved_bytes <= 0.95 * reported)
    informed, _ = failing_at(expected, figures)
    assert informed.recoveries[0].chunk_after == expected and len(informed.recoveries) == 1
    blind, sizes = failing_at(expected, "CUDA out of memory. Tried to allocate 64.00 MiB")
    assert blind.recoveries[0].chunk_after > expected  # the estimate alone steps down 2 x margin, and fails again
    assert len(blind.recoveries) > 1 and max(sizes[1:]) > expected


# ----------------------------------------------------------------------------------------- Lightning


def fit(tmp_path: Path, module: Regression, callback: MemoryPlanner | None) -> L.Trainer:
    trainer = make_trainer(tmp_path, callback)
    trainer.fit(module)
    return trainer


def make_trainer(tmp_path: Path, callback: MemoryPlanner | None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[callback] if callback else [],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


@pytest.fixture(scope="module")
def undisturbed_lightning(tmp_path_factory: pytest.TempPathFactory) -> tuple[Regression, L.Trainer]:
    module = Regression()
    return module, fit(tmp_path_factory.mktemp("undisturbed"), module, None)


@pytest.mark.parametrize(("where", "from_batch", "replayed"), [("forward", 2, 0), ("backward", 3, 1)])
def test_lightning_run_survives_oom_with_the_same_steps_samples_and_weights(
    tmp_path: Path, undisturbed_lightning: tuple, where: str, from_batch: int, replayed: int
) -> None:
    reference, reference_trainer = undisturbed_lightning
    module = Regression(limit=4, where=where, from_batch=from_batch)
    callback = MemoryPlanner(mode="observe")
    with pytest.warns(UserWarning, match="effective batch stays 24") as caught:
        trainer = fit(tmp_path, module, callback)
    message = next(str(w.message) for w in caught if "effective batch" in str(w.message))
    assert f"out of memory at step {from_batch // 2}" in message
    assert trainer.global_step == reference_trainer.global_step == 4
    assert trainer.accumulate_grad_batches == 2 and module.batch_size == 12  # the loader is untouched
    assert torch.allclose(flat_parameters(module), flat_parameters(reference), atol=1e-6)
    assert callback.recovery.chunk_size <= 4
    assert callback.recovery.recoveries[0].replayed_batches == replayed
    if where == "forward":
        assert sorted(module.seen) == list(range(96))  # every sample once
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("memfit/oom_recoveries")]
    assert rows and float(rows[-1]["memfit/micro_batch_size"]) == callback.recovery.chunk_size


def test_lightning_on_oom_raise_lets_the_error_end_the_run(tmp_path: Path) -> None:
    with pytest.raises(torch.OutOfMemoryError, match="injected in forward"):
        fit(tmp_path, Regression(limit=4), MemoryPlanner(mode="observe", on_oom="raise"))


def test_lightning_unrecoverable_oom_says_so(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, MemoryPlanner(mode="observe", allow_checkpointing=False))
    with pytest.raises(UnrecoverableOutOfMemoryError, match="checkpointing is not available"):
        trainer.fit(Regression(limit=0))
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)  # the loop's own again


class FailingStepRegression(Regression):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return FailingSGD(self.parameters(), lr=0.05, fail_at=2)


@pytest.mark.usefixtures("lenient")  # the injected error also fails memfit's trace of the step: it only observes
def test_lightning_optimizer_step_oom_says_why_it_cannot_be_recovered(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, MemoryPlanner(mode="observe"))
    with (
        pytest.warns(UserWarning, match="out of memory in the optimizer step"),
        pytest.raises(torch.OutOfMemoryError, match="injected in the optimizer step"),
    ):
        trainer.fit(FailingStepRegression())


# ------------------------------------------------------------------------------------ Hugging Face


def hf_train(tmp_path: Path, model: DictRegression, callbacks: list) -> object:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=12,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    from memfit.huggingface import MemoryPlannerCallback, attach

    trainer = Trainer(model=model, args=args, train_dataset=DictData(), callbacks=callbacks)
    if any(isinstance(callback, MemoryPlannerCallback) for callback in callbacks):
        attach(trainer)  # the callback the Trainer was given goes first and may wrap the step
    trainer.train()
    return trainer


class LogRecorder(TrainerCallback):
    """Stands in for a report_to tracker: keeps what each ``on_log`` hands it."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **kwargs: object) -> None:
        self.logs.append(dict(logs or {}))


def test_hf_trainer_survives_oom_with_the_same_steps_samples_and_weights(tmp_path: Path) -> None:
    from memfit.huggingface import MemoryPlannerCallback

    reference = DictRegression()
    reference_trainer = hf_train(tmp_path / "undisturbed", reference, [])
    model = DictRegression(limit=4)
    ceiling(model.net).armed = True
    callback, tracker = MemoryPlannerCallback(), LogRecorder()
    with pytest.warns(UserWarning, match="effective batch stays 24"):
        trainer = hf_train(tmp_path / "recovered", model, [tracker, callback])
    assert trainer.state.global_step == reference_trainer.state.global_step == 4
    assert trainer.args.per_device_train_batch_size == 12
    assert torch.allclose(flat_parameters(model), flat_parameters(reference), atol=1e-6)
    assert sorted(model.seen) == sorted(reference.seen) == list(range(96))
    assert callback.recovery.chunk_size <= 4
    logged = [logs for logs in tracker.logs if "memfit/oom_recoveries" in logs]  # what report_to trackers get
    assert logged and logged[0]["memfit/micro_batch_size"] == callback.recovery.chunk_size  # all at step 0
    assert logged[0]["memfit/oom_recoveries"] == len(callback.recovery.recoveries)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    reference_losses = [e["loss"] for e in reference_trainer.state.log_history if "loss" in e]
    assert losses == pytest.approx(reference_losses, rel=1e-5)  # chunk losses add up to the batch's
    assert "training_step" not in vars(trainer)  # the Trainer's own method is back after training


def test_hf_trainer_replays_the_window_after_an_oom_mid_backward(tmp_path: Path) -> None:
    from memfit.huggingface import MemoryPlannerCallback

    reference = DictRegression()
    hf_train(tmp_path / "undisturbed", reference, [])
    model = DictRegression(limit=4, where="backward")

    class ArmAfterFirstMicroBatch(TrainerCallback):
        def on_substep_end(self, *args: object, **kwargs: object) -> None:
            ceiling(model.net).armed = True

    callback = MemoryPlannerCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_train(tmp_path / "recovered", model, [callback, ArmAfterFirstMicroBatch()])
    assert callback.recovery.recoveries[0].replayed_batches == 1
    assert torch.allclose(flat_parameters(model), flat_parameters(reference), atol=1e-6)


def test_hf_on_oom_raise_lets_the_error_end_the_run(tmp_path: Path) -> None:
    from memfit.huggingface import MemoryPlannerCallback

    model = DictRegression(limit=4)
    ceiling(model.net).armed = True
    with pytest.raises(torch.OutOfMemoryError, match="injected in forward"):
        hf_train(tmp_path, model, [MemoryPlannerCallback(on_oom="raise")])


@pytest.mark.usefixtures("lenient")  # the injected error also fails memfit's trace of the step
def test_hf_optimizer_step_oom_says_why_it_cannot_be_recovered_and_a_second_run_is_not_wrapped_twice(
    tmp_path: Path,
) -> None:
    from transformers import Trainer, TrainingArguments

    from memfit.huggingface import MemoryPlannerCallback, attach

    model = DictRegression()
    optimizer = FailingSGD(model.parameters(), lr=0.05)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=12, max_steps=3, report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True, max_grad_norm=0.0)  # fmt: skip
    callback = MemoryPlannerCallback()
    trainer = Trainer(model=model, args=args, train_dataset=DictData(),
                      optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)))  # fmt: skip
    attach(trainer, callback)
    with (
        pytest.warns(UserWarning, match="out of memory in the optimizer step"),
        pytest.raises(torch.OutOfMemoryError, match="injected in the optimizer step"),
    ):
        trainer.train()
    assert "training_step" in vars(trainer)  # the failed run never reached on_train_end

    class WrappedOnce(TrainerCallback):
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            wrapped = inspect.getclosurevars(vars(trainer)["training_step"]).nonlocals["original_step"]
            assert wrapped.__func__ is Trainer.training_step  # not the failed run's wrapper

    trainer.add_callback(WrappedOnce())
    optimizer.fail_at = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == 3
    assert "training_step" not in vars(trainer) and "compute_loss" not in vars(trainer)


def test_the_recovery_warning_names_the_chunks_each_micro_batch_runs_in() -> None:
    """A batch of 32 in chunks of at most 7 runs 7, 7, 7, 7 and 4 samples: the new plan is said that way, not as a
    micro batch times an accumulation whose product is not the effective batch."""
    record = Recovery(step=3, batch_size=32, chunk_before=32, chunk_after=7, checkpointing_enabled=False,
                      replayed_batches=0, error="OutOfMemoryError")  # fmt: skip
    warning = record.warning(accumulation=2, world_size=1, rank=0)
    assert "micro batch 32 x accumulation 2 -> each micro batch of 32 in chunks of 7, 7, 7, 7, 4 samples" in warning
    assert warning.endswith("x accumulation 2; the effective batch stays 64.")
