"""Per-rank predicted vs measured peaks of real multi-process sharded runs on CPU (gloo), side by side.

    python benchmarks/sharding_gloo.py [--worlds 2 4] [--strategies fsdp fsdp-bf16 zero1 zero2 zero3]

Every rank trains the same tiny GPT-2 (2 blocks, width 128, sequence 64, micro batch 2, AdamW, fp32) for two
steps under PyTorch's ``MemTracker`` (it follows storages, including FSDP's ``resize_`` of gathered
parameters) and reports its peak tensor bytes:

* ``fsdp``: FSDP2, ``fully_shard`` on each block, then the root (``tests/fsdp2_fit.py``);
* ``fsdp-bf16``: the same with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (fp32 shards, bf16 gathered
  parameters and compute, no autocast), predicted with ``mixed_precision_param_dtype="bfloat16"``;
* ``zero1/2/3``: DeepSpeed's engine with its CPU accelerator and the gloo backend, the tracker open from
  ``deepspeed.initialize`` on (its flat groups, fp32 partitions and buckets are made there), with
  ``reduce_bucket_size`` 1e5 elements and DeepSpeed's defaults otherwise.

The prediction is ``memfit.estimate(..., target=Target("cpu"), loop=TrainingLoop(sharding=ShardingConfig(...)))``
for the same step, traced once in this process; for FSDP both the fake-process-group trace (AdamW by name) and
the documented model (AdamW as a class). Writes ``benchmarks/results/sharding-cpu.json`` (the rows of the
strategies and worlds run; a subset keeps the file's other rows).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

import memfit
from memfit import ShardingConfig, Target, TrainingLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fsdp2_fit

RESULTS = Path(__file__).resolve().parent / "results" / "sharding-cpu.json"
LAYERS, BATCH, SEQ = 2, 2, 64
REDUCE_BUCKET = 100_000
_PARAM_DTYPE = {"fsdp-bf16": "bfloat16"}  # FSDP2's MixedPrecisionPolicy(param_dtype=...) of a row


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _zero_rank(rank: int, world: int, port: int, stage: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    from torch.distributed._tools.mem_tracker import MemTracker

    deepspeed.init_distributed(dist_backend="gloo")
    model = fsdp2_fit.tiny_gpt2(LAYERS, SEQ)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    data = fsdp2_fit.sample(BATCH, SEQ)
    tracker = MemTracker()
    with tracker:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for _ in range(2):
            loss = engine(**data).loss
            engine.backward(loss)
            engine.step()
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    cpu = next(value for device, value in peak.items() if torch.device(device).type == "cpu")
    Path(f"{out}.rank{rank}").write_text(json.dumps({"rank": rank, "peak_bytes": int(cpu["Total"])}))


def measure(strategy: str, world: int) -> list[int]:
    """Each rank's measured peak tensor bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run.json")
        if strategy.startswith("fsdp"):
            results = fsdp2_fit.run(world, out, LAYERS, BATCH, SEQ, param_dtype=_PARAM_DTYPE.get(strategy))
        else:
            mp.spawn(_zero_rank, args=(world, _port(), int(strategy[-1]), out), nprocs=world, join=True)
            results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    return [r["peak_bytes"] for r in results]


def predict(strategy: str, world: int, optimizer: Any = "adamw") -> memfit.MemoryEstimate:
    """memfit's estimate of one rank; for FSDP2 with ``optimizer="adamw"`` it is traced under real ``fully_shard``
    on a fake process group, with the optimizer given as a class the documented model answers."""
    if strategy.startswith("fsdp"):
        sharding = ShardingConfig("fsdp", world, mixed_precision_param_dtype=_PARAM_DTYPE.get(strategy))
    else:
        sharding = ShardingConfig(strategy, world, reduce_bucket_size=REDUCE_BUCKET)  # type: ignore[arg-type]
    model = fsdp2_fit.tiny_gpt2(LAYERS, SEQ)
    return memfit.estimate(model, fsdp2_fit.sample(BATCH, SEQ), target=Target("cpu"), optimizer=optimizer,
                           loop=TrainingLoop(sharding=sharding))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["fsdp", "fsdp-bf16", "zero1", "zero2", "zero3"])
    args = parser.parse_args()
    single = memfit.estimate(fsdp2_fit.tiny_gpt2(LAYERS, SEQ), fsdp2_fit.sample(BATCH, SEQ), target=Target("cpu"))
    rows: list[dict[str, Any]] = []
    print(f"{'strategy':10} {'N':>3} {'predicted':>12} {'measured (per rank)':>28} {'error':>8}")
    for strategy in args.strategies:
        for world in args.worlds:
            row: dict[str, Any] = {"strategy": strategy, "world_size": world}
            predicted = predict(strategy, world)
            row["predicted_bytes"] = predicted.peak_allocated_bytes
            row["rank_terms_bytes"] = dict(predicted.rank_terms)
            row["path"] = "fake process group trace" if any("fake process group" in n for n in predicted.notes) else (
                "documented model")  # fmt: skip
            if strategy.startswith("fsdp"):
                row["documented_model_bytes"] = predict(strategy, world, torch.optim.AdamW).peak_allocated_bytes
            started = time.perf_counter()
            try:
                measured = measure(strategy, world)
            except Exception as exc:  # a stack that does not run here: say so in the result file
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
                print(f"{strategy:10} {world:>3} {predicted.peak_allocated_bytes:>12,} {'did not run':>28}")
                rows.append(row)
                continue
            row["measured_bytes"] = measured
            row["seconds"] = round(time.perf_counter() - started, 1)
            error = (predicted.peak_allocated_bytes - max(measured)) / max(measured)
            row["relative_error"] = round(error, 4)
            shown = ", ".join(f"{m:,}" for m in measured)
            print(f"{strategy:10} {world:>3} {predicted.peak_allocated_bytes:>12,} {shown:>28} {error:>+8.1%}"
                  f"  ({row['path']})")  # fmt: skip
            if "documented_model_bytes" in row:
                documented = row["documented_model_bytes"]
                row["documented_model_relative_error"] = round((documented - max(measured)) / max(measured), 4)
                print(f"{'':10} {'':>3} {documented:>12,} {'':>28} "
                      f"{row['documented_model_relative_error']:>+8.1%}  (documented model)")  # fmt: skip
            rows.append(row)
    ran = {(row["strategy"], row["world_size"]) for row in rows}
    kept = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    order = {s: n for n, s in enumerate(parser.get_default("strategies"))}
    rows = sorted([r for r in kept if (r["strategy"], r["world_size"]) not in ran] + rows,
                  key=lambda r: (order.get(r["strategy"], len(order)), r["world_size"]))  # fmt: skip
    result = {
        "model": f"GPT-2 {LAYERS} blocks, width {fsdp2_fit.EMBED}, seq {SEQ}, micro batch {BATCH}, AdamW, fp32 "
        "(fsdp-bf16: MixedPrecisionPolicy(param_dtype=torch.bfloat16))",
        "measured_with": "torch.distributed._tools.mem_tracker.MemTracker peak CPU tensor bytes, each rank",
        "torch": torch.__version__,
        "single_process_predicted_bytes": single.peak_allocated_bytes,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"single process (no sharding), predicted: {single.peak_allocated_bytes:,}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
