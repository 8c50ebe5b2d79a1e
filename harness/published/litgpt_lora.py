"""LoRA fine-tuning in litgpt, as its resource tables measured it.

Source: Lightning-AI/litgpt ``tutorials/resource-tables.md`` (updated 10/20/2023, lit-gpt commit 8641822,
A100-SXM4-40GB, PyTorch 2.1.0+cu121, bitsandbytes 0.41.1): ``finetune/lora.py`` with
``--precision bf16-true``, Alpaca, a global batch of 128. The figure is what the script prints at the end,
``torch.cuda.max_memory_allocated() / 1e9`` ("GB").

The configuration is the script's of that commit (``finetune/lora.py``): ``lora_r=8, lora_alpha=16,
lora_dropout=0.05`` on the query and value projections only (the trainable counts of the table, such as
4,194,304 for Llama 2 7B, confirm it), ``torch.optim.AdamW(lr=3e-4, weight_decay=0.01)`` over the LoRA
weights (torch 2.1 picks ``foreach`` on CUDA), the whole model in bf16 (Fabric's ``bf16-true`` builds it
under ``init_module``), gradient accumulation to 128, and every micro batch padded to its longest
sample, the first one holding the longest of the data set (1304 tokens with Llama 2's tokenizer, 1044
with phi-1.5's; the table states both). The step is ``model(input_ids, lm_head_chunk_size=128)`` then
``chunked_cross_entropy`` on the shifted targets.

memfit traces litgpt's own ``GPT`` (``litgpt.lora``) built from ``Config.from_name`` on ``meta``: today's
litgpt, not the 2023 ``lit_gpt`` package, so these rows are "today's model code". What they leave out: the
``validate()`` the script runs before training (forward-only, with a KV cache for one generated
sample) also counts in ``max_memory_allocated``; memfit predicts the training step.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from harness.published.rows import GB, Prediction, Row, estimate_details

SOURCE = 'Lightning-AI/litgpt tutorials/resource-tables.md ("Finetuning with LoRA on 1 GPU", 10/20/2023)'
SOFTWARE = "lit-gpt 8641822, torch 2.1.0+cu121, bitsandbytes 0.41.1, A100-SXM4-40GB"
GLOBAL_BATCH = 128
HOW_2023 = (
    "lit_gpt of commit 8641822 itself (its lit_gpt.lora GPT on meta, PYTHONPATH to a checkout of that commit) with "
    "its finetune/lora.py settings: LoRA r 8, alpha 16, dropout 0.05 on query and value, bf16-true, torch AdamW "
    "(foreach, as torch 2.1 picks on CUDA), lm_head_chunk_size=128 + chunked_cross_entropy, accumulation to 128; "
    "the validate() before training is not modelled"
)
HOW = (
    "today's litgpt GPT (litgpt.lora) on meta with the 2023 script's LoRA settings (r 8, alpha 16, dropout 0.05, "
    "query and value), bf16-true, torch AdamW (foreach), lm_head_chunk_size=128 + chunked_cross_entropy, "
    "accumulation to 128; the validate() before training is not modelled"
)


def _import(package: str) -> tuple[Any, Any, Any, Any]:
    """``GPT, Config, mark_only_lora_as_trainable, chunked_cross_entropy`` of litgpt, or of lit_gpt (2023)."""
    lora = importlib.import_module(f"{package}.lora")
    utils = importlib.import_module(f"{package}.utils")
    return lora.GPT, lora.Config, lora.mark_only_lora_as_trainable, utils.chunked_cross_entropy


def _lora_settings(package: str) -> dict[str, Any]:
    """The 2023 script's LoRA settings, in the names each package's ``Config`` takes."""
    settings = {"r": 8, "alpha": 16, "dropout": 0.05, "query": True, "key": False, "value": True,
                "projection": False, "mlp": False, "head": False}  # fmt: skip
    if package == "lit_gpt":  # Config(r=, alpha=, dropout=, to_query=, ...)
        return {key if key in ("r", "alpha", "dropout") else f"to_{key}": value for key, value in settings.items()}
    return {f"lora_{key}": value for key, value in settings.items()}


NF4_DEPTHS = (2, 4)
HOW_NF4 = (
    "lit_gpt of commit 8641822 with Fabric 2.1's BitsandbytesPrecision('nf4', bf16) reproduced: every nn.Linear "
    "(LoRA bases and LM head included) a bitsandbytes Linear4bit, nf4, no double quantization, blocksize 64, "
    "compute in bf16, quantized from random bf16 weights on the CPU; the rest bf16; bitsandbytes' MatMul4Bit "
    "keeping its input activation for backward, as its 2023 release did (ctx.tensors = (A, B); today's keeps "
    "(None, B)). Quantizing needs real weights, so memfit traced 2 and 4 blocks and extrapolated linearly to the "
    "full depth (the peak grows by the same bytes per block). torch AdamW stands for bnb PagedAdamW (its state is "
    "in managed memory, not in max_memory_allocated: the LoRA state, ~17 MB, is counted here and was not there)"
)


def _nf4_model(gpt: Any, config: Any) -> torch.nn.Module:
    """``gpt(config)`` with real bf16 weights on the CPU and every ``nn.Linear`` replaced by an nf4 ``Linear4bit``,
    as Lightning 2.1's ``BitsandbytesPrecision("nf4", torch.bfloat16)`` replaced them (``_NF4Linear``: nf4, no
    double quantization) before quantizing them on the GPU."""
    import bitsandbytes as bnb

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # Fabric's init_module under bf16
    try:
        model = gpt(config)
    finally:
        torch.set_default_dtype(previous)

    def convert(module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            if not isinstance(child, torch.nn.Linear):
                convert(child)
                continue
            linear = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None, compute_dtype=torch.bfloat16,
                compress_statistics=False, quant_type="nf4", device="meta",
            )  # fmt: skip
            linear.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, compress_statistics=False, quant_type="nf4"
            )
            if child.bias is not None:
                linear.bias = child.bias
            setattr(module, child_name, linear.to("cpu"))  # quantizes

    convert(model)
    return model


@contextlib.contextmanager
def _matmul_4bit_keeping_its_input() -> Iterator[None]:
    """bitsandbytes' ``MatMul4Bit`` as of 2023 (0.41): its forward kept ``ctx.tensors = (A, B)``, the input
    activation of every 4-bit linear alive until backward, though only ``B`` is read there; today's keeps
    ``(None, B)``. Patched for the trace of the 2023 run only, and restored."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = original(ctx, A, B, *args, **kwargs)
        if getattr(ctx, "tensors", (None, None))[1] is not None:
            ctx.tensors = (A, ctx.tensors[1])
        return output

    MatMul4Bit.forward = staticmethod(forward)
    try:
        yield
    finally:
        MatMul4Bit.forward = staticmethod(original)


