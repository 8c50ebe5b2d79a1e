"""bert-large-uncased sequence classification in the Hugging Face Trainer, as the transformers docs measured it.

Source: the "Efficient Training on a Single GPU" page of January 2022 (kept as
``docs/source/zh/perf_train_gpu_one.md`` in huggingface/transformers; the fp32 batch-4 run is also the
example of "Model training anatomy", ``docs/source/en/model_memory_anatomy.md``). 512 random sequences
of 512 token ids, binary labels, ``TrainingArguments(num_train_epochs=1, ...)``, a Tesla V100-SXM2 16 GB
(driver 460.91, CUDA 11.2). The figure is NVML's used memory after ``trainer.train()`` (``used // 1024**2``,
printed "MB"); the page measured the CUDA context alone as 1343 MB (``torch.ones((1, 1)).to("cuda")``).

How the 2022 software is reproduced (transformers ~4.15, torch ~1.10):

* attention: ``attn_implementation="eager"`` (BERT had no other path then): the s x s scores, softmax
  and dropout mask are kept per layer;
* optimizer: the Trainer's default ``adamw_hf`` was transformers' own AdamW, a Python loop over the
  parameters; torch's ``AdamW(foreach=False)`` runs the same per-parameter loop (one parameter-sized
  temporary for the denominator, where transformers' took one too). ``optim="adafactor"`` is
  ``transformers.optimization.Adafactor(scale_parameter=False, relative_step=False)``, as the Trainer
  built it; 8-bit Adam is ``bitsandbytes`` 8-bit Adam (memfit's ``adam-8bit``);
* ``fp16=True`` was ``torch.cuda.amp`` autocast with a ``GradScaler`` on fp32 weights: memfit's
  ``16-mixed``;
* ``Trainer`` called ``model.zero_grad()``, which in torch < 2.0 zeroes gradients in place
  (``set_to_none=False``): they are never freed, so every forward runs with them alive
  (``TrainingLoop(zero_grad="in_place")``);
* gradient checkpointing: the model's own switch (``torch.utils.checkpoint`` per layer);
* NVML used after training is the caching allocator's reserve (which it never returns without
  ``empty_cache``) plus the context: memfit's reserved peak plus the 1343 MB measured there.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.published.rows import MB, Prediction, Row, estimate_details

SOURCE = (
    'huggingface/transformers docs/source/zh/perf_train_gpu_one.md ("Efficient Training on a Single GPU", '
    "2022); docs/source/en/model_memory_anatomy.md"
)
SOFTWARE = "transformers ~4.15 Trainer, torch ~1.10, Tesla V100-SXM2 16 GB, CUDA 11.2 (January 2022)"
CONTEXT_MB = 1343  # measured on that page: torch.ones((1, 1)).to("cuda"), then NVML used
SEQUENCE = 512

HOW = (
    "eager attention; torch AdamW(foreach=False) for transformers' per-parameter AdamW; fp16 = autocast + "
    "GradScaler on fp32 weights; zero_grad(set_to_none=False) as torch < 2.0 did; reserved + the 1343 MB "
    "context measured there"
)


def _model(layers: int | None) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    # bert-large-uncased's config.json; two labels (the Trainer's default for a classification head)
    config = BertConfig(
        vocab_size=30522, hidden_size=1024, num_hidden_layers=layers or 24, num_attention_heads=16,
        intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2, num_labels=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return BertForSequenceClassification(config)


def _optimizer(name: str) -> Any:
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return lambda params: Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)
    return "adam-8bit"


def _predictor(batch: int, accumulation: int, checkpointing: bool, fp16: bool, optimizer: str) -> Any:
    def predict(layers: int | None) -> Prediction:
        import memfit

        sample = {
            "input_ids": torch.randint(100, 30000, (batch, SEQUENCE)),
            "labels": torch.zeros(batch, dtype=torch.long),
        }
        runtime = memfit.CudaRuntime(cuda_context_bytes=CONTEXT_MB * MB, compute_capability=(7, 0))
        estimate = memfit.estimate(
            _model(layers), sample, optimizer=_optimizer(optimizer), precision="16-mixed" if fp16 else "fp32",
            gradient_checkpointing=checkpointing,
            loop=memfit.TrainingLoop(accumulation_steps=accumulation, zero_grad="in_place"),
            target=memfit.Target(runtime=runtime),
        )  # fmt: skip
        return Prediction(estimate.peak_bytes, (HOW,), estimate_details(estimate))

    return predict


def _row(key: str, published: int, batch: int, accumulation: int, checkpointing: bool, fp16: bool,
         optimizer: str) -> Row:  # fmt: skip
    parts = [f"batch {batch}"]
    if accumulation > 1:
        parts[0] += f" x {accumulation} accumulation"
    parts.append("fp16 (amp)" if fp16 else "fp32")
    parts.append({"adamw": "AdamW (adamw_hf)", "adafactor": "Adafactor", "adam-8bit": "bnb 8-bit Adam"}[optimizer])
    if checkpointing:
        parts.append("gradient checkpointing")
    return Row(
        id=f"bert-large {key}",
        source=SOURCE,
        configuration=f"bert-large-uncased classification, seq {SEQUENCE}, " + ", ".join(parts),
        published=published,
        unit="MB",
        unit_bytes=MB,
        quantity="nvml_used",
        software=SOFTWARE,
        section="reproduced",
        requires="transformers",
        predict=_predictor(batch, accumulation, checkpointing, fp16, optimizer),
    )


ROWS = [
    _row("b4 fp32", 14949, 4, 1, False, False, "adamw"),
    _row("b1x4 fp32", 8681, 1, 4, False, False, "adamw"),
    _row("b1x4 fp32 ckpt", 6775, 1, 4, True, False, "adamw"),
    _row("b4 fp16", 13939, 4, 1, False, True, "adamw"),
    _row("b1x4 fp16 ckpt", 7275, 1, 4, True, True, "adamw"),
    _row("b4 fp32 adafactor", 12295, 4, 1, False, False, "adafactor"),
    _row("b1x4 fp16 ckpt adafactor", 4847, 1, 4, True, True, "adafactor"),
    _row("b4 fp32 adam8bit", 13085, 4, 1, False, False, "adam-8bit"),
    _row("b1x4 fp16 ckpt adam8bit", 5363, 1, 4, True, True, "adam-8bit"),
]
