"""``StepCurve``: one traced step read at any batch size and sequence length.

A ``MemoryEstimate`` is a value: the peaks at the batch traced. Reading the same step at another batch needs the
trace it came from, and a ``StepCurve`` is the object that holds it (``memfit.trace``): from a symbolic trace
(the default, ``memfit.prediction.exact``) every batch is the step's log read at that batch and replayed, what a
trace at it gives; where the step cannot be traced symbolically, the fit between the two traced batches. A batch
the trace does not cover (batch 1, one outside the conditions the model put on the batch) is traced when first
asked, so a curve holds its model; the value it answers with holds neither.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from memfit.devices.catalog import capacity_bytes as _capacity_of
from memfit.errors import EstimationError, InvalidInputError, MemfitError
from memfit.prediction.values import BatchPeak, MemoryEstimate
from memfit.simulation.allocator import AllocatorConfig
from memfit.simulation.replay import LimitFit, PhasePeak

__all__ = ["PeakReplayer", "StepCurve"]

_MAX_BATCH = 1 << 31


class PeakReplayer(Protocol):
    """``(batch, seq_len) -> phase peaks`` of a step replayed from its trace (``None``: no trace covers it). A
    replayer may also offer ``least_reserved``, ``at_limit`` and ``estimate_at_length`` (``ExactPeaks``)."""

    def __call__(self, batch: int, seq_len: int | None = None) -> tuple[PhasePeak, ...] | None: ...


@dataclass(frozen=True)
class StepCurve:
    """A traced step: ``estimate`` (the value at the traced batch) and what reads the step at any other.

    ``replayer`` replays the step's symbolic trace at a batch (``memfit.prediction.exact.ExactPeaks``); ``None``
    where the step was traced concretely at two batches (``MEMFIT_TRACE=concrete``, or a step that cannot be traced
    with a symbolic batch; the notes say), and ``at()`` then reads the fit between them.
    """

    estimate: MemoryEstimate
    replayer: PeakReplayer | None = field(default=None, repr=False, compare=False)

    @property
    def exact(self) -> bool:
        """Every batch is read off a trace of the step (a symbolic one), not the fit between two batches."""
        return self.replayer is not None

    def replaced(self, **changes: Any) -> StepCurve:
        """This curve with its estimate's fields changed (``dataclasses.replace``); the trace is the same."""
        return StepCurve(dataclasses.replace(self.estimate, **changes), self.replayer)

    def with_notes(self, *notes: str) -> StepCurve:
        """This curve with more notes on its estimate (``MemoryEstimate.with_notes``)."""
        noted = self.estimate.with_notes(*notes)
        return self if noted is self.estimate else StepCurve(noted, self.replayer)

    def at(self, batch_size: int, seq_len: int | None = None) -> BatchPeak:
        """Predicted peaks at ``batch_size`` (and ``seq_len`` tokens a sample; default: the traced sample's).

        From a symbolic trace (the default, ``memfit.prediction.exact``): the step's log read at that batch and
        replayed, what a trace at it gives. Otherwise (``MEMFIT_TRACE=concrete``, or a step that cannot be
        traced symbolically; the notes say) from the per-phase linear models: at the traced batch at least the
        traced peak (the worst allocator ratios of both traces are applied); for a decision at one batch size,
        trace at that size.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInputError(f"batch_size must be a positive integer, got {batch_size!r}")
        if seq_len is not None and seq_len != self.estimate.seq_len:
            return self._at_length(batch_size, seq_len)
        replayed = self.replayer(batch_size) if self.replayer is not None else None
        if replayed is not None:  # the step's log at this batch, replayed: what a trace at it gives
            allocated = max(p.allocated_bytes for p in replayed)
            reserved = max(p.reserved_bytes for p in replayed)
            return BatchPeak(batch_size, allocated, reserved, reserved + (self.estimate.cuda_context_bytes or 0))
        tensors = max(model.at(batch_size) for model in self.estimate.phase_models)
        # Whole-block handouts and fragmentation do not grow linearly with the batch: scale by the
        # worst ratios traced, which keeps at() monotonic and never below the traced peaks.
        allocated = math.ceil(tensors * self.estimate.allocated_to_tensor_ratio)
        reserved = math.ceil(allocated * self.estimate.reserved_to_allocated_ratio)
        return BatchPeak(batch_size, allocated, reserved, reserved + (self.estimate.cuda_context_bytes or 0))

    def least_device_bytes(
        self, batch_size: int, *, seq_len: int | None = None, allocator: AllocatorConfig | None = None
    ) -> int | None:
        """The least memory the step at ``batch_size`` runs in, CUDA context included, when the caching allocator
        reaches its limit: it frees its cached blocks and retries before it runs out of memory, so a step fits
        where its blocks do, below the peak it reserves with room to spare (``at().device_bytes``).

        ``allocator``: the allocator's options (default: this process's ``PYTORCH_ALLOC_CONF``). ``None`` where the
        step's log cannot be replayed at that batch (a CPU target, or an estimate on the concrete path).
        """
        least = getattr(self.replayer, "least_reserved", None)
        if least is None or self.estimate.cuda_context_bytes is None:
            return None
        config = allocator if allocator is not None else AllocatorConfig.from_environment()
        reserved = least(batch_size, seq_len, config)
        return None if reserved is None else reserved + self.estimate.cuda_context_bytes

    def at_limit(
        self,
        batch_size: int,
        capacity_bytes: int | str,
        *,
        include_context: bool = True,
        seq_len: int | None = None,
        allocator: AllocatorConfig | None = None,
    ) -> LimitFit | None:
        """The step at ``batch_size`` replayed with the caching allocator held to ``capacity_bytes`` (less the CUDA
        context unless ``include_context=False``): whether it runs, and after how many allocator retries.
        ``None`` where the log cannot be replayed (see ``least_device_bytes``). ``capacity_bytes``: bytes, a size
        such as ``"20GiB"`` or a GPU name such as ``"h100"``, as ``memfit.plan`` takes it."""
        capacity_bytes = _capacity(capacity_bytes)
        replay_limit = getattr(self.replayer, "at_limit", None)
        if replay_limit is None or self.estimate.cuda_context_bytes is None:
            return None
        config = allocator if allocator is not None else AllocatorConfig.from_environment()
        limit = capacity_bytes - (self.estimate.cuda_context_bytes if include_context else 0)
        return replay_limit(batch_size, seq_len, limit, config)

    def _at_length(self, batch_size: int, seq_len: int) -> BatchPeak:
        """At another sequence length: the symbolic trace read there (or a trace of its own), never the fit."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise InvalidInputError(f"seq_len must be a positive integer, got {seq_len!r}")
        if self.estimate.seq_len is None:
            raise InvalidInputError("seq_len: this step's sample has no sequence dimension (token ids) to vary")
        if self.replayer is None:
            raise InvalidInputError(
                "seq_len: this estimate cannot answer other sequence lengths (it was not traced symbolically; see its "
                "notes); estimate a sample of that length"
            )
        try:
            replayed = self.replayer(batch_size, seq_len)
        except MemfitError:
            raise
        except Exception as exc:
            raise EstimationError(f"the step could not be traced at sequence length {seq_len}: {exc}") from exc
        if not replayed:
            raise EstimationError(f"the step could not be traced at sequence length {seq_len}")
        allocated = max(p.allocated_bytes for p in replayed)
        reserved = max(p.reserved_bytes for p in replayed)
        return BatchPeak(batch_size, allocated, reserved, reserved + (self.estimate.cuda_context_bytes or 0))

    def for_seq_len(self, seq_len: int) -> StepCurve:
        """This step with samples of ``seq_len`` tokens, read off the same trace: every figure, and ``at()``, at
        that length (a sharded run's per-rank terms kept)."""
        if seq_len == self.estimate.seq_len:
            return self
        return self.rebuilt_at(self.estimate.batch_size, seq_len)

    def rebuilt_at(self, batch_size: int, seq_len: int) -> StepCurve:
        """``for_seq_len`` traced at ``batch_size``: the estimate a trace at that batch and length gives."""
        self._at_length(batch_size, seq_len)  # says what is wrong with the length, if anything
        source = getattr(self.replayer, "estimate_at_length", None)
        if source is None:
            raise InvalidInputError("seq_len: this estimate cannot be rebuilt at another sequence length")
        other: StepCurve = source(batch_size, seq_len)
        value = self.estimate
        return other.replaced(
            sharding=value.sharding, rank_terms=value.rank_terms, rank_model=value.rank_model,
            host_bytes_per_node=value.host_bytes_per_node, trace_seconds=value.trace_seconds,
            notes=tuple(dict.fromkeys([*value.notes, *other.estimate.notes])),
        )  # fmt: skip

    def max_batch_size(
        self,
        capacity_bytes: int | str,
        *,
        include_context: bool = True,
        seq_len: int | None = None,
        at_limit: bool = True,
        allocator: AllocatorConfig | None = None,
    ) -> int | None:
        """Largest batch that runs in ``capacity_bytes`` (``None``: not even 1): bytes, a size such as ``"20GiB"`` or
        a GPU name such as ``"h100"``, as ``memfit.plan`` takes it.

        ``include_context=False`` when the capacity was measured after CUDA started in this
        process (``torch.cuda.mem_get_info`` then already excludes the context).

        ``seq_len``: at that many tokens a sample (default: the traced sample's).

        By default (``at_limit=True``, as ``memfit.plan``) it asks where the step really runs out of memory: the
        allocator frees its cache and retries at its limit (each batch's step replayed held to the capacity, under
        ``allocator``'s options, default this process's ``PYTORCH_ALLOC_CONF``). ``at_limit=False``: where its peak
        with room to spare reaches the capacity (also where the log cannot be replayed: a CPU target, the concrete
        path).

        This reads ``at()``: exact from a symbolic trace; otherwise the interpolation from the two batch
        sizes traced, which can be off by a few samples either way (the allocator's rounding and the
        step's phases are not linear in the batch). A plan made with traces of the whole step
        (``memfit.plan(..., confirm=)``, the planning session the callbacks and ``memfit plan`` use)
        starts from this answer and then checks its way to the micro batch that fits while the next does
        not (replays of the symbolic trace, or concrete traces on the fallback path).
        """
        capacity_bytes = _capacity(capacity_bytes)
        overhead = (self.estimate.cuda_context_bytes or 0) if include_context else 0

        def fits(batch: int) -> bool:
            # at the allocator's limit: one replay held to the capacity says it (the least capacity the batch runs
            # in, ``least_device_bytes``, is a bisection of such replays, to 2 MiB)
            limited = self.at_limit(batch, capacity_bytes, include_context=include_context, seq_len=seq_len,
                                    allocator=allocator) if at_limit else None  # fmt: skip
            if limited is not None:
                return limited.fits
            return self.at(batch, seq_len).reserved_bytes + overhead <= capacity_bytes

        # with a symbolic trace, batch 1 takes a trace of its own: asked only when 2 does not fit
        if self.replayer is not None and fits(2):
            low, high = 2, 4
        elif not fits(1):
            return None
        else:
            low, high = 1, 2
        while high < _MAX_BATCH and fits(high):
            low, high = high, high * 2
        if high >= _MAX_BATCH and fits(_MAX_BATCH):
            return _MAX_BATCH
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


def _capacity(value: float | str) -> float:
    """A capacity given as bytes (as they are: a search may ask below zero), a size or a GPU name, as bytes; a bad one
    is refused in one line."""
    if isinstance(value, str):
        return _capacity_of(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"capacity_bytes must be bytes, a size such as '20GiB' or a GPU name, got {value!r}")
    return value
