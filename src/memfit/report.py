"""Rendering of estimates for people: rich tables, kept apart from the data classes they show."""

from __future__ import annotations

from rich.table import Table

from memfit.formula import FormulaEstimate
from memfit.units import format_bytes

__all__ = ["formula_table"]

_LABELS: dict[str, str] = {
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


def _sizes_table(
    title: str, components: dict[str, int], total_bytes: int, caption: str | None = None
) -> Table:
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
    if estimate.trainable_fraction != 1.0:
        title += f", {estimate.trainable_fraction:g} of parameters trainable"
    caption = "Excludes temporaries, allocator overhead and the CUDA context."
    return _sizes_table(title, estimate.components(), estimate.total_bytes, caption)
