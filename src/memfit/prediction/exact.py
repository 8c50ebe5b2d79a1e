"""Estimates from one symbolic trace: every batch size answered by replaying the allocator, exactly.

``estimate`` traces the step once with the batch symbolic (``memfit.tracing.symbolic``) and keeps the
trace: the estimate at the batch asked for, and ``StepCurve.at(b)`` for any other ``b``, are replays
of that trace's log read at ``b``, the same log a concrete trace at ``b`` records. A batch the trace does
not cover (batch 1, which symbolic shapes exclude, or one outside the conditions the model put on the
batch) is traced again: symbolically with that batch as its hint where it can, else concretely.

The traces are kept per model, sample and step settings (``_SESSIONS``), so a planner that asks
``trace`` at many batch sizes of one step (the callbacks' and the CLI's planning sessions) traces it
once. A model whose parameters, buffers or modules changed since is traced again. The kept traces hold
no tensors: the sample is kept as meta tensors, the model weakly (its sessions go when it goes), and
only the last eight sessions are kept. A curve holds its model itself (its ``ExactPeaks``): its ``at()`` may have
to trace it again (the symbolic trace after an estimate at batch 1, a batch outside the trace's conditions), and
answers the same whether or not the caller kept the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.categories import Category, Phase
from memfit.diagnostics import degrade
from memfit.errors import InvalidInputError, ValueDependentError
from memfit.prediction import forked
from memfit.prediction.curve import StepCurve
from memfit.simulation.allocator import AllocatorConfig
from memfit.simulation.replay import LimitFit, LimitReplayer, PhasePeak, StepReplays, TimelinePoint, replay, replay_step
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing import trace_cache, trace_data
from memfit.tracing.batch import rebatch
from memfit.tracing.checkpointing import find_blocks
from memfit.tracing.depth import TEMPLATE_BLOCK, DepthMismatch, deepen, deepen_symbolic
from memfit.tracing.known_masks import holds_only_ones, shape_only
from memfit.tracing.model_limits import check_sequence_length
from memfit.tracing.recorder import StorageRecorder
from memfit.tracing.symbolic import (
    SymbolicTrace,
    SymbolicUnavailable,
    resequenced,
    sequence_length,
    trace_symbolic,
)
from memfit.tracing.tracer import StepTrace, TraceSettings, trace_steps

__all__ = [
    "DeepSession",
    "ExactPeaks",
    "StepSession",
    "clear_sessions",
    "deep_session",
    "exact_estimates",
    "kept_sessions",
    "step_session",
]

_KEPT_SESSIONS = 8
_KEPT_REPLAYERS = 4  # batches whose limit replays an estimate keeps (each holds checkpoints of its replay)


class StepSession:
    """The traces of one step (model, sample, settings): symbolic ones, and concrete ones where needed."""

    def __init__(self, model: nn.Module, sample: Any, sample_batch: int, settings: TraceSettings) -> None:
        self._model = weakref.ref(model)
        self._sample, self.sample_batch, self.settings = sample, sample_batch, settings
        self.symbolic: list[SymbolicTrace] = []
        self.concrete: dict[int, StepTrace] = {}
        self.other_lengths: dict[tuple[int, int], StepTrace] = {}  # (batch, sequence length) -> concrete trace
        self.with_length: SymbolicTrace | None = None  # the sequence length symbolic too (``ensure_with_length``)
        self.length_unavailable: str | None = None  # why there is none
        self.unavailable: str | None = None  # why the step cannot be traced symbolically
        self.trace_seconds = 0.0
        self.deep_sessions: dict[int, DeepSession] = {}  # depth -> the deep model's session built from this one
        self._prefetched: dict[str, tuple[Any, float]] = {}  # part -> a trace a forked child took (``aside``)
        self._factory = callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple))
        self.seq_len = sequence_length(*self._sample_at(2)) if self._factory else sequence_length(sample, sample_batch)
        self._cache_key = trace_cache.session_key(model, sample, sample_batch, settings)

    def ensure_symbolic(self, hint: int) -> bool:
        """Trace symbolically once (at ``hint``, >= 2) unless done or known impossible; whether one exists."""
        model = self._model()
        if not self.symbolic and self.unavailable is None and model is not None:
            try:
                self.symbolic.append(self._symbolic(model, hint, symbolic_sequence=False))
            except SymbolicUnavailable as exc:
                self.unavailable = exc.reason
        return bool(self.symbolic)

    def trace_at(self, batch: int, seq_len: int | None = None) -> tuple[StepTrace, str | None]:
        """The step's log at ``batch`` (and ``seq_len``; default: the sample's) and, where it took a trace of its
        own, why (in plain words)."""
        if seq_len is not None and seq_len != self.seq_len:
            return self._at_length(batch, seq_len)
        if not self.symbolic and batch in self.concrete:  # traced already, before any symbolic trace was needed
            return self.concrete[batch], None
        for symbolic in self.symbolic:
            if symbolic.valid(batch):
                return symbolic.at(batch), None
        model = self._model()
        if model is None:
            raise LookupError("the model was garbage collected")
        if batch >= 2 and self.unavailable is None:
            try:
                symbolic = self._symbolic(model, batch, symbolic_sequence=False)
            except SymbolicUnavailable as exc:
                if not self.symbolic:
                    self.unavailable = exc.reason
            else:
                self.symbolic.append(symbolic)
                if self.symbolic[0] is not symbolic:
                    return symbolic.at(batch), _outside_note(batch, self.symbolic[0])
                return symbolic.at(batch), None
        if batch not in self.concrete:
            self.concrete[batch] = self._concrete(model, self._sample, self.sample_batch, batch)
        if self.unavailable is not None:
            return self.concrete[batch], f"traced at each batch size: {self.unavailable}"
        if batch == 1:
            return self.concrete[batch], (
                "batch 1 is traced on its own: a symbolic batch covers sizes from 2 up, as a dimension of size 1 "
                "can broadcast and change the step"
            )
        return self.concrete[batch], _outside_note(batch, self.symbolic[0]) if self.symbolic else None

    def ensure_with_length(self, hint: int) -> SymbolicTrace | None:
        """The trace with the sequence length symbolic too, taken once, when another length is first asked for (a
        second symbol makes a trace about twice as slow, so the batch-only one serves the sample's own length)."""
        model = self._model()
        if self.with_length is None and self.length_unavailable is None and model is not None:
            if self.seq_len is None:
                self.length_unavailable = "the sample has no sequence dimension"
            else:
                try:
                    traced = self._symbolic(model, hint, symbolic_sequence=True)
                except SymbolicUnavailable as exc:
                    self.length_unavailable = exc.reason
                else:
                    if traced.seq is None:
                        self.length_unavailable = "the step cannot run with its sequence length symbolic"
                    else:
                        self.with_length = traced
        return self.with_length

    def _at_length(self, batch: int, seq_len: int) -> tuple[StepTrace, str | None]:
        """Another sequence length: read off the trace with the length symbolic where it covers it, else traced
        concretely with the sample remade at that length."""
        symbolic = self.ensure_with_length(max(2, batch))
        if batch >= 2 and symbolic is not None and symbolic.valid(batch, seq_len):
            return symbolic.at(batch, seq_len), None
        why = "batch 1" if batch == 1 else (self.length_unavailable or "outside the trace's conditions")
        return self.concrete_trace(batch, seq_len), f"sequence length {seq_len} traced on its own ({why})"

    def concrete_trace(self, batch: int, seq_len: int | None = None) -> StepTrace:
        """A concrete trace at ``batch`` (and ``seq_len``, the sample remade at that length), kept."""
        model = self._model()
        if model is None:
            raise LookupError("the model was garbage collected")
        if seq_len is not None and seq_len != self.seq_len:
            if self.seq_len is None:
                raise InvalidInputError("the sample has no sequence dimension (token ids) to set seq_len of")
            key = (batch, seq_len)
            if key not in self.other_lengths:
                sample, sample_batch = self._sample_at(batch)
                sample = resequenced(sample, sample_batch, self.seq_len, seq_len)
                self.other_lengths[key] = self._concrete(model, sample, sample_batch, batch, seq_len)
            return self.other_lengths[key]
        if batch not in self.concrete:
            self.concrete[batch] = self._concrete(model, self._sample, self.sample_batch, batch)
        return self.concrete[batch]

    def aside(self, part: str) -> contextlib.AbstractContextManager[None]:
        """A ``with`` block during which a forked child takes this session's trace ``part`` (``symbolic:<hint>:<0|1>``
        or ``concrete:<batch>:None``) while the body takes another's (``memfit.prediction.forked``); nothing where the
        session has it, the cache keeps it, or no child can be forked."""
        model = self._model()
        kind, value, flag = part.split(":")
        had = {"symbolic": self.symbolic or self.unavailable is not None, "concrete": int(value) in self.concrete}
        if flag == "1":
            had["symbolic"] = self.with_length is not None or self.length_unavailable is not None
        if model is None or had[kind] or part in self._prefetched or self._kept_on_disk(part):
            return contextlib.nullcontext()
        sample, sample_batch, settings = self._sample, self.sample_batch, self.settings

        def compute() -> Any:
            if kind == "concrete":
                return trace_data.encode_trace(trace_steps(model, sample, sample_batch, int(value), settings))
            try:
                traced = trace_symbolic(model, sample, sample_batch, settings, hint=int(value),
                                        symbolic_sequence=flag == "1")  # fmt: skip
            except SymbolicUnavailable as exc:
                return {"unavailable": exc.reason}
            return {"trace": trace_data.encode_symbolic(traced)}

        return forked.aside(compute, lambda data, seconds: self._prefetched.__setitem__(part, (data, seconds)))

    def _kept_on_disk(self, part: str) -> bool:
        if self._cache_key is None or not trace_cache.enabled():
            return False
        try:
            return trace_cache.holds(self._cache_key, self._part(part))
        except trace_cache.Uncacheable:
            return False

    def _traced(self, part: str, trace: Callable[[], Any], decode: Callable[[Any], Any]) -> Any:
        """``trace()``, timed; or what a forked child took of ``part`` (decoded as the cache decodes it)."""
        prefetched = self._prefetched.pop(part, None)
        if prefetched is None:
            return self._timed(trace)
        data, seconds = prefetched
        self.trace_seconds += seconds
        return decode(data)

    def _sample_at(self, batch: int) -> tuple[Any, int]:
        """The sample and its batch size: a sample factory's batch at ``batch``, else the sample itself."""
        if self._factory:
            return self._sample(batch), batch
        return self._sample, self.sample_batch

    def _symbolic(self, model: nn.Module, hint: int, *, symbolic_sequence: bool) -> SymbolicTrace:
        """A symbolic trace at ``hint``: from the trace cache where it holds this step's, else traced (and kept).

        Raises:
            SymbolicUnavailable: the step cannot run with a symbolic batch (remembered in the cache too).
        """
        part = f"symbolic:{hint}:{int(symbolic_sequence)}"
        kept = self._cached(part, _decode_symbolic_outcome)
        if isinstance(kept, SymbolicTrace):
            return kept
        if isinstance(kept, str):
            raise SymbolicUnavailable(kept)
        try:
            traced = self._traced(part, lambda: trace_symbolic(model, self._sample, self.sample_batch, self.settings,
                                                               hint=hint, symbolic_sequence=symbolic_sequence),
                                  _symbolic_or_raise)  # fmt: skip
        except SymbolicUnavailable as exc:
            reason = exc.reason
            self._keep(part, lambda: {"unavailable": reason})
            raise
        self._keep(part, lambda: {"trace": trace_data.encode_symbolic(traced)})
        return traced

    def _concrete(self, model: nn.Module, sample: Any, sample_batch: int, batch: int, seq_len: int | None = None
                  ) -> StepTrace:  # fmt: skip
        part = f"concrete:{batch}:{seq_len}"
        kept = self._cached(part, trace_data.decode_trace)
        if kept is not None:
            return kept
        if seq_len is None and sample is self._sample:
            traced = self._traced(part, lambda: trace_steps(model, sample, sample_batch, batch, self.settings),
                                  trace_data.decode_trace)  # fmt: skip
        else:
            traced = self._timed(lambda: trace_steps(model, sample, sample_batch, batch, self.settings))
        self._keep(part, lambda: trace_data.encode_trace(traced))
        return traced

    def _cached(self, part: str, decode: Callable[[Any], Any]) -> Any:
        if self._cache_key is None:
            return None
        try:
            part = self._part(part)
        except trace_cache.Uncacheable:
            return None
        return trace_cache.load(self._cache_key, part, decode)

    def _keep(self, part: str, encode: Callable[[], Any]) -> None:
        if self._cache_key is None:
            return
        try:
            trace_cache.store(self._cache_key, self._part(part), encode())
        except trace_cache.Uncacheable:
            return

    def _part(self, part: str) -> str:
        """A trace's part of the key; a factory's batch at the traced size is in it (what the trace reads)."""
        return trace_cache.trace_part(part, self._sample, int(part.split(":")[1]))

    def _timed(self, trace: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return trace()
        finally:
            self.trace_seconds += time.perf_counter() - started

    @property
    def range_note(self) -> str | None:
        return self.symbolic[0].range_note() if self.symbolic else None


def _symbolic_or_raise(value: dict[str, Any]) -> SymbolicTrace:
    """A symbolic trace a forked child took; ``SymbolicUnavailable`` where it found the step cannot be taken so."""
    outcome = _decode_symbolic_outcome(value)
    if isinstance(outcome, str):
        raise SymbolicUnavailable(outcome)
    return outcome


def _decode_symbolic_outcome(value: dict[str, Any]) -> SymbolicTrace | str:
    """A kept symbolic trace, or the reason the step cannot be traced symbolically."""
    if "unavailable" in value:
        return str(value["unavailable"])
    return trace_data.decode_symbolic(value["trace"])


def _outside_note(batch: int, symbolic: SymbolicTrace) -> str:
    return f"batch {batch} is traced on its own: the model branches on the batch size ({symbolic.range_note()})"


class DeepSession:
    """The traces of a model ``depth`` blocks deep, each built from the same step's traces at two shallow depths
    (``memfit.tracing.depth``): a plan of an eighty-block model from traces of three and four blocks.

    It answers as a ``StepSession`` of the whole model does: with a symbolic batch from 2 up, batch 1 (and any
    batch outside the symbolic traces' conditions) from concrete traces.

    Raises (from ``ensure_symbolic``, ``trace_at``, ``concrete_trace``):
        DepthMismatch: the model's blocks do not repeat one another; trace the whole model instead.
    """

    def __init__(self, shallow: StepSession, deeper: StepSession, depth: int, depths: tuple[int, int]) -> None:
        self._shallow, self._deeper, self.depth, self.depths = shallow, deeper, depth, depths
        self.symbolic: list[SymbolicTrace] = []
        self.with_length: SymbolicTrace | None = None
        self.concrete: dict[int, StepTrace] = {}
        self.other_lengths: dict[tuple[int, int], StepTrace] = {}  # (batch, sequence length) -> built trace

    @property
    def unavailable(self) -> str | None:
        return self._shallow.unavailable or self._deeper.unavailable

    @property
    def trace_seconds(self) -> float:
        return self._shallow.trace_seconds + self._deeper.trace_seconds

    def ensure_symbolic(self, hint: int) -> bool:
        """Both models' symbolic traces, the shallow one built to the whole depth (checked against the other)."""
        if self.symbolic:
            return True
        with self._deeper.aside(f"symbolic:{hint}:0"):  # the two traces at once, where a child can take one
            shallow = self._shallow.ensure_symbolic(hint)
        if shallow and self._deeper.ensure_symbolic(hint):
            base, check = self._shallow.symbolic[0], self._deeper.symbolic[0]
            self.symbolic.append(deepen_symbolic(base, self.depth, check=check))
        return bool(self.symbolic)

    @property
    def seq_len(self) -> int | None:
        return self._shallow.seq_len

    def ensure_with_length(self, hint: int) -> SymbolicTrace | None:
        """Both models' traces with the sequence length symbolic too, the shallow one built to the whole depth."""
        if self.with_length is None:
            with self._deeper.aside(f"symbolic:{hint}:1"):
                base = self._shallow.ensure_with_length(hint)
            check = self._deeper.ensure_with_length(hint)
            if base is not None and check is not None:
                self.with_length = deepen_symbolic(base, self.depth, check=check)
        return self.with_length

    def trace_at(self, batch: int, seq_len: int | None = None) -> tuple[StepTrace, str | None]:
        if seq_len == self.seq_len:
            seq_len = None
        if seq_len is not None:
            symbolic = self.ensure_with_length(max(2, batch))
            if batch >= 2 and symbolic is not None and symbolic.valid(batch, seq_len):
                return symbolic.at(batch, seq_len), None
            return self.concrete_trace(batch, seq_len), f"sequence length {seq_len} traced on its own"
        for symbolic in self.symbolic:
            if symbolic.valid(batch):
                return symbolic.at(batch), None
        note = None
        if self.unavailable is not None:
            note = f"traced at each batch size: {self.unavailable}"
        elif batch == 1:
            note = (
                "batch 1 is traced on its own: a symbolic batch covers sizes from 2 up, as a dimension of size 1 "
                "can broadcast and change the step"
            )
        elif self.symbolic:
            note = _outside_note(batch, self.symbolic[0])
        return self.concrete_trace(batch), note

    def concrete_trace(self, batch: int, seq_len: int | None = None) -> StepTrace:
        if seq_len is not None and seq_len != self.seq_len:
            key = (batch, seq_len)
            if key not in self.other_lengths:
                shallow = self._shallow.concrete_trace(batch, seq_len)
                deeper = self._deeper.concrete_trace(batch, seq_len)
                self.other_lengths[key] = deepen(shallow, self.depth, check=(shallow, deeper))
            return self.other_lengths[key]
        if batch not in self.concrete:
            with self._deeper.aside(f"concrete:{batch}:None"):
                shallow = self._shallow.concrete_trace(batch)
            self.concrete[batch] = deepen(shallow, self.depth, check=(shallow, self._deeper.concrete_trace(batch)))
        return self.concrete[batch]

    @property
    def range_note(self) -> str | None:
        return self.symbolic[0].range_note() if self.symbolic else None

    # Results read off the built traces (an ``ExactPeaks`` replay) are kept with the shallow session's traces,
    # keyed by the depth built to and the deeper session that checked the build.

    def _cached(self, part: str, decode: Callable[[Any], Any]) -> Any:
        deep = self._deep_part(part)
        return None if deep is None else self._shallow._cached(deep, decode)

    def _keep(self, part: str, encode: Callable[[], Any]) -> None:
        deep = self._deep_part(part)
        if deep is not None:
            self._shallow._keep(deep, encode)

    def _deep_part(self, part: str) -> str | None:
        checked_by = self._deeper._cache_key
        return None if checked_by is None else f"{part}:deep:{self.depth}:{checked_by}"


Session = StepSession | DeepSession


class ExactPeaks:
    """``batch -> phase peaks`` of one step on one GPU, replayed from the session's traces (cached per batch);
    ``transform`` rewrites each trace first (one rank's log of a sharded run).

    It holds ``models`` (the session holds them weakly): a batch the traces do not cover yet is traced on them,
    so a caller that let go of its model after ``estimate`` must get the same answers as one that kept it."""

    def __init__(
        self,
        session: Session,
        runtime: CudaRuntime | None,
        models: Sequence[nn.Module],
        transform: Callable[[StepTrace], StepTrace] | None = None,
        rebuild: Callable[[StepTrace, StepTrace], Any] | None = None,
    ) -> None:
        self._session, self._runtime, self._models, self._transform = session, runtime, tuple(models), transform
        self._rebuild = rebuild  # (trace, trace at another batch) -> the estimate of that step
        self._cache: dict[int, tuple[PhasePeak, ...] | None] = {}
        self._lengths: dict[tuple[int, int], tuple[PhasePeak, ...]] = {}
        self._least: dict[tuple[int, int | None, AllocatorConfig], int | None] = {}
        self._replayers: OrderedDict[tuple[int, int | None, AllocatorConfig], LimitReplayer | None] = OrderedDict()

    def __call__(self, batch: int, seq_len: int | None = None) -> tuple[PhasePeak, ...] | None:
        session = self._session
        if seq_len is not None and seq_len != session.seq_len:
            return self._at_length(batch, seq_len)
        if batch not in self._cache and (kept := self._kept("peaks", batch, None, (), _decode_peaks)) is not None:
            self._cache[batch] = kept
        if batch not in self._cache and batch not in session.concrete and not session.ensure_symbolic(max(2, batch)):
            return None  # no symbolic trace can be had: at() falls back to the fit, not a trace per batch
        if batch not in self._cache:
            try:
                trace, _ = self._session.trace_at(batch)
            except Exception as error:  # a failure away from the traced batch: at() falls back to the fit in the batch
                degrade(
                    f"memfit could not trace the step at batch {batch} ({type(error).__name__}: {error}); estimates "
                    "there come from the fit between the traced batches, which can be a few percent off",
                    error,
                    key=f"exact-peaks-{type(error).__name__}",
                )
                self._cache[batch] = None
            else:
                self._cache[batch] = self._replayed(trace)
                self._keep("peaks", batch, None, (), _encode_peaks(self._cache[batch]))
        return self._cache[batch]

    def step_replays(self, primary: StepTrace, secondary: StepTrace) -> StepReplays:
        """``replay_step`` of the two traces an estimate is built from (kept: a question asked again replays none)."""
        arguments = (secondary.batch_size, secondary.seq_len)
        kept = self._kept("step", primary.batch_size, primary.seq_len, arguments, _decode_step_replays)
        if kept is None:
            kept = _replayed_side_by_side(primary.recorder, secondary.recorder, self._runtime is not None)
            self._keep("step", primary.batch_size, primary.seq_len, arguments, _encode_step_replays(kept))
        return kept

    def _at_length(self, batch: int, seq_len: int) -> tuple[PhasePeak, ...]:
        """Another sequence length: no fit to fall back on, so a failure is the caller's to see."""
        self._check_length(seq_len)
        key = (batch, seq_len)
        if key not in self._lengths:
            kept = self._kept("peaks", batch, seq_len, (), _decode_peaks)
            if kept is None:
                trace, _ = self._session.trace_at(batch, seq_len)
                kept = self._replayed(trace)
                self._keep("peaks", batch, seq_len, (), _encode_peaks(kept))
            self._lengths[key] = kept
        return self._lengths[key]

    def estimate_at_length(self, batch: int, seq_len: int) -> StepCurve:
        """The step at ``batch`` with samples of ``seq_len`` tokens, from the same traces; its ``at()`` answers
        at that length."""
        if self._rebuild is None:
            raise InvalidInputError("this estimate cannot be rebuilt at another sequence length")
        self._check_length(seq_len)
        primary, note = self._session.trace_at(batch, seq_len)
        secondary, _ = self._session.trace_at(2 * batch, seq_len)
        if self._transform is not None:
            primary, secondary = self._transform(primary), self._transform(secondary)
        if self._runtime is not None:
            resize_workspace(primary, self._runtime.workspace_bytes)
            resize_workspace(secondary, self._runtime.workspace_bytes)
        built = self._rebuild(primary, secondary)
        notes = [note] if note else []
        return StepCurve(built, _AtLength(self, seq_len)).with_notes(*notes)

    def _check_length(self, seq_len: int) -> None:
        """Refuse a length the model has no positions for: its forward would fail, whatever the trace reads."""
        check_sequence_length(self._models[0], seq_len, fix="ask for {positions} tokens or fewer")

    def _replayed(self, trace: StepTrace) -> tuple[PhasePeak, ...]:
        if self._transform is not None:
            trace = self._transform(trace)
        return tuple(replay_for(trace, self._runtime))

    def least_reserved(self, batch: int, seq_len: int | None, config: AllocatorConfig) -> int | None:
        """The least reserved memory the step at ``batch`` runs in at the allocator's limit (``least_reserved``);
        ``None`` on a CPU target or where the step cannot be traced at that batch."""
        key = (batch, seq_len, config)
        if key not in self._least:
            least = self._kept("least", batch, seq_len, (config,), int)
            if least is None:
                replayer = self._replayer(batch, seq_len, config)
                least = None if replayer is None else replayer.least()
                if least is not None:
                    self._keep("least", batch, seq_len, (config,), least)
            self._least[key] = least
        return self._least[key]

    def at_limit(self, batch: int, seq_len: int | None, limit_bytes: int, config: AllocatorConfig) -> LimitFit | None:
        """The step at ``batch`` replayed with the allocator held to ``limit_bytes`` (``replay_at_limit``)."""
        fit = self._kept("limit", batch, seq_len, (config, limit_bytes), lambda data: LimitFit(**data))
        if fit is None:
            replayer = self._replayer(batch, seq_len, config)
            fit = None if replayer is None else replayer.at(limit_bytes)
            if fit is not None:
                self._keep("limit", batch, seq_len, (config, limit_bytes), dataclasses.asdict(fit))
        return fit

    # A replay's result is a function of the trace at the batch (the session's key and the batch), the runtime, the
    # replay's own arguments and the rewrite of the log, if any, so it is kept beside the traces: a question asked
    # again skips the replays too. A rewrite (``transform``: a sharded rank's log) is kept by its ``identity``, the
    # data it reads besides the trace (its code is memfit's, which the session's key holds); one without is not kept.

    def _replay_part(self, name: str, batch: int, seq_len: int | None, arguments: tuple[Any, ...]) -> str | None:
        rewrite = "" if self._transform is None else getattr(self._transform, "identity", None)
        if rewrite is None:
            return None
        return f"replay:{batch}:{name}:{seq_len}:{self._runtime!r}:{':'.join(map(repr, arguments))}{rewrite}"

    def _kept(
        self, name: str, batch: int, seq_len: int | None, arguments: tuple[Any, ...], decode: Callable[[Any], Any]
    ) -> Any:
        cached = getattr(self._session, "_cached", None)
        part = self._replay_part(name, batch, seq_len, arguments)
        return None if cached is None or part is None else cached(part, decode)

    def _keep(self, name: str, batch: int, seq_len: int | None, arguments: tuple[Any, ...], value: Any) -> None:
        keep = getattr(self._session, "_keep", None)
        part = self._replay_part(name, batch, seq_len, arguments)
        if keep is not None and part is not None:
            keep(part, lambda: value)

    def _replayer(self, batch: int, seq_len: int | None, config: AllocatorConfig) -> LimitReplayer | None:
        """The step's replays at limits, kept for the last few batches asked about (a planner asks each several)."""
        key = (batch, seq_len, config)
        if key in self._replayers:
            self._replayers.move_to_end(key)
            return self._replayers[key]
        trace = self._prepared(batch, seq_len)
        replayer = None if trace is None else LimitReplayer(trace.recorder, config)
        self._replayers[key] = replayer
        while len(self._replayers) > _KEPT_REPLAYERS:
            self._replayers.popitem(last=False)
        return replayer

    def _prepared(self, batch: int, seq_len: int | None) -> StepTrace | None:
        if self._runtime is None or self(batch, seq_len) is None:
            return None
        trace, _ = self._session.trace_at(batch, seq_len if seq_len != self._session.seq_len else None)
        if self._transform is not None:
            trace = self._transform(trace)
        resize_workspace(trace, self._runtime.workspace_bytes)
        return trace


# a log this long takes a few tenths of a second to replay; a forked child costs about 50 ms
_FORKED_REPLAY_EVENTS = 50_000


def _replayed_side_by_side(primary: StorageRecorder, secondary: StorageRecorder, simulate: bool) -> StepReplays:
    """``replay_step(primary, secondary, simulate)``, the secondary log replayed in a forked child while this process
    replays the primary one where the logs are long (``memfit.prediction.forked``: the same peaks, or the child's
    discarded and the log replayed here)."""
    if len(secondary.events) < _FORKED_REPLAY_EVENTS:
        return replay_step(primary, secondary, simulate)
    other: list[tuple[PhasePeak, ...]] = []
    with forked.aside(lambda: _encode_peaks(replay(secondary, simulate_cuda_allocator=simulate)),
                      lambda data, _: other.append(_decode_peaks(data))):  # fmt: skip
        timeline: list[TimelinePoint] = []
        peaks = replay(primary, simulate_cuda_allocator=simulate, timeline=timeline)
    if not other:
        other.append(tuple(replay(secondary, simulate_cuda_allocator=simulate)))
    return tuple(peaks), tuple(timeline), other[0]


def _encode_peaks(peaks: Sequence[PhasePeak]) -> list[dict[str, Any]]:
    return [
        {"step": p.step, "phase": p.phase.name, "allocated": p.allocated_bytes, "reserved": p.reserved_bytes,
         "breakdown": {c.name: n for c, n in p.breakdown.items()}, "tensor": p.tensor_bytes}
        for p in peaks
    ]  # fmt: skip


def _encode_step_replays(replays: StepReplays) -> dict[str, Any]:
    peaks, timeline, other = replays
    points = [[p.event_index, p.step, p.phase.name, list(p.category_bytes), p.reserved_bytes] for p in timeline]
    return {"peaks": _encode_peaks(peaks), "timeline": points, "other": None if other is None else _encode_peaks(other)}


def _decode_step_replays(data: dict[str, Any]) -> StepReplays:
    timeline = tuple(
        TimelinePoint(index, step, Phase[phase], tuple(categories), reserved)
        for index, step, phase, categories, reserved in data["timeline"]
    )
    other = None if data["other"] is None else _decode_peaks(data["other"])
    return _decode_peaks(data["peaks"]), timeline, other


def _decode_peaks(data: list[dict[str, Any]]) -> tuple[PhasePeak, ...]:
    return tuple(
        PhasePeak(p["step"], Phase[p["phase"]], p["allocated"], p["reserved"],
                  {Category[c]: n for c, n in p["breakdown"].items()}, p["tensor"])
        for p in data
    )  # fmt: skip


class _AtLength:
    """``ExactPeaks`` read at one sequence length unless another is asked for."""

    def __init__(self, peaks: ExactPeaks, seq_len: int) -> None:
        self._peaks, self._seq_len = peaks, seq_len

    def __call__(self, batch: int, seq_len: int | None = None) -> tuple[PhasePeak, ...] | None:
        return self._peaks(batch, seq_len if seq_len is not None else self._seq_len)

    def least_reserved(self, batch: int, seq_len: int | None, config: AllocatorConfig) -> int | None:
        return self._peaks.least_reserved(batch, seq_len if seq_len is not None else self._seq_len, config)

    def at_limit(self, batch: int, seq_len: int | None, limit_bytes: int, config: AllocatorConfig) -> LimitFit | None:
        return self._peaks.at_limit(batch, seq_len if seq_len is not None else self._seq_len, limit_bytes, config)

    def estimate_at_length(self, batch: int, seq_len: int) -> StepCurve:
        return self._peaks.estimate_at_length(batch, seq_len)


def replay_for(trace: StepTrace, runtime: CudaRuntime | None) -> list[PhasePeak]:
    """Replay ``trace`` for ``runtime``'s GPU (its cuBLAS workspace), or as plain tensor bytes on a CPU."""
    if runtime is not None:
        resize_workspace(trace, runtime.workspace_bytes)
    return replay(trace.recorder, simulate_cuda_allocator=runtime is not None)


def resize_workspace(trace: StepTrace, workspace_bytes: int) -> None:
    recorder = trace.recorder
    for sid, category in recorder.categories.items():
        if category is Category.WORKSPACE:
            recorder.sizes[sid] = workspace_bytes


# model -> its kept sessions: an entry goes with its model (weakly keyed), and at most _KEPT_SESSIONS in all
_SESSIONS: weakref.WeakKeyDictionary[nn.Module, OrderedDict[tuple, StepSession]] = weakref.WeakKeyDictionary()
_ORDER: OrderedDict[tuple[int, tuple], weakref.ref] = OrderedDict()


def step_session(model: nn.Module, sample: Any, sample_batch: int, settings: TraceSettings) -> StepSession:
    """The kept session of this step, or a new one (the last ``_KEPT_SESSIONS`` are kept)."""
    key = (_fingerprint(model), _sample_key(sample, sample_batch), _settings_key(settings))
    kept = _SESSIONS.setdefault(model, OrderedDict())
    session = kept.get(key)
    if session is not None:
        _ORDER.move_to_end((id(model), key))
        return session
    session = StepSession(model, _shapes_only(sample, sample_batch), sample_batch, settings)
    kept[key] = session
    _ORDER[(id(model), key)] = weakref.ref(model)
    while len(_ORDER) > _KEPT_SESSIONS:
        (_, old_key), owner = _ORDER.popitem(last=False)
        sessions = _SESSIONS.get(owner()) if owner() is not None else None
        if sessions is not None:
            sessions.pop(old_key, None)
    return session


def kept_sessions() -> list[StepSession]:
    """The sessions kept now (for tests and diagnostics)."""
    return [session for sessions in list(_SESSIONS.values()) for session in sessions.values()]


def clear_sessions() -> None:
    """Forget every kept trace (tests, and callers that change a model in place in ways shapes do not show)."""
    _SESSIONS.clear()
    _ORDER.clear()


def _fingerprint(model: nn.Module) -> tuple:
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return (
        tuple((n, tuple(t.shape), t.dtype, t.requires_grad, type(t).__name__, t.device.type) for n, t in tensors),
        tuple(type(m).__name__ for m in model.modules()),
        tuple(getattr(m, "gradient_checkpointing", None) for m in model.modules()),
    )


def _sample_key(sample: Any, sample_batch: int) -> tuple:
    if callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple)):
        return ("factory", id(sample))  # called at each batch traced: its own batch size does not matter
    shapes: list[Any] = []
    rebatch(sample, sample_batch, sample_batch, lambda t, shape: shapes.append((tuple(shape), t.dtype,
                                                                                 holds_only_ones(t))))  # fmt: skip
    return ("batch", sample_batch, repr(_structure(sample)), tuple(shapes))


