"""GPU truth, predicted on this machine: every row measured on a real GPU beside memfit's prediction of it made here
(on a machine without a GPU: fake CPU tensors with CUDA's kernels substituted) and the one made on the GPU machine.

    python benchmarks/gpu_truth.py                 # every row; writes benchmarks/results/gpu_truth-cpu.json
    python benchmarks/gpu_truth.py --only t5       # the configurations whose name contains "t5" (not written)

The rows and their provenance are ``benchmarks/results/gpu-truth/h100-2026-11.json``; the test suite holds the same
predictions to the goal (``tests/test_gpu_truth.py``). Error = (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/
import memfit
from harness.accuracy import gpu_truth

RESULTS = Path(__file__).resolve().parent / "results"


def run(only: str | None) -> list[dict[str, Any]]:
    out = []
    for (_, config), group in gpu_truth.groups(gpu_truth.rows()):
        if only and only not in config:
            continue
        for prediction in gpu_truth.predict(group):
            row = prediction.row
            entry = {
                "config": row.config,
                "kind": row.kind,
                "batch_size": row.batch_size,
                "source": row.source,
                "measured_peak_allocated_bytes": row.measured_peak_allocated_bytes,
                "measured_peak_reserved_bytes": row.measured_peak_reserved_bytes,
                "predicted_peak_allocated_bytes": prediction.peak_allocated_bytes,
                "predicted_peak_reserved_bytes": prediction.peak_reserved_bytes,
                "allocated_error_pct": round(prediction.error_pct("allocated"), 3),
                "reserved_error_pct": round(prediction.error_pct("reserved"), 3),
                "gpu_predicted_peak_reserved_bytes": row.gpu_predicted_peak_reserved_bytes,
                "gpu_allocated_error_pct": round(prediction.gpu_error_pct("allocated"), 3),
                "gpu_reserved_error_pct": round(prediction.gpu_error_pct("reserved"), 3),
                "within_goal": prediction.within_goal(),
                "known_gap": gpu_truth.KNOWN_GAPS.get((row.config, row.batch_size)),
                "substituted": [n for n in prediction.notes if "modelled as on CUDA" in n],
                "estimate_seconds": round(prediction.seconds, 2),
            }
            out.append(entry)
            print(json.dumps(entry), flush=True)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Median and largest |error| of the reserved peak, and the rows more than 2 % / 5 % under, per path."""
    out: dict[str, dict[str, float | int]] = {}
    for path, key in (("without_gpu", "reserved_error_pct"), ("on_gpu_machine", "gpu_reserved_error_pct")):
        errors = [row[key] for row in rows]
        out[path] = {
            "rows": len(errors),
            "median_abs_pct": round(statistics.median(abs(e) for e in errors), 3),
            "max_abs_pct": round(max(abs(e) for e in errors), 3),
            "under_by_more_than_2_pct": sum(e < -2 for e in errors),
            "under_by_more_than_5_pct": sum(e < -5 for e in errors),
        }
    out["without_gpu"]["within_goal"] = sum(row["within_goal"] for row in rows)
    return out


def show(rows: list[dict[str, Any]], totals: dict[str, Any]) -> None:
    table = Table(title="GPU truth: reserved peak, predicted without the GPU and on the GPU machine, vs measured")
    for column in ("row", "batch", "measured", "without GPU", "error", "on GPU machine", "error", "allocated error"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for row in rows:
        table.add_row(
            row["config"] + (" *" if row["known_gap"] else ""),
            str(row["batch_size"]),
            memfit.format_bytes(row["measured_peak_reserved_bytes"]),
            memfit.format_bytes(row["predicted_peak_reserved_bytes"]),
            f"{row['reserved_error_pct']:+.2f} %",
            memfit.format_bytes(row["gpu_predicted_peak_reserved_bytes"]),
            f"{row['gpu_reserved_error_pct']:+.2f} %",
            f"{row['allocated_error_pct']:+.2f} %",
        )
    console = Console(width=160)
    console.print(table)
    console.print("* a known gap (harness/accuracy/gpu_truth.py KNOWN_GAPS)")
    console.print(json.dumps(totals, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="only the configurations whose name contains this text (nothing is written)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args.only)
    totals = summary(rows)
    show(rows, totals)
    if args.only:
        return
    import transformers

    meta = {
        "measured_on": gpu_truth.sources(),
        "predicted_on": {
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, no GPU"
            if not torch.cuda.is_available()
            else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.perf_counter() - started, 1),
        },
        "goal": {"lowest_error_pct": gpu_truth.LOWEST_ERROR_PCT, "highest_error_pct": gpu_truth.HIGHEST_ERROR_PCT},
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "gpu_truth-cpu.json"
    path.write_text(json.dumps({"meta": meta, "summary": totals, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
