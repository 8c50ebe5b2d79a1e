"""`memfit plan`: presets traced on fake tensors at small depth, JSON schema, and the table's golden output."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import memfit
from memfit import Category, Phase, Precision, Target
from memfit.cli.main import main
from memfit.planning.gpu_report import GpuPlan, PlanReport
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.prediction.estimator import MemoryEstimate, PhaseModel, StepCurve
from memfit.presets import PRESETS, from_hf_config
from memfit.reporting.tables import plan_table
from memfit.units import GiB, MiB, format_bytes

GOLDEN = Path(__file__).parent / "golden" / "plan_table.txt"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_on_meta_and_traces_at_small_depth(preset: str) -> None:
    spec = from_hf_config(preset, seq_len=32, image_size=32, layers=1)
    assert all(p.is_meta for p in spec.model.parameters())
    import memfit

    estimate = memfit.estimate(spec.model, spec.sample, batch_size=1, precision="bf16-mixed")
    assert estimate.peak_bytes > estimate.breakdown[Category.PARAMETERS] > 0


def test_plan_json_for_gpus_and_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--gpu", "t4", "--budget", "3GiB",
                 "--target-batch-size", "32", "--json"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "gpt2" and report["precision"] == "bf16-mixed" and report["seq_len"] == 64
    t4, budget = report["gpus"]
    assert t4["gpu"] == "T4" and t4["capacity_bytes"] == 15360 * MiB
    for row in (t4, budget):
        assert row["fits"] is True and row["error"] is None
        assert row["predicted_peak_bytes"] <= row["budget_bytes"]
        assert row["micro_batch_size"] * row["accumulate_grad_batches"] == row["effective_batch_size"] == 32
        assert set(row["breakdown_bytes"]) >= {"parameters", "activations", "optimizer_state"}
    assert budget["gpu"] == "budget 3GiB" and budget["micro_batch_size"] < t4["micro_batch_size"]


def test_plan_counts_ddp_buckets_and_the_loops_zero_grad(capsys: pytest.CaptureFixture[str]) -> None:
    def row(*extra: str) -> dict:
        code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--budget", "3GiB",
                     "--target-batch-size", "8", "--json", *extra])  # fmt: skip
        assert code == 0
        return json.loads(capsys.readouterr().out)["gpus"][0]

    single, data_parallel = row(), row("--world-size", "2")
    gradients = data_parallel["breakdown_bytes"]["gradients"]  # at the rank's peak (one rank's peak may hold none)
    assert single["breakdown_bytes"]["gradient_buckets"] == 0
    # DDP keeps one more copy of the (fp32) gradients in its buckets, allocated with the wrapper (a few
    # large blocks, while the gradients' own blocks are rounded one by one)
    assert gradients > 0
    assert data_parallel["breakdown_bytes"]["gradient_buckets"] == pytest.approx(gradients, rel=0.02)
    assert data_parallel["effective_batch_size"] == 8 and data_parallel["micro_batch_size"] == 4
    lightning = row("--zero-grad", "before_backward")
    assert lightning["predicted_peak_bytes"] >= single["predicted_peak_bytes"]
    # the table says the row is one rank of two
    assert main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--budget", "3GiB",
                 "--target-batch-size", "8", "--gpus", "2"]) == 0  # fmt: skip
    assert "one rank of ddp over 2 GPUs" in capsys.readouterr().out


def test_plan_reports_a_gpu_that_cannot_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--budget", "200MiB", "--json"])
    assert code == 1  # the answer is "no": printed, and said in the exit status
    (row,) = json.loads(capsys.readouterr().out)["gpus"]
    assert row["fits"] is False and "does not fit" in row["error"]


def test_a_deep_model_traced_whole_says_why_its_log_was_not_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral with a sliding window and ``use_cache`` on: its forward builds the KV cache's sliding-window layers,
    one per block, before the first block, so one block more does not give the deeper trace and the five blocks
    are traced whole. The answer says so and why, in the text and in the JSON (from kept traces)."""
    monkeypatch.setenv("MEMFIT_CACHE", "on")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 5, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 256,
                                "sliding_window": 16}))  # fmt: skip
    argv = ["plan", "--hf-config", str(path), "--budget", "1GiB", "--seq-len", "64"]
    assert main(argv) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "the whole model traced: its log could not be built from traces at 3 and 4 blocks (" in said
    assert main([*argv, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["depth_built_from"] is None and answer["depth_not_built"]
    assert answer["depth_not_built"] in said
    assert answer["depth_not_built"].startswith("its blocks do not repeat one another: the trace at 4 blocks is not")


def test_every_row_of_the_json_has_the_same_keys_with_or_without_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """A row that fits, one whose card cannot run the precision (T4: no bf16) and one that does not fit carry the
    same keys; the ones without a plan hold null, so a reader indexes every row alike."""
    argv = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--gpu", "h100", "--gpu", "t4",
            "--budget", "1MiB", "--precision", "bf16-mixed", "--json"]  # fmt: skip
    assert main(argv) == 0
    fits, refused, short = json.loads(capsys.readouterr().out)["gpus"]
    assert (fits["fits"], refused["refused"], short["fits"], short["refused"]) == (True, True, False, False)
    assert set(fits) == set(refused) == set(short)
    for row in (refused, short):
        assert row["micro_batch_size"] is None and row["breakdown_bytes"] is None and row["error"]
    assert fits["micro_batch_size"] >= 1 and fits["breakdown_bytes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--hf-config", "gpt-5", "--gpu", "h100"], "neither a preset"),
        (["plan", "--hf-config", "gpt2", "--gpu", "a100"], "ambiguous"),
        (["plan", "--hf-config", "gpt2"], "name at least one --gpu"),
        (["plan", "--model", "no_such_module:make", "--gpu", "h100"], "cannot load"),
        # the library's `budget` is said as the flag; argparse's reading of -3GiB as an option says what to write
        (["plan", "--hf-config", "gpt2", "--budget=-3GiB"], "error: --budget must be positive, got '-3GiB'"),
        (["plan", "--hf-config", "gpt2", "--budget", "-3GiB"], "goes after '=': --budget=-3GiB"),
        (["plan", "--hf-config", "gpt2", "--budget=3Gx"], "error: --budget could not read '3Gx' as a size"),
    ],
)
def test_plan_bad_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit: error:") and message in err and "Traceback" not in err


