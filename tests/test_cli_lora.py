"""``memfit plan`` / ``memfit estimate`` with LoRA, DoRA and bitsandbytes quantization flags, run as a user would.

The model the CLI builds on ``meta`` is checked against real ones built from the same config: peft's own
trainable count, bitsandbytes' own quantized layout (``from_pretrained`` with a ``BitsAndBytesConfig``),
and ``memfit.estimate`` of that real quantized model.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import shlex
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    BitsAndBytesConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import memfit
from memfit.cli.main import main
from memfit.planning.finetune import finetune_breakdown
from memfit.presets import from_hf_config
from memfit.simulation.runtime import CudaRuntime

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
SEQ, BATCH, RANK = 32, 2, 8
PLAN = ["--budget", "1GiB", "--seq-len", str(SEQ), "--target-batch-size", str(BATCH), "--checkpointing", "off"]
BNB: dict[str, dict[str, Any]] = {
    "nf4": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": torch.bfloat16,
    },
    "fp4": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "fp4",
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": torch.bfloat16,
    },
    "int8": {"load_in_8bit": True},
}
FLAGS = {
    "nf4": ["--quantize", "nf4"],
    "fp4": ["--quantize", "fp4", "--no-double-quant"],
    "int8": ["--quantize", "int8"],
}


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """bitsandbytes and transformers warn about optional CPU kernels and deprecated names on every call."""
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same config with weights, saved in bf16 as published checkpoints are, for real quantization."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-weights")
    LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return path


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


_PLANS: dict[tuple[str, ...], dict[str, Any]] = {}


def plan_json(config_path: Path, *flags: str) -> dict[str, Any]:
    """``memfit plan ... --json`` (each set of flags run once per session)."""
    if flags not in _PLANS:
        code, out, err = cli("plan", "--hf-config", str(config_path), *PLAN, *flags, "--json")
        assert code == 0, err
        _PLANS[flags] = json.loads(out)
    return _PLANS[flags]


def real_quantized(checkpoint: Path, case: str, **lora: Any) -> torch.nn.Module:
    """A real bitsandbytes model as a QLoRA script builds it: load quantized, prepare, add adapters."""
    model = LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=BitsAndBytesConfig(**BNB[case]), dtype=torch.bfloat16, device_map="cpu"
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear", **lora))


@pytest.mark.parametrize(
    ("flags", "lora"),
    [
        ([], {"target_modules": "all-linear"}),
        (["--lora-targets", "q_proj,v_proj"], {"target_modules": ["q_proj", "v_proj"]}),
        (["--lora-targets", "self_attn.o_proj,down_proj"], {"target_modules": ["self_attn.o_proj", "down_proj"]}),
        (["--dora"], {"target_modules": "all-linear", "use_dora": True}),
    ],
    ids=["all-linear", "q-v", "path-suffix", "dora"],
)
def test_trainable_parameters_are_peft_own_count(config_path: Path, flags: list[str], lora: dict[str, Any]) -> None:
    report = plan_json(config_path, "--lora-r", str(RANK), *flags)
    real = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), LoraConfig(r=RANK, **lora))
    trainable, total = real.get_nb_trainable_parameters()
    assert report["finetune"]["trainable_parameters"] == trainable
    assert report["finetune"]["parameters"] == total
    assert report["finetune"]["adapter_weights_bytes"] == 4 * trainable  # peft keeps adapters in fp32


@pytest.mark.parametrize("case", ["nf4", "fp4", "int8"])
def test_quantized_layout_is_bitsandbytes_own(config_path: Path, checkpoint: Path, case: str) -> None:
    report = plan_json(config_path, "--lora-r", str(RANK), *FLAGS[case])["finetune"]
    real = real_quantized(checkpoint, case)
    assert (report["trainable_parameters"], report["parameters"]) == real.get_nb_trainable_parameters()
    sizes = finetune_breakdown(real)
    assert {k: report[k] for k in sizes} == sizes
    expected = sum(
        _bnb_bytes(m.weight.shape, case)
        for name, m in LlamaForCausalLM(LlamaConfig(**CONFIG)).named_modules()
        if type(m) is torch.nn.Linear and name != "lm_head"
    )
    assert report["quantized_weights_bytes"] == expected


@pytest.mark.parametrize("case", ["nf4", "fp4", "int8"])
def test_qdora_counts_are_peft_own_on_bitsandbytes_layers(config_path: Path, checkpoint: Path, case: str) -> None:
    """--dora --quantize: real peft DoRA on the meta model's bitsandbytes layers, the magnitude vectors trainable."""
    report = plan_json(config_path, "--lora-r", str(RANK), *FLAGS[case], "--dora")["finetune"]
    real = real_quantized(checkpoint, case, use_dora=True)
    trainable, total = real.get_nb_trainable_parameters()
    assert (report["trainable_parameters"], report["parameters"]) == (trainable, total)
    magnitudes = sum(p.numel() for name, p in real.named_parameters() if "lora_magnitude_vector" in name)
    assert magnitudes and trainable == magnitudes + plan_json(config_path, "--lora-r", str(RANK), *FLAGS[case])[
        "finetune"]["trainable_parameters"]  # fmt: skip
    sizes = finetune_breakdown(real)
    assert {k: report[k] for k in sizes} == sizes
    assert report["label"].endswith(f"DoRA r={RANK}")


