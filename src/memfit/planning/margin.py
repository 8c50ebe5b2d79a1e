"""The share of the memory a plan keeps free by default, and the measurement it comes from.

A plan's micro batch fits when the step runs within ``capacity x (1 - margin)`` as the caching allocator behaves at
its limit. The prediction is not exact: against 51 training steps measured on an H100 or H200 and predicted on a machine
without a GPU (``benchmarks/results/gpu_truth-cpu.json``), the reserved peak was under-predicted by at most
``DEFAULT_MARGIN`` in 9 of 10 runs. The margin covers that error; ``tests/test_margin.py`` holds it to the committed
measurements, so it moves with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["DEFAULT_MARGIN", "MARGIN_COVERAGE", "margin_covering"]

MARGIN_COVERAGE = 0.9
"""The share of measured runs whose under-prediction the default margin covers."""

DEFAULT_MARGIN = 0.015
"""``margin_covering`` of the committed GPU-truth errors: 1.5 % of the capacity kept free."""


def margin_covering(error_pcts: Sequence[float], coverage: float = MARGIN_COVERAGE, step: float = 0.005) -> float:
    """The smallest margin, in steps of ``step``, that at least ``coverage`` of the runs' errors (predicted - measured,
    in percent of measured) are not under by more than. Over-predictions need none."""
    if not error_pcts:
        raise ValueError("no measured runs to size a margin from")
    shortfalls = sorted(max(0.0, -error) / 100 for error in error_pcts)
    covered = shortfalls[math.ceil(coverage * len(shortfalls)) - 1]
    return round(math.ceil(round(covered / step, 9)) * step, 6)
