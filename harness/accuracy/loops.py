"""The training loop around the step, predicted vs measured on CPU: zero_grad order, accumulation, DDP.

When a loop frees gradients decides what the next forward carries: the Hugging Face Trainer frees
them after ``optimizer.step()``, Lightning's closure between ``training_step`` and ``backward``;
gradient accumulation keeps them through every micro batch; DDP adds its gradient buckets. For
each loop this runs three real optimizer steps of one MLP on CPU and measures the peak from the
CPU allocator's own reports (``reference.profiled_cpu_peak``), next to memfit's prediction for
that loop and the prediction of a trace that ignores the loop. Lightning and the HF Trainer run
for real, with memfit's callbacks observing (with ``on_oom="replan"`` memfit's own closure zeroes
gradients before the forward and keeps a window's earlier batches to replay them; on CPU the
Trainer's look-ahead batch counts too, as the device is the host). Evaluation passes run inside
``Trainer.train`` with ``compute_metrics``, and ``Trainer.predict`` runs on a small GPT-2 (fresh,
after training, with ``bf16_full_eval``); their loop-blind column is the training step alone, or
for ``predict`` the pass without the outputs it keeps. Two more run a small GPT-2 over examples of
varying length (HF Trainer.train, Lightning Trainer.fit), padded to the longest in each batch; their
loop-blind column is the first batch's trace.

    python -m harness.accuracy.loops        # CPU, ~45 s: benchmarks/results/training_loop-cpu.json
    python -m harness.accuracy.loops --gpu  # the same loops on the visible CUDA GPU, measured with
                                                 # torch.cuda.max_memory_allocated/reserved: training_loop-gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit
from harness.accuracy.reference import profiled_cpu_peak
from memfit.prediction.evaluation import EvaluationPeak
from memfit.tracing.ddp import DDPConfig

WIDTH, BATCH, DEPTH = 1024, 512, 6  # 24 MiB of weights, activations of the same order
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)])


def square_loss(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


def predicted(device: str = "cpu", *, inference: bool = False, **loop: Any) -> memfit.MemoryEstimate:
    """memfit's estimate of the MLP's step with plain SGD (or its forward pass), in the loop ``loop`` describes
    (``TrainingLoop`` fields)."""
    return memfit.estimate(
        mlp(), torch.randn(BATCH, WIDTH), optimizer="sgd", loss_fn=square_loss, loop=memfit.TrainingLoop(**loop),
        target=memfit.Target(device), inference=inference,
    )  # fmt: skip


def hand_loop(
    zero_grad: str,
    accumulation: int,
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module,
    device: str = "cpu",
) -> Callable[[], None]:
    """Three optimizer steps of a hand-written loop with ``zero_grad`` where the argument says (``"in_place"``:
    after the step, ``set_to_none=False``, as torch < 2.0 did by default)."""

    def run() -> None:
        torch.manual_seed(0)
        model = wrap(mlp().to(device))
        batch = torch.randn(BATCH, WIDTH, device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            for micro in range(accumulation):
                loss = model(batch).square().mean()
                if zero_grad == "before_backward" and micro == 0:
                    optimizer.zero_grad()
                loss.backward()
                del loss
            optimizer.step()
            if zero_grad in ("after_step", "in_place"):
                optimizer.zero_grad(set_to_none=zero_grad == "after_step")

    return run


def lightning_fit(
    root: Path,
    on_oom: str,
    accumulation: int,
    device: str = "cpu",
    *,
    validation_batch: int | None = None,
    budget: str | None = None,
) -> tuple[Callable[[], None], Any]:
    """A real ``lightning.Trainer.fit`` of the MLP with ``MemoryPlanner`` observing; returns it and the callback.

    With ``validation_batch``, one validation batch of that size runs after the second step, with
    SGD's momentum as the optimizer state it runs beside.
    """
    import lightning as L

    from memfit.lightning import MemoryPlanner

    class MLPModule(L.LightningModule):
        def __init__(self, data: torch.Tensor) -> None:
            super().__init__()
            self.net, self.data, self.batch_size = mlp(), data, BATCH

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9 if validation_batch else 0.0)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.data), batch_size=self.batch_size)

    class WithValidation(MLPModule):
        def validation_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            loss = self.net(batch[0]).square().mean()
            self.log("val_loss", loss)
            return loss

        def val_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(held_out), batch_size=validation_batch)

    callback = MemoryPlanner(mode="observe", on_oom=on_oom, budget=budget, verbose=False)
    data = torch.randn(BATCH * 8, WIDTH)  # the datasets are not part of the step
    held_out = torch.randn(validation_batch or 1, WIDTH)
    validation = {"val_check_interval": 2, "num_sanity_val_steps": 0} if validation_batch else {}

    def fit() -> None:
        torch.manual_seed(0)
        trainer = L.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=3,
            accumulate_grad_batches=accumulation, callbacks=[callback],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, **validation,
        )  # fmt: skip
        trainer.fit((WithValidation if validation_batch else MLPModule)(data))

    return fit, callback


class _LossOfMLP(nn.Module):
    """The MLP as the Hugging Face Trainer wants a model: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).square().mean()}


