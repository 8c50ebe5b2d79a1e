"""Both callbacks plan a peft LoRA over a bitsandbytes 4-bit Llama, and the plan takes effect in a real run.

A real ``lightning.Trainer.fit`` with a LightningModule holding the peft model, and a real
``transformers.Trainer.train`` with the peft model loaded with a ``BitsAndBytesConfig``, on the CPU
(bitsandbytes has CPU kernels). The budget is chosen between the predicted peaks of two micro
batches, so the plan must shrink the micro batch and accumulate; the estimate must count the packed
weights and their quantization state as parameters and give gradients and optimizer state to the
adapters only. Under ``bf16-mixed`` (``bf16=True``) the frozen weights stay fp32 (autocast casts in
the forward), and the trace must keep the dtypes the run really has (DESIGN.md §5).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

import lightning as L
from peft import LoraConfig, get_peft_model
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import memfit
from harness.accuracy.reference import profiled_cpu_peak
from memfit import Category, Phase
from memfit.huggingface import attach, plan_training_arguments
from memfit.lightning import MemoryPlanner
from quantized_models import (
    TARGETS,
    adapter_bytes,
    llama_config,
    quantized_llama,
    quiet_bitsandbytes,
    save_random_llama,
    weight_bytes,
)

VOCAB, SEQ, CONFIGURED, MICRO, MARGIN = 256, 64, 8, 2, 0.05
# bytes: a quarter of the smallest bf16 weight copy (v_proj, 256 x 128 x 2 B = 64 KiB), so one cast of any weight
# traced in the wrong dtype, or missing, cannot pass; the autocast step at micro batch 8 is traced 8 KiB over.
CAST_TOLERANCE = 16 * 1024


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with quiet_bitsandbytes():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama"), llama_config(vocab=VOCAB))


def token_ids(n: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))


def budget_for(traced: memfit.StepCurve, micro: int) -> int:
    """A budget whose usable part lies between the predicted peaks of ``micro`` and ``micro + 1``."""
    low, high = traced.at(micro).device_bytes, traced.at(micro + 1).device_bytes
    assert low < high
    return math.ceil((low + high) / 2 / (1 - MARGIN))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_trained_adapters_only(before: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Every LoRA B (zero at start) moved, and no unquantized frozen weight (embeddings, norms, head) did.

    The packed 4-bit weights are not compared: bitsandbytes repacks some of them in place for its
    AVX512-bf16 CPU kernel when a layer runs in eval mode, which a Lightning run does with or without memfit.
    """
    after = dict(model.named_parameters())
    moved = {name for name, value in before.items() if not torch.equal(value, after[name].detach())}
    assert {name for name in before if "lora_B" in name} <= moved
    plain_frozen = {name for name, p in after.items() if not p.requires_grad and "quant_state" not in p.__dict__}
    assert plain_frozen and not plain_frozen & moved


def assert_adapters_alone_train(estimate: memfit.MemoryEstimate, model: torch.nn.Module, stored: int) -> None:
    """Parameters are the bytes stored before training (``stored``: packed weights, absmax, code books,
    fp32/bf16 rest, adapters); gradients and AdamW's two moments are the adapters' only."""
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    adapters = adapter_bytes(model)
    assert estimate.phases[0].breakdown[Category.PARAMETERS] == stored
    assert estimate.gradient_bytes == adapters
    state = [phase for phase in estimate.phases if phase.phase is Phase.OPTIMIZER][-1].breakdown
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert 2 * adapters <= state[Category.OPTIMIZER_STATE] <= 2 * adapters + 64 * trainable  # + step counters


# ------------------------------------------------------------------------------------------- Lightning
class QLoRAModule(L.LightningModule):
    """A LightningModule holding a peft model; its batch size lives on the module, as BatchSizeFinder expects."""

    def __init__(self, model: torch.nn.Module, batch_size: int = CONFIGURED) -> None:
        super().__init__()
        self.model = model
        self.batch_size = batch_size
        self.seen_batch_sizes: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        if not is_fake(ids):  # memfit's trace calls training_step on fake tensors at setup
            self.seen_batch_sizes.append(ids.shape[0])
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(token_ids()), batch_size=self.batch_size)


@pytest.mark.parametrize(("quantization", "kbit", "precision"), [("nf4", False, "32-true"),
                                                                  ("nf4-double", True, "bf16-mixed")])  # fmt: skip
