"""LoRA and DoRA on a 3B-class Llama: memfit's prediction beside the measured CUDA peak.

    python benchmarks/lora_gpu.py            # every configuration (needs a CUDA GPU with ~60 GB)
    python benchmarks/lora_gpu.py --only dora

The model is a Llama 3.2 3B-shaped ``LlamaForCausalLM`` with random bf16 weights (nothing is
downloaded), trained without autocast at batch 4, sequence 768, with ``torch.optim.AdamW``. peft
keeps its adapters in fp32 (``autocast_adapter_dtype=True``, its default). memfit predicts from the
same model built on ``meta``; each measurement runs two real steps in a fresh process and reads
``torch.cuda.max_memory_allocated/reserved``. Raw rows go to ``benchmarks/results/lora-gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import memfit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/
from harness.accuracy import reference
from harness.accuracy.lora_llama import BATCH, CONFIGS, SEQUENCE, batch, build
from harness.accuracy.run import child_answer

RESULTS = Path(__file__).resolve().parent / "results"


def predict(name: str) -> dict[str, Any]:
    model = build(name, "meta")
    started = time.perf_counter()
    estimate = memfit.estimate(
        model, batch, batch_size=BATCH, optimizer="adamw", precision="fp32", target=memfit.Target("cuda")
    )
    data = estimate.to_dict()
    return {
        "estimate_seconds": round(time.perf_counter() - started, 3),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "predicted_peak_allocated_bytes": data["peak_allocated_bytes"],
        "predicted_peak_reserved_bytes": data["peak_reserved_bytes"],
        "predicted_breakdown_bytes": data["breakdown_bytes"],
        "peak_phase": f"step {estimate.peak_step} {estimate.peak_phase.value}",
    }


def measure(name: str, steps: int = 2) -> dict[str, Any]:
    model = build(name, "cuda").train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    inputs = {k: v.cuda() for k, v in batch(BATCH).items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reference.run_steps(model, optimizer, inputs, lambda m, b: m(**b).loss, steps=steps)
    torch.cuda.synchronize()
    return {
        "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="the configurations whose name contains this text")
    parser.add_argument("--measure-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        print(json.dumps(measure(args.measure_one)))
        return
    rows = []
    for name in [n for n in CONFIGS if not args.only or args.only in n]:
        row: dict[str, Any] = {"config": name}
        try:
            row.update(predict(name))
        except Exception as error:  # a failed prediction is a result too
            row["prediction_error"] = f"{type(error).__name__}: {error}"
        row.update(child_answer([sys.executable, __file__, "--measure-one", name]))
        for kind in ("allocated", "reserved"):
            predicted, measured = row.get(f"predicted_peak_{kind}_bytes"), row.get(f"measured_peak_{kind}_bytes")
            if predicted and measured:
                row[f"{kind}_error_pct"] = round(100 * (predicted - measured) / measured, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        RESULTS.mkdir(exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
            "torch": torch.__version__,
            "memfit": memfit.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "batch": BATCH,
            "sequence": SEQUENCE,
        }
        (RESULTS / "lora-gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(f"{row['config']:24} allocated {row.get('allocated_error_pct', '-'):>8}%  "
              f"reserved {row.get('reserved_error_pct', '-'):>8}%")  # fmt: skip


if __name__ == "__main__":
    main()