def _synthetic_row(name: str, capacity: int, micro: int) -> GpuPlan:
    model = PhaseModel(2, Phase.BACKWARD, 2 * GiB, 1 * GiB)
    estimate = MemoryEstimate(
        batch_size=micro, device="cuda", precision=Precision.BF16_MIXED, optimizer="adamw",
        gradient_checkpointing=False, peak_allocated_bytes=model.at(micro), peak_reserved_bytes=model.at(micro),
        cuda_context_bytes=500 * MiB, peak_step=2, peak_phase=Phase.BACKWARD,
        breakdown={Category.PARAMETERS: GiB // 2, Category.GRADIENTS: GiB // 2, Category.OPTIMIZER_STATE: GiB,
                   Category.ACTIVATIONS: micro * GiB},
        fixed_bytes=2 * GiB, per_sample_bytes=GiB, phases=(), phase_models=(model,), trace_seconds=0.0,
    )  # fmt: skip
    plan = Plan(
        micro_batch_size=micro, accumulate_grad_batches=2, gradient_checkpointing=micro < 4, world_size=1,
        effective_batch_size=2 * micro, target_batch_size=2 * micro, predicted_peak_bytes=estimate.peak_bytes,
        capacity_bytes=capacity, budget_bytes=int(capacity * 0.95), margin=0.05, largest_micro_batch=micro,
    )  # fmt: skip
    return GpuPlan(name, capacity, plan, estimate)


def test_plan_table_golden_output() -> None:
    report = PlanReport(
        "tiny", 123_000_000, "bf16-mixed", "adamw", 512,
        (_synthetic_row("H100", 80 * GiB, 12), _synthetic_row("T4", 15 * GiB, 3),
         GpuPlan("RTX4090", 24 * GiB, None, None, error="micro batch 1 does not fit")),
    )  # fmt: skip
    # as wide as `memfit plan` prints when stdout is not a terminal
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(plan_table(report))
    rendered = console.export_text()
    if not GOLDEN.exists():  # first run writes it; review it and commit
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text()


