"""Every optimizer memfit names is traced, or refused with what to use instead.

The registry's names (``memfit.tracing.optimizers.OPTIMIZERS``) and every ``TrainingArguments.optim``
value: what the trace keeps as optimizer state is what the real optimizer holds after two real CPU
steps, and Adafactor's traced peak (its step reads tensor values, see ``optimizers.stepping``) is
the peak the CPU allocator reports for a real run.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.optimization import Adafactor as HFAdafactor
from transformers.training_args import OptimizerNames

import memfit
from harness.accuracy.reference import profiled_cpu_peak
from memfit import Category, InvalidInputError, Phase
from memfit.huggingface import plan_training_arguments
from memfit.tracing.optimizers import OPTIMIZERS, optimizer_info

EXACT = 1024  # bytes: CPU tensors are allocated at their size, so a right model is off by a few scalars at most
DOCS = Path(__file__).resolve().parents[1] / "docs"


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors the optimizer keeps as state, each storage once (bitsandbytes shares its code books)."""
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def traced_state_bytes(estimate: memfit.MemoryEstimate) -> int:
    """Optimizer state alive at the end of the traced second step."""
    last_step = [phase for phase in estimate.phases if phase.phase is Phase.OPTIMIZER][-1]
    return last_step.breakdown.get(Category.OPTIMIZER_STATE, 0)


def bitsandbytes_manager() -> Any:
    """bitsandbytes' process-wide manager of per-parameter overrides, or None without bitsandbytes."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from bitsandbytes.optim import GlobalOptimManager
    return GlobalOptimManager.get_instance()


def overrides(manager: Any) -> tuple[Any, ...]:
    if manager is None:
        return ()
    return list(manager.module_weight_config_triple), dict(manager.pid2config), dict(manager.index2config)


@pytest.fixture(autouse=True)
def restored_bitsandbytes_manager() -> Iterator[None]:
    """A real ``Trainer.create_optimizer`` registers overrides in bitsandbytes' manager: put it back afterwards."""
    manager = bitsandbytes_manager()
    before = overrides(manager)
    yield
    if manager is not None:
        manager.module_weight_config_triple, manager.pid2config, manager.index2config = before


# ------------------------------------------------------------------------------------------ Adafactor
WIDTH = 256


def mlp() -> nn.Module:
    """Matrices (factored second moments) and vectors (full ones, LayerNorm and biases)."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))


def square_loss(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.float().square().mean()


ADAFACTORS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], torch.dtype]] = {
    "torch": (lambda params: torch.optim.Adafactor(params), torch.float32),
    "torch-foreach": (lambda params: torch.optim.Adafactor(params, foreach=True, weight_decay=0.1), torch.float32),
    # transformers' defaults: relative step and parameter scale, both read from tensor values
    "transformers": (lambda params: HFAdafactor(params), torch.float32),
    # a first moment, weight decay, and fp32 copies of the bf16 parameters and gradients in its step
    "transformers-bf16": (lambda params: HFAdafactor(params, beta1=0.9, weight_decay=0.1), torch.bfloat16),
}


@pytest.mark.parametrize("case", ADAFACTORS)
def test_adafactor_is_traced_as_the_real_optimizer_steps(case: str) -> None:
    build, dtype = ADAFACTORS[case]
    stepped: list[torch.optim.Optimizer] = []

    def run() -> None:
        torch.manual_seed(0)
        model, batch = mlp().to(dtype), torch.randn(4, WIDTH, dtype=dtype)
        optimizer = build(model.parameters())
        for _ in range(2):
            loss = square_loss(model(batch), batch)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()
        stepped.append(optimizer)

    measured = profiled_cpu_peak(run)
    precision = "bf16-true" if dtype is torch.bfloat16 else "fp32"
    estimate = memfit.estimate(mlp(), torch.randn(4, WIDTH, dtype=dtype), optimizer=build, loss_fn=square_loss,
                               precision=precision, target=memfit.Target("cpu"))  # fmt: skip
    assert traced_state_bytes(estimate) == state_bytes(stepped[0])
    assert estimate.peak_phase is Phase.OPTIMIZER  # the step's own temporaries make the peak
    assert abs(estimate.peak_allocated_bytes - measured) <= EXACT


# ------------------------------------------------------------------------------------- the registry
def registry_model() -> nn.Module:
    """One matrix of 8192 elements (bitsandbytes keeps 8-bit state from 4096 up) and small ones."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_registry_name_is_traced_as_its_class_steps(name: str) -> None:
    info = optimizer_info(name)
    sample = torch.randn(2, 64)
    if info.package is not None and importlib.util.find_spec(info.package) is None:
        with pytest.raises(InvalidInputError, match=rf"'{name}'.*pip install {info.package}.*estimate_from_counts"):
            memfit.estimate(registry_model(), sample, optimizer=name, loss_fn=square_loss, target=memfit.Target("cpu"))
        return
    estimate = memfit.estimate(registry_model(), sample, optimizer=name, loss_fn=square_loss,
                               target=memfit.Target("cpu"))  # fmt: skip
    if info.class_path is None:
        assert traced_state_bytes(estimate) == 0
        return
    module, _, cls = info.class_path.rpartition(".")
    model = registry_model()
    optimizer = getattr(importlib.import_module(module), cls)(model.parameters(), **info.defaults)
    for _ in range(2):
        square_loss(model(sample), sample).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert traced_state_bytes(estimate) == state_bytes(optimizer)