def hf_train(
    root: Path, accumulation: int, device: str = "cpu", on_oom: str = "replan"
) -> tuple[Callable[[], None], Any]:
    """A real ``transformers.Trainer.train`` of the MLP with ``MemoryPlannerCallback`` observing."""
    from transformers import Trainer, TrainingArguments

    from memfit.huggingface import MemoryPlannerCallback, attach

    callback = MemoryPlannerCallback(on_oom=on_oom, verbose=False)
    data = [{"x": row} for row in torch.randn(BATCH * 8, WIDTH)]
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation,
        max_steps=3, optim="sgd", learning_rate=0.01, max_grad_norm=0.0, use_cpu=device == "cpu", report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip

    def train() -> None:
        torch.manual_seed(0)
        trainer = Trainer(model=_LossOfMLP(), args=args, train_dataset=data)
        attach(trainer, callback)
        trainer.train()

    return train, callback


class _Classifier(nn.Module):
    """The MLP as a classifier over ``WIDTH`` classes: logits as wide as its activations, a loss with labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _accuracy(prediction: Any) -> dict[str, float]:
    """Accuracy in numpy, on the host, as metrics are: nothing here allocates on the device."""
    import numpy as np

    predictions, labels = prediction.predictions, prediction.label_ids
    if isinstance(predictions, list):  # eval_do_concat_batches=False
        predictions, labels = np.concatenate(predictions), np.concatenate(labels)
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}


EVAL_BATCH = BATCH // 2


def hf_train_with_evaluation(
    root: Path,
    eval_batches: int,
    device: str = "cpu",
    *,
    concatenated: bool = True,
    eval_accumulation_steps: int | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
) -> tuple[Callable[[], None], Any]:
    """A real ``Trainer.train`` (AdamW, 3 steps) evaluating after step 2 with ``compute_metrics``: every
    evaluation batch's logits and labels are collected on the device until the pass ends."""
    from transformers import Trainer, TrainingArguments

    from memfit.huggingface import MemoryPlannerCallback, attach

    callback = MemoryPlannerCallback(verbose=False)
    generator = torch.Generator().manual_seed(0)
    train = [{"x": row, "labels": torch.tensor(i % WIDTH)}
             for i, row in enumerate(torch.randn(BATCH * 4, WIDTH, generator=generator))]  # fmt: skip
    rows = torch.randn(EVAL_BATCH * eval_batches, WIDTH, generator=generator)
    evaluation = [{"x": row, "labels": torch.tensor(i % WIDTH)} for i, row in enumerate(rows)]
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=BATCH, per_device_eval_batch_size=EVAL_BATCH, max_steps=3,
        optim="adamw_torch", learning_rate=0.01, max_grad_norm=0.0, use_cpu=device == "cpu", report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True, eval_strategy="steps",
        eval_steps=2, eval_do_concat_batches=concatenated, eval_accumulation_steps=eval_accumulation_steps,
    )  # fmt: skip

    def train_and_evaluate() -> None:
        torch.manual_seed(0)
        trainer = Trainer(
            model=_Classifier(), args=args, train_dataset=train, eval_dataset=evaluation,
            compute_metrics=_accuracy, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        attach(trainer, callback)
        trainer.train()

    return train_and_evaluate, callback


SMALL_GPT2_VOCAB, SMALL_GPT2_POSITIONS = 512, 32


def small_gpt2() -> nn.Module:
    """The GPT-2 of the Trainer.predict and variable-length rows: 2 layers, 64 wide, vocabulary 512."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=SMALL_GPT2_VOCAB, n_positions=SMALL_GPT2_POSITIONS)
    return GPT2LMHeadModel(config)


def hf_predict(
    root: Path, device: str = "cpu", *, after_training: bool, full_eval: str | None = None
) -> tuple[Callable[[], None], dict[str, EvaluationPeak]]:
    """A real ``Trainer.predict`` of a small GPT-2 over 32 batches of 16, on a Trainer that has just
    trained 2 AdamW steps with ``MemoryPlannerCallback`` or on a fresh one. ``predict`` keeps every
    batch's logits (batch x 32 x 512 here) with no ``compute_metrics``; ``full_eval`` ("bf16" or
    "fp16") casts the model first. memfit's prediction (``predict_trainer_pass``) is made inside the
    run, right before ``predict``, into the returned dict."""
    from transformers import Trainer, TrainingArguments

    from memfit.huggingface import MemoryPlannerCallback, predict_trainer_pass

    shape = (64 + 16 * 32, SMALL_GPT2_POSITIONS)
    ids = torch.randint(0, SMALL_GPT2_VOCAB, shape, generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=8, per_device_eval_batch_size=16, max_steps=2,
        optim="adamw_torch", learning_rate=0.01, max_grad_norm=0.0, use_cpu=device == "cpu", report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        bf16_full_eval=full_eval == "bf16", fp16_full_eval=full_eval == "fp16",
    )  # fmt: skip
    predicted: dict[str, EvaluationPeak] = {}

    def predict() -> None:
        trainer = Trainer(model=small_gpt2(), args=args, train_dataset=rows[:64],
                          callbacks=[MemoryPlannerCallback(verbose=False)])  # fmt: skip
        if after_training:
            trainer.train()
        predicted["peak"] = predict_trainer_pass(trainer, rows[64:], loop="predict")
        trainer.predict(rows[64:])

    return predict, predicted


def pad_to_longest(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """What DataCollatorWithPadding and the language-modeling collators do: pad to the batch's longest."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.tensor([row["input_ids"] + [0] * (longest - len(row["input_ids"])) for row in rows])
    labels = torch.tensor([row["input_ids"] + [-100] * (longest - len(row["input_ids"])) for row in rows])
    return {"input_ids": ids, "labels": labels}


