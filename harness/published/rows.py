"""The published measurements: where each comes from, what it measures, and how memfit predicts it.

Every row names its source (a repository and file, or a document's title), the configuration read
there, the published figure with the quantity it measures and its unit, and the software that
measured it. ``predict`` builds the model on ``meta`` (random weights never exist) and returns
memfit's prediction of the *same* quantity, with notes on how the publishing software's behaviour
was reproduced. Nothing here is fitted to a published figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from memfit.units import MiB

Quantity = Literal["nvml_used", "max_memory_allocated", "max_memory_reserved"]
Section = Literal["reproduced", "today"]

QUANTITIES: dict[str, str] = {
    "nvml_used": "NVML used memory of the device after training (the CUDA context included)",
    "max_memory_allocated": "torch.cuda.max_memory_allocated()",
    "max_memory_reserved": "torch.cuda.max_memory_reserved()",
}
SECTIONS: dict[str, str] = {
    "reproduced": "the publishing software's behaviour reproduced",
    "today": "today's model code, the published configuration",
}


@dataclass(frozen=True)
class Prediction:
    """memfit's figure for a row's quantity, or ``None`` with the reason it cannot be predicted."""

    predicted_bytes: int | None
    notes: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One published measurement.

    ``published`` is the figure as printed and ``unit_bytes`` its unit (``MiB`` for NVML's ``used // 1024**2``
    printed as "MB", ``10**9`` for ``/ 1e9`` printed as "GB"). ``predict(layers)`` returns memfit's
    prediction; ``layers`` shortens the model for a quick check of the machinery (the published figure
    is then not comparable, and the runner says so). ``requires`` names the package the row's model code
    comes from.
    """

    id: str
    source: str
    configuration: str
    published: float
    unit: str
    unit_bytes: int
    quantity: Quantity
    software: str
    section: Section
    requires: str
    predict: Callable[[int | None], Prediction]

    @property
    def published_bytes(self) -> int:
        return round(self.published * self.unit_bytes)


def estimate_details(estimate: Any) -> dict[str, Any]:
    """What a row records of memfit's estimate besides its figure: the peaks it predicts, and where."""
    return {
        "predicted_peak_allocated_bytes": estimate.peak_allocated_bytes,
        "predicted_peak_reserved_bytes": estimate.peak_reserved_bytes,
        "cuda_context_bytes": estimate.cuda_context_bytes,
        "peak_phase": f"step {estimate.peak_step} {estimate.peak_phase.value}",
        "phase_peaks_allocated_bytes": {
            f"step {peak.step} {peak.phase.value}": peak.allocated_bytes for peak in estimate.phases
        },
    }


def all_rows() -> list[Row]:
    """Every row, in the order of the published tables."""
    from harness.published.hf_bert import ROWS as BERT_ROWS
    from harness.published.litgpt_lora import ROWS as LITGPT_ROWS

    return [*BERT_ROWS, *LITGPT_ROWS]


MB = MiB  # NVML's used // 1024**2, printed as "MB" by the publications
GB = 10**9  # torch.cuda.max_memory_allocated() / 1e9, printed as "GB"
