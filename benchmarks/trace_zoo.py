"""Predicted peak memory for a small zoo of training configurations, and measured peaks on a GPU.

    python benchmarks/trace_zoo.py              # predictions only (any machine)
    python benchmarks/trace_zoo.py --measure    # also run each config for real on the visible GPU

Without a GPU it prints, per config, the trace time and the predicted allocated / reserved /
device peaks for a CUDA target. With ``--measure`` (needs CUDA) each config also runs three real
training steps in a fresh process and records ``torch.cuda.max_memory_allocated``,
``max_memory_reserved`` and NVML's used memory, side by side with the prediction. Raw results go
to ``benchmarks/results/trace_zoo-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import memfit
from memfit.run.measure import nvml_device_used_bytes
from memfit.tracing.checkpointing import enable_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo
from harness.accuracy import reference
from harness.accuracy.run import child_answer

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    name: str
    build: Callable[[], torch.nn.Module]
    sample: Callable[[int], Any]
    batch_size: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    checkpointing: bool = False
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    forward_fn: Callable[[torch.nn.Module, Any], Any] | None = None


def _tokens(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    def make(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids}

    return make


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config())


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig())


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(num_labels=1000))


def _llama_1b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):  # never materialised on CPU; --measure builds it on the GPU
        return LlamaForCausalLM(config)


def _images(batch: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch, 3, 224, 224), "labels": torch.zeros(batch, dtype=torch.long)}


def _xent(output: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


CONFIGS = [
    Config("gpt2-124m s1024 fp32 adamw", _gpt2, _tokens(50257, 1024), 8),
    Config("gpt2-124m s1024 bf16-mixed adamw", _gpt2, _tokens(50257, 1024), 8, "bf16-mixed"),
    Config(
        "gpt2-124m s1024 bf16-mixed adamw ckpt",
        _gpt2,
        _tokens(50257, 1024),
        8,
        "bf16-mixed",
        checkpointing=True,
    ),
    Config("bert-base s512 fp32 adamw", _bert, _tokens(30522, 512), 16),
    Config("vit-base 224 16-mixed sgd-momentum", _vit, _images, 32, "16-mixed", "sgd-momentum"),
    Config("llama-1b s2048 bf16-mixed adamw", _llama_1b, _tokens(32000, 2048), 2, "bf16-mixed"),
    Config(
        "resnet-style 64x64 fp32 sgd-momentum",
        lambda: zoo.SmallResNet(channels=64, blocks=8, classes=100),
        lambda b: (torch.randn(b, 3, 64, 64), torch.zeros(b, dtype=torch.long)),
        64,
        optimizer="sgd-momentum",
        loss_fn=_xent,
        forward_fn=lambda model, batch: model(batch[0]),
    ),
    Config(
        "lstm 2x512 s128 fp32 adamw",
        lambda: zoo.LSTMClassifier(vocab=10000, hidden=512, layers=2, classes=10),
        lambda b: (torch.randint(0, 10000, (b, 128)), torch.zeros(b, dtype=torch.long)),
        32,
        loss_fn=_xent,
        forward_fn=lambda model, batch: model(batch[0]),
    ),
]


def predict(config: Config) -> dict[str, Any]:
    torch.manual_seed(0)
    model = config.build()
    started = time.perf_counter()
    estimate = memfit.estimate(
        model,
        config.sample,
        batch_size=config.batch_size,
        optimizer=config.optimizer,
        precision=config.precision,
        gradient_checkpointing=config.checkpointing,
        loss_fn=config.loss_fn,
        forward_fn=config.forward_fn,
        target=memfit.Target("cuda"),
    )
    return {
        "config": config.name,
        "estimate_seconds": round(time.perf_counter() - started, 3),
        **{
            f"predicted_{k}": v
            for k, v in estimate.to_dict().items()
            if k.endswith("_bytes") and k != "breakdown_bytes"
        },
        "predicted_breakdown_bytes": estimate.to_dict()["breakdown_bytes"],
        "peak_phase": f"step {estimate.peak_step} {estimate.peak_phase.value}",
    }


def measure(config: Config, steps: int = 3) -> dict[str, Any]:
    """Run ``steps`` real training steps on the GPU; this process must be fresh (one config each)."""
    device = torch.device("cuda")
    nvml_before = _nvml_used()
    torch.manual_seed(0)
    model = config.build()
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device=device)
    model = model.to(device)
    if config.precision in ("bf16", "bf16-true"):
        model = model.to(torch.bfloat16)
    if config.checkpointing:
        enable_checkpointing(model)  # the model's own switch, non-reentrant, under whichever name transformers uses
    model.train()
    optimizer = {
        "adamw": lambda: torch.optim.AdamW(model.parameters()),
        "sgd-momentum": lambda: torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
    }[config.optimizer]()
    batch = _to(config.sample(config.batch_size), device)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(config.precision)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None)

    def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        output = config.forward_fn(model, batch) if config.forward_fn else model(**batch)
        return config.loss_fn(output, batch) if config.loss_fn else output.loss

    reference.run_steps(model, optimizer, batch, loss_of, steps=steps, autocast=autocast)
    torch.cuda.synchronize()
    return {
        "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "measured_nvml_used_bytes": _nvml_used(),
        "nvml_used_before_bytes": nvml_before,
    }


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def _nvml_used() -> int | None:
    return nvml_device_used_bytes(torch.cuda.current_device())


def _error(predicted: int, measured: int | None) -> str:
    if not measured:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="also measure each config on the visible GPU")
    parser.add_argument("--only", help="run the configs whose name contains this text (results are not written)")
    parser.add_argument("--measure-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        config = next(c for c in CONFIGS if c.name == args.measure_one)
        print(json.dumps(measure(config)))
        return
    if args.measure and not torch.cuda.is_available():
        parser.error("--measure needs a CUDA GPU; without one, run without --measure for predictions only")
    configs = [c for c in CONFIGS if not args.only or args.only in c.name]
    rows = []
    for config in configs:
        row = predict(config)
        if args.measure:
            row.update(child_answer([sys.executable, __file__, "--measure-one", config.name]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if args.measure else "cpu-only (predictions for a CUDA target)"
    _show(rows, device)
    if args.only:
        return  # a subset: shown, not written over the full results
    RESULTS.mkdir(exist_ok=True)
    tag = "gpu" if args.measure else "cpu"
    path = RESULTS / f"trace_zoo-{tag}.json"
    meta = {
        "device": device,
        "torch": torch.__version__,
        "memfit": memfit.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


def _show(rows: list[dict[str, Any]], device: str) -> None:
    fmt = memfit.format_bytes
    table = Table(title=f"memfit trace zoo on {device}")
    for column in ("config", "estimate s", "pred. allocated", "pred. reserved", "pred. device", "peak in"):
        table.add_column(column, justify="left" if column in ("config", "peak in") else "right")
    measured = any("measured_peak_reserved_bytes" in r for r in rows)
    if measured:
        for column in ("meas. allocated", "err", "meas. reserved", "err", "NVML used"):
            table.add_column(column, justify="right")
    for r in rows:
        cells = [
            r["config"],
            f"{r['estimate_seconds']:.2f}",
            fmt(r["predicted_peak_allocated_bytes"]),
            fmt(r["predicted_peak_reserved_bytes"]),
            fmt(r["predicted_peak_bytes"]),
            r["peak_phase"],
        ]
        if measured:
            ma, mr = r.get("measured_peak_allocated_bytes"), r.get("measured_peak_reserved_bytes")
            cells += [
                fmt(ma),
                _error(r["predicted_peak_allocated_bytes"], ma),
                fmt(mr),
                _error(r["predicted_peak_reserved_bytes"], mr),
                fmt(r.get("measured_nvml_used_bytes")),
            ]
        table.add_row(*cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
