"""``memfit plan`` of a deep preset (dozens of blocks) from traces of the same model a few blocks deep.

Built (the default for a preset deeper than ``BUILD_DEPTHS[1]`` blocks): the model is traced at ``BUILD_DEPTHS``
and the whole model's log is built from those two traces (``memfit.tracing.depth``), which first checks that
one block more than the shallower trace gives the deeper one, event for event. The plan, its search and its
figures then rest on the whole model's log, replayed as a trace of it would be, for a fraction of the time.

Where the log cannot be built (blocks of several kinds, a step that cannot be traced with a symbolic batch), a
model of a billion parameters or more is searched on traces at ``EXTRAPOLATION_DEPTHS`` extrapolated in depth
(the peaks, not the log: ``extrapolate_depth``), and every plan is confirmed on a trace of the whole model; a
smaller model is traced whole. ``--exact`` (or ``--layers``) traces the whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import EstimationError
from memfit.prediction.estimator import StepCurve, extrapolate_depth
from memfit.presets import ModelSpec
from memfit.tracing.depth import DepthMismatch

__all__ = ["BUILD_DEPTHS", "EXTRAPOLATION_DEPTHS", "DeepModel", "extrapolating", "model_depth"]

# the depths a deep preset is traced at to build the whole model's log: the template block 2 has a block on each side
BUILD_DEPTHS = (3, 4)
# Where the log cannot be built, large deep models are searched on traces at these depths, extrapolated (seconds
# instead of a minute); the chosen plan is then confirmed on a trace of the whole model.
EXTRAPOLATION_DEPTHS = (2, 4)

Tracer = Callable[..., Any]  # trace(batch, checkpointing, accumulation) -> one estimate per GPU


def model_depth(model: Any) -> int | None:
    """The number of blocks a transformers config gives its model (``None`` if it names none)."""
    config = getattr(model, "config", None)
    for attribute in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class DeepModel:
    """How a preset is traced: whole, built from shallow traces, or extrapolated from them (decided per training
    loop on its first trace, by whether its log can be built). ``build_at(depth)`` makes the preset ``depth``
    blocks deep. ``built`` and ``extrapolated`` say which depths served, where any loop used them."""

    spec: ModelSpec
    depth: int | None
    build_at: Callable[[int], ModelSpec] | None
    large: bool
    built: tuple[int, int] | None = None  # the depths the whole log was built from
    extrapolated: tuple[int, int] | None = None  # the depths the search was extrapolated from
    not_built: str | None = None  # why the log could not be built
    _specs: dict[int, ModelSpec] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, spec: ModelSpec, build_at: Callable[[int], ModelSpec] | None, *, large: bool) -> DeepModel:
        """``build_at`` ``None``: trace the whole model (``--exact``, ``--layers``, a model factory)."""
        depth = model_depth(spec.model)
        deep = build_at is not None and depth is not None and depth > BUILD_DEPTHS[1]
        return cls(spec, depth, build_at if deep else None, large)

    def _at(self, depth: int) -> ModelSpec:
        """The preset ``depth`` blocks deep (built once)."""
        assert self.build_at is not None
        if depth not in self._specs:
            self._specs[depth] = self.build_at(depth)
        return self._specs[depth]

    def tracers(
        self, tracer: Callable[..., Tracer], probe_checkpointing: bool, probe_batch: int = 2
    ) -> tuple[Tracer, Tracer]:
        """``(search, whole)``: ``tracer(spec, **keywords)`` makes a trace function of a spec; whether the log can
        be built is found by building it at ``probe_batch`` (the plan's first estimate)."""
        search: Tracer | None = None
        whole = tracer(self.spec, fits_of=lambda checkpointing: search(1, checkpointing, 1))
        search = whole
        if self.build_at is None:
            return whole, whole
        built = tracer(self.spec, repeated=[self._at(d).model for d in BUILD_DEPTHS])
        try:
            built(probe_batch, probe_checkpointing, 1)
        except (DepthMismatch, EstimationError) as why:  # this step's log cannot be built (a loop's DDP buckets)
            self.not_built = getattr(why, "reason", str(why))
            if not self.large:
                return whole, whole
            self.extrapolated = EXTRAPOLATION_DEPTHS
            shallow = [tracer(self._at(d)) for d in EXTRAPOLATION_DEPTHS]
            search = extrapolating(shallow, EXTRAPOLATION_DEPTHS, self.depth or 0, whole)
            return search, whole
        self.built = BUILD_DEPTHS
        search = _built_or_whole(built, whole)
        return search, search


def _built_or_whole(built: Tracer, whole: Tracer) -> Tracer:
    """The built log's estimates; the whole model's trace where a configuration's log cannot be built."""

    def trace(batch: int, checkpointing: bool, accumulation: int = 1) -> list[StepCurve]:
        try:
            return built(batch, checkpointing, accumulation)
        except (DepthMismatch, EstimationError):
            return whole(batch, checkpointing, accumulation)

    return trace


def extrapolating(tracers: list[Tracer], depths: tuple[int, int], depth: int, full_trace: Tracer) -> Tracer:
    """``trace(batch, checkpointing, accumulation)`` from the two shallow traces; the full trace if they
    disagree."""

    @functools.cache
    def trace(batch: int, checkpointing: bool, accumulation: int = 1) -> list[StepCurve]:
        shallow, deeper = (tracer(batch, checkpointing, accumulation) for tracer in tracers)
        # at twice the batch too: at()'s allocator ratios come from both, as a whole trace's do
        shallow2, deeper2 = (tracer(2 * batch, checkpointing, accumulation) for tracer in tracers)
        try:
            return [
                extrapolate_depth(a, b, *depths, depth, doubled=(a2.estimate, b2.estimate))
                for a, b, a2, b2 in zip(shallow, deeper, shallow2, deeper2, strict=True)
            ]
        except EstimationError:
            return full_trace(batch, checkpointing, accumulation)

    return trace
