"""Tests of the caching-allocator model against the rules of ``CUDACachingAllocator.cpp``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.errors import InvalidInputError
from memfit.simulation.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    BlockInfo,
    CachingAllocatorSimulator,
    round_size,
    segment_size,
)

MiB = 1024**2


# -- helpers ------------------------------------------------------------------------------------------


def check_invariants(sim: CachingAllocatorSimulator) -> None:
    """The block structure is consistent with the counters."""
    segments = sim.snapshot()
    assert sim.reserved_bytes == sum(seg.size for seg in segments)
    allocated = 0
    for seg in segments:
        offset = 0
        prev_free = False
        for block in seg.blocks:
            assert block.offset == offset, "blocks must tile their segment"
            assert block.size > 0 and block.size % MIN_BLOCK_SIZE == 0
            assert not (prev_free and not block.allocated), "adjacent free blocks must have merged"
            prev_free = not block.allocated
            offset += block.size
            allocated += block.size if block.allocated else 0
        assert offset == seg.size
        assert seg.pool == ("small" if seg.size == SMALL_BUFFER else "large")
    assert sim.allocated_bytes == allocated
    assert sim.allocated_bytes <= sim.reserved_bytes
    assert sim.peak_allocated_bytes >= sim.allocated_bytes
    assert sim.peak_reserved_bytes >= sim.reserved_bytes


class ReferenceAllocator:
    """A slow, obviously-correct restatement of the rules, to compare the fast model with."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []  # per segment: [offset, size, allocated] blocks, in order
        self.pools: list[bool] = []  # is_small per segment
        self.live: dict[int, tuple[int, int]] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: int, nbytes: int) -> int:
        size = round_size(nbytes)
        if size == 0:
            self.live[key] = (-1, -1)
            return 0
        small = size <= SMALL_SIZE
        candidates = [  # best fit, then the lowest address: a later segment lies below an earlier one
            (block[1], -s, block[0])
            for s, blocks in enumerate(self.segments)
            if self.pools[s] == small
            for block in blocks
            if not block[2] and block[1] >= size
        ]
        if candidates:
            _, s, offset = min(candidates)
            s = -s
        else:
            self.segments.append([[0, segment_size(size), False]])
            self.pools.append(small)
            self.reserved += segment_size(size)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            s, offset = len(self.segments) - 1, 0
        blocks = self.segments[s]
        i = next(i for i, b in enumerate(blocks) if b[0] == offset)
        remaining = blocks[i][1] - size
        if (small and remaining >= MIN_BLOCK_SIZE) or (not small and remaining > SMALL_SIZE):
            blocks.insert(i + 1, [offset + size, remaining, False])
            blocks[i][1] = size
        blocks[i][2] = True
        self.live[key] = (s, offset)
        self.allocated += blocks[i][1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return blocks[i][1]

    def free(self, key: int) -> None:
        s, offset = self.live.pop(key)
        if s < 0:
            return
        blocks = self.segments[s]
        i = next(i for i, b in enumerate(blocks) if b[0] == offset)
        blocks[i][2] = False
        self.allocated -= blocks[i][1]
        merged: list[list] = []
        for block in blocks:
            if merged and not merged[-1][2] and not block[2]:
                merged[-1][1] += block[1]
            else:
                merged.append(block)
        self.segments[s] = merged


# A mix of sizes that exercises both pools, splitting thresholds and the segment-size classes.
sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(1, 3 * MiB),
    st.integers(1, 25 * MiB),
    st.sampled_from([512, MiB, MiB + 1, 2 * MiB, 5 * MiB, 10 * MiB - 1, 10 * MiB, 19 * MiB, 20 * MiB]),
)
# Each step: (True, size) allocates a new storage, (False, i) frees the i-th live one (mod live count).
steps = st.lists(st.tuples(st.booleans(), sizes), max_size=120)


def replay(sim, trace, on_step=None) -> dict[int, int]:
    """Run a hypothesis trace on ``sim``; return the live keys with their requested sizes."""
    live: dict[int, int] = {}
    for key, (is_malloc, value) in enumerate(trace):
        if is_malloc or not live:
            sim.malloc(key, value)
            live[key] = value
        else:
            victim = list(live)[value % len(live)]
            sim.free(victim)
            del live[victim]
        if on_step is not None:
            on_step(live)
    return live


# -- rounding and segment sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(0, 0), (1, 512), (100, 512), (511, 512), (512, 512), (513, 1024), (MiB, MiB), (MiB + 1, MiB + 512)],
)
def test_round_size(nbytes: int, expected: int) -> None:
    assert round_size(nbytes) == expected


