"""Deep models from shallow traces vs the full trace: how far ``memfit plan``'s fast paths are from tracing it whole.

``memfit plan --hf-config`` traces deep models at 3 and 4 blocks and builds the whole model's log from them
(``memfit.tracing.depth``: "built"); where that cannot be done it traces them at 2 and 4 blocks and extrapolates
the peaks in depth (``memfit.prediction.estimator.extrapolate_depth``). This prints the three predictions side by
side for the presets (the peak at the traced batch, and ``at()`` at twice and four times it), with the time each
took, and the highest point of the timeline ``--plot`` draws, and writes
``benchmarks/results/depth_extrapolation.json``.

    python benchmarks/depth_extrapolation.py [--only llama-3-8b] [--seq-len 2048] [--batch 1]

``CONFIGS`` adds TinyLlama-1.1B and Qwen2-0.5B, whose vocabulary head is much of a shallow trace.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from memfit.errors import EstimationError
from memfit.planning.deep_models import BUILD_DEPTHS, EXTRAPOLATION_DEPTHS, model_depth
from memfit.prediction.estimator import MemoryEstimate, StepCurve, extrapolate_depth, trace_for_runtimes
from memfit.presets import from_hf_config
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import Target
from memfit.tracing.depth import DepthMismatch
from memfit.units import format_bytes

PRESETS = ["gpt2", "bert-base", "t5-base", "vit-base", "qwen2.5-7b", "llama-3-8b"]
# Small models whose head over a large vocabulary is much of a shallow trace, extrapolated far in depth
# (2 and 4 blocks to 22 or 24): configs as published, written to a temporary config.json.
CONFIGS: dict[str, dict] = {
    "tinyllama-1.1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                       "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "qwen2-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}  # fmt: skip
DEFAULT = [*PRESETS, *CONFIGS]
RESULTS = Path(__file__).parent / "results" / "depth_extrapolation.json"


def _config(name: str) -> str:
    """A preset's name, or the path of a temporary config.json for one of ``CONFIGS``."""
    if name not in CONFIGS:
        return name
    path = Path(tempfile.gettempdir()) / f"memfit-{name}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CONFIGS[name]))
    return str(path)


