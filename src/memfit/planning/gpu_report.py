"""``memfit plan``: one model, several GPUs, one plan each; the data behind the CLI's table and JSON."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import EstimationError, InsufficientMemoryError, InvalidInputError
from memfit.planning.capacity import parse_budget
from memfit.planning.deep_models import BUILD_DEPTHS, EXTRAPOLATION_DEPTHS, DeepModel, model_depth
from memfit.planning.finetune import (
    FinetuneReport,
    FinetuneSpec,
    apply_finetune,
    finetune_report,
    from_config_quantization,
)
from memfit.planning.gpus import GPU, gpu_by_name
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.session import PlanningSession, PlanRequest
from memfit.precision import Precision
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate, trace_for_runtimes
from memfit.prediction.host import HostEstimate, estimate_host, offloaded_optimizer_bytes
from memfit.presets import ModelSpec, from_factory, from_hf_config
from memfit.simulation.allocator import AllocatorConfig
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.batch import sequence_length
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.model_limits import check_sequence_length
from memfit.tracing.symbolic import symbolic_enabled
from memfit.tracing.tracer import ZeroGrad

__all__ = [
    "BUILD_DEPTHS",
    "EXTRAPOLATION_DEPTHS",
    "EXTRAPOLATION_ERROR_BAND",
    "GpuPlan",
    "PlanReport",
    "model_depth",
    "plan_for_gpus",
    "traced_how",
]

# A deep preset's log is built from traces at BUILD_DEPTHS (memfit.planning.deep_models); where it cannot be, a
# large one is searched on traces at EXTRAPOLATION_DEPTHS extrapolated in depth, and confirmed on the whole model.
# Plans start from the estimate at batch 2: its symbolic trace answers 2 and every batch above it, and batch 1, which
# takes concrete traces of its own (a dimension of size 1 broadcasts), is traced only when 2 does not fit.
START_BATCH = 2
EXTRAPOLATION_MIN_PARAMETERS = 10**9  # below this a full trace takes seconds anyway
# How far an extrapolated peak may sit above the whole model's: the search's figure (at(batch) with the CUDA
# context) is within +-3 % of the whole trace's on the billion-parameter configs benchmarks/depth_extrapolation.py
# measures, and +17 % at worst on any (GPT-2 with checkpointing, which the CLI traces whole).
# A "no" whose smallest extrapolated peak is within this of the budget is decided again on whole traces.
EXTRAPOLATION_ERROR_BAND = 0.20


# a row's plan fields in the JSON (``Plan.to_dict`` but the capacity, which every row has)
_PLAN_KEYS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "capacity_bytes")


@dataclass(frozen=True)
class GpuPlan:
    """The plan for one GPU, or why there is none."""

    gpu: str
    capacity_bytes: int
    plan: Plan | None
    estimate: MemoryEstimate | None
    error: str | None = None
    approximate: bool = False
    base: StepCurve | None = None  # the trace at batch 1 the plan started from (for the batch curve)
    precision: str | None = None  # what this card is planned in (``None``: it cannot run the one asked for)
    note: str | None = None  # why the precision is not the report's
    seq_len: int | None = None  # the sequence length of a row of a sweep (``None``: the report's)

    @property
    def refused(self) -> bool:
        """The card cannot run what was asked (its ``error`` says why): nothing was planned for it."""
        return self.precision is None and self.plan is None and self.error is not None

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                               "approximate": self.approximate, "error": self.error, "precision": self.precision,
                               "note": self.note, "refused": self.refused}  # fmt: skip
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        if self.plan is not None:
            out.update({k: v for k, v in self.plan.to_dict().items() if k not in ("capacity_bytes",)})
        else:  # the same keys on every row, so that a reader of the JSON needs no check for the ones without a plan
            out.update({k: None for k in _PLAN_KEYS})
        if self.estimate is not None:
            out["breakdown_bytes"] = self.estimate.to_dict()["breakdown_bytes"]
            out["peak_phase"] = f"step {self.estimate.peak_step} {self.estimate.peak_phase.value}"
        else:
            out.update(breakdown_bytes=None, peak_phase=None)
        return out


@dataclass(frozen=True)
class PlanReport:
    model: str
    parameters: int
    precision: str
    optimizer: str
    seq_len: int | None
    rows: tuple[GpuPlan, ...] = field(default=())
    inference: bool = False
    host: HostEstimate | None = None
    depth_extrapolated_from: tuple[int, int] | None = None  # the depths traced, when extrapolated
    depth_built_from: tuple[int, int] | None = None  # the depths traced, when the whole log was built from them
    depth_not_built: str | None = None  # why a deep model's log could not be built from shallow traces
    finetune: FinetuneReport | None = None  # LoRA / quantization: the weights by role

    def plot(self, path: str) -> None:
        """Both pictures: the traced step at the first plan's batch, and peak vs batch for every GPU.

        A plan is confirmed on a trace of the whole model, so its timeline is that trace's; with no
        plan, the timeline at batch 1 is the one extrapolated in depth when the search was."""
        from memfit.reporting.plots import plot_plan

        traced = [row for row in self.rows if row.seq_len is None]  # the traced length's rows, not a sweep's
        base = next((row.base for row in traced if row.base is not None), None)
        if base is None:
            raise InvalidInputError("nothing was traced to draw: no GPU could run the precision asked for")
        capacities = {row.gpu: row.capacity_bytes for row in traced}
        chosen = {row.gpu: row.plan.micro_batch_size for row in traced if row.plan is not None}
        first = next((row.estimate for row in traced if row.estimate is not None), None)
        lengths = [row.seq_len for row in self.rows if row.seq_len is not None]
        plot_plan(base, capacities=capacities, chosen=chosen, timeline_of=first, seq_lens=lengths, path=path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "parameters": self.parameters,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "seq_len": self.seq_len,
            "inference": self.inference,
            "gpus": [row.to_dict() for row in self.rows],
            "host": self.host.to_dict() if self.host else None,
            "depth_extrapolated_from": list(self.depth_extrapolated_from) if self.depth_extrapolated_from else None,
            "depth_built_from": list(self.depth_built_from) if self.depth_built_from else None,
            "depth_not_built": self.depth_not_built,
            "finetune": self.finetune.to_dict() if self.finetune else None,
        }


def plan_for_gpus(
    *,
    hf_config: str | None,
    model: str | None,
    gpus: list[str],
    budget: str | None,
    seq_len: int = 1024,
    image_size: int | None = None,
    layers: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    checkpointing: str = "auto",
    target_batch_size: int | str = "max",
    world_size: int = 1,
    margin: float = DEFAULT_MARGIN,
    show_progress: bool = False,
    inference: bool = False,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    offload_optimizer: bool = False,
    exact: bool = False,
    zero_grad: ZeroGrad = "after_step",
    finetune: FinetuneSpec | None = None,
    more_seq_lens: Sequence[int] = (),
    allocator: AllocatorConfig | None = None,
) -> PlanReport:
    """Trace once per GPU architecture, then plan (and confirm with a trace at the chosen batch) per GPU.

    A ``hf_config`` deeper than ``BUILD_DEPTHS[1]`` blocks is traced at those depths and the whole
    model's log built from them (``memfit.planning.deep_models``), unless ``exact`` or ``layers``. Where
    the log cannot be built, one with a billion parameters or more is searched on traces at
    ``EXTRAPOLATION_DEPTHS`` extrapolated in depth (the allocated peak follows the depth closely, the
    allocator's reserved peak less so); the plan found is then confirmed, and its row's figures taken,
    from a trace of the whole model at the chosen batch. A "does not fit" is then decided again on traces
    of the whole model unless even its smallest extrapolated peak is more than ``EXTRAPOLATION_ERROR_BAND``
    over the budget; such a far "no" says in its message that it rests on the extrapolation.
    ``benchmarks/depth_extrapolation.py`` compares both with full traces.

    ``world_size`` above 1 means DistributedDataParallel (its gradient buckets count); a plan that
    accumulates is confirmed on a trace with accumulation, as its gradients outlive a micro batch.

    ``precision`` ``None`` plans each card in its usual precision (``GPU.precision_for``): bf16-mixed,
    or 16-mixed on cards without bf16 (T4, V100); with ``inference``, half-precision weights (bf16, or
    fp16 there). A bf16 precision asked of a card without bf16 is that row's error. One trace serves
    every GPU planned in the same precision.

    ``finetune`` adds LoRA adapters and a bitsandbytes layout to every model traced (``memfit.planning.finetune``).
    ``more_seq_lens`` plans every GPU again at each of those sequence lengths, read off the same traces (their
    sequence length is symbolic: ``StepCurve.for_seq_len``); those rows carry their ``seq_len``.
    ``allocator``: the caching allocator's options the run will have (default: ``PYTORCH_ALLOC_CONF`` here); each
    micro batch is fitted where the allocator, freeing its cache and retrying, really runs out of memory."""
    if not gpus and budget is None:
        raise InvalidInputError("name at least one --gpu (e.g. h100) or give a --budget (e.g. 20GiB)")
    targets = _targets(gpus, budget)
    default = _default_precision(precision, inference)
    precisions = [_card_precision(gpu, precision, default, inference) for _, _, gpu in targets]
    spec = _meta_spec(hf_config, model, seq_len, image_size, layers, show_progress)
    check_sequence_length(spec.model, max((seq_len, *more_seq_lens)), fix="use --seq-len {positions} or less")
    if model is not None and more_seq_lens:
        _check_sweep(spec, model, (seq_len, *more_seq_lens))
    parameters = sum(p.numel() for p in spec.model.parameters())
    finetune = from_config_quantization(spec, finetune or FinetuneSpec())
    spec = apply_finetune(spec, finetune, default, inference=inference)
    runtimes = [gpu.runtime if gpu else CudaRuntime() for _, _, gpu in targets]
    # One trace serves every GPU of a precision. Confirmations at a chosen batch take their fit in the
    # batch from the search's trace at batch 1, so they trace once instead of twice.
    loop = TrainingLoop(zero_grad=zero_grad, ddp=DDPConfig() if world_size > 1 else None)
    whole_only = not hf_config or exact or layers is not None
    build_at = _shallow_builder(spec.name, hf_config, finetune, default, inference, seq_len, image_size, show_progress)
    deep = DeepModel.of(spec, None if whole_only else build_at, large=parameters >= EXTRAPOLATION_MIN_PARAMETERS)
    probe = checkpointing == "on" and not inference
    traces_in = _tracers_by_precision(deep, runtimes, precisions, optimizer, inference, loop, probe)
    allow = "off" if inference else checkpointing
    rows = []
    for position, ((name, capacity, gpu), row_precision) in enumerate(zip(targets, precisions, strict=True)):
        if not isinstance(row_precision, Precision):  # the card cannot run the precision asked for
            rows.append(GpuPlan(name, capacity, None, None, error=row_precision,
                                approximate=bool(gpu and gpu.approximate)))  # fmt: skip
            continue
        with _progress(show_progress, f"tracing {spec.name} and planning for {name}"):
            index = sum(p is row_precision for p in precisions[:position])  # its place among its precision's cards
            for_gpu, whole = _card_traces(*traces_in(row_precision), index)
            request = PlanRequest(capacity_bytes=capacity, margin=margin, target_batch_size=target_batch_size,
                                  world_size=world_size, allow_checkpointing=allow == "auto",
                                  always_checkpoint=allow == "on", allocator=allocator)  # fmt: skip
            row = _plan_one(name, gpu, for_gpu, request, whole, deep.extrapolated)
            rows.append(_in_precision(row, row_precision, default, gpu))
            for length in more_seq_lens:
                rows.append(_in_precision(_at_length(name, gpu, for_gpu, whole, request, deep, length, seq_len),
                                          row_precision, default, gpu))  # fmt: skip
    host = _host(
        spec, rows, num_workers, prefetch_factor, pin_memory, offload_optimizer, optimizer, inference, default.value
    )
    return PlanReport(spec.name, parameters, _shown_precision(rows, default), "none" if inference else optimizer,
                      _report_seq_len(spec, model, seq_len), tuple(rows),
                      inference=inference, host=host, depth_extrapolated_from=deep.extrapolated,
                      depth_built_from=deep.built, depth_not_built=deep.not_built,
                      finetune=finetune_report(spec.model, finetune, default, rows, inference=inference))  # fmt: skip


def _report_seq_len(spec: ModelSpec, model: str | None, seq_len: int) -> int | None:
    """The sample's own token length: a factory's sample sets its shapes; an image or feature model has none."""
    found = sequence_length(spec.sample(2), 2) if callable(spec.sample) else sequence_length(spec.sample, 2)
    return found if model is not None or found is None else seq_len


def _shown_precision(rows: list[GpuPlan], default: Precision) -> str:
    """The report's precision: the one every planned card shares (a T4 alone: 16-mixed), else the default, which
    the rows planned otherwise say in their notes."""
    planned = {row.precision for row in rows if row.precision is not None}
    return planned.pop() if len(planned) == 1 else default.value


def traced_how(report: PlanReport, *, extrapolated: str) -> list[str]:
    """The lines that say how a deep model was traced: its log built from shallow traces, or the whole model traced
    (with why its log could not be built), or the search ``extrapolated`` (that line's words) in depth."""
    lines = []
    if report.depth_built_from:
        low, high = report.depth_built_from
        lines.append(f"traced at {low} and {high} blocks, the whole model's log built from them (--exact: trace the "
                     "whole model)")  # fmt: skip
    elif report.depth_not_built:
        low, high = BUILD_DEPTHS
        searched = "the search extrapolated in depth" if report.depth_extrapolated_from else "the whole model traced"
        lines.append(f"{searched}: its log could not be built from traces at {low} and {high} blocks "
                     f"({report.depth_not_built})")  # fmt: skip
    if report.depth_extrapolated_from:
        low, high = report.depth_extrapolated_from
        lines.append(extrapolated.format(low=low, high=high))
    return lines


def _check_sweep(spec: Any, model: str, lengths: Sequence[int]) -> None:
    """A factory's own sample sets its shapes: a sweep of sequence lengths needs token ids in it."""
    sample = spec.sample(2) if callable(spec.sample) else spec.sample
    if sequence_length(sample, 2) is None:
        raise InvalidInputError(
            f"--seq-len {','.join(map(str, lengths))} sweeps sequence lengths, but the sample of --model {model} holds "
            "no token ids (an integer [batch, seq] tensor) to vary: drop --seq-len, or make the factory's "
            "sample(batch_size) build token ids"
        )


def _meta_spec(hf_config: str | None, model: str | None, seq_len: int, image_size: int | None, layers: int | None,
               show_progress: bool) -> ModelSpec:  # fmt: skip
    """The model on the meta device: a config's (a preset or a ``config.json``) or the factory's."""
    with _progress(show_progress, "building the model on the meta device"):
        return from_hf_config(hf_config, seq_len=seq_len, image_size=image_size, layers=layers) if hf_config else (
            from_factory(model, seq_len=seq_len)
        )  # fmt: skip


def _shallow_builder(
    name: str,
    hf_config: str | None,
    finetune: FinetuneSpec,
    default: Precision,
    inference: bool,
    seq_len: int,
    image_size: int | None,
    show_progress: bool,
) -> Callable[[int], ModelSpec]:
    """``build_at(depth)``: the config at ``depth`` blocks, fine-tuned as the whole model is, for the traces a deep
    model's log is built (or extrapolated) from."""

    def build_at(depth: int) -> ModelSpec:
        with _progress(show_progress, f"building {name} at {depth} blocks"):
            shallow = from_hf_config(hf_config, seq_len=seq_len, image_size=image_size, layers=depth)
            return apply_finetune(shallow, finetune, default, inference=inference)

    return build_at


def _targets(gpus: list[str], budget: str | None) -> list[tuple[str, int, GPU | None]]:
    """``(name, capacity, card)`` of each row: every GPU named, then the budget (no card) if one was given."""
    targets: list[tuple[str, int, GPU | None]] = [(g.name, g.memory_bytes, g) for g in map(gpu_by_name, gpus)]
    if budget is not None:
        targets.append((f"budget {budget}", parse_budget(budget), None))
    return targets


def _tracers_by_precision(deep: DeepModel, runtimes: list[CudaRuntime], precisions: list[Precision | str],
                          optimizer: str, inference: bool, loop: TrainingLoop,
                          probe: bool) -> Callable[[Precision], tuple[Any, Any]]:  # fmt: skip
    """``traces_in(precision)``: ``(search trace, full trace)`` in ``precision``, over the runtimes of the cards
    planned in it, made once however many cards share it."""

    @functools.cache
    def traces_in(precision: Precision) -> tuple[Any, Any]:
        group = [runtime for runtime, p in zip(runtimes, precisions, strict=True) if p is precision]

        def tracer(model_spec: ModelSpec, **keywords: Any) -> Any:
            return _tracer(model_spec, precision, optimizer, group, inference, loop, **keywords)

        return deep.tracers(tracer, probe)

    return traces_in


def _card_traces(trace: Any, full_trace: Any, index: int) -> tuple[Any, Any]:
    """``(search, whole)`` of one card: its estimate (the ``index``-th of its precision's runtimes) from each."""

    def for_gpu(batch: int, checkpointing: bool, accumulation: int = 1, source: Any = trace) -> StepCurve:
        return source(batch, checkpointing, accumulation)[index]

    return for_gpu, functools.partial(for_gpu, source=full_trace)


def _at_length(name: str, gpu: GPU | None, search: Any, whole: Any, request: PlanRequest, deep: DeepModel,
               length: int, traced_length: int) -> GpuPlan:  # fmt: skip
    """The row of ``gpu`` at sequence length ``length``, planned on the traces made at ``traced_length``."""

    def at_length(source: Any) -> Any:
        return lambda batch, checkpointing, accumulation=1: source(batch, checkpointing, accumulation).for_seq_len(
            length
        )

    try:
        row = _plan_one(name, gpu, at_length(search), request, at_length(whole), deep.extrapolated)
    except (InvalidInputError, EstimationError) as error:
        row = GpuPlan(name, request.capacity_bytes, None, None,
                      error=f"sequence length {length} not read off the trace at {traced_length}: {error}")  # fmt: skip
    return dataclasses.replace(row, seq_len=length)


def _default_precision(requested: str | None, inference: bool) -> Precision:
    """The precision asked for, or the one cards with bf16 are planned in when none was."""
    if requested is not None:
        return Precision.parse(requested)
    return Precision.BF16_TRUE if inference else Precision.BF16_MIXED


def _card_precision(gpu: GPU | None, requested: str | None, default: Precision, inference: bool) -> Precision | str:
    """The precision ``gpu`` is planned in, or why it cannot run the one asked for (a budget: ``default``)."""
    if gpu is None:
        return default
    try:
        return gpu.precision_for(requested, inference=inference)
    except InvalidInputError as error:
        return str(error)


def _in_precision(row: GpuPlan, precision: Precision, default: Precision, gpu: GPU | None) -> GpuPlan:
    """The row with its precision, and a note when it is not the report's (a card without bf16)."""
    note = None
    if precision != default and gpu is not None:
        note = f"planned in {precision.value}: {gpu.architecture} cards have no bf16"
    plan = row.plan.with_reason(note) if row.plan is not None and note else row.plan
    return dataclasses.replace(row, plan=plan, precision=precision.value, note=note)


def _host(spec: ModelSpec, rows: list[GpuPlan], num_workers: int, prefetch_factor: int, pin_memory: bool,
          offload_optimizer: bool, optimizer: str, inference: bool, precision: str) -> HostEstimate:  # fmt: skip
    """Host RAM for the largest planned micro batch (weights as stored, batches in flight, offload)."""
    half = Precision.parse(precision) in (Precision.FP16_TRUE, Precision.BF16_TRUE)  # stored and loaded as 16-bit
    weights = sum(
        t.numel() * (2 if half and t.is_floating_point() else t.element_size())
        for t in [*spec.model.parameters(), *spec.model.buffers()]
    )
    micro = max((row.plan.micro_batch_size for row in rows if row.plan), default=1)
    batch = spec.sample(micro)
    tensors = list(batch.values()) if isinstance(batch, dict) else [t for t in batch if hasattr(t, "numel")]
    batch_bytes = sum(t.numel() * t.element_size() for t in tensors)
    trainable = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
    offload = offloaded_optimizer_bytes(optimizer, trainable) if offload_optimizer and not inference else 0
    return estimate_host(weights_bytes=weights, batch_bytes=batch_bytes, num_workers=num_workers,
                         prefetch_factor=prefetch_factor, pin_memory=pin_memory, offload_bytes=offload,
                         local_machine=True)  # fmt: skip


def _tracer(spec: ModelSpec, precision: Precision, optimizer: str, runtimes: list[CudaRuntime], inference: bool,
            loop: TrainingLoop, fits_of: Any = None, repeated: list[Any] | None = None) -> Any:  # fmt: skip
    """``trace(batch, checkpointing, accumulation)``, cached; above batch 1 with ``fits_of``, one trace plus
    that fit (of the loop without accumulation: ``at()`` is raised to cover what accumulation adds). ``repeated``
    (the model at two shallow depths) builds the whole model's log from theirs."""

    @functools.cache
    def trace(batch: int, checkpointing: bool, accumulation: int = 1) -> list[StepCurve]:
        return trace_for_runtimes(
            spec.model,
            spec.sample,
            # a symbolic trace answers every batch itself; the concrete path takes the fit from batch 1's
            batch_fits=[c.estimate for c in fits_of(checkpointing)]
            if fits_of is not None and batch > 1 and not symbolic_enabled()
            else None,
            runtimes=runtimes,
            batch_size=batch,
            precision=precision,
            optimizer=optimizer,
            gradient_checkpointing=checkpointing,
            loop=dataclasses.replace(loop, accumulation_steps=accumulation),
            target=Target("cuda"),
            inference=inference,
            repeated=repeated,
        )

    return trace


def _plan_one(name: str, gpu: GPU | None, trace: Any, request: PlanRequest, whole: Any,
              extrapolated: tuple[int, int] | None) -> GpuPlan:  # fmt: skip
    """Search on ``trace``, confirm and report on ``whole`` (the same unless ``extrapolated`` in depth).

    Every "fits" is confirmed on ``whole`` by the session. A "no" from an extrapolated search is decided
    again on ``whole`` alone when it is near the budget (``_near_the_budget``): an extrapolation a few
    percent high must not turn a run that fits into one that does not."""
    always = request.always_checkpoint
    session = PlanningSession(whole, batch_size=START_BATCH, search_at=trace)
    approximate = bool(gpu and gpu.approximate)
    base = session.search_at(START_BATCH, always, 1)
    try:
        decision = session.decide(request)
    except InsufficientMemoryError as error:
        if extrapolated is None:
            return GpuPlan(name, request.capacity_bytes, None, None, error=str(error), approximate=approximate,
                           base=base)  # fmt: skip
        if not _near_the_budget(session, request):
            low, high = extrapolated
            message = (
                f"{error} These figures are extrapolated in depth from traces at {low} and {high} blocks, more than "
                f"{EXTRAPOLATION_ERROR_BAND:.0%} over the budget (--exact traces the whole model)."
            )
            return GpuPlan(name, request.capacity_bytes, None, None, error=message, approximate=approximate, base=base)
        session = PlanningSession(whole, batch_size=START_BATCH)
        try:
            decision = session.decide(request)
        except InsufficientMemoryError as exact_error:
            return GpuPlan(name, request.capacity_bytes, None, None, error=str(exact_error), approximate=approximate,
                           base=session.search_at(START_BATCH, always, 1))  # fmt: skip
    return GpuPlan(name, request.capacity_bytes, decision.plan, decision.traced.estimate, approximate=approximate,
                   base=base)  # fmt: skip


def _near_the_budget(session: PlanningSession, request: PlanRequest) -> bool:
    """Whether the smallest extrapolated peak at micro batch 1 (with checkpointing where it is allowed) is
    within ``EXTRAPOLATION_ERROR_BAND`` of the budget, so that the whole model's trace may still fit."""
    budget = request.capacity_bytes * (1.0 - request.margin)
    options = {request.always_checkpoint, request.always_checkpoint or request.allow_checkpointing}
    smallest = min(session.search_at(START_BATCH, c, 1).at(1).device_bytes for c in options)
    return smallest <= budget * (1.0 + EXTRAPOLATION_ERROR_BAND)


class _progress:
    """A rich spinner on stderr while something slow runs (kept off stdout, where JSON goes)."""

    def __init__(self, enabled: bool, message: str) -> None:
        self._status = None
        if enabled:
            from rich.console import Console

            self._status = Console(stderr=True).status(message)

    def __enter__(self) -> None:
        if self._status is not None:
            self._status.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
