"""LoRA and DoRA on a Llama 3.2 3B-shaped model: the configurations ``benchmarks/lora_gpu.py`` measures.

The model is a ``LlamaForCausalLM`` with random bf16 weights (nothing is downloaded), trained without autocast at
batch 4, sequence 768, with ``torch.optim.AdamW``; peft keeps its adapters in fp32 (``autocast_adapter_dtype=True``,
its default).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BATCH", "CONFIGS", "SEQUENCE", "VOCAB", "batch", "build"]

BATCH, SEQUENCE, VOCAB = 4, 768, 128256
CONFIGS: dict[str, dict[str, Any] | None] = {
    "full fine-tuning": None,
    "lora r16 q,v": {"r": 16, "target_modules": ["q_proj", "v_proj"]},
    "lora r16 gate,up,down": {"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "lora r64 all linear": {"r": 64, "target_modules": "all-linear"},
    "dora r16 q,v": {"r": 16, "target_modules": ["q_proj", "v_proj"], "use_dora": True},
}


def build(name: str, device: str) -> torch.nn.Module:
    """The model of configuration ``name`` on ``device`` (``"meta"`` to plan it without memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    adapter = CONFIGS[name]
    if adapter is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(lora_alpha=2 * adapter["r"], lora_dropout=0.0, **adapter))
    return model


def batch(size: int) -> dict[str, torch.Tensor]:
    """Token ids of ``size`` samples of ``SEQUENCE`` tokens, their own labels."""
    ids = torch.randint(1, VOCAB, (size, SEQUENCE), generator=torch.Generator().manual_seed(size))
    return {"input_ids": ids, "labels": ids}
