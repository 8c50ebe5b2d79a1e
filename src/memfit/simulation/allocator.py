"""A pure-Python model of PyTorch's CUDA caching allocator.

The bytes a training step *asks for* are not the bytes the GPU *gives up*: PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) rounds every request, carves blocks out of larger cached
segments, and keeps freed blocks for reuse instead of returning them to the driver. The peaks that decide
whether a step fits, ``torch.cuda.max_memory_allocated()`` and ``torch.cuda.max_memory_reserved()``,
therefore depend on the order and sizes of the allocations, not only on their sum. This module replays a
sequence of storage allocations and frees through the same rules and reports those two peaks.

At a capacity (``capacity_bytes``: the device's memory, or ``torch.cuda.set_per_process_memory_fraction``'s
limit) it does what the allocator does when a ``cudaMalloc`` would not fit (``DeviceCachingAllocator::malloc``):
run the garbage collection a ``garbage_collection_threshold`` asks for, release cached blocks of
``max_split_size`` or more (``release_available_cached_blocks``), then release every cached block and retry
(``release_cached_blocks``, counted in ``num_alloc_retries``: each one synchronizes the device), and run out of
memory only if that fails too. The allocator's options (``PYTORCH_ALLOC_CONF``, formerly
``PYTORCH_CUDA_ALLOC_CONF``: ``expandable_segments``, ``max_split_size_mb``, ``max_non_split_rounding_mb``,
``garbage_collection_threshold``) are an ``AllocatorConfig``. With expandable segments each pool has one segment
that maps pages (2 MiB small, 20 MiB large) at its lowest free address as it grows and unmaps them when cached
blocks are released (``ExpandableSegment``, ``try_allocate_expandable_block``).

Addresses are modelled as the segment's place in creation order followed by the offset inside it, each new segment
below every earlier one. Addresses decide which of two free blocks of exactly the same size a best-fit search takes
(``BlockComparatorSize`` orders blocks by size, then by pointer, and ``get_free_block`` takes the first that fits), so
the order matters whenever equal blocks compete, as the blocks of a model's equal parameters, gradients and optimizer
states do. CUDA's driver hands out ``cudaMalloc`` address space from the top down: in the H200 snapshots of
``benchmarks/results/gpu-truth/h200-2026-11-27`` most segments lie below the one made before them (423 of 486 in a
Llama step; the others fill gaps that the driver's alignment of a larger one left), and replaying those snapshots'
requests with segments ordered so reserves what the real allocator reserved (Llama 16-mixed with fused AdamW:
32,637,976,576 bytes, to the byte; ordered the other way, 31,497,125,888, 3.5 % less). In every committed snapshot
with many ties between equal free blocks (all but the LSTM ones, which have at most 30), 84 % or more of them went to
the newest segment. The driver's gap filling and its interleaved regions are not modelled (in the H100 ViT snapshot
of 2026-11-26 they decide 2.3 % of the reserved peak); a replay of a real allocator's trace sets
``next_segment_address`` from it.

Known limitations: one stream (blocks are never held back by cross-stream events, per-stream pools are not kept
apart); ``roundup_power2_divisions``, CUDA-graph private pools and the free-memory callbacks are not modelled;
memory outside the allocator (CUDA context) and the driver's own fragmentation of device memory are ignored.
"""

from __future__ import annotations

import difflib
import os
from bisect import bisect_left, insort
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from memfit.errors import InvalidInputError

__all__ = [
    "AllocatorConfig",
    "BlockInfo",
    "CachingAllocatorSimulator",
    "SegmentInfo",
    "round_size",
    "segment_size",
]

