"""Rendering of estimates for people: rich tables, kept apart from the data classes they show."""

from __future__ import annotations

from rich.table import Table

from memfit.categories import Category, Phase
from memfit.planning.gpu_report import GpuPlan, PlanReport
from memfit.planning.planner import Plan
from memfit.prediction.estimator import MemoryEstimate
from memfit.prediction.formula import FormulaEstimate
from memfit.units import format_bytes

__all__ = ["estimate_table", "finetune_table", "formula_table", "phases_table", "plan_table"]

_LABELS: dict[str, str] = {
    "quantized_weights_bytes": "Quantized weights",
    "parameters_bytes": "Parameters",
    "gradients_bytes": "Gradients",
    "master_weights_bytes": "Master weights",
    "optimizer_state_bytes": "Optimizer state",
    "activations_bytes": "Activations",
}


def _label(key: str) -> str:
    """Human name of a ``*_bytes`` component key; unknown keys get a readable fallback."""
    return _LABELS.get(key) or key.removesuffix("_bytes").replace("_", " ").capitalize()


def _share(part_bytes: int, total_bytes: int) -> str:
    """``part_bytes`` as a percentage of ``total_bytes``; a zero total has no meaningful share."""
    if total_bytes <= 0:
        return "-"
    return f"{100.0 * part_bytes / total_bytes:.1f}%"


def _sizes_table(title: str, components: dict[str, int], total_bytes: int, caption: str | None = None) -> Table:
    """One row per component plus a Total row: the shape every estimate table shares."""
    # Wide enough that the title's lines are not wrapped to the (narrow) width of the columns.
    table = Table(title=title, caption=caption, min_width=max(len(line) for line in title.splitlines()))
    table.add_column("Component")
    table.add_column("Size", justify="right")
    table.add_column("Share", justify="right")
    for key, num_bytes in components.items():
        table.add_row(_label(key), format_bytes(num_bytes), _share(num_bytes, total_bytes))
    table.add_section()
    table.add_row("Total", format_bytes(total_bytes), _share(total_bytes, total_bytes), style="bold")
    return table


def formula_table(estimate: FormulaEstimate) -> Table:
    """A table of a formula-tier estimate: each component's size and share of the total."""
    title = (
        f"Formula estimate: {estimate.parameters:,} parameters, "
        f"{estimate.precision.short_name}, optimizer {estimate.optimizer}\n"
        f"batch {estimate.batch_size} x {estimate.activations_per_sample:,} activations per sample"
    )
    if estimate.trainable_count is not None:
        title += f", {estimate.trainable_count:,} trainable (adapters)"
    elif estimate.trainable_fraction != 1.0:
        title += f", {100 * estimate.trainable_fraction:g}% of parameters trainable"
    if estimate.quantize:
        title += f", frozen weights in {estimate.quantize}"
    caption = "Excludes temporaries, allocator overhead and the CUDA context."
    return _sizes_table(title, estimate.components(), estimate.total_bytes, caption)


# The plan table's columns for the state a step carries, each at the predicted peak: gradients get their
# own column (with DDP's buckets, copies of them) so that a peak before backward, where they are freed,
# reads as "0 B of gradients at the peak", not as gradients left uncounted.
_STATE_COLUMNS: dict[str, tuple[Category, ...]] = {
    "params": (Category.PARAMETERS,),
    "grads": (Category.GRADIENTS, Category.GRADIENT_BUCKETS),
    "optim state": (Category.OPTIMIZER_STATE,),
}
_CATEGORY_LABELS: dict[Category, str] = {
    Category.PARAMETERS: "Parameters",
    Category.BUFFERS: "Buffers",
    Category.GRADIENTS: "Gradients",
    Category.GRADIENT_BUCKETS: "DDP gradient buckets",
    Category.SHARDING_BUFFERS: "FSDP/ZeRO buffers",
    Category.OPTIMIZER_STATE: "Optimizer state",
    Category.INPUTS: "Inputs (batch)",
    Category.ACTIVATIONS: "Activations",
    Category.TEMPORARIES: "Temporaries",
    Category.WORKSPACE: "cuBLAS workspace",
}


