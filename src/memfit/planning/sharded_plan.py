"""``memfit plan --gpus N --strategy ...`` and ``--gpus auto``: one rank's plan, and the fewest GPUs that fit.

A plan for a given GPU count and strategy comes from ``memfit.estimate``'s own per-rank estimate
(``TrainingLoop(sharding=...)``), searched and confirmed as any ``memfit plan`` row is (``_plan_one``:
depth-extrapolated traces for the search of a deep model, the whole model's trace for the answer).

``--gpus auto`` first screens every candidate count and strategy with the per-rank estimate of that strategy at
one reference count, read at the others by the same model (``memfit.planning.sharded.rescaled``; a count whose rank
is not rewritten from the reference's traced step, FSDP on one GPU, by its own estimate), so looking at a
hundred counts costs no more traces than looking at one; the smallest count the screen passes is then planned, and
confirmed, by the per-rank estimate at that count, and the search moves on where that says no. The chosen count's
screen figure is that estimate's own, so the screen line, the table and the breakdown agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.categories import Category
from memfit.errors import InsufficientMemoryError, InvalidInputError, NoCountFitsError
from memfit.planning.capacity import parse_budget
from memfit.planning.deep_models import DeepModel
from memfit.planning.finetune import FinetuneSpec, apply_finetune
from memfit.planning.gpu_report import (
    EXTRAPOLATION_MIN_PARAMETERS,
    START_BATCH,
    GpuPlan,
    PlanReport,
    _card_precision,
    _default_precision,
    _in_precision,
    _plan_one,
    _progress,
    _tracer,
)
from memfit.planning.gpus import GPU, gpu_by_name
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.session import PlanningSession, PlanRequest
from memfit.precision import Precision
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate
from memfit.presets import ModelSpec, from_factory, from_hf_config
from memfit.simulation.allocator import AllocatorConfig
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.model_limits import check_sequence_length
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.tracer import ZeroGrad
from memfit.units import format_bytes

from .sharded import candidate_gpu_counts, describe, reads_reference, rescaled

__all__ = ["AUTO_STRATEGIES", "CountCheck", "Option", "ShardedReport", "plan_sharded"]

# what --gpus auto tries at each count, in order of preference among those that fit: the least
# communication first (DDP needs no more GPUs than one, so it only answers a run that fits on one)
AUTO_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "zero3")
# what --gpus auto weighs but does not choose unless --offload asks for it: offload moves the states over
# PCIe every step and needs host RAM, so it is a choice for the user (the answer says where it would fit)
AUTO_OFFLOADS = ("optimizer", "all")
# counts the screen passes but the per-rank estimate refuses before --gpus auto stops and says so: the screen
# passes a count on a lower bound (the tensors alone), so it may pass a few the estimate then refuses, each at the
# cost of that estimate
AUTO_MAX_REFUSED = 4


@dataclass(frozen=True)
class Option:
    """A strategy with its offload, as ``--strategy`` and ``--offload`` name them."""

    strategy: str
    offload: str = "none"  # none, optimizer, params, all

    @property
    def label(self) -> str:
        return self.strategy + ("" if self.offload == "none" else f"+offload-{self.offload}")

    def config(self, gpus: int, gpus_per_node: int, precision: Precision) -> ShardingConfig:
        """The run's settings; FSDP under a ``*-mixed`` precision gathers 16-bit parameters
        (``MixedPrecisionPolicy(param_dtype=...)``, as accelerate's and Lightning's FSDP mixed precision do)."""
        mixed = self.strategy.startswith("fsdp") and precision.is_mixed
        return ShardingConfig(
            self.strategy,  # type: ignore[arg-type]
            gpus,
            gpus_per_node=min(gpus, gpus_per_node),
            mixed_precision_param_dtype=str(precision.compute_dtype).removeprefix("torch.") if mixed else None,
            offload_optimizer=self.offload in ("optimizer", "all") or (self.strategy.startswith("fsdp")
                                                                       and self.offload != "none"),
            offload_params=self.offload in ("params", "all"),
        )  # fmt: skip


_PLANNED_KEYS = ("micro_batch_size", "gradient_checkpointing", "predicted_peak_bytes")


@dataclass(frozen=True)
class CountCheck:
    """What one GPU count said in the ``--gpus auto`` search: each option's smallest per-rank peak at the
    micro batch asked for (checkpointing on where it is allowed and needed), and whether it fits.

    A figure is the per-rank estimate's own (``estimated``: the option was planned at this count; what its plan at
    that micro batch says, the peak the run reaches on the card where it fits, else what it would need: the table's
    figure, from the same estimate) or the screen's (printed with ``~``): its reading of the strategy's estimate at
    its reference count (``memfit.planning.sharded.rescaled``), or the peak of the count's own estimate where its
    rank is not rewritten from the reference's step (``_RankPlanner.screen``)."""

    gpus: int
    nodes: int
    # (option, device bytes, checkpointing, fits, choosable, estimated)
    peaks: tuple[tuple[str, int, bool, bool, bool, bool], ...]
    confirmed: str | None = None  # the option the whole model's trace confirmed at this count
    rejected: tuple[str, ...] = ()  # options the whole model's trace did not confirm
    host: tuple[tuple[str, int], ...] = ()  # (option, host RAM a node) of each option that offloads
    planned: tuple[int, bool, int] | None = None  # the confirmed plan's (micro batch, checkpointing, peak): the table's

    def host_bytes(self, label: str) -> int:
        """Host RAM a node needs under the option ``label`` at this count (0: it offloads nothing)."""
        return dict(self.host).get(label, 0)

    def summary(self, budget_bytes: int) -> str:
        host = dict(self.host)
        parts = [f"{label} {'' if own else '~'}{format_bytes(peak)}{' (ckpt)' if ckpt else ''}{'' if fits else ' x'}"
                 + (f" (host {format_bytes(host[label])} a node)" if fits and host.get(label) else "")
                 for label, peak, ckpt, fits, _, own in self.peaks]  # fmt: skip
        verdict = f"fits with {self.confirmed}" if self.confirmed else "does not fit"
        if self.planned is not None and (self.planned[1], self.planned[2]) not in {
            (ckpt, peak) for label, peak, ckpt, *_ in self.peaks if label == self.confirmed
        }:  # the plan runs another micro batch than the one screened: say the table's figure beside
            micro, ckpt, peak = self.planned
            with_ckpt = " with ckpt" if ckpt else ""
            verdict += f" (planned at micro batch {micro}{with_ckpt}: {format_bytes(peak)}, the table's)"
        if self.rejected:
            verdict += f" ({', '.join(self.rejected)} not confirmed on the whole model)"
        nodes = f" ({self.nodes} nodes)" if self.nodes > 1 else ""
        return f"{self.gpus} GPU(s){nodes}: {verdict}; per-rank peak vs {format_bytes(budget_bytes)}: " + ", ".join(
            parts
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "nodes": self.nodes,
            "fits": self.confirmed is not None,
            "chosen": self.confirmed,
            "planned": None if self.planned is None else dict(zip(_PLANNED_KEYS, self.planned, strict=True)),
            "not_confirmed": list(self.rejected),
            "options": [
                {
                    "option": label,
                    "peak_bytes": peak,
                    "gradient_checkpointing": ckpt,
                    "fits": fits,
                    "choosable": chosen,
                    "estimated": own,
                    "host_bytes_per_node": self.host_bytes(label),
                }
                for label, peak, ckpt, fits, chosen, own in self.peaks
            ],
        }


