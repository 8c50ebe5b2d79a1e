"""The command line as a newcomer meets it: the GPU catalog, exit codes that say "no", one line for a missing extra."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.cli.main import EXIT_NOTHING_FITS, main
from memfit.planning.gpus import known_gpus

FACTORY = """
import torch
from torch import nn


class Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        return self.net(x).pow(2).mean()


def make():
    return Squared(), (lambda batch: torch.randn(batch, 64))
"""


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "newcomer_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "newcomer_factory:make"


def test_the_gpu_catalog_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpus", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [card["name"] for card in listed] == [gpu.name for gpu in known_gpus()]
    h100 = next(card for card in listed if card["name"].startswith("H100"))
    assert h100["bf16"] and h100["compute_capability"] == "9.0" and h100["memory_bytes"] > 70 * 2**30
    assert main(["gpus"]) == 0
    table = capsys.readouterr().out
    assert "T4" in table and "compute capability" in table
    assert main(["plan", "--hf-config", "gpt2", "--gpu", "list"]) == 0  # what a newcomer types first
    assert "T4" in capsys.readouterr().out


def test_a_plan_where_nothing_fits_exits_1_and_its_json_is_still_the_answer(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", factory, "--budget", "500MiB", "--json"]) == EXIT_NOTHING_FITS == 1
    (row,) = json.loads(capsys.readouterr().out)["gpus"]
    assert not row["fits"] and "does not fit" in row["error"]
    assert main(["plan", "--model", factory, "--budget", "2GiB", "--json"]) == 0
    assert "exit status: 0 when the step fits" in _help(["plan", "--help"], capsys)


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return " ".join(capsys.readouterr().out.split())


def test_a_missing_optional_dependency_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    argv = ["plan", "--hf-config", "llama-3-8b", "--layers", "1", "--seq-len", "128", "--gpu", "rtx4090",
            "--lora-r", "16", "--quantize", "nf4"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == 'memfit: error: this needs bitsandbytes, which is not installed: pip install "memfit[quant]"\n'


def test_sequences_longer_than_the_models_positions_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 and BERT hold a learned table of positions: a longer sequence fails in their forward, so it is refused
    with the length that works; Llama's rotary positions have no table and no such limit."""
    assert main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "512,2048", "--gpu", "t4"]) == 2
    err = capsys.readouterr().err
    assert "2048 tokens are longer than the model's 1024 positions (transformer.wpe" in err
    assert err.strip().endswith("use --seq-len 1024 or less") and len(err.strip().splitlines()) == 1
    assert main(["plan", "--hf-config", "bert-base", "--layers", "1", "--seq-len", "1024", "--budget", "4GiB"]) == 2
    assert "512 positions" in capsys.readouterr().err

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, TrainingArguments

    import memfit
    from memfit.huggingface import plan_training_arguments

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, use_cpu=True, report_to=[])
    ids = torch.randint(0, 100, (8, 64))
    data = [{"input_ids": row, "labels": row} for row in ids]
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=100))
    with pytest.raises(memfit.InvalidInputError, match="64 tokens are longer than the model's 32 positions"):
        plan_training_arguments(gpt2, args, data, budget="1GiB")
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                                         max_position_embeddings=32))  # fmt: skip
    assert plan_training_arguments(llama, args, data, budget="1GiB").plan.micro_batch_size >= 1