def test_plan_table_names_gradients_and_a_missed_target() -> None:
    row = _synthetic_row("H100", 80 * GiB, 12)
    why = "micro batch 12 fits; the effective batch 24 differs from the target 23: why"
    missed_plan = dataclasses.replace(row.plan, target_batch_size=23, reasons=(why,))
    missed = GpuPlan("H100", row.capacity_bytes, missed_plan, row.estimate)
    console = Console(width=400, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(plan_table(PlanReport("tiny", 123_000_000, "bf16-mixed", "adamw", 512, (missed,))))
    rendered = " ".join(console.export_text().split())
    assert "effective" in rendered and "24 (target 23)" in rendered
    assert f"H100: {why}" in rendered
    assert "params+grads+optim" not in rendered and "grads" in rendered and "optim state" in rendered


def test_summary_says_when_the_target_is_missed_and_what_the_peak_holds() -> None:
    plan = _synthetic_row("H100", 80 * GiB, 12).plan
    context = 500 * MiB
    reserved = plan.predicted_peak_bytes - context
    exact = dataclasses.replace(plan, predicted_reserved_bytes=reserved).summary()
    assert "= 24 (target 24)" in exact and "not the target" not in exact
    assert f"(reserved {format_bytes(reserved)} + CUDA context {format_bytes(context)})" in exact
    missed = dataclasses.replace(plan, target_batch_size=23, predicted_reserved_bytes=plan.predicted_peak_bytes)
    assert "= 24, not the target 23" in missed.summary() and "CUDA context" not in missed.summary()


def test_text_output_says_when_the_effective_batch_misses_the_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import memfit.planning.gpu_report as gpu_report

    estimate = _synthetic_row("T4", 15 * GiB, 3).estimate
    chosen = memfit.plan(StepCurve(estimate), 15 * GiB, target_batch_size=13, allow_checkpointing=False)
    assert chosen.effective_batch_size != 13
    report = PlanReport("tiny", 123_000_000, "bf16-mixed", "adamw", 512, (GpuPlan("T4", 15 * GiB, chosen, estimate),))
    monkeypatch.setattr(gpu_report, "plan_for_gpus", lambda **kwargs: report)
    assert main(["plan", "--hf-config", "gpt2", "--gpu", "t4", "--target-batch-size", "13"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{chosen.effective_batch_size} (target 13)" in text
    assert f"T4: micro batch {chosen.largest_micro_batch} is the largest that fits" in text
    assert f"the effective batch {chosen.effective_batch_size} differs from the target 13" in text


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plan_plot_draws_timeline_and_batch_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--gpu", "t4", "--budget", "2GiB",
                 "--target-batch-size", "64", "--plot", str(out)])  # fmt: skip
    assert code == 0 and f"pictures: {out}" in capsys.readouterr().out
    assert _png_size(out) == (1100, 1485)  # 10 x 13.5 inches at 110 dpi: three panels (the sample has token ids)


def test_a_sweeps_pictures_are_the_first_lengths_and_its_length_curve_reaches_the_longest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import memfit.reporting.plots as plots

    drawn: list[Any] = []
    real = plots.plot_plan
    monkeypatch.setattr(plots, "plot_plan", lambda *args, **kwargs: drawn.append(real(*args, **kwargs)))
    command = ["plan", "--hf-config", "gpt2", "--layers", "1", "--budget", "8GiB", "--json"]
    assert main([*command, "--seq-len", "64,512", "--plot", str(tmp_path / "sweep.png")]) == 0
    first, longer = json.loads(capsys.readouterr().out)["gpus"]
    assert first["micro_batch_size"] > longer["micro_batch_size"]
    (figure,) = drawn
    _, batches, lengths = figure.axes
    (marked,) = [text.get_text() for text in batches.texts]
    assert marked == f"budget 8GiB: {first['micro_batch_size']}"  # the first length's choice, not the last row's
    (curve,) = [line for line in lengths.lines if line.get_label().startswith("predicted peak")]
    assert max(curve.get_xdata()) == 512 and curve.get_label().endswith(f"micro batch {first['micro_batch_size']}")


def test_a_plot_that_cannot_be_written_is_refused_before_tracing(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--gpu", "t4", "--plot", "/no/such/folder/p.png"])
    assert code == 2
    assert "the folder /no/such/folder does not exist" in capsys.readouterr().err


def test_the_sequence_length_curve_reads_the_trace_and_needs_a_sequence(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from memfit import InvalidInputError
    from memfit.reporting.plots import plot_seq_curve

    spec = from_hf_config("gpt2", seq_len=64, layers=1)
    curve = memfit.trace(spec.model, spec.sample, batch_size=2, target=Target("cuda"), precision="bf16-mixed")
    figure = plot_seq_curve(curve, batch=3, lengths=[16, 64, 256], path=tmp_path / "seq.png")
    (line,) = [line for line in figure.axes[0].lines if line.get_label().startswith("predicted peak")]
    assert list(line.get_xdata()) == [16, 64, 256]
    assert list(line.get_ydata()) == [curve.at(3, n).device_bytes / GiB for n in (16, 64, 256)]
    assert _png_size(tmp_path / "seq.png") == (1100, 495)
    pictures = from_hf_config("vit-base", layers=1)
    image_curve = memfit.trace(pictures.model, pictures.sample, batch_size=2)
    with pytest.raises(InvalidInputError, match="no sequence dimension"):
        plot_seq_curve(image_curve, batch=2)


def test_plot_functions_without_a_timeline_or_matplotlib_say_why(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from memfit import InvalidInputError
    from memfit.reporting.plots import plot_drift, plot_timeline

    with pytest.raises(InvalidInputError, match="no timeline"):
        plot_timeline(_synthetic_row("H100", 80 * GiB, 4).estimate)
    plot_drift([10, 20, 30], 2 * GiB, [int(1.9 * GiB), None, int(2.1 * GiB)], path=tmp_path / "drift.png")
    assert _png_size(tmp_path / "drift.png") == (1100, 385)


def test_inference_plan_has_no_training_state_and_keeps_the_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    import memfit

    spec = from_hf_config("llama-3-8b", seq_len=64, layers=1)
    serving = memfit.estimate(spec.model, spec.sample, batch_size=2, precision="bf16", inference=True)
    training = memfit.estimate(spec.model, spec.sample, batch_size=2, precision="bf16")
    assert serving.breakdown[Category.GRADIENTS] == serving.breakdown[Category.OPTIMIZER_STATE] == 0
    assert [p.phase for p in serving.phases] == [Phase.FORWARD]
    config = spec.model.config
    kv_cache = 2 * 1 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 64 * 2 * 2
    logits = 2 * 64 * config.vocab_size * 2
    assert serving.activation_bytes >= kv_cache + logits  # outputs kept: logits and the KV cache
    assert serving.peak_bytes < training.peak_bytes

    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--budget", "2GiB", "--inference",
                 "--num-workers", "2", "--pin-memory", "--json"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inference"] is True and report["optimizer"] == "none"
    (row,) = report["gpus"]
    assert row["fits"] and row["gradient_checkpointing"] is False
    host = report["host"]
    assert host["weights_bytes"] > 0 and host["pinned_bytes"] > 0
    assert host["batches_bytes"] == 4 * host["pinned_bytes"]  # 2 workers x 2 prefetched batches, 1 pinned copy
    assert host["total_bytes"] == sum(
        host[k] for k in ("weights_bytes", "batches_bytes", "pinned_bytes", "offload_bytes")
    )


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict:
    assert main(["plan", *argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_cards_without_bf16_are_planned_in_16_mixed_and_refuse_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    """T4 and V100 have no bf16: by default they are planned in 16-mixed, saying so; asked for bf16, they refuse."""
    small = ["--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--target-batch-size", "8"]
    report = _plan_json(capsys, *small, "--gpu", "t4", "--gpu", "v100-16gb", "--gpu", "h100")
    t4, v100, h100 = report["gpus"]
    assert report["precision"] == "bf16-mixed" and h100["precision"] == "bf16-mixed" and h100["note"] is None
    for row, architecture in ((t4, "Turing"), (v100, "Volta")):
        assert row["fits"] and row["precision"] == "16-mixed"
        assert architecture in row["note"] and "no bf16" in row["note"] and row["note"] in row["reasons"]
    (asked,) = _plan_json(capsys, *small, "--gpu", "t4", "--precision", "16-mixed")["gpus"]
    assert t4["predicted_peak_bytes"] == asked["predicted_peak_bytes"]  # traced in 16-mixed, not bf16
    assert t4["breakdown_bytes"] == asked["breakdown_bytes"]

    refused, fine = _plan_json(capsys, *small, "--gpu", "t4", "--gpu", "h100", "--precision", "bf16-mixed")["gpus"]
    assert not refused["fits"] and "no bf16" in refused["error"] and "16-mixed" in refused["error"]
    assert fine["fits"] and fine["precision"] == "bf16-mixed"
    assert "plan it with --precision 16-mixed instead" in refused["error"]  # the flag the command line takes

    alone = _plan_json(capsys, *small, "--gpu", "t4")  # every card planned in 16-mixed: so is the report
    assert alone["precision"] == "16-mixed" and alone["gpus"][0]["precision"] == "16-mixed"

    assert main(["plan", *small, "--gpu", "t4"]) == 0
    out = capsys.readouterr().out
    assert "T4: planned in 16-mixed" in out  # the table says it too
    assert "parameters, 16-mixed" in out and "bf16" not in out.splitlines()[0]  # and its title


def test_an_image_model_has_no_sequence_length(capsys: pytest.CaptureFixture[str]) -> None:
    """A ViT's sample is pixels: the report has no sequence length to give (``--seq-len`` does not shape it)."""
    tiny = ["--hf-config", "vit-base", "--layers", "1", "--image-size", "64", "--budget", "4GiB",
            "--target-batch-size", "8"]  # fmt: skip
    report = _plan_json(capsys, *tiny)
    assert report["seq_len"] is None and report["gpus"][0]["fits"]
    assert main(["plan", *tiny]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert "vit-base" in title and "seq" not in title


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
         "max_position_embeddings": 512}  # fmt: skip


def test_inference_plans_half_precision_weights_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Serving loads the weights in half precision; fp32 master weights (bf16-mixed) are a training thing."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    one = ["--hf-config", str(config), "--seq-len", "64", "--inference", "--target-batch-size", "1"]
    default = _plan_json(capsys, *one, "--budget", "4GiB")
    (row,) = default["gpus"]
    assert default["precision"] == "bf16-true" and row["precision"] == "bf16-true"
    parameters = default["parameters"]
    assert 2 * parameters <= row["breakdown_bytes"]["parameters"] < 3 * parameters
    (mixed,) = _plan_json(capsys, *one, "--budget", "4GiB", "--precision", "bf16-mixed")["gpus"]
    assert mixed["breakdown_bytes"]["parameters"] >= 4 * parameters

    # a card that fits the half-precision weights and not fp32 ones: the default plan fits it
    between = (row["predicted_peak_bytes"] + mixed["predicted_peak_bytes"]) // 2
    budget = f"{math.ceil(between / (1 - DEFAULT_MARGIN))}B"  # the midpoint, once the margin is kept free
    (fits,) = _plan_json(capsys, *one, "--budget", budget)["gpus"]
    (misses,) = _plan_json(capsys, *one, "--budget", budget, "--precision", "bf16-mixed", status=1)["gpus"]
    assert fits["fits"] and not misses["fits"]
    assert "optimizer" not in misses["error"] and "quantized weights" in misses["error"]
    (t4,) = _plan_json(capsys, *one, "--gpu", "t4")["gpus"]
    assert t4["precision"] == "16-true" and "no bf16" in t4["note"]


def test_host_estimate_rules() -> None:
    from memfit.prediction.host import estimate_host

    host = estimate_host(weights_bytes=10 * GiB, batch_bytes=100 * MiB, num_workers=4, prefetch_factor=2,
                         pin_memory=True, offload_bytes=3 * GiB)  # fmt: skip
    assert host.batches_bytes == 800 * MiB and host.pinned_bytes == 100 * MiB
    assert host.total_bytes == 13 * GiB + 900 * MiB and host.fits is None
    assert "offload 3.00 GiB" in host.summary()
    local = estimate_host(weights_bytes=1, batch_bytes=1, local_machine=True)
    assert local.available_bytes and local.fits is True and local.batches_bytes == 1


@pytest.mark.parametrize("optimizer", ["adagrad", "rmsprop", "adamw", "sgd"])
def test_host_offload_line_counts_the_registry_state(optimizer: str) -> None:
    """The offloaded state is the formula tier's fp32 state (one registry): adagrad and rmsprop keep one state."""
    from memfit.prediction.formula import estimate_from_counts
    from memfit.prediction.host import offloaded_optimizer_bytes

    formula = estimate_from_counts(parameters=1000, precision="fp32", optimizer=optimizer)
    assert offloaded_optimizer_bytes(optimizer, 1000) == formula.optimizer_state_bytes
    assert (offloaded_optimizer_bytes(optimizer, 1000) > 0) == (optimizer != "sgd")


def test_plan_host_line_offloads_adagrad_state(capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.prediction.formula import estimate_from_counts

    spec = from_hf_config("gpt2", seq_len=32, layers=1)
    trainable = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
    code = main(["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--budget", "2GiB",
                 "--optimizer", "adagrad", "--offload-optimizer", "--json"])  # fmt: skip
    assert code == 0
    host = json.loads(capsys.readouterr().out)["host"]
    fp32_state = estimate_from_counts(parameters=trainable, precision="fp32", optimizer="adagrad")
    assert host["offload_bytes"] == fp32_state.optimizer_state_bytes > 0


def test_depth_extrapolation_follows_the_full_trace() -> None:
    from memfit.prediction.estimator import extrapolate_depth, trace_for_runtimes
    from memfit.simulation.runtime import CudaRuntime

    def traced(layers: int) -> StepCurve:
        spec = from_hf_config("llama-3-8b", seq_len=128, layers=layers)
        (result,) = trace_for_runtimes(spec.model, spec.sample, runtimes=[CudaRuntime()], batch_size=1,
                                       precision="bf16-mixed", target=Target("cuda"))  # fmt: skip
        return result

    deeper = traced(4)
    guess = extrapolate_depth(traced(2), deeper, 2, 4, 6)
    exact = traced(6)
    guessed, whole = guess.estimate, exact.estimate
    assert guessed.peak_allocated_bytes == pytest.approx(whole.peak_allocated_bytes, rel=1e-3)
    assert (guessed.peak_step, guessed.peak_phase) == (whole.peak_step, whole.peak_phase)
    assert guess.at(3).allocated_bytes == pytest.approx(exact.at(3).allocated_bytes, rel=1e-2)
    assert "extrapolated in depth to 6 blocks" in guessed.notes[-1]

    # The timeline is stretched to the full depth: same phases in order, peaking where the estimate does.
    def phases(points: Sequence[Any]) -> list[tuple[int, str]]:
        return [key for key, _ in itertools.groupby((p.step, p.phase.value) for p in points)]

    assert phases(guessed.timeline) == phases(whole.timeline)
    top = max(guessed.timeline, key=lambda p: sum(p.category_bytes))
    assert sum(top.category_bytes) == guessed.peak_allocated_bytes
    assert (top.step, top.phase) == (whole.peak_step, whole.peak_phase)
    assert max(p.reserved_bytes for p in guessed.timeline) == pytest.approx(whole.peak_reserved_bytes, rel=0.02)
    assert guessed.timeline[-1].event_index > deeper.estimate.timeline[-1].event_index  # more blocks, more events


def test_an_extrapolated_estimate_answers_other_sequence_lengths_from_both_depths() -> None:
    """A sweep of lengths reads an extrapolated estimate at another length: both depths read there, then the line
    (it raised a TypeError inside, which reached the row as "does not fit")."""
    from memfit.prediction.estimator import extrapolate_depth, trace_for_runtimes
    from memfit.simulation.runtime import CudaRuntime

    def traced(layers: int) -> StepCurve:
        spec = from_hf_config("llama-3-8b", seq_len=64, layers=layers)
        (result,) = trace_for_runtimes(spec.model, spec.sample, runtimes=[CudaRuntime()], batch_size=2,
                                       precision="bf16-mixed", target=Target("cuda"))  # fmt: skip
        return result

    shallow, deeper = traced(2), traced(4)
    guess = extrapolate_depth(shallow, deeper, 2, 4, 6)
    longer = guess.for_seq_len(128)
    direct = extrapolate_depth(shallow.for_seq_len(128), deeper.for_seq_len(128), 2, 4, 6)
    assert longer.estimate.seq_len == 128 and longer.estimate.peak_reserved_bytes == direct.estimate.peak_reserved_bytes
    assert (
        guess.at(3, seq_len=128) == direct.at(3)
        and guess.at(3, seq_len=128).reserved_bytes > guess.at(3).reserved_bytes
    )


def test_a_large_deep_config_is_planned_from_shallow_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "plan.png"
    code = main(["plan", "--hf-config", "llama-3-8b", "--gpu", "h100", "--seq-len", "256", "--json",
                 "--plot", str(picture)])  # fmt: skip
    assert code == 1  # full fine-tuning of 8B parameters in AdamW does not fit an H100
    report = json.loads(capsys.readouterr().out)
    assert report["depth_built_from"] == [3, 4] and report["depth_extrapolated_from"] is None
    (row,) = report["gpus"]
    assert not row["fits"] and "checkpointing cannot help" in row["error"]
    assert "extrapolated" not in row["error"]  # the whole model's log, built: no extrapolation to hedge
    assert _png_size(picture) == (1100, 1485)  # timeline, batch curve and sequence-length curve, from the built log


# A TinyLlama-shaped causal LM, narrow and 12 blocks deep so that a whole trace takes seconds: like TinyLlama
# (22 blocks of 2048), its head over a 32k vocabulary is a large part of a shallow trace, so the traces at 2 and 4
# blocks are extrapolated far (t = 5) in depth.
NARROW_LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 12,
                "num_attention_heads": 8, "num_key_value_heads": 1, "vocab_size": 32000,
                "max_position_embeddings": 1024}  # fmt: skip
NARROW_SEQ = 1024


def _narrow_llama(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NARROW_LLAMA))
    return str(path)


def _unbuildable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as for a model whose blocks do not repeat one another: its log cannot be built from shallow traces, so a
    large one is searched on traces extrapolated in depth and confirmed on the whole model."""
    from memfit.tracing import depth

    monkeypatch.setattr(depth, "log_difference", lambda built, traced: "blocks of two kinds")


def _whole(config: str, checkpointing: bool, layers: int | None = None, batch: int = 1) -> StepCurve:
    """The step traced as a budget row of ``memfit plan`` traces it (bf16-mixed AdamW, CUDA semantics)."""
    from memfit.prediction.estimator import trace_for_runtimes
    from memfit.simulation.runtime import CudaRuntime

    spec = from_hf_config(config, seq_len=NARROW_SEQ, layers=layers)
    (result,) = trace_for_runtimes(spec.model, spec.sample, runtimes=[CudaRuntime(compute_capability=(9, 0))],
                                   batch_size=batch, precision="bf16-mixed", gradient_checkpointing=checkpointing,
                                   target=Target("cuda"))  # fmt: skip
    return result


def test_a_no_near_the_budget_is_decided_on_the_whole_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that micro batch 1 with checkpointing just fits by whole traces: the plan must say "fits" (as
    ``--exact`` does), not "does not fit even with checkpointing" from the extrapolated figures."""
    from memfit.planning import gpu_report

    monkeypatch.setattr(gpu_report, "EXTRAPOLATION_MIN_PARAMETERS", 0)  # extrapolate this small model too
    _unbuildable(monkeypatch)
    config = _narrow_llama(tmp_path)
    checkpointed = _whole(config, True)  # without checkpointing micro batch 1 needs more
    # what the exact search asks of micro 1
    needed = max(checkpointed.estimate.peak_bytes, checkpointed.at(1).device_bytes)
    capacity = math.ceil(needed / 0.95)
    report = gpu_report.plan_for_gpus(hf_config=config, model=None, gpus=[], budget=f"{capacity}B",
                                      seq_len=NARROW_SEQ, margin=0.05)  # fmt: skip
    assert report.depth_extrapolated_from == gpu_report.EXTRAPOLATION_DEPTHS
    (row,) = report.rows
    assert row.fits, row.error
    assert (row.plan.micro_batch_size, row.plan.gradient_checkpointing) == (1, True)
    assert row.estimate.peak_bytes <= row.plan.budget_bytes and "extrapolated" not in " ".join(row.estimate.notes)


def test_a_far_no_from_the_extrapolation_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.planning import gpu_report

    monkeypatch.setattr(gpu_report, "EXTRAPOLATION_MIN_PARAMETERS", 0)
    _unbuildable(monkeypatch)
    config = _narrow_llama(tmp_path)
    floor = _whole(config, True, layers=2).estimate.peak_bytes  # the whole model needs more than its 2-block trace
    report = gpu_report.plan_for_gpus(hf_config=config, model=None, gpus=[], budget=f"{floor // 2}B",
                                      seq_len=NARROW_SEQ)  # fmt: skip
    (row,) = report.rows
    assert not row.fits and "extrapolated in depth from traces at 2 and 4 blocks" in row.error
    assert "--exact" in row.error


def test_extrapolated_checkpointing_is_not_above_no_checkpointing_where_whole_traces_say_so(tmp_path: Path) -> None:
    """The allocator's overhead does not grow with the depth as the peak does: copied as a ratio from the
    deeper shallow trace, it made checkpointing (whose shallow traces hold little but the head's transients)
    extrapolate above no checkpointing at micro batch 1, where whole traces put it below."""
    from memfit.planning.gpu_report import EXTRAPOLATION_DEPTHS
    from memfit.prediction.estimator import extrapolate_depth

    config = _narrow_llama(tmp_path)
    depth, (low, high) = NARROW_LLAMA["num_hidden_layers"], EXTRAPOLATION_DEPTHS
    guesses, wholes = {}, {}
    for checkpointing in (False, True):
        shallow, deeper = (_whole(config, checkpointing, layers) for layers in (low, high))
        doubled = tuple(_whole(config, checkpointing, layers, batch=2).estimate for layers in (low, high))
        guesses[checkpointing] = extrapolate_depth(shallow, deeper, low, high, depth, doubled=doubled)
        wholes[checkpointing] = _whole(config, checkpointing)
    for batch in (1, 2, 4):
        if wholes[True].at(batch).reserved_bytes < wholes[False].at(batch).reserved_bytes:
            assert guesses[True].at(batch).reserved_bytes < guesses[False].at(batch).reserved_bytes, batch
    for checkpointing, guess in guesses.items():  # and both stay near the whole trace
        whole = wholes[checkpointing]
        assert guess.at(1).reserved_bytes == pytest.approx(whole.at(1).reserved_bytes, rel=0.08), checkpointing
        assert guess.estimate.peak_reserved_bytes >= guess.estimate.peak_allocated_bytes


def _ramp(levels: list[tuple[Phase, list[int]]]) -> list[Any]:
    """A synthetic timeline: per phase, activations at each event (parameters fixed at 100 bytes)."""
    from memfit.simulation.replay import TimelinePoint

    points, event = [], 0
    for phase, values in levels:
        for value in values:
            sizes = tuple(100 if c is Category.PARAMETERS else value if c is Category.ACTIVATIONS else 0
                          for c in Category)  # fmt: skip
            points.append(TimelinePoint(event, 1, phase, sizes, sum(sizes) + 7))
            event += 1
    return points


@pytest.mark.parametrize("where", ["start", "end"])
def test_timeline_extrapolation_keeps_peaks_at_the_phase_edges(where: str) -> None:
    from memfit.simulation.replay import extrapolate_timeline

    def phase(blocks: int) -> list[int]:  # each block adds 10 bytes; the peak is the first or last event
        up = [10 * i for i in range(1, blocks + 1)]
        return up if where == "end" else up[::-1]

    shallow = _ramp([(Phase.FORWARD, phase(2)), (Phase.BACKWARD, [5, 1])])
    deeper = _ramp([(Phase.FORWARD, phase(4)), (Phase.BACKWARD, [5, 1])])
    out = extrapolate_timeline(shallow, deeper, 3.0)  # 2 + 3 x 2 = 8 blocks
    forward = [p for p in out if p.phase is Phase.FORWARD]
    assert len(forward) == 8 and out[-1].phase is Phase.BACKWARD
    activations = [p.category_bytes[list(Category).index(Category.ACTIVATIONS)] for p in forward]
    assert max(activations) == 80 and activations[-1 if where == "end" else 0] == 80
    assert all(p.reserved_bytes >= sum(p.category_bytes) for p in out)
    assert extrapolate_timeline(shallow, deeper[:4], 3.0) == tuple(deeper[:4])  # other phases: left as traced


FACTORIES = '''
import torch


class Summed(torch.nn.Module):
    """A model whose forward returns its loss, as the CLI needs without loss_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).pow(2).mean()


def build():
    return Summed(), lambda batch_size: torch.zeros(batch_size, 8)


def raises():
    raise RuntimeError("no checkpoint at /data/run7")


def needs(width, depth=2):
    return Summed()


def three():
    return Summed(), None, None


def bare_linear():
    return torch.nn.Linear(8, 8)  # called with input_ids=...: the trace advises forward_fn=


not_callable = 42
'''


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI on bad input: exit code 2, nothing on stdout, one line on stderr and no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("memfit: error: ") and "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("factory", "fragments"),
    [
        ("raises", ["memfit_cli_factories:raises", "RuntimeError", "no checkpoint at /data/run7"]),
        ("needs", ["memfit_cli_factories:needs", "width", "no arguments"]),
        ("three", ["memfit_cli_factories:three", "3 items", "(module, sample)"]),
        ("not_callable", ["memfit_cli_factories:not_callable", "int", "not a function"]),
        ("bare_linear", ["forward_fn", "--model", "(module, sample)"]),
    ],
)
def test_a_factory_that_fails_is_one_line(
    factory: str, fragments: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "memfit_cli_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _one_line_error(capsys, ["plan", "--model", f"memfit_cli_factories:{factory}", "--budget", "1GiB"])
    for fragment in fragments:
        assert fragment in line


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (["--target-batch-size", "-4"], ["--target-batch-size", "'-4'", "max"]),
        (["--target-batch-size", "0"], ["--target-batch-size", "'0'"]),
        (["--seq-len", "-5"], ["--seq-len", "'-5'", "positive"]),
        (["--seq-len", "many"], ["--seq-len", "'many'"]),
        (["--layers", "0"], ["--layers", "'0'", "positive"]),
        (["--image-size", "-3"], ["--image-size", "'-3'"]),
        (["--world-size", "0"], ["--world-size", "'0'"]),
        (["--num-workers", "-1"], ["--num-workers", "'-1'"]),
        (["--prefetch-factor", "0"], ["--prefetch-factor", "'0'"]),
        (["--margin", "2"], ["--margin", "'2'"]),
    ],
)
def test_bad_plan_options_are_one_line(
    options: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(capsys, ["plan", "--hf-config", "gpt2", "--budget", "1GiB", *options])
    assert "_target" not in line  # the message names the option, not the parsing function
    for fragment in fragments:
        assert fragment in line


def test_a_bad_config_json_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    malformed = tmp_path / "config.json"
    malformed.write_text('{"model_type": "gpt2", "n_layer": 2,}')
    line = _one_line_error(capsys, ["plan", "--hf-config", str(malformed), "--budget", "1GiB"])
    assert str(malformed) in line and "line 1 column" in line

    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "lama", "hidden_size": 64}')
    line = _one_line_error(capsys, ["plan", "--hf-config", str(unknown), "--budget", "1GiB"])
    assert str(unknown) in line and "'lama'" in line and "llama" in line  # the close match, not ~600 types
    assert len(line) < 400

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    line = _one_line_error(capsys, ["plan", "--hf-config", str(listed), "--budget", "1GiB"])
    assert str(listed) in line and "model_type" in line


def test_a_preset_name_close_to_a_known_one_is_suggested(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["plan", "--hf-config", "llama3-8b", "--budget", "1GiB"])
    assert "did you mean 'llama-3-8b'?" in line and "never downloads" in line
    line = _one_line_error(capsys, ["plan", "--hf-config", "no-such-model", "--budget", "1GiB"])
    assert "did you mean" not in line


@pytest.mark.parametrize(("precision", "advised"), [("bf16-true", False), ("bf16-mixed", True)])
def test_lower_precision_is_advised_only_to_a_run_whose_weights_are_not_16_bit_already(
    precision: str, advised: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "512", "--budget", "1GiB", "--precision",
            precision, "--json"]  # fmt: skip
    assert main(argv) == 1
    (row,) = json.loads(capsys.readouterr().out)["gpus"]
    assert "does not fit" in row["error"] and ("lower precision" in row["error"]) is advised


def test_a_config_json_without_its_sizes_warns_naming_the_defaults_used(tmp_path: Path) -> None:
    given = {k: v for k, v in LLAMA.items() if k not in ("hidden_size", "intermediate_size")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(given))
    with pytest.warns(UserWarning, match=r"gives no hidden_size, intermediate_size: .*LlamaConfig defaults were "
                      r"used \(hidden_size 4096, intermediate_size 11008\)"):  # fmt: skip
        from_hf_config(str(path), seq_len=16)
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(LLAMA))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_hf_config(str(whole), seq_len=16)


def test_the_command_line_says_its_warnings_in_one_line_and_a_configs_clash_as_the_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unsized = tmp_path / "unsized.json"
    unsized.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "intermediate_size"}))
    assert main(["plan", "--hf-config", str(unsized), "--budget", "4GiB", "--seq-len", "16"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "gives no" in line]
    assert warned == [f"memfit: warning: {unsized} gives no intermediate_size: transformers' LlamaConfig defaults "
                      "were used (intermediate_size 11008); write the model's own sizes in the file"]  # fmt: skip

    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps({**LLAMA, "num_key_value_heads": 3}))  # 4 heads cannot share 3 key-value heads
    line = _one_line_error(capsys, ["plan", "--hf-config", str(clash), "--budget", "4GiB", "--seq-len", "16"])
    assert "check that the config's sizes agree with one another" in line
    assert "forward_fn" not in line and "sample matches" not in line  # a library argument the command line lacks