@dataclass(frozen=True)
class ShardedReport:
    """One rank's plan under ``sharding`` (``None`` when nothing fits), with how it was found."""

    report: PlanReport  # one row: the rank's plan, in the tables ``memfit plan`` prints
    sharding: ShardingConfig | None
    option: Option | None
    trainable: int
    model_states_bytes: dict[str, int] = field(default_factory=dict)  # one rank's, on the device
    host_offload_per_rank_bytes: int = 0
    considered: tuple[CountCheck, ...] = ()
    budget_bytes: int = 0
    auto: bool = False

    @property
    def row(self) -> GpuPlan:
        return self.report.rows[0]

    @property
    def host_offload_per_node_bytes(self) -> int:
        if self.sharding is None:
            return 0
        return self.host_offload_per_rank_bytes * (self.sharding.gpus_per_node or self.sharding.world_size)

    def to_dict(self) -> dict[str, Any]:
        out = self.report.to_dict()
        config = self.sharding
        out["per_rank"] = True
        out["auto"] = self.auto
        out["sharding"] = None if config is None else {
            "strategy": config.strategy,
            "gpus": config.world_size,
            "nodes": config.nodes,
            "gpus_per_node": config.gpus_per_node or config.world_size,
            "shard_group_size": config.shard_group_size,
            "offload": self.option.offload if self.option else "none",
            "offload_optimizer": config.offload_optimizer,
            "offload_params": config.offload_params,
        }  # fmt: skip
        out["trainable_parameters"] = self.trainable
        out["model_states_per_rank_bytes"] = dict(self.model_states_bytes)
        out["host_offload_per_rank_bytes"] = self.host_offload_per_rank_bytes
        out["host_offload_per_node_bytes"] = self.host_offload_per_node_bytes
        out["budget_bytes"] = self.budget_bytes
        out["considered"] = [check.to_dict() for check in self.considered]
        return out


