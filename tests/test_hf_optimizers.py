"""Every ``TrainingArguments.optim`` value is planned with the optimizer state it really keeps, or refused clearly.

Beside tests/test_optimizers.py (which compares the trace with the Trainer's own optimizer after two
real steps), this checks the planned state against the size each optimizer family is documented to
keep, counted from the parameters alone: AdamW 8 B per element in fp32; bitsandbytes 8-bit 1 B per
state and element plus an fp32 absmax per block of 256 (32-bit state for tensors under 4096 elements
and for embeddings, which the Trainer overrides), and its two 256-entry code books; Adafactor's
factored rows and columns. And bitsandbytes' paged optimizers, whose big state buffers live in CUDA
unified memory (``memfit.tracing.paged``): out of the planned GPU peak, and said so in the notes.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.training_args import OptimizerNames

from memfit import Category, InvalidInputError, Phase, format_bytes
from memfit.huggingface import plan_training_arguments
from test_optimizers import NEEDS_PACKAGE, STEPS_IN_BACKWARD, Tokens, restored_bitsandbytes_manager  # noqa: F401

SEQ, VOCAB = 8, 1024
FP32 = 4
STEP = 4  # torch's optimizers keep the step count as an fp32 scalar tensor per parameter
CODE_BOOK = 256 * 4  # bitsandbytes' dynamic code book per state, shared by all parameters
ONE_STATE_8BIT = {"lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit"}
# bitsandbytes' AdEMAMix allocates paged state without checking the device (it has no CPU fallback):
# on the CPU its paged variants fail in bitsandbytes itself, so they are planned for a GPU only.
PAGED_WITHOUT_CPU = {"paged_ademamix_8bit", "paged_ademamix_32bit"}


def tiny_gpt2() -> GPT2LMHeadModel:
    """wte (131,072 elements, over bitsandbytes' 100,000 paging threshold), c_attn/c_fc (8-bit state),
    and vectors under 4096 elements (32-bit state)."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=128, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")  # fmt: skip
    return GPT2LMHeadModel(config)


def is_embedding(model: nn.Module, param: torch.Tensor) -> bool:
    return any(m.weight is param for m in model.modules() if isinstance(m, nn.Embedding))


def bnb_8bit(states: int, first_state_copies: int = 1) -> Callable[[nn.Module, torch.Tensor], int]:
    """bitsandbytes with ``states`` state tensors (AdEMAMix's first state holds two moments)."""
    copies = first_state_copies + states - 1

    def size(model: nn.Module, param: torch.Tensor) -> int:
        n = param.numel()
        if n < 4096 or is_embedding(model, param):
            return copies * n * FP32
        return copies * n + copies * math.ceil(n / 256) * FP32

    return size


def bnb_32bit(states: int) -> Callable[[nn.Module, torch.Tensor], int]:
    return lambda model, param: states * param.numel() * FP32


def torch_states(states: int) -> Callable[[nn.Module, torch.Tensor], int]:
    return lambda model, param: states * param.numel() * FP32 + STEP


def adafactor(model: nn.Module, param: torch.Tensor) -> int:
    """transformers' Adafactor, its defaults (no first moment): a row and a column second moment per matrix,
    a full one per vector, and the parameter's RMS (a 0-d fp32 tensor, ``state["RMS"]``)."""
    if param.dim() >= 2:
        return (param.shape[-2] + param.shape[-1]) * FP32 + FP32
    return param.numel() * FP32 + FP32


# optim value -> state bytes of one parameter (the shared 8-bit code books are added once per optimizer)
EXPECTED: dict[str, Callable[[nn.Module, torch.Tensor], int]] = {
    "adamw_torch": torch_states(2),
    "adamw_torch_fused": torch_states(2),
    "adafactor": adafactor,
    "sgd": lambda model, param: 0,
    "adagrad": torch_states(1),
    "rmsprop": torch_states(1),
    "adamw_bnb_8bit": bnb_8bit(2),
    "adamw_8bit": bnb_8bit(2),
    "paged_adamw_8bit": bnb_8bit(2),
    "paged_adamw_32bit": bnb_32bit(2),
    "lion_8bit": bnb_8bit(1),
    "paged_lion_8bit": bnb_8bit(1),
    "lion_32bit": bnb_32bit(1),
    "paged_lion_32bit": bnb_32bit(1),
    "ademamix": bnb_32bit(3),
    "ademamix_8bit": bnb_8bit(2, first_state_copies=2),
    "paged_ademamix_8bit": bnb_8bit(2, first_state_copies=2),
    "paged_ademamix_32bit": bnb_32bit(3),
    "rmsprop_bnb": bnb_32bit(1),
    "rmsprop_bnb_8bit": bnb_8bit(1),
    "rmsprop_bnb_32bit": bnb_32bit(1),
}


