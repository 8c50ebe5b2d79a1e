"""Pictures of an estimate: the traced step's memory over time, the peak against batch size, drift.

Needs matplotlib (``pip install 'memfit[plot]'``). Figures are built on matplotlib's object API
with the Agg canvas, so nothing touches pyplot's global state or needs a display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.prediction.curve import StepCurve
from memfit.prediction.estimator import MemoryEstimate
from memfit.units import GiB

__all__ = ["plot_batch_curve", "plot_drift", "plot_plan", "plot_seq_curve", "plot_timeline"]

_COLORS = {
    Category.PARAMETERS: "#4c72b0",
    Category.BUFFERS: "#8172b2",
    Category.GRADIENTS: "#dd8452",
    Category.GRADIENT_BUCKETS: "#ccb974",
    Category.SHARDING_BUFFERS: "#64b5cd",
    Category.OPTIMIZER_STATE: "#c44e52",
    Category.INPUTS: "#937860",
    Category.ACTIVATIONS: "#55a868",
    Category.TEMPORARIES: "#da8bc3",
    Category.WORKSPACE: "#8c8c8c",
}
_UNIT = GiB


def _figure(rows: int = 1, width: float = 10.0, height: float = 4.5) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise InvalidInputError("plots need matplotlib: pip install 'memfit[plot]'") from error
    figure = Figure(figsize=(width, height * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, squeeze=False)[:, 0]
    return figure, axes


def _save(figure: Any, path: str | Path | None) -> Any:
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def plot_timeline(
    estimate: MemoryEstimate | StepCurve,
    *,
    capacity_bytes: int | None = None,
    path: str | Path | None = None,
    ax: Any = None,
) -> Any:
    """Memory of the traced steps over time, stacked by category, with the peak and the capacity marked."""
    if isinstance(estimate, StepCurve):
        estimate = estimate.estimate
    if not estimate.timeline:
        raise InvalidInputError("this estimate carries no timeline (it was built by hand, not traced)")
    figure, axes = (ax.figure, [ax]) if ax is not None else _figure()
    axis = axes[0]
    points = estimate.timeline
    x = [p.event_index - points[0].event_index for p in points]  # events, not samples: phases keep their length
    order = list(Category)
    stacks = [[p.category_bytes[i] / _UNIT for p in points] for i in range(len(order))]
    axis.stackplot(x, stacks, labels=[c.value.replace("_", " ") for c in order],
                   colors=[_COLORS[c] for c in order], linewidth=0)  # fmt: skip
    if estimate.device == "cuda":
        axis.plot(x, [p.reserved_bytes / _UNIT for p in points], color="black", linewidth=1, label="reserved")
    peak_index = max(range(len(points)), key=lambda i: sum(points[i].category_bytes))
    peak = sum(points[peak_index].category_bytes) / _UNIT
    axis.annotate(f"allocated peak {peak:.2f} GiB\n(step {points[peak_index].step} {points[peak_index].phase.value})",
                  xy=(x[peak_index], peak), xytext=(0.02, 0.93), textcoords="axes fraction",
                  arrowprops={"arrowstyle": "->", "color": "black"}, fontsize=9, va="top")  # fmt: skip
    if capacity_bytes:
        axis.axhline(capacity_bytes / _UNIT, color="red", linestyle="--", linewidth=1.2, label="capacity")
    _shade_phases(axis, points, x)
    extrapolated = next((note for note in estimate.notes if note.startswith("extrapolated in depth")), None)
    axis.set_xlabel(f"traced events (two training steps; {extrapolated})" if extrapolated else
                    "traced events (two training steps)")  # fmt: skip
    axis.set_ylabel("GiB")
    axis.set_title(
        f"memory of two traced training steps, batch {estimate.batch_size}, {estimate.precision.short_name}", pad=14
    )
    axis.legend(loc="upper right", fontsize=8, ncol=2)
    axis.set_xlim(0, max(1, x[-1]))
    return _save(figure, path)


def _shade_phases(axis: Any, points: Sequence[Any], x: Sequence[int]) -> None:
    start = 0
    for i in range(1, len(points) + 1):
        if i == len(points) or (points[i].step, points[i].phase) != (points[start].step, points[start].phase):
            if points[start].phase is Phase.BACKWARD:
                axis.axvspan(x[start], x[i - 1], color="#000000", alpha=0.04, linewidth=0)
            axis.text((x[start] + x[i - 1]) / 2, 1.005, f"{points[start].phase.value} {points[start].step}",
                      transform=axis.get_xaxis_transform(), ha="center", va="bottom", fontsize=7,
                      color="#444444")  # fmt: skip
            start = i


def plot_batch_curve(
    curve: StepCurve,
    *,
    capacities: Mapping[str, int] | None = None,
    chosen: Mapping[str, int] | None = None,
    max_batch: int | None = None,
    path: str | Path | None = None,
    ax: Any = None,
) -> Any:
    """Predicted peak (device memory) of the traced step against batch size, with each GPU's capacity and chosen
    batch."""
    _check_curve(curve, "plot_batch_curve")
    figure, axes = (ax.figure, [ax]) if ax is not None else _figure()
    axis = axes[0]
    capacities = dict(capacities or {})
    chosen = dict(chosen or {})
    limit = max_batch or max([*chosen.values(), curve.estimate.batch_size, 8]) * 2
    for capacity in capacities.values():
        fit = curve.max_batch_size(capacity)
        if fit:
            limit = max(limit, min(int(fit * 1.25), 4096))
    batches = sorted({max(1, round(limit * i / 60)) for i in range(61)})
    axis.plot(batches, [curve.at(b).device_bytes / _UNIT for b in batches], color="#4c72b0", label="predicted peak")
    for index, (name, capacity) in enumerate(capacities.items()):
        color = f"C{index + 1}"
        axis.axhline(capacity / _UNIT, color=color, linestyle="--", linewidth=1, label=f"{name} capacity")
        if name in chosen:
            micro = chosen[name]
            axis.plot([micro], [curve.at(micro).device_bytes / _UNIT], "o", color=color)
            axis.annotate(f"{name}: {micro}", (micro, curve.at(micro).device_bytes / _UNIT),
                          textcoords="offset points", xytext=(5, -12), fontsize=8, color=color)  # fmt: skip
    axis.set_xlabel("micro batch size")
    axis.set_ylabel("GiB")
    axis.set_title("predicted peak vs batch size")
    axis.legend(fontsize=8)
    axis.set_xlim(0, limit)
    axis.set_ylim(bottom=0)
    return _save(figure, path)


def plot_seq_curve(
    curve: StepCurve,
    *,
    batch: int,
    capacities: Mapping[str, int] | None = None,
    lengths: Sequence[int] | None = None,
    path: str | Path | None = None,
    ax: Any = None,
) -> Any:
    """Predicted peak (device memory) against the sequence length at micro batch ``batch``, read off the same trace
    as the batch curve (the estimate's sequence length is symbolic), with each GPU's capacity. ``lengths``: where
    to draw it (default: from an eighth of the traced length to four times it)."""
    _check_curve(curve, "plot_seq_curve")
    traced = curve.estimate.seq_len
    if traced is None:
        raise InvalidInputError("this estimate's sample has no sequence dimension to draw a sequence-length curve of")
    figure, axes = (ax.figure, [ax]) if ax is not None else _figure()
    axis = axes[0]
    peaks = _up_to_the_longest(curve, batch, sorted(set(lengths or _length_grid(traced))))
    axis.plot(list(peaks), [peak / _UNIT for peak in peaks.values()], "o-", color="#55a868",
              markersize=3, label=f"predicted peak, micro batch {batch}")  # fmt: skip
    axis.axvline(traced, color="gray", linestyle=":", linewidth=1, label=f"traced length {traced}")
    for index, (name, capacity) in enumerate((capacities or {}).items()):
        axis.axhline(capacity / _UNIT, color=f"C{index + 1}", linestyle="--", linewidth=1, label=f"{name} capacity")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length (tokens a sample)")
    axis.set_ylabel("GiB")
    axis.set_title("predicted peak vs sequence length")
    axis.legend(fontsize=8)
    axis.set_ylim(bottom=0)
    return _save(figure, path)


def _up_to_the_longest(curve: StepCurve, batch: int, lengths: Sequence[int]) -> dict[int, int]:
    """Device bytes at each length, up to the longest the model takes (a longer one is refused: no positions)."""
    peaks: dict[int, int] = {}
    for length in lengths:
        try:
            peaks[length] = curve.at(batch, length).device_bytes
        except InvalidInputError:
            if not peaks or length <= curve.estimate.seq_len:
                raise
            break
    return peaks


def _length_grid(traced: int, asked: Sequence[int] = ()) -> list[int]:
    """From an eighth of the traced length to four times it in steps of sqrt(2), on to the longest length asked
    about, and the lengths asked about."""
    grid = {max(2, round(traced * 2 ** (k / 2))) for k in range(-6, 5)}
    while asked and max(grid) < max(asked):
        grid.add(round(max(grid) * 2**0.5))
    return sorted(grid | set(asked))


def plot_plan(
    curve: StepCurve,
    *,
    capacities: Mapping[str, int],
    chosen: Mapping[str, int],
    timeline_of: MemoryEstimate | None = None,
    seq_lens: Sequence[int] = (),
    path: str | Path | None = None,
) -> Any:
    """The pictures of ``memfit plan --plot``: the step's timeline (at the first chosen batch), the batch curve, and
    where the sample has a sequence length, the sequence-length curve at the first chosen batch, reaching the
    longest of ``seq_lens`` (the lengths a sweep asked about; all three read off the same trace)."""
    _check_curve(curve, "plot_plan")
    traced_length = curve.estimate.seq_len
    figure, axes = _figure(rows=3 if traced_length is not None and curve.exact else 2)
    first_capacity = next(iter(capacities.values()), None)
    plot_timeline(timeline_of or curve.estimate, capacity_bytes=first_capacity, ax=axes[0])
    plot_batch_curve(curve, capacities=capacities, chosen=chosen, ax=axes[1])
    if traced_length is not None and curve.exact:
        batch = next(iter(chosen.values()), curve.estimate.batch_size)
        lengths = _length_grid(traced_length, seq_lens)
        plot_seq_curve(curve, batch=batch, capacities=capacities, lengths=lengths, ax=axes[2])
    return _save(figure, path)


def plot_drift(steps: Sequence[int], predicted_bytes: int | None, measured_bytes: Sequence[int | None], *,
               label: str = "measured peak", path: str | Path | None = None) -> Any:  # fmt: skip
    """Measured peak per logging window against the prediction (``None``: no comparable prediction,
    such as CPU runs, where the process's resident memory is measured; the measured peaks alone)."""
    figure, axes = _figure(height=3.5)
    axis = axes[0]
    pairs = [(s, m) for s, m in zip(steps, measured_bytes, strict=True) if m is not None]
    if pairs:
        axis.plot([s for s, _ in pairs], [m / _UNIT for _, m in pairs], "o-", label=label)
    if predicted_bytes is not None:
        axis.axhline(predicted_bytes / _UNIT, color="black", linestyle="--", label="predicted")
    axis.set_xlabel("step")
    axis.set_ylabel("GiB")
    axis.set_title("memory: predicted vs measured" if predicted_bytes is not None else "memory: measured peak")
    axis.legend(fontsize=8)
    return _save(figure, path)


def _check_curve(curve: Any, function: str) -> None:
    """A picture of other batches needs the traced step: a ``MemoryEstimate`` (a value) is refused in one line."""
    if not isinstance(curve, StepCurve):
        raise InvalidInputError(
            f"{function} draws the step at other batches, which needs its trace: pass memfit.trace(...) (a StepCurve), "
            f"not {type(curve).__name__}"
        )
