"""A pure-Python model of PyTorch's CUDA caching allocator.

The bytes a training step *asks for* are not the bytes the GPU *gives up*: PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) rounds every request, carves blocks out of larger cached
segments, and keeps freed blocks for reuse instead of returning them to the driver. The peaks that decide
whether a step fits, ``torch.cuda.max_memory_allocated()`` and ``torch.cuda.max_memory_reserved()``,
therefore depend on the order and sizes of the allocations, not only on their sum. This module replays a
sequence of storage allocations and frees through the same rules (default settings: no expandable
segments, unlimited ``max_split_size``, a single stream) and reports those two peaks.

Addresses are modelled as the segment's creation index followed by the offset inside it. Real device pointers
order segments differently, which only matters when two free blocks of exactly the same size compete in
a best-fit search; a replay of a real allocator's trace sets ``next_segment_address`` from it.

Known limitations: only one stream is modelled (blocks are never held back by cross-stream events and
per-stream pools are not kept apart); expandable segments, ``PYTORCH_CUDA_ALLOC_CONF`` options
(``max_split_size_mb``, ``roundup_power2_divisions``, ``garbage_collection_threshold``,
``expandable_segments``, ...) and the garbage-collection pass they enable are not modelled; CUDA-graph
private pools, the free-memory callbacks, and memory outside the allocator (CUDA context, cuBLAS/cuDNN
workspaces allocated by the libraries themselves) are not modelled either. ``capacity_bytes`` stands for
the memory the allocator may reserve, like ``torch.cuda.set_per_process_memory_fraction``; the driver's
own fragmentation of device memory is ignored.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import NamedTuple

from memfit.errors import InvalidInputError

__all__ = ["BlockInfo", "CachingAllocatorSimulator", "SegmentInfo", "round_size", "segment_size"]

# kMinBlockSize: every request is rounded up to a multiple of 512 bytes (round_size), and a small-pool
# block is split only when the remainder is at least this big (should_split).
MIN_BLOCK_SIZE = 512
# kSmallSize: rounded requests up to 1 MiB go to the small pool (get_pool); a large-pool block is split
# only when the remainder is bigger than this (should_split).
SMALL_SIZE = 1048576
# kSmallBuffer: a new small-pool segment is 2 MiB (get_allocation_size).
SMALL_BUFFER = 2097152
# kLargeBuffer: a large request under kMinLargeAlloc gets a 20 MiB segment (get_allocation_size).
LARGE_BUFFER = 20971520
# kMinLargeAlloc: large requests from 10 MiB up get a segment of their own size (get_allocation_size).
MIN_LARGE_ALLOC = 10485760
# kRoundLarge: those segments are rounded up to a multiple of 2 MiB (get_allocation_size).
ROUND_LARGE = 2097152
# Synthetic segment addresses: segment i starts at (i + 1) << _ADDRESS_BITS, above any offset inside it.
_ADDRESS_BITS = 48


def _check_nbytes(nbytes: int, what: str) -> None:
    """Reject what the C++ allocator could never be asked for, so a bad trace fails loudly."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise InvalidInputError(f"{what} must be an integer number of bytes, got {nbytes!r}")
    if nbytes < 0:
        raise InvalidInputError(f"{what} cannot be negative, got {nbytes}")


def round_size(nbytes: int) -> int:
    """Return the block size the allocator hands out for a request of ``nbytes`` (``round_size``).

    Requests under 512 bytes become 512, larger ones are rounded up to a multiple of 512. A 0-byte request
    gives 0: torch never calls the allocator for an empty storage.
    """
    _check_nbytes(nbytes, "the requested size")
    if nbytes == 0:
        return 0
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """Return the size of the segment cudaMalloc'd when no cached block fits ``rounded`` bytes.

    Mirrors ``get_allocation_size``: small requests share 2 MiB segments, large ones under 10 MiB share
    20 MiB segments, and bigger ones get a segment of their own rounded up to 2 MiB.
    """
    _check_nbytes(rounded, "the rounded size")
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