def token_rows(lengths: list[int]) -> list[dict[str, list[int]]]:
    """Tokenized examples of the given lengths (random ids, seeded) for the small GPT-2."""
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, SMALL_GPT2_VOCAB, (n,), generator=generator).tolist()} for n in lengths]


def hf_train_variable_lengths(
    root: Path, device: str = "cpu"
) -> tuple[Callable[[], None], Any, Callable[[], memfit.MemoryEstimate]]:
    """A real ``Trainer.train`` (SGD, one epoch of 6 steps of 8) of a small GPT-2 over 40 examples of 8
    tokens and one of 32, padded to the longest in each batch: the peak is the batch with the long one.
    Also returns the estimate of the first batch, which a plan from the first examples would trace."""
    from transformers import Trainer, TrainingArguments

    from memfit.huggingface import MemoryPlannerCallback
    from memfit.integrations.huggingface.arguments import held_batches

    rows = token_rows([8] * 40 + [SMALL_GPT2_POSITIONS])
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=8, max_steps=6, optim="sgd", learning_rate=0.01,
        max_grad_norm=0.0, use_cpu=device == "cpu", report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callback = MemoryPlannerCallback(verbose=False)

    def train() -> None:
        Trainer(model=small_gpt2(), args=args, train_dataset=rows, data_collator=pad_to_longest,
                callbacks=[callback]).train()  # fmt: skip

    def first_batch() -> memfit.MemoryEstimate:
        extra = held_batches(1, torch.device(device))
        first = pad_to_longest(rows[:8])
        return memfit.estimate(small_gpt2(), first, optimizer="sgd", loop=memfit.TrainingLoop(extra_batches=extra),
                               target=memfit.Target(device))  # fmt: skip

    return train, callback, first_batch


def lightning_fit_variable_lengths(
    root: Path, device: str = "cpu"
) -> tuple[Callable[[], None], Any, Callable[[], memfit.MemoryEstimate]]:
    """A real ``lightning.Trainer.fit`` (SGD, 5 steps of 8) of a small GPT-2 over 20 examples of 8
    tokens, one of 32, then 20 more of 8, in order, padded to the longest in each batch by the
    dataloader's ``collate_fn``: the third batch makes the peak. Also returns the estimate of the
    first batch, which a plan from the dataloader's first batch would trace."""
    import lightning as L

    from memfit.lightning import MemoryPlanner

    rows = token_rows([8] * 20 + [SMALL_GPT2_POSITIONS] + [8] * 20)

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.batch_size = small_gpt2(), 8

        def training_step(self, batch: dict[str, torch.Tensor], _index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size, collate_fn=pad_to_longest)

    callback = MemoryPlanner(mode="observe", verbose=False)

    def fit() -> None:
        trainer = L.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=5, callbacks=[callback],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root,
        )  # fmt: skip
        trainer.fit(LanguageModel())

    def first_batch() -> memfit.MemoryEstimate:
        return memfit.estimate(small_gpt2(), pad_to_longest(rows[:8]), target=memfit.Target(device), optimizer="sgd")

    return fit, callback, first_batch