def plan_sharded(
    *,
    hf_config: str | None,
    model: str | None,
    gpu: str | None,
    budget: str | None,
    options: Sequence[Option],
    gpus: int | None,
    hints: Sequence[Option] = (),
    nodes: int | None = None,
    gpus_per_node: int = 8,
    max_gpus: int = 1024,
    micro_batch_size: int = 1,
    seq_len: int = 1024,
    image_size: int | None = None,
    layers: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    checkpointing: str = "auto",
    target_batch_size: int | str = "max",
    margin: float = DEFAULT_MARGIN,
    exact: bool = False,
    zero_grad: ZeroGrad = "after_step",
    show_progress: bool = False,
    finetune: FinetuneSpec | None = None,
) -> ShardedReport:
    """One rank's plan for ``gpus`` GPUs (``nodes`` nodes) under ``options[0]``, or with ``gpus`` ``None``
    the fewest GPUs (``candidate_gpu_counts``, ``gpus_per_node`` a node) at which one of ``options`` fits
    ``micro_batch_size`` per rank, preferring them in the order given at that count. ``hints`` are weighed
    at each count and shown, never chosen (offload, unless the user asked for it). ``finetune`` adds LoRA adapters
    (their frozen base is sharded and has no gradients or optimizer state); quantized weights are refused here.
    """
    finetune = finetune or FinetuneSpec()
    if finetune.quantize:
        raise InvalidInputError(
            f"--quantize {finetune.quantize} is not planned under --strategy/--gpus auto yet (bitsandbytes weights "
            "sharded by FSDP or ZeRO are not modelled); plan QLoRA on one GPU, or LoRA on a 16-bit base with --strategy"
        )
    if (gpu is None) == (budget is None):
        raise InvalidInputError("a per-rank plan is for one kind of GPU: give one --gpu (e.g. h100) or a --budget")
    card = gpu_by_name(gpu) if gpu else None
    capacity = card.memory_bytes if card else parse_budget(budget or "")
    default = _default_precision(precision, False)
    row_precision = _card_precision(card, precision, default, False)
    if not isinstance(row_precision, Precision):
        raise InvalidInputError(row_precision)
    with _progress(show_progress, "building the model on the meta device"):
        spec = apply_finetune(_spec(hf_config, model, seq_len, image_size, layers), finetune, default, inference=False)
    parameters = sum(p.numel() for p in spec.model.parameters())
    trainable = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)

    def build_at(depth: int) -> ModelSpec:
        with _progress(show_progress, f"building {spec.name} at {depth} blocks"):
            shallow = _spec(hf_config, None, seq_len, image_size, depth)
            return apply_finetune(shallow, finetune, default, inference=False)

    whole_only = not hf_config or exact or layers is not None
    deep = DeepModel.of(spec, None if whole_only else build_at, large=parameters >= EXTRAPOLATION_MIN_PARAMETERS)
    planner = _RankPlanner(
        spec=spec, parameters=parameters, trainable=trainable, deep=deep, card=card,
        runtime=card.runtime if card else CudaRuntime(), capacity=capacity,
        name=card.name if card else f"budget {budget}", default=default, precision=row_precision,
        optimizer=optimizer, zero_grad=zero_grad, allow=checkpointing, margin=margin,
        target_batch_size=target_batch_size, micro_batch_size=micro_batch_size,
        gpus_per_node=gpus_per_node, seq_len=seq_len, show_progress=show_progress, auto=gpus is None,
    )  # fmt: skip
    if gpus is not None:
        option = options[0]
        per_node = gpus // nodes if nodes else min(gpus, gpus_per_node)
        row, config = planner.planned(option, gpus, per_node)
        return planner.finish(row, config, option, ())
    return planner.fewest_gpus(options, hints, max_gpus)