def _bnb_bytes(shape: torch.Size, case: str) -> int:
    """bitsandbytes' bytes for one weight: numel / 2 packed plus the quantization state (see its QuantState)."""
    numel, rows = shape.numel(), shape[0]
    if case == "int8":
        return numel + 4 * rows  # int8 weight, fp32 scale per row
    blocks = math.ceil(numel / 64)
    if case == "fp4":  # no double quantization: fp32 absmax per block of 64, 16-entry fp32 code
        return numel // 2 + 4 * blocks + 16 * 4
    # uint8 absmax, fp32 absmax per 256 blocks, 256-entry dynamic code, fp32 offset, 16-entry code
    return numel // 2 + blocks + 4 * math.ceil(blocks / 256) + 256 * 4 + 4 + 16 * 4


@pytest.mark.parametrize(("case", "dora"), [("nf4", False), ("int8", False), ("nf4", True), ("int8", True)],
                         ids=["nf4", "int8", "qdora-nf4", "dora-int8"])  # fmt: skip
def test_traced_plan_equals_estimate_of_real_quantized_model(
    config_path: Path, checkpoint: Path, case: str, dora: bool
) -> None:
    """The plan's meta model against a real one (bitsandbytes' quantization, peft's adapters): the same trace.
    With DoRA, peft dequantizes each quantized weight in every forward to take its norm."""
    flags = (*FLAGS[case], "--dora") if dora else FLAGS[case]
    row = plan_json(config_path, "--lora-r", str(RANK), *flags, "--optimizer", "paged_adamw_8bit")["gpus"][0]
    assert row["micro_batch_size"] == BATCH and not row["gradient_checkpointing"]
    real = real_quantized(checkpoint, case, use_dora=dora)
    sample = from_hf_config(str(config_path), seq_len=SEQ).sample  # the batch the CLI feeds its meta model
    estimate = memfit.estimate(
        real,
        sample,
        batch_size=BATCH,
        optimizer="adam-8bit",
        precision="bf16-mixed",
        target=memfit.Target("cuda", CudaRuntime(compute_capability=(9, 0))),
    )
    assert row["breakdown_bytes"] == estimate.to_dict()["breakdown_bytes"]
    assert row["predicted_peak_bytes"] >= estimate.peak_bytes  # the plan's figure is at(batch): never below the trace


@pytest.mark.parametrize("case", ["nf4", "int8"])
def test_inference_plan_of_a_quantized_model_equals_estimate_of_the_real_one(
    config_path: Path, checkpoint: Path, case: str
) -> None:
    """Serving a quantized model: an 8-bit forward finds its outlier columns from the input's values, which
    the trace replays with a fixed count instead of failing."""
    row = plan_json(config_path, "--inference", *FLAGS[case])["gpus"][0]
    assert row["micro_batch_size"] == BATCH
    real = LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=BitsAndBytesConfig(**BNB[case]), dtype=torch.bfloat16, device_map="cpu"
    )
    estimate = memfit.estimate(
        real,
        from_hf_config(str(config_path), seq_len=SEQ).sample,
        batch_size=BATCH,
        precision="bf16",
        inference=True,
        target=memfit.Target("cuda", CudaRuntime(compute_capability=(9, 0))),
    )
    assert row["breakdown_bytes"] == estimate.to_dict()["breakdown_bytes"]
    assert row["breakdown_bytes"]["temporaries"] > 0