def trace(name: str, seq_len: int, layers: int | None, batch: int, checkpointing: bool, built: bool = False) -> tuple:
    """``(curve, seconds, spec)``; ``built``: the whole model's log built from its traces at ``BUILD_DEPTHS``."""
    spec = from_hf_config(_config(name), seq_len=seq_len, layers=layers)
    repeated = [from_hf_config(_config(name), seq_len=seq_len, layers=d).model for d in BUILD_DEPTHS] if built else None
    started = time.perf_counter()
    (result,) = trace_for_runtimes(spec.model, spec.sample, runtimes=[CudaRuntime(compute_capability=(9, 0))],
                                   batch_size=batch, precision="bf16-mixed", optimizer="adamw",
                                   gradient_checkpointing=checkpointing, target=Target("cuda"),
                                   repeated=repeated)  # fmt: skip
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
    for name in args.only or DEFAULT:
        for checkpointing in (False, True):
            exact_curve, exact_seconds, spec = trace(name, args.seq_len, None, args.batch, checkpointing)
            exact = exact_curve.estimate
            depth = model_depth(spec.model)
            low, high = EXTRAPOLATION_DEPTHS
            shallow, low_seconds, _ = trace(name, args.seq_len, low, args.batch, checkpointing)
            deeper, high_seconds, _ = trace(name, args.seq_len, high, args.batch, checkpointing)
            doubled_traces = [trace(name, args.seq_len, d, 2 * args.batch, checkpointing) for d in (low, high)]
            doubled = (doubled_traces[0][0].estimate, doubled_traces[1][0].estimate)  # at()'s ratios at twice the batch
            guess_curve = extrapolate_depth(shallow, deeper, low, high, depth, doubled=doubled)
            guess = guess_curve.estimate
            row = {"model": name, "depth": depth, "checkpointing": checkpointing, "batch": args.batch,
                   "exact_allocated": exact.peak_allocated_bytes, "extrapolated_allocated": guess.peak_allocated_bytes,
                   "exact_reserved": exact.peak_reserved_bytes, "extrapolated_reserved": guess.peak_reserved_bytes,
                   "exact_peak_phase": f"{exact.peak_step}/{exact.peak_phase.value}",
                   "extrapolated_peak_phase": f"{guess.peak_step}/{guess.peak_phase.value}",
                   "exact_timeline_peak": _timeline_peak(exact), "extrapolated_timeline_peak": _timeline_peak(guess),
                   # what the plan's search compares with the budget: at(batch) with the CUDA context
                   "exact_at_batch": exact_curve.at(args.batch).device_bytes,
                   "extrapolated_at_batch": guess_curve.at(args.batch).device_bytes,
                   "exact_seconds": round(exact_seconds, 2),
                   "extrapolated_seconds": round(low_seconds + high_seconds + sum(d[1] for d in doubled_traces),
                                                 2)}  # fmt: skip
            for kind in ("allocated", "reserved", "timeline_peak", "at_batch"):
                row[f"{kind}_error_pct"] = round(
                    100 * (row[f"extrapolated_{kind}"] - row[f"exact_{kind}"]) / row[f"exact_{kind}"], 3
                )
            try:
                built, built_seconds, _ = trace(name, args.seq_len, None, args.batch, checkpointing, built=True)
            except (DepthMismatch, EstimationError) as why:  # memfit plan extrapolates such a model
                row["built_not_possible"] = getattr(why, "reason", str(why))
            else:
                row.update(_built_row(exact, built, built_seconds, args.batch))
            rows.append(row)
    table = Table(title=f"built from {BUILD_DEPTHS} blocks and extrapolated from ({low}, {high}) vs the whole trace, "
                  f"bf16-mixed AdamW, seq {args.seq_len}, batch {args.batch}")  # fmt: skip
    for column in ("model", "ckpt", "exact reserved", "built", "built: largest difference", "extrapolated", "error",
                   "alloc. error", "timeline peak error", "peak (exact/extr.)", "time exact", "time built",
                   "time extr."):  # fmt: skip
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        unbuilt = "built_reserved" not in r
        table.add_row(r["model"], "on" if r["checkpointing"] else "off", format_bytes(r["exact_reserved"]),
                      "-" if unbuilt else format_bytes(r["built_reserved"]),
                      "-" if unbuilt else f"{r['built_largest_difference_bytes']:,} B",
                      format_bytes(r["extrapolated_reserved"]), f"{r['reserved_error_pct']:+.2f}%",
                      f"{r['allocated_error_pct']:+.2f}%", f"{r['timeline_peak_error_pct']:+.2f}%",
                      f"{r['exact_peak_phase']} / {r['extrapolated_peak_phase']}",
                      f"{r['exact_seconds']:.1f} s", "-" if unbuilt else f"{r['built_seconds']:.1f} s",
                      f"{r['extrapolated_seconds']:.1f} s")  # fmt: skip
    Console(width=200).print(table)
    _check_order(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {"torch": torch.__version__, "machine": platform.machine(), "cpus": torch.get_num_threads(),
               "seq_len": args.seq_len, "rows": rows}  # fmt: skip
    if args.only and RESULTS.exists():  # keep the other models' rows
        kept = [r for r in json.loads(RESULTS.read_text())["rows"] if r["model"] not in args.only]
        payload["rows"] = kept + rows
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


def _built_row(exact_curve: StepCurve, built_curve: StepCurve, seconds: float, batch: int) -> dict:
    """The built log against the whole trace: peaks at the batch and ``at()`` at 2x and 4x it, their largest
    difference in bytes (0 where the build is exact), and the seconds the build took."""
    exact, built = exact_curve.estimate, built_curve.estimate
    pairs = [(exact.peak_allocated_bytes, built.peak_allocated_bytes), (exact.peak_reserved_bytes,
             built.peak_reserved_bytes), (_timeline_peak(exact), _timeline_peak(built))]  # fmt: skip
    for times in (2, 4):
        whole, from_shallow = exact_curve.at(times * batch), built_curve.at(times * batch)
        pairs += [(whole.allocated_bytes, from_shallow.allocated_bytes), (whole.reserved_bytes,
                   from_shallow.reserved_bytes)]  # fmt: skip
    return {"built_allocated": built.peak_allocated_bytes, "built_reserved": built.peak_reserved_bytes,
            "built_largest_difference_bytes": max(abs(a - b) for a, b in pairs),
            "built_seconds": round(seconds, 2), "built_from": list(BUILD_DEPTHS)}  # fmt: skip


def _check_order(rows: list[dict]) -> None:
    """Say where checkpointing is extrapolated above no checkpointing although the whole traces put it below."""
    by_model: dict[str, dict[bool, dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], {})[row["checkpointing"]] = row
    for model, pair in by_model.items():
        if len(pair) < 2:
            continue
        whole = pair[True]["exact_reserved"] < pair[False]["exact_reserved"]
        guess = pair[True]["extrapolated_at_batch"] < pair[False]["extrapolated_at_batch"]
        if whole and not guess:
            print(f"{model}: checkpointing extrapolated above no checkpointing, whole traces put it below")


if __name__ == "__main__":
    main()
