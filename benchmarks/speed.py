"""How long an estimate takes, and how much real memory it needs, on this machine.

    python benchmarks/speed.py

Each case runs in a fresh process so its peak RSS is its own:
* GPT-2 124M (12 layers, 768 wide), batch 8, seq 1024, AdamW: the first ``memfit.estimate`` call in
  a process (cold: includes one-time imports and kernel-cache warm-up) and the second (warm). Each
  call traces two steps at two batch sizes.
* A Llama-style 7B (32 layers, 4096 wide, built on the ``meta`` device), batch 1, seq 2048,
  bf16-mixed AdamW: seconds and the process's peak resident memory.
* ``memfit plan --hf-config llama-3-8b --gpu h100 --gpu rtx4090 --seq-len 2048`` end to end, and the
  same command with ``--plot`` (the table and the PNG, through the command line's own entry point).
* ``memfit plan --hf-config llama-3-8b --gpu h200 --optimizer sgd --seq-len 2048``: a plan that fits,
  so the chosen batch is confirmed on a trace of the whole model.
* ``memfit.tracing.batch.longest_examples`` on a ``datasets.Dataset`` of 100,000 tokenized rows, from its
  ``length`` column and by reading the rows.
Results go to ``benchmarks/results/speed.json``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import memfit

RESULTS = Path(__file__).resolve().parent / "results"


def gpt2_124m() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    ids = torch.zeros(8, 1024, dtype=torch.long)
    sample = {"input_ids": ids, "labels": ids}
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        estimate = memfit.estimate(model, sample, optimizer="adamw")
        timings.append(time.perf_counter() - started)
    return {
        "case": "gpt2-124m b8 s1024 fp32 adamw",
        "cold_seconds": round(timings[0], 2),
        "warm_seconds": round(min(timings[1:]), 2),
        "predicted_peak_bytes": estimate.peak_bytes,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def llama_7b() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 2048, dtype=torch.long)
    started = time.perf_counter()
    estimate = memfit.estimate(model, {"input_ids": ids, "labels": ids}, optimizer="adamw", precision="bf16-mixed")
    return {
        "case": "llama-7b (meta) b1 s2048 bf16-mixed adamw",
        "parameters": sum(p.numel() for p in model.parameters()),
        "cold_seconds": round(time.perf_counter() - started, 2),
        "predicted_peak_bytes": estimate.peak_bytes,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def plan_llama3_8b() -> dict:
    from memfit.planning.gpu_report import plan_for_gpus

    started = time.perf_counter()
    report = plan_for_gpus(hf_config="llama-3-8b", model=None, gpus=["h100", "rtx4090"], budget=None, seq_len=2048)
    return {
        "case": "memfit plan --hf-config llama-3-8b --gpu h100 --gpu rtx4090 --seq-len 2048",
        "cold_seconds": round(time.perf_counter() - started, 2),
        "predicted_peak_bytes": max(row.base.peak_bytes for row in report.rows),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def plan_llama3_8b_plot() -> dict:
    import contextlib
    import io
    import tempfile

    from memfit.cli.main import main as memfit_main

    with tempfile.TemporaryDirectory() as folder:
        picture = Path(folder) / "plan.png"
        argv = ["plan", "--hf-config", "llama-3-8b", "--gpu", "h100", "--gpu", "rtx4090", "--seq-len", "2048"]
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = memfit_main([*argv, "--plot", str(picture)])
        seconds = time.perf_counter() - started
        size = picture.stat().st_size
    if code != 0:
        raise SystemExit(f"memfit plan failed with exit code {code}")
    return {
        "case": "memfit " + " ".join(argv) + " --plot plan.png",
        "cold_seconds": round(seconds, 2),
        "png_bytes": size,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def plan_llama3_8b_fits() -> dict:
    """A plan that fits: the search runs on the shallow traces, the chosen batch is confirmed on a full trace."""
    from memfit.planning.gpu_report import plan_for_gpus

    started = time.perf_counter()
    report = plan_for_gpus(hf_config="llama-3-8b", model=None, gpus=["h200"], budget=None, seq_len=2048,
                           optimizer="sgd")  # fmt: skip
    (row,) = report.rows
    return {
        "case": "memfit plan --hf-config llama-3-8b --gpu h200 --optimizer sgd --seq-len 2048",
        "cold_seconds": round(time.perf_counter() - started, 2),
        "micro_batch_size": row.plan.micro_batch_size if row.plan else None,
        "gradient_checkpointing": row.plan.gradient_checkpointing if row.plan else None,
        "predicted_peak_bytes": row.plan.predicted_peak_bytes if row.plan else None,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def longest_examples_100k() -> dict:
    """Choosing the plan's batch from 100,000 tokenized rows (1 to 500 tokens) of a ``datasets.Dataset``:
    from its ``length`` column, and by reading the rows (capped at 20,000 rows and about 2 s)."""
    from datasets import Dataset

    from memfit.tracing.batch import longest_examples

    rows = Dataset.from_dict({"input_ids": [[1] * (1 + i % 500) for i in range(100_000)]})
    with_lengths = rows.add_column("length", [1 + i % 500 for i in range(100_000)])
    started = time.perf_counter()
    from_column = longest_examples(with_lengths, 8)
    column_seconds = time.perf_counter() - started
    started = time.perf_counter()
    from_rows = longest_examples(rows, 8)
    return {
        "case": "longest_examples, datasets.Dataset of 100,000 rows: length column / reading rows",
        "cold_seconds": round(column_seconds, 3),
        "rows_scan_seconds": round(time.perf_counter() - started, 3),
        "same_choice": from_column == from_rows,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


CASES = {"gpt2": gpt2_124m, "llama7b": llama_7b, "plan-llama3-8b": plan_llama3_8b,
         "plan-llama3-8b-plot": plan_llama3_8b_plot, "plan-llama3-8b-fits": plan_llama3_8b_fits,
         "longest-examples": longest_examples_100k}  # fmt: skip


def main() -> None:
    if len(sys.argv) == 2 and sys.argv[1] in CASES:
        print(json.dumps(CASES[sys.argv[1]]()))
        return
    rows = []
    for name in CASES:
        out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for row in rows:
        extra = f", warm {row['warm_seconds']} s" if "warm_seconds" in row else ""
        extra += f", reading rows {row['rows_scan_seconds']} s" if "rows_scan_seconds" in row else ""
        predicted = row.get("predicted_peak_bytes")
        peak = f"; predicted peak {memfit.format_bytes(predicted)}" if predicted else ""
        rss = memfit.format_bytes(row["max_rss_bytes"])
        print(f"{row['case']}: cold {row['cold_seconds']} s{extra}{peak}; peak RSS {rss}")
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
