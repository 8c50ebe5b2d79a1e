"""Largest micro batch on this card: the truth, memfit's plan, Lightning's BatchSizeFinder, HF's auto_find_batch_size.

    python -m harness.accuracy.largest_batch                 # GPU: every family (about 4 min each)
    python -m harness.accuracy.largest_batch --only gpt2     # one family; its rows replace the old ones
    python -m harness.accuracy.largest_batch --simulate-max-batch 6 --only gpt2 --in-process   # CPU dry run

For each model family of the zoo (``size="gpu"``; bf16-mixed AdamW without checkpointing by default):

* **truth**: the largest micro batch that trains ``--steps`` (3) real steps without running out of
  memory, found by bisection with one fresh process per probe. The search starts at memfit's
  prediction without margin, which changes the order of the probes, not the answer; it assumes
  that a batch that fits makes every smaller one fit. It stops at ``--max-batch`` (8192).
* **memfit**: the micro batch ``memfit.plan`` picks at its default margin from the device's free memory measured
  after CUDA starts (as the callbacks do), fitting each micro batch where the allocator, freeing its cache and
  retrying, really runs out of memory, and the seconds the estimate and the plan take.
* ``--cap-gib G`` holds every trial's caching allocator to G GiB (``set_per_process_memory_fraction``), a budget
  smaller than the card; memfit plans for the same cap. Probes record ``num_alloc_retries``.
* **Lightning** ``Tuner.scale_batch_size`` (the ``BatchSizeFinder`` callback's search) in ``binsearch``
  and ``power`` mode, 3 steps per trial from 2 up to ``--max-batch``; **HF** ``Trainer.train`` with
  ``auto_find_batch_size=True`` from ``per_device_train_batch_size=--hf-start``, 3 steps. Their seconds
  include those trial steps, which is how they decide.
* each chosen batch then trains ``--check-steps`` (50) steps in a fresh process: does it run out of memory?

Every trial runs in a fresh process, so one trial's cached blocks never help or hurt the next. The
probes and the check runs are plain PyTorch steps (forward under autocast, backward, optimizer step,
``zero_grad``); the finders run inside their own trainers, as their users run them.
``--simulate-max-batch N`` runs the same harness on CPU with the zoo's tiny models, where a forward
over more than N samples raises CUDA's out-of-memory error: it checks the harness's machinery (the
test suite runs it), not memfit's accuracy, and memfit then plans for ``--budget``.
Raw rows: ``benchmarks/results/largest_batch-<device>.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from harness.accuracy import reference
from harness.accuracy.run import RESULTS, _loss, _to, autocast_for, build, optimizer_spec, real_model
from harness.accuracy.zoo import FAMILIES, RESNET50, Config
from harness.accuracy.zoo import family as zoo_family

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("memfit", "lightning_binsearch", "lightning_power", "hf_auto_find")
_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}
_HF_OPTIMIZER = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused"}


# --------------------------------------------------------------------------- one trial (a worker)


def config_of(family: str, precision: str, optimizer: str) -> Config:
    try:
        return Config(zoo_family(family), precision, optimizer, False, 1)
    except KeyError:
        names = ", ".join(f.name for f in (*FAMILIES, RESNET50))
        raise SystemExit(f"unknown family {family!r}; the zoo has {names}") from None


def _simulate_ceiling(model: torch.nn.Module, max_batch: int | None) -> torch.nn.Module:
    """On CPU: a forward over more than ``max_batch`` samples raises CUDA's out-of-memory error."""
    if max_batch is None:
        return model

    def check(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        if first is not None and first.dim() > 0 and first.shape[0] > max_batch:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 1.00 GiB (simulated card: at most {max_batch} samples)"
            )

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def cap_memory(cap_bytes: int | None) -> None:
    """Hold this process's caching allocator to ``cap_bytes`` (``set_per_process_memory_fraction``), as a budget
    smaller than the card does; the CUDA context stays outside it."""
    if cap_bytes is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, 0)


