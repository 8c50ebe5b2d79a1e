"""memfit's accuracy harness: predicted vs independently measured memory over the zoo.

    python -m harness.accuracy.run             # CPU mode (any machine)
    python -m harness.accuracy.run --gpu       # GPU mode (needs CUDA)
    python -m harness.accuracy.run --gpu --family gpt2 --family llama   # a part; its rows replace the same rows

CPU mode traces each configuration for a CPU target and compares, on real CPU tensors,
(a) the activations the trace keeps from forward to backward with the bytes autograd saves
(``saved_tensors_hooks``, deduplicated by storage; configurations without checkpointing, whose
recomputation keeps its inputs outside autograd's saved tensors) and (b) the traced peak with
PyTorch's ``MemTracker`` over two real steps; it also times the estimate against one real CPU
training step. GPU mode traces for a CUDA target and runs each configuration for real in a fresh
process: ``torch.cuda.max_memory_allocated/reserved`` and NVML used memory. Each configuration runs
at two batch sizes. Raw rows go to ``benchmarks/results/accuracy-<mode>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import memfit
from harness.accuracy import reference
from harness.accuracy.zoo import FAMILIES, Config, configs
from memfit.tracing.checkpointing import enable_checkpointing

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def optimizer_spec(name: str) -> tuple[Any, dict[str, Any]]:
    return {
        "adamw": (torch.optim.AdamW, {}),
        "adamw-fused": (torch.optim.AdamW, {"fused": True}),
        "sgd-momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    }[name]


def autocast_for(config: Config, device: str) -> Callable[[], Any]:
    """The autocast context of ``config``'s precision on ``device`` (disabled for fp32)."""
    dtype = _AUTOCAST.get(config.precision)
    return lambda: torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None)


