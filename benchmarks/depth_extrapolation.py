"""Depth extrapolation vs the full trace: how far ``memfit plan``'s fast path is from tracing the whole model.

``memfit plan --hf-config`` traces deep models at 2 and 4 blocks and extrapolates in depth
(``memfit.estimate.extrapolate_depth``). This prints both predictions side by side for the presets,
with the time each took, and the highest point of the timeline ``--plot`` draws (extrapolated vs
traced), and writes ``benchmarks/results/depth_extrapolation.json``.

    python benchmarks/depth_extrapolation.py [--only llama-3-8b] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from memfit.planning.gpu_report import EXTRAPOLATION_DEPTHS, model_depth
from memfit.prediction.estimator import MemoryEstimate, estimate_for_runtimes, extrapolate_depth
from memfit.presets import from_hf_config
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import Target
from memfit.units import format_bytes

PRESETS = ["gpt2", "bert-base", "t5-base", "vit-base", "qwen2.5-7b", "llama-3-8b"]
RESULTS = Path(__file__).parent / "results" / "depth_extrapolation.json"


def trace(name: str, seq_len: int, layers: int | None, batch: int, checkpointing: bool) -> tuple:
    spec = from_hf_config(name, seq_len=seq_len, layers=layers)
    started = time.perf_counter()
    (result,) = estimate_for_runtimes(spec.model, spec.sample, runtimes=[CudaRuntime(compute_capability=(9, 0))],
                                      batch_size=batch, precision="bf16-mixed", optimizer="adamw",
                                      gradient_checkpointing=checkpointing, target=Target("cuda"))  # fmt: skip
    return result, time.perf_counter() - started, spec


def _timeline_peak(estimate: MemoryEstimate) -> int:
    """The highest point of the timeline the plot draws (allocated bytes, all categories)."""
    return max(sum(point.category_bytes) for point in estimate.timeline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a preset to run (repeatable)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name in args.only or PRESETS:
        for checkpointing in (False, True):
            exact, exact_seconds, spec = trace(name, args.seq_len, None, args.batch, checkpointing)
            depth = model_depth(spec.model)
            low, high = EXTRAPOLATION_DEPTHS
            shallow, low_seconds, _ = trace(name, args.seq_len, low, args.batch, checkpointing)
            deeper, high_seconds, _ = trace(name, args.seq_len, high, args.batch, checkpointing)
            guess = extrapolate_depth(shallow, deeper, low, high, depth)
            row = {"model": name, "depth": depth, "checkpointing": checkpointing, "batch": args.batch,
                   "exact_allocated": exact.peak_allocated_bytes, "extrapolated_allocated": guess.peak_allocated_bytes,
                   "exact_reserved": exact.peak_reserved_bytes, "extrapolated_reserved": guess.peak_reserved_bytes,
                   "exact_peak_phase": f"{exact.peak_step}/{exact.peak_phase.value}",
                   "extrapolated_peak_phase": f"{guess.peak_step}/{guess.peak_phase.value}",
                   "exact_timeline_peak": _timeline_peak(exact), "extrapolated_timeline_peak": _timeline_peak(guess),
                   "exact_seconds": round(exact_seconds, 2),
                   "extrapolated_seconds": round(low_seconds + high_seconds, 2)}  # fmt: skip
            for kind in ("allocated", "reserved", "timeline_peak"):
                row[f"{kind}_error_pct"] = round(
                    100 * (row[f"extrapolated_{kind}"] - row[f"exact_{kind}"]) / row[f"exact_{kind}"], 3
                )
            rows.append(row)
    table = Table(title=f"depth extrapolation ({low} and {high} blocks) vs full trace, bf16-mixed AdamW, "
                  f"seq {args.seq_len}, batch {args.batch}")  # fmt: skip
    for column in ("model", "ckpt", "exact reserved", "extrapolated", "error", "alloc. error", "timeline peak error",
                   "peak (exact/extr.)", "time exact", "time extr."):  # fmt: skip
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(r["model"], "on" if r["checkpointing"] else "off", format_bytes(r["exact_reserved"]),
                      format_bytes(r["extrapolated_reserved"]), f"{r['reserved_error_pct']:+.2f}%",
                      f"{r['allocated_error_pct']:+.2f}%", f"{r['timeline_peak_error_pct']:+.2f}%",
                      f"{r['exact_peak_phase']} / {r['extrapolated_peak_phase']}",
                      f"{r['exact_seconds']:.1f} s", f"{r['extrapolated_seconds']:.1f} s")  # fmt: skip
    Console(width=200).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {"torch": torch.__version__, "machine": platform.machine(), "cpus": torch.get_num_threads(),
               "seq_len": args.seq_len, "rows": rows}  # fmt: skip
    if args.only and RESULTS.exists():  # keep the other models' rows
        kept = [r for r in json.loads(RESULTS.read_text())["rows"] if r["model"] not in args.only]
        payload["rows"] = kept + rows
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
