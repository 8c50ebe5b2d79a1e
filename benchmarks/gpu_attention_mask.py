"""What an attention mask costs on a real CUDA GPU: none, all ones, and with padding.

    python benchmarks/gpu_attention_mask.py CASE          # one case, its measured peaks as one JSON line
    python benchmarks/gpu_attention_mask.py --cases       # the case names

transformers skips an all-ones padding mask in eager SDPA (``masking_utils._ignore_causal_mask_sdpa``,
``_ignore_bidirectional_mask_sdpa``) and builds a (batch, 1, seq, seq) mask where a row is padded. Each case runs
three real training steps (forward and loss under autocast, backward, AdamW step, ``zero_grad``) of a small Llama
(bf16-mixed, batch 4, sequence 2048) or BERT classifier (fp32, batch 16, sequence 512) in a fresh process and
records the measured peaks. ``tests/test_known_masks.py`` holds memfit's no-GPU prediction of the same cases to
them. Models and samples are built here, with fixed seeds, so the test rebuilds them exactly.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import torch

CASES = [f"{model}-{mask}" for model in ("llama", "bert") for mask in ("none", "ones", "padded")]


def build(case: str, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """The case's model, sample and precision (the same on every machine: seeded)."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    family, mask = case.split("-")
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip
        model, batch, length, precision = LlamaForCausalLM(config), 4, 2048, "bf16-mixed"
    else:
        config = BertConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                            vocab_size=30522, max_position_embeddings=512)  # fmt: skip
        model, batch, length, precision = BertForSequenceClassification(config), 16, 512, "fp32"
    ids = torch.randint(0, config.vocab_size, (batch, length))
    labels = ids if family == "llama" else torch.zeros(batch, dtype=torch.long)
    sample: dict[str, torch.Tensor] = {"input_ids": ids, "labels": labels}
    if mask != "none":
        sample["attention_mask"] = torch.ones_like(ids)
        if mask == "padded":
            sample["attention_mask"][0, -length // 4 :] = 0
    model.config._attn_implementation = "sdpa"
    return model.to(device), {k: v.to(device) for k, v in sample.items()}, precision


def measure(case: str) -> dict[str, Any]:
    from harness.accuracy import reference

    model, sample, precision = build(case, "cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reference.run_steps(model, optimizer, sample, lambda m, b: m(**b).loss, steps=3, autocast=autocast)
    torch.cuda.synchronize()
    import transformers

    return {
        "case": case, "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--cases"]:
        print("\n".join(CASES))
    else:
        print(json.dumps(measure(sys.argv[1])))