def build(config: Config, size: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return config.family.build(size)


def predict(config: Config, batch: int, size: str, device: str) -> tuple[memfit.MemoryEstimate, float]:
    curve, seconds = trace_config(config, batch, size, device)
    return curve.estimate, seconds


def trace_config(config: Config, batch: int, size: str, device: str) -> tuple[memfit.StepCurve, float]:
    """The configuration's step traced at ``batch`` (read at any other off the same trace), and the seconds it took."""
    model = build(config, size)
    cls, kwargs = optimizer_spec(config.optimizer)
    started = time.perf_counter()
    curve = memfit.trace(
        model,
        config.family.batch(size),
        batch_size=batch,
        optimizer=cls,
        optimizer_kwargs=kwargs,
        precision=config.precision,
        gradient_checkpointing=config.checkpointing,
        loss_fn=config.family.loss_fn,
        forward_fn=config.family.forward_fn,
        target=memfit.Target(device),
    )
    return curve, time.perf_counter() - started


def _loss(config: Config, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    family = config.family
    output = family.forward_fn(model, batch) if family.forward_fn else model(**batch)
    return family.loss_fn(output, batch) if family.loss_fn else output.loss


def real_model(config: Config, size: str, device: str) -> torch.nn.Module:
    model = build(config, size).to(device).train()
    if config.checkpointing:
        enable_checkpointing(model)
    return model


def cpu_reference(config: Config, batch_size: int) -> dict[str, Any]:
    """Independent counts on real CPU tensors: saved activations, MemTracker peak, one step's time."""
    cls, kwargs = optimizer_spec(config.optimizer)
    batch = config.family.batch("cpu")(batch_size)
    loss_of = functools.partial(_loss, config)
    autocast = autocast_for(config, "cpu")

    saved_bytes = None
    if not config.checkpointing:
        saved_bytes = reference.saved_activation_bytes(real_model(config, "cpu", "cpu"), batch, loss_of, autocast)

    model = real_model(config, "cpu", "cpu")
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    peak, tracker_error = None, None
    try:
        peak = reference.memtracker_peak(model, optimizer, batch, loss_of, autocast=autocast)
    except RuntimeError as error:  # MemTracker hooks every parameter, frozen ones too, and fails on them
        tracker_error = str(error)
        model = real_model(config, "cpu", "cpu")
        optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)

    started = time.perf_counter()  # one more real step, untracked, for the time ratio
    with reference.onednn_off():
        reference.run_steps(model, optimizer, batch, loss_of, steps=1, autocast=autocast)
    return {
        "saved_activation_bytes": saved_bytes,
        "memtracker_peak_bytes": peak,
        "memtracker_error": tracker_error,
        "real_step_seconds": time.perf_counter() - started,
    }


def gpu_measure(config_name: str, batch_size: int, steps: int = 3) -> dict[str, Any]:
    """Real steps on the GPU; run in a fresh process per configuration."""
    from memfit.run.measure import nvml_device_used_bytes

    config = next(c for c in configs("gpu") if c.name == config_name)
    # NVML's used memory before this process creates its CUDA context: what the device holds without
    # it (≈529 MiB on an idle H100 with driver 580), which no prediction of this process includes.
    used_before = nvml_device_used_bytes(0)
    device = torch.device("cuda")
    model = real_model(config, "gpu", "cuda")
    cls, kwargs = optimizer_spec(config.optimizer)
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    batch = _to(config.family.batch("gpu")(batch_size), device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reference.run_steps(model, optimizer, batch, functools.partial(_loss, config), steps=steps,
                        autocast=autocast_for(config, "cuda"))  # fmt: skip
    torch.cuda.synchronize()
    return {
        "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "measured_nvml_used_bytes": nvml_device_used_bytes(torch.cuda.current_device()),
        "nvml_used_before_bytes": used_before,
    }


def process_nvml_bytes(measured: dict[str, Any]) -> int | None:
    """NVML's used memory that the measuring process added: used at its peak less used before it started."""
    used = measured.get("measured_nvml_used_bytes")
    if used is None:
        return None
    return used - (measured.get("nvml_used_before_bytes") or 0)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def _pct(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 3)


def run_cpu(selected: list[Config]) -> list[dict[str, Any]]:
    rows = []
    for config in selected:
        for batch in (config.batch_size, 2 * config.batch_size):
            estimate, seconds = predict(config, batch, "cpu", "cpu")
            reference = cpu_reference(config, batch)
            rows.append(
                {
                    "config": config.name,
                    "batch_size": batch,
                    "predicted_activation_bytes": estimate.activation_bytes,
                    "predicted_peak_bytes": estimate.peak_allocated_bytes,
                    "estimate_seconds": round(seconds, 3),
                    **reference,
                    "activation_error_pct": _pct(estimate.activation_bytes, reference["saved_activation_bytes"]),
                    "peak_error_pct": _pct(estimate.peak_allocated_bytes, reference["memtracker_peak_bytes"]),
                    "estimate_to_step_time_ratio": round(seconds / reference["real_step_seconds"], 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_gpu(selected: list[Config]) -> list[dict[str, Any]]:
    rows = []
    for config in selected:
        for batch in (config.batch_size, 2 * config.batch_size):
            estimate, seconds = predict(config, batch, "gpu", "cuda")
            total = _device_total_bytes()
            if total is not None and estimate.peak_bytes > total:  # it would only run out of memory
                measured = {"error": f"not run: predicted {memfit.format_bytes(estimate.peak_bytes)}, above the "
                                     f"card's {memfit.format_bytes(total)}"}  # fmt: skip
            else:
                measured = child_answer(
                    [sys.executable, "-m", "harness.accuracy.run", "--measure-one", config.name, str(batch)]
                )
            rows.append(
                {
                    "config": config.name,
                    "batch_size": batch,
                    "predicted_peak_allocated_bytes": estimate.peak_allocated_bytes,
                    "predicted_peak_reserved_bytes": estimate.peak_reserved_bytes,
                    "predicted_peak_bytes": estimate.peak_bytes,
                    "estimate_seconds": round(seconds, 3),
                    **measured,
                    "allocated_error_pct": _pct(
                        estimate.peak_allocated_bytes, measured.get("measured_peak_allocated_bytes")
                    ),
                    "reserved_error_pct": _pct(
                        estimate.peak_reserved_bytes, measured.get("measured_peak_reserved_bytes")
                    ),
                    # the process on the device: reserved plus the CUDA context, against NVML's used memory
                    # less what the device held before the process started
                    "nvml_error_pct": _pct(estimate.peak_bytes, process_nvml_bytes(measured)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _device_total_bytes() -> int | None:
    """The card's memory from NVML, which (unlike ``torch.cuda``) starts no CUDA context in this process:
    the measuring child must have the device to itself."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:
        return None


def child_answer(command: list[str]) -> dict[str, Any]:
    """The JSON a child process prints last, or its error: one failed configuration is one row, not the run."""
    out = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[2])
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no answer: {(out.stdout + out.stderr)[-2000:]}"}


def summarize(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, dict[str, float]]:
    summary = {}
    for key in keys:
        errors = [abs(r[key]) for r in rows if r.get(key) is not None]
        if errors:
            summary[key] = {
                "median_abs": round(statistics.median(errors), 3),
                "max_abs": round(max(errors), 3),
                "n": len(errors),
            }
    return summary


def show(rows: list[dict[str, Any]], summary: dict[str, Any], gpu: bool) -> None:
    fmt = memfit.format_bytes
    table = Table(
        title="memfit accuracy: " + ("GPU, predicted vs measured" if gpu else "CPU, traced vs counted on real tensors")
    )
    if gpu:
        columns = [
            "config",
            "batch",
            "pred. alloc",
            "meas. alloc",
            "err %",
            "pred. reserved",
            "meas. reserved",
            "err %",
            "NVML",
        ]
    else:
        columns = [
            "config",
            "batch",
            "traced act.",
            "saved",
            "err %",
            "traced peak",
            "MemTracker",
            "err %",
            "estimate/step",
        ]
    for column in columns:
        table.add_column(column, justify="left" if column == "config" else "right")
    for r in rows:
        if gpu:
            cells = [
                fmt(r["predicted_peak_allocated_bytes"]),
                fmt(r.get("measured_peak_allocated_bytes")),
                _e(r.get("allocated_error_pct")),
                fmt(r["predicted_peak_reserved_bytes"]),
                fmt(r.get("measured_peak_reserved_bytes")),
                _e(r.get("reserved_error_pct")),
                fmt(r.get("measured_nvml_used_bytes")),
            ]
        else:
            saved = r["saved_activation_bytes"]
            cells = [
                fmt(r["predicted_activation_bytes"]),
                fmt(saved) if saved is not None else "-",
                _e(r["activation_error_pct"]),
                fmt(r["predicted_peak_bytes"]),
                fmt(r["memtracker_peak_bytes"]) if r["memtracker_peak_bytes"] else "-",
                _e(r["peak_error_pct"]),
                f"{r['estimate_to_step_time_ratio']:.1f}x",
            ]
        table.add_row(r["config"], str(r["batch_size"]), *cells)
    console = Console(width=200)
    console.print(table)
    for key, stats in summary.items():
        if "median_abs" not in stats:
            console.print(f"{key}: median {stats['median']}, {stats['min']} to {stats['max']} over {stats['n']} runs")
            continue
        console.print(
            f"{key}: median |error| {stats['median_abs']:.3f} %, max |error| {stats['max_abs']:.3f} % "
            f"over {stats['n']} runs"
        )


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def summary_of(rows: list[dict[str, Any]], gpu: bool) -> dict[str, Any]:
    """Median and max absolute errors; in CPU mode also how many real training steps one estimate costs."""
    if gpu:
        keys = ["allocated_error_pct", "reserved_error_pct", "nvml_error_pct"]
    else:
        keys = ["activation_error_pct", "peak_error_pct"]
    summary: dict[str, Any] = summarize(rows, keys)
    ratios = [r["estimate_to_step_time_ratio"] for r in rows if r.get("estimate_to_step_time_ratio") is not None]
    if ratios:
        summary["estimate_to_step_time_ratio"] = {"median": round(statistics.median(ratios), 2), "min": min(ratios),
                                                  "max": max(ratios), "n": len(ratios)}  # fmt: skip
    return summary


def merged_rows(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """``rows`` in place of the same configuration and batch in ``path``, the others kept, in zoo order:
    a GPU run in parts that each fit a time limit. Rows of another device or torch are not mixed in."""
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    if (old["meta"].get("device"), old["meta"].get("torch")) != (meta["device"], meta["torch"]):
        print(f"{path} holds rows from {old['meta'].get('device')} with torch {old['meta'].get('torch')}: "
              "replaced by this run's rows, not merged")  # fmt: skip
        return rows
    new = {(r["config"], r["batch_size"]) for r in rows}
    kept = [r for r in old["rows"] if (r["config"], r["batch_size"]) not in new]
    return sorted(kept + rows, key=lambda r: (order.index(r["config"]), r["batch_size"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="measure on the visible CUDA GPU")
    parser.add_argument("--only", help="run the configurations whose name contains this text (results are not written)")
    parser.add_argument(
        "--family",
        action="append",
        choices=[f.name for f in FAMILIES],
        help="run this model family (repeatable); its rows replace the same rows in the result file",
    )
    parser.add_argument("--measure-one", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_one:
        print(json.dumps(gpu_measure(args.measure_one[0], int(args.measure_one[1]))))
        return 0
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device; without one, run CPU mode (no flag)")
    size = "gpu" if args.gpu else "cpu"
    zoo = configs(size)
    selected = [
        c for c in zoo if (not args.only or args.only in c.name) and (not args.family or c.family.name in args.family)
    ]
    meta = {
        "mode": size,
        "device": torch.cuda.get_device_name() if args.gpu else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "memfit": memfit.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    path = RESULTS / f"accuracy-{size}.json"
    rows: list[dict[str, Any]] = []
    for config in selected:  # written after each configuration: a run cut short keeps what it measured
        rows += run_gpu([config]) if args.gpu else run_cpu([config])
        if not args.only:
            written = merged_rows(path, meta, rows, [c.name for c in zoo]) if args.family else rows
            RESULTS.mkdir(exist_ok=True)
            document = {"meta": meta, "summary": summary_of(written, args.gpu), "rows": written}
            path.write_text(json.dumps(document, indent=2) + "\n")
    show(rows, summary_of(rows, args.gpu), args.gpu)
    if not args.only:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
