"""How far ``--gpus auto``'s screen is from the per-rank estimate it stands in for.

For each strategy the screen reads the per-rank estimate made at two GPUs at other GPU counts
(``memfit.planning.sharded.rescaled``); this prints, count by count, that reading beside the per-rank estimate
made at the count itself (``memfit.estimate`` with ``TrainingLoop(sharding=...)``), at micro batch 1, the
device bytes the screen compares with the budget. Writes ``benchmarks/results/sharded_screen-cpu.json``.

    python benchmarks/sharded_screen.py [--preset llama-3-8b --preset mistral-7b] [--layers 4] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import memfit
from memfit.planning.sharded import rescaled
from memfit.presets import from_hf_config
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.sharding import ShardingConfig

RESULTS = Path(__file__).parent / "results" / "sharded_screen-cpu.json"
STRATEGIES = ("zero1", "zero2", "zero3", "fsdp")
COUNTS = (4, 8, 16, 32)


def per_rank(spec, strategy: str, gpus: int, offload: bool = False) -> memfit.StepCurve:
    sharding = ShardingConfig(strategy, gpus, gpus_per_node=min(gpus, 8), offload_optimizer=offload,
                              mixed_precision_param_dtype="bfloat16" if strategy == "fsdp" else None)  # fmt: skip
    return memfit.trace(spec.model, spec.sample, batch_size=1, precision="bf16-mixed", optimizer="adamw",
                        loop=TrainingLoop(sharding=sharding), target=Target("cuda"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="repeatable (default: llama-3-8b and mistral-7b)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    presets = args.preset or ["llama-3-8b", "mistral-7b"]
    rows = []
    for preset in presets:
        rows += _compare(preset, args.layers, args.seq_len)
    errors = [r["error_pct"] for r in rows]
    summary = {"rows": len(rows), "median_abs_pct": sorted(map(abs, errors))[len(errors) // 2],
               "max_abs_pct": max(map(abs, errors)), "min_pct": min(errors), "max_pct": max(errors),
               "below": sum(e < 0 for e in errors)}  # fmt: skip
    print(
        f"median |error| {summary['median_abs_pct']:.2f} %, from {summary['min_pct']:+.2f} % to "
        f"{summary['max_pct']:+.2f} %; {summary['below']} of {len(rows)} below the per-rank estimate"
    )
    meta = {"presets": presets, "layers": args.layers, "seq_len": args.seq_len, "torch": torch.__version__,
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    RESULTS.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


def _compare(preset: str, layers: int, seq_len: int) -> list[dict]:
    """The screen's reading beside the per-rank estimate, for every strategy and count, of ``preset``."""
    spec = from_hf_config(preset, seq_len=seq_len, layers=layers)
    rows: list[dict] = []
    print(f"{preset} ({layers} blocks), seq {seq_len}, bf16-mixed AdamW, H100, micro batch 1")
    print(f"{'strategy':<18}{'GPUs':>5}{'screen GiB':>12}{'per-rank GiB':>14}{'error':>9}")
    for strategy in STRATEGIES:
        for offload in (False, True):
            if offload and strategy == "zero1":
                continue
            reference = per_rank(spec, strategy, 2)
            for gpus in COUNTS:
                exact = per_rank(spec, strategy, gpus, offload)
                screen = rescaled(reference, exact.estimate.sharding).at(1).device_bytes
                own = exact.at(1).device_bytes
                error = 100 * (screen - own) / own
                label = strategy + ("+offload" if offload else "")
                print(f"{label:<18}{gpus:>5}{screen / 2**30:>12.3f}{own / 2**30:>14.3f}{error:>8.2f}%")
                rows.append({"preset": preset, "strategy": label, "gpus": gpus, "screen_bytes": screen,
                             "per_rank_bytes": own, "error_pct": round(error, 3)})  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