def probe(config: Config, batch_size: int, steps: int, size: str, device: str, ceiling: int | None) -> dict[str, Any]:
    """``steps`` real training steps at ``batch_size``: did they fit, how high did memory go, and how often did the
    allocator free its cache and retry (``num_alloc_retries``)."""
    model = _simulate_ceiling(real_model(config, size, device), ceiling)
    cls, kwargs = optimizer_spec(config.optimizer)
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    batch = _to(config.family.batch(size)(batch_size), torch.device(device))
    try:
        reference.run_steps(model, optimizer, batch, lambda m, b: _loss(config, m, b), steps=steps,
                            autocast=autocast_for(config, device))  # fmt: skip
    except torch.OutOfMemoryError as error:
        return {"batch_size": batch_size, "steps": steps, "ok": False, "error": str(error).splitlines()[0][:200]}
    out: dict[str, Any] = {"batch_size": batch_size, "steps": steps, "ok": True}
    if device == "cuda":
        torch.cuda.synchronize()
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return out


def memfit_plan(
    config: Config, size: str, device: str, budget: str | None, max_batch: int, cap_bytes: int | None = None
) -> dict[str, Any]:
    """What the callbacks do at setup: estimate the real model, then plan for the memory free now (or the cap)."""
    import memfit
    from memfit.planning.capacity import free_device_bytes, parse_budget

    model = build(config, size)
    if cap_bytes is not None:  # the allocator's own limit: the context is outside it
        capacity, include_context = cap_bytes, False
    elif device == "cuda":
        torch.zeros(1, device="cuda")  # start CUDA, as a training run has by then
        capacity, include_context = free_device_bytes(torch.device("cuda")), False
    else:
        capacity, include_context = parse_budget(budget), True
    cls, kwargs = optimizer_spec(config.optimizer)
    started = time.perf_counter()
    curve = memfit.trace(model, config.family.batch(size), batch_size=1, optimizer=cls, optimizer_kwargs=kwargs,
                               precision=config.precision, loss_fn=config.family.loss_fn,
                               forward_fn=config.family.forward_fn, target=memfit.Target("cuda"))  # fmt: skip
    limit = curve.max_batch_size(capacity, include_context=include_context, at_limit=True)
    try:
        chosen = memfit.plan(curve, capacity, target_batch_size="max", allow_checkpointing=False,
                             include_context=include_context, max_batch_size=max_batch)  # fmt: skip
    except memfit.InsufficientMemoryError as error:
        return {"batch_size": None, "seconds": round(time.perf_counter() - started, 3), "capacity_bytes": capacity,
                "predicted_limit": limit, "error": str(error)}  # fmt: skip
    seconds = time.perf_counter() - started
    return {"batch_size": chosen.micro_batch_size, "seconds": round(seconds, 3), "capacity_bytes": capacity,
            "predicted_limit": limit, "predicted_peak_bytes": chosen.predicted_peak_bytes,
            "predicted_alloc_retries": chosen.alloc_retries, "margin": chosen.margin}  # fmt: skip


class _SameBatch(torch.utils.data.IterableDataset):
    """One batch, over and over: the data never limits how fast a trial runs."""

    def __init__(self, make: Callable[[int], Any], batch_size: int) -> None:
        self.batch = make(batch_size)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.batch


def lightning_finder(config: Config, mode: str, size: str, device: str, ceiling: int | None,
                     max_batch: int) -> dict[str, Any]:  # fmt: skip
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _simulate_ceiling(real_model(config, size, "cpu"), ceiling)
            self.batch_size = 2

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            return _loss(config, self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            cls, kwargs = optimizer_spec(config.optimizer)
            return cls([p for p in self.parameters() if p.requires_grad], **kwargs)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(_SameBatch(config.family.batch(size), self.batch_size), batch_size=None)

    with tempfile.TemporaryDirectory() as folder:  # the finder saves and restores a checkpoint there
        trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=3, logger=False,
                            precision=_LIGHTNING_PRECISION[config.precision], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder)  # fmt: skip
        module = Module()
        started = time.perf_counter()
        tuner = Tuner(trainer)
        # Lightning 2.4 and older have no max_val: the finder then stops at an OOM or after max_trials
        limit = {"max_val": max_batch} if "max_val" in inspect.signature(tuner.scale_batch_size).parameters else {}
        chosen = tuner.scale_batch_size(module, mode=mode, steps_per_trial=3, init_val=2, **limit)
        seconds = time.perf_counter() - started
    return {"batch_size": chosen, "seconds": round(seconds, 3)}


