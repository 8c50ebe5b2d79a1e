"""bitsandbytes-quantized Llama with LoRA on the CPU: memfit's traced peak beside the measured one.

    python benchmarks/quantized_accuracy.py             # every configuration (a few minutes on 2 cores)
    python benchmarks/quantized_accuracy.py --only int8

A Llama of 4 layers (hidden 512, MLP 1376, vocabulary 2048, random weights, nothing downloaded) is
loaded with a ``BitsAndBytesConfig`` (nf4, fp4, each with and without double quantization, and
int8), with and without ``peft.prepare_model_for_kbit_training`` (fp32 norms and head, input
gradients), and a peft LoRA of rank 8 on q, v and up. memfit traces two training steps with
``torch.optim.AdamW`` on the adapters for ``memfit.Target("cpu")``; the same two steps then run for
real on the CPU (bitsandbytes' CPU kernels), and the CPU allocator's own reports to
``torch.profiler`` give the measured peak (``harness.accuracy.reference.profiled_cpu_peak``,
the yardstick of tests/test_quantized.py).

The model exists before the measurement, so the measured peak is what the step adds on top of the
weights; the predicted figure compared with it is memfit's peak less the parameters and buffers
alive at that peak. The total (weights included) is printed too. Raw rows go to
``benchmarks/results/quantized-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import memfit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/
sys.path.insert(0, str(ROOT / "tests"))  # the one builder of quantized test models
from quantized_models import (  # noqa: E402
    llama_config,
    quantized_llama,
    quiet_bitsandbytes,
    save_random_llama,
    step_peaks,
)

RESULTS = ROOT / "benchmarks" / "results" / "quantized-cpu.json"
BATCH, SEQUENCE, VOCAB = 2, 256, 2048
QUANTIZATIONS = ["nf4", "fp4", "nf4-double", "fp4-double", "int8"]
CONFIGS = {f"{q}{' + kbit' if kbit else ''}": (q, kbit) for q in QUANTIZATIONS for kbit in (False, True)}


def tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def measure(checkpoint: Path, name: str) -> dict[str, Any]:
    quantization, kbit = CONFIGS[name]
    model = quantized_llama(checkpoint, quantization, kbit=kbit)
    started = time.perf_counter()
    estimate = memfit.estimate(model, tokens(), target=memfit.Target("cpu"))
    trace_seconds = time.perf_counter() - started
    predicted, measured = step_peaks(model, estimate, tokens)
    static = estimate.peak_allocated_bytes - predicted  # the weights and buffers, there before the measurement
    adapters = [p for p in model.parameters() if p.requires_grad]
    return {
        "config": name,
        "quantization": quantization,
        "prepare_model_for_kbit_training": kbit,
        "trainable_parameters": sum(p.numel() for p in adapters),
        "weight_bytes": static,
        "predicted_step_peak_bytes": predicted,
        "measured_step_peak_bytes": measured,
        "step_error_pct": 100 * (predicted - measured) / measured,
        "predicted_total_peak_bytes": estimate.peak_allocated_bytes,
        "measured_total_peak_bytes": measured + static,
        "total_error_pct": 100 * (predicted - measured) / (measured + static),
        "peak_phase": estimate.peak_phase.value if estimate.peak_phase else None,
        "trace_seconds": round(trace_seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the configurations whose name contains this")
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    names = [name for name in CONFIGS if options.only is None or options.only in name]
    rows = []
    with quiet_bitsandbytes(), tempfile.TemporaryDirectory() as folder:
        config = llama_config(vocab=VOCAB, hidden=512, intermediate=1376, layers=4)
        checkpoint = save_random_llama(Path(folder), config)
        print(f"{'configuration':<20} {'predicted':>12} {'measured':>12} {'error':>9} {'total error':>12}")
        for name in names:
            row = measure(checkpoint, name)
            rows.append(row)
            print(f"{name:<20} {memfit.format_bytes(row['predicted_step_peak_bytes']):>12} "
                  f"{memfit.format_bytes(row['measured_step_peak_bytes']):>12} {row['step_error_pct']:>+8.3f}% "
                  f"{row['total_error_pct']:>+11.3f}%", flush=True)  # fmt: skip
    meta = {
        "device": f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "batch": BATCH,
        "sequence": SEQUENCE,
        "model": "Llama, 4 layers, hidden 512, MLP 1376, vocabulary 2048, LoRA r8 on q_proj, v_proj, up_proj",
        "packages": {name: __import__(name).__version__ for name in ("bitsandbytes", "peft", "transformers")},
    }
    options.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