@pytest.mark.parametrize(
    ("rounded", "expected"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (11 * MiB, 12 * MiB),
        (12 * MiB, 12 * MiB),
        (12 * MiB + 512, 14 * MiB),
    ],
)
def test_segment_size(rounded: int, expected: int) -> None:
    assert segment_size(rounded) == expected


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        round_size(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        CachingAllocatorSimulator().malloc(0, bad)  # type: ignore[arg-type]


# -- single rules ---------------------------------------------------------------------------------------


def test_tiny_request_takes_512_bytes_of_a_2mib_segment() -> None:
    sim = CachingAllocatorSimulator()
    assert sim.malloc(0, 100) == 512
    assert (sim.allocated_bytes, sim.reserved_bytes) == (512, 2 * MiB)
    assert sim.snapshot()[0].pool == "small"
    check_invariants(sim)


def test_zero_byte_request_allocates_nothing() -> None:
    sim = CachingAllocatorSimulator()
    assert sim.malloc(0, 0) == 0
    assert (sim.allocated_bytes, sim.reserved_bytes, sim.snapshot()) == (0, 0, [])
    sim.free(0)
    with pytest.raises(KeyError):
        sim.free(0)


def test_two_1mib_requests_share_one_small_segment() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, MiB)
    sim.malloc(1, MiB)
    assert (sim.allocated_bytes, sim.reserved_bytes) == (2 * MiB, 2 * MiB)
    assert len(sim.snapshot()) == 1
    sim.malloc(2, 1)
    assert sim.reserved_bytes == 4 * MiB
    check_invariants(sim)


def test_small_segment_keeps_a_512_byte_remainder() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, MiB)
    sim.malloc(1, MiB - 1024)  # leaves 1024 bytes in the segment
    sim.malloc(2, 512)
    sim.malloc(3, 512)
    assert sim.reserved_bytes == 2 * MiB
    assert [b.size for b in sim.snapshot()[0].blocks] == [MiB, MiB - 1024, 512, 512]
    sim.malloc(4, 512)
    assert sim.reserved_bytes == 4 * MiB


def test_small_pool_splits_off_a_512_byte_remainder() -> None:
    # Free a 1536-byte hole, then ask for 1024: the 512-byte remainder is split off (>= kMinBlockSize).
    # Small-pool sizes are multiples of 512, so a small block is always split and allocated stays exact.
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 1536)
    sim.malloc(1, 512)
    sim.free(0)
    assert sim.malloc(2, 1024) == 1024
    assert sim.malloc(3, 512) == 512
    assert sim.reserved_bytes == 2 * MiB
    check_invariants(sim)


def test_5mib_requests_share_a_20mib_segment() -> None:
    sim = CachingAllocatorSimulator()
    assert sim.malloc(0, 5 * MiB) == 5 * MiB
    assert sim.reserved_bytes == LARGE_BUFFER
    assert sim.malloc(1, 5 * MiB) == 5 * MiB
    assert (sim.allocated_bytes, sim.reserved_bytes) == (10 * MiB, 20 * MiB)
    assert [b.size for b in sim.snapshot()[0].blocks] == [5 * MiB, 5 * MiB, 10 * MiB]
    check_invariants(sim)


def test_11mib_request_gets_a_12mib_segment_and_the_whole_block() -> None:
    sim = CachingAllocatorSimulator()
    # Remainder 1 MiB is not > kSmallSize: the whole 12 MiB block is handed out and counted.
    assert sim.malloc(0, 11 * MiB) == 12 * MiB
    assert (sim.allocated_bytes, sim.reserved_bytes) == (12 * MiB, 12 * MiB)
    assert sim.snapshot()[0].blocks == (BlockInfo(0, 12 * MiB, True),)


def test_large_block_with_remainder_at_most_1mib_is_not_split() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 19 * MiB)  # 20 MiB segment, remainder exactly 1 MiB: not split
    assert sim.allocated_bytes == 20 * MiB
    sim.free(0)
    assert sim.malloc(1, 18 * MiB + 512) == 18 * MiB + 512  # remainder just over 1 MiB: split
    assert sim.allocated_bytes == 18 * MiB + 512
    check_invariants(sim)