@dataclass
class _RankPlanner:
    """What every count and option of one per-rank plan shares: the model, the card, the question asked, and
    the traces already made (one per layout: a count's search and its confirmation trace each layout once)."""

    spec: ModelSpec
    parameters: int
    trainable: int
    deep: DeepModel
    card: GPU | None
    runtime: CudaRuntime
    capacity: int
    name: str
    default: Precision
    precision: Precision
    optimizer: str
    zero_grad: ZeroGrad
    allow: str  # checkpointing: auto, on or off
    margin: float
    target_batch_size: int | str
    micro_batch_size: int
    gpus_per_node: int
    seq_len: int
    show_progress: bool
    auto: bool
    _traced: dict[bool | ShardingConfig, tuple[Any, Any]] = field(default_factory=dict, init=False, repr=False)

    @property
    def budget_bytes(self) -> int:
        return int(self.capacity * (1 - self.margin))

    def traces(self, kind: bool | ShardingConfig) -> tuple[Any, Any]:
        """``(search, whole)`` traces of the step: one rank's under a ``ShardingConfig``, else in DDP's loop
        (``True``) or a plain one (``False``, the screen every count reads)."""
        if kind not in self._traced:
            if isinstance(kind, ShardingConfig):
                loop = TrainingLoop(zero_grad=self.zero_grad, sharding=kind)
            else:
                loop = TrainingLoop(zero_grad=self.zero_grad, ddp=DDPConfig() if kind else None)

            def tracer(model_spec: ModelSpec, **keywords: Any) -> Any:
                return _tracer(model_spec, self.precision, self.optimizer, [self.runtime], False, loop, **keywords)

            self._traced[kind] = self.deep.tracers(tracer, self.allow == "on")
        return self._traced[kind]

    def screen(self, option: Option, config: ShardingConfig) -> Callable[[int, bool, int], StepCurve]:
        """The rank's search estimate under ``config``: read off the strategy's per-rank estimate at its reference
        count (``rescaled``), or its own where its rank is not rewritten from the reference's traced step (one
        GPU's DDP, FSDP's NO_SHARD on one GPU: the plain step, replayed; ``reads_reference``)."""
        reference = Option(option.strategy).config(*_reference_count(option, self.gpus_per_node), self.precision)
        if (config.world_size == 1 and option.strategy == "ddp") or not reads_reference(reference, config):
            return self.ranked(config)[0]
        search = self.ranked(reference)[0]
        return lambda b, c, a: rescaled(search(b, c, a), config)

    def ranked(self, config: ShardingConfig) -> tuple[Any, Any]:
        """``(search, whole)`` of one rank under ``config``, from ``memfit.estimate``'s per-rank estimate."""
        search, whole = self.traces(config if config.world_size > 1 or config.strategy != "ddp" else False)
        return (lambda b, c, a: search(b, c, a)[0]), (lambda b, c, a: whole(b, c, a)[0])

    def request(self, count: int) -> PlanRequest:
        return PlanRequest(capacity_bytes=self.capacity, margin=self.margin, target_batch_size=self.target_batch_size,
                           world_size=count, min_batch_size=self.micro_batch_size,
                           allow_checkpointing=self.allow == "auto", always_checkpoint=self.allow == "on")  # fmt: skip

    def planned(
        self, option: Option, count: int, per_node: int, candidate: bool = False
    ) -> tuple[GpuPlan, ShardingConfig]:
        """One rank's plan; a ``candidate`` of the ``--gpus auto`` search takes a "no" from the search's
        (depth-extrapolated) estimate as final instead of deciding it again on whole-model traces."""
        config = option.config(count, per_node, self.precision)
        search, whole = self.ranked(config)
        label = f"{self.name} x{count} {option.label} (per rank)"
        with _progress(self.show_progress, f"planning {describe(config)}"):
            if candidate:
                session = PlanningSession(whole, batch_size=START_BATCH, search_at=search)
                try:
                    decision = session.decide(self.request(count))
                    row = GpuPlan(label, self.capacity, decision.plan, decision.traced.estimate,
                                  base=session.search_at(START_BATCH, self.allow == "on", 1))  # fmt: skip
                except InsufficientMemoryError as error:
                    row = GpuPlan(label, self.capacity, None, None, error=str(error))
            else:
                row = _plan_one(label, self.card, search, self.request(count), whole, self.deep.extrapolated)
        return _in_precision(row, self.precision, self.default, self.card), config

    def finish(self, row: GpuPlan, config: ShardingConfig | None, option: Option | None,
               considered: tuple[CountCheck, ...]) -> ShardedReport:  # fmt: skip
        """The report of the plan found: the rank's model states from its estimate (or, without a plan on
        several ranks, the whole model's), and the host RAM its offload takes."""
        report = PlanReport(self.spec.name, self.parameters, self.default.value, self.optimizer, self.seq_len, (row,),
                            depth_extrapolated_from=self.deep.extrapolated,
                            depth_built_from=self.deep.built, depth_not_built=self.deep.not_built)  # fmt: skip
        states: dict[str, int] = {}
        host = 0
        estimate = row.estimate  # a whole-model trace (a depth-extrapolated one carries its shallow terms)
        if config is not None and estimate is not None and estimate.rank_terms:
            states = dict(estimate.rank_terms)
            host = (estimate.host_bytes_per_node or 0) // (config.gpus_per_node or config.world_size)
        elif config is not None:  # one GPU, or no plan: the rank's terms where sharded, else the states it holds
            rank = self.ranked(config)[0](self.micro_batch_size, False, 1)
            states = dict(rank.estimate.rank_terms) if rank.estimate.rank_terms else _held_states(rank.estimate)
        return ShardedReport(report, config, option, self.trainable, states, host, considered, self.budget_bytes,
                             auto=self.auto)  # fmt: skip

    def fewest_gpus(self, options: Sequence[Option], hints: Sequence[Option], max_gpus: int) -> ShardedReport:
        """``--gpus auto``: the counts in order, each screened, then planned with the options the screen passes
        until one fits; past ``AUTO_MAX_REFUSED`` counts the estimate refused, or past ``max_gpus``, why not."""
        considered: list[CountCheck] = []
        refused = 0  # counts the screen passed and the per-rank estimate did not
        allocator = AllocatorConfig.from_environment()
        micro, allow, budget_bytes = self.micro_batch_size, self.allow, self.budget_bytes
        for count in candidate_gpu_counts(self.gpus_per_node, max_gpus):
            per_node = min(count, self.gpus_per_node)
            screened, host = self._screened(count, per_node, (*options, *hints))
            peaks = {option: (figure, ckpt, figure <= budget_bytes, False) for option, figure, ckpt, _ in screened}
            rejected: list[str] = []
            for option in [o for o, _, _, could in screened if could and o in options]:  # in order of preference
                row, config = self.planned(option, count, per_node, candidate=True)
                own = _needed(self.ranked(config)[0], micro, allow, budget_bytes, self.capacity, allocator)
                peaks[option] = (*own, True)  # what the plan itself says at ``micro``
                if row.plan is not None:
                    plan = row.plan
                    planned = (plan.micro_batch_size, plan.gradient_checkpointing, plan.predicted_peak_bytes)
                    check = CountCheck(count, config.nodes, _said(peaks, options), option.label, tuple(rejected), host,
                                       planned)  # fmt: skip
                    return self.finish(row, config, option, (*considered, check))
                rejected.append(option.label)
            considered.append(CountCheck(count, max(1, count // per_node), _said(peaks, options), None,
                                         tuple(rejected), host))  # fmt: skip
            refused += bool(rejected)
            if refused >= AUTO_MAX_REFUSED:
                raise NoCountFitsError(
                    f"the screen's lower bound says {self.spec.name} may fit {micro} sample(s) per rank from "
                    f"{considered[-AUTO_MAX_REFUSED].gpus} x {self.name}, but the per-rank estimate refuses it at "
                    f"{' and '.join(str(c.gpus) for c in considered if c.rejected)} GPUs; plan a count with --gpus N "
                    "--strategy S to see its figures. Per count: "
                    + " | ".join(check.summary(budget_bytes) for check in considered[-3:]),
                    tuple(check.to_dict() for check in considered),
                    budget_bytes,
                    tuple(check.summary(budget_bytes) for check in considered),
                )
        tried = ", ".join(o.label for o in options)
        untried = ["--offload all"] if all(o.offload != "all" for o in options) else []
        untried += [*(["checkpointing"] if allow == "off" else []), "a shorter --seq-len", "a larger --max-gpus"]
        raise NoCountFitsError(
            f"{self.spec.name} does not fit {micro} sample(s) per rank on up to {max_gpus} x {self.name} with any of "
            f"{tried}; try {', '.join(untried[:-1])} or {untried[-1]}. Per count: "
            + " | ".join(check.summary(budget_bytes) for check in considered[-3:]),
            tuple(check.to_dict() for check in considered),
            budget_bytes,
            tuple(check.summary(budget_bytes) for check in considered),
        )

    def _screened(
        self, count: int, per_node: int, weighed: Sequence[Option]
    ) -> tuple[list[tuple[Option, int, bool, bool]], tuple[tuple[str, int], ...]]:
        """The screen at ``count``: ``(option, figure, checkpointing, could fit)`` of each option that can run
        there, and the host RAM a node needs under each of them that offloads."""
        screened = []
        for option in weighed:
            if option.strategy == "ddp" and count > 1:
                continue  # DDP holds on each rank what one GPU holds, and its buckets besides
            if option.strategy == "fsdp-hybrid" and count <= self.gpus_per_node:
                continue  # within one node hybrid sharding is fsdp
            if option.strategy.startswith("fsdp") and option.offload != "none" and count == 1:
                continue  # one GPU's FSDP is NO_SHARD, whose CPU offload is not modelled (zero3 offloads there)
            config = option.config(count, per_node, self.precision)
            screened.append((option, *_screened(self.screen(option, config), self.micro_batch_size, self.allow,
                                                self.budget_bytes)))  # fmt: skip
        host = tuple((option.label, self.screen(option, option.config(count, per_node, self.precision))(
            self.micro_batch_size, False, 1).estimate.host_bytes_per_node or 0) for option, *_ in screened
            if option.offload != "none")  # fmt: skip
        return screened, host


def _reference_count(option: Option, gpus_per_node: int) -> tuple[int, int]:
    """``(gpus, gpus per node)`` a strategy's per-rank estimate is made at for the screen: two GPUs (two nodes'
    worth for hybrid sharding, which shards within a node and replicates across nodes)."""
    if option.strategy == "fsdp-hybrid":
        return 2 * gpus_per_node, gpus_per_node
    return 2, min(2, gpus_per_node)


def _held_states(estimate: MemoryEstimate) -> dict[str, int]:
    """The model states a rank holding everything holds: each category at its largest over the step."""
    states = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)
    return {c.value: max((p.breakdown.get(c, 0) for p in estimate.phases), default=0) for c in states}