class BlockInfo(NamedTuple):
    """One block of a segment, as in ``torch.cuda.memory_snapshot()``."""

    offset: int
    size: int
    allocated: bool


class SegmentInfo(NamedTuple):
    """One cudaMalloc'd segment and the blocks that tile it, lowest offset first."""

    index: int
    pool: str
    size: int
    blocks: tuple[BlockInfo, ...]


class _Block:
    """A piece of a segment; neighbours are linked so a freed block can merge with them."""

    __slots__ = ("address", "allocated", "next", "offset", "prev", "segment", "size")

    def __init__(self, segment: int, base: int, offset: int, size: int) -> None:
        self.segment = segment
        self.offset = offset
        self.address = base + offset
        self.size = size
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """Free blocks of one pool, sorted by (size, address) so best fit is one bisect away (``BlockComparatorSize``)."""

    __slots__ = ("by_address", "free", "is_small", "name")

    def __init__(self, name: str, is_small: bool) -> None:
        self.name = name
        self.is_small = is_small
        self.free: list[tuple[int, int]] = []
        self.by_address: dict[int, _Block] = {}

    def insert(self, block: _Block) -> None:
        insort(self.free, (block.size, block.address))
        self.by_address[block.address] = block

    def remove(self, block: _Block) -> None:
        i = bisect_left(self.free, (block.size, block.address))
        del self.free[i]
        del self.by_address[block.address]

    def take_best_fit(self, size: int) -> _Block | None:
        """Pop the smallest free block of ``size`` bytes or more, lowest address first (get_free_block)."""
        i = bisect_left(self.free, (size,))
        if i == len(self.free):
            return None
        _, address = self.free.pop(i)
        return self.by_address.pop(address)


class _Segment:
    __slots__ = ("base", "head", "index", "pool", "size")

    def __init__(self, index: int, base: int, size: int, pool: _Pool) -> None:
        self.index = index
        self.base = base
        self.size = size
        self.pool = pool
        self.head = _Block(index, base, 0, size)


