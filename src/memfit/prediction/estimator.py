"""``memfit.estimate``: the peak memory of a training step, traced on fake tensors.

The estimate comes from running the user's real module through two real training steps (forward,
loss, backward, optimizer step, ``zero_grad``) on fake tensors, which carry shapes and dtypes but
no data, so a 7B model plans on a laptop. Every storage the step creates is logged and the log is
replayed through a model of the CUDA caching allocator. The step is traced once with the batch size
symbolic, so ``StepCurve.at(b)`` replays the log read at ``b`` (``memfit.prediction.exact``); where
that cannot be done, tracing at two batch sizes gives, for each phase, ``fixed + per_sample x batch``.
``memfit.trace`` returns that curve; ``memfit.estimate`` its value at the traced batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from memfit.categories import Category
from memfit.devices import find_backend
from memfit.errors import EstimationError, InvalidInputError, MemfitError, ValueDependentError
from memfit.precision import Precision
from memfit.prediction.curve import StepCurve
from memfit.prediction.exact import exact_estimates
from memfit.prediction.sharded import (
    RankModel,
    model_facts,
    rank_notes,
    rank_plan,
    shard_trace,
    sharded_settings,
    traced_bytes,
    traced_fsdp2_peak,
    with_traced_fsdp2,
)
from memfit.prediction.values import BatchPeak, MemoryEstimate, PhaseModel
from memfit.simulation.replay import (
    PhasePeak,
    StepReplays,
    extrapolate_timeline,
    replay_step,
)
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing import trace_cache, trace_data
from memfit.tracing.batch import Sample, infer_batch_size, sequence_length
from memfit.tracing.checkpointing import CheckpointTarget
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.model_limits import check_sequence_length
from memfit.tracing.optimizers import OptimizerSpec, optimizer_name
from memfit.tracing.paged import paged_note
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.symbolic import symbolic_enabled
from memfit.tracing.tracer import (
    ForwardFn,
    LossFn,
    StepTrace,
    TraceSettings,
    has_compile_paths,
    trace_steps,
)
from memfit.units import format_bytes

__all__ = [
    "BatchPeak",
    "MemoryEstimate",
    "PhaseModel",
    "StepCurve",
    "Target",
    "TrainingLoop",
    "estimate",
    "trace",
    "trace_for_runtimes",
]
_P = ParamSpec("_P")
_R = TypeVar("_R")

# said of a model that runs under torch.compile (traced eagerly; a framework that compiles it later says so too)
COMPILED_NOTE = (
    "the model is torch.compile'd: the step is predicted as it runs eagerly, an upper bound for activations, until "
    "compiled memory is modelled"
)


# estimate's keywords that are fields of its loop= and target= objects now: (keyword, object, class, field)
_MOVED_KEYWORDS = (
    ("zero_grad", "loop", "TrainingLoop", "zero_grad"),
    ("accumulation_steps", "loop", "TrainingLoop", "accumulation_steps"),
    ("extra_batches", "loop", "TrainingLoop", "extra_batches"),
    ("ddp", "loop", "TrainingLoop", "ddp"),
    ("device", "target", "Target", "device"),
    ("cuda_runtime", "target", "Target", "runtime"),
)


def _moved_keywords_message(function: str, given: Iterable[str]) -> str | None:
    """The one line that says where ``function``'s moved keywords among ``given`` go now; ``None`` if none is."""
    names = set(given)
    moved = [entry for entry in _MOVED_KEYWORDS if entry[0] in names]
    if not moved:
        return None
    objects: dict[tuple[str, str], list[str]] = {}
    for _, argument, cls, name in moved:
        objects.setdefault((argument, cls), []).append(f"{name}=...")
    passed = ", ".join(f"{keyword}=..." for keyword, *_ in moved)
    goes = ", ".join(f"{argument}=memfit.{cls}({', '.join(fields)})" for (argument, cls), fields in objects.items())
    return f"{function}({passed}) moved: pass {goes}"


