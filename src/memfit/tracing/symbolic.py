"""Trace a step once with the batch size (and sequence length) symbolic, then read its log at any of them.

Under a ``FakeTensorMode`` with a ``ShapeEnv``, an input whose first dimension is a ``SymInt`` carries
that dimension through the model: every storage the step creates has a size in bytes that is a sympy
expression in the batch (parameters, gradients and optimizer state stay plain integers, as their
shapes are static). The log of one such trace, evaluated at a batch ``b``, is the log a concrete trace
at ``b`` records, event for event, so the allocator replay of it gives that trace's peaks exactly.

That holds only where the step takes the same path at ``b`` as at the batch the trace ran with (the
hint): whenever model code branches on the batch (``if batch > 1``, a size compared with a constant),
torch records a guard, a condition on the batch under which the trace is valid. ``SymbolicTrace.valid``
checks a batch against them all, and the symbol's own range: backed symbols are assumed to be at least 2
(0 and 1 are specialised, as size-1 dimensions broadcast), so batch 1 always needs a trace of its own.

Where the sample has a sequence dimension (its token ids: integer tensors of two or more dimensions; every
dimension 1 of the sample of that length moves with it) the sequence length is a second symbol, so the same
trace answers ``at(batch, seq_len)``; where the step cannot run with both symbolic, the batch alone is.

Known limitations: a model that reads values (``.item()``, ``nonzero``), or an operator without a
symbolic shape function, cannot run with a symbolic batch; the caller traces concretely instead.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.tracing.batch import Sample, rebatch, resequenced, sequence_length
from memfit.tracing.tracer import StepTrace, TraceSettings, trace_steps

__all__ = [
    "SequenceSymbol",
    "SymbolicTrace",
    "SymbolicUnavailable",
    "resequenced",
    "sequence_length",
    "symbolic_enabled",
    "trace_symbolic",
]


class SymbolicUnavailable(Exception):
    """The step cannot be traced with a symbolic batch; ``reason`` says why in plain words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def symbolic_enabled() -> bool:
    """Whether estimates trace with a symbolic batch (the default); ``MEMFIT_TRACE=concrete`` turns it off."""
    return os.environ.get("MEMFIT_TRACE", "symbolic").strip().lower() != "concrete"


@dataclass(frozen=True)
class SequenceSymbol:
    """The sequence length as a symbol of a trace: its value in the trace (``hint``) and its range."""

    symbol: sympy.Symbol
    hint: int
    lower: int
    upper: int | None


@dataclass
class SymbolicTrace:
    """One trace whose storage sizes are expressions in ``symbol`` (the batch), and in ``seq.symbol`` (the sequence
    length) where it is symbolic too, valid where its guards hold. ``seq_len`` is the sample's sequence length."""

    trace: StepTrace
    symbol: sympy.Symbol
    hint: int
    guards: tuple[sympy.Basic, ...]
    lower: int
    upper: int | None
    seq: SequenceSymbol | None = None
    seq_len: int | None = None
    _evaluators: dict[Any, Callable[[int, int], int]] = field(default_factory=dict, repr=False)

    def valid(self, batch: int, seq_len: int | None = None) -> bool:
        """Whether the step at ``batch`` (and ``seq_len``; default: the traced one) takes the path this trace took:
        both in range and every guard holding."""
        if batch < self.lower or (self.upper is not None and batch > self.upper):
            return False
        if seq_len is not None and seq_len != self.seq_len:
            seq = self.seq
            if seq is None or seq_len < seq.lower or (seq.upper is not None and seq_len > seq.upper):
                return False
        values = self._values(batch, seq_len)
        return all(bool(guard.xreplace(values)) for guard in self.guards)

    def range_note(self) -> str:
        """In plain words, for which batch sizes (and sequence lengths) the trace answers."""
        pinned = [g for g in self.guards if isinstance(g, sympy.Eq) and self.symbol in g.free_symbols]
        if pinned:
            return (
                f"traced with the batch size symbolic, but the model reads it as a plain number, so the trace "
                f"answers for batch {self.hint} alone; other batch sizes are traced on their own"
            )
        upper = f" to {self.upper}" if self.upper is not None else " up"
        conditions = [_plain(guard, self.symbol) for guard in self.guards if self._about_batch_only(guard)]
        conditions = [c for c in conditions if c]
        extra = f", where {' and '.join(conditions)}" if conditions else ""
        sequence = ""
        if self.seq is not None:
            seq = self.seq
            top = f" to {seq.upper}" if seq.upper is not None else " up"
            sequence = f" and the sequence length (lengths {seq.lower}{top})"
        return (
            f"traced once with the batch size{sequence} symbolic (batch sizes {self.lower}{upper}{extra}); every "
            "batch size is read off that trace by replaying its allocations"
        )

    def at(self, batch: int, seq_len: int | None = None) -> StepTrace:
        """The storage log at ``batch`` (and ``seq_len``): what a concrete trace there records."""
        source = self.trace.recorder
        recorder = copy.copy(source)
        sequence = seq_len if seq_len is not None else self.seq_len
        values: dict[Any, int] = {}
        sizes = {}
        for sid, size in source.sizes.items():
            if isinstance(size, int):
                sizes[sid] = size
                continue
            value = values.get(size)
            if value is None:
                value = values[size] = self._evaluate(size, batch, sequence)
            sizes[sid] = value
        recorder.sizes = sizes
        recorder.categories = dict(source.categories)
        recorder.marks = list(source.marks)
        recorder.events = list(source.events)
        vanished = {sid for sid in source.scratch if sizes.get(sid) == 0}
        if vanished:  # a kernel's scratch that this batch does not need: a trace here would not log it at all
            _drop_events(recorder, vanished)
        return StepTrace(
            batch_size=batch,
            recorder=recorder,
            checkpointing=self.trace.checkpointing,
            substitutions=dict(self.trace.substitutions),
            ops=self.trace.ops,
            compiled=self.trace.compiled,
            paged=self.trace.paged,  # parameter-sized, so the same at every batch
            blocks=self.trace.blocks,
            seq_len=sequence,
        )

    def _values(self, batch: int, seq_len: int | None) -> dict[Any, int]:
        values = {self.symbol: batch}
        if self.seq is not None:
            values[self.seq.symbol] = seq_len if seq_len is not None else self.seq.hint
        return values

    def _about_batch_only(self, guard: sympy.Basic) -> bool:
        return guard.free_symbols <= {self.symbol}

    def _evaluate(self, size: Any, batch: int, seq_len: int | None) -> int:
        evaluator = self._evaluators.get(size)
        if evaluator is None:
            symbols = (self.symbol, self.seq.symbol) if self.seq is not None else (self.symbol,)
            evaluator = _evaluator(size, symbols)
            self._evaluators[size] = evaluator
        return evaluator(batch, seq_len if seq_len is not None else (self.seq.hint if self.seq else 0))