def estimate_table(estimate: MemoryEstimate) -> Table:
    """The peak of a traced step: tensors by category, then what the runtime adds on a GPU."""
    step, what = (
        ("forward pass", "inference") if estimate.inference else ("training step", f"optimizer {estimate.optimizer}")
    )
    title = (
        f"Peak of one {step}: batch {estimate.batch_size}, {estimate.precision.short_name}, "
        f"{what}{', checkpointing' if estimate.gradient_checkpointing else ''}\n"
        f"target {estimate.device}, peak in step {estimate.peak_step} {estimate.peak_phase.value}"
    )
    table = Table(title=title, min_width=max(len(line) for line in title.splitlines()))
    table.add_column("Component")
    table.add_column("Size", justify="right")
    table.add_column("Share", justify="right")
    total = estimate.peak_bytes
    for category, label in _CATEGORY_LABELS.items():
        size = estimate.breakdown.get(category, 0)
        if size:
            table.add_row(label, format_bytes(size), _share(size, total))
    table.add_section()
    table.add_row(
        "Allocated (tensors)",
        format_bytes(estimate.peak_allocated_bytes),
        _share(estimate.peak_allocated_bytes, total),
    )
    if estimate.device == "cuda":
        overhead = estimate.allocator_overhead_bytes
        table.add_row("Allocator rounding + fragmentation", format_bytes(overhead), _share(overhead, total))
        table.add_row(
            "Reserved (caching allocator)",
            format_bytes(estimate.peak_reserved_bytes),
            _share(estimate.peak_reserved_bytes, total),
        )
        context = estimate.cuda_context_bytes or 0
        table.add_row("CUDA context", format_bytes(context), _share(context, total))
    table.add_section()
    table.add_row("Peak device memory", format_bytes(total), _share(total, total), style="bold")
    return table


def phases_table(estimate: MemoryEstimate) -> Table:
    """Peak of each phase of the two traced steps, and how it grows per sample."""
    table = Table(title="Peaks by phase (step 1 creates the optimizer state; step 2 repeats from then on)")
    table.add_column("Step", justify="right")
    table.add_column("Phase")
    table.add_column("Allocated", justify="right")
    table.add_column("Reserved", justify="right")
    table.add_column("Per sample", justify="right")
    models = {(m.step, m.phase): m for m in estimate.phase_models}
    for peak in estimate.phases:
        model = models.get((peak.step, peak.phase))
        per_sample = format_bytes(round(model.per_sample_bytes)) if model else "-"
        table.add_row(
            str(peak.step),
            peak.phase.value,
            format_bytes(peak.allocated_bytes),
            format_bytes(peak.reserved_bytes),
            per_sample,
        )
    return table


def plan_table(report: PlanReport) -> Table:
    """One row per GPU: does it fit, with what micro batch, accumulation and checkpointing, at what peak.

    The sizes are those at the predicted peak. The caption says where the effective batch differs
    from the target, where gradients are freed at the peak, and why a GPU does not fit.
    """
    what = "inference (forward only)" if report.inference else f"optimizer {report.optimizer}"
    sweep = any(row.seq_len is not None for row in report.rows)
    seq = f", seq {report.seq_len}" if report.seq_len and not sweep else ""
    title = f"{report.model}: {_count(report.parameters)} parameters, {report.precision}, {what}{seq}"
    table = Table(title=title)
    # A forward-only pass has no accumulation, checkpointing, gradients or optimizer state to show.
    skipped = {"accum.", "ckpt", "effective", "grads", "optim state"} if report.inference else set()
    columns = [c for c in ("GPU", "seq", "memory", "fits", "micro batch", "accum.", "ckpt", "effective",
                           "predicted peak", *_STATE_COLUMNS, "activations", "other", "peak in")
               if c not in skipped and (c != "seq" or sweep)]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("GPU", "fits", "peak in") else "right")
    notes: list[str] = []
    for row in report.rows:
        name = row.gpu + (" (approx.)" if row.approximate else "")
        length = [str(row.seq_len or report.seq_len)] if sweep else []
        if row.plan is None or row.estimate is None:
            table.add_row(name, *length, format_bytes(row.capacity_bytes), "[red]no[/red]",
                          *["-"] * (len(columns) - 4 - len(length)), "")  # fmt: skip
            continue
        plan, breakdown = row.plan, row.estimate.breakdown
        state = {column: sum(breakdown.get(c, 0) for c in kinds) for column, kinds in _STATE_COLUMNS.items()}
        activations = breakdown.get(Category.ACTIVATIONS, 0)
        # the rest of the peak the row quotes (at the allocator's limit, where planned so), so the row adds up
        other = max(0, plan.predicted_peak_bytes - sum(state.values()) - activations)
        effective = str(plan.effective_batch_size)
        if plan.target_batch_size is not None and plan.effective_batch_size != plan.target_batch_size:
            effective += f" (target {plan.target_batch_size})"
            why = next((r for r in plan.reasons if "differs from the target" in r), None)
            notes.append(f"{_row_label(row, report, sweep)}: " + (why or (
                f"effective batch {plan.effective_batch_size} = {plan.micro_batch_size} x "
                f"{plan.accumulate_grad_batches} steps x {plan.world_size} device(s), not the target "
                f"{plan.target_batch_size}"
            )))  # fmt: skip
        if not report.inference and not state["grads"] and row.estimate.peak_phase is Phase.FORWARD:
            notes.append(
                f"{_row_label(row, report, sweep)}: gradients are 0 B at the peak ({row.estimate.peak_phase.value} of "
                f"step {row.estimate.peak_step}): they are freed after each optimizer step and counted where they live"
            )
        cells = {
            "GPU": name,
            "seq": length[0] if length else "",
            "memory": format_bytes(row.capacity_bytes),
            "fits": "[green]yes[/green]",
            "micro batch": str(plan.micro_batch_size),
            "accum.": str(plan.accumulate_grad_batches),
            "ckpt": "on" if plan.gradient_checkpointing else "off",
            "effective": effective,
            "predicted peak": format_bytes(plan.predicted_peak_bytes),
            **{column: format_bytes(size) for column, size in state.items()},
            "activations": format_bytes(activations),
            "other": format_bytes(other),
            "peak in": f"step {row.estimate.peak_step} {row.estimate.peak_phase.value}",
        }
        table.add_row(*(cells[column] for column in columns))
    notes.extend(f"{row.gpu}: {row.note}" for row in report.rows if row.note)  # the card's, at every length
    notes.extend(f"{_row_label(row, report, sweep)}: {row.error}" for row in report.rows if row.error)
    notes.extend(f"{_row_label(row, report, sweep)}: {_at_the_limit(row.plan)}" for row in report.rows
                 if row.plan is not None and _at_the_limit(row.plan))  # fmt: skip
    if notes:
        table.caption = "\n".join(dict.fromkeys(notes))  # one GPU's note once, however many lengths it is planned at
    return table


