"""A deep model's log built from traces a few blocks deep (memfit.tracing.depth) is the log a trace of it records."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memfit.cli.main import main
from memfit.prediction.estimator import _prepare, _Step
from memfit.prediction.sharded import shard_trace
from memfit.simulation.replay import replay
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.depth import DepthMismatch, deepen, deepen_symbolic, log_difference
from memfit.tracing.recorder import fold_sums_in_place
from memfit.tracing.shard_log import RankPlan
from memfit.tracing.symbolic import trace_symbolic
from memfit.tracing.tracer import StepTrace, TraceSettings, trace_steps

transformers = pytest.importorskip("transformers")

IDS = torch.zeros(2, 24, dtype=torch.long)


def gpt2(blocks: int) -> nn.Module:
    config = transformers.GPT2Config(n_layer=blocks, n_embd=32, n_head=4, vocab_size=300, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def llama(blocks: int) -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert(blocks: int) -> nn.Module:
    config = transformers.BertConfig(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                                     num_attention_heads=4, vocab_size=300, num_labels=3)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Identical residual blocks between an input and an output projection (no transformers)."""

    def __init__(self, blocks: int, width: int = 48) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, width), nn.Linear(width, 4)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def sample_of(build: Callable[[int], nn.Module]) -> Any:
    if build is Stack:
        return torch.zeros(2, 16)
    if build is bert:
        return {"input_ids": IDS, "labels": torch.zeros(2, dtype=torch.long)}
    return {"input_ids": IDS, "labels": IDS}


def settings_for(model: nn.Module, sample: Any, record: bool = True, **step: Any) -> tuple[TraceSettings, int]:
    """The step's trace settings; ``record``: log the block of each event, as the shallow traces a deep log is built
    from do (the whole model's trace, the one a built log must equal, records none)."""
    loop = step.pop("loop", TrainingLoop())
    device = step.pop("device", "cuda")
    options = {"optimizer": "adamw", "optimizer_kwargs": None, "precision": "fp32", "gradient_checkpointing": False,
               "checkpoint_modules": None, "loss_fn": None, "forward_fn": None, "inference": False, **step}  # fmt: skip
    if isinstance(sample, torch.Tensor):
        options["loss_fn"] = lambda output, batch: output.square().mean()
    settings, (_, _, sample_batch) = _prepare(model, sample, None, _Step(**options), loop, Target(device))
    return dataclasses.replace(settings, record_blocks=record), sample_batch


def traced(
    build: Callable[[int], nn.Module], blocks: int, batch: int = 3, record: bool = True, **step: Any
) -> StepTrace:
    torch.manual_seed(0)
    model, sample = build(blocks), sample_of(build)
    settings, sample_batch = settings_for(model, sample, record, **step)
    return trace_steps(model, sample, sample_batch, batch, settings)


def peaks(trace: StepTrace) -> list[tuple[int, int]]:
    return [(p.allocated_bytes, p.reserved_bytes) for p in replay(trace.recorder, simulate_cuda_allocator=True)]


