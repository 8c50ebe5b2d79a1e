"""The out-of-memory boundary: real allocator traces replayed capped, and the largest micro batch planned at the
allocator's limit against the one planned on the peak with room to spare.

    python benchmarks/limit_replay.py          # writes benchmarks/results/limit_replay.json

1. Each allocator snapshot of ``benchmarks/results/gpu-truth/`` (three real steps on an H100) replayed through memfit's
   caching-allocator simulation with the reserved memory capped: at the peak it reserved with no cap, a few percent
   under it, at the least cap it runs in, and just under that. For each cap: does it run, and after how many
   retries (the allocator freeing its cache: ``num_alloc_retries``).
2. Zoo models at the GPU sizes the accuracy harness measures (bf16-mixed, AdamW, no checkpointing), planned for a
   whole H100 and under 12 GiB: the largest micro batch whose step fits (a) by its peak with room to spare, as memfit
   planned before, (b) at the allocator's limit, as it plans now, (c) at the limit with ``expandable_segments``.
   No margin, so the three rules are compared alone.
"""

from __future__ import annotations

import gzip
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/
import memfit
from harness.accuracy import run as accuracy
from harness.accuracy.zoo import configs
from memfit.simulation.allocator import AllocatorConfig, CachingAllocatorSimulator
from memfit.units import GiB, MiB

RESULTS = Path(__file__).resolve().parent / "results"
SNAPSHOTS = sorted((RESULTS / "gpu-truth").glob("snapshot-*.json.gz"))
ZOO = ("gpt2 bf16-mixed", "bert bf16-mixed", "vit bf16-mixed", "resnet-bn bf16-mixed")
CAPACITIES = {"H100 (79.65 GiB)": 81559 * MiB, "12 GiB": 12 * GiB}


def _requests(path: Path) -> list[tuple[int, int]]:
    with gzip.open(path) as file:
        trace = json.load(file)["trace"]
    return [(e["addr"], e["size"]) if e["action"] == "alloc" else (-e["addr"], 0)
            for e in trace if e["action"] in ("alloc", "free_completed")]  # fmt: skip


def _capped(sequence: list[tuple[int, int]], cap: int | None) -> CachingAllocatorSimulator:
    sim = CachingAllocatorSimulator(capacity_bytes=cap)
    for key, size in sequence:
        if key > 0:
            sim.malloc(key, size)
        else:
            sim.free(-key)
    return sim


def snapshots() -> list[dict[str, Any]]:
    rows = []
    for path in SNAPSHOTS:
        sequence = _requests(path)
        free = _capped(sequence, None)
        low, high = free.peak_allocated_bytes, free.peak_reserved_bytes
        while high - low > 2 * MiB:
            middle = (low + high) // 2
            low, high = (low, middle) if not _capped(sequence, middle).oom else (middle, high)
        caps = {
            "unlimited peak": free.peak_reserved_bytes,
            "peak - 2 %": int(free.peak_reserved_bytes * 0.98),
            "peak - 5 %": int(free.peak_reserved_bytes * 0.95),
            "least": high,
            "least - 2 MiB": high - 2 * MiB,
        }
        for label, cap in caps.items():
            sim = _capped(sequence, cap)
            rows.append({
                "snapshot": path.name.removeprefix("snapshot-").removesuffix(".json.gz"), "cap": label,
                "cap_bytes": cap, "fits": not sim.oom, "alloc_retries": sim.num_alloc_retries,
                "peak_reserved_bytes": sim.peak_reserved_bytes, "peak_allocated_bytes": free.peak_allocated_bytes,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def zoo() -> list[dict[str, Any]]:
    rows = []
    for prefix in ZOO:
        config = next(c for c in configs("gpu") if c.name.startswith(prefix))
        model = accuracy.build(config, "gpu")
        cls, kwargs = accuracy.optimizer_spec("adamw")
        started = time.perf_counter()
        curve = memfit.trace(model, config.family.batch("gpu"), batch_size=2, optimizer=cls,
                                   optimizer_kwargs=kwargs, precision=config.precision, loss_fn=config.family.loss_fn,
                                   forward_fn=config.family.forward_fn, target=memfit.Target("cuda"))  # fmt: skip
        traced = time.perf_counter() - started
        for label, capacity in CAPACITIES.items():
            started = time.perf_counter()
            with_room = curve.max_batch_size(capacity)
            at_limit = curve.max_batch_size(capacity, at_limit=True, allocator=AllocatorConfig())
            expandable = curve.max_batch_size(capacity, at_limit=True, allocator=AllocatorConfig(True))
            fit = curve.at_limit(at_limit, capacity, allocator=AllocatorConfig()) if at_limit else None
            rows.append({
                "model": f"{config.family.name} {config.precision} adamw", "capacity": label,
                "capacity_bytes": capacity, "with_room": with_room, "at_limit": at_limit,
                "at_limit_expandable": expandable, "alloc_retries_at_limit": fit.alloc_retries if fit else None,
                "trace_seconds": round(traced, 1), "search_seconds": round(time.perf_counter() - started, 1),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    meta = {"torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, no GPU" if not torch.cuda.is_available() else "CUDA"}  # fmt: skip
    data = {"meta": meta, "snapshots": snapshots(), "zoo": zoo()}
    path = RESULTS / "limit_replay.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