def _said(
    peaks: Mapping[Option, tuple[int, bool, bool, bool]], options: Sequence[Option]
) -> tuple[tuple[str, int, bool, bool, bool, bool], ...]:
    return tuple((option.label, peak, ckpt, fits, option in options, own)
                 for option, (peak, ckpt, fits, own) in peaks.items())  # fmt: skip


def _checkpointing(allow: str) -> tuple[bool, ...]:
    return {"off": (False,), "on": (True,), "auto": (False, True)}[allow]


def _screened(
    search: Callable[[int, bool, int], StepCurve], micro: int, allow: str, budget_bytes: int
) -> tuple[int, bool, bool]:
    """The screen at ``micro``: its per-rank device peak, with checkpointing where allowed and needed, and whether
    the step could fit. It could where its tensors alone (the phase fits, no allocator overhead) and the CUDA
    context are within ``budget_bytes``: a bound the per-rank estimate cannot go below, so the search never
    passes over a count that fits."""
    answers = []
    for ckpt in _checkpointing(allow):
        screen = search(micro, ckpt, 1)
        value = screen.estimate
        tensors = max(model.at(micro) for model in value.phase_models) + (value.cuda_context_bytes or 0)
        answers.append((screen.at(micro).device_bytes, ckpt, tensors <= budget_bytes))
        if answers[-1][2]:
            break
    return min(answers, key=lambda answer: (not answer[2], answer[0]))


