"""GPU truth on a machine without a GPU: every row measured on a real GPU, predicted again here for a CUDA target.

The rows and their provenance (device, torch, transformers, cuDNN, date, command) are
``benchmarks/results/gpu-truth/h100-2026-11.json``; ``python benchmarks/gpu_truth.py`` prints the same comparison
as a table. Each row's allocated and reserved peaks must be within the goal (at most 2 % under, 5 % over) unless
``KNOWN_GAPS`` names why it is not, and then it must still miss (a row that comes inside fails until its entry goes).
"""

from __future__ import annotations

import functools

import pytest

from harness.accuracy import gpu_truth

ROWS = gpu_truth.rows()
GROUPS = dict(gpu_truth.groups(ROWS))


@functools.cache
def _predictions(group: tuple[str, str]) -> dict[int, gpu_truth.Prediction]:
    return {p.row.batch_size: p for p in gpu_truth.predict(GROUPS[group])}


def _row_param(row: gpu_truth.TruthRow) -> object:
    gap = gpu_truth.KNOWN_GAPS.get((row.config, row.batch_size))
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    return pytest.param(row, id=f"{row.config} @ {row.batch_size}".replace(" ", "_"), marks=marks)


@pytest.mark.parametrize("row", [_row_param(row) for row in ROWS])
def test_the_prediction_without_a_gpu_is_within_the_goal_of_the_measured_peak(row: gpu_truth.TruthRow) -> None:
    prediction = _predictions((row.kind, row.config))[row.batch_size]
    errors = {kind: round(prediction.error_pct(kind), 2) for kind in ("allocated", "reserved")}
    substituted = [note for note in prediction.notes if "modelled as on CUDA" in note]
    assert prediction.within_goal(), f"{row.name}: {errors} (goal -2 % .. +5 %); {substituted}"


def test_every_known_gap_names_a_measured_row() -> None:
    measured = {(row.config, row.batch_size) for row in ROWS}
    assert set(gpu_truth.KNOWN_GAPS) <= measured
    assert len(gpu_truth.KNOWN_GAPS) < len(ROWS) // 5


def test_the_rows_carry_their_provenance() -> None:
    sources = gpu_truth.sources()
    assert {row.source for row in ROWS} | {gpu_truth.boundary()["source"]} == set(sources)
    for source in sources.values():
        for key in ("device", "torch", "transformers", "cudnn", "date", "how"):
            assert source[key], key
    assert len(ROWS) == 51