def _evaluator(expr: sympy.Expr, symbols: tuple[sympy.Symbol, ...]) -> Callable[[int, int], int]:
    """A fast ``(batch, seq_len) -> bytes`` for ``expr``: integer polynomials (``a x batch x seq + c`` mostly) term by
    term, anything else by sympy."""
    poly = None
    try:
        if expr.is_polynomial(*symbols):
            poly = sympy.Poly(expr, *symbols)
    except (sympy.PolynomialError, TypeError):
        poly = None
    if poly is not None and all(c.is_Integer for c in poly.coeffs()):
        terms = [(tuple(powers) + (0,) * (2 - len(powers)), int(c)) for powers, c in poly.terms()]

        def polynomial(batch: int, seq_len: int) -> int:
            return sum(c * batch**i * seq_len**j for (i, j), c in terms)

        return polynomial

    def general(batch: int, seq_len: int) -> int:
        return int(expr.xreplace(dict(zip(symbols, (batch, seq_len)[: len(symbols)], strict=True))))

    return general


def trace_symbolic(
    model: nn.Module,
    sample: Sample,
    sample_batch: int,
    settings: TraceSettings,
    *,
    hint: int,
    symbolic_sequence: bool = False,
) -> SymbolicTrace:
    """Trace the step with the batch symbolic, the model's branches taken as at batch ``hint`` (>= 2), and with
    ``symbolic_sequence`` the sequence length too where the sample has one (the batch alone where the step cannot
    run with both). A second symbol makes the trace about twice as slow: planners take it only when asked about
    another length.

    Raises:
        SymbolicUnavailable: the step cannot run with a symbolic batch (the reason in plain words).
    """
    if hint < 2:
        raise ValueError("the hint of a symbolic batch must be at least 2")
    if callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple)):
        sample, sample_batch = _from_factory(sample, hint), hint
    length = sequence_length(sample, sample_batch)
    if symbolic_sequence and length is not None and length >= 2:
        try:
            return _trace(model, sample, sample_batch, settings, hint, length)
        except SymbolicUnavailable:
            pass  # e.g. a model that reads the sequence length as a plain number: the batch alone
    symbolic = _trace(model, sample, sample_batch, settings, hint, None)
    symbolic.seq_len = length
    return symbolic