def _structure(sample: Any) -> Any:
    if isinstance(sample, dict):
        return {k: _structure(v) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(_structure(v) for v in sample)
    return type(sample).__name__ if isinstance(sample, torch.Tensor) else repr(sample)


def _shapes_only(sample: Any, sample_batch: int) -> Any:
    """The sample as meta tensors: the trace reads shapes and dtypes only, and the kept session must not
    hold the user's batch (on the run's GPU, say) alive into training."""
    if callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple)):
        return sample
    return rebatch(sample, sample_batch, sample_batch, shape_only)


def _settings_key(settings: TraceSettings) -> tuple:
    """The settings as a key; accumulation matters to the trace only as "more than one micro batch"."""
    values = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name == "accumulation_steps":
            value = min(value, 2)
        try:
            hash(value)
        except TypeError:
            value = ("id", id(value), repr(value))
        values.append((f.name, value))
    return tuple(values)


def deep_session(
    models: Sequence[nn.Module], sample: Any, sample_batch: int, settings: TraceSettings, depth: int
) -> DeepSession:
    """The session of the model ``depth`` blocks deep whose traces are built from ``models`` (the same model at two
    depths, one block apart), each traced with its blocks recorded."""
    recorded = dataclasses.replace(settings, record_blocks=True)
    shallow, deeper = (step_session(model, sample, sample_batch, recorded) for model in models)
    low, high = (_depth_of(model) for model in models)
    if high != low + 1:
        raise DepthMismatch(f"the shallow models must be one block apart, got {low} and {high} blocks")
    # kept with the shallow session, as its traces are: a planner asking again builds (and checks) the log once
    kept = shallow.deep_sessions.get(depth)
    if kept is None or kept._deeper is not deeper:
        kept = shallow.deep_sessions[depth] = DeepSession(shallow, deeper, depth, (low, high))
    return kept