def _predictor(package: str, name: str, batch: int, sequence: int, quantize: str | None) -> Any:
    def predict(layers: int | None) -> Prediction:
        import memfit

        try:
            GPT, Config, mark_only_lora_as_trainable, chunked_cross_entropy = _import(package)
        except ImportError as error:  # the runner skips the row before calling this; said here too
            return Prediction(None, (f"{package} is not importable ({error})",))
        if quantize is not None and package != "lit_gpt":
            return Prediction(
                None,
                (
                    "not predicted with today's litgpt (its nf4 path also swaps in bitsandbytes' StableEmbedding); "
                    "the lit-gpt 2023 row predicts the published software's nf4 run",
                ),
            )

        def forward(module: torch.nn.Module, batch_: dict[str, torch.Tensor]) -> Any:
            return module(batch_["input_ids"], lm_head_chunk_size=128)

        def loss(logits: Any, batch_: dict[str, torch.Tensor]) -> torch.Tensor:
            logits[-1] = logits[-1][..., :-1, :]
            return chunked_cross_entropy(logits, batch_["targets"][..., 1:])

        def trace(depth: int | None, quantized: bool) -> tuple[Any, int]:
            overrides = {"n_layer": depth} if depth else {}
            config = Config.from_name(name, **_lora_settings(package), **overrides)
            if quantized:
                model = _nf4_model(GPT, config)  # real bf16 weights on the CPU, quantized as Fabric did on the GPU
            else:
                with torch.device("meta"):
                    model = GPT(config)
            mark_only_lora_as_trainable(model)
            model.max_seq_length = sequence  # the script sets the longest sequence of the data
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            sample = {
                "input_ids": torch.randint(0, config.vocab_size, (batch, sequence)),
                "targets": torch.randint(0, config.vocab_size, (batch, sequence)),
            }
            with _matmul_4bit_keeping_its_input() if quantized else contextlib.nullcontext():
                estimate = memfit.estimate(
                    model, sample, optimizer="adamw", optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.01},
                    precision="fp32" if quantized else "bf16-true",  # quantized: the model's own dtypes, as built
                    forward_fn=forward, loss_fn=loss,
                    loop=memfit.TrainingLoop(accumulation_steps=GLOBAL_BATCH // batch),
                    target=memfit.Target(runtime=memfit.CudaRuntime(compute_capability=(8, 0))),
                )  # fmt: skip
            return estimate, trainable

        if quantize is None:
            estimate, trainable = trace(layers, quantized=False)
            return Prediction(
                estimate.peak_allocated_bytes,
                (HOW_2023 if package == "lit_gpt" else HOW,),
                {"trainable_parameters": trainable, **estimate_details(estimate)},
            )
        # nf4: quantizing means real weights, so the whole depth is extrapolated from two shallow models
        if layers:
            estimate, trainable = trace(layers, quantized=True)
            return Prediction(estimate.peak_allocated_bytes, (HOW_NF4,), {"trainable_parameters": trainable})
        depth = Config.from_name(name).n_layer
        shallow, _ = trace(NF4_DEPTHS[0], quantized=True)
        deeper, _ = trace(NF4_DEPTHS[1], quantized=True)
        per_block = (deeper.peak_allocated_bytes - shallow.peak_allocated_bytes) / (NF4_DEPTHS[1] - NF4_DEPTHS[0])
        predicted = round(shallow.peak_allocated_bytes + per_block * (depth - NF4_DEPTHS[0]))
        return Prediction(
            predicted,
            (HOW_NF4,),
            {
                "extrapolated_from": {
                    f"{NF4_DEPTHS[0]} blocks": shallow.peak_allocated_bytes,
                    f"{NF4_DEPTHS[1]} blocks": deeper.peak_allocated_bytes,
                },
                "peak_phase": f"step {deeper.peak_step} {deeper.peak_phase.value}",
            },
        )

    return predict