def test_a_served_quantized_model_trains_nothing_and_counts_its_tied_embedding_once(tmp_path: Path) -> None:
    """Serving trains nothing: a Qwen2 whose head is its embedding has that one frozen weight, counted once."""
    torch.manual_seed(0)
    shape = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    config = Qwen2Config(**{**shape, "vocab_size": 512}, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    code, out, err = cli("plan", "--hf-config", str(tmp_path / "config.json"), "--budget", "1GiB", "--seq-len",
                         str(SEQ), "--inference", *FLAGS["nf4"], "--json")  # fmt: skip
    assert code == 0, err
    finetune = json.loads(out)["finetune"]
    real = Qwen2ForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(**BNB["nf4"]), dtype=torch.bfloat16, device_map="cpu"
    )
    assert real.lm_head.weight is real.model.embed_tokens.weight
    unquantized = [p for p in real.parameters() if type(p).__name__ != "Params4bit"]  # a tied weight once
    assert finetune["trainable_parameters"] == 0 and finetune["adapter_weights_bytes"] == 0
    assert finetune["frozen_weights_bytes"] == sum(p.numel() * p.element_size() for p in unquantized)
    assert finetune["parameters"] == PeftModel.get_nb_trainable_parameters(real)[1]  # counted as peft counts
    assert finetune["adapter_gradients_bytes"] is None and finetune["optimizer_state_bytes"] is None


def test_qlora_below_lora_below_full_fine_tuning(config_path: Path) -> None:
    def held(*flags: str) -> int:
        """Weights, gradients and optimizer state at the peak of the step at the same micro batch."""
        row = plan_json(config_path, *flags)["gpus"][0]
        assert row["micro_batch_size"] == BATCH
        return sum(row["breakdown_bytes"].get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))

    full, lora, qlora = held(), held("--lora-r", str(RANK)), held("--lora-r", str(RANK), "--quantize", "nf4")
    assert qlora < lora < full


def test_json_names_the_paged_optimizer_it_stands_in_for(config_path: Path) -> None:
    report = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"], "--optimizer", "paged_adamw_8bit")
    finetune = report["finetune"]
    assert finetune["label"] == f"nf4 double-quant, LoRA r={RANK}"
    assert finetune["adapter_gradients_bytes"] == finetune["adapter_weights_bytes"]  # fp32 adapters, fp32 grads
    unpaged = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"], "--optimizer", "adam-8bit")["finetune"]
    assert finetune["optimizer_state_bytes"] == unpaged["optimizer_state_bytes"] > 0
    if report["optimizer"] != "paged-adamw-8bit":  # traced as its unpaged twin: the report says so
        assert report["optimizer"] == "adam-8bit" and "paged" in finetune["notes"][0]


def test_table_shows_the_finetune_lines_and_no_training_columns_for_inference(config_path: Path) -> None:
    code, out, err = cli("plan", "--hf-config", str(config_path), *PLAN, "--lora-r", str(RANK), "--quantize", "nf4")
    assert code == 0, err
    assert "Quantized weights" in out and "Adapter gradients" in out and "accum." in out
    code, out, err = cli(
        "plan",
        "--hf-config",
        str(config_path),
        "--budget",
        "1GiB",
        "--seq-len",
        str(SEQ),
        "--inference",
        "--quantize",
        "nf4",
    )
    assert code == 0, err
    assert "Quantized weights" in out
    assert not any(column in out for column in ("accum.", "ckpt", "effective", "Adapter gradients", "optim state"))


def _refused(*argv: str) -> str:
    code, out, err = cli(*argv)
    assert code == 2 and not out
    message = err.strip()
    assert message.startswith("memfit: error:") and "\n" not in message and "sample" not in message
    return message