def exact_estimates(
    model: nn.Module,
    sample: Any,
    sample_batch: int,
    batch: int,
    settings: TraceSettings,
    runtimes: Sequence[CudaRuntime | None],
    build: Callable[..., Any],
    *,
    repeated: Sequence[nn.Module] | None = None,
    transform: Callable[[StepTrace], StepTrace] | None = None,
) -> list[StepCurve] | str:
    """One curve per GPU at ``batch`` from the step's symbolic trace, each answering ``at()`` exactly;
    where the step cannot be traced symbolically, why (in plain words).

    ``repeated`` (``model`` built at two shallow depths, one block apart) builds the whole model's traces from
    theirs instead of tracing it (``DeepSession``). ``transform`` rewrites every trace before it is replayed.

    Raises:
        DepthMismatch: ``repeated`` was given and the model's blocks do not repeat one another.
    """
    if repeated is not None:
        session: Session = deep_session(repeated, sample, sample_batch, settings, _depth_of(model))
        keep: Sequence[nn.Module] = (model, *repeated)
    else:
        session, keep = step_session(model, sample, sample_batch, settings), (model,)
    before, started = session.trace_seconds, time.perf_counter()
    if not session.symbolic and session.unavailable is None and (batch == 1 or batch in session.concrete):
        # Batch 1 needs a concrete trace anyway: with one more at batch 2 it is the two-trace estimate, and the
        # symbolic trace (several times a concrete one) is taken only when at() asks for another batch.
        try:
            primary = session.concrete_trace(batch)
            # a plan from a built log reads other batches next: its symbolic trace serves the second batch too
            if isinstance(session, DeepSession) and session.ensure_symbolic(2 * batch):
                secondary, _ = session.trace_at(2 * batch)
            else:
                secondary = session.concrete_trace(2 * batch)
        except ValueDependentError as exc:  # the caller's concrete path retries on the model's compile branch
            return f"the model reads tensor values ({exc})"
        notes = [
            f"traced at batch sizes {batch} and {2 * batch}; any other batch size is read off one trace with the "
            "batch size symbolic, taken when first asked"
        ]
    else:
        if not session.ensure_symbolic(max(2, batch)):
            return session.unavailable or "the model is gone"
        primary, note = session.trace_at(batch)
        symbolic = session.symbolic[0]
        other = next((b for b in (2 * batch, batch + 1, batch - 1) if b >= 2 and symbolic.valid(b)), 2 * batch)
        secondary, _ = session.trace_at(other)
        notes = [text for text in (session.range_note, note) if text]
    if isinstance(session, DeepSession):
        low, high = session.depths
        notes.append(
            f"the {session.depth} blocks' log built from traces at {low} and {high} blocks (block {TEMPLATE_BLOCK}'s "
            f"events repeated, checked against the {high}-block trace); --exact traces the whole model"
        )
    if transform is not None:
        primary, secondary = transform(primary), transform(secondary)
    estimates = []
    for runtime in runtimes:
        if settings.targets_cuda:
            runtime = runtime or CudaRuntime.of_current_device()
            resize_workspace(primary, runtime.workspace_bytes)
            resize_workspace(secondary, runtime.workspace_bytes)
        else:
            runtime = None
        elapsed = session.trace_seconds - before + (time.perf_counter() - started)
        rebuild = functools.partial(_rebuilt, build, settings, runtime)
        peaks = ExactPeaks(session, runtime, keep, transform, rebuild)
        built = build(primary, secondary, settings, runtime, elapsed, replays=peaks.step_replays(primary, secondary))
        estimates.append(StepCurve(built, peaks).with_notes(*notes))
    return estimates


def _rebuilt(build: Callable[..., Any], settings: TraceSettings, runtime: CudaRuntime | None, primary: StepTrace,
             secondary: StepTrace) -> Any:  # fmt: skip
    return build(primary, secondary, settings, runtime, 0.0)


def _depth_of(model: nn.Module) -> int:
    """How many repeated blocks ``model`` has (what its traces record)."""
    return len(find_blocks(model))