def test_free_merges_so_a_bigger_request_reuses_the_segment() -> None:
    sim = CachingAllocatorSimulator()
    for key in range(4):
        sim.malloc(key, 5 * MiB)  # four 5 MiB blocks fill one 20 MiB segment
    assert sim.reserved_bytes == 20 * MiB
    for key in (0, 2, 1, 3):  # free out of order: neighbours merge both ways
        sim.free(key)
    assert sim.snapshot()[0].blocks == (BlockInfo(0, 20 * MiB, False),)
    assert sim.malloc(9, 18 * MiB) == 18 * MiB
    assert (sim.reserved_bytes, sim.peak_reserved_bytes) == (20 * MiB, 20 * MiB)
    check_invariants(sim)


def test_best_fit_picks_the_smallest_fitting_block() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 4 * MiB)
    sim.malloc(1, 2 * MiB)
    sim.malloc(2, 3 * MiB)
    sim.malloc(3, 2 * MiB)
    # Holes of 4 MiB (offset 0) and 3 MiB (offset 6 MiB); the tail of 9 MiB is free too.
    sim.free(0)
    sim.free(2)
    sim.malloc(4, 3 * MiB)  # 3 MiB hole fits exactly; remainder 0 -> whole block, no split
    blocks = sim.snapshot()[0].blocks
    assert BlockInfo(6 * MiB, 3 * MiB, True) in blocks
    assert BlockInfo(0, 4 * MiB, False) in blocks
    check_invariants(sim)


def test_best_fit_breaks_ties_by_lower_address() -> None:
    sim = CachingAllocatorSimulator()
    for key, address in enumerate((3 << 40, 1 << 40, 2 << 40)):
        sim.next_segment_address = address  # as a replay of a real trace places them
        sim.malloc(key, 12 * MiB)  # three separate 12 MiB segments
    sim.free(2)
    sim.free(1)
    sim.malloc(3, 12 * MiB)  # the lowest of the two equal free blocks: segment 1's
    assert [seg.blocks[0].allocated for seg in sim.snapshot()] == [True, True, False]


def test_later_segments_lie_lower_so_ties_go_to_the_newest() -> None:
    sim = CachingAllocatorSimulator()
    for key in range(3):
        sim.malloc(key, 12 * MiB)  # three separate 12 MiB segments, each below the one before
    sim.free(2)
    sim.free(0)
    sim.malloc(3, 12 * MiB)
    assert [seg.blocks[0].allocated for seg in sim.snapshot()] == [False, True, True]


def test_pools_are_kept_apart() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 5 * MiB)
    sim.free(0)
    sim.malloc(1, 1000)  # a free large block never serves a small request
    assert sim.reserved_bytes == 22 * MiB
    sim.free(1)
    sim.malloc(2, MiB + 1)  # nor a free small block a large one
    assert sim.reserved_bytes == 22 * MiB
    assert [seg.pool for seg in sim.snapshot()] == ["large", "small"]


def test_free_unknown_key_raises_key_error() -> None:
    sim = CachingAllocatorSimulator()
    with pytest.raises(KeyError, match="not allocated"):
        sim.free(7)
    sim.malloc(7, 10)
    sim.free(7)
    with pytest.raises(KeyError, match="already freed"):
        sim.free(7)


def test_double_malloc_of_a_key_is_rejected() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(1, 10)
    with pytest.raises(InvalidInputError, match="already allocated"):
        sim.malloc(1, 10)


def test_peaks_and_reset() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 30 * MiB)
    sim.free(0)
    assert (sim.allocated_bytes, sim.peak_allocated_bytes) == (0, 30 * MiB)
    assert (sim.reserved_bytes, sim.peak_reserved_bytes) == (30 * MiB, 30 * MiB)
    sim.reset_peaks()
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == (0, 30 * MiB)
    sim.empty_cache()
    assert sim.reserved_bytes == 0
    sim.reset_peaks()
    assert sim.peak_reserved_bytes == 0


def test_empty_cache_keeps_partly_used_segments() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 5 * MiB)
    sim.malloc(1, 5 * MiB)
    sim.malloc(2, 12 * MiB)
    sim.free(0)
    sim.free(2)
    sim.empty_cache()
    assert sim.reserved_bytes == 20 * MiB
    assert sim.allocated_bytes == 5 * MiB
    check_invariants(sim)


# -- capacity and out-of-memory -------------------------------------------------------------------------


def test_releasing_cached_segments_avoids_an_oom() -> None:
    sim = CachingAllocatorSimulator(capacity_bytes=40 * MiB)
    sim.malloc(0, 30 * MiB)
    sim.free(0)  # 30 MiB stays cached
    sim.malloc(1, 32 * MiB)  # does not fit the 30 MiB block; 30 + 32 > 40, so the cache is released
    assert not sim.oom
    assert sim.first_oom_request_bytes is None
    assert sim.num_alloc_retries == 1
    assert (sim.reserved_bytes, sim.peak_reserved_bytes) == (32 * MiB, 32 * MiB)
    check_invariants(sim)