class _Repeat(torch.utils.data.Dataset):
    """One sample at every index, as a dict the HF collator stacks."""

    def __init__(self, config: Config, size: str, length: int) -> None:
        sample = config.family.batch(size)(1)
        self.item = {k: v[0] for k, v in sample.items()} if isinstance(sample, dict) else {
            "inputs": sample[0][0], "labels": sample[1][0]}  # fmt: skip
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.item


class _WithLoss(torch.nn.Module):
    """What HF's Trainer calls: ``model(**batch)`` returning the loss."""

    def __init__(self, config: Config, model: torch.nn.Module) -> None:
        super().__init__()
        self.config_, self.model = config, model

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        keyed = "inputs" not in batch
        return {"loss": _loss(self.config_, self.model, batch if keyed else (batch["inputs"], batch["labels"]))}


def hf_auto_find(config: Config, start: int, size: str, device: str, ceiling: int | None) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    if config.optimizer not in _HF_OPTIMIZER:
        raise SystemExit(f"HF comparison supports {', '.join(_HF_OPTIMIZER)}, not {config.optimizer}")
    model = _WithLoss(config, _simulate_ceiling(real_model(config, size, "cpu"), ceiling))
    # transformers 4.x writes the precision into ACCELERATE_MIXED_PRECISION, where every later Trainer
    # of the process reads it whatever its own arguments say: leave the process as found
    environment = os.environ.get("ACCELERATE_MIXED_PRECISION")
    with tempfile.TemporaryDirectory() as folder:
        try:
            args = TrainingArguments(output_dir=folder, per_device_train_batch_size=start, auto_find_batch_size=True,
                                     max_steps=3, bf16=config.precision == "bf16-mixed",
                                     fp16=config.precision == "16-mixed", optim=_HF_OPTIMIZER[config.optimizer],
                                     report_to=[], save_strategy="no", logging_strategy="no",
                                     remove_unused_columns=False, use_cpu=device == "cpu", dataloader_num_workers=0,
                                     disable_tqdm=True)  # fmt: skip
            trainer = Trainer(model=model, args=args, train_dataset=_Repeat(config, size, 4 * start))
            started = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - started
        finally:
            if environment is None:
                os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
            else:
                os.environ["ACCELERATE_MIXED_PRECISION"] = environment
    return {"batch_size": trainer._train_batch_size, "seconds": round(seconds, 3)}


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    config = config_of(job["family"], job["precision"], job["optimizer"])
    kind, size, device, ceiling = job["kind"], job["size"], job["device"], job.get("ceiling")
    if device == "cuda":
        cap_memory(job.get("cap_bytes"))
    if kind == "probe":
        return probe(config, job["batch_size"], job["steps"], size, device, ceiling)
    if kind == "memfit":
        return memfit_plan(config, size, device, job.get("budget"), job["max_batch"], job.get("cap_bytes"))
    if kind.startswith("lightning_"):
        return lightning_finder(config, kind.removeprefix("lightning_"), size, device, ceiling, job["max_batch"])
    if kind == "hf_auto_find":
        return hf_auto_find(config, job["hf_start"], size, device, ceiling)
    raise SystemExit(f"unknown job kind {kind!r}")