def test_a_registry_name_whose_package_is_missing_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Moved from test_errors.py, where 'adam-8bit' was refused outright before it could be traced.)"""
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)  # importing it now fails, as without the package
    with pytest.raises(InvalidInputError, match=r"'adam-8bit'.*pip install bitsandbytes.*estimate_from_counts"):
        memfit.estimate(nn.Linear(4, 2), torch.randn(3, 4), optimizer="adam-8bit", loss_fn=square_loss)


def test_documented_optimizer_names_are_the_registry() -> None:
    api = next(line for line in (DOCS / "core-api.md").read_text().splitlines() if line.startswith("| `optimizer` |"))
    assert set(re.findall(r'`"([a-z0-9-]+)"`', api)) == set(OPTIMIZERS)
    cli = (DOCS / "cli.md").read_text()
    listed = re.search(r"\(`memfit\.tracing\.optimizers\.OPTIMIZERS`[^)]*\):\s*(.*?)\s\(", cli, re.S)
    assert listed is not None
    assert re.findall(r"`([a-z0-9-]+)`", listed.group(1)) == list(OPTIMIZERS)


# ------------------------------------------------------------------------ TrainingArguments.optim
# Values transformers cannot build without a package this environment may lack, by that package:
# memfit must refuse them naming the value and what to do, and plan them like any other once installed.
NEEDS_PACKAGE = {
    "adamw_torch_xla": "torch_xla",  # XLA devices
    "adamw_torch_npu_fused": "torch_npu",  # Ascend NPUs
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "galore_adamw": "galore_torch",
    "galore_adamw_8bit": "galore_torch",
    "galore_adafactor": "galore_torch",
    "grokadamw": "grokadamw",
    "schedule_free_radam": "schedulefree",
    "schedule_free_adamw": "schedulefree",
    "schedule_free_sgd": "schedulefree",
    "apollo_adamw": "apollo_torch",
    "stable_adamw": "optimi",
}
if "adamw_apex_fused" in {optim.value for optim in OptimizerNames}:  # NVIDIA apex: transformers 4.x lists it
    NEEDS_PACKAGE["adamw_apex_fused"] = "apex"
# Values whose update runs inside backward (LOMO's fused step; per-parameter hooks for the layerwise
# ones, which transformers registers on the model's parameters as it builds them): memfit's trace
# steps the optimizer after backward, so it refuses them whatever is installed, before building anything.
STEPS_IN_BACKWARD = {
    "lomo": "sgd",
    "adalomo": "adafactor",
    "galore_adamw_layerwise": "galore_adamw",
    "galore_adamw_8bit_layerwise": "galore_adamw_8bit",
    "galore_adafactor_layerwise": "galore_adafactor",
    "apollo_adamw_layerwise": "apollo_adamw",
}
# Every other value must plan, and a new one transformers adds is planned here (or fails here) too.
SEQ, VOCAB = 8, 128


class Tokens(torch.utils.data.Dataset):
    """Eight random causal-LM rows (the same at every call)."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ) -> None:
        self.ids = torch.randint(0, vocab, (8, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2() -> GPT2LMHeadModel:
    """The embedding and c_attn (64 x 192) are large enough for bitsandbytes' 8-bit state."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")  # fmt: skip
    return GPT2LMHeadModel(config)


def test_the_refused_values_are_transformers_values() -> None:
    assert set(NEEDS_PACKAGE) | set(STEPS_IN_BACKWARD) <= {optim.value for optim in OptimizerNames}
    assert not set(NEEDS_PACKAGE) & set(STEPS_IN_BACKWARD)


@pytest.mark.parametrize("optim", [optim.value for optim in OptimizerNames])
def test_every_trainer_optim_plans_or_is_refused_with_what_to_use(optim: str, tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens()
    args = TrainingArguments(str(tmp_path), optim=optim, per_device_train_batch_size=2, use_cpu=True, report_to=[],
                             optim_target_modules=["attn", "mlp"])  # fmt: skip
    if optim in STEPS_IN_BACKWARD:
        hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
        instead = STEPS_IN_BACKWARD[optim]
        with pytest.raises(InvalidInputError, match=rf"optim='{optim}'.*inside backward.*optim='{instead}'"):
            plan_training_arguments(model, args, data, budget="1GiB")
        assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == hooks  # nothing registered
        return
    if optim in NEEDS_PACKAGE and importlib.util.find_spec(NEEDS_PACKAGE[optim]) is None:
        with pytest.raises(InvalidInputError, match=rf"optim='{optim}'.*install.*optim='adamw_torch'"):
            plan_training_arguments(model, args, data, budget="1GiB")
        return
    manager = bitsandbytes_manager()
    before = overrides(manager)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        planned = plan_training_arguments(model, args, data, budget="1GiB")
        assert overrides(manager) == before  # planning registered nothing in the process's manager
        trainer = Trainer(model=tiny_gpt2(), args=args)  # the optimizer the Trainer itself builds
        optimizer = trainer.create_optimizer()
        batch = {"input_ids": data.ids[:2], "labels": data.ids[:2]}
        for _ in range(2):
            trainer.model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert planned.plan.micro_batch_size >= 2
    assert traced_state_bytes(planned.estimate) == state_bytes(optimizer)
