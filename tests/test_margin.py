"""The default margin is the measured error of the prediction, not a guess: it is held to the committed GPU truth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.planning.margin import DEFAULT_MARGIN, MARGIN_COVERAGE, margin_covering

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_truth-cpu.json"


def test_the_default_margin_covers_the_measured_under_prediction_of_nine_runs_in_ten() -> None:
    rows = json.loads(RESULTS.read_text())["rows"]
    errors = [row["reserved_error_pct"] for row in rows]
    assert margin_covering(errors, MARGIN_COVERAGE) == DEFAULT_MARGIN
    covered = sum(-error / 100 <= DEFAULT_MARGIN for error in errors)
    assert covered >= MARGIN_COVERAGE * len(errors)


@pytest.mark.parametrize(
    ("errors", "coverage", "expected"),
    [([+3.0, -0.4, -1.1], 1.0, 0.015), ([-8.0, -1.0, -0.2, 0.0], 0.75, 0.01), ([+1.0, +2.0], 0.9, 0.0)],
)
def test_a_margin_is_the_smallest_half_percent_step_that_covers_the_share_asked(
    errors: list[float], coverage: float, expected: float
) -> None:
    assert margin_covering(errors, coverage) == expected