def expected_state_bytes(optim: str, model: nn.Module) -> int:
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    total = sum(EXPECTED[optim](model, p) for p in params)
    if "8bit" in optim:
        total += CODE_BOOK * (1 if optim in ONE_STATE_8BIT else 2)
    return total


def planned_state_bytes(planned: object) -> int:
    last_step = [phase for phase in planned.estimate.phases if phase.phase is Phase.OPTIMIZER][-1]
    return last_step.breakdown.get(Category.OPTIMIZER_STATE, 0)


def args_for(optim: str, tmp_path: Path) -> TrainingArguments:
    return TrainingArguments(str(tmp_path), optim=optim, per_device_train_batch_size=2, use_cpu=True, report_to=[],
                             optim_target_modules=["attn", "mlp"])  # fmt: skip


def test_every_value_is_expected_or_refused() -> None:
    values = {optim.value for optim in OptimizerNames}
    assert values == set(EXPECTED) | set(NEEDS_PACKAGE) | set(STEPS_IN_BACKWARD)


@pytest.mark.parametrize("optim", [optim.value for optim in OptimizerNames])
def test_every_optim_plans_its_documented_state_or_is_refused(optim: str, tmp_path: Path) -> None:
    model, args = tiny_gpt2(), args_for(optim, tmp_path)
    if optim in STEPS_IN_BACKWARD:
        with pytest.raises(InvalidInputError, match=rf"optim='{optim}'.*inside backward.*Plan with optim="):
            plan_training_arguments(model, args, Tokens(VOCAB, SEQ), budget="1GiB")
        return
    if optim in NEEDS_PACKAGE and importlib.util.find_spec(NEEDS_PACKAGE[optim]) is None:
        with pytest.raises(InvalidInputError, match=rf"cannot build optim='{optim}'.*install what it needs"):
            plan_training_arguments(model, args, Tokens(VOCAB, SEQ), budget="1GiB")
        return
    if optim not in EXPECTED:
        pytest.skip(f"{optim}: its package is installed here; tests/test_optimizers.py compares it with the real one")
    if optim in PAGED_WITHOUT_CPU:  # for a GPU, as its unpaged twin less the embedding's state in unified memory
        planned = plan_training_arguments(model, args, Tokens(VOCAB, SEQ), budget="h100")
        twin = plan_training_arguments(model, args_for(UNPAGED[optim], tmp_path), Tokens(VOCAB, SEQ), budget="h100")
        wte = model.transformer.wte.weight
        assert planned_state_bytes(planned) == planned_state_bytes(twin) - 3 * wte.numel() * FP32
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        planned = plan_training_arguments(model, args, Tokens(VOCAB, SEQ), budget="1GiB")
    assert planned.plan.micro_batch_size >= 2
    assert planned_state_bytes(planned) == expected_state_bytes(optim, model)


# paged value -> the same optimizer unpaged (transformers names no unpaged 32-bit bitsandbytes AdamW)
UNPAGED = {"paged_adamw_8bit": "adamw_8bit", "paged_adamw_32bit": None, "paged_lion_8bit": "lion_8bit",
           "paged_lion_32bit": "lion_32bit", "paged_ademamix_8bit": "ademamix_8bit",
           "paged_ademamix_32bit": "ademamix"}  # fmt: skip


@pytest.mark.parametrize("optim", UNPAGED)
def test_paged_state_is_out_of_the_gpu_peak_and_said_so(optim: str, tmp_path: Path) -> None:
    """For a CUDA target the state of parameters of 100,000 elements or more (here the embedding, 32-bit
    by the Trainer's override) lives in unified memory, out of the planned state; the notes say how much."""
    model = tiny_gpt2()
    on_gpu = plan_training_arguments(model, args_for(optim, tmp_path), Tokens(VOCAB, SEQ), budget="h100")
    states = 3 if "ademamix" in optim else 1 if "lion" in optim else 2
    unified = states * model.transformer.wte.weight.numel() * FP32
    if UNPAGED[optim] is not None:
        unpaged = plan_training_arguments(model, args_for(UNPAGED[optim], tmp_path), Tokens(VOCAB, SEQ), budget="h100")
        assert planned_state_bytes(unpaged) - planned_state_bytes(on_gpu) == unified
        assert not any(note.startswith("paged optimizer") for note in unpaged.estimate.notes)
    notes = [note for note in on_gpu.estimate.notes if note.startswith("paged optimizer")]
    assert len(notes) == 1 and f"{format_bytes(unified)} of its state" in notes[0] and "unified memory" in notes[0]
