"""Trace a step once with the batch size symbolic, then read its storage log at any batch size.

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

Known limitations: a model that reads values (``.item()``, ``nonzero``), or an operator without a
symbolic shape function, cannot run with a symbolic batch; the caller traces concretely instead.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.tracing.batch import Sample, rebatch
from memfit.tracing.tracer import StepTrace, TraceSettings, trace_steps

__all__ = ["SymbolicTrace", "SymbolicUnavailable", "symbolic_enabled", "trace_symbolic"]


class SymbolicUnavailable(Exception):
    """The step cannot be traced with a symbolic batch; ``reason`` says why in plain words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def symbolic_enabled() -> bool:
    """Whether estimates trace with a symbolic batch (the default); ``MEMFIT_TRACE=concrete`` turns it off."""
    return os.environ.get("MEMFIT_TRACE", "symbolic").strip().lower() != "concrete"


@dataclass
class SymbolicTrace:
    """One trace whose storage sizes are expressions in ``symbol`` (the batch), valid where its guards hold."""

    trace: StepTrace
    symbol: sympy.Symbol
    hint: int
    guards: tuple[sympy.Basic, ...]
    lower: int
    upper: int | None
    _evaluators: dict[Any, Callable[[int], int]] = field(default_factory=dict, repr=False)

    def valid(self, batch: int) -> bool:
        """Whether the step at ``batch`` takes the path this trace took (its range and every guard hold)."""
        if batch < self.lower or (self.upper is not None and batch > self.upper):
            return False
        return all(bool(guard.xreplace({self.symbol: batch})) for guard in self.guards)

    def range_note(self) -> str:
        """In plain words, for which batch sizes the trace answers."""
        pinned = [g for g in self.guards if isinstance(g, sympy.Eq) and self.symbol in g.free_symbols]
        if pinned:
            return (
                f"traced with the batch size symbolic, but the model reads it as a plain number, so the trace "
                f"answers for batch {self.hint} alone; other batch sizes are traced on their own"
            )
        upper = f" to {self.upper}" if self.upper is not None else " up"
        conditions = [_plain(guard, self.symbol) for guard in self.guards]
        conditions = [c for c in conditions if c]
        extra = f", where {' and '.join(conditions)}" if conditions else ""
        return (
            f"traced once with the batch size symbolic (batch sizes {self.lower}{upper}{extra}); every batch size "
            "is read off that trace by replaying its allocations"
        )

    def at(self, batch: int) -> StepTrace:
        """The storage log at ``batch``: what a concrete trace at ``batch`` records."""
        source = self.trace.recorder
        recorder = copy.copy(source)
        recorder.sizes = {sid: self._evaluate(size, batch) for sid, size in source.sizes.items()}
        recorder.categories = dict(source.categories)
        recorder.marks = list(source.marks)
        recorder.events = list(source.events)
        return StepTrace(
            batch_size=batch,
            recorder=recorder,
            checkpointing=self.trace.checkpointing,
            substitutions=dict(self.trace.substitutions),
            ops=self.trace.ops,
            compiled=self.trace.compiled,
            paged=self.trace.paged,  # parameter-sized, so the same at every batch
            blocks=self.trace.blocks,
        )

    def _evaluate(self, size: Any, batch: int) -> int:
        if isinstance(size, int):
            return size
        evaluator = self._evaluators.get(size)
        if evaluator is None:
            evaluator = _evaluator(size, self.symbol)
            self._evaluators[size] = evaluator
        return evaluator(batch)


def _evaluator(expr: sympy.Expr, symbol: sympy.Symbol) -> Callable[[int], int]:
    """A fast ``batch -> bytes`` for ``expr``: integer polynomials (``a x batch + c`` mostly) by Horner, else sympy."""
    poly = None
    try:
        if expr.is_polynomial(symbol):
            poly = sympy.Poly(expr, symbol)
    except (sympy.PolynomialError, TypeError):
        poly = None
    if poly is not None and all(c.is_Integer for c in poly.all_coeffs()):
        coefficients = [int(c) for c in poly.all_coeffs()]

        def polynomial(batch: int) -> int:
            value = 0
            for c in coefficients:
                value = value * batch + c
            return value

        return polynomial
    return lambda batch: int(expr.xreplace({symbol: batch}))


def trace_symbolic(
    model: nn.Module, sample: Sample, sample_batch: int, settings: TraceSettings, *, hint: int
) -> SymbolicTrace:
    """Trace the step with the batch symbolic, the model's branches taken as at batch ``hint`` (>= 2).

    Raises:
        SymbolicUnavailable: the step cannot run with a symbolic batch (the reason in plain words).
    """
    if hint < 2:
        raise ValueError("the hint of a symbolic batch must be at least 2")
    if callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple)):
        sample, sample_batch = _from_factory(sample, hint), hint
    from torch._dynamo.source import ConstantSource  # torch._dynamo takes seconds to import: only when tracing
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    source = ConstantSource("batch_size")
    symbol = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    batch = shape_env.create_symintnode(symbol, hint=hint, source=source)
    try:
        trace = trace_steps(model, sample, sample_batch, batch, settings, fake_mode=fake_mode)
    except Exception as exc:  # whatever stops it, the concrete trace is the answer (and says so if it fails)
        raise SymbolicUnavailable(_why(exc)) from exc
    trace.batch_size = hint  # not the SymInt: the kept trace holds no shape environment
    guards = tuple(guard.expr for guard in shape_env.guards if symbol in guard.expr.free_symbols)
    bounds = shape_env.var_to_range.get(symbol)
    low, high = (_integer(bounds.lower), _integer(bounds.upper)) if bounds is not None else (None, None)
    lower, upper = max(2, low or 2), high
    replaced = shape_env.replacements.get(symbol)
    if replaced is not None and replaced.is_number:  # the batch was pinned to one value
        guards = (*guards, sympy.Eq(symbol, int(replaced)))
    others = {free for size in trace.recorder.sizes.values() if not isinstance(size, int) for free in size.free_symbols}
    if others - {symbol}:  # sizes set by values (nonzero, masked selects), which a concrete trace refuses too
        raise SymbolicUnavailable(
            "the step's memory depends on tensor values (e.g. nonzero or a mask), not only on the batch size"
        )
    symbolic = SymbolicTrace(trace, symbol, hint, guards, lower, upper)
    if not symbolic.valid(hint):
        raise SymbolicUnavailable("the trace's conditions on the batch size exclude the batch it ran with")
    return symbolic


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
