"""Traced memory vs independent counts on real CPU tensors, side by side.

    python benchmarks/cpu_accuracy.py

For each model of the test zoo (GPT-2, BERT, a ResNet-style CNN, an LSTM; random weights):
* activations: ``estimate.activation_bytes`` (CPU target) vs the bytes autograd saves in a real
  forward, counted with ``saved_tensors_hooks`` and deduplicated by storage;
* peak: ``estimate.peak_allocated_bytes`` vs PyTorch's ``MemTracker`` over two real steps.
Writes ``benchmarks/results/cpu_accuracy.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import memfit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test models
import zoo
from harness.accuracy import reference

RESULTS = Path(__file__).resolve().parent / "results"


def memtracker_peak(case: zoo.Case) -> int | None:
    try:
        optimizer = torch.optim.AdamW(case.model.parameters(), foreach=False)  # CPU default: single-tensor
        return reference.memtracker_peak(case.model, optimizer, case.batch, case.loss_of)
    except ImportError:  # MemTracker is private API; older torch lacks it
        return None


def main() -> None:
    rows = []
    for name, make in zoo.CASES.items():
        case = make()
        estimate = memfit.estimate(
            case.model, case.batch, target=memfit.Target("cpu"), loss_fn=case.loss_fn, forward_fn=case.forward_fn
        )
        saved = zoo.saved_activation_bytes(make())
        tracked = memtracker_peak(make())
        rows.append(
            {
                "model": name,
                "traced_activation_bytes": estimate.activation_bytes,
                "saved_tensor_bytes": saved,
                "activation_error_pct": round(100 * (estimate.activation_bytes - saved) / saved, 3),
                "traced_peak_bytes": estimate.peak_allocated_bytes,
                "memtracker_peak_bytes": tracked,
                "peak_error_pct": round(100 * (estimate.peak_allocated_bytes - tracked) / tracked, 3)
                if tracked
                else None,
            }
        )
    table = Table(title="Traced (fake tensors) vs counted on real CPU tensors, bytes")
    for column in (
        "model",
        "traced activations",
        "saved tensors",
        "err %",
        "traced peak",
        "MemTracker",
        "err %",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['traced_activation_bytes']:,}",
            f"{r['saved_tensor_bytes']:,}",
            f"{r['activation_error_pct']:+.3f}",
            f"{r['traced_peak_bytes']:,}",
            f"{r['memtracker_peak_bytes']:,}" if r["memtracker_peak_bytes"] else "-",
            f"{r['peak_error_pct']:+.3f}" if r["peak_error_pct"] is not None else "-",
        )
    Console(width=120).print(table)
    RESULTS.mkdir(exist_ok=True)
    meta = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    (RESULTS / "cpu_accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
