"""The caching allocator at its limit, and under its options: what ``CUDACachingAllocator.cpp`` does when a
``cudaMalloc`` would not fit (free cached blocks, retry, then run out of memory), with ``expandable_segments``,
``max_split_size_mb`` and ``garbage_collection_threshold``; real allocator traces of an H100 replayed capped."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.errors import InvalidInputError
from memfit.simulation.allocator import LARGE_BUFFER, SMALL_BUFFER, AllocatorConfig, CachingAllocatorSimulator

MiB = 1024**2
SNAPSHOTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth").glob("snapshot-*"))


def requests(path: Path) -> list[tuple[int, int]]:
    """A snapshot's request sequence: (+key, size) allocates, (-key, 0) frees, (0, address) is where the real
    allocator's next segment went (best fit breaks ties between equal free blocks by address)."""
    with gzip.open(path) as file:
        trace = json.load(file)["trace"]
    actions = {"alloc": lambda e: (e["addr"], e["size"]), "free_completed": lambda e: (-e["addr"], 0),
               "segment_alloc": lambda e: (0, e["addr"])}  # fmt: skip
    return [actions[e["action"]](e) for e in trace if e["action"] in actions]


def replay(sequence: list[tuple[int, int]], capacity: int | None, config: AllocatorConfig | None = None):
    sim = CachingAllocatorSimulator(capacity_bytes=capacity, config=config)
    for key, size in sequence:
        if key > 0:
            sim.malloc(key, size)
        elif key < 0:
            sim.free(-key)
        else:
            sim.next_segment_address = size
    return sim


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_a_real_step_capped_frees_its_cache_and_retries_down_to_a_least_limit(path: Path) -> None:
    """Capped at what it reserved with no limit, a real request sequence runs as it did. Capped lower, it frees its
    cache and retries instead of running out, down to a least limit between its blocks' peak and its reserved
    peak; 2 MiB under that, it runs out of memory."""
    sequence = requests(path)
    free = replay(sequence, None)
    at_peak = replay(sequence, free.peak_reserved_bytes)
    assert not at_peak.oom and at_peak.num_alloc_retries == 0
    assert at_peak.peak_reserved_bytes == free.peak_reserved_bytes
    low, high = free.peak_allocated_bytes, free.peak_reserved_bytes
    while high - low > SMALL_BUFFER:
        middle = (low + high) // 2
        low, high = (low, middle) if not replay(sequence, middle).oom else (middle, high)
    assert free.peak_allocated_bytes < high < free.peak_reserved_bytes  # every one of these fits below its peak
    least = replay(sequence, high)
    assert not least.oom and least.num_alloc_retries > 0 and least.peak_reserved_bytes <= high
    assert replay(sequence, high - SMALL_BUFFER).oom
    assert replay(sequence, free.peak_allocated_bytes - SMALL_BUFFER).oom


def test_expandable_segments_map_pages_at_their_lowest_free_address_and_unmap_them() -> None:
    sim = CachingAllocatorSimulator(config=AllocatorConfig(expandable_segments=True))
    sim.malloc(1, 30 * MiB)  # two 20 MiB pages of the large segment
    assert sim.reserved_bytes == 2 * LARGE_BUFFER
    sim.malloc(2, 9 * MiB)  # the rest of the second page
    assert sim.reserved_bytes == 2 * LARGE_BUFFER
    sim.malloc(3, 1000)  # the small pool's own 2 MiB page
    assert sim.reserved_bytes == 2 * LARGE_BUFFER + SMALL_BUFFER
    sim.free(1)
    sim.malloc(4, 25 * MiB)  # fits where the first block was: nothing new mapped
    assert sim.reserved_bytes == 2 * LARGE_BUFFER + SMALL_BUFFER
    sim.free(4)
    sim.empty_cache()  # whole free pages go back; the page that still holds block 2 stays
    assert sim.reserved_bytes == LARGE_BUFFER + SMALL_BUFFER
    assert sim.allocated_bytes == 9 * MiB + 1024


def test_expandable_segments_remove_the_fragmentation_of_growing_requests() -> None:
    """A batch that grows step after step leaves every older segment too small to reuse; one expandable segment
    grows in place instead."""
    plain, expandable = CachingAllocatorSimulator(), CachingAllocatorSimulator(config=AllocatorConfig(True))
    for sim in (plain, expandable):
        for step, size in enumerate(range(30, 80, 5)):
            sim.malloc(step, size * MiB)
            sim.free(step)
    assert expandable.peak_reserved_bytes < plain.reserved_bytes
    assert expandable.peak_reserved_bytes == 4 * LARGE_BUFFER


