"""The accuracy zoo: model families x precision x optimizer x checkpointing x batch size.

Every model is built from a config with random weights (nothing is downloaded). ``size="cpu"``
builds tiny versions that a 2-core machine trains in seconds; ``size="gpu"`` builds the sizes the
GPU harness measures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import zoo as test_models

Batch = Callable[[int], Any]


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[str], nn.Module]
    batch: Callable[[str], Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    forward_fn: Callable[[nn.Module, Any], Any] | None = None
    checkpointable: bool = True
    gpu_batches: tuple[int, int] = (8, 16)  # the smaller and larger base batch at GPU size (each run at x1 and x2)


@dataclass(frozen=True)
class Config:
    family: Family
    precision: str
    optimizer: str
    checkpointing: bool
    batch_size: int

    @property
    def name(self) -> str:
        ckpt = " ckpt" if self.checkpointing else ""
        return f"{self.family.name} {self.precision} {self.optimizer}{ckpt} b{self.batch_size}"


def _tokens(vocab: int, seq: int) -> Batch:
    def make(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch))
        return {"input_ids": ids, "labels": ids}

    return make


def _classify(vocab: int, seq: int, classes: int) -> Batch:
    def make(batch: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, vocab, (batch, seq), generator=generator)
        return {"input_ids": ids, "labels": torch.randint(0, classes, (batch,), generator=generator)}

    return make


def _gpt2(size: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "gpu":
        return GPT2LMHeadModel(GPT2Config(loss_type="ForCausalLM"))
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, loss_type="ForCausalLM")
    )


def _bert(size: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    if size == "gpu":
        return BertForSequenceClassification(BertConfig(num_labels=4))
    config = BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000, num_labels=4
    )
    return BertForSequenceClassification(config)


def _t5(size: str) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    if size == "gpu":
        return T5ForConditionalGeneration(
            T5Config(
                d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, decoder_start_token_id=0, pad_token_id=0
            )
        )
    config = T5Config(
        d_model=64,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        d_kv=16,
        vocab_size=1000,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def _llama(size: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == "gpu":
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip
    else:
        config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (the LoRA recipe, no peft needed)."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _llama_lora(size: str) -> nn.Module:
    model = _llama(size).requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def _vit(size: str) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    if size == "gpu":
        return ViTForImageClassification(ViTConfig(num_labels=1000))
    config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, num_labels=10)  # fmt: skip
    return ViTForImageClassification(config)


def _images(size: str, key_value: bool = True) -> Batch:
    side = 224 if size == "gpu" else 32

    def make(batch: int) -> Any:
        generator = torch.Generator().manual_seed(batch)
        pixels = torch.randn(batch, 3, side, side, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
        return {"pixel_values": pixels, "labels": labels} if key_value else (pixels, labels)

    return make


def _xent(output: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def _first(model: nn.Module, batch: Any) -> Any:
    return model(batch[0])


FAMILIES = [
    Family(
        "resnet-bn",
        lambda size: test_models.SmallResNet(channels=64 if size == "gpu" else 16, blocks=8 if size == "gpu" else 2),
        lambda size: lambda b: _images(size, key_value=False)(b),
        loss_fn=_xent,
        forward_fn=_first,
    ),
    Family("vit", _vit, lambda size: _images(size)),
    Family("gpt2", _gpt2, lambda size: _tokens(50257 if size == "gpu" else 1000, 1024 if size == "gpu" else 64)),
    Family("bert", _bert, lambda size: _classify(30522 if size == "gpu" else 1000, 512 if size == "gpu" else 64, 4)),
    Family("t5", _t5, lambda size: _tokens(32128 if size == "gpu" else 1000, 512 if size == "gpu" else 32)),
    # a 1B model at sequence 2048: batches of 16 and 32 are predicted above an 80 GB card
    Family(
        "llama",
        _llama,
        lambda size: _tokens(32000 if size == "gpu" else 1000, 2048 if size == "gpu" else 64),
        gpu_batches=(2, 4),
    ),
    Family(
        "llama-lora",
        _llama_lora,
        lambda size: _tokens(32000 if size == "gpu" else 1000, 2048 if size == "gpu" else 64),
        gpu_batches=(2, 4),
    ),
    Family(
        "lstm",
        lambda size: test_models.LSTMClassifier(
            vocab=10000 if size == "gpu" else 500, hidden=1024 if size == "gpu" else 64, layers=2
        ),
        lambda size: (
            lambda b: (torch.randint(0, 500, (b, 128 if size == "gpu" else 16)), torch.zeros(b, dtype=torch.long))
        ),
        loss_fn=_xent,
        forward_fn=_first,
        checkpointable=False,
    ),
]


RESNET50 = Family(
    "resnet50",
    lambda size: test_models.ResNet50(width=64 if size == "gpu" else 8, classes=1000 if size == "gpu" else 10),
    lambda size: lambda b: _images(size, key_value=False)(b),
    loss_fn=_xent,
    forward_fn=_first,
    gpu_batches=(64, 128),
)
"""torchvision's ResNet-50 at 224 px: the convnet of the out-of-memory boundary checks (not one of the zoo's eight)."""


def family(name: str) -> Family:
    """A zoo family, or ``resnet50``, by name."""
    for candidate in (*FAMILIES, RESNET50):
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def configs(size: str = "cpu") -> list[Config]:
    """Three configurations per family (24 in all), each at two batch sizes on GPU."""
    out = []
    for family in FAMILIES:
        small, large = (2, 4) if size == "cpu" else family.gpu_batches
        out.append(Config(family, "fp32", "adamw", False, small))
        out.append(Config(family, "bf16-mixed", "sgd-momentum", family.checkpointable, large))
        out.append(Config(family, "16-mixed", "adamw-fused", False, small if size == "cpu" else large))
    return out
