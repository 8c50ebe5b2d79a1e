"""The largest micro batch a plan picks, and the proof: the next batch's full trace is over the budget.

For ``memfit plan --hf-config gpt2 --gpu rtx4090``, ``--hf-config llama-3-8b --gpu h100 --optimizer sgd
--seq-len 2048`` and a small MLP planned by a ``PlanningSession`` (45 MiB budget, target 256), this prints
the chosen micro batch (and the largest that fits, which the accumulation splits), the full trace of
the next micro batch against the budget, and how many traces planning took (full traces of the whole
model; shallow ones for the depth extrapolation apart). A trace is one ``trace_for_runtimes`` call
(at batch 1 it traces batch 2 too, for the fit in the batch; ``memfit plan`` asks for batch 1 under two
cache keys today, so it is listed twice). Writes ``benchmarks/results/largest_batch_plans.json``.

    python benchmarks/largest_batch_plans.py [--only gpt2] [--output PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit
from memfit.planning import gpu_report
from memfit.planning.gpus import gpu_by_name
from memfit.planning.session import PlanningSession, PlanRequest
from memfit.prediction.estimator import trace_for_runtimes as original_trace_for_runtimes
from memfit.presets import from_hf_config
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import Target, TrainingLoop
from memfit.units import MiB, format_bytes

RESULTS = Path(__file__).parent / "results" / "largest_batch_plans.json"
CLI_CASES = {
    "gpt2": {"hf_config": "gpt2", "gpus": ["rtx4090"]},
    "llama-3-8b": {"hf_config": "llama-3-8b", "gpus": ["h100"], "optimizer": "sgd", "seq_len": 2048},
}
MLP_CAPACITY_BYTES = 45 * MiB
MLP_TARGET = 256


class MLP(nn.Module):
    """d=256, 4 residual blocks (256 -> 1280 -> 256), a 10-way head: a plain MLP planned on the CPU."""

    def __init__(self, width: int = 256, blocks: int = 4, expansion: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, expansion * width), nn.GELU(), nn.Linear(expansion * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def mlp_tracer(model: nn.Module) -> Callable[[int, bool, int], memfit.StepCurve]:
    """``trace_at(micro, checkpointing, accumulation)`` of the MLP's AdamW step on the CPU."""

    def trace_at(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        return memfit.trace(
            model, torch.zeros(micro, 256), optimizer="adamw", target=memfit.Target("cpu"), batch_size=micro,
            gradient_checkpointing=checkpointing, loop=memfit.TrainingLoop(accumulation_steps=accumulation),
            loss_fn=lambda out, batch: out.float().pow(2).mean(),
        )  # fmt: skip

    return trace_at


@contextlib.contextmanager
def counting_traces(depth: int | None) -> Iterator[list[dict[str, Any]]]:
    """Every trace ``memfit plan`` takes, with the depth it traced (shallow ones serve the extrapolation)."""
    original, log = gpu_report.trace_for_runtimes, []

    def counted(model: Any, sample: Any, **kwargs: Any) -> list[memfit.StepCurve]:
        started = time.perf_counter()
        results = original(model, sample, **kwargs)
        traced_depth = gpu_report.model_depth(model)
        log.append({
            "full": traced_depth == depth, "depth": traced_depth, "batch": kwargs["batch_size"],
            "checkpointing": kwargs["gradient_checkpointing"], "accumulation": kwargs["loop"].accumulation_steps,
            "peak_bytes": results[0].estimate.peak_bytes, "seconds": round(time.perf_counter() - started, 2),
        })  # fmt: skip
        return results

    gpu_report.trace_for_runtimes = counted
    try:
        yield log
    finally:
        gpu_report.trace_for_runtimes = original


def next_accumulation(target: int | None, micro: int) -> int:
    """The accumulation micro batch ``micro`` would run with on its own: the fewest steps for the target."""
    return 1 if target is None else math.ceil(target / micro)


def cli_case(name: str, options: dict[str, Any]) -> dict[str, Any]:
    spec = from_hf_config(options["hf_config"], seq_len=options.get("seq_len", 1024))
    depth = gpu_report.model_depth(spec.model)
    started = time.perf_counter()
    with counting_traces(depth) as log:
        report = gpu_report.plan_for_gpus(
            hf_config=options["hf_config"], model=None, gpus=options["gpus"], budget=None,
            seq_len=options.get("seq_len", 1024), optimizer=options.get("optimizer", "adamw"),
        )  # fmt: skip
    seconds = time.perf_counter() - started
    (row,) = report.rows
    chosen = row.plan
    assert chosen is not None, row.error
    largest = chosen.largest_micro_batch
    following = largest + 1
    traced = next((t for t in log if t["full"] and t["batch"] == following and t["accumulation"] == 1
                   and t["checkpointing"] == chosen.gradient_checkpointing), None)  # fmt: skip
    if traced is None:  # the plan never looked at it: trace it now (not counted)
        gpu = gpu_by_name(options["gpus"][0])
        runtime = CudaRuntime(compute_capability=gpu.compute_capability or (9, 0))
        (curve,) = original_trace_for_runtimes(
            spec.model, spec.sample, runtimes=[runtime], batch_size=following, precision="bf16-mixed",
            optimizer=options.get("optimizer", "adamw"), gradient_checkpointing=chosen.gradient_checkpointing,
            loop=TrainingLoop(), target=Target("cuda"),
        )  # fmt: skip
        next_peak = curve.estimate.peak_bytes
    else:
        next_peak = traced["peak_bytes"]
    return summarise(name, chosen, next_peak, log, seconds, traced_by_plan=traced is not None)


def mlp_case() -> dict[str, Any]:
    torch.manual_seed(0)
    trace_at, log = mlp_tracer(MLP()), []

    def counted(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        result = trace_at(micro, checkpointing, accumulation)
        traced = result.estimate
        log.append({"full": True, "batch": micro, "checkpointing": checkpointing, "accumulation": accumulation,
                    "peak_bytes": traced.peak_bytes, "seconds": round(traced.trace_seconds, 2)})  # fmt: skip
        return result

    session = PlanningSession(counted, batch_size=8)
    started = time.perf_counter()
    chosen = session.decide(PlanRequest(capacity_bytes=MLP_CAPACITY_BYTES, target_batch_size=MLP_TARGET)).plan
    seconds = time.perf_counter() - started
    traces = len(log)
    following = chosen.largest_micro_batch + 1
    next_peak = session.trace_at(following, chosen.gradient_checkpointing, next_accumulation(MLP_TARGET, following))
    row = summarise("mlp", chosen, next_peak.estimate.peak_bytes, log[:traces], seconds,
                    traced_by_plan=len(log) == traces)  # fmt: skip
    return {**row, "capped": chosen.largest_micro_batch >= MLP_TARGET}


def summarise(name: str, chosen: memfit.Plan, next_peak: int, log: list[dict[str, Any]], seconds: float,
              traced_by_plan: bool) -> dict[str, Any]:  # fmt: skip
    full = [t for t in log if t["full"]]
    return {
        "case": name,
        "micro_batch_size": chosen.micro_batch_size,
        "accumulate_grad_batches": chosen.accumulate_grad_batches,
        "largest_micro_batch": chosen.largest_micro_batch,
        "gradient_checkpointing": chosen.gradient_checkpointing,
        "predicted_peak_bytes": chosen.predicted_peak_bytes,
        "budget_bytes": chosen.budget_bytes,
        "next_micro_batch_peak_bytes": next_peak,
        "next_micro_batch_fits": next_peak <= chosen.budget_bytes,
        "next_traced_by_plan": traced_by_plan,
        "full_traces": len(full),
        "shallow_traces": len(log) - len(full),
        "traced": [{k: v for k, v in t.items() if k != "full"} for t in log],
        "seconds": round(seconds, 1),
        "reasons": list(chosen.reasons),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[*CLI_CASES, "mlp"], help="a case to run (repeatable)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for name in args.only or [*CLI_CASES, "mlp"]:
        row = mlp_case() if name == "mlp" else cli_case(name, CLI_CASES[name])
        rows.append(row)
        excess = row["next_micro_batch_peak_bytes"] - row["budget_bytes"]
        overshoot = f"{format_bytes(excess)} over" if excess > 0 else f"fits, {format_bytes(-excess)} left"
        print(
            f"{name}: micro batch {row['micro_batch_size']} x {row['accumulate_grad_batches']} (largest "
            f"{row['largest_micro_batch']}), peak {format_bytes(row['predicted_peak_bytes'])}; micro batch "
            f"{row['largest_micro_batch'] + 1} traces at {format_bytes(row['next_micro_batch_peak_bytes'])} of "
            f"{format_bytes(row['budget_bytes'])} budget ({overshoot}); "
            f"{row['full_traces']} full + {row['shallow_traces']} shallow traces, {row['seconds']} s"
        )
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": torch.get_num_threads()}
    args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