# kMinBlockSize: every request is rounded up to a multiple of 512 bytes (round_size), and a small-pool
# block is split only when the remainder is at least this big (should_split).
MIN_BLOCK_SIZE = 512
# kSmallSize: rounded requests up to 1 MiB go to the small pool (get_pool); a large-pool block is split
# only when the remainder is bigger than this (should_split).
SMALL_SIZE = 1048576
# kSmallBuffer: a new small-pool segment is 2 MiB (get_allocation_size), and an expandable small segment maps
# pages of this size.
SMALL_BUFFER = 2097152
# kLargeBuffer (large_segment_size): a large request under kMinLargeAlloc gets a 20 MiB segment, and an
# expandable large segment maps pages of this size.
LARGE_BUFFER = 20971520
# kMinLargeAlloc: large requests from 10 MiB up get a segment of their own size (get_allocation_size).
MIN_LARGE_ALLOC = 10485760
# kRoundLarge: those segments are rounded up to a multiple of 2 MiB (get_allocation_size).
ROUND_LARGE = 2097152
# Synthetic segment addresses: segment i starts at (_SEGMENT_SLOTS - i) << _ADDRESS_BITS, above any offset inside it
# and below every segment made before it (the driver gives out address space from the top down).
_ADDRESS_BITS = 48
_SEGMENT_SLOTS = 1 << 40
_MiB = 1048576


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


def segment_size(rounded: int, large_segment: int = LARGE_BUFFER) -> int:
    """Return the size of the segment cudaMalloc'd when no cached block fits ``rounded`` bytes.

    Mirrors ``get_allocation_size``: small requests share 2 MiB segments, large ones under 10 MiB share
    20 MiB segments, and bigger ones get a segment of their own rounded up to 2 MiB.
    """
    _check_nbytes(rounded, "the rounded size")
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return large_segment
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


# PYTORCH_ALLOC_CONF keys torch 2.13 accepts (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.h)
_MODELLED_KEYS = {
    "expandable_segments",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
}
# keys that change what the device allocator reserves, not modelled: another rounding of requests, another size of
# the shared large segments, CUDA's own asynchronous allocator, a per-process cap (give it as the capacity instead)
_UNMODELLED_KEYS = {"roundup_power2_divisions", "large_segment_size_mb", "backend", "per_process_memory_fraction"}
# keys of the host (pinned) allocator, of locking and of graph capture: what the device reserves does not change
_OTHER_KEYS = {
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_max_round_threshold", "pinned_max_cached_size", "pinned_reserve_segment_size_mb",
    "pinned_free_catch_all", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom",
}  # fmt: skip
_KNOWN_KEYS = _MODELLED_KEYS | _UNMODELLED_KEYS | _OTHER_KEYS


