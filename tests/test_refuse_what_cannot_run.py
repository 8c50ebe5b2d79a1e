"""What the real step could not run is refused in one line, not planned: sequences longer than the model's
positions, token ids and labels outside its vocabulary, a ``--model`` whose forward returns logits without
``--loss``; and the examples' own configs give transformers nothing to warn about."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import (
    BertConfig,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    T5Config,
    TrainingArguments,
)

from memfit.cli.main import main
from memfit.errors import InvalidInputError
from memfit.huggingface import plan_training_arguments
from memfit.presets import from_factory

VOCAB = 100
POSITIONS = 32
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(_gpt2_config())


def _gpt2_config(**extra: Any) -> GPT2Config:
    return GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=POSITIONS, vocab_size=VOCAB, bos_token_id=0,
                      eos_token_id=0, loss_type="ForCausalLM", **extra)  # fmt: skip


class Rows(torch.utils.data.Dataset):
    """Examples of the given columns, every row the same."""

    def __init__(self, n: int = 8, **columns: torch.Tensor) -> None:
        self.n, self.columns = n, columns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(self.columns)


def _args(tmp_path: Path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip


def _ids(length: int, high: int = VOCAB) -> torch.Tensor:
    return torch.arange(length) % high


# 1. sequences longer than the model's positions


def test_plan_training_arguments_refuses_sequences_longer_than_the_positions(tmp_path: Path) -> None:
    ids = _ids(2 * POSITIONS)  # GPT-2's real forward raises IndexError in its position table at this length
    with pytest.raises(InvalidInputError) as refused:
        plan_training_arguments(tiny_gpt2(), _args(tmp_path), Rows(input_ids=ids, labels=ids), budget="1GiB")
    message = str(refused.value)
    assert "\n" not in message
    assert f"{2 * POSITIONS} tokens" in message and f"{POSITIONS} positions" in message
    assert f"max_length={POSITIONS}" in message  # what to do


def _config_file(tmp_path: Path, config: Any) -> str:
    path = tmp_path / f"{config.model_type}.json"
    path.write_text(config.to_json_string())
    return str(path)


def _bert_config() -> BertConfig:
    return BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=POSITIONS, vocab_size=VOCAB)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [_gpt2_config(), _bert_config()],
    ids=["gpt2-n_positions", "bert-max_position_embeddings"],
)
def test_the_cli_refuses_a_seq_len_past_the_configs_positions(
    tmp_path: Path, config: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--hf-config", _config_file(tmp_path, config), "--seq-len", str(2 * POSITIONS), "--budget", "1GiB"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    error = captured.err
    assert error.startswith("memfit: error: ") and error.count("\n") == 1
    assert f"{2 * POSITIONS} tokens" in error and f"{POSITIONS} positions" in error
    assert f"use --seq-len {POSITIONS} or less" in error


def test_relative_positions_have_no_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    argv = ["plan", "--hf-config", _config_file(tmp_path, config), "--seq-len", str(2 * POSITIONS), "--budget", "1GiB"]
    assert main(argv) == 0, capsys.readouterr().err


# 2. token ids and labels outside the vocabulary


def test_input_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    ids = _ids(16)
    ids[3] = VOCAB + 50  # the real forward: IndexError in the embedding lookup (a device assert on a GPU)
    with pytest.raises(InvalidInputError) as refused:
        plan_training_arguments(tiny_gpt2(), _args(tmp_path), Rows(input_ids=ids, labels=_ids(16)), budget="1GiB")
    message = str(refused.value)
    assert "\n" not in message
    assert f"input_ids hold token id {VOCAB + 50}" in message and f"vocabulary of {VOCAB} tokens" in message
    assert "resize_token_embeddings" in message


def test_labels_outside_the_vocabulary_are_refused_but_minus_100_is_not(tmp_path: Path) -> None:
    ids = _ids(16)
    labels = ids.clone()
    labels[5] = VOCAB
    with pytest.raises(InvalidInputError, match=rf"labels hold {VOCAB}, outside the {VOCAB} token ids"):
        plan_training_arguments(tiny_gpt2(), _args(tmp_path), Rows(input_ids=ids, labels=labels), budget="1GiB")
    labels[5] = -7
    with pytest.raises(InvalidInputError, match="labels hold -7"):
        plan_training_arguments(tiny_gpt2(), _args(tmp_path), Rows(input_ids=ids, labels=labels), budget="1GiB")
    labels[:8] = -100  # positions the loss ignores: a prompt's, padding
    planned = plan_training_arguments(tiny_gpt2(), _args(tmp_path), Rows(input_ids=ids, labels=labels), budget="1GiB")
    assert planned.plan.micro_batch_size >= 1


def test_class_labels_outside_num_labels_are_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(_gpt2_config(num_labels=3, pad_token_id=0))
    data = Rows(input_ids=_ids(16), labels=torch.tensor(3))
    with pytest.raises(InvalidInputError, match="labels hold 3, outside the 3 classes"):
        plan_training_arguments(model, _args(tmp_path), data, budget="1GiB")


# 3. --loss for a --model factory whose forward returns logits

FACTORY = """
import torch
from torch import nn


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.head = nn.Linear(32, 100)

    def forward(self, input_ids, labels=None):
        return self.head(self.embed(input_ids))


