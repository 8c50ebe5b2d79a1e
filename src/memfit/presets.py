"""Well-known public architectures, built on the ``meta`` device from their published configs.

No weights are ever materialised or downloaded: the config values below are the published
architecture facts (layers, widths, heads, vocabulary), and the model is built under
``torch.device("meta")`` so a 8B model costs no memory. Each preset also knows what a batch of
it looks like (token ids, or images).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import InvalidInputError

__all__ = ["PRESETS", "ModelSpec", "from_factory", "from_hf_config"]

Batch = Callable[[int], Any]


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan and how to make a batch of it."""

    name: str
    model: nn.Module
    sample: Batch


# name -> (transformers config class, its published arguments, task)
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", {}, "causal-lm"),
    "bert-base": ("BertConfig", {}, "masked-lm"),
    "t5-base": ("T5Config", {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64,
                             "vocab_size": 32128, "decoder_start_token_id": 0, "pad_token_id": 0}, "seq2seq-lm"),
    "llama-3-8b": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                   "max_position_embeddings": 8192, "rope_theta": 500000.0}, "causal-lm"),
    "mistral-7b": ("MistralConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
                                     "max_position_embeddings": 32768, "sliding_window": None}, "causal-lm"),
    "qwen2.5-7b": ("Qwen2Config", {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                                   "max_position_embeddings": 32768, "tie_word_embeddings": False}, "causal-lm"),
    "vit-base": ("ViTConfig", {}, "image-classification"),
}  # fmt: skip

_TASK_MODELS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}


def from_hf_config(
    name_or_path: str, *, seq_len: int = 1024, image_size: int | None = None, layers: int | None = None
) -> ModelSpec:
    """A preset name (``llama-3-8b``) or a local ``config.json`` (or a folder holding one)."""
    transformers = _transformers()
    key = name_or_path.lower()
    if key in PRESETS:
        class_name, arguments, task = PRESETS[key]
        config = getattr(transformers, class_name)(**arguments)
    else:
        path = Path(name_or_path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise InvalidInputError(
                f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file; "
                "memfit never downloads configs"
            )
        raw = json.loads(path.read_text())
        if "model_type" not in raw:
            raise InvalidInputError(f"{path} has no model_type; is it a transformers config.json?")
        config = transformers.AutoConfig.for_model(**raw)
        task = _task_of(config)
    if layers is not None:
        _set_depth(config, layers)
    if image_size is not None and hasattr(config, "image_size"):
        config.image_size = image_size
    with torch.device("meta"):
        model = getattr(transformers, _TASK_MODELS[task]).from_config(config)
    return ModelSpec(name_or_path, model, _sample_for(task, config, seq_len, image_size))


def from_factory(target: str, *, seq_len: int = 1024) -> ModelSpec:
    """``module.path:factory`` from the user's code: ``factory()`` returns a module, or a
    ``(module, sample)`` pair where ``sample(batch_size)`` makes one batch; a bare module gets
    ``input_ids``/``labels`` token batches of ``seq_len``."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise InvalidInputError(f"--model must look like 'package.module:factory', got {target!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise InvalidInputError(f"cannot load {target!r}: {error}") from error
    made = factory()
    model, sample = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"{target} returned {type(model).__name__}, not a torch.nn.Module")
    if sample is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 1000)
        sample = _tokens(vocab, seq_len)
    return ModelSpec(target, model, sample)


def _task_of(config: Any) -> str:
    transformers = _transformers()
    for task, auto in _TASK_MODELS.items():
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            return task
    raise InvalidInputError(
        f"no causal-LM, masked-LM, seq2seq or image-classification head for {type(config).__name__}"
    )


def _set_depth(config: Any, layers: int) -> None:
    for attribute in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, attribute):
            setattr(config, attribute, layers)
    if hasattr(config, "num_decoder_layers"):
        config.num_decoder_layers = layers


def _tokens(vocab: int, seq_len: int) -> Batch:
    def make(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long)  # values never matter to a fake-tensor trace
        return {"input_ids": ids, "labels": ids}

    return make


def _sample_for(task: str, config: Any, seq_len: int, image_size: int | None) -> Batch:
    if task == "image-classification":
        side = image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        return lambda batch: {
            "pixel_values": torch.zeros(batch, channels, side, side),
            "labels": torch.zeros(batch, dtype=torch.long),
        }
    return _tokens(config.vocab_size, seq_len)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise InvalidInputError("--hf-config needs transformers: pip install 'memfit[hf]'") from error
    return transformers