@pytest.mark.parametrize(
    ("quantization", "flags", "stand_in"),
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, ["--lora-r", "8", "--optimizer", "paged_adamw_8bit"],
         "nf4"),
        ({"quant_method": "gptq", "bits": 8}, ["--inference"], "int8"),
        ({"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4}}}, [], "nf4"),
        ({"quant_method": "torchao", "quant_type": "int8_weight_only"}, ["--lora-r", "8", "--dora"], "int8"),
    ],
    ids=["awq-lora", "gptq-8bit-inference", "hqq-training", "torchao-dora"],
)  # fmt: skip
def test_foreign_quantization_suggests_an_estimate_command_that_runs(
    tmp_path: Path, quantization: dict[str, Any], flags: list[str], stand_in: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "quantization_config": quantization}))
    message = _refused("plan", "--hf-config", str(path), "--budget", "1GiB", *flags)
    library = {"awq": "AWQ", "gptq": "GPTQ", "hqq": "HQQ", "torchao": "torchao"}[quantization["quant_method"]]
    assert f"quantized with {library}" in message and f"Add --quantize {stand_in}" in message
    command = shlex.split(message.split("formula tier: ", 1)[1])
    assert command[:2] == ["memfit", "estimate"] and command[command.index("--quantize") + 1] == stand_in
    code, out, err = cli(*command[1:], "--json")
    assert code == 0, err
    formula = json.loads(out)
    assert formula["quantized_weights_bytes"] > 0
    assert (formula["trainable_parameters"] == 0) == ("--inference" in flags)  # a served model trains nothing
    message = _refused("estimate", "--hf-config", str(path), "--lora-r", "8")  # the formula tier needs a width
    assert library in message and f"add --quantize {stand_in}" in message


def test_foreign_quantization_is_planned_with_bitsandbytes_standing_in(config_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    code, out, err = cli("plan", "--hf-config", str(path), *PLAN, "--lora-r", str(RANK), *FLAGS["nf4"], "--json")
    assert code == 0, err
    finetune = json.loads(out)["finetune"]
    flagged = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"])["finetune"]
    assert {k: v for k, v in finetune.items() if k != "notes"} == {k: v for k, v in flagged.items() if k != "notes"}
    assert finetune["notes"] == ["GPTQ (the config's quantization_config) planned as bitsandbytes nf4"]


def test_a_bitsandbytes_checkpoint_config_is_planned_quantized(config_path: Path, tmp_path: Path) -> None:
    """A pre-quantized checkpoint's config.json carries its BitsAndBytesConfig: planned as it says."""
    path = tmp_path / "config.json"
    quantization = BitsAndBytesConfig(**BNB["nf4"]).to_dict()
    path.write_text(json.dumps({**CONFIG, "quantization_config": quantization}))
    code, out, err = cli("plan", "--hf-config", str(path), *PLAN, "--lora-r", str(RANK), "--json")
    assert code == 0, err
    finetune = json.loads(out)["finetune"]
    flagged = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"])["finetune"]
    assert finetune["quantized_weights_bytes"] == flagged["quantized_weights_bytes"] > 0
    assert "quantization_config" in finetune["notes"][-1]
    message = _refused("plan", "--hf-config", str(path), "--budget", "1GiB")
    assert "quantization_config" in message and "--lora-r" in message


def test_quantize_refuses_conv1d_models_naming_the_layers(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64).to_json_string())
    message = _refused("plan", "--hf-config", str(path), "--seq-len", "64", "--budget", "1GiB", "--lora-r", "8",
                       "--quantize", "nf4")  # fmt: skip
    assert "c_attn" in message and "Conv1D" in message and "Drop --quantize" in message and "Llama" in message


def test_lora_targets_naming_no_layer_lists_the_layers(config_path: Path) -> None:
    message = _refused(
        "plan", "--hf-config", str(config_path), "--budget", "1GiB", "--lora-r", "8", "--lora-targets", "q_proj,query"
    )
    assert "query" in message and "q_proj," not in message.split("can adapt are")[0]
    assert all(name in message.split("can adapt are")[1] for name in ("q_proj", "k_proj", "gate_proj", "lm_head"))


def test_quantize_alone_asks_for_adapters_or_inference(config_path: Path) -> None:
    message = _refused("plan", "--hf-config", str(config_path), "--budget", "1GiB", "--quantize", "nf4")
    assert "--lora-r" in message and "--inference" in message


def test_estimate_counts_adapters_with_peft_and_quantized_weights(config_path: Path) -> None:
    code, out, err = cli(
        "estimate",
        "--hf-config",
        str(config_path),
        "--lora-r",
        str(RANK),
        "--quantize",
        "nf4",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "paged_adamw_8bit",
        "--json",
    )
    assert code == 0, err
    formula = json.loads(out)
    real = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), LoraConfig(r=RANK, target_modules="all-linear"))
    trainable, total = real.get_nb_trainable_parameters()
    assert (formula["trainable_parameters"], formula["parameters"]) == (trainable, total)
    traced = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"])["finetune"]
    # the scales of all layers counted at once: the same bytes up to a few blocks rounded per layer
    assert formula["quantized_weights_bytes"] == pytest.approx(traced["quantized_weights_bytes"], abs=4 * 14)
    assert formula["gradients_bytes"] == 2 * trainable and formula["master_weights_bytes"] == 4 * trainable
    # every adapter is under bitsandbytes' min_8bit_size (4096 elements): two fp32 states, as the trace holds them
    paged = plan_json(config_path, "--lora-r", str(RANK), *FLAGS["nf4"], "--optimizer", "paged_adamw_8bit")
    assert formula["optimizer_state_bytes"] == paged["finetune"]["optimizer_state_bytes"] == 8 * trainable