def in_fresh_process(job: dict[str, Any]) -> dict[str, Any]:
    """Run one trial in a new Python process; its last stdout line is the JSON answer."""
    out = subprocess.run([sys.executable, "-m", "harness.accuracy.largest_batch", "--worker", json.dumps(job)],
                         capture_output=True, text=True, check=False, cwd=ROOT)  # fmt: skip
    lines = out.stdout.strip().splitlines()
    result = ({"failed": True, "error": (out.stderr or out.stdout)[-1500:]} if out.returncode != 0 or not lines
              else json.loads(lines[-1]))  # fmt: skip
    print(json.dumps({"trial": job, "result": result}), file=sys.stderr, flush=True)  # kept if the run is cut short
    return result


# --------------------------------------------------------------------------- the search and the comparison


def largest_that_fits(fits: Callable[[int], bool], seed: int, cap: int) -> tuple[int | None, bool]:
    """The largest batch for which ``fits`` holds (``None``: not even 1), and whether ``cap`` stopped the search.

    Steps away from ``seed`` by growing factors (1.25, 1.56, 2.4, ...) until the answer is
    bracketed, then bisects. Assumes ``fits`` is monotone."""
    known: dict[int, bool] = {}

    def test(batch: int) -> bool:
        if batch not in known:
            known[batch] = fits(batch)
        return known[batch]

    factor = 1.25
    current = min(max(1, seed), cap)
    if test(current):
        low, high = current, None
        while high is None:
            if low >= cap:
                return cap, True
            step = min(cap, max(low + 1, math.ceil(low * factor)))
            low, high = (step, None) if test(step) else (low, step)
            factor *= factor
    else:
        low, high = 0, current
        while low == 0:
            if high == 1:
                return None, False
            step = max(1, min(high - 1, math.floor(high / factor)))
            low, high = (step, high) if test(step) else (0, step)
            factor *= factor
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if test(middle) else (low, middle)
    return low, False


def compare_family(family: str, args: argparse.Namespace, run: Callable[[dict[str, Any]], dict[str, Any]]) -> dict:
    size = "cpu" if args.simulate_max_batch is not None else "gpu"
    device = "cpu" if size == "cpu" else "cuda"
    cap = round(args.cap_gib * 2**30) if args.cap_gib else None
    base = {"family": family, "precision": args.precision, "optimizer": args.optimizer, "size": size,
            "device": device, "ceiling": args.simulate_max_batch, "cap_bytes": cap}  # fmt: skip
    row: dict[str, Any] = {"family": family, "precision": args.precision, "optimizer": args.optimizer,
                           "cap_bytes": cap}  # fmt: skip
    started = time.perf_counter()
    row["memfit"] = run({**base, "kind": "memfit", "budget": args.budget, "max_batch": args.max_batch})
    probes: list[dict[str, Any]] = []

    def fits(batch: int) -> bool:
        probes.append(run({**base, "kind": "probe", "batch_size": batch, "steps": args.steps}))
        return bool(probes[-1].get("ok"))

    seed = row["memfit"].get("predicted_limit") or 1
    row["true_max"], row["true_max_capped"] = largest_that_fits(fits, seed, args.max_batch)
    row["probes"] = probes
    finders = {"lightning_binsearch": {"max_batch": args.max_batch}, "lightning_power": {"max_batch": args.max_batch},
               "hf_auto_find": {"hf_start": args.hf_start}}  # fmt: skip
    for method, options in finders.items():
        row[method] = run({**base, "kind": method, **options}) if method in args.methods else {"skipped": True}
    checks: dict[int, dict[str, Any]] = {}
    for method in METHODS:
        chosen = row[method].get("batch_size")
        if chosen and chosen not in checks:
            checks[chosen] = run({**base, "kind": "probe", "batch_size": chosen, "steps": args.check_steps})
    score(row, checks)
    row["harness_seconds"] = round(time.perf_counter() - started, 1)
    return row


def score(row: dict[str, Any], checks: dict[int, dict[str, Any]]) -> None:
    """Each method's check verdict, share of the true maximum and seconds over memfit's, written into ``row``."""
    for method in METHODS:
        chosen = row[method].get("batch_size")
        if not chosen:
            continue
        if chosen in checks:
            row[method]["check_ok"] = checks[chosen].get("ok")
            row[method]["check_steps"] = checks[chosen].get("steps")
        if row["true_max"]:
            row[method]["fraction_of_true_max"] = round(chosen / row["true_max"], 3)
    memfit_seconds = row["memfit"].get("seconds")
    for method in METHODS[1:]:
        if memfit_seconds and row[method].get("seconds"):
            row[method]["seconds_vs_memfit"] = round(row[method]["seconds"] / memfit_seconds, 1)