def make():
    return Logits()


def make_with_tuples():
    return Logits(), (lambda batch: (torch.zeros(batch, 16, dtype=torch.long),))


def my_loss(output, batch):
    return nn.functional.cross_entropy(output.flatten(0, 1), batch["labels"].flatten())


def tuple_loss(output, batch):
    assert isinstance(batch, tuple) and len(batch) == 1, batch
    return output.float().logsumexp(-1).mean()


def two_arguments_too_many(output, batch, extra):
    return output.mean()


def wrong_key(output, batch):
    return output.mean() + batch["targets"].sum()


def not_reduced(output, batch):
    return output.float().logsumexp(-1)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 10)

    def forward(self, images):
        return self.head(self.conv(images).mean((2, 3)))


def make_classifier():
    return Classifier(), (lambda b: (torch.zeros(b, 3, 32, 32), torch.zeros(b, dtype=torch.long)))


def labelled_loss(output, batch):
    images, labels = batch
    return nn.functional.cross_entropy(output, labels)
"""


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "logits_factory_mod.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "logits_factory_mod"
    sys.modules.pop("logits_factory_mod", None)


def test_a_factory_returning_logits_plans_with_loss(factory_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan = ["plan", "--model", f"{factory_module}:make", "--seq-len", "16", "--budget", "1GiB", "--json"]
    assert main(plan) == 2
    error = capsys.readouterr().err
    assert "--loss MODULE:FUNCTION" in error and "loss_fn" not in error
    assert main([*plan, "--loss", f"{factory_module}:my_loss"]) == 0, capsys.readouterr().err
    assert '"fits": true' in capsys.readouterr().out
    # a tuple batch reaches the loss as the tuple it was, as loss_fn= gets it
    tuples = ["plan", "--model", f"{factory_module}:make_with_tuples", "--loss", f"{factory_module}:tuple_loss",
              "--budget", "1GiB", "--json"]  # fmt: skip
    assert main(tuples) == 0, capsys.readouterr().err


def test_an_inputs_and_labels_batch_calls_the_forward_with_its_inputs(
    factory_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A classifier's forward(images) with an (images, labels) sample: the labels reach the loss only."""
    argv = ["plan", "--model", f"{factory_module}:make_classifier", "--loss", f"{factory_module}:labelled_loss",
            "--budget", "1GiB", "--json"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert '"fits": true' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("{m}:absent", "has no attribute 'absent'"),
        ("{m}:two_arguments_too_many", "takes (output, batch, extra)"),
        ("no_such_module_here:loss", "cannot load --loss"),
        ("{m}", "must look like 'package.module:function'"),
        ("{m}:wrong_key", "the --loss function {m}:wrong_key raised KeyError: 'targets'"),
        ("{m}:not_reduced", "returned a tensor of shape [2, 1024], not a scalar loss"),
    ],
)
def test_a_loss_that_cannot_be_called_is_one_line(
    factory_module: str, loss: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", f"{factory_module}:make", "--loss", loss.format(m=factory_module), "--budget", "1GiB"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("memfit: error: ") and error.count("\n") == 1
    assert expected.format(m=factory_module) in error


def test_loss_goes_with_model_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hf-config", "gpt2", "--loss", "somewhere:loss", "--budget", "1GiB"]) == 2
    assert "--loss somewhere:loss goes with --model" in capsys.readouterr().err


def test_from_factory_loss_is_applied_once(factory_module: str) -> None:
    module = sys.modules.get(factory_module) or __import__(factory_module)
    spec = from_factory(f"{factory_module}:make", seq_len=8, loss_fn=module.my_loss)
    batch = spec.sample(2)
    loss = spec.model(**batch)
    assert loss.dim() == 0 and loss.requires_grad
    with torch.no_grad():  # a forward-only plan keeps the output
        assert spec.model(**batch).shape == (2, 8, VOCAB)


# 4. the examples' configs


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"memfit_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _special_ids_outside_the_vocabulary(config: Any) -> dict[str, Any]:
    """The ids transformers' ``validate_token_ids`` warns about (once per process, so not caught reliably)."""
    return {
        name: value
        for name, value in config.to_dict().items()
        if name.endswith("_token_id") and isinstance(value, int) and not 0 <= value < config.vocab_size
    }


def test_the_examples_configs_keep_their_special_tokens_in_the_vocabulary() -> None:
    hf = _example("hf_trainer_quickstart").model_config(layers=1, width=32, seq_len=16)
    assert _special_ids_outside_the_vocabulary(hf) == {}
    lightning = pytest.importorskip("lightning")
    assert lightning is not None
    module = _example("lightning_quickstart").TinyGPT(seq_len=16, layers=1, width=32)
    assert _special_ids_outside_the_vocabulary(module.model.config) == {}