def test_lightning_plans_and_trains_a_quantized_lora(checkpoint: Path, quantization: str, kbit: bool,
                                                     precision: str, tmp_path: Path) -> None:  # fmt: skip
    module = QLoRAModule(quantized_llama(checkpoint, quantization, kbit=kbit))
    ids = token_ids(CONFIGURED)
    by_hand = memfit.trace(module, (ids,), precision=precision, target=memfit.Target("cpu"),
                           forward_fn=lambda m, b: m.model(input_ids=b[0], labels=b[0]),
                           loop=memfit.TrainingLoop(zero_grad="before_backward", accumulation_steps=4))  # fmt: skip
    callback = MemoryPlanner(budget=budget_for(by_hand, MICRO), margin=MARGIN)
    before, stored = snapshot(module.model), weight_bytes(module.model)
    fit = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[callback], logger=False, precision=precision,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    default_root_dir=tmp_path)  # fmt: skip
    fit.fit(module)

    plan = callback.plan
    assert plan is not None and (plan.micro_batch_size, plan.accumulate_grad_batches) == (MICRO, CONFIGURED // MICRO)
    assert module.batch_size == MICRO and fit.accumulate_grad_batches == CONFIGURED // MICRO
    assert module.seen_batch_sizes == [MICRO] * (2 * CONFIGURED // MICRO)  # 2 steps x 4 micro batches
    assert callback.estimate.precision is memfit.Precision.parse(precision)
    assert_adapters_alone_train(callback.estimate, module.model, stored)
    assert_trained_adapters_only(before, module.model)


# ------------------------------------------------------------------------------------------- Hugging Face
class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = token_ids()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def hf_args(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    return TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=CONFIGURED, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2,
                             **kwargs)  # fmt: skip


class BatchSizes:
    """The batch size of every real forward (memfit's trace runs on fake tensors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[int] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and not is_fake(ids):
            self.seen.append(ids.shape[0])


@pytest.mark.parametrize(("quantization", "kbit", "bf16"), [("nf4", False, False), ("nf4-double", True, True)])
def test_hf_trainer_plans_and_trains_a_quantized_lora(checkpoint: Path, quantization: str, kbit: bool, bf16: bool,
                                                      tmp_path: Path) -> None:  # fmt: skip
    model, data = quantized_llama(checkpoint, quantization, kbit=kbit), Tokens()
    args = hf_args(tmp_path, bf16=bf16)
    accumulating = hf_args(tmp_path, bf16=bf16, gradient_accumulation_steps=4)
    roomy = plan_training_arguments(model, accumulating, data, budget="1GiB", max_batch_size=CONFIGURED)
    planned = plan_training_arguments(model, args, data, budget=budget_for(roomy.traced, MICRO), margin=MARGIN)
    assert (planned.plan.micro_batch_size, planned.plan.accumulate_grad_batches) == (MICRO, CONFIGURED // MICRO)
    assert planned.estimate.precision is (memfit.Precision.BF16_MIXED if bf16 else memfit.Precision.FP32)
    assert_adapters_alone_train(planned.estimate, model, weight_bytes(model))

    before, sizes = snapshot(model), BatchSizes(model)
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    callback = attach(trainer, plan=planned.plan, verbose=False)
    trainer.train()
    assert trainer.state.train_batch_size == MICRO and trainer.state.global_step == 2
    assert sizes.seen == [MICRO] * (2 * CONFIGURED // MICRO)
    assert callback.estimate is not None
    assert callback.estimate.peak_allocated_bytes == planned.estimate.peak_allocated_bytes
    assert_trained_adapters_only(before, model)


# ---------------------------------------------------------------------------- deliberate mixed dtypes
def test_bf16_mixed_traces_fp32_frozen_weights_as_the_run_keeps_them(checkpoint: Path, tmp_path: Path) -> None:
    """``bf16=True`` leaves a peft model's fp32 frozen weights fp32 (the Trainer casts nothing; autocast
    casts in the forward): the estimate counts them in fp32, and its step peaks where a real
    autocast step on the CPU does."""
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(checkpoint), LoraConfig(r=8, target_modules=TARGETS))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    planned = plan_training_arguments(model, hf_args(tmp_path, bf16=True), Tokens(), budget="1GiB")
    estimate = planned.estimate
    assert estimate.precision is memfit.Precision.BF16_MIXED
    assert_adapters_alone_train(estimate, model, weight_bytes(model))

    batch = {"input_ids": token_ids(CONFIGURED), "labels": token_ids(CONFIGURED)}
    traced = memfit.estimate(model, batch, precision="bf16-mixed", target=memfit.Target("cpu"))
    at_peak = next(p for p in traced.phases if p.allocated_bytes == traced.peak_allocated_bytes)
    static = at_peak.breakdown[Category.PARAMETERS] + at_peak.breakdown[Category.BUFFERS]
    model.train()
    adapters = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        optimizer = torch.optim.AdamW(adapters)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()

    assert abs(traced.peak_allocated_bytes - static - profiled_cpu_peak(run)) <= CAST_TOLERANCE