def test_the_console_script_imports_a_factory_from_the_current_directory(tmp_path: Path) -> None:
    script = shutil.which("memfit", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the memfit console script is not installed next to this Python")
    (tmp_path / "mymod.py").write_text(FACTORIES)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    result = subprocess.run(
        [script, "plan", "--model", "mymod:build", "--budget", "1GiB", "--target-batch-size", "4", "--json"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["gpus"]
    assert row["fits"] and row["effective_batch_size"] == 4


def test_the_title_counts_parameters_as_people_do_and_names_a_sequence_only_when_there_is_one() -> None:
    small = PlanReport("cnn", 77_310, "bf16-mixed", "adamw", None, ())
    large = PlanReport("llama", 8_030_261_248, "bf16-mixed", "adamw", 2048, ())
    assert plan_table(small).title == "cnn: 77.3K parameters, bf16-mixed, optimizer adamw"
    assert plan_table(large).title == "llama: 8.03B parameters, bf16-mixed, optimizer adamw, seq 2048"


def test_a_config_saved_in_bf16_is_planned_in_the_precision_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Published configs carry "torch_dtype": "bfloat16"; bf16-mixed still means fp32 weights and fp32 Adam state."""
    plain, saved_in_bf16 = tmp_path / "plain.json", tmp_path / "bf16.json"
    plain.write_text(json.dumps(LLAMA))
    saved_in_bf16.write_text(json.dumps({**LLAMA, "torch_dtype": "bfloat16"}))
    one = ["--seq-len", "64", "--target-batch-size", "1", "--budget", "4GiB", "--precision", "bf16-mixed"]
    (reference,) = _plan_json(capsys, "--hf-config", str(plain), *one)["gpus"]
    report = _plan_json(capsys, "--hf-config", str(saved_in_bf16), *one)
    (row,) = report["gpus"]
    assert row["breakdown_bytes"] == reference["breakdown_bytes"]
    assert row["breakdown_bytes"]["parameters"] >= 4 * report["parameters"]


def test_a_request_no_card_can_run_is_an_error_exit(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64", "--target-batch-size", "8"]
    assert main([*small, "--gpu", "t4", "--precision", "bf16-mixed", "--json"]) == 2
    captured = capsys.readouterr()
    (row,) = json.loads(captured.out)["gpus"]
    assert row["refused"] and not row["fits"]
    assert captured.err.count("\n") == 1 and "no bf16" in captured.err


def test_a_sweep_of_sequence_lengths_plans_each_from_one_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.prediction.exact import clear_sessions, kept_sessions

    command = ["plan", "--hf-config", "gpt2", "--layers", "2", "--budget", "4GiB", "--json"]
    clear_sessions()
    assert main([*command, "--seq-len", "64,128,256"]) == 0
    swept = json.loads(capsys.readouterr().out)
    # the batch-only trace for the first length, and one with the length symbolic too for the others
    sessions = kept_sessions()
    assert sum(len(s.symbolic) for s in sessions) == 1 and sum(s.with_length is not None for s in sessions) == 1
    assert [row.get("seq_len") for row in swept["gpus"]] == [None, 128, 256] and swept["seq_len"] == 64
    for row in swept["gpus"]:
        clear_sessions()
        assert main([*command, "--seq-len", str(row.get("seq_len") or 64)]) == 0
        (alone,) = json.loads(capsys.readouterr().out)["gpus"]
        for key in ("fits", "micro_batch_size", "gradient_checkpointing", "predicted_peak_bytes",
                    "predicted_reserved_bytes", "breakdown_bytes"):  # fmt: skip
            assert row[key] == alone[key], (row.get("seq_len"), key)
    assert swept["gpus"][0]["micro_batch_size"] > swept["gpus"][2]["micro_batch_size"]


@pytest.mark.parametrize(
    ("lengths", "extra", "message"),
    [
        ("512,512", [], "each sequence length once"),
        ("512,0", [], "must be a positive whole number"),
        ("512,1024", ["--gpus", "8", "--strategy", "fsdp"], "several --seq-len values are planned on one GPU"),
    ],
)
def test_a_bad_sweep_is_refused_in_one_line(
    lengths: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plan", "--hf-config", "gpt2", "--gpu", "h100", "--seq-len", lengths, *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_sweep_says_a_gpus_note_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A T4 planned at two lengths is planned in 16-mixed at both; its caption says so once."""
    assert main(["plan", "--hf-config", "gpt2", "--layers", "1", "--gpu", "t4", "--seq-len", "64,128"]) == 0
    assert capsys.readouterr().out.count("Turing cards have no bf16") == 1


def test_a_sweep_says_which_length_a_rows_note_is_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that one length splits exactly and the other does not: the note names the row, GPU and length."""
    monkeypatch.setenv("MEMFIT_CACHE", "on")  # the text answer from the JSON answer's kept traces
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    command = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "64,1024", "--budget", "4GiB"]
    assert main([*command, "--target-batch-size", "13", "--json"]) == 0
    rows = {row.get("seq_len") or 64: row for row in json.loads(capsys.readouterr().out)["gpus"]}
    off = [length for length, row in rows.items() if row["effective_batch_size"] != 13]
    assert off and len(off) < len(rows)  # one length keeps 13 exactly, the other cannot
    assert main([*command, "--target-batch-size", "13"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"budget 4GiB at seq {off[0]}: micro batch" in said
    assert all(f"budget 4GiB at seq {length}: micro batch" not in said for length in rows if length not in off)


_BART = {"model_type": "bart", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
         "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 128,
         "max_position_embeddings": 64}  # fmt: skip
_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "vocab_size": 128}  # fmt: skip


# BART has a causal LM of its decoder alone too: the config describes the encoder-decoder
@pytest.mark.parametrize(("config", "head"), [(_BART, "BartForConditionalGeneration"), (_LLAMA, "LlamaForCausalLM")])
def test_a_config_is_built_with_the_head_of_the_model_it_describes(tmp_path: Path, config: dict, head: str) -> None:
    from memfit.presets import from_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert type(from_hf_config(str(path), seq_len=16).model).__name__ == head


def test_a_config_without_a_head_memfit_builds_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whisper is an encoder-decoder of audio features: its causal LM is its decoder alone, so memfit builds
    nothing for it from a config, and says how to plan it instead."""
    path = tmp_path / "config.json"
    whisper = {"model_type": "whisper", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 128}  # fmt: skip
    path.write_text(json.dumps(whisper))
    assert main(["plan", "--hf-config", str(path), "--gpu", "h100"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1
    assert "head for WhisperConfig" in said and "plan it with --model module:factory" in said


def test_a_config_that_lacks_a_key_its_model_reads_is_told_to_add_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A T5 config without ``decoder_start_token_id``: the model's code reads it to shift the labels, and the
    answer names the key to add, not the sizes."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5", "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 1,
                                "num_heads": 2, "vocab_size": 128}))  # fmt: skip
    assert main(["plan", "--hf-config", str(path), "--gpu", "h100", "--seq-len", "16"]) == 2
    said = capsys.readouterr().err
    assert "add `decoder_start_token_id` to the config.json" in said and "sizes agree" not in said


def test_an_8_bit_optimizer_is_planned_without_bitsandbytes_advice_on_this_machine() -> None:
    """bitsandbytes' CPU backend logs advice about its optional CPU kernels when imported; the command line's
    answer for an 8-bit optimizer prints nothing but the answer (a fresh process: the import is once a process)."""
    pytest.importorskip("bitsandbytes")
    argv = ["plan", "--hf-config", "gpt2", "--layers", "1", "--seq-len", "32", "--gpu", "t4", "--optimizer",
            "adam-8bit", "--json"]  # fmt: skip
    env = {**os.environ, "MEMFIT_CACHE": "off"}
    done = subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=600,
                          env=env, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout)["gpus"][0]["fits"] is True
