"""GPU truth: real peaks measured on a GPU, predicted again here, on any machine, for a CUDA target.

``benchmarks/results/gpu-truth/`` holds rows measured on a GPU (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` after real steps in a fresh process) with their provenance: device, torch, transformers,
cuDNN, date and the command that measured them, and memfit's prediction made on that machine (native fake CUDA
tensors). :func:`predict` makes the prediction again without the GPU (on a CPU-only torch: fake CPU tensors with
CUDA's kernels substituted), so the two paths can be held to the same measurement, row by row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import memfit
from harness.accuracy import lora_llama
from harness.accuracy.run import trace_config
from harness.accuracy.zoo import Config, configs

__all__ = [
    "FIXTURES",
    "HIGHEST_ERROR_PCT",
    "KNOWN_GAPS",
    "LOWEST_ERROR_PCT",
    "Prediction",
    "TruthRow",
    "boundary",
    "predict",
    "rows",
    "sources",
]

FIXTURES = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu-truth"
MEASURED = FIXTURES / "h100-2026-11.json"

LOWEST_ERROR_PCT, HIGHEST_ERROR_PCT = -2.0, 5.0
"""The goal for every row, allocated and reserved peak alike: never more than 2 % under, at most 5 % over."""

_WGRAD_SPLIT_K = (
    "cuDNN's backward-weight engine adds split-K partial sums of the filter gradient to its workspace (14 x 147,456 "
    "bytes in the b8 snapshot), a split count its heuristics choose; without those 2 MB memfit's 196 MiB workspace "
    "fits a cached 198 MiB segment, where the real allocator needs a new 200 MiB one"
)
_ADDRESS_ORDER = (
    "memfit's requests are the real ones (the snapshot's own sequence replays to the same figures), but ties between "
    "equal free blocks go to the lowest address, and the driver placed this run's segments partly bottom-up and in "
    "interleaved regions, where memfit models it handing out address space top down, as in every H200 snapshot: "
    "in top-down order the snapshot's requests reserve 1,673,527,296 bytes (-2.3 %), in their real order 1,713,373,184"
)
KNOWN_GAPS: dict[tuple[str, int], str] = {
    ("resnet-bn fp32 adamw b8", 8): _WGRAD_SPLIT_K,
    ("resnet-bn fp32 adamw b8", 16): _WGRAD_SPLIT_K,
    ("vit bf16-mixed sgd-momentum ckpt b16", 32): _ADDRESS_ORDER,
}
"""Rows whose prediction without a GPU misses the goal, with the mechanism: the GPU-truth test expects them to
(strictly: one that comes inside fails the test until it leaves this list)."""


@dataclass(frozen=True)
class TruthRow:
    """One measured training step and memfit's prediction of it on the machine that measured it."""

    kind: str  # "zoo" (harness.accuracy.zoo) or "lora" (harness.accuracy.lora_llama)
    source: str
    config: str
    batch_size: int
    measured_peak_allocated_bytes: int
    measured_peak_reserved_bytes: int
    gpu_predicted_peak_allocated_bytes: int
    gpu_predicted_peak_reserved_bytes: int

    @property
    def name(self) -> str:
        return f"{self.config} @ {self.batch_size}"


@dataclass(frozen=True)
class Prediction:
    """A row predicted here, with what the trace substituted to stand in for CUDA."""

    row: TruthRow
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    notes: tuple[str, ...]
    seconds: float

    def error_pct(self, kind: str) -> float:
        """(predicted - measured) / measured for ``kind`` ``"allocated"`` or ``"reserved"``, in percent."""
        measured = getattr(self.row, f"measured_peak_{kind}_bytes")
        return 100.0 * (getattr(self, f"peak_{kind}_bytes") - measured) / measured

    def within_goal(self) -> bool:
        """Both peaks no more than 2 % under and at most 5 % over the measured ones."""
        return all(LOWEST_ERROR_PCT <= self.error_pct(kind) <= HIGHEST_ERROR_PCT for kind in ("allocated", "reserved"))

    def gpu_error_pct(self, kind: str) -> float:
        """The same for the prediction made on the GPU machine."""
        measured = getattr(self.row, f"measured_peak_{kind}_bytes")
        return 100.0 * (getattr(self.row, f"gpu_predicted_peak_{kind}_bytes") - measured) / measured


def sources(path: Path = MEASURED) -> dict[str, dict[str, Any]]:
    """Where and with what each row was measured, by source id."""
    return json.loads(path.read_text())["sources"]


def boundary(path: Path = MEASURED) -> dict[str, Any]:
    """Where a real step ran out of memory under an allocator limit: batches that ran (with their allocator retries)
    and the first that did not."""
    return json.loads(path.read_text())["boundary"]


def rows(path: Path = MEASURED) -> list[TruthRow]:
    """Every measured row, grouped by configuration."""
    data = json.loads(path.read_text())
    return sorted((TruthRow(**row) for row in data["rows"]), key=lambda r: (r.kind, r.config, r.batch_size))


def groups(selected: list[TruthRow]) -> Iterator[tuple[tuple[str, str], list[TruthRow]]]:
    """Rows of one configuration together: one trace answers all their batch sizes."""
    for key, members in groupby(sorted(selected, key=lambda r: (r.kind, r.config)), key=lambda r: (r.kind, r.config)):
        yield key, sorted(members, key=lambda r: r.batch_size)


def predict(group: list[TruthRow]) -> list[Prediction]:
    """Predict every row of one configuration for a CUDA target on this machine: one estimate at the smallest
    batch, read at the others (``StepCurve.at``: the step's log replayed at that batch)."""
    first = group[0]
    started = time.perf_counter()
    curve = _trace(first)
    estimate = curve.estimate
    seconds = time.perf_counter() - started
    out = []
    for row in group:
        if row.batch_size == estimate.batch_size:
            allocated, reserved = estimate.peak_allocated_bytes, estimate.peak_reserved_bytes
        else:
            peak = curve.at(row.batch_size)
            allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
        out.append(Prediction(row, allocated, reserved, tuple(estimate.notes), seconds))
    return out


def _trace(row: TruthRow) -> memfit.StepCurve:
    if row.kind == "lora":
        model = lora_llama.build(row.config, "meta")
        return memfit.trace(
            model,
            lora_llama.batch,
            batch_size=row.batch_size,
            optimizer="adamw",
            precision="fp32",
            target=memfit.Target("cuda"),
        )
    return trace_config(_zoo_config(row.config), row.batch_size, "gpu", "cuda")[0]


def _zoo_config(name: str) -> Config:
    return next(c for c in configs("gpu") if c.name == name)
