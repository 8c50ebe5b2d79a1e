"""The published-record suite: its runner on shortened models, the result file's fields, its rendering,
and the loop behaviour it needed (torch < 2.0's zero_grad that never frees gradients)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.accuracy import loops, readme
from harness.accuracy.reference import profiled_cpu_peak
from harness.published import hf_bert, run
from harness.published.rows import QUANTITIES, SECTIONS, all_rows

pytest.importorskip("transformers")


def test_a_shortened_row_runs_end_to_end(tmp_path: Path) -> None:
    output = tmp_path / "published.json"
    assert run.main(["--only", "bert-large b1x4 fp32 ckpt", "--layers", "1", "--output", str(output)]) == 0
    data = json.loads(output.read_text())
    (row,) = data["rows"]
    assert row["id"] == "bert-large b1x4 fp32 ckpt" and row["layers"] == 1
    # a shortened model is not compared with the published figure
    assert row["error_pct"] is None and "not comparable" in row["notes"][-1]
    # NVML used: the reserved peak plus the 1343 MB context the page measured
    assert row["cuda_context_bytes"] == hf_bert.CONTEXT_MB * 2**20
    assert row["predicted_bytes"] == row["predicted_peak_reserved_bytes"] + row["cuda_context_bytes"]
    # fp32 weights, gradients (zeroed in place, never freed) and AdamW's two states are all alive at the peak
    parameters = sum(p.numel() for p in hf_bert._model(1).parameters())
    assert row["predicted_peak_allocated_bytes"] > 16 * parameters
    assert data["summary"]["all"]["n"] == 0


def test_rows_of_a_missing_package_are_kept_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = tmp_path / "published.json"
    kept = {"id": "litgpt today phi-1.5 b1", "section": "today", "traced_with": "torch x, litgpt y", "error_pct": 1.0,
            "predicted_bytes": 1}  # fmt: skip
    output.write_text(json.dumps({"rows": [kept]}))
    monkeypatch.setattr(run, "available", lambda package: package not in ("litgpt", "lit_gpt"))
    data = run.run(["phi-1.5 b1", "bert-large b1x4 fp32 ckpt"], 1, output)  # phi: both packages missing
    ids = [row["id"] for row in data["rows"]]
    assert ids == ["bert-large b1x4 fp32 ckpt", "litgpt today phi-1.5 b1"]  # table order; lit_gpt: no row kept
    assert data["rows"][1] == kept


def test_every_committed_row_says_what_it_measures_and_where_it_comes_from() -> None:
    data = json.loads((readme.RESULTS / "published.json").read_text())
    ids = {row.id for row in all_rows()}
    assert data["rows"], "benchmarks/results/published.json holds no row"
    for row in data["rows"]:
        assert row["id"] in ids
        for name in run.REQUIRED_FIELDS:
            assert row.get(name), f"{row['id']}: no {name}"
        assert row["quantity"] in QUANTITIES and row["section"] in SECTIONS
        if row["predicted_bytes"] is None:  # not predicted: says why, borrows no number
            assert row["error_pct"] is None and row["notes"]
        else:
            expected = 100 * (row["predicted_bytes"] - row["published_bytes"]) / row["published_bytes"]
            assert row["error_pct"] == pytest.approx(expected, abs=1e-3)
            assert "layers" not in row  # the committed file compares whole models only


def test_the_published_table_is_the_result_file(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(readme.RESULTS, results)
    data = json.loads((results / "published.json").read_text())
    lines = readme.published(results)
    for row in data["rows"]:
        (line,) = [line for line in lines if line.startswith(f"| {row['id']}: ")]
        assert f"| {row['published']:g} {row['unit']} |" in line
        assert line.endswith("| - |" if row["error_pct"] is None else f"| {row['error_pct']:+.2f} % |")
    assert any(line.startswith("*Reproduced software*") for line in lines)
    # a changed row changes the table and the README's status line
    data["rows"][0]["error_pct"] = 42.0
    data["summary"]["all"]["max_abs_error_pct"] = 42.0
    (results / "published.json").write_text(json.dumps(data))
    assert any(line.endswith("| +42.00 % |") for line in readme.published(results))
    assert "largest 42.00 %" in readme.published_status(results)[0]
    assert readme.main(["--check", "--results", str(results)]) == 1
    (results / "published.json").unlink()
    assert "not predicted yet" in readme.published(results)[0]


def test_zero_grad_in_place_is_a_real_loop_that_never_frees_gradients() -> None:
    """torch < 2.0 zeroed gradients in place: the next forward runs with them alive. Measured on real CPU
    tensors, as the training-loop harness measures its loops."""
    measured = profiled_cpu_peak(loops.hand_loop("in_place", 1))
    predicted = loops.predicted("cpu", zero_grad="in_place").peak_allocated_bytes
    freed = loops.predicted("cpu", zero_grad="after_step").peak_allocated_bytes
    assert abs(predicted - measured) <= 4096
    assert measured - freed > 4 * 1024 * 1024  # a trace that frees them misses the gradients


def test_a_shortened_litgpt_row_traces_litgpt_s_own_model(tmp_path: Path) -> None:
    """Runs where litgpt is installed (its own environment, see harness/published/README.md)."""
    pytest.importorskip("litgpt")
    from litgpt import Config

    data = run.run(["litgpt today phi-1.5 b1"], 2, tmp_path / "published.json")
    (row,) = data["rows"]
    config = Config.from_name("phi-1_5")
    # LoRA r=8 on query and value of two blocks: A is r x n_embd, B is n_embd x r, for each of the two
    assert row["trainable_parameters"] == 2 * 2 * 8 * (config.n_embd + config.n_embd)
    # the quantity is max_memory_allocated; the bf16 embedding and LM head alone hold 2 x vocab x n_embd x 2 B
    embedding_and_head = 2 * config.padded_vocab_size * config.n_embd * 2
    assert row["predicted_bytes"] == row["predicted_peak_allocated_bytes"] > embedding_and_head


def test_the_2023_matmul_4bit_keeps_its_input_only_inside_the_patch() -> None:
    """The nf4 row reproduces bitsandbytes' 2023 MatMul4Bit, which kept its input for backward; outside the
    row's trace bitsandbytes is as installed."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from bitsandbytes.autograd import _functions as bnb_functions

    from harness.published.litgpt_lora import _matmul_4bit_keeping_its_input

    installed = bnb_functions.MatMul4Bit.forward

    class Ctx:
        needs_input_grad = (True, False, False, False, False)

    def kept(ctx: Ctx) -> tuple[object, object]:
        layer = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4").to("cpu")  # .to quantizes
        weight = layer.weight
        A = torch.randn(4, 64)
        bnb_functions.MatMul4Bit.forward(ctx, A, weight.t(), None, None, weight.quant_state)
        return ctx.tensors[0], A

    with _matmul_4bit_keeping_its_input():
        saved, A = kept(Ctx())
        assert saved is A
    assert bnb_functions.MatMul4Bit.forward is installed
    saved, _ = kept(Ctx())
    assert saved is None  # today's bitsandbytes keeps (None, B)