def test_real_oom_is_flagged_and_the_replay_goes_on() -> None:
    sim = CachingAllocatorSimulator(capacity_bytes=40 * MiB)
    sim.malloc(0, 30 * MiB)
    sim.malloc(1, 1000)  # 2 MiB small segment: 32 MiB reserved
    sim.malloc(2, 12 * MiB - 5)  # needs 12 MiB more, nothing cached to release
    assert sim.oom
    assert sim.num_ooms == 1
    assert sim.first_oom_request_bytes == 12 * MiB - 5
    assert sim.reserved_bytes == 44 * MiB  # allocated anyway
    sim.malloc(3, 50 * MiB)
    assert (sim.num_ooms, sim.first_oom_request_bytes) == (2, 12 * MiB - 5)
    check_invariants(sim)


def test_oom_release_frees_only_fully_free_segments() -> None:
    sim = CachingAllocatorSimulator(capacity_bytes=24 * MiB)
    sim.malloc(0, 5 * MiB)
    sim.malloc(1, 5 * MiB)
    sim.free(0)  # the 20 MiB segment is partly used: it cannot be released
    sim.malloc(2, 16 * MiB)  # 15 MiB tail too small, new 16 MiB segment: 36 > 24
    assert sim.oom
    assert sim.reserved_bytes == 36 * MiB


def test_no_capacity_never_ooms() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(0, 10**12)
    assert not sim.oom and sim.num_alloc_retries == 0


# -- properties on random traces ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(steps)
def test_random_traces_keep_the_invariants(trace) -> None:
    sim = CachingAllocatorSimulator()

    def on_step(live: dict[int, int]) -> None:
        assert sim.allocated_bytes <= sim.reserved_bytes
        assert sim.allocated_bytes >= sum(round_size(n) for n in live.values())
        assert sim.peak_reserved_bytes >= sim.peak_allocated_bytes

    live = replay(sim, trace, on_step)
    check_invariants(sim)
    for key in live:
        sim.free(key)
    assert sim.allocated_bytes == 0
    assert all(len(seg.blocks) == 1 and not seg.blocks[0].allocated for seg in sim.snapshot())
    check_invariants(sim)
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.snapshot() == []


@settings(max_examples=200, deadline=None)
@given(steps)
def test_random_traces_match_the_reference_model(trace) -> None:
    sim = CachingAllocatorSimulator()
    ref = ReferenceAllocator()
    live: dict[int, int] = {}
    for key, (is_malloc, value) in enumerate(trace):
        if is_malloc or not live:
            assert sim.malloc(key, value) == ref.malloc(key, value)
            live[key] = value
        else:
            victim = list(live)[value % len(live)]
            sim.free(victim)
            ref.free(victim)
            del live[victim]
        assert (sim.allocated_bytes, sim.reserved_bytes) == (ref.allocated, ref.reserved)
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == (ref.peak_allocated, ref.peak_reserved)
    expected = [tuple(BlockInfo(*b) for b in blocks) for blocks in ref.segments]
    assert [seg.blocks for seg in sim.snapshot()] == expected


@settings(max_examples=100, deadline=None)
@given(steps, st.integers(0, 80 * MiB))
def test_capacity_bounds_reserved_unless_oom(trace, capacity) -> None:
    limited = CachingAllocatorSimulator(capacity_bytes=capacity)
    free = CachingAllocatorSimulator()
    replay(limited, trace)
    replay(free, trace)
    check_invariants(limited)
    assert limited.peak_allocated_bytes <= limited.peak_reserved_bytes
    if not limited.oom:
        assert limited.peak_reserved_bytes <= capacity
    if free.peak_reserved_bytes <= capacity:
        assert not limited.oom and limited.num_alloc_retries == 0
        assert limited.peak_allocated_bytes == free.peak_allocated_bytes


def test_long_trace_is_fast() -> None:
    import random
    import time

    rng = random.Random(0)
    sim = CachingAllocatorSimulator()
    live: list[int] = []
    start = time.perf_counter()
    for key in range(100_000):
        if live and rng.random() < 0.5:
            sim.free(live.pop(rng.randrange(len(live))))
        else:
            sim.malloc(key, rng.choice([rng.randrange(1, 4096), rng.randrange(1, 64 * MiB)]))
            live.append(key)
    assert time.perf_counter() - start < 10
    check_invariants(sim)