def _items(text: str) -> list[str]:
    """``key:value`` items of an options string; a bracketed value (``roundup_power2_divisions:[64:8,>:1]``) keeps
    its commas."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _switch(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise InvalidInputError(f"allocator option {key} takes True or False, got {value!r} (torch refuses it too)")
    return value.lower() == "true"


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's options that change how much it reserves (``PYTORCH_ALLOC_CONF``).

    ``max_split_size`` (``max_split_size_mb``): blocks of this size or more are never split, and a request below it
    never takes one; ``None`` is torch's default, no limit. ``max_non_split_rounding``
    (``max_non_split_rounding_mb``): how much larger than a request of ``max_split_size`` or more a cached block may
    be and still be handed out whole. ``garbage_collection_threshold``: with a per-process memory limit, the share of
    it above which cached blocks unused for longest are freed before a new segment is taken.
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    max_non_split_rounding: int = LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    unmodelled: tuple[str, ...] = ()  # options given that change what is reserved but are not modelled

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size < LARGE_BUFFER:
            raise InvalidInputError(
                f"max_split_size must be at least {LARGE_BUFFER // _MiB} MiB, as torch requires, got "
                f"{self.max_split_size // _MiB} MiB"
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise InvalidInputError(
                f"garbage_collection_threshold must be in [0, 1), got {self.garbage_collection_threshold!r}"
            )

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """The options of a ``PYTORCH_ALLOC_CONF`` string (``"expandable_segments:True,max_split_size_mb:128"``).

        Keys torch does not know are refused, as torch refuses them (``c10/core/AllocatorConfig.cpp``,
        ``c10/cuda/CUDAAllocatorConfig.h``); so are switches other than True/False. Keys that change what is
        reserved but are not modelled are kept in ``unmodelled`` (a plan names them); keys of the host (pinned)
        allocator and of locking change nothing here."""
        options: dict[str, object] = {}
        unmodelled: list[str] = []
        for item in _items(text or ""):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key not in _KNOWN_KEYS:
                close = difflib.get_close_matches(key, sorted(_KNOWN_KEYS), n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; torch knows {', '.join(sorted(_KNOWN_KEYS))}"
                raise InvalidInputError(f"unknown allocator option {key!r} (torch refuses it too){hint}")
            if key == "expandable_segments":
                options["expandable_segments"] = _switch(key, value)
                continue
            try:
                if key == "max_split_size_mb":
                    options["max_split_size"] = int(float(value)) * _MiB
                elif key == "max_non_split_rounding_mb":
                    options["max_non_split_rounding"] = int(float(value)) * _MiB
                elif key == "garbage_collection_threshold":
                    options["garbage_collection_threshold"] = float(value)
                elif key in _UNMODELLED_KEYS and f"{key}:{value}" != "backend:native":  # native: this allocator
                    unmodelled.append(f"{key}:{value}")
            except ValueError:
                raise InvalidInputError(f"allocator option {key}:{value} is not a number") from None
        return cls(**options, unmodelled=tuple(unmodelled))  # type: ignore[arg-type]

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The options this process's CUDA allocator reads: ``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``."""
        environ = os.environ if environ is None else environ
        return cls.parse(environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF"))

    def setting(self) -> str:
        """The ``PYTORCH_ALLOC_CONF`` value that selects these options ("" for torch's defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MiB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // _MiB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        parts.extend(self.unmodelled)
        return ",".join(parts)


class BlockInfo(NamedTuple):
    """One block of a segment, as in ``torch.cuda.memory_snapshot()``."""

    offset: int
    size: int
    allocated: bool


class SegmentInfo(NamedTuple):
    """One cudaMalloc'd segment (or the mapped pages of an expandable one) and the blocks that tile it."""

    index: int
    pool: str
    size: int
    blocks: tuple[BlockInfo, ...]


class _Block:
    """A piece of a segment; neighbours are linked so a freed block can merge with them."""

    __slots__ = ("address", "allocated", "gc_base", "mapped", "next", "offset", "prev", "segment", "size")

    def __init__(self, segment: int, base: int, offset: int, size: int, mapped: bool = True) -> None:
        self.segment = segment
        self.offset = offset
        self.address = base + offset
        self.size = size
        self.allocated = False
        self.mapped = mapped  # an expandable segment's block is either mapped or address space only
        self.gc_base = 0  # the pool's get_free_block count when the block was cached (garbage collection)
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """Free mapped blocks of one pool, sorted by (size, address) so best fit is one bisect away
    (``BlockComparatorSize``), and an expandable segment's unmapped ranges by address."""

    __slots__ = ("by_address", "free", "is_small", "lookups", "name", "page", "unmapped")

    def __init__(self, name: str, is_small: bool) -> None:
        self.name = name
        self.is_small = is_small
        self.page = SMALL_BUFFER if is_small else LARGE_BUFFER
        self.free: list[tuple[int, int]] = []
        self.by_address: dict[int, _Block] = {}
        self.unmapped: dict[int, _Block] = {}
        self.lookups = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:
        if not block.mapped:
            self.unmapped[block.address] = block
            return
        block.gc_base = self.lookups
        insort(self.free, (block.size, block.address))
        self.by_address[block.address] = block

    def remove(self, block: _Block) -> None:
        if not block.mapped:
            del self.unmapped[block.address]
            return
        i = bisect_left(self.free, (block.size, block.address))
        del self.free[i]
        del self.by_address[block.address]

    def split(self, block: _Block, size: int) -> None:
        """Keep ``size`` bytes of ``block``; the rest becomes a free block of its own, after it."""
        rest = _Block(block.segment, block.address - block.offset, block.offset + size, block.size - size)
        _link_after(block, rest)
        block.size = size
        self.insert(rest)

    def merged(self, block: _Block) -> _Block:
        """``block`` merged with free neighbours in the same mapping state; the caller inserts the result."""
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self.remove(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        return block


def _link_after(block: _Block, new: _Block) -> None:
    new.prev, new.next = block, block.next
    if block.next is not None:
        block.next.prev = new
    block.next = new


def _link_before(block: _Block, new: _Block) -> None:
    new.prev, new.next = block.prev, block
    if block.prev is not None:
        block.prev.next = new
    block.prev = new


class _Segment:
    __slots__ = ("base", "expandable", "head", "index", "pool", "size")

    def __init__(self, index: int, base: int, size: int, pool: _Pool, expandable: bool = False) -> None:
        self.index = index
        self.base = base
        self.size = size  # for an expandable segment, its address space
        self.pool = pool
        self.expandable = expandable
        self.head = _Block(index, base, 0, size, mapped=not expandable)

    def copy(self, pools: dict[int, _Pool], blocks: dict[int, _Block]) -> _Segment:
        """An independent copy of the segment and its chain of blocks, in the copied ``pools`` (by the original's
        id); ``blocks`` receives each copied block under its original's id."""
        copied = object.__new__(_Segment)
        copied.index, copied.base, copied.size = self.index, self.base, self.size
        copied.pool, copied.expandable = pools[id(self.pool)], self.expandable
        previous, block = None, self.head
        while block is not None:
            twin_block = object.__new__(_Block)
            for slot in _Block.__slots__:
                setattr(twin_block, slot, getattr(block, slot))
            twin_block.prev, twin_block.next = previous, None
            if previous is None:
                copied.head = twin_block
            else:
                previous.next = twin_block
            blocks[id(block)] = previous = twin_block
            block = block.next
        return copied

    def info(self) -> SegmentInfo:
        """The segment and its blocks as torch describes them: an expandable one by its mapped blocks."""
        blocks = []
        block: _Block | None = self.head
        while block is not None:
            if block.mapped:
                blocks.append(BlockInfo(block.address - self.base, block.size, block.allocated))
            block = block.next
        size = sum(b.size for b in blocks) if self.expandable else self.size
        return SegmentInfo(self.index, self.pool.name, size, tuple(blocks))


class CachingAllocatorSimulator:
    """Replays storage allocations and frees through the caching allocator's rules.

    Feed it the ``malloc``/``free`` events of a training step in order; ``peak_allocated_bytes`` and
    ``peak_reserved_bytes`` then predict ``torch.cuda.max_memory_allocated()`` and
    ``torch.cuda.max_memory_reserved()``. With ``capacity_bytes`` set, a segment that would not fit makes the
    simulator free cached memory and retry as the allocator does (see the module docstring); if it still does not
    fit, the out-of-memory is recorded and the allocation goes ahead anyway, so one replay answers "would this step
    run out of memory, where, and after how many retries?".
    """

    def __init__(self, capacity_bytes: int | None = None, config: AllocatorConfig | None = None) -> None:
        if capacity_bytes is not None:
            _check_nbytes(capacity_bytes, "capacity_bytes")
        self._capacity = capacity_bytes
        self.config = config or AllocatorConfig()
        self._lookups_counted = self._garbage_collects()  # get_free_block counts lookups only for garbage collection
        self._small = _Pool("small", is_small=True)
        self._large = _Pool("large", is_small=False)
        self._segments: dict[int, _Segment] = {}
        self._expandable: dict[str, _Segment] = {}
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

    def clone(self) -> CachingAllocatorSimulator:
        """An independent copy of the allocator's whole state (a replay checkpoint to resume from)."""
        twin = object.__new__(CachingAllocatorSimulator)
        twin.__dict__.update(self.__dict__)
        pools = {id(self._small): _Pool("small", is_small=True), id(self._large): _Pool("large", is_small=False)}
        twin._small, twin._large = pools[id(self._small)], pools[id(self._large)]
        blocks: dict[int, _Block] = {}
        twin._segments = {}
        for key, segment in self._segments.items():
            twin._segments[key] = segment.copy(pools, blocks)
        for old in (self._small, self._large):
            new = pools[id(old)]
            new.free = list(old.free)
            new.by_address = {address: blocks[id(b)] for address, b in old.by_address.items()}
            new.unmapped = {address: blocks[id(b)] for address, b in old.unmapped.items()}
            new.lookups = old.lookups
        segment_of = {id(old): twin._segments[key] for key, old in self._segments.items()}
        twin._expandable = {name: segment_of[id(segment)] for name, segment in self._expandable.items()}
        twin._live = {key: None if block is None else blocks[id(block)] for key, block in self._live.items()}
        return twin

    def set_capacity(self, capacity_bytes: int | None) -> None:
        """Hold reserved memory to ``capacity_bytes`` from now on (a replay resumed under a limit)."""
        if capacity_bytes is not None:
            _check_nbytes(capacity_bytes, "capacity_bytes")
        self._capacity = capacity_bytes
        self._lookups_counted = self._garbage_collects()

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
        """Bytes in segments (or mapped pages) held from the driver now (``reserved_bytes.all.current``)."""
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
    def segments_made(self) -> int:
        """How many segments it has taken from the driver (``cudaMalloc`` calls; an expandable pool's first one)."""
        return self._next_segment

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
        """How many allocations had to release every cached block and retry (``num_alloc_retries``)."""
        return self._num_alloc_retries

    def reset_peaks(self) -> None:
        """Restart peak tracking from the current values, like ``torch.cuda.reset_peak_memory_stats``."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def snapshot(self) -> list[SegmentInfo]:
        """Describe every segment and its blocks, in creation order, for inspection and tests. An expandable
        segment is described by its mapped blocks, as torch describes it."""
        return [segment.info() for segment in self._segments.values()]

    # -- events -------------------------------------------------------------------------------------------

    def malloc(self, key: int, nbytes: int) -> int:
        """Allocate ``nbytes`` for the storage ``key`` and return the size of the block handed out.

        The returned size is what ``allocated_bytes`` grows by: the rounded request, or a whole cached
        block when the leftover would be too small to split off.
        """
        if key in self._live:
            raise InvalidInputError(f"storage {key!r} is already allocated; free it before allocating it again")
        _check_nbytes(nbytes, "the requested size")
        return self.allocate_rounded(key, nbytes, round_size(nbytes))

    def allocate_rounded(self, key: int, nbytes: int, size: int) -> int:
        """``malloc`` of a request already checked and rounded (``size`` is ``round_size(nbytes)``), for a replay
        that has checked its log once: the same handout, without checking each event again."""
        if size == 0:
            self._live[key] = None
            return 0
        pool = self._small if size <= SMALL_SIZE else self._large
        # get_free_block, then taking the block out of the pool: one search of the sorted free list serves both
        if self._lookups_counted:
            pool.lookups += 1
        free = pool.free
        index = bisect_left(free, (size,))
        block = None if index == len(free) else pool.by_address[free[index][1]]
        limit = self.config.max_split_size
        # max_split_size: an oversize block is not handed to a smaller request, nor a much larger one to a large one
        if (
            block is not None
            and limit is not None
            and block.size >= (limit if size < limit else size + self.config.max_non_split_rounding)
        ):
            block = None
        if block is None:
            block = self._new_block(pool, size, nbytes)
        else:
            del free[index]
            del pool.by_address[block.address]
        remaining = block.size - size  # should_split
        if pool.is_small or self.config.expandable_segments:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = (limit is None or size < limit) and remaining > SMALL_SIZE
        if split:
            pool.split(block, size)
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
        pool.insert(pool.merged(block))

    def empty_cache(self) -> None:
        """Give every cached block back to the driver, like ``torch.cuda.empty_cache``."""
        self._release_cached_blocks()

    # -- finding memory -----------------------------------------------------------------------------------

    def _new_block(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        """Memory from the driver (``alloc_block``), freeing cached memory and retrying at the capacity as the
        allocator does; past that the out-of-memory is recorded and the block made anyway."""
        if self._garbage_collects():
            self._garbage_collect()
        block = self._alloc(pool, size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc(pool, size)
        if block is None:
            self._num_alloc_retries += 1
            self._release_cached_blocks()
            block = self._alloc(pool, size)
        if block is None:
            self._num_ooms += 1
            if self._first_oom_request is None:
                self._first_oom_request = nbytes
            block = self._alloc(pool, size, over_capacity=True)
            assert block is not None
        return block

    def _room(self, extra: int, over_capacity: bool) -> bool:
        return over_capacity or self._capacity is None or self._reserved + extra <= self._capacity

    def _alloc(self, pool: _Pool, size: int, over_capacity: bool = False) -> _Block | None:
        if self.config.expandable_segments:
            return self._map_expandable(pool, size, over_capacity)
        alloc_size = segment_size(size)
        if not self._room(alloc_size, over_capacity):
            return None
        base = self.next_segment_address
        if base is None:  # later segments lie lower, as the driver places them (see the module docstring)
            base = (_SEGMENT_SLOTS - self._next_segment) << _ADDRESS_BITS
        self.next_segment_address = None
        segment = _Segment(self._next_segment, base, alloc_size, pool)
        self._next_segment += 1
        self._segments[segment.index] = segment
        self._grow_reserved(alloc_size)
        return segment.head

    def _grow_reserved(self, size: int) -> None:
        self._reserved += size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    # -- expandable segments ------------------------------------------------------------------------------

    def _map_expandable(self, pool: _Pool, size: int, over_capacity: bool) -> _Block | None:
        """``try_allocate_expandable_block``: the lowest address where ``size`` fits in free and unmapped address
        space (``find_expandable_block``), its missing pages mapped."""
        segment = self._expandable.get(pool.name)
        if segment is None:
            segment = _Segment(self._next_segment, (self._next_segment + 1) << _ADDRESS_BITS, 1 << 46, pool, True)
            self._next_segment += 1
            self._segments[segment.index] = segment
            self._expandable[pool.name] = segment
            pool.insert(segment.head)
        start = self._expandable_room(pool, size)
        unmapped, pages = 0, pool.page
        block: _Block | None = start
        covered = 0
        while covered < size and block is not None:  # the pages this allocation maps
            if not block.mapped:
                unmapped += min(block.size, size - covered)
            covered += block.size
            block = block.next
        mapped = -(-unmapped // pages) * pages
        if not self._room(mapped, over_capacity):
            return None
        candidate = start if start.mapped else self._map(pool, start, min(start.size, size))
        while candidate.size < size:  # a free block, then unmapped space: map what is missing, merged into it
            following = candidate.next
            assert following is not None and not following.mapped and not following.allocated
            candidate = self._map(pool, following, size - candidate.size)
        pool.remove(candidate)
        return candidate

    def _expandable_room(self, pool: _Pool, size: int) -> _Block:
        """The first block, by address, of free address space (a free mapped block before an unmapped one, or
        the unmapped one) with ``size`` bytes of allocatable blocks from it."""
        for address in sorted(pool.unmapped):
            block = pool.unmapped[address]
            if block.prev is not None and not block.prev.allocated and block.prev.mapped:
                block = block.prev
            room, probe = 0, block
            while probe is not None and not probe.allocated and room < size:
                room += probe.size
                probe = probe.next
            if room >= size:
                return block
        raise AssertionError("an expandable segment always ends in unmapped address space")

    def _map(self, pool: _Pool, block: _Block, size: int) -> _Block:
        """Map the pages of ``block``'s first ``size`` bytes (rounded up to a page); the rest stays unmapped."""
        mapped = min(block.size, -(-size // pool.page) * pool.page)
        pool.remove(block)
        if mapped < block.size:
            rest = _Block(block.segment, block.address - block.offset, block.offset + mapped, block.size - mapped,
                          mapped=False)  # fmt: skip
            _link_after(block, rest)
            block.size = mapped
            pool.insert(rest)
        block.mapped = True
        self._grow_reserved(mapped)
        merged = pool.merged(block)
        pool.insert(merged)
        return merged

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: give the whole pages inside a cached block back; partial pages at its ends stay."""
        page = pool.page
        first = -(-block.offset // page) * page  # pages count from the segment's start
        last = (block.offset + block.size) // page * page
        if last <= first:
            return
        pool.remove(block)
        base = block.address - block.offset
        if first > block.offset:
            before = _Block(block.segment, base, block.offset, first - block.offset)
            _link_before(block, before)
            pool.insert(before)
        if last < block.offset + block.size:
            after = _Block(block.segment, base, last, block.offset + block.size - last)
            _link_after(block, after)
            pool.insert(after)
        block.offset, block.address, block.size, block.mapped = first, base + first, last - first, False
        self._reserved -= block.size
        pool.insert(pool.merged(block))

    # -- releasing cached memory --------------------------------------------------------------------------

    def _garbage_collects(self) -> bool:
        return self.config.garbage_collection_threshold > 0 and self._capacity is not None

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above the threshold share of the capacity, free the whole cached
        large segments that have waited longest (at least the average wait, repeatedly) until below it."""
        assert self._capacity is not None
        threshold = int(self.config.garbage_collection_threshold * self._capacity)
        if self._reserved <= threshold:
            return
        target, reclaimed = self._reserved - threshold, 0
        pool = self._large
        candidates = [b for b in pool.by_address.values() if b.prev is None and b.next is None]
        while candidates and reclaimed < target:
            ages = {id(b): pool.lookups - b.gc_base for b in candidates}
            average = sum(ages.values()) / len(candidates)
            old = [b for b in sorted(candidates, key=lambda b: (b.size, b.address)) if ages[id(b)] >= average]
            if not old:
                break
            for block in old:
                reclaimed += block.size
                self._release_segment(block)
            candidates = [b for b in candidates if b not in old]

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """With a ``max_split_size``, free one cached oversize block that fits ``size``, or the largest ones
        until their sizes add up to it; without one, nothing (``release_available_cached_blocks``)."""
        limit = self.config.max_split_size
        if limit is None or self.config.expandable_segments:
            return False
        key = max(size, limit)
        whole = [(s, a) for s, a in pool.free if pool.by_address[a].prev is None and pool.by_address[a].next is None]
        fitting = [entry for entry in whole if entry[0] >= key]
        if fitting:
            self._release_segment(pool.by_address[fitting[0][1]])
            return True
        released = 0
        for block_size, address in reversed(whole):
            if released >= key or block_size < limit:
                break
            released += block_size
            self._release_segment(pool.by_address[address])
        return released >= key

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: every cached whole segment back to the driver, every expandable segment's
        cached pages unmapped."""
        for pool in (self._large, self._small):
            for block in list(pool.by_address.values()):
                if self._segments[block.segment].expandable:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_segment(block)

    def _release_segment(self, block: _Block) -> None:
        segment = self._segments.pop(block.segment)
        segment.pool.remove(block)
        self._reserved -= segment.size