class CachingAllocatorSimulator:
    """Replays storage allocations and frees through the caching allocator's rules.

    Feed it the ``malloc``/``free`` events of a training step in order; ``peak_allocated_bytes`` and
    ``peak_reserved_bytes`` then predict ``torch.cuda.max_memory_allocated()`` and
    ``torch.cuda.max_memory_reserved()``. With ``capacity_bytes`` set, a segment that would not fit first
    makes the simulator release every cached, fully free segment (as a failed cudaMalloc does); if it
    still does not fit the out-of-memory is recorded and the allocation goes ahead anyway, so one replay
    answers "would this step run out of memory, and where?".
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None:
            _check_nbytes(capacity_bytes, "capacity_bytes")
        self._capacity = capacity_bytes
        self._small = _Pool("small", is_small=True)
        self._large = _Pool("large", is_small=False)
        self._segments: dict[int, _Segment] = {}
        self._next_segment = 0
        # the device address the next cudaMalloc returns, when replaying a real allocator's trace (its
        # ``segment_alloc`` events): best fit breaks ties between equal blocks by address, as the real one does
        self.next_segment_address: int | None = None
        self._live: dict[int, _Block | None] = {}
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._first_oom_request: int | None = None
        self._num_ooms = 0
        self._num_alloc_retries = 0

    # -- statistics ---------------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        """The reservable memory OOMs are judged against, or ``None`` for no limit."""
        return self._capacity

    @property
    def allocated_bytes(self) -> int:
        """Bytes in blocks handed out now (``allocated_bytes.all.current``)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes in segments held from the driver now (``reserved_bytes.all.current``)."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest ``allocated_bytes`` since creation or ``reset_peaks`` (``max_memory_allocated``)."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """Highest ``reserved_bytes`` since creation or ``reset_peaks`` (``max_memory_reserved``)."""
        return self._peak_reserved

    @property
    def oom(self) -> bool:
        """Whether some allocation could not fit in ``capacity_bytes`` even after emptying the cache."""
        return self._num_ooms > 0

    @property
    def first_oom_request_bytes(self) -> int | None:
        """The requested size (before rounding) of the first allocation that ran out of memory."""
        return self._first_oom_request

    @property
    def num_ooms(self) -> int:
        """How many allocations ran out of memory (``num_ooms``)."""
        return self._num_ooms

    @property
    def num_alloc_retries(self) -> int:
        """How many segment allocations had to release the cache and retry (``num_alloc_retries``)."""
        return self._num_alloc_retries

    def reset_peaks(self) -> None:
        """Restart peak tracking from the current values, like ``torch.cuda.reset_peak_memory_stats``."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def snapshot(self) -> list[SegmentInfo]:
        """Describe every segment and its blocks, in creation order, for inspection and tests."""
        result = []
        for segment in self._segments.values():
            blocks = []
            block: _Block | None = segment.head
            while block is not None:
                blocks.append(BlockInfo(block.offset, block.size, block.allocated))
                block = block.next
            result.append(SegmentInfo(segment.index, segment.pool.name, segment.size, tuple(blocks)))
        return result

    # -- events -------------------------------------------------------------------------------------------

    def malloc(self, key: int, nbytes: int) -> int:
        """Allocate ``nbytes`` for the storage ``key`` and return the size of the block handed out.

        The returned size is what ``allocated_bytes`` grows by: the rounded request, or a whole cached
        block when the leftover would be too small to split off.
        """
        if key in self._live:
            raise InvalidInputError(f"storage {key!r} is already allocated; free it before allocating it again")
        _check_nbytes(nbytes, "the requested size")
        if nbytes == 0:
            self._live[key] = None
            return 0
        size = round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = pool.take_best_fit(size)
        if block is None:
            block = self._alloc_segment(pool, size, nbytes)
        if self._should_split(pool, block, size):
            rest = _Block(block.segment, block.address - block.offset, block.offset + size, block.size - size)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        self._live[key] = block
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        return block.size

    def free(self, key: int) -> None:
        """Return the storage ``key``'s block to its pool, merged with free neighbours (``free_block``)."""
        try:
            block = self._live.pop(key)
        except KeyError:
            raise KeyError(f"storage {key!r} is not allocated: it was never allocated or was already freed") from None
        if block is None:
            return
        self._allocated -= block.size
        block.allocated = False
        pool = self._segments[block.segment].pool
        prev = block.prev
        if prev is not None and not prev.allocated:
            pool.remove(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        pool.insert(block)

    def empty_cache(self) -> None:
        """Give every fully free segment back to the driver, like ``torch.cuda.empty_cache``."""
        self._release_cached_segments()

    # -- internals ----------------------------------------------------------------------------------------

    @staticmethod
    def _should_split(pool: _Pool, block: _Block, size: int) -> bool:
        """Small blocks split off any leftover of 512 bytes or more, large ones only leftovers over 1 MiB."""
        remaining = block.size - size
        if pool.is_small:
            return remaining >= MIN_BLOCK_SIZE
        return remaining > SMALL_SIZE

    def _alloc_segment(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        """cudaMalloc a new segment (``alloc_block``); empty the cache and retry when it would not fit."""
        alloc_size = segment_size(size)
        capacity = self._capacity
        if capacity is not None and self._reserved + alloc_size > capacity:
            self._num_alloc_retries += 1
            self._release_cached_segments()
            if self._reserved + alloc_size > capacity:
                self._num_ooms += 1
                if self._first_oom_request is None:
                    self._first_oom_request = nbytes
        base = self.next_segment_address
        if base is None:  # creation order stands for the device address (see the module docstring)
            base = (self._next_segment + 1) << _ADDRESS_BITS
        self.next_segment_address = None
        segment = _Segment(self._next_segment, base, alloc_size, pool)
        self._next_segment += 1
        self._segments[segment.index] = segment
        self._reserved += alloc_size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        return segment.head

    def _release_cached_segments(self) -> None:
        """Free every segment that is one unallocated block (``release_cached_blocks``)."""
        for index, segment in list(self._segments.items()):
            head = segment.head
            if head.allocated or head.next is not None:
                continue
            segment.pool.remove(head)
            del self._segments[index]
            self._reserved -= segment.size