def _refuse_moved_keywords(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` answers a keyword that moved into ``TrainingLoop`` or ``Target`` with one line saying where."""

    @functools.wraps(function)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        message = _moved_keywords_message(function.__name__, kwargs)
        if message is not None:
            raise InvalidInputError(message)
        return function(*args, **kwargs)

    return checked


@_refuse_moved_keywords
def trace(
    model: nn.Module,
    sample: Sample | Callable[[int], Sample],
    *,
    optimizer: OptimizerSpec = "adamw",
    precision: Precision | str = "fp32",
    batch_size: int | None = None,
    gradient_checkpointing: bool = False,
    checkpoint_modules: CheckpointTarget | None = None,
    loop: TrainingLoop | None = None,
    target: Target | None = None,
    loss_fn: LossFn | None = None,
    forward_fn: ForwardFn | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    inference: bool = False,
) -> StepCurve:
    """The training step of ``model`` traced, as a curve: ``estimate``'s prediction at the traced batch
    (``curve.estimate``), and the same step read at any other batch size or sequence length (``curve.at(b)``,
    ``curve.max_batch_size(capacity)``, ``curve.for_seq_len(n)``) off the same trace. ``memfit.plan`` plans on
    it. The curve holds the model: a batch its trace does not cover is traced when first asked.

    Args:
        model: the user's module (real, or built on the ``meta`` device). It is left untouched.
        sample: one batch (tensor, dict, tuple) or a callable ``batch_size -> batch``. Only shapes
            and dtypes are used; tensors whose first dimension is the batch size are resized.
        optimizer: an optimizer instance over ``model``'s parameters, an optimizer class or factory
            (called with the parameters and ``optimizer_kwargs``), a name (``"adamw"``, ``"sgd"``,
            ``"sgd-momentum"``, ``"adam"``, ... : ``memfit.tracing.optimizers.OPTIMIZER_NAMES``), or ``None``.
        precision: ``"fp32"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"fp16"``/``"16-true"``,
            ``"bf16"``/``"bf16-true"``.
        batch_size: batch to report (default: the sample's).
        gradient_checkpointing: trace with activation checkpointing; Hugging Face models use their
            own switch, other modules are wrapped per block (``checkpoint_modules`` or auto-detected).
        loop: the training loop around the step (``memfit.TrainingLoop``: where ``zero_grad`` runs,
            gradient accumulation, batches held besides the step's, DDP); default: a plain loop.
        target: the device predicted for (``memfit.Target``: ``"cuda"`` by default, or ``"cpu"``, and
            the GPU's ``CudaRuntime``).
        loss_fn: ``loss_fn(output, batch) -> scalar``; not needed when the model returns ``.loss``.
        forward_fn: ``forward_fn(model, batch) -> output`` when the model is not called as
            ``model(**batch)`` / ``model(*batch)`` / ``model(batch)``.
        inference: plan a forward-only pass instead (eval mode, no gradients, optimizer state or saved
            activations; the outputs, including a KV cache, are kept to the end of the pass). Labels
            are dropped from a dict sample unless ``forward_fn`` is given (an evaluation step). Of the
            loop only ``extra_batches`` applies.

    Raises:
        InvalidInputError: an argument cannot be used (``zero_grad=``, ``accumulation_steps=``,
            ``extra_batches=``, ``ddp=``, ``device=`` and ``cuda_runtime=`` are fields of ``loop`` and ``target``:
            the error names where each one goes).
        TraceError: the model, loss or optimizer failed on the traced step (the message names where).
        ValueDependentError: the model reads tensor values, which fake tensors do not have.
    """
    if loop is not None and not isinstance(loop, TrainingLoop):
        raise InvalidInputError(f"loop must be a memfit.TrainingLoop, got {loop!r}")
    if target is not None and not isinstance(target, Target):
        raise InvalidInputError(f"target must be a memfit.Target, got {target!r}")
    traced = trace_for_runtimes(
        model, sample, optimizer=optimizer, precision=precision, batch_size=batch_size,
        gradient_checkpointing=gradient_checkpointing, checkpoint_modules=checkpoint_modules, loop=loop,
        target=target, loss_fn=loss_fn, forward_fn=forward_fn, optimizer_kwargs=optimizer_kwargs, inference=inference,
    )[0]  # fmt: skip
    dropped = loop.dropped_for_inference() if inference and loop is not None else None
    return traced.with_notes(dropped) if dropped else traced


@_refuse_moved_keywords
def estimate(model: nn.Module, sample: Sample | Callable[[int], Sample], **options: Any) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``model`` without running it for real: a value, holding
    neither the model nor the trace. It takes ``trace``'s arguments (``help(memfit.trace)``); ``trace`` keeps the
    trace, to read the step at other batch sizes and sequence lengths and to plan on."""
    unknown = sorted(set(options) - set(_TRACE_SIGNATURE.parameters))
    if unknown:  # said as estimate's, not trace's
        raise TypeError(f"estimate() got an unexpected keyword argument {unknown[0]!r}")
    return trace(model, sample, **options).estimate


# help() and editors show estimate's arguments: trace's own
_TRACE_SIGNATURE = inspect.signature(trace)
estimate.__signature__ = _TRACE_SIGNATURE.replace(return_annotation="MemoryEstimate")  # type: ignore[attr-defined]


def trace_for_runtimes(
    model: nn.Module,
    sample: Sample | Callable[[int], Sample],
    *,
    runtimes: Sequence[CudaRuntime | None] | None = None,
    optimizer: OptimizerSpec = "adamw",
    precision: Precision | str = "fp32",
    batch_size: int | None = None,
    gradient_checkpointing: bool = False,
    checkpoint_modules: CheckpointTarget | None = None,
    loop: TrainingLoop | None = None,
    target: Target | None = None,
    loss_fn: LossFn | None = None,
    forward_fn: ForwardFn | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    inference: bool = False,
    batch_fits: Sequence[MemoryEstimate] | None = None,
    repeated: Sequence[nn.Module] | None = None,
) -> list[StepCurve]:
    """``trace`` for several GPUs at once: the step is traced once and only replayed per GPU.

    GPUs differ, for the trace, only in what no tensor owns (the CUDA context and the cuBLAS
    workspace, whose size depends on the architecture), so the storage log is shared and the
    workspace blocks are resized before each replay. ``runtimes`` are the GPUs (default: ``target``'s
    runtime alone); ``None`` in them means the visible GPU. ``target`` gives the device.

    ``batch_fits`` (one estimate of the same step per runtime) skips the second trace, which only
    serves the fit in the batch: the peaks are traced at ``batch_size`` and ``at()`` keeps those
    estimates' per-phase fits. A planner confirming a batch it chose from them needs no more.

    ``repeated`` is ``model`` built at two shallow depths, one block apart: the whole model's log is built from
    theirs (``memfit.tracing.depth``) instead of traced, and a model whose blocks do not repeat one another raises
    ``DepthMismatch`` (a model that cannot be traced with a symbolic batch, ``EstimationError``).
    """
    loop, target = loop or TrainingLoop(), target or Target()
    if runtimes is None:
        runtimes = [target.runtime]
    elif target.runtime is not None:
        raise InvalidInputError("give the GPUs either as runtimes= or as target.runtime, not both")
    if batch_fits is not None and len(batch_fits) != len(runtimes):
        raise InvalidInputError(f"batch_fits needs one estimate per runtime ({len(runtimes)}), got {len(batch_fits)}")
    step = _Step(
        optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, precision=precision,
        gradient_checkpointing=gradient_checkpointing, checkpoint_modules=checkpoint_modules, loss_fn=loss_fn,
        forward_fn=forward_fn, inference=inference,
    )  # fmt: skip
    settings, batches = _prepare(model, sample, batch_size, step, loop, target.with_runtime(runtimes[0]))
    if loop.sharding is not None:
        settings = sharded_settings(settings, loop.sharding)
    primary_batch, secondary_batch, sample_batch = batches
    fallback_note = None
    sharding = loop.sharding
    # FSDP on a CPU target is answered by real fully_shard on a fake process group, traced at the batch asked
    traced_fsdp = sharding is not None and sharding.strategy in ("fsdp", "fsdp-grad-op") and not settings.targets_cuda
    if batch_fits is None and symbolic_enabled() and not traced_fsdp:
        rewrite = _RankRewrite(sharding, model_facts(model, settings, step.checkpoint_modules)) if sharding else None
        exact = exact_estimates(model, sample, sample_batch, primary_batch, settings, runtimes, _build_estimate,
                                repeated=repeated, transform=rewrite)  # fmt: skip
        if not isinstance(exact, str):
            return [rewrite.annotate(curve) for curve in exact] if rewrite is not None else exact
        fallback_note = f"traced at two batch sizes, other batch sizes interpolated: {exact}"
    if repeated is not None:
        raise EstimationError(f"the model's log cannot be built from shallower traces: {fallback_note}")
    started = time.perf_counter()
    kept = _KeptTraces(model, sample, sample_batch, settings)
    try:
        primary = kept.at(primary_batch)
    except ValueDependentError as eager_error:
        if not has_compile_paths():
            raise
        settings = dataclasses.replace(settings, compile_paths=True)  # the model's value-free branch, if it has one
        kept = _KeptTraces(model, sample, sample_batch, settings)
        try:
            primary = kept.at(primary_batch)
        except MemfitError:
            raise eager_error from None
    secondary = None if batch_fits else kept.at(secondary_batch)
    elapsed = time.perf_counter() - started
    fits = list(batch_fits) if batch_fits else [None] * len(runtimes)
    notes = [fallback_note] if fallback_note else []
    if sharding is not None:  # one rank's log, rewritten from the single-process trace

        def traced_fsdp2() -> int | None:
            return traced_fsdp2_peak(model, sample, sample_batch, primary_batch, settings, sharding,
                                     step.checkpoint_modules)  # fmt: skip

        ranks = _one_rank(model, primary, secondary, settings, sharding, step, runtimes, elapsed, fits, traced_fsdp2)
        return [StepCurve(rank) for rank in ranks]
    if not settings.targets_cuda:
        return [StepCurve(_build_estimate(primary, secondary, settings, None, elapsed, fit).with_notes(*notes))
                for fit in fits]  # fmt: skip
    estimates = []
    for runtime, fit in zip(runtimes, fits, strict=True):
        runtime = runtime or CudaRuntime.of_current_device()
        for step_trace in (primary, secondary):
            if step_trace is not None:
                _resize_workspace(step_trace, runtime.workspace_bytes)
        built = _build_estimate(primary, secondary, settings, runtime, elapsed, fit)
        estimates.append(StepCurve(built.with_notes(*notes)))
    return estimates


class _KeptTraces:
    """``trace_steps`` of one step at a batch, from the trace cache where it holds that trace, else traced and kept
    (entries the symbolic path's concrete traces share): a step that cannot be traced with a symbolic batch is
    traced again only at batches it was never traced at."""

    def __init__(self, model: nn.Module, sample: Any, sample_batch: int, settings: TraceSettings) -> None:
        self._model, self._sample, self._sample_batch, self._settings = model, sample, sample_batch, settings
        self._key = trace_cache.session_key(model, sample, sample_batch, settings)  # the whole model: keyed once

    def at(self, batch: int) -> StepTrace:
        part = None
        if self._key is not None:
            try:
                part = trace_cache.trace_part(f"concrete:{batch}:None", self._sample, batch)
            except trace_cache.Uncacheable:
                part = None
        if part is not None and (kept := trace_cache.load(self._key, part, trace_data.decode_trace)) is not None:
            return kept
        traced = trace_steps(self._model, self._sample, self._sample_batch, batch, self._settings)
        if part is not None:
            trace_cache.store(self._key, part, trace_data.encode_trace(traced))
        return traced


class _RankRewrite:
    """One rank's log of ``sharding``'s run, rewritten from any trace of the step (``memfit.prediction.sharded``);
    the rank's plan is made from the first trace it sees (its model states are the same at every batch)."""

    def __init__(self, sharding: ShardingConfig, facts: Any) -> None:
        self._sharding, self._facts = sharding, facts
        self.plan: Any = None
        self.model: RankModel | None = None

    @functools.cached_property
    def identity(self) -> str:
        """What the rewrite reads besides the trace, as a key for its replays kept on disk: the sharding and the
        model's facts (the whole model's, where the trace is a shallower one's)."""
        return ":rank:" + hashlib.sha256(repr((self._sharding, self._facts)).encode()).hexdigest()[:32]

    def __call__(self, trace: StepTrace) -> StepTrace:
        if self.plan is None:
            self.model = RankModel(self._facts, traced_bytes(trace))
            self.plan = rank_plan(self._sharding, self.model.facts, self.model.traced)
        return shard_trace(trace, self.plan)

    def annotate(self, curve: StepCurve) -> StepCurve:
        sharding, plan = self._sharding, self.plan
        return curve.with_notes(*rank_notes(sharding, plan)).replaced(
            sharding=sharding, rank_terms=dict(plan.terms),
            rank_model=self.model,
            host_bytes_per_node=plan.host_bytes * (sharding.gpus_per_node or sharding.world_size),
        )  # fmt: skip


def _one_rank(
    model: nn.Module,
    primary: StepTrace,
    secondary: StepTrace | None,
    settings: TraceSettings,
    sharding: ShardingConfig,
    step: _Step,
    runtimes: Sequence[CudaRuntime | None],
    elapsed: float,
    fits: Sequence[MemoryEstimate | None],
    traced_fsdp2: Callable[[], int | None],
) -> list[MemoryEstimate]:
    """Estimates of one rank of ``sharding``'s run (``memfit.prediction.sharded``)."""
    model_of_rank = RankModel(model_facts(model, settings, step.checkpoint_modules), traced_bytes(primary))
    plan = rank_plan(sharding, model_of_rank.facts, model_of_rank.traced)
    primary = shard_trace(primary, plan)
    secondary = shard_trace(secondary, plan) if secondary is not None else None
    estimates = []
    for runtime, fit in zip(runtimes, fits, strict=True):
        if settings.targets_cuda:
            runtime = runtime or CudaRuntime.of_current_device()
            for step_trace in (primary, secondary):
                if step_trace is not None:
                    _resize_workspace(step_trace, runtime.workspace_bytes)
        built = _build_estimate(primary, secondary, settings, runtime if settings.targets_cuda else None, elapsed, fit)
        estimates.append(
            dataclasses.replace(
                built.with_notes(*rank_notes(sharding, plan)), sharding=sharding, rank_terms=dict(plan.terms),
                rank_model=model_of_rank,
                host_bytes_per_node=plan.host_bytes * (sharding.gpus_per_node or sharding.world_size),
            )
        )  # fmt: skip
    if sharding.strategy in ("fsdp", "fsdp-grad-op") and not settings.targets_cuda:
        estimates = [with_traced_fsdp2(e, traced_fsdp2()) for e in estimates]
    return estimates


@dataclass(frozen=True)
class _Step:
    """What the traced step computes, as ``estimate`` was given it (checked in ``_prepare``)."""

    optimizer: OptimizerSpec
    optimizer_kwargs: Mapping[str, Any] | None
    precision: Precision | str
    gradient_checkpointing: bool
    checkpoint_modules: CheckpointTarget | None
    loss_fn: LossFn | None
    forward_fn: ForwardFn | None
    inference: bool


def _resize_workspace(trace: StepTrace, workspace_bytes: int) -> None:
    recorder = trace.recorder
    for sid, category in recorder.categories.items():
        if category is Category.WORKSPACE:
            recorder.sizes[sid] = workspace_bytes


def _prepare(
    model: Any, sample: Any, batch_size: Any, step: _Step, loop: TrainingLoop, target: Target
) -> tuple[TraceSettings, tuple[int, int, int]]:
    """Check the step's arguments and turn them into trace settings and the batch sizes to trace at."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidInputError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if not isinstance(step.gradient_checkpointing, bool):
        raise InvalidInputError(f"gradient_checkpointing must be True or False, got {step.gradient_checkpointing!r}")
    for name, fn in (("loss_fn", step.loss_fn), ("forward_fn", step.forward_fn)):
        if fn is not None and not callable(fn):
            raise InvalidInputError(f"{name} must be callable or None, got {fn!r}")
    device = target.torch_device
    parsed_precision = Precision.parse(step.precision)
    if not step.inference and not any(p.requires_grad for p in model.parameters()):
        raise InvalidInputError(
            f"{type(model).__name__} has no parameter that requires grad, so there is no training step to "
            "plan; unfreeze some parameters"
        )

    is_factory = callable(sample) and not isinstance(sample, (torch.Tensor, Mapping, list, tuple))
    sample_batch = (batch_size or 1) if is_factory else infer_batch_size(sample)
    if not is_factory and (length := sequence_length(sample, sample_batch)) is not None:
        # fake tensors read no values: a lookup past a learned position table would trace without error
        check_sequence_length(model, length, fix="truncate the sample to {positions} tokens or fewer")
    primary = batch_size or sample_batch
    secondary = primary * 2
    runtime = target.runtime or CudaRuntime.of_current_device()
    backend = find_backend(device)
    emulate = backend is not None and backend.emulates_on_host()
    traced_loop = loop.for_inference() if step.inference else loop
    settings = TraceSettings(
        target=device,
        device=torch.device("cpu") if emulate else device,
        emulate_cuda=emulate,
        precision=parsed_precision,
        optimizer=step.optimizer,
        optimizer_kwargs=dict(step.optimizer_kwargs) if step.optimizer_kwargs else None,
        gradient_checkpointing=step.gradient_checkpointing,
        checkpoint_modules=step.checkpoint_modules,
        loss_fn=step.loss_fn,
        forward_fn=step.forward_fn,
        workspace_bytes=runtime.workspace_bytes if device.type == "cuda" else 0,
        runtime=runtime,
        inference=bool(step.inference),
        zero_grad=traced_loop.zero_grad,
        accumulation_steps=traced_loop.accumulation_steps,
        ddp=traced_loop.ddp,
        extra_batches=traced_loop.extra_batches,
    )
    return settings, (primary, secondary, sample_batch)


def _fit(
    peaks_a: Sequence[PhasePeak], peaks_b: Sequence[PhasePeak], batch_a: int, batch_b: int
) -> tuple[PhaseModel, ...]:
    """Per-phase ``fixed + slope x batch`` from the same phase of the same step at two batch sizes.

    The peak can sit at a different op in each step (warm-up vs steady), so phases are only ever
    compared with themselves.
    """
    by_key = {(p.step, p.phase): p for p in peaks_b}
    span = batch_b - batch_a
    models = []
    for peak in peaks_a:
        other = by_key[(peak.step, peak.phase)]
        slope = max(0.0, (other.tensor_bytes - peak.tensor_bytes) / span)
        models.append(PhaseModel(peak.step, peak.phase, round(peak.tensor_bytes - slope * batch_a), slope))
    return tuple(models)


def _ratio(peaks: Sequence[PhasePeak], numerator: str, denominator: str) -> float:
    top = max(getattr(p, numerator) for p in peaks)
    return top / max(1, max(getattr(p, denominator) for p in peaks))


def _kept_from_first_forward(trace: StepTrace) -> int:
    recorder = trace.recorder
    return sum(
        recorder.sizes[sid]
        for sid, category in recorder.categories.items()
        if category is Category.ACTIVATIONS and recorder.alloc_phase.get(sid) == 0
    )


def _build_estimate(
    primary: StepTrace,
    secondary: StepTrace | None,
    settings: TraceSettings,
    runtime: CudaRuntime | None,
    elapsed: float,
    fit: MemoryEstimate | None = None,
    replays: StepReplays | None = None,
) -> MemoryEstimate:
    """Replay the traces into an estimate; without ``secondary``, the fit in the batch is ``fit``'s. ``replays``:
    the traces' replays made already (``replay_step``; kept ones)."""
    cuda = runtime is not None
    peaks, timeline, peaks_b = replays or replay_step(primary.recorder, secondary and secondary.recorder, cuda)
    top = max(peaks, key=lambda p: p.allocated_bytes)
    peak_reserved = max(p.reserved_bytes for p in peaks)
    if secondary is not None:
        models = _fit(peaks, peaks_b, primary.batch_size, secondary.batch_size)
        allocated_ratio = max(_ratio(pk, "allocated_bytes", "tensor_bytes") for pk in (peaks, peaks_b))
        reserved_ratio = max(_ratio(pk, "reserved_bytes", "allocated_bytes") for pk in (peaks, peaks_b))
    elif fit is not None:  # the fit's ratios, raised so that at() of the traced batch covers its peaks
        models = fit.phase_models
        tensors = max(1, max(m.at(primary.batch_size) for m in models))
        allocated_ratio = max(fit.allocated_to_tensor_ratio, top.allocated_bytes / tensors)
        reserved_ratio = max(fit.reserved_to_allocated_ratio, peak_reserved / math.ceil(tensors * allocated_ratio))
    else:
        raise InvalidInputError("an estimate traced at one batch size needs the fit of another estimate")
    top_model = next((m for m in models if (m.step, m.phase) == (top.step, top.phase)), None)
    if top_model is None:
        raise EstimationError("the step traced differently from the estimate given as batch_fits; trace it whole")
    notes = []
    if settings.emulate_cuda:
        notes.append("traced on fake CPU tensors with CUDA kernels' memory substituted")
    for name, count in sorted(primary.substitutions.items()):
        notes.append(f"{name}: {count} call(s) per trace modelled as on CUDA")
    kinds = getattr(primary.recorder, "scratch_kinds", {})
    if kinds:
        added = ", ".join(f"{kind} x {count}" for kind, count in sorted(kinds.items()))
        notes.append(f"memory CUDA kernels allocate for themselves, added per trace: {added}")
    if settings.compile_paths:
        notes.append(
            "the model's eager forward reads tensor values: traced the branch it keeps for torch.compile "
            "(transformers' is_torchdynamo_compiling() true), which e.g. builds an attention mask even where "
            "an eager run skips an all-ones one"
        )
    if primary.checkpointing:
        notes.append(f"checkpointing: {primary.checkpointing}")
    if primary.compiled:
        notes.append(COMPILED_NOTE)
    if settings.zero_grad == "before_backward" and settings.accumulation_steps == 1:
        notes.append("zero_grad before backward (Lightning): each forward carries the last step's gradients")
    if settings.zero_grad == "in_place":
        notes.append("zero_grad(set_to_none=False): gradients are zeroed, never freed, so every step carries them")
    if settings.accumulation_steps > 1:
        notes.append(
            f"gradient accumulation over {settings.accumulation_steps} micro batches: step 2 is a later micro "
            "batch, with the window's gradients alive"
        )
    if settings.extra_batches:
        notes.append(f"{settings.extra_batches} more batch(es) held on the device through the step")
    if primary.paged is not None and primary.paged.total_bytes:
        notes.append(paged_note(primary.paged))
    if settings.ddp is not None:
        buckets = top.breakdown.get(Category.GRADIENT_BUCKETS, 0)
        notes.append(f"{settings.ddp.describe()}: {format_bytes(buckets)} at the peak")
    return MemoryEstimate(
        batch_size=primary.batch_size,
        device="cuda" if cuda else "cpu",
        precision=settings.precision,
        optimizer="none" if settings.inference else optimizer_name(settings.optimizer),
        gradient_checkpointing=settings.gradient_checkpointing,
        peak_allocated_bytes=top.allocated_bytes,
        peak_reserved_bytes=peak_reserved,
        cuda_context_bytes=runtime.cuda_context_bytes if runtime else None,
        peak_step=top.step,
        peak_phase=top.phase,
        breakdown={category: size for category, size in top.breakdown.items()},
        fixed_bytes=top_model.fixed_bytes,
        per_sample_bytes=math.ceil(top_model.per_sample_bytes),
        phases=tuple(peaks),
        phase_models=models,
        trace_seconds=elapsed,
        activation_bytes=_kept_from_first_forward(primary),
        allocated_to_tensor_ratio=allocated_ratio,
        reserved_to_allocated_ratio=reserved_ratio,
        notes=tuple(notes),
        timeline=tuple(timeline),
        zero_grad=settings.zero_grad,
        accumulation_steps=settings.accumulation_steps,
        ddp=settings.ddp,
        extra_batches=settings.extra_batches,
        inference=settings.inference,
        seq_len=primary.seq_len,
    )


def extrapolate_depth(
    shallow_curve: StepCurve,
    deeper_curve: StepCurve,
    shallow_depth: int,
    deeper_depth: int,
    depth: int,
    *,
    doubled: tuple[MemoryEstimate, MemoryEstimate] | None = None,
) -> StepCurve:
    """The step of a ``depth``-block model from traces of the same model at two smaller depths.

    A stack of identical blocks adds the same parameters, gradients, optimizer state and saved
    activations per block, so every phase's peak is affine in the depth, and so is each term of its
    fit in the batch: each is extended along the line through the two traces. The peak phase is
    chosen again at the new depth, since two affine peaks can cross. What the allocator holds beyond
    the tensors is extended in bytes, bounded by what it sits on, and no phase reserves less than
    the one before (``_extrapolated_phases``); the timeline is stretched to the new depth
    (``memfit.simulation.replay.extrapolate_timeline``).

    ``at()``'s allocator ratios are those of the extrapolated peaks, never the shallow traces' own:
    the allocator's overhead does not grow with the depth as the peak does, and under checkpointing a
    shallow trace holds little but the head's and the loss's transients, so its ratio is the largest;
    copied to the whole model it scaled that overhead with every block and put checkpointing above no
    checkpointing where whole traces put it below. ``doubled`` (the same two depths traced at twice
    the batch) gives the ratios at that batch too, as a whole estimate's come from its two batches;
    without it they are the traced batch's alone.
    """
    if not 0 < shallow_depth < deeper_depth:
        raise InvalidInputError(f"need 0 < shallow_depth < deeper_depth, got {shallow_depth}, {deeper_depth}")
    shallow, deeper = shallow_curve.estimate, deeper_curve.estimate
    pairs = [(shallow, deeper), *([doubled] if doubled is not None else [])]
    for a, b in pairs:
        model_keys = [(m.step, m.phase) for m in a.phase_models]
        if [(p.step, p.phase) for p in a.phases] != [(p.step, p.phase) for p in b.phases] or model_keys != [
            (m.step, m.phase) for m in b.phase_models
        ]:
            raise EstimationError("the two depths traced different phases; trace the full model instead")
        if a.batch_size != b.batch_size:
            raise EstimationError("the two depths were traced at different batch sizes; trace the full model instead")
    t = (depth - shallow_depth) / (deeper_depth - shallow_depth)

    def line(a: float, b: float) -> int:
        return max(0, round(a + (b - a) * t))

    phases = _extrapolated_phases(shallow.phases, deeper.phases, t)
    models = tuple(
        PhaseModel(m.step, m.phase, line(m.fixed_bytes, n.fixed_bytes),
                   m.per_sample_bytes + (n.per_sample_bytes - m.per_sample_bytes) * t)
        for m, n in zip(shallow.phase_models, deeper.phase_models, strict=True)
    )  # fmt: skip
    peak = max(phases, key=lambda p: p.allocated_bytes)
    peak_model = next((m for m in models if (m.step, m.phase) == (peak.step, peak.phase)), models[0])
    peak_reserved = max(p.reserved_bytes for p in phases)
    traced = [phases, *([_extrapolated_phases(doubled[0].phases, doubled[1].phases, t)] if doubled is not None else [])]
    allocated_ratio = max(_ratio(pk, "allocated_bytes", "tensor_bytes") for pk in traced)
    reserved_ratio = max(_ratio(pk, "reserved_bytes", "allocated_bytes") for pk in traced)
    tensors = max(1, max(m.at(deeper.batch_size) for m in models))  # at() of the traced batch covers its peaks
    allocated_ratio = max(1.0, allocated_ratio, peak.allocated_bytes / tensors)
    reserved_ratio = max(1.0, reserved_ratio, peak_reserved / math.ceil(tensors * allocated_ratio))
    extrapolated = dataclasses.replace(
        deeper,
        peak_allocated_bytes=peak.allocated_bytes,
        peak_reserved_bytes=peak_reserved,
        allocated_to_tensor_ratio=allocated_ratio,
        reserved_to_allocated_ratio=reserved_ratio,
        peak_step=peak.step,
        peak_phase=peak.phase,
        breakdown=dict(peak.breakdown),
        fixed_bytes=peak_model.fixed_bytes,
        per_sample_bytes=round(peak_model.per_sample_bytes),
        phases=tuple(phases),
        phase_models=models,
        trace_seconds=sum(e.trace_seconds for pair in pairs for e in pair),
        activation_bytes=line(shallow.activation_bytes, deeper.activation_bytes),
        # a rank's shards grow with the blocks as the states they are cut from do
        rank_terms={k: line(shallow.rank_terms.get(k, 0), v) for k, v in deeper.rank_terms.items()},
        rank_model=deeper.rank_model,  # its terms' ratios between world sizes are the deep model's
        host_bytes_per_node=None if deeper.host_bytes_per_node is None else line(
            shallow.host_bytes_per_node or 0, deeper.host_bytes_per_node),
        timeline=extrapolate_timeline(shallow.timeline, deeper.timeline, t),
        notes=(*deeper.notes, f"extrapolated in depth to {depth} blocks from traces at {shallow_depth} and "
               f"{deeper_depth}"),
    )  # fmt: skip
    return StepCurve(extrapolated, _depth_line(shallow_curve, deeper_curve, (shallow_depth, deeper_depth, depth)))


def _depth_line(shallow: StepCurve, deeper: StepCurve, depths: tuple[int, int, int]) -> _DepthLine | None:
    """``at()`` of an extrapolated step from both depths' replays at that batch (symbolic traces), when both
    have them: the same line in the depth, at every batch (and sequence length), instead of the fit in the batch."""
    if shallow.replayer is None or deeper.replayer is None:
        return None
    return _DepthLine(shallow, deeper, depths)


class _DepthLine:
    """Both depths' replays at a batch (and sequence length), on the line through them to the whole depth."""

    def __init__(self, shallow: StepCurve, deeper: StepCurve, depths: tuple[int, int, int]) -> None:
        self._shallow, self._deeper, self._depths = shallow, deeper, depths
        low, high, depth = depths
        self._t = (depth - low) / (high - low)

    def __call__(self, batch: int, seq_len: int | None = None) -> tuple[PhasePeak, ...] | None:
        a, b = self._shallow.replayer, self._deeper.replayer
        assert a is not None and b is not None
        low, high = (a(batch), b(batch)) if seq_len is None else (a(batch, seq_len), b(batch, seq_len))
        if low is None or high is None or [(p.step, p.phase) for p in low] != [(p.step, p.phase) for p in high]:
            return None
        return tuple(_extrapolated_phases(low, high, self._t))

    def estimate_at_length(self, batch: int, seq_len: int) -> StepCurve:
        """The extrapolated step at ``seq_len`` tokens a sample: both depths read at that length, then the line."""
        low, high, depth = self._depths
        shallow, deeper = (e.rebuilt_at(batch, seq_len) for e in (self._shallow, self._deeper))
        return extrapolate_depth(shallow, deeper, low, high, depth)


def _extrapolated_phases(shallow: Sequence[PhasePeak], deeper: Sequence[PhasePeak], t: float) -> list[PhasePeak]:
    """Each phase's peaks at ``t`` on the line through the two depths (0: ``shallow``, 1: ``deeper``).

    Allocated and tensor bytes follow the line. What the allocator reserves beyond the allocated
    blocks (cached free blocks) is extended in bytes, never as a ratio: those blocks are blocks the
    step freed, so per block of depth they grow at most as fast as the allocated peak they sit on,
    and at most in the share of it the deeper trace wastes (part of that waste is the head's and the
    loss's, which does not repeat per block); they never shrink below what either trace shows.
    Between two shallow traces they jump by whole segments (20 MiB, 2 MiB rounding), which the line
    alone would multiply. The caching allocator keeps what it reserved, so no phase reserves less
    than the one before."""

    def line(a: float, b: float) -> int:
        return max(0, round(a + (b - a) * t))

    def breakdown(a: Mapping[Category, int], b: Mapping[Category, int]) -> dict[Category, int]:
        return {c: line(a.get(c, 0), b.get(c, 0)) for c in dict.fromkeys([*a, *b])}

    phases: list[PhasePeak] = []
    reserved = 0
    for p, q in zip(shallow, deeper, strict=True):
        allocated = line(p.allocated_bytes, q.allocated_bytes)
        slack_a, slack_b = p.reserved_bytes - p.allocated_bytes, q.reserved_bytes - q.allocated_bytes
        growth = min(slack_b - slack_a, max(0, q.allocated_bytes - p.allocated_bytes))
        extended = slack_b + growth * (t - 1)
        proportional = slack_b * allocated / max(1, q.allocated_bytes)  # the deeper trace's share of waste, at most
        reserved = max(reserved, allocated + max(slack_a, slack_b, round(min(extended, proportional))))
        tensors = line(p.tensor_bytes, q.tensor_bytes)
        phases.append(PhasePeak(p.step, p.phase, allocated, reserved, breakdown(p.breakdown, q.breakdown), tensors))
    return phases
