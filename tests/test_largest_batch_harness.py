"""The largest-batch harness on CPU: a simulated card whose limit is known, so every method's answer is checkable.

On a GPU the same code finds real out-of-memory limits; here a forward over more than N samples
raises CUDA's out-of-memory error, which Lightning's BatchSizeFinder and HF's auto_find_batch_size
catch exactly as they catch the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import memfit
from harness.accuracy import readme
from harness.accuracy.largest_batch import config_of, in_fresh_process, largest_that_fits, main
from harness.accuracy.run import build, optimizer_spec
from harness.accuracy.zoo import FAMILIES


@given(limit=st.integers(0, 300), seed=st.integers(1, 400), cap=st.integers(1, 256))
def test_the_search_finds_the_limit_from_any_seed(limit: int, seed: int, cap: int) -> None:
    calls: list[int] = []

    def fits(batch: int) -> bool:
        calls.append(batch)
        return batch <= limit

    found, capped = largest_that_fits(fits, seed, cap)
    assert (found, capped) == ((None, False) if limit == 0 else (cap, True) if limit >= cap else (limit, False))
    assert len(calls) == len(set(calls)) and all(1 <= b <= cap for b in calls)  # no batch tried twice


def test_harness_compares_every_method_with_the_true_limit(tmp_path: Path) -> None:
    output = tmp_path / "largest.json"
    code = main(["--simulate-max-batch", "6", "--only", "gpt2", "--in-process", "--check-steps", "2",
                 "--hf-start", "16", "--output", str(output)])  # fmt: skip
    assert code == 0
    data = json.loads(output.read_text())
    (row,) = data["rows"]
    assert data["meta"]["device"] == "CPU, simulated card of 6 samples"
    assert (row["true_max"], row["true_max_capped"]) == (6, False)
    assert all(probe["ok"] == (probe["batch_size"] <= 6) for probe in row["probes"])
    # Lightning's finder, binsearch (with its 5 % margin) and power of two; HF shrinks by 0.9 from 16.
    assert 1 <= row["lightning_binsearch"]["batch_size"] <= 6
    assert row["lightning_power"]["batch_size"] == 4
    assert row["hf_auto_find"]["batch_size"] == 6
    for method in ("lightning_binsearch", "lightning_power", "hf_auto_find"):
        result = row[method]
        assert result["check_ok"] is True and result["seconds"] > 0
        assert result["fraction_of_true_max"] == round(result["batch_size"] / 6, 3)
        assert result["seconds_vs_memfit"] == round(result["seconds"] / row["memfit"]["seconds"], 1)
    # memfit planned for the 2 GiB budget, which the simulated card ignores: its batch fails the check run.
    family = next(f for f in FAMILIES if f.name == "gpt2")
    cls, kwargs = optimizer_spec("adamw")
    torch.manual_seed(0)
    curve = memfit.trace(family.build("cpu"), family.batch("cpu"), batch_size=1, optimizer=cls,
                         optimizer_kwargs=kwargs, precision="bf16-mixed", target=memfit.Target("cuda"))  # fmt: skip
    expected = memfit.plan(curve, 2 * 1024**3, target_batch_size="max", allow_checkpointing=False,
                           max_batch_size=8192).micro_batch_size  # fmt: skip
    assert row["memfit"]["batch_size"] == expected > 6
    assert row["memfit"]["check_ok"] is False
    summary = data["summary"]
    hf_ratio = row["hf_auto_find"]["seconds_vs_memfit"]
    assert summary["hf_auto_find"] == {"families": 1, "median_share": 1.0, "lowest_share": 1.0, "above_true_max": 0,
                                       "out_of_memory_in_check": 0, "median_seconds_vs_memfit": hf_ratio}  # fmt: skip
    assert summary["memfit"]["above_true_max"] == 1 and summary["memfit"]["out_of_memory_in_check"] == 1
    # the README's table is rendered from such a file once a GPU run is committed
    output.rename(tmp_path / "largest_batch-gpu.json")
    lines = readme.largest_batch(tmp_path)
    text = "\n".join(lines)
    memfit_share = f"{100 * row['memfit']['fraction_of_true_max']:.0f} %"
    assert f"| gpt2 | 6 | {row['memfit']['batch_size']} ({memfit_share}), " in text
    assert f"| 6 (100 %), {row['hf_auto_find']['seconds']:.1f} s |" in text
    assert "| memfit | 1 | " in text and "**OOM**" in text


def test_a_trial_runs_in_a_fresh_process_and_reports_out_of_memory() -> None:
    job = {"kind": "probe", "family": "gpt2", "precision": "bf16-mixed", "optimizer": "adamw", "size": "cpu",
           "device": "cpu", "ceiling": 3, "steps": 1}  # fmt: skip
    assert in_fresh_process({**job, "batch_size": 3})["ok"] is True
    failed = in_fresh_process({**job, "batch_size": 4})
    assert failed["ok"] is False and "out of memory" in failed["error"]
    broken = in_fresh_process({**job, "family": "no-such-model", "batch_size": 1})
    assert broken["failed"] is True and "unknown family" in broken["error"]


def test_without_a_gpu_the_real_comparison_says_what_to_run_instead(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        main(["--only", "gpt2"])
    assert "--simulate-max-batch" in capsys.readouterr().err


def test_a_run_cut_short_is_rebuilt_from_its_logged_trials(tmp_path: Path) -> None:
    """The committed capped-boundary logs of the H100 run rebuild to the rows its table reports."""
    logs = sorted(
        (Path(__file__).parents[1] / "benchmarks/results/gpu-truth/h100-2026-11-27").glob("largest_batch-*.log")
    )
    output = tmp_path / "capped.json"
    assert main(["--from-logs", *map(str, logs), "--output", str(output)]) == 0
    rows = {row["family"]: row for row in json.loads(output.read_text())["rows"]}
    for row in rows.values():  # the true maximum fits and one more sample does not, in 3-step probes
        fits = {p["batch_size"]: p.get("ok") for p in row["probes"]}
        assert fits[row["true_max"]] is True and fits[row["true_max"] + 1] is False
        assert row["memfit"]["batch_size"] <= row["true_max"] and row["memfit"]["check_ok"] is True
    assert rows["gpt2"]["hf_auto_find"]["check_ok"] is False  # HF's choice ran out of memory in the check run
    # vit's HF trial was cut short in the first run; a later run of HF's finder alone, from 512, ended
    assert rows["vit"]["hf_auto_find"]["start"] == 512 and rows["vit"]["hf_auto_find"]["check_ok"] is True
    first_run = [log for log in logs if not log.name.endswith("-hf.log")]
    assert main(["--from-logs", *map(str, first_run), "--output", str(output)]) == 0
    rows = {row["family"]: row for row in json.loads(output.read_text())["rows"]}
    assert rows["vit"]["hf_auto_find"] == {"cut_short": True}
    assert rows["gpt2"]["hf_auto_find"]["start"] == 4096


WHOLE_CARD = Path(__file__).parents[1] / "benchmarks/results/gpu-truth/h200-2026-11-27-whole-card"


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_planned_without_the_gpu_the_whole_card_boundary_is_the_measured_one(family: str) -> None:
    """On the whole H200, from the free memory the run measured after CUDA started: planned here on CPU, the
    largest batch predicted to fit is the largest that trained 3 steps there (one more ran out of memory), and
    the batch chosen at the default margin reserves what the 10-step check run reserved."""
    trials = [json.loads(line) for line in (WHOLE_CARD / f"largest_batch-whole-{family}.log").read_text().splitlines()
              if line.startswith('{"trial"')]  # fmt: skip
    on_gpu = next(t["result"] for t in trials if t["trial"]["kind"] == "memfit")
    fits = {t["result"]["batch_size"]: t["result"]["ok"] for t in trials if t["trial"]["kind"] == "probe"}
    check = json.loads((WHOLE_CARD / f"check-whole-{family}.log").read_text().splitlines()[-1])
    config = config_of(family, "bf16-mixed", "adamw")
    cls, kwargs = optimizer_spec("adamw")
    curve = memfit.trace(build(config, "gpu"), config.family.batch("gpu"), batch_size=1, optimizer=cls,
                         optimizer_kwargs=kwargs, precision="bf16-mixed", loss_fn=config.family.loss_fn,
                         forward_fn=config.family.forward_fn, target=memfit.Target("cuda"))  # fmt: skip
    capacity = on_gpu["capacity_bytes"]
    limit = curve.max_batch_size(capacity, include_context=False, at_limit=True)
    assert fits[limit] is True and fits[limit + 1] is False
    chosen = memfit.plan(curve, capacity, target_batch_size="max", allow_checkpointing=False,
                         include_context=False, max_batch_size=8192)  # fmt: skip
    assert chosen.micro_batch_size == on_gpu["batch_size"] == check["batch_size"] < limit
    assert check["ok"] is True and check["alloc_retries"] == 0
    assert chosen.predicted_peak_bytes == check["peak_reserved_bytes"]
