"""A slice of the accuracy harness runs in the suite: traced vs counted on real CPU tensors."""

from __future__ import annotations

import pytest

from harness.accuracy.run import run_cpu, summarize
from harness.accuracy.zoo import configs


@pytest.mark.parametrize(
    "name", ["gpt2 fp32 adamw b2", "resnet-bn 16-mixed adamw-fused b2", "llama bf16-mixed sgd-momentum ckpt b4"]
)
def test_harness_rows_agree_with_independent_counts(name: str) -> None:
    (config,) = [c for c in configs("cpu") if c.name == name]
    rows = run_cpu([config])
    assert [r["batch_size"] for r in rows] == [config.batch_size, 2 * config.batch_size]
    for row in rows:
        assert row["peak_error_pct"] is not None and abs(row["peak_error_pct"]) <= 10  # MemTracker's own tests: 10 %
        if not config.checkpointing:
            assert abs(row["activation_error_pct"]) <= 1
        assert row["estimate_seconds"] > 0 and row["real_step_seconds"] > 0
    summary = summarize(rows, ["peak_error_pct"])
    assert summary["peak_error_pct"]["n"] == 2


def test_the_zoo_has_eight_families_and_24_configurations() -> None:
    zoo = configs("cpu")
    assert len(zoo) == 24
    assert len({c.family.name for c in zoo}) == 8
    assert {c.precision for c in zoo} == {"fp32", "bf16-mixed", "16-mixed"}
    assert {c.optimizer for c in zoo} == {"adamw", "adamw-fused", "sgd-momentum"}
    assert any(c.checkpointing for c in zoo) and any(not c.checkpointing for c in zoo)


def test_a_run_of_some_families_replaces_their_rows_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    # how a GPU run is done in parts that each fit a time limit
    import json
    import shutil

    from harness.accuracy import run

    shutil.copy(run.RESULTS / "accuracy-cpu.json", tmp_path / "accuracy-cpu.json")
    before = json.loads((tmp_path / "accuracy-cpu.json").read_text())
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    assert run.main(["--family", "lstm"]) == 0
    after = json.loads((tmp_path / "accuracy-cpu.json").read_text())
    key = [(r["config"], r["batch_size"]) for r in before["rows"]]
    assert [(r["config"], r["batch_size"]) for r in after["rows"]] == key  # same rows, zoo order
    for old, new in zip(before["rows"], after["rows"], strict=True):
        if old["config"].startswith("lstm "):
            assert new["real_step_seconds"] != old["real_step_seconds"]  # measured again in this run
        else:
            assert new == old
    assert after["summary"] == run.summary_of(after["rows"], gpu=False)
    assert after["summary"]["peak_error_pct"]["n"] == before["summary"]["peak_error_pct"]["n"]

    # rows of another device or torch are never mixed with this run's
    foreign = {**after, "meta": {**after["meta"], "torch": "2.4.0"}}
    (tmp_path / "accuracy-cpu.json").write_text(json.dumps(foreign))
    assert run.main(["--family", "lstm"]) == 0
    replaced = json.loads((tmp_path / "accuracy-cpu.json").read_text())
    assert {r["config"].split()[0] for r in replaced["rows"]} == {"lstm"} and len(replaced["rows"]) == 6


def test_a_child_that_fails_or_says_nothing_is_one_error_row() -> None:
    import sys

    from harness.accuracy.run import child_answer

    assert child_answer([sys.executable, "-c", "print('log line'); print('{\"peak\": 7}')"]) == {"peak": 7}
    assert "no answer" in child_answer([sys.executable, "-c", "pass"])["error"]
    assert "no answer" in child_answer([sys.executable, "-c", "print('not json')"])["error"]
    assert "boom" in child_answer([sys.executable, "-c", "raise SystemExit('boom')"])["error"]
