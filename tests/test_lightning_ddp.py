"""Two CPU processes under DDP: the smaller free memory wins, both ranks apply one plan, rank 0 logs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lightning_models import TinyGPT
from test_lightning import budget_for_micro_batch

HERE = Path(__file__).resolve().parent


def test_ddp_ranks_apply_the_plan_of_the_smallest_budget(tmp_path: Path) -> None:
    if not torch.distributed.is_available():
        import pytest

        pytest.skip("torch.distributed is not available")
    module = TinyGPT(batch_size=12)
    roomy, tight = budget_for_micro_batch(module, 6), budget_for_micro_batch(module, 3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(HERE / "ddp_fit.py"), str(tmp_path), str(roomy), str(tight)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["batch_size"] == 3
        assert report["accumulate_grad_batches"] == 4
        assert report["seen_batch_sizes"] == [3]
    assert reports[0]["plan"]["effective_batch_size"] == 3 * 4 * 2 == 24
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(metrics) == 1  # only rank 0 writes
    with open(metrics[0]) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("memfit/drift_rss_pct")]
    assert [int(row["step"]) for row in rows] == [2, 4]
