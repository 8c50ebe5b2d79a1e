"""The command line as a newcomer meets it: the GPU catalog, exit codes that say "no", one line for a missing extra."""

from __future__ import annotations

import importlib
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


def test_a_sequence_sweep_of_a_factory_without_token_ids_is_refused_in_one_line(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", factory, "--budget", "2GiB", "--seq-len", "128,256"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "holds no token ids (an integer [batch, seq] tensor) to vary" in error


TOKENS_FACTORY = """
import torch
from torch import nn


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 32), nn.Linear(32, 100)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids)).logsumexp(-1).mean()


def make():
    return Tokens(), (lambda batch: {"input_ids": torch.randint(0, 100, (batch, 77))})
"""


def test_a_factorys_own_length_is_said_when_seq_len_asks_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The factory's sample makes 77 tokens: the plan is for 77, and --seq-len 128 gets one warning saying so."""
    (tmp_path / "tokens_factory.py").write_text(textwrap.dedent(TOKENS_FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "tokens_factory:make", "--budget", "2GiB", "--seq-len", "128", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["seq_len"] == 77
    assert captured.err.count("memfit: warning: --seq-len 128: the sample of --model tokens_factory:make makes "
                              "batches of 77 tokens") == 1  # fmt: skip
    assert main(["plan", "--model", "tokens_factory:make", "--budget", "2GiB", "--json"]) == 0  # none asked: quiet
    assert "warning" not in capsys.readouterr().err


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


def test_plan_gpu_list_needs_no_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu", "list"]) == 0  # the list, not "one of --hf-config --model is required"
    assert "T4" in capsys.readouterr().out
    assert main(["gpus", "--json"]) == 0
    catalog = capsys.readouterr().out
    assert main(["plan", "--gpu=LIST", "--json"]) == 0
    assert capsys.readouterr().out == catalog
    assert main(["plan", "--gpu", "list", "--help"]) == 0  # --help still explains plan
    assert "--hf-config" in capsys.readouterr().out


def test_gpus_auto_where_nothing_fits_exits_1_and_bad_input_still_2(capsys: pytest.CaptureFixture[str]) -> None:
    gpt2 = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--gpus", "auto"]
    assert main([*gpt2, "--budget", "300MiB", "--max-gpus", "2", "--json"]) == EXIT_NOTHING_FITS
    out, err = capsys.readouterr()
    answer = json.loads(out)  # the answer is "no", in --json too, with every count's figures
    assert answer["fits"] is False and [check["gpus"] for check in answer["considered"]] == [1, 2]
    assert err.startswith("memfit: error: gpt2 does not fit 1 sample(s) per rank on up to 2 x budget 300MiB")
    assert len(err.strip().splitlines()) == 1
    assert main([*gpt2, "--budget", "300MiB", "--nodes", "2"]) == 2  # what was asked cannot be planned
    assert "drop --nodes" in capsys.readouterr().err


def test_a_missing_module_behind_a_library_error_names_its_extra_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 8-bit optimizer's loader raises its own error from the ModuleNotFoundError; --plot says so before the
    traces; a module a newer release has names the upgrade; a module no extra installs is not memfit's to explain."""
    gpt2 = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--budget", "4GiB"]
    _uninstalled(monkeypatch, "bitsandbytes")
    assert main([*gpt2, "--optimizer", "adamw_bnb_8bit"]) == 2
    err = capsys.readouterr().err
    assert err == 'memfit: error: this needs bitsandbytes, which is not installed: pip install "memfit[quant]"\n'
    _uninstalled(monkeypatch, "peft")
    assert main([*gpt2, "--lora-r", "8"]) == 2
    assert 'this needs peft, which is not installed: pip install "memfit[quant]"' in capsys.readouterr().err
    _uninstalled(monkeypatch, "matplotlib")
    assert main([*gpt2, "--plot", str(tmp_path / "plan.png")]) == 2
    out, err = capsys.readouterr()
    assert err == 'memfit: error: --plot needs matplotlib, which is not installed: pip install "memfit[plot]"\n'
    assert "parameters" not in out  # said before a trace, not after it

    cli = importlib.import_module("memfit.cli.main")

    def raising(error: Exception) -> None:
        def handler(args: object) -> int:
            raise error

        monkeypatch.setattr(cli, "_cmd_estimate", handler)

    raising(ModuleNotFoundError("No module named 'transformers.models.newest'", name="transformers.models.newest"))
    assert main(["estimate", "--params", "7B"]) == 2
    assert 'installed transformers lacks: pip install -U "memfit[hf]"' in capsys.readouterr().err
    raising(ModuleNotFoundError("No module named 'not_an_extra'", name="not_an_extra"))
    with pytest.raises(ModuleNotFoundError):
        main(["estimate", "--params", "7B"])


def _uninstalled(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Imports of ``package`` and its modules fail as if it were not installed (modules this process has
    imported already included: ``import_module`` would return them)."""
    for name in [name for name in sys.modules if name == package or name.startswith(f"{package}.")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_offload_that_needs_more_host_ram_than_this_machine_has_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import memfit.cli.sharding as sharding
    import memfit.prediction.host as host

    zero2 = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--budget", "4GiB",
             "--strategy", "zero2", "--gpus", "2", "--offload", "optimizer"]  # fmt: skip
    monkeypatch.setattr(sharding, "machine_ram_bytes", lambda: 100 * 2**20)
    assert main(zero2) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("host RAM for offloaded")]
    assert line.endswith("a node; more than this machine's 100.00 MiB")
    monkeypatch.setattr(sharding, "machine_ram_bytes", lambda: 2**40)
    assert main(zero2) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("host RAM for offloaded")]
    assert line.endswith(" a node")

    one_gpu = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--budget", "4GiB",
               "--offload", "optimizer"]  # fmt: skip
    monkeypatch.setattr(host, "available_ram_bytes", lambda: 100 * 2**20)
    assert main(one_gpu) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("host RAM:")]
    assert line.endswith("of 100.00 MiB available here; more than this machine has available") and "offload" in line


def test_names_the_user_wrote_are_printed_as_written(
    factory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A title such as ``mod:smile: 16.6K parameters`` holds ``:smile:``, which rich would print as an emoji."""
    (tmp_path / "emoji_mod.py").write_text("from newcomer_factory import make as smile\n")
    assert main(["plan", "--model", "emoji_mod:smile", "--budget", "2GiB", "--target-batch-size", "8"]) == 0
    assert "emoji_mod:smile:" in capsys.readouterr().out
