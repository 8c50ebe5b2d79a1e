"""memfit's caching-allocator simulation against the real allocator: the request sequences of real training steps
on an H100 (``torch.cuda.memory._snapshot()``: every alloc and free of three steps, and the segments the allocator
cudaMalloc'd for them; ``benchmarks/results/gpu-truth/snapshot-*.json.gz``), replayed request by request."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from memfit.simulation.allocator import CachingAllocatorSimulator

SNAPSHOTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth").glob("snapshot-*"))


def load(path: Path) -> dict:
    with gzip.open(path) as file:
        return json.load(file)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_the_simulation_reserves_what_the_real_allocator_reserved_segment_by_segment(path: Path) -> None:
    snapshot = load(path)
    simulation = CachingAllocatorSimulator()
    real_reserved = real_peak = 0
    for event in snapshot["trace"]:
        action = event["action"]
        if action == "alloc":
            simulation.malloc(event["addr"], event["size"])
        elif action == "free_completed":
            simulation.free(event["addr"])
        elif action == "segment_alloc":
            simulation.next_segment_address = event["addr"]  # where ties between equal free blocks go
            real_reserved += event["size"]
            real_peak = max(real_peak, real_reserved)
        elif action == "segment_free":
            real_reserved -= event["size"]
        if action in ("alloc", "free_completed"):  # the real allocator logs a new segment before the block in it
            assert simulation.reserved_bytes == real_reserved  # the reserved curve, request by request
    assert simulation.peak_reserved_bytes == real_peak
    real_segments = sorted(segment["total_size"] for segment in snapshot["segments"])
    assert sorted(segment.size for segment in simulation.snapshot()) == real_segments
    # and the blocks inside them: what is still allocated after three steps, block for block
    real_blocks = sorted(
        block["size"] for segment in snapshot["segments"] for block in segment["blocks"] if block["state"] != "inactive"
    )
    simulated = sorted(block.size for segment in simulation.snapshot() for block in segment.blocks if block.allocated)
    assert simulated == real_blocks