def _row_label(row: GpuPlan, report: PlanReport, sweep: bool) -> str:
    """Which row a note is about: the GPU, and in a sweep of sequence lengths the row's length."""
    return f"{row.gpu} at seq {row.seq_len or report.seq_len}" if sweep else row.gpu


_FINETUNE_LABELS = {
    "quantized_weights_bytes": "Quantized weights (packed + quantization state)",
    "frozen_weights_bytes": "Other frozen weights (embeddings, norms, head)",
    "adapter_weights_bytes": "Adapters (trainable)",
    "adapter_gradients_bytes": "Adapter gradients (largest in the step)",
    "optimizer_state_bytes": "Optimizer state (adapters)",
}


def finetune_table(report: PlanReport) -> Table:
    """The fine-tuning breakdown: the model's weights by role, then what the adapters add in training."""
    finetune = report.finetune
    if finetune is None:
        raise ValueError("the report has no fine-tuning lines")
    share = 100.0 * finetune.trainable_parameters / max(finetune.parameters, 1)
    title = (
        f"{finetune.label}: {_count(finetune.parameters)} parameters, none trained (inference)"
        if report.inference
        else f"{finetune.label}: {_count(finetune.trainable_parameters)} of {_count(finetune.parameters)} "
        f"parameters trainable ({share:.2f}%)"
    )
    table = Table(title=title, min_width=len(title))
    table.add_column("Component")
    table.add_column("Size", justify="right")
    for key, size in finetune.components().items():
        if report.inference and key in ("adapter_gradients_bytes", "optimizer_state_bytes"):
            continue
        if key == "quantized_weights_bytes" and not size:
            continue
        if key == "frozen_weights_bytes" and not finetune.quantized_weights_bytes:  # LoRA on an unquantized base
            table.add_row("Frozen weights (the base model)", format_bytes(size or 0))
            continue
        if key == "adapter_weights_bytes" and report.inference:
            if size:
                table.add_row("Adapters", format_bytes(size))
            continue
        table.add_row(_FINETUNE_LABELS[key], "-" if size is None else format_bytes(size))
    if finetune.notes:
        table.caption = "\n".join(finetune.notes)
    return table


def _count(parameters: int) -> str:
    """A parameter count as people say it, to three digits: ``77.3K``, ``124M``, ``8.03B``."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{suffix}"
    return str(parameters)


def _at_the_limit(plan: Plan) -> str:
    """What the plan's reasons say of the allocator at its limit (retries, expandable segments, options planned as
    torch's defaults), in one line."""
    keys = ("at the allocator's limit", "retries", "expandable_segments", "allocator options not modelled")
    return "; ".join(reason for reason in plan.reasons if any(key in reason for key in keys))
