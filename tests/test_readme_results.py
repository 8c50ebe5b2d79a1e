"""The accuracy figures of docs/accuracy.md and the README are the committed result files, rendered; nothing is
copied by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.accuracy import readme


def _results_copy(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(readme.RESULTS, results)
    return results


def test_the_readme_shows_the_committed_results() -> None:
    assert readme.main(["--check"]) == 0


def test_a_result_file_changed_without_the_readme_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _results_copy(tmp_path)
    path = results / "accuracy-cpu.json"
    data = json.loads(path.read_text())
    data["summary"]["peak_error_pct"]["max_abs"] += 1.0
    path.write_text(json.dumps(data))
    assert readme.main(["--check", "--results", str(results)]) == 1
    assert "--write" in capsys.readouterr().err
    rendered = readme.render(readme.DOC.read_text(), results)
    assert f"{data['summary']['peak_error_pct']['max_abs']:.3f} %" in rendered


def test_a_gpu_run_replaces_the_pending_lines(tmp_path: Path) -> None:
    results = _results_copy(tmp_path)
    (results / "accuracy-gpu.json").unlink(missing_ok=True)  # before any GPU run
    pending = readme.render(readme.DOC.read_text(), results)
    assert "**GPU: still to be measured.**" in pending

    def row(config: str, reserved_error: float | None) -> dict:
        if reserved_error is None:  # the harness keeps a configuration whose run failed, with its error
            return {"config": config, "batch_size": 8, "predicted_peak_reserved_bytes": 1000, "error": "Traceback"}
        return {"config": config, "batch_size": 8, "predicted_peak_reserved_bytes": 1000,
                "measured_peak_reserved_bytes": 1000, "allocated_error_pct": reserved_error / 2,
                "reserved_error_pct": reserved_error, "nvml_error_pct": None}  # fmt: skip

    rows = [row("gpt2 fp32 adamw b8", 1.0), row("gpt2 bf16-mixed adamw b8", -3.0), row("gpt2 x b8", None),
            row("vit fp32 adamw b8", 0.5)]  # fmt: skip
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu128", "date": "2026-12-01"}
    (results / "accuracy-gpu.json").write_text(json.dumps({"meta": meta, "summary": {}, "rows": rows}))
    lines = readme.gpu_accuracy(results)
    assert "NVIDIA H100 80GB HBM3, torch 2.11.0+cu128, 2026-12-01" in lines[0]
    table = {line.split(" | ")[0].removeprefix("| "): line for line in lines if line.startswith("| ")}
    # per family: runs that measured (and those that failed), median and max of the absolute errors
    assert table["gpt2"] == "| gpt2 | 2 (1 not measured) | 1.000 % | 1.500 % | 2.000 % | 3.000 % | - | - |"
    assert table["vit"] == "| vit | 1 | 0.250 % | 0.250 % | 0.500 % | 0.500 % | - | - |"
    assert table["**all**"] == "| **all** | 3 (1 not measured) | 0.500 % | 1.500 % | 1.000 % | 3.000 % | - | - |"
    written = readme.render(readme.DOC.read_text(), results)
    assert "**GPU: still to be measured.**" not in written and table["gpt2"] in written


def test_measured_trace_zoo_rows_show_their_errors(tmp_path: Path) -> None:
    results = _results_copy(tmp_path)
    data = json.loads((results / "trace_zoo-cpu.json").read_text())
    first, second = data["rows"][:2]
    first.update(measured_peak_allocated_bytes=first["predicted_peak_allocated_bytes"] * 2,
                 measured_peak_reserved_bytes=first["predicted_peak_reserved_bytes"],
                 measured_nvml_used_bytes=None)  # fmt: skip
    second["error"] = "CUDA out of memory"
    (results / "trace_zoo-gpu.json").write_text(json.dumps({"meta": data["meta"], "rows": [first, second]}))
    lines = readme.trace_zoo_gpu(results)
    assert f"| {first['config']} |" in lines[-2] and lines[-2].endswith("| -50.00 % | +0.00 % | - |")
    assert lines[-1].startswith(f"| {second['config']} |") and "| failed |" in lines[-1]


def test_a_readme_without_a_block_is_refused() -> None:
    text = readme.DOC.read_text().replace("<!-- results: speed -->", "")
    with pytest.raises(ValueError, match="results: speed"):
        readme.render(text)


def test_the_readme_status_follows_the_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = _results_copy(tmp_path)
    status = readme.render(readme.README.read_text(), results, readme.README_BLOCKS)
    assert status == readme.README.read_text()  # the committed README shows the committed files
    path = results / "accuracy-cpu.json"
    data = json.loads(path.read_text())
    data["summary"]["peak_error_pct"]["median_abs"] += 1.0
    path.write_text(json.dumps(data))
    assert readme.main(["--check", "--results", str(results)]) == 1
    assert "README.md" in capsys.readouterr().err
    rendered = readme.render(readme.README.read_text(), results, readme.README_BLOCKS)
    assert f"within {data['summary']['peak_error_pct']['median_abs']:.3f} %" in rendered
    truth_path = results / "gpu_truth-cpu.json"
    truth = json.loads(truth_path.read_text())
    truth_path.unlink()  # before any GPU run
    assert "**GPU:** still to be measured" in readme.render(readme.README.read_text(), results, readme.README_BLOCKS)

    truth["summary"]["without_gpu"].update(median_abs_pct=0.5, max_abs_pct=7.25, within_goal=40)
    truth["summary"]["on_gpu_machine"].update(median_abs_pct=1.75)
    truth_path.write_text(json.dumps(truth))
    gpu_line = readme.status(results)[1]
    assert "still to be measured" not in gpu_line
    rows = truth["summary"]["without_gpu"]["rows"]
    assert (
        "NVIDIA H100 80GB HBM3" in gpu_line
        and "within 0.50 % of the measured one" in gpu_line
        and "(7.25 % at worst; 40 of" in gpu_line
        and f"{rows} measured runs" in gpu_line
        and "1.75 % at the median" in gpu_line
    )


def test_the_depth_extrapolation_table_is_the_result_file(tmp_path: Path) -> None:
    results = _results_copy(tmp_path)
    data = json.loads((results / "depth_extrapolation.json").read_text())
    lines = readme.depth_extrapolation(results)
    table = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(data["rows"])
    for line, row in zip(table, data["rows"], strict=True):
        assert line.startswith(f"| {row['model']} | {row['depth']} |")
        assert f"{row['reserved_error_pct']:+.3f} %" in line
        built = f"{row['built_seconds']:.2f}" if "built_seconds" in row else "-"
        assert line.endswith(f"| {row['exact_seconds']:.2f} / {built} / {row['extrapolated_seconds']:.2f} |")
        if "built_largest_difference_bytes" in row:
            assert f"| {row['built_largest_difference_bytes']:,} B |" in line


def test_a_readme_without_its_status_block_is_refused() -> None:
    text = readme.README.read_text().replace("<!-- results: status -->", "")
    with pytest.raises(ValueError, match="results: status"):
        readme.render(text, blocks=readme.README_BLOCKS)


def test_the_quantized_cpu_table_is_the_result_file(tmp_path: Path) -> None:
    results = _results_copy(tmp_path)
    path = results / "quantized-cpu.json"
    data = json.loads(path.read_text())
    lines = readme.quantized_cpu(results)
    table = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(data["rows"])
    for line, row in zip(table, data["rows"], strict=True):
        difference = row["predicted_step_peak_bytes"] - row["measured_step_peak_bytes"]
        assert line.startswith(f"| {row['config']} |")
        assert line.endswith(f"| {difference:+d} B ({readme._pct(row['step_error_pct'], True, digits=4)}) |")
    data["rows"][0]["measured_step_peak_bytes"] += 4096  # a new measurement, the docs not rendered again
    path.write_text(json.dumps(data))
    assert readme.main(["--check", "--results", str(results)]) == 1
    path.unlink()
    assert "not measured yet" in readme.render(readme.DOC.read_text(), results)