def test_max_split_size_keeps_oversize_blocks_whole_and_frees_them_first() -> None:
    config = AllocatorConfig(max_split_size=64 * MiB)
    sim = CachingAllocatorSimulator(config=config)
    sim.malloc(1, 100 * MiB)
    sim.free(1)
    sim.malloc(2, 30 * MiB)  # under max_split_size: the 100 MiB block is not handed out, a segment is made
    assert sim.reserved_bytes == 100 * MiB + 30 * MiB
    sim.malloc(3, 80 * MiB)  # of max_split_size or more, but not 20 MiB smaller than the block: a new one
    assert sim.reserved_bytes == 100 * MiB + 30 * MiB + 80 * MiB
    sim.free(3)
    sim.malloc(4, 70 * MiB)  # within 20 MiB of the cached 80 MiB block: taken whole, not split
    assert sim.allocated_bytes == 30 * MiB + 80 * MiB
    capped = CachingAllocatorSimulator(capacity_bytes=120 * MiB, config=config)
    capped.malloc(1, 100 * MiB)
    capped.free(1)
    capped.malloc(2, 30 * MiB)  # the cached oversize block is released to make room, without a full retry
    assert not capped.oom and capped.num_alloc_retries == 0 and capped.reserved_bytes == 30 * MiB


def test_garbage_collection_frees_cached_segments_above_its_threshold() -> None:
    config = AllocatorConfig(garbage_collection_threshold=0.5)
    sim = CachingAllocatorSimulator(capacity_bytes=400 * MiB, config=config)
    sim.malloc(1, 150 * MiB)
    sim.free(1)  # cached: 150 MiB reserved, under half the capacity
    sim.malloc(2, 160 * MiB)
    assert sim.reserved_bytes == 310 * MiB  # nothing to collect below the threshold when this was made
    sim.free(2)
    sim.malloc(3, 170 * MiB)  # 310 MiB cached is over 200 MiB: collected before a segment is made
    assert sim.reserved_bytes <= 200 * MiB + 170 * MiB and sim.num_alloc_retries == 0


@pytest.mark.parametrize(
    ("text", "config"),
    [
        ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
        ("max_split_size_mb:128,garbage_collection_threshold:0.6",
         AllocatorConfig(max_split_size=128 * MiB, garbage_collection_threshold=0.6)),
        ("backend:native, expandable_segments:False,roundup_power2_divisions:4",
         AllocatorConfig(unmodelled=("roundup_power2_divisions:4",))),
    ],
)  # fmt: skip
def test_the_options_are_read_as_torch_spells_them(text: str, config: AllocatorConfig) -> None:
    assert AllocatorConfig.parse(text) == config
    assert AllocatorConfig.parse(config.setting()) == config
    assert AllocatorConfig.from_environment({"PYTORCH_CUDA_ALLOC_CONF": text}) == config
    assert AllocatorConfig.from_environment({"PYTORCH_ALLOC_CONF": text, "PYTORCH_CUDA_ALLOC_CONF": "x:1"}) == config


def test_options_torch_refuses_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="at least 20 MiB"):
        AllocatorConfig.parse("max_split_size_mb:8")
    with pytest.raises(InvalidInputError, match="garbage_collection_threshold"):
        AllocatorConfig(garbage_collection_threshold=1.5)
    with pytest.raises(InvalidInputError, match="not a number"):
        AllocatorConfig.parse("max_split_size_mb:lots")


sizes = st.one_of(st.integers(1, 4096), st.integers(1, 3 * MiB), st.integers(1, 45 * MiB))
steps = st.lists(st.tuples(st.booleans(), sizes), max_size=80)
configs = st.sampled_from(
    [AllocatorConfig(), AllocatorConfig(expandable_segments=True), AllocatorConfig(max_split_size=32 * MiB)]
)


@settings(max_examples=150, deadline=None)
@given(steps, configs, st.integers(20 * MiB, 400 * MiB))
def test_any_sequence_keeps_the_books_under_any_options(trace, config, capacity) -> None:
    sim = CachingAllocatorSimulator(capacity_bytes=capacity, config=config)
    live: list[int] = []
    for key, (allocate, size) in enumerate(trace):
        if allocate or not live:
            sim.malloc(key, size)
            live.append(key)
        else:
            sim.free(live.pop(size % len(live)))
        assert sim.allocated_bytes <= sim.reserved_bytes
        assert sim.reserved_bytes == sum(segment.size for segment in sim.snapshot())
        if not sim.oom:
            assert sim.reserved_bytes <= capacity
    for key in live:
        sim.free(key)
    sim.empty_cache()
    assert sim.allocated_bytes == 0 and sim.reserved_bytes == 0