def _row(
    package: str, model: str, name: str, batch: int, sequence: int, published: float, quantize: str | None = None
) -> Row:
    quantized = f", {quantize}" if quantize else ""
    prefix = "lit-gpt 2023" if package == "lit_gpt" else "litgpt today"
    return Row(
        id=f"{prefix} {model} b{batch}{quantized.replace(', ', ' ')}",
        source=SOURCE,
        configuration=(
            f"{model} ({name}) LoRA r=8 on query+value, bf16-true{quantized}, micro batch {batch}, seq {sequence}, "
            f"global batch {GLOBAL_BATCH}"
        ),
        published=published,
        unit="GB",
        unit_bytes=GB,
        quantity="max_memory_allocated",
        software=SOFTWARE,
        section="reproduced" if package == "lit_gpt" else "today",
        requires=package,
        predict=_predictor(package, name, batch, sequence, quantize),
    )


def _rows(package: str) -> list[Row]:
    return [
        _row(package, "phi-1.5", "phi-1_5", 1, 1044, 4.82),
        _row(package, "phi-1.5", "phi-1_5", 2, 1044, 6.76),
        _row(package, "phi-1.5", "phi-1_5", 4, 1044, 10.68),
        _row(package, "Llama-2-7B", "Llama-2-7b-hf", 1, 1304, 21.30),
        _row(package, "Llama-2-7B", "Llama-2-7b-hf", 2, 1304, 29.07),
        _row(package, "Llama-2-7B", "Llama-2-7b-hf", 1, 1304, 14.14, quantize="bnb.nf4"),
        _row(package, "Llama-2-13B", "Llama-2-13b-hf", 1, 1304, 38.12),
    ]


# the 2023 package itself first (reproduced software), then today's litgpt with the same configuration
ROWS = [*_rows("lit_gpt"), *_rows("litgpt")]
