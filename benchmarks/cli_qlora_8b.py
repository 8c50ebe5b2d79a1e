"""``memfit plan`` for Llama-3-8B fine-tuning on an RTX 4090: QLoRA, LoRA in bf16 and full fine-tuning.

Runs the command line as a user would (one process each, wall time included: imports, building on
``meta``, peft, the traces), and writes ``benchmarks/results/cli_qlora_8b.json``:

- the plan for the RTX 4090 (largest micro batch, checkpointing where needed);
- the peak at micro batch 1 with checkpointing on a large budget, so the three compare like for like
  even where a card cannot hold them.

    python benchmarks/cli_qlora_8b.py
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

RUNS = {
    "qlora-nf4": [
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "all-linear",
        "--quantize",
        "nf4",
        "--optimizer",
        "paged-adamw-8bit",
    ],
    "lora-bf16": ["--lora-r", "16", "--lora-alpha", "32", "--lora-targets", "all-linear", "--optimizer", "adamw"],
    "full": ["--optimizer", "adamw"],
}
BASE = ["plan", "--hf-config", "llama-3-8b", "--seq-len", "2048", "--json"]
GIB = 2**30


def memfit(*argv: str) -> tuple[dict, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: nothing fits, still a JSON answer
        raise SystemExit(f"memfit {' '.join(argv)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout), seconds


def main() -> None:
    results = {}
    for name, flags in RUNS.items():
        plan, plan_seconds = memfit(*BASE, "--gpu", "rtx4090", *flags)
        row = plan["gpus"][0]
        same, same_seconds = memfit(
            *BASE, "--budget", "512GiB", "--target-batch-size", "1", "--checkpointing", "on", *flags
        )
        results[name] = {
            "flags": flags,
            "rtx4090": {
                k: row.get(k)
                for k in ("fits", "micro_batch_size", "gradient_checkpointing", "predicted_peak_bytes", "error")
            },
            "rtx4090_seconds": round(plan_seconds, 1),
            "batch1_checkpointing_peak_bytes": same["gpus"][0]["predicted_peak_bytes"],
            "batch1_seconds": round(same_seconds, 1),
            "finetune": plan["finetune"],
        }
        print(
            f"{name:10s} rtx4090: fits={row['fits']} micro={row.get('micro_batch_size')} "
            f"peak={(row.get('predicted_peak_bytes') or 0) / GIB:.2f} GiB ({plan_seconds:.0f} s); batch 1 + ckpt: "
            f"{same['gpus'][0]['predicted_peak_bytes'] / GIB:.2f} GiB ({same_seconds:.0f} s)",
            flush=True,
        )
    out = Path(__file__).parent / "results" / "cli_qlora_8b.json"
    import datetime
    import os

    import torch

    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    out.write_text(json.dumps({**meta, "runs": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