def rows_from_logs(paths: list[Path], search_steps: int, methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    """Rows rebuilt from the trials a run logged as they ended (``{"trial": job, "result": ...}`` lines), for a run
    its deadline cut short: a method whose trial never ended is marked ``cut_short`` (``skipped`` if not in
    ``methods``), a check that never ran is
    left out, and the true maximum is known only where the search bracketed it."""
    trials: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith('{"trial"'):
                entry = json.loads(line)
                trials.setdefault(entry["trial"]["family"], []).append((entry["trial"], entry["result"]))
    rows = []
    for family, done in trials.items():
        job = done[0][0]
        row: dict[str, Any] = {"family": family, "precision": job["precision"], "optimizer": job["optimizer"],
                               "cap_bytes": job.get("cap_bytes")}  # fmt: skip
        for method in METHODS:
            found = [dict(r, **({"start": j["hf_start"]} if "hf_start" in j else {})) for j, r in done
                     if j["kind"] == method]  # fmt: skip
            row[method] = found[0] if found else {"cut_short": True} if method in methods else {"skipped": True}
        probes = [r for j, r in done if j["kind"] == "probe" and j["steps"] == search_steps]
        fits = {p["batch_size"]: bool(p.get("ok")) for p in probes}
        bracketed = [b for b, ok in fits.items() if ok and fits.get(b + 1) is False]
        row["true_max"], row["true_max_capped"], row["probes"] = (bracketed or [None])[0], False, probes
        score(row, {r["batch_size"]: r for j, r in done if j["kind"] == "probe" and j["steps"] != search_steps})
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: how close to the true maximum (median, lowest), how often above it or out of memory
    in the check run, and the median of its seconds over memfit's."""
    summary = {}
    for method in METHODS:
        results = [row[method] for row in rows if row[method].get("batch_size") and row["true_max"]]
        shares = [r["fraction_of_true_max"] for r in results]
        ratios = [r["seconds_vs_memfit"] for r in results if "seconds_vs_memfit" in r]
        summary[method] = {
            "families": len(results),
            "median_share": statistics.median(shares) if shares else None,
            "lowest_share": min(shares, default=None),
            "above_true_max": sum(share > 1 for share in shares),
            "out_of_memory_in_check": sum(r.get("check_ok") is False for r in results),
            "median_seconds_vs_memfit": statistics.median(ratios) if ratios else None,
        }
    return summary


def chosen_cell(result: dict[str, Any], oom: str = " OOM") -> str:
    """One method's answer: its batch, its share of the true maximum, its seconds, and ``oom`` if the check failed."""
    if result.get("cut_short"):
        return "cut short"
    if result.get("skipped"):
        return "not run"
    if result.get("failed") or not result.get("batch_size"):
        return "failed"
    share = f" ({100 * result['fraction_of_true_max']:.0f} %)" if "fraction_of_true_max" in result else ""
    verdict = "" if result.get("check_ok", True) else oom
    return f"{result['batch_size']}{share}, {result['seconds']:.1f} s{verdict}"


def true_max_cell(row: dict[str, Any]) -> str:
    return "-" if row["true_max"] is None else f"{'≥ ' if row['true_max_capped'] else ''}{row['true_max']}"


def show(rows: list[dict[str, Any]], device: str, simulated: bool) -> None:
    table = Table(title=f"largest micro batch on {device}: chosen batch (share of the true maximum, seconds to "
                  "decide, 'OOM' if it then fails the check run)")  # fmt: skip
    memfit_column = "memfit (plans for --budget)" if simulated else "memfit"
    for column in ("family", "true max", memfit_column, "BSF binsearch", "BSF power", "HF auto_find"):
        table.add_column(column, justify="left" if column == "family" else "right")

    for row in rows:
        table.add_row(row["family"], true_max_cell(row), *(chosen_cell(row[m]) for m in METHODS))
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="a family to run (repeatable); default: all")
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(_LIGHTNING_PRECISION))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(_HF_OPTIMIZER))
    parser.add_argument("--steps", type=int, default=3, help="real steps a probe must survive (default 3)")
    parser.add_argument("--check-steps", type=int, default=50, help="steps each chosen batch must survive")
    parser.add_argument("--max-batch", type=int, default=8192, help="the largest batch any method may try")
    parser.add_argument("--hf-start", type=int, default=4096, help="HF's per_device_train_batch_size to start from")
    parser.add_argument("--simulate-max-batch", type=int, metavar="N", help="CPU dry run: batches above N fail")
    parser.add_argument("--budget", default="2GiB", help="memfit's capacity in the CPU dry run")
    parser.add_argument("--in-process", action="store_true", help="run trials in this process (CPU dry run only)")
    parser.add_argument("--cap-gib", type=float, metavar="GIB", help="hold every trial's allocator to this many GiB "
                        "(set_per_process_memory_fraction), as a smaller budget: memfit plans for it too")  # fmt: skip
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                        help=f"which methods run ({', '.join(METHODS)}; default all): memfit, the true maximum and "
                        "the checks always run")  # fmt: skip
    parser.add_argument("--output", type=Path, help="where to write the JSON (default benchmarks/results/)")
    parser.add_argument("--device", help="with --from-logs: the card the logs came from")
    parser.add_argument("--from-logs", type=Path, nargs="+", metavar="LOG", help="rebuild the table from the trial "
                        "lines of logs a deadline cut short (with --output: write them as results)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    if args.from_logs:
        rows = rows_from_logs(args.from_logs, args.steps, tuple(args.methods))
        show(rows, args.device or "the logged card", simulated=False)
        if args.output:
            checks = [row[m]["check_steps"] for row in rows for m in METHODS if row[m].get("check_steps")]
            meta = {"device": args.device, "steps": args.steps, "check_steps": max(checks, default=None),
                    "from_logs": [p.name for p in args.from_logs]}  # fmt: skip
            args.output.write_text(
                json.dumps({"meta": meta, "summary": summarize(rows), "rows": rows}, indent=2) + "\n"
            )
        return 0
    simulated = args.simulate_max_batch is not None
    if not simulated and not torch.cuda.is_available():
        parser.error("this compares real out-of-memory limits and needs a CUDA GPU; without one, "
                     "--simulate-max-batch N checks the harness on CPU")  # fmt: skip
    if args.in_process and not simulated:
        parser.error("--in-process is for the CPU dry run; on a GPU every trial needs a fresh process")
    families = args.only or [f.name for f in FAMILIES]
    for name in families:
        config_of(name, args.precision, args.optimizer)
    run = run_worker if args.in_process else in_fresh_process
    device = f"CPU, simulated card of {args.simulate_max_batch} samples" if simulated else torch.cuda.get_device_name()
    path = args.output or RESULTS / f"largest_batch-{'simulated' if simulated else 'gpu'}.json"
    kept = []
    cap = round(args.cap_gib * 2**30) if args.cap_gib else None
    if path.exists():  # rows of other families, or of another cap, are kept
        kept = [r for r in json.loads(path.read_text())["rows"]
                if r["family"] not in families or r.get("cap_bytes") != cap]  # fmt: skip
    meta = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
            "check_steps": args.check_steps, "max_batch": args.max_batch, "hf_start": args.hf_start}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name in families:  # written after each family: a run cut short keeps the families it finished
        rows.append(compare_family(name, args, run))
        print(json.dumps(rows[-1]), flush=True)
        summary = summarize(kept + rows)
        path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": kept + rows}, indent=2) + "\n")
    show(rows, device, simulated)
    for method, figures in summary.items():
        print(f"{method}: {figures}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
