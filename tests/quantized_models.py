"""Tiny bitsandbytes-quantized Llama models with LoRA, built from a config with random weights (no download).

One builder for the quantized tests, the callback tests and ``benchmarks/quantized_accuracy.py``:
``from_pretrained`` with a ``BitsAndBytesConfig`` is what quantizes a model on load, so the random
Llama is saved once to a folder and loaded back quantized.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

TARGETS = ["q_proj", "v_proj", "up_proj"]

QUANTIZATIONS: dict[str, dict[str, Any]] = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": torch.bfloat16},
    "fp4-double": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "fp4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": torch.bfloat16,
    },
    "nf4-double": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": torch.bfloat16,
    },
    "int8": {"load_in_8bit": True},
}
"""``BitsAndBytesConfig`` keywords by name."""


def llama_config(vocab: int = 256, hidden: int = 256, intermediate: int = 512, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def save_random_llama(path: Path, config: LlamaConfig | None = None, seed: int = 0) -> Path:
    """A random Llama of ``config`` saved to ``path`` (a folder), to be loaded back quantized."""
    torch.manual_seed(seed)
    LlamaForCausalLM(config or llama_config()).save_pretrained(path)
    return path


def quantized_llama(
    checkpoint: Path, quantization: str, *, kbit: bool = False, lora: bool = True, dora: bool = False
) -> torch.nn.Module:
    """The Llama at ``checkpoint`` loaded on the CPU with ``QUANTIZATIONS[quantization]``; with ``kbit``,
    through ``peft.prepare_model_for_kbit_training`` (fp32 norms and head, input gradients, no
    checkpointing); with ``lora``, a peft LoRA of rank 8 on ``TARGETS`` (DoRA with ``dora``)."""
    with quiet_bitsandbytes():
        model = LlamaForCausalLM.from_pretrained(
            checkpoint, quantization_config=BitsAndBytesConfig(**QUANTIZATIONS[quantization]), device_map="cpu"
        )
        if kbit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if not lora:
            return model
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS, use_dora=dora))


@contextmanager
def quiet_bitsandbytes() -> Iterator[None]:
    """bitsandbytes warns about its optional CPU kernels and dtype casts on every import and call."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters as they are stored, bitsandbytes' quantization state included (each
    tensor once: the nested code book is shared between weights)."""
    tensors: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        tensors[id(param)] = param
        state = param.__dict__.get("quant_state")
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    tensors[id(value)] = value
            state = getattr(state, "state2", None)
        scb = param.__dict__.get("SCB")
        if isinstance(scb, torch.Tensor):
            tensors[id(scb)] = scb
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that train (the LoRA adapters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def step_peaks(model: torch.nn.Module, estimate: Any, batch: Any) -> tuple[int, int]:
    """``(predicted, measured)`` peak bytes of two real AdamW steps of ``model``'s adapters on the CPU, beyond the
    weights and buffers (the model exists before the measurement, so its weights are not in the measured peak)."""
    from harness.accuracy.reference import profiled_cpu_peak
    from memfit import Category

    at_peak = next(p for p in estimate.phases if p.allocated_bytes == estimate.peak_allocated_bytes)
    static_bytes = at_peak.breakdown[Category.PARAMETERS] + at_peak.breakdown[Category.BUFFERS]
    model.train()  # as the trace (and every trainer) runs it; from_pretrained returns the model in eval mode
    adapters = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        inputs = batch()
        optimizer = torch.optim.AdamW(adapters)
        for _ in range(2):
            loss = model(**inputs).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()

    return estimate.peak_allocated_bytes - static_bytes, profiled_cpu_peak(run)