def test_estimate_orders_qlora_lora_and_full_fine_tuning_of_an_8b_model() -> None:
    def total(*flags: str) -> int:
        code, out, err = cli("estimate", "--params", "8B", "--precision", "bf16-mixed", *flags, "--json")
        assert code == 0, err
        return json.loads(out)["total_bytes"]

    full = total("--optimizer", "adamw")
    lora = total("--lora-r", "16", "--lora-params", "42M")
    qlora = total("--lora-r", "16", "--lora-params", "42M", "--quantize", "nf4", "--optimizer", "paged_adamw_8bit")
    assert qlora < lora < full
    assert 4e9 < qlora < 6e9 and 16e9 < lora < 18e9  # 8B at ~4.1 bits / 16 bits, plus 42M adapters
    message = _refused("estimate", "--params", "8B", "--lora-r", "16")
    assert "--hf-config" in message and "--lora-params" in message


def test_estimate_of_a_quantized_model_without_adapters_says_what_to_add(config_path: Path) -> None:
    """--quantize without --lora-r would train the quantized weights, which bitsandbytes cannot: refused, with
    the two things that make sense; the second of them then runs."""
    for counts in (["--params", "7B"], ["--hf-config", str(config_path)]):
        message = _refused("estimate", *counts, "--quantize", "nf4")
        assert "--lora-r 16" in message and "--trainable-fraction 0" in message and "bitsandbytes" in message
    code, out, err = cli("estimate", "--hf-config", str(config_path), "--quantize", "nf4", "--trainable-fraction", "0",
                         "--json")  # fmt: skip
    assert code == 0, err
    served = json.loads(out)
    assert served["quantized_weights_bytes"] > 0 and served["trainable_parameters"] == 0
    assert served["gradients_bytes"] == served["optimizer_state_bytes"] == 0


def test_estimate_counts_8bit_optimizer_state_as_bitsandbytes_and_the_trace_do(tmp_path: Path) -> None:
    """Adapters on both sides of bitsandbytes' min_8bit_size (hidden 512, r=8: 1024 to 8192 elements): the formula
    tier counts the state a real AdamW8bit allocates, and the trace holds the same tensors (CUDA rounds each
    allocation up to 512 B)."""
    config = {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    flags = ["--lora-r", str(RANK), "--optimizer", "adamw_8bit", "--precision", "bf16-mixed"]
    code, out, err = cli("estimate", "--hf-config", str(path), *flags, "--json")
    assert code == 0, err
    formula = json.loads(out)["optimizer_state_bytes"]

    import bitsandbytes as bnb

    torch.manual_seed(0)
    real = get_peft_model(LlamaForCausalLM(LlamaConfig(**config)), LoraConfig(r=RANK, target_modules="all-linear"))
    adapters = [p for p in real.parameters() if p.requires_grad]
    assert min(p.numel() for p in adapters) < 4096 <= max(p.numel() for p in adapters)
    optimizer = bnb.optim.AdamW8bit(adapters)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 8))
    real(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = {id(t): t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)}
    sizes = [t.numel() * t.element_size() for t in state.values()]
    assert formula == sum(sizes)

    code, out, err = cli("plan", "--hf-config", str(path), *PLAN, *flags, "--json")
    assert code == 0, err
    assert json.loads(out)["finetune"]["optimizer_state_bytes"] == sum(-(-size // 512) * 512 for size in sizes)


def test_a_lora_target_that_names_no_layer_lists_the_ones_peft_can_adapt(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 has no q_proj: one line naming the layers peft adapts (Conv1D and embeddings included, as peft takes
    them), not calling them all linear."""
    argv = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--gpu", "t4", "--lora-r", "8",
            "--lora-targets", "q_proj"]  # fmt: skip
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--lora-targets q_proj names no layer of GPT2LMHeadModel" in error
    assert "the layers peft can adapt are c_attn, c_fc, c_proj" in error and "linear layers" not in error