def wrap_in_ddp(options: dict[str, Any]) -> Callable[[nn.Module], nn.Module]:
    # No broadcast of the weights at wrapping: with one process it only copies them, and gloo may
    # keep that copy until a garbage collection, inside the measured steps.
    return lambda module: nn.parallel.DistributedDataParallel(module, init_sync=False, **options)


Prediction = memfit.MemoryEstimate | EvaluationPeak


def _peaks(prediction: Prediction) -> tuple[int, int]:
    """Allocated and reserved peak of a step's estimate or of an evaluation pass beside training."""
    if isinstance(prediction, EvaluationPeak):
        return prediction.allocated_bytes, prediction.reserved_bytes
    return prediction.peak_allocated_bytes, prediction.peak_reserved_bytes


def cuda_peaks(run: Callable[[], None]) -> tuple[int, int]:
    """``max_memory_allocated`` and ``max_memory_reserved`` over ``run()``, from an empty allocator
    (cuBLAS workspaces of earlier runs freed, so each run allocates its own as a fresh process would)."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - allocated, torch.cuda.max_memory_reserved() - reserved


def measure_all(root: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """Every loop: measured peak, memfit's prediction for it, and a loop-blind trace's (for an evaluation
    pass, the training step alone)."""
    loop_blind = predicted(device).peak_allocated_bytes
    rows: list[dict[str, Any]] = []

    def add(
        name: str, run: Callable[[], None], estimate: Callable[[], Prediction],
        unaware: Callable[[], int] = lambda: loop_blind,
    ) -> None:  # fmt: skip
        measured, reserved = cuda_peaks(run) if device == "cuda" else (profiled_cpu_peak(run), None)
        predicted_allocated, predicted_reserved = _peaks(estimate())
        blind = unaware()
        row = {
            "loop": name,
            "measured_peak_bytes": measured,
            "predicted_peak_bytes": predicted_allocated,
            "error_pct": round(100 * (predicted_allocated - measured) / measured, 3),
            "loop_blind_peak_bytes": blind,
            "loop_blind_error_pct": round(100 * (blind - measured) / measured, 3),
        }
        if reserved is not None:
            row |= {"measured_peak_reserved_bytes": reserved, "predicted_peak_reserved_bytes": predicted_reserved,
                    "reserved_error_pct": round(100 * (predicted_reserved - reserved) / reserved, 3)}  # fmt: skip
        rows.append(row)

    for zero_grad, accumulation in [("after_step", 1), ("before_backward", 1), ("after_step", 3),
                                    ("before_backward", 3)]:  # fmt: skip
        add(f"hand loop, zero_grad {zero_grad}, accumulation {accumulation}",
            hand_loop(zero_grad, accumulation, device=device),
            lambda z=zero_grad, a=accumulation: predicted(device, zero_grad=z, accumulation_steps=a))  # fmt: skip
    if torch.distributed.is_available():
        store = Path(tempfile.mkdtemp()) / "store"
        backend = "nccl" if device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        try:
            for label, options in [("default", {}), ("gradient_as_bucket_view", {"gradient_as_bucket_view": True}),
                                   ("find_unused_parameters, 4 MiB buckets",
                                    {"find_unused_parameters": True, "bucket_cap_mb": 4})]:  # fmt: skip
                add(f"DDP ({label}), hand loop", hand_loop("after_step", 1, wrap_in_ddp(options), device),
                    lambda o=options: predicted(device, ddp=DDPConfig.from_kwargs(o)))  # fmt: skip
        finally:
            torch.distributed.destroy_process_group()
    for on_oom, accumulation in [("raise", 1), ("raise", 2), ("replan", 1), ("replan", 2)]:
        run, callback = lightning_fit(root / f"lightning-{on_oom}-{accumulation}", on_oom, accumulation, device)
        add(f"Lightning Trainer.fit, on_oom={on_oom}, accumulation {accumulation}", run, lambda c=callback: c.estimate)
    run, callback = lightning_fit(root / "lightning-validation", "replan", 1, device, validation_batch=8 * BATCH)
    add(f"Lightning Trainer.fit, validation batch {8 * BATCH} after step 2 (SGD momentum)", run,
        lambda c=callback: max(c.estimate, c.validation, key=lambda e: _peaks(e)[0]))  # fmt: skip
    for on_oom, accumulation in [("replan", 1), ("replan", 2), ("raise", 2)]:
        run, callback = hf_train(root / f"hf-{on_oom}-{accumulation}", accumulation, device, on_oom)
        add(f"HF Trainer.train, on_oom={on_oom}, accumulation {accumulation}", run, lambda c=callback: c.estimate)
    evaluations = [("concatenated", 32, {}), ("kept as a list", 64, {"concatenated": False})]
    if device == "cuda":  # on the CPU the collection moves nowhere
        evaluations.append(("moved to the CPU every 8 batches", 32, {"eval_accumulation_steps": 8}))
    for label, batches, options in evaluations:
        run, callback = hf_train_with_evaluation(root / f"hf-eval-{batches}-{len(options)}", batches, device, **options)
        # what memfit predicted before it knew the evaluation pass: the training step alone
        add(f"HF train (AdamW) + eval of {batches} x {EVAL_BATCH}, logits {label}", run,
            lambda c=callback: max(c.estimate, c.evaluation, key=lambda e: _peaks(e)[0]),
            lambda c=callback: c.estimate.peak_allocated_bytes)  # fmt: skip
    run, callback, first_batch = hf_train_variable_lengths(root / "hf-lengths", device)
    add("HF Trainer.train, GPT-2, 40 x 8 tokens + 1 x 32, padded to the longest in each batch", run,
        lambda c=callback: c.estimate, lambda f=first_batch: f().peak_allocated_bytes)  # fmt: skip
    run, callback, first_batch = lightning_fit_variable_lengths(root / "lightning-lengths", device)
    add("Lightning Trainer.fit, GPT-2, 20 x 8 tokens, 1 x 32, 20 x 8, padded by collate_fn", run,
        lambda c=callback: c.estimate, lambda f=first_batch: f().peak_allocated_bytes)  # fmt: skip
    for label, after_training, full_eval in [("fresh Trainer", False, None), ("after 2 AdamW steps", True, None),
                                             ("after 2 AdamW steps, bf16_full_eval", True, "bf16")]:  # fmt: skip
        run, predicted_pass = hf_predict(root / f"hf-predict-{len(rows)}", device, after_training=after_training,
                                         full_eval=full_eval)  # fmt: skip
        # the pass without the logits it keeps: what a forward-only trace would say
        add(f"HF Trainer.predict, GPT-2 32 x 16, {label}", run, lambda p=predicted_pass: p["peak"],
            lambda p=predicted_pass: p["peak"].allocated_bytes - p["peak"].collected_bytes)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from memfit.units import format_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run on the visible CUDA GPU")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device; without one, run on CPU (no flag)")
    device = "cuda" if args.gpu else "cpu"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        rows = measure_all(Path(root), device)
    where = torch.cuda.get_device_name() if args.gpu else "CPU"
    table = Table(title=f"Training loops on {where}: {DEPTH} x Linear({WIDTH}) + GELU, batch {BATCH}, SGD, 3 steps")
    for column in ("loop", "measured peak", "memfit", "error", "loop-blind trace", "its error"):
        table.add_column(column, justify="left" if column == "loop" else "right")
    for row in rows:
        table.add_row(row["loop"], format_bytes(row["measured_peak_bytes"]), format_bytes(row["predicted_peak_bytes"]),
                      f"{row['error_pct']:+.3f} %", format_bytes(row["loop_blind_peak_bytes"]),
                      f"{row['loop_blind_error_pct']:+.2f} %")  # fmt: skip
    Console(width=150).print(table)
    measured_with = (
        "torch.cuda.max_memory_allocated/reserved from an emptied allocator" if args.gpu
        else "torch.profiler CPU allocator reports (harness.accuracy.reference.profiled_cpu_peak)"
    )  # fmt: skip
    path = RESULTS / f"training_loop-{'gpu' if args.gpu else 'cpu'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": where, "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "measured_with": measured_with,
        "seconds": round(time.perf_counter() - started, 1), "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