def _needed(
    search: Callable[[int, bool, int], StepCurve],
    micro: int,
    allow: str,
    budget_bytes: int,
    capacity_bytes: int,
    allocator: AllocatorConfig,
) -> tuple[int, bool, bool]:
    """What a plan of the per-rank estimate at ``micro`` says, with checkpointing where allowed and needed:
    ``(figure, checkpointing, fits)``. It fits where what the step needs at the allocator's limit (where the log
    can be replayed) is within the budget, and the figure is then the peak the run reaches on ``capacity_bytes``,
    the table's predicted peak at that micro batch; otherwise what it would need, as the plan's refusal says."""
    answers = []
    for ckpt in _checkpointing(allow):
        curve = search(micro, ckpt, 1)
        least = curve.least_device_bytes(micro, allocator=allocator)
        answers.append((least if least is not None else curve.at(micro).device_bytes, ckpt, curve))
        if answers[-1][0] <= budget_bytes:
            break
    needed, ckpt, curve = min(answers, key=lambda answer: answer[:2])
    if needed > budget_bytes:
        return needed, ckpt, False
    on_card = curve.at_limit(micro, capacity_bytes, allocator=allocator)
    context = curve.estimate.cuda_context_bytes or 0
    return needed if on_card is None else on_card.peak_reserved_bytes + context, ckpt, True


def _spec(hf_config: str | None, model: str | None, seq_len: int, image_size: int | None,
          layers: int | None) -> ModelSpec:  # fmt: skip
    spec = (
        from_hf_config(hf_config, seq_len=seq_len, image_size=image_size, layers=layers)
        if hf_config
        else from_factory(model or "", seq_len=seq_len)
    )
    check_sequence_length(spec.model, seq_len, fix="use --seq-len {positions} or less")
    return spec