STEPS = {
    "gpt2-fp32": (gpt2, {}),
    "llama-bf16-checkpointing": (llama, {"precision": "bf16-mixed", "gradient_checkpointing": True}),
    # a 16-bit model's final norm frees the last block's output right after it, where a recomputation that stopped
    # early once left another block marked as running
    "llama-bf16-true-checkpointing": (llama, {"precision": "bf16-true", "gradient_checkpointing": True}),
    "bert-fp32": (bert, {}),
    "llama-accumulation": (llama, {"precision": "bf16-mixed", "loop": TrainingLoop(accumulation_steps=2)}),
    "gpt2-sgd-lightning-cpu": (
        gpt2,
        {"optimizer": "sgd", "device": "cpu", "loop": TrainingLoop(zero_grad="before_backward")},
    ),
    "stack-checkpointing": (Stack, {"gradient_checkpointing": True}),
    "llama-inference": (llama, {"precision": "bf16-true", "inference": True, "optimizer": "none"}),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_log_built_from_three_blocks_is_what_seven_blocks_trace(name: str) -> None:
    build, step = STEPS[name]
    three, four = (traced(build, blocks, **step) for blocks in (3, 4))
    seven = traced(build, 7, record=False, **step)
    built = deepen(three, 7, check=(three, four))
    assert log_difference(built.recorder, seven.recorder) is None
    assert peaks(built) == peaks(seven)
    assert (built.ops, built.blocks, built.substitutions) == (seven.ops, 7, seven.substitutions)


def test_lora_adapters_and_frozen_blocks_build_as_traced() -> None:
    peft = pytest.importorskip("peft")

    def adapted(blocks: int) -> nn.Module:
        return peft.get_peft_model(llama(blocks), peft.LoraConfig(r=4, target_modules="all-linear"))

    sample = sample_of(llama)
    step = {"precision": "bf16-mixed", "gradient_checkpointing": True}
    three, four, six = (
        trace_steps(model, sample, 2, 3, settings_for(model, sample, blocks < 6, **step)[0])
        for blocks, model in ((blocks, adapted(blocks)) for blocks in (3, 4, 6))
    )
    built = deepen(three, 6, check=(three, four))
    assert log_difference(built.recorder, six.recorder) is None
    assert peaks(built) == peaks(six)


def test_a_symbolic_trace_builds_to_every_batch_of_the_deep_model() -> None:
    sample = sample_of(gpt2)

    def symbolic(blocks: int, record: bool = True) -> Any:
        torch.manual_seed(0)
        model = gpt2(blocks)
        settings, sample_batch = settings_for(model, sample, record, precision="bf16-mixed")
        return trace_symbolic(model, sample, sample_batch, settings, hint=4)

    whole = symbolic(8, record=False)
    built = deepen_symbolic(symbolic(3), 8, check=symbolic(4))
    assert built.valid(2) and built.valid(64)
    for batch in (2, 7, 64):
        assert log_difference(built.at(batch).recorder, whole.at(batch).recorder) is None, batch
        assert peaks(built.at(batch)) == peaks(whole.at(batch)), batch


class Alternating(Stack):
    """Blocks of one class whose odd ones do more work: a log that one block's events cannot build."""

    def __init__(self, blocks: int) -> None:
        super().__init__(blocks)
        for number, block in enumerate(self.blocks):
            block.twice = number % 2 == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(block(x)) if block.twice else block(x)
        return self.out(x)


def test_blocks_that_differ_are_refused_with_the_reason() -> None:
    sample = torch.zeros(2, 16)
    three, four = (
        trace_steps(model, sample, 2, 2, settings_for(model, sample)[0]) for model in (Alternating(3), Alternating(4))
    )
    with pytest.raises(DepthMismatch, match="its blocks do not repeat one another"):
        deepen(three, 9, check=(three, four))


def test_a_trace_without_recorded_blocks_is_refused() -> None:
    model = Stack(3)
    settings, sample_batch = settings_for(model, torch.zeros(2, 16))
    plain = trace_steps(model, torch.zeros(2, 16), sample_batch, 2, dataclasses.replace(settings, record_blocks=False))
    with pytest.raises(DepthMismatch):
        deepen(plain, 8, check=(plain, plain))


NARROW_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 9,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                "max_position_embeddings": 256}  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--lora-r", "8", "--lora-targets", "all-linear"]])
def test_memfit_plan_of_a_deep_config_builds_its_log_and_answers_as_the_whole_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(NARROW_LLAMA))
    command = ["plan", "--hf-config", str(config), "--budget", "1GiB", "--seq-len", "128", "--json", *extra]
    answers = []
    for exact in ([], ["--exact"]):
        assert main([*command, *exact]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    built, whole = answers
    assert built["depth_built_from"] == [3, 4] and whole["depth_built_from"] is None
    (row,), (exact_row,) = built["gpus"], whole["gpus"]
    assert row["fits"] and row["micro_batch_size"] > 1
    for key in ("micro_batch_size", "gradient_checkpointing", "accumulate_grad_batches", "predicted_peak_bytes",
                "predicted_reserved_bytes", "breakdown_bytes", "peak_phase"):  # fmt: skip
        assert row[key] == exact_row[key], key


def test_the_engines_in_place_gradient_sums_are_folded_back_into_a_log_that_records_blocks() -> None:
    recorded = traced(llama, 3, precision="bf16-mixed")
    plain = traced(llama, 3, record=False, precision="bf16-mixed")
    assert recorded.recorder.sums_in_place, "a trace that records blocks keeps each in-place sum apart"
    assert log_difference(recorded.recorder, plain.recorder) is not None
    assert log_difference(fold_sums_in_place(recorded.recorder), plain.recorder) is None
    # one rank's log (FSDP gathers by unit, so its traces record blocks) has them in place too
    ranked = shard_trace(recorded, RankPlan("fsdp", 2))
    assert log_difference(ranked.recorder, plain.recorder) is None


def test_a_folded_sum_leaves_no_storage_of_its_own_behind() -> None:
    """GPT-2 ties its embedding to its head: the embedding's two gradients are summed in place. Folded back, the
    sum is the first gradient's storage, so the log's storages by category are the plain trace's: a sharded rank's
    gradient term counted the tied embedding twice when the sum kept a category of its own."""
    from memfit.prediction.sharded import traced_bytes

    recorded = traced(gpt2, 3)
    plain = traced(gpt2, 3, record=False)
    folded = dataclasses.replace(recorded, recorder=fold_sums_in_place(recorded.recorder))
    assert recorded.recorder.sums_in_place  # the tied embedding's, among others
    assert traced_bytes(folded) == traced_bytes(plain)