def _trace(
    model: nn.Module, sample: Sample, sample_batch: int, settings: TraceSettings, hint: int, length: int | None
) -> SymbolicTrace:
    from torch._dynamo.source import ConstantSource  # torch._dynamo takes seconds to import: only when tracing
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    source = ConstantSource("batch_size")
    symbol = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    batch = shape_env.create_symintnode(symbol, hint=hint, source=source)
    sequence, seq_symbol = None, None
    if length is not None:
        seq_source = ConstantSource("seq_len")
        seq_symbol = shape_env.create_symbol(length, source=seq_source, dynamic_dim=DimDynamic.DYNAMIC)
        sequence = (length, shape_env.create_symintnode(seq_symbol, hint=length, source=seq_source))
    try:
        trace = trace_steps(model, sample, sample_batch, batch, settings, fake_mode=fake_mode, sequence=sequence)
    except Exception as exc:  # whatever stops it, the concrete trace is the answer (and says so if it fails)
        raise SymbolicUnavailable(_why(exc)) from exc
    trace.batch_size = hint  # not the SymInt: the kept trace holds no shape environment
    trace.seq_len = length
    ours = {symbol} if seq_symbol is None else {symbol, seq_symbol}
    guards = tuple(guard.expr for guard in shape_env.guards if guard.expr.free_symbols & ours)
    lower, upper = _range(shape_env, symbol)
    for pinned in ours:
        replaced = shape_env.replacements.get(pinned)
        if replaced is not None and replaced.is_number:  # the symbol was pinned to one value
            guards = (*guards, sympy.Eq(pinned, int(replaced)))
    others = {free for size in trace.recorder.sizes.values() if not isinstance(size, int) for free in size.free_symbols}
    if others - ours:  # sizes set by values (nonzero, masked selects), which a concrete trace refuses too
        raise SymbolicUnavailable(
            "the step's memory depends on tensor values (e.g. nonzero or a mask), not only on the batch size"
        )
    seq = None
    if seq_symbol is not None and length is not None:
        seq = SequenceSymbol(seq_symbol, length, *_range(shape_env, seq_symbol))
    symbolic = SymbolicTrace(trace, symbol, hint, guards, lower, upper, seq, length)
    if not symbolic.valid(hint):
        raise SymbolicUnavailable("the trace's conditions on the batch size exclude the batch it ran with")
    return symbolic


def _range(shape_env: Any, symbol: sympy.Symbol) -> tuple[int, int | None]:
    """A symbol's range: at least 2 (0 and 1 are specialised), up to its upper bound if it has one."""
    bounds = shape_env.var_to_range.get(symbol)
    low, high = (_integer(bounds.lower), _integer(bounds.upper)) if bounds is not None else (None, None)
    return max(2, low or 2), high


def _from_factory(factory: Callable[[int], Any], hint: int) -> Any:
    """The factory's batch at ``hint``, if its shapes grow with the batch in their first dimension alone."""
    try:
        sample, larger = factory(hint), factory(hint + 1)
    except Exception as exc:
        raise SymbolicUnavailable(f"the sample factory failed ({type(exc).__name__}: {exc})") from exc
    shapes: list[tuple] = []
    rebatch(sample, hint, hint + 1, lambda t, shape: shapes.append((tuple(shape), t.dtype)))
    grown: list[tuple] = []
    rebatch(larger, hint + 1, hint + 1, lambda t, shape: grown.append((tuple(shape), t.dtype)))
    if shapes != grown:
        raise SymbolicUnavailable("the sample's shapes change with the batch size beyond their first dimension")
    return sample


def _integer(value: Any) -> int | None:
    """A range bound as an int; ``None`` for an infinite one."""
    return int(value) if isinstance(value, sympy.Integer) else None


def _why(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    if "data-dependent" in text.lower() or "DataDependent" in text or "GuardOnDataDependent" in text:
        return "the step reads tensor values that depend on the batch size"
    return f"the step failed with a symbolic batch size ({text[:200]})"


def _plain(guard: sympy.Basic, symbol: sympy.Symbol) -> str:
    """A guard in plain words where it is a simple comparison of the batch with a number, else ''."""
    text = str(guard)
    name = str(symbol)
    match = re.fullmatch(rf"(Eq|Ne)\({name}, (\d+)\)", text)
    if match:
        return f"the batch size is {'' if match.group(1) == 'Eq' else 'not '}{match.group(2)}"
    match = re.fullmatch(rf"{name} (<=|<|>=|>) (\d+)", text)
    if match:
        words = {"<=": "at most", "<": "below", ">=": "at least", ">": "above"}[match.group(1)]
        return f"the batch size is {words} {match.group(2)}"
    match = re.fullmatch(rf"(\d+) (<=|<|>=|>) {name}", text)
    if match:
        words = {"<=": "at least", "<": "above", ">=": "at most", ">": "below"}[match.group(2)]
        return f"the batch size is {words} {match.group(1)}"
    return "the model's own conditions on the batch size hold"


def _drop_events(recorder: Any, sids: set[int]) -> None:
    """Remove every event of ``sids`` from ``recorder``'s log, keeping phase marks and block labels in step."""
    keep = [abs(event) not in sids for event in recorder.events]
    moved_to, kept = [], 0
    for flag in keep:
        moved_to.append(kept)
        kept += flag
    moved_to.append(kept)
    recorder.marks = [replace(mark, event_index=moved_to[mark.event_index]) for mark in recorder.marks]
    recorder.events = [event for event, flag in zip(recorder.events, keep, strict=True) if flag]
    if recorder.event_blocks is not None:
        recorder.event_blocks = [block for block, flag in zip(recorder.event_blocks, keep, strict=True) if flag]
