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
    # the plan splits 12 samples per rank into 3 x 4 under DDP: trace that loop for the budgets
    roomy, tight = (budget_for_micro_batch(module, micro, ddp=True, accumulation_steps=4) for micro in (6, 3))
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
    assert reports[1]["plan"] == reports[0]["plan"]  # every rank holds the plan it runs
    traced = reports[0]["estimate"]  # the plan's own trace: Lightning's loop under DDP, as it ran
    assert traced["ddp"] == {"bucket_cap_mb": None, "gradient_as_bucket_view": False,
                             "find_unused_parameters": False, "static_graph": False}  # fmt: skip
    assert traced["breakdown_bytes"]["gradient_buckets"] == reports[0]["trainable_bytes"]
    assert (traced["accumulation_steps"], traced["zero_grad"]) == (4, "after_step")  # memfit's closure zeroes first
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(metrics) == 1  # only rank 0 writes
    with open(metrics[0]) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("memfit/measured_peak_rss_bytes")]
    assert [int(row["step"]) for row in rows] == [1, 3]


def run_ddp_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_oom_on_one_rank_is_recovered_and_agreed_without_deadlock(tmp_path: Path) -> None:
    if not torch.distributed.is_available():
        import pytest

        pytest.skip("torch.distributed is not available")
    runs = {"undisturbed": "none", "recovered": "4"}
    for name, limit in runs.items():
        result = run_ddp_script("ddp_oom_fit.py", str(tmp_path / name), limit)
        assert result.returncode == 0, result.stderr[-3000:]
    reports = {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)] for name in runs}
    weights = {name: [torch.load(tmp_path / name / f"rank{r}.pt") for r in (0, 1)] for name in runs}
    rank0, rank1 = reports["recovered"]
    assert rank1["recoveries"] >= 1 and rank0["recoveries"] == 0  # only rank 1 ran out of memory
    assert rank0["chunk_size"] == rank1["chunk_size"] <= 4  # rank 0 adopted rank 1's chunk
    for recovered, undisturbed in zip(reports["recovered"], reports["undisturbed"], strict=True):
        assert recovered["global_step"] == undisturbed["global_step"] == 2
        assert recovered["seen"] == undisturbed["seen"]  # 48 samples per rank, each once
    assert torch.equal(weights["recovered"][0], weights["recovered"][1])  # gradients were synchronised
    assert torch.allclose(weights["recovered"][0], weights["undisturbed"][0], atol=1e-6)
