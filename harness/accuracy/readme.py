"""The accuracy figures of the docs, rendered from the committed result files and nothing else.

    python -m harness.accuracy.readme            # print the generated blocks
    python -m harness.accuracy.readme --write    # rewrite them in docs/accuracy.md and README.md
    python -m harness.accuracy.readme --check    # exit 1 if either differs (the test suite runs it)

Each block stands between ``<!-- results: NAME -->`` and ``<!-- end results: NAME -->`` and is replaced
whole: the result tables in docs/accuracy.md, and the two-line accuracy status in README.md. A
result file that does not exist yet (the GPU ones, until a GPU run is committed) renders as a line
that says so and names the command that measures it; after ``bash benchmarks/gpu_checks.sh ...`` on a
GPU, ``--write`` puts its tables in.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.accuracy.largest_batch import chosen_cell, true_max_cell
from harness.accuracy.run import process_nvml_bytes
from memfit import format_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOC = ROOT / "docs" / "accuracy.md"
_METHOD_NAMES = {
    "memfit": "memfit",
    "lightning_binsearch": "BatchSizeFinder binsearch",
    "lightning_power": "BatchSizeFinder power",
    "hf_auto_find": "HF auto_find_batch_size",
}


def _load(name: str, results: Path) -> dict[str, Any] | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def _pct(value: float | None, signed: bool = False, digits: int = 2) -> str:
    if value is None:
        return "-"
    value = 0.0 if round(value, digits) == 0 else value  # no "-0.00"
    return f"{value:+.{digits}f} %" if signed else f"{value:.{digits}f} %"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    aligns = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(line) + " |" for line in [header, aligns, *rows]]


def _source(name: str, meta: dict[str, Any]) -> str:
    facts = [meta.get("device"), f"torch {meta['torch']}" if meta.get("torch") else None, meta.get("date")]
    return f"`benchmarks/results/{name}`; " + ", ".join(fact for fact in facts if fact)


# --------------------------------------------------------------------------- the zoo, predicted vs measured


def _error_stats(rows: list[dict[str, Any]], key: str) -> tuple[str, str]:
    errors = [abs(row[key]) for row in rows if row.get(key) is not None]
    if not errors:
        return "-", "-"
    return _pct(statistics.median(errors), digits=3), _pct(max(errors), digits=3)


def gpu_accuracy(results: Path) -> list[str]:
    data = _load("accuracy-gpu.json", results)
    if data is None:
        return [
            "**GPU: still to be measured.** `bash benchmarks/gpu_checks.sh accuracy` (that is, "
            "`python -m harness.accuracy.run --gpu`) runs the zoo below on a CUDA GPU: predicted vs "
            "measured `max_memory_allocated` / `max_memory_reserved` and NVML's used memory, in a fresh "
            "process per configuration. No GPU figure is published before its result file is committed."
        ]
    rows = data["rows"]
    families = list(dict.fromkeys(row["config"].split()[0] for row in rows))  # in the zoo's order
    table = []
    for family in [*families, None]:
        group = [row for row in rows if family is None or row["config"].split()[0] == family]
        measured = [row for row in group if row.get("measured_peak_reserved_bytes") is not None]
        cells = [
            *_error_stats(measured, "allocated_error_pct"),
            *_error_stats(measured, "reserved_error_pct"),
            *_error_stats(measured, "nvml_error_pct"),
        ]
        failed = len(group) - len(measured)
        name = "**all**" if family is None else family
        table.append([name, f"{len(measured)}" + (f" ({failed} not measured)" if failed else ""), *cells])
    header = ["family", "runs", "allocated: median", "max", "reserved: median", "max", "NVML: median", "max"]
    return [
        f"**GPU** (`python -m harness.accuracy.run --gpu`, {_source('accuracy-gpu.json', data['meta'])}): "
        "absolute error of the predicted peak against the measured one, per model family, each "
        "configuration in a fresh process (three real steps); NVML compares the predicted total "
        "(reserved, CUDA context and workspaces) with the device's used memory"
        + (f" ({data['meta']['nvml_note']})." if data["meta"].get("nvml_note") else "."),
        "",
        *_table(header, table),
    ]


def _relative(predicted: int | None, measured: int | None) -> float | None:
    return None if predicted is None or not measured else 100.0 * (predicted - measured) / measured


def trace_zoo_gpu(results: Path) -> list[str]:
    data = _load("trace_zoo-gpu.json", results)
    if data is None:
        return [
            "**Larger single configurations, GPU: still to be measured.** `bash benchmarks/gpu_checks.sh trace_zoo` "
            "(that is, `python benchmarks/trace_zoo.py --measure`): GPT-2 124M at sequence 1024, a 1B Llama and "
            "others, predicted and then trained for three real steps in a fresh process."
        ]
    rows = []
    for row in data["rows"]:
        if row.get("measured_peak_reserved_bytes") is None:
            rows.append([row["config"], format_bytes(row["predicted_peak_reserved_bytes"]), "failed", "-", "-", "-"])
            continue
        rows.append(
            [
                row["config"],
                format_bytes(row["predicted_peak_reserved_bytes"]),
                format_bytes(row["measured_peak_reserved_bytes"]),
                _pct(_relative(row["predicted_peak_allocated_bytes"], row["measured_peak_allocated_bytes"]), True),
                _pct(_relative(row["predicted_peak_reserved_bytes"], row["measured_peak_reserved_bytes"]), True),
                _pct(_relative(row["predicted_peak_bytes"], process_nvml_bytes(row)), True),
            ]
        )
    return [
        f"**Larger single configurations, GPU** (`python benchmarks/trace_zoo.py --measure`, "
        f"{_source('trace_zoo-gpu.json', data['meta'])}): predicted vs measured after three real steps in a "
        "fresh process; error = (predicted - measured) / measured.",
        "",
        *_table(
            [
                "configuration",
                "predicted reserved",
                "measured reserved",
                "allocated error",
                "reserved error",
                "device (NVML) error",
            ],
            rows,
        ),
    ]


def cpu_accuracy(results: Path) -> list[str]:
    data = _load("accuracy-cpu.json", results)
    if data is None:
        return ["**CPU: not measured yet.** `python -m harness.accuracy.run`."]
    summary = data["summary"]
    activations, peaks = summary["activation_error_pct"], summary["peak_error_pct"]
    ratio = summary["estimate_to_step_time_ratio"]
    configs = len({row["config"] for row in data["rows"]})  # a configuration's name holds its first batch size
    return [
        f"**CPU** (`python -m harness.accuracy.run`, {_source('accuracy-cpu.json', data['meta'])}): "
        f"{configs} configurations, each at two batch sizes, traced for a CPU target and compared with "
        "independent counts on real CPU tensors:",
        "",
        *_table(
            ["check", "runs", "median abs. error", "max abs. error"],
            [
                [
                    "activations kept for backward vs bytes autograd saves (`saved_tensors_hooks`, deduplicated by "
                    "storage; runs without checkpointing)",
                    str(activations["n"]),
                    _pct(activations["median_abs"], digits=3),
                    _pct(activations["max_abs"], digits=3),
                ],
                [
                    "traced peak vs PyTorch's `MemTracker` over two real steps (not the LoRA rows: MemTracker fails "
                    "on frozen parameters)",
                    str(peaks["n"]),
                    _pct(peaks["median_abs"], digits=3),
                    _pct(peaks["max_abs"], digits=3),
                ],
            ],
        ),
        "",
        f"One estimate (two traced steps at two batch sizes) takes as long as {ratio['median']} real CPU "
        f"training steps of the same tiny configuration at the median ({ratio['min']} to {ratio['max']}; "
        "`estimate_to_step_time_ratio`, timed in the same run): tracing costs per operation, not per byte, "
        "so it is dear next to a tiny model's step and cheap next to a large one's.",
        "",
        "Largest peak error against `MemTracker`, per family: " + _worst_per_family(data["rows"]) + ".",
    ]


def quantized_cpu(results: Path) -> list[str]:
    """bitsandbytes-quantized LoRA steps on the CPU (``benchmarks/quantized_accuracy.py``): the traced step's peak
    beyond the weights against the CPU allocator's."""
    data = _load("quantized-cpu.json", results)
    if data is None:
        return ["**Quantized LoRA on CPU: not measured yet.** `python benchmarks/quantized_accuracy.py`."]
    meta = data["meta"]
    rows = [
        [
            row["config"],
            format_bytes(row["predicted_step_peak_bytes"]),
            format_bytes(row["measured_step_peak_bytes"]),
            f"{row['predicted_step_peak_bytes'] - row['measured_step_peak_bytes']:+d} B "
            f"({_pct(row['step_error_pct'], True, digits=4)})",
        ]
        for row in data["rows"]
    ]
    packages = ", ".join(f"{name} {version}" for name, version in meta.get("packages", {}).items())
    return [
        f"**bitsandbytes quantization with LoRA, CPU** (`python benchmarks/quantized_accuracy.py`, "
        f"{_source('quantized-cpu.json', meta)}; {packages}): {meta['model']}, batch {meta['batch']} x sequence "
        f"{meta['sequence']}, loaded with a `BitsAndBytesConfig` (`+ kbit`: through peft's "
        "`prepare_model_for_kbit_training`); two AdamW steps of the adapters traced for a CPU target, against the "
        "peak the CPU allocator reports to `torch.profiler` over the same two real steps. Both are the step's peak "
        "beyond the weights, which exist before the measurement; error = predicted - measured.",
        "",
        *_table(["configuration", "predicted", "measured", "error"], rows),
    ]


def _worst_per_family(rows: list[dict[str, Any]]) -> str:
    worst: dict[str, float] = {}
    for row in rows:
        error = row.get("peak_error_pct")
        family = row["config"].split()[0]
        if error is not None and abs(error) >= abs(worst.get(family, 0.0)):
            worst[family] = error
    return ", ".join(f"{family} {_pct(error, True, digits=2)}" for family, error in worst.items())


# --------------------------------------------------------------------------- the loop around the step


def training_loops(results: Path, device: str) -> list[str]:
    name = f"training_loop-{device}.json"
    data = _load(name, results)
    if data is None:
        return [
            f"**Training loops, {device.upper()}: still to be measured.** `bash benchmarks/gpu_checks.sh loops` "
            "(that is, `python -m harness.accuracy.loops --gpu`)."
        ]
    within = max(abs(row["predicted_peak_bytes"] - row["measured_peak_bytes"]) for row in data["rows"])
    table = [
        [
            row["loop"],
            format_bytes(row["measured_peak_bytes"]),
            f"{row['predicted_peak_bytes'] - row['measured_peak_bytes']:+d} B",
            _pct(row["loop_blind_error_pct"], True),
        ]
        for row in data["rows"]
    ]
    meta = {"device": data.get("device"), "torch": data.get("torch"), "date": data.get("date")}
    return [
        f"**Training loops, {device.upper()}** (`python -m harness.accuracy.loops"
        f"{' --gpu' if device == 'gpu' else ''}`, {_source(name, meta)}; peaks measured by "
        f"{data['measured_with']}): {len(data['rows'])} loops, memfit within {within} bytes of every measured peak.",
        "",
        *_table(["loop", "measured peak", "memfit - measured", "a trace blind to the loop"], table),
    ]


# --------------------------------------------------------------------------- the largest micro batch


def largest_batch(results: Path) -> list[str]:
    data = _load("largest_batch-gpu.json", results)
    if data is None:
        return [
            '**Largest batch: still to be measured (GPU).** `FAMILIES="gpt2 llama" bash benchmarks/gpu_checks.sh '
            "largest_batch` (that is, `python -m harness.accuracy.largest_batch --only gpt2 --only llama`) "
            "finds, per model family, the true largest micro batch on the card by bisection with real steps "
            "in fresh processes, and compares it with memfit's plan (goal: at least 95 % of it, never above), "
            "with Lightning's `BatchSizeFinder` (`binsearch` and `power`) and with HF's `auto_find_batch_size`: "
            "the batch each picks, the seconds each takes to decide, and whether the batch then survives 50 "
            "steps (details in `harness/accuracy/README.md`). Without a GPU, `--simulate-max-batch N` "
            "checks the harness itself on CPU against a card that fails above N samples; the test suite runs that."
        ]
    return [*_whole_card(data), *_whole_card_now(results), *_capped(results)]


def _whole_card_now(results: Path) -> list[str]:
    """memfit alone on a whole card, with the planner as it is now: its limit, its choice and the check run's peak."""
    folder = "gpu-truth/h200-2026-11-27-whole-card"
    data = _load(f"{folder}/largest_batch-whole-card.json", results)
    if data is None:
        return []
    rows = []
    for row in data["rows"]:
        memfit = row["memfit"]
        log = results / folder / f"check-whole-{row['family']}.log"
        check = json.loads(log.read_text().splitlines()[-1]) if log.exists() else {}
        measured = (
            f"{format_bytes(check['peak_reserved_bytes'])}, {check['steps']} steps, {check['alloc_retries']} retries"
            if check.get("ok")
            else "**OOM**"
            if check
            else "-"
        )
        rows.append([
            row["family"], true_max_cell(row), str(memfit["predicted_limit"]),
            f"{memfit['batch_size']} ({100 * memfit['fraction_of_true_max']:.0f} %)",
            format_bytes(memfit["predicted_peak_bytes"]), measured,
        ])  # fmt: skip
    header = ["family", "true max", "memfit's predicted limit", "memfit (default margin)", "predicted peak reserved",
              "check run: measured peak reserved"]  # fmt: skip
    return [
        "",
        f"**The whole card with the planner as it is now** (`--methods memfit`, `benchmarks/results/{folder}/`; "
        f"{data['meta']['device']}; bf16-mixed adamw; memfit planned for the memory free after CUDA started, as "
        "the callbacks do; 3-step probes, then a check run at memfit's choice; the finders were not run):",
        "",
        *_table(header, rows),
    ]


def _capped(results: Path) -> list[str]:
    """The boundary with the allocator capped (``--cap-gib``), rebuilt from a run's trial logs (``--from-logs``)."""
    name = "gpu-truth/h100-2026-11-27/largest_batch-capped.json"
    data = _load(name, results)
    if data is None:
        return []
    meta = data["meta"]
    rows = [
        [row["family"], true_max_cell(row), *(chosen_cell(row[method], oom=", **OOM**") for method in _METHOD_NAMES)]
        for row in data["rows"]
    ]
    starts = {row["family"]: row["hf_auto_find"].get("start") for row in data["rows"]}
    ends = sorted({start for start in starts.values() if start})
    others = [f"{' and '.join(sorted(f for f, s in starts.items() if s == start))}: {start}" for start in ends[:-1]]
    start_note = (
        f" HF's `auto_find_batch_size` started from `per_device_train_batch_size` {ends[-1]}"
        f"{f' ({chr(59).join(others)})' if others else ''}; it multiplies the batch by 0.9 after each "
        "out-of-memory error."
        if ends
        else ""
    )
    return [
        "",
        f"**With the allocator capped at 12 GiB** (`--cap-gib 12`, `benchmarks/results/{name}`, rebuilt from the "
        f"run's trial logs; {meta['device']}; bf16-mixed adamw; {meta['steps']}-step probes, "
        f"{meta['check_steps']}-step check runs; *cut short*: the run's deadline ended the trial first), memfit at "
        f"its current margin.{start_note}",
        "",
        *_table(["family", "true max", *_METHOD_NAMES.values()], rows),
    ]


def _whole_card(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    rows = [
        [row["family"], true_max_cell(row), *(chosen_cell(row[method], oom=", **OOM**") for method in _METHOD_NAMES)]
        for row in data["rows"]
    ]
    summary = [_method_summary(method, figures) for method, figures in data["summary"].items()]
    return [
        f"**Largest batch** (`python -m harness.accuracy.largest_batch`, "
        f"{_source('largest_batch-gpu.json', meta)}; {_training(data['rows'])}): the batch each method picks "
        f"(its share of the true maximum, found by bisection with {meta['steps']} real steps per probe in fresh "
        f"processes), the seconds it takes to decide, and **OOM** where that batch then fails a "
        f"{meta['check_steps']}-step run.",
        "",
        *_table(["family", "true max", *_METHOD_NAMES.values()], rows),
        "",
        *_table(_SUMMARY_HEADER, summary),
    ]


_SUMMARY_HEADER = [
    "method",
    "families",
    "median share",
    "lowest share",
    "above the max",
    "OOM in the check",
    "seconds vs memfit (median)",
]


def _method_summary(method: str, figures: dict[str, Any]) -> list[str]:
    def share(value: float | None) -> str:
        return "-" if value is None else _pct(100 * value, digits=0)

    ratio = figures["median_seconds_vs_memfit"]
    return [
        _METHOD_NAMES[method],
        str(figures["families"]),
        share(figures["median_share"]),
        share(figures["lowest_share"]),
        str(figures["above_true_max"]),
        str(figures["out_of_memory_in_check"]),
        "1x" if method == "memfit" else "-" if ratio is None else f"{ratio}x",
    ]


def _training(rows: list[dict[str, Any]]) -> str:
    """The precision and optimizer the rows trained with, as one phrase."""
    return ", ".join(sorted({f"{row['precision']} {row['optimizer']}" for row in rows}))


# --------------------------------------------------------------------------- speed


def speed(results: Path) -> list[str]:
    data = _load("speed.json", results)
    if data is None:
        return ["**Speed: not measured yet.** `python benchmarks/speed.py`."]
    meta = data["meta"]
    rows = []
    for row in data["rows"]:
        seconds = f"{row['cold_seconds']:.2f}"
        if "warm_seconds" in row:
            seconds += f" (then {row['warm_seconds']:.2f} in the same process)"
        if "rows_scan_seconds" in row:
            seconds += f" (reading the rows: {row['rows_scan_seconds']:.2f})"
        rows.append(
            [
                f"`{row['case']}`" if row["case"].startswith("memfit ") else row["case"],
                seconds,
                format_bytes(row.get("max_rss_bytes")),
            ]
        )
    return [
        f"**Speed** (`python benchmarks/speed.py`, `benchmarks/results/speed.json`; {meta['cpu_count']}-core CPU, "
        f"no GPU, torch {meta['torch']}, {meta['date']}; one run, and timings here vary by a few tenths of a "
        "second between runs):",
        "",
        *_table(["case", "seconds", "process peak (RSS)"], rows),
    ]


def performance(results: Path) -> list[str]:
    """README's lines on speed, from ``benchmarks/symbolic_speed.py``'s result file."""
    data = _load("symbolic_speed.json", results)
    if data is None:
        return ["- **Speed: not measured yet.** `python benchmarks/symbolic_speed.py`."]
    cases = {row["case"]: row for row in data["cases"] if "plan_s" in row}
    names = {"gpt2-124m": "GPT-2 124M (seq 1024)", "bert-base": "BERT-base (seq 512)",
             "resnet50": "a ResNet-50 (224 x 224)"}  # fmt: skip
    plans = [
        f"{names[case]} {row['plan_s']:.1f} s ({row['ratio']:.1f} x one concrete trace of its step, "
        f"{row['concrete_trace_s']:.1f} s)"
        for case, row in cases.items()
        if case in names
    ]
    lines = [
        f"- **Planning** (`python benchmarks/symbolic_speed.py`, `benchmarks/results/symbolic_speed.json`; "
        f"{data['machine']}, torch {data['torch']}): a whole plan for an 80 GiB H100 from a model in hand, as the "
        f"callbacks make it (one symbolic trace, then allocator replays): {'; '.join(plans)}."
    ]
    llama = cases.get("llama-3-8b")
    if llama is not None:
        lines.append(
            f"- `memfit plan --hf-config llama-3-8b --gpu h100 --seq-len 2048` (its 32 blocks' log built from traces "
            f"at 3 and 4 blocks): {llama['plan_s']:.1f} s, against {llama['plan_concrete_s']:.1f} s on concrete "
            f"traces; importing the command line {data['imports']['memfit.cli.main_s']:.1f} s, and transformers "
            f"{data['imports']['transformers_s']:.1f} s where a preset needs it."
        )
    return lines + answer_speed(results)


def answer_speed(results: Path) -> list[str]:
    """README's lines on the common questions asked first and again, from ``benchmarks/answer_speed.py``."""
    data = _load("answer_speed.json", results)
    if data is None:
        return ["- **Questions asked again: not measured yet.** `python benchmarks/answer_speed.py`."]
    unit = data["meta"]["unit"].get("unit_s")

    def timed(row: dict[str, Any], key: str) -> str:
        if key not in row:
            return "-"
        return f"{row[key]:.1f} s ({row[key] / unit:.1f})" if unit else f"{row[key]:.1f} s"

    rows = [
        [
            f"`{row['command']}`",
            timed(row, "cold_s"),
            timed(row, "again_s"),
            timed(row, "traces_s"),
            timed(row, "neighbour_s"),
            f"{row['goal_s']:.0f} s",
            "yes" if row["same_answer"] else "**no**",
        ]
        for row in data["questions"]
    ]
    lines = [
        "- **Questions, first and again** (`python benchmarks/answer_speed.py`, "
        f"`benchmarks/results/answer_speed.json`; {data['meta']['cpu_count']} cores, torch {data['meta']['torch']}; "
        "each a fresh process, imports included; one concrete GPT-2 124M trace, the unit, took "
        f"{unit} s in the same run). *First* traces (the caches off), *again* prints the same question's kept "
        "answer, *from traces* answers it again with only its traces kept, *neighbour* a neighbouring question "
        "from the same cache (a target batch, or a card of the same kind); in brackets, the same in units (the "
        "machine's speed changes from day to day, the units much less):",
        "",
        *_table(["question", "first", "again", "from traces", "neighbour", "goal", "same answer"], rows),
    ]
    lines += _speed_before(data, results)
    callbacks = [row for row in data["callbacks"] if "setup_cold_s" in row]
    if callbacks:
        lines += [
            "",
            "- **A run's planning at its start** (a 4-layer GPT-2 on CPU): "
            + "; ".join(
                f"{row['framework']} {row['setup_cold_s']:.1f} s, started again {row['setup_again_s']:.1f} s"
                for row in callbacks
            )
            + " (a LightningModule defined in the training script is outside any installed package, so its traces "
            "are never kept).",
        ]
    return lines


def _speed_before(data: dict[str, Any], results: Path) -> list[str]:
    """A line on what the lean transformers import buys, from its side-by-side runs (``model_build_imports.py``)."""
    lean = _load("model_build_imports.json", results)
    if lean is None:
        return []
    parts = [f"{row['preset']} {row['plain_s']:.1f} -> {row['deferred_s']:.1f} -> {row['lean_s']:.1f} s"
             for row in lean["rows"]]  # fmt: skip
    return ["", "- **Building a preset's model** (`python benchmarks/model_build_imports.py`, "
            "`benchmarks/results/model_build_imports.json`; fresh processes, alternating, medians of "
            f"{lean['rows'][0]['runs']}): transformers imported as it imports itself, then without the scikit-learn "
            "and scipy its generation and losses load, then also without `@auto_docstring`'s docstrings, as the "
            "command line imports it: " + "; ".join(parts) + "."]  # fmt: skip


# --------------------------------------------------------------------------- depth extrapolation


def depth_extrapolation(results: Path) -> list[str]:
    data = _load("depth_extrapolation.json", results)
    if data is None:
        return ["**Deep models: not measured yet.** `python benchmarks/depth_extrapolation.py`."]

    def built(row: dict[str, Any]) -> str:
        if "built_largest_difference_bytes" not in row:
            return "-"
        return f"{row['built_largest_difference_bytes']:,} B"

    rows = [
        [
            row["model"],
            str(row["depth"]),
            "on" if row["checkpointing"] else "off",
            built(row),
            _pct(row["allocated_error_pct"], True, digits=3),
            _pct(row["reserved_error_pct"], True, digits=3),
            _pct(row["timeline_peak_error_pct"], True, digits=3),
            f"{row['exact_seconds']:.2f} / {row['built_seconds']:.2f} / {row['extrapolated_seconds']:.2f}"
            if "built_seconds" in row
            else f"{row['exact_seconds']:.2f} / - / {row['extrapolated_seconds']:.2f}",
        ]
        for row in data["rows"]
    ]
    settings = sorted({f"batch {row['batch']}" for row in data["rows"]})
    return [
        f"**Deep models from shallow traces** (`python benchmarks/depth_extrapolation.py`, "
        f"`benchmarks/results/depth_extrapolation.json`; {data['cpus']}-core CPU, torch {data['torch']}; sequence "
        f"{data['seq_len']}, {', '.join(settings)}, bf16-mixed AdamW), against a trace of the whole model. Built: the "
        "whole model's log built from traces at 3 and 4 blocks, its largest difference from the whole trace over "
        'the peaks (allocated, reserved, timeline) at the batch and `at()` at twice and four times it ("-": the log '
        "cannot be built, so `memfit plan` extrapolates). Extrapolated: the peak extrapolated from traces at 2 and 4 "
        "blocks, error = (extrapolated - whole) / whole. Seconds on this machine.",
        "",
        *_table(
            [
                "model",
                "blocks",
                "checkpointing",
                "built: largest difference",
                "extrapolated: allocated error",
                "reserved error",
                "timeline peak error",
                "seconds: whole / built / extrapolated",
            ],
            rows,
        ),
    ]


# --------------------------------------------------------------------------- README.md: the status in two lines


def status(results: Path) -> list[str]:
    """Two lines for the README: what is measured on CPU, and what on a GPU (or that it is still to be)."""
    cpu, loops = _load("accuracy-cpu.json", results), _load("training_loop-cpu.json", results)
    if cpu is None or loops is None:
        first = "**CPU:** not measured yet (`python -m harness.accuracy.run` and `python -m harness.accuracy.loops`)."
    else:
        peaks = cpu["summary"]["peak_error_pct"]
        within = max(abs(row["predicted_peak_bytes"] - row["measured_peak_bytes"]) for row in loops["rows"])
        first = (
            f"**CPU:** the traced peak is within {_pct(peaks['median_abs'], digits=3)} of PyTorch's `MemTracker` at "
            f"the median of {peaks['n']} runs ({_pct(peaks['max_abs'], digits=3)} at worst), and "
            f"{len(loops['rows'])} real training loops (Lightning, the HF Trainer, DDP, hand-written) peak within "
            f"{within} bytes of memfit's prediction."
        )
    truth = _load("gpu_truth-cpu.json", results)
    if truth is None:
        second = "**GPU:** still to be measured; no GPU figure is published before its result file is committed."
    else:
        device = " and ".join(dict.fromkeys(source["device"] for source in truth["meta"]["measured_on"].values()))
        without, native = truth["summary"]["without_gpu"], truth["summary"]["on_gpu_machine"]
        second = (
            f"**GPU** ({device}, {without['rows']} measured runs): the predicted `max_memory_reserved`, planned "
            f"**without the GPU** (the CLI on a laptop), is within {_pct(without['median_abs_pct'], digits=2)} of the "
            f"measured one at the median ({_pct(without['max_abs_pct'], digits=2)} at worst; "
            f"{without['within_goal']} of {without['rows']} runs within -2 % .. +5 % for both peaks); planned **on "
            f"the GPU** by memfit as it was on the day of each measurement, {_pct(native['median_abs_pct'], digits=2)} "
            f"at the median ({_pct(native['max_abs_pct'], digits=2)} at worst)."
        )
    return [f"- {first}", f"- {second} Every figure and how it is measured: [docs/accuracy.md](docs/accuracy.md)."]


def gpu_truth(results: Path) -> list[str]:
    """Every GPU-measured row, predicted without the GPU now and on the GPU machine when it was measured."""
    data = _load("gpu_truth-cpu.json", results)
    if data is None:
        return ["**GPU truth:** not predicted yet (`python benchmarks/gpu_truth.py`)."]
    meta, rows = data["meta"], data["rows"]
    sources = meta["measured_on"]
    first = next(iter(sources.values()))
    where = meta["predicted_on"]
    lines = [
        f"**Both paths against the same measurements** (`python benchmarks/gpu_truth.py`, "
        f"`benchmarks/results/gpu_truth-cpu.json`): {len(rows)} runs measured on an {first['device']} (torch "
        f"{first['torch']}, transformers {first['transformers']}, cuDNN {first['cudnn']}; "
        f"{', '.join(sorted({s['date'] for s in sources.values()}))}; fixtures and provenance in "
        f"`benchmarks/results/gpu-truth/`). *Without the GPU*: predicted on {where['machine']} (torch "
        f"{where['torch']}, transformers {where['transformers']}, {where['date']}), CUDA's kernels substituted. *On "
        f"the GPU machine*: memfit's prediction made there when the run was measured (native fake CUDA tensors, the "
        f"code of that day). Error = (predicted - measured) / measured; a row marked * misses the goal (-2 % .. +5 %) "
        f"for a reason `harness/accuracy/gpu_truth.py` names (KNOWN_GAPS).",
        "",
    ]
    table = []
    for row in rows:
        table.append([
            f"{row['config']}{' *' if row['known_gap'] else ''}",
            str(row["batch_size"]),
            format_bytes(row["measured_peak_reserved_bytes"]),
            _pct(row["reserved_error_pct"], signed=True),
            _pct(row["allocated_error_pct"], signed=True),
            _pct(row["gpu_reserved_error_pct"], signed=True),
            _pct(row["gpu_allocated_error_pct"], signed=True),
        ])  # fmt: skip
    header = ["run", "batch", "measured reserved", "without GPU: reserved", "allocated", "on GPU: reserved",
              "allocated"]  # fmt: skip
    lines += _table(header, table)
    lines.append("")
    for name, label in (("without_gpu", "Without the GPU"), ("on_gpu_machine", "On the GPU machine")):
        summary = data["summary"][name]
        lines.append(
            f"- {label}: reserved peak within {_pct(summary['median_abs_pct'])} at the median, "
            f"{_pct(summary['max_abs_pct'])} at worst; {summary['under_by_more_than_2_pct']} runs under by more than "
            f"2 %, {summary['under_by_more_than_5_pct']} by more than 5 %."
        )
    return lines


def lora_gpu(results: Path) -> list[str]:
    data = _load("lora-gpu.json", results)
    if data is None:
        return [
            "**LoRA and DoRA on a 3B Llama, GPU: still to be measured.** `python benchmarks/lora_gpu.py` (about "
            "60 GB of GPU memory): full fine-tuning and peft adapters, predicted vs measured."
        ]
    meta = data["meta"]
    rows = []
    for row in data["rows"]:
        measured = row.get("measured_peak_reserved_bytes")
        rows.append(
            [
                row["config"],
                f"{row['trainable_parameters']:,}" if row.get("trainable_parameters") else "-",
                format_bytes(row["predicted_peak_reserved_bytes"]) if row.get("predicted_peak_reserved_bytes") else "-",
                format_bytes(measured) if measured else "failed",
                _pct(row.get("allocated_error_pct"), True),
                _pct(row.get("reserved_error_pct"), True),
            ]
        )
    return [
        f"**LoRA and DoRA on a 3B Llama** (`python benchmarks/lora_gpu.py`, {_source('lora-gpu.json', meta)}): "
        f"Llama-3.2-3B-shaped, bf16 weights without autocast, peft adapters in fp32 (its default), batch "
        f"{meta.get('batch')} x sequence {meta.get('sequence')}, torch AdamW; predicted from the model built on "
        "`meta`, measured over two real steps in a fresh process.",
        "",
        *_table(LORA_HEADER, rows),
    ]


LORA_HEADER = [
    "configuration",
    "trainable parameters",
    "predicted reserved",
    "measured reserved",
    "allocated error",
    "reserved error",
]


# --------------------------------------------------------------------------- the published record

_PUBLISHED_COMMAND = "python -m harness.published.run"
_QUANTITY_SHORT = {
    "nvml_used": "NVML used",
    "max_memory_allocated": "`max_memory_allocated`",
    "max_memory_reserved": "`max_memory_reserved`",
}


def _in_unit(value: int, row: dict[str, Any]) -> str:
    """Bytes in the unit the publication printed (MB as NVML's // 1024**2, GB as / 1e9)."""
    scaled = value / (row["published_bytes"] / row["published"])
    return f"{scaled:.0f} {row['unit']}" if row["unit"] == "MB" else f"{scaled:.2f} {row['unit']}"


def _published_rows(rows: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    table, unpredicted = [], []
    for row in rows:
        predicted = row.get("predicted_bytes")
        if predicted is None:
            unpredicted.append(f"`{row['id']}`: {row['notes'][0] if row.get('notes') else 'not predicted'}")
        table.append(
            [
                f"{row['id']}: {row['configuration']}",
                _QUANTITY_SHORT.get(row["quantity"], row["quantity"]),
                f"{row['published']:g} {row['unit']}",
                "not predicted" if predicted is None else _in_unit(predicted, row),
                _pct(row.get("error_pct"), True),
            ]
        )
    return table, unpredicted


def published(results: Path) -> list[str]:
    data = _load("published.json", results)
    if data is None:
        return [f"**Published measurements: not predicted yet.** `{_PUBLISHED_COMMAND}`."]
    lines = [
        f"**Published measurements** (`{_PUBLISHED_COMMAND}`, `benchmarks/results/published.json`, "
        f"{data['meta']['date']}): "
        "GPU memory other people measured and published with the full configuration, predicted by memfit from "
        "that configuration alone (models built on `meta`); error = (memfit - published) / published, on the "
        "quantity the publication measured.",
    ]
    for section, title in (("reproduced", "Reproduced software"), ("today", "Today's software")):
        rows = [row for row in data["rows"] if row["section"] == section]
        if not rows:
            continue
        stats = data["summary"][section]
        software = "; ".join(dict.fromkeys(row["software"] for row in rows))
        sources = "; ".join(dict.fromkeys(row["source"] for row in rows))
        table, unpredicted = _published_rows(rows)
        lines += [
            "",
            f"*{title}* ({data['meta']['sections'][section]}): median absolute error "
            f"{_pct(stats['median_abs_error_pct'])}, largest {_pct(stats['max_abs_error_pct'])} over {stats['n']} "
            f"rows. Sources: {sources}. Measured with: {software}.",
            "",
            *_table(["measurement", "measures", "published", "memfit", "error"], table),
        ]
        if unpredicted:
            lines += ["", *(f"- {line}" for line in unpredicted)]
    return lines


def published_status(results: Path) -> list[str]:
    """One line for the README: how close memfit comes to the published record."""
    data = _load("published.json", results)
    if data is None:
        return [f"- **Published record:** not predicted yet (`{_PUBLISHED_COMMAND}`)."]
    stats, reproduced, today = data["summary"]["all"], data["summary"]["reproduced"], data["summary"]["today"]
    figures = len({(row["source"], row["configuration"], row["published"]) for row in data["rows"]})
    return [
        f"- **Published record:** {figures} GPU measurements published with their configurations (Hugging Face's "
        f"BERT-large Trainer runs, litgpt's LoRA tables), {stats['n']} predictions from the configuration alone "
        "(litgpt's with its 2023 code and with today's): median error "
        f"{_pct(stats['median_abs_error_pct'])}, largest {_pct(stats['max_abs_error_pct'])} "
        f"(reproduced software: {_pct(reproduced['median_abs_error_pct'])} median over {reproduced['n']}; today's "
        f"model code: {_pct(today['median_abs_error_pct'])} over {today['n']}"
        + (f"; {stats['not_predicted']} not predicted, with the reason" if stats["not_predicted"] else "")
        + ")."
    ]


BLOCKS: dict[str, Callable[[Path], list[str]]] = {
    "gpu-truth": gpu_truth,
    "gpu-accuracy": gpu_accuracy,
    "trace-zoo-gpu": trace_zoo_gpu,
    "lora-gpu": lora_gpu,
    "largest-batch": largest_batch,
    "cpu-accuracy": cpu_accuracy,
    "quantized-cpu": quantized_cpu,
    "training-loops-cpu": lambda results: training_loops(results, "cpu"),
    "training-loops-gpu": lambda results: training_loops(results, "gpu"),
    "speed": speed,
    "depth-extrapolation": depth_extrapolation,
    "published": published,
}
_FINETUNES = {
    "qlora-nf4": "QLoRA nf4, r=16 all-linear, paged AdamW 8-bit",
    "lora-bf16": "LoRA r=16 all-linear, bf16 base, AdamW",
    "full": "full fine-tuning, AdamW",
}


def cli_finetune(results: Path) -> list[str]:
    """docs/cli.md's Llama-3-8B fine-tuning table and its timings, from ``benchmarks/cli_qlora_8b.py``."""
    data = _load("cli_qlora_8b.json", results)
    if data is None:
        return ["**Not measured yet.** `python benchmarks/cli_qlora_8b.py`."]
    rows = []
    for name, label in _FINETUNES.items():
        run = data["runs"][name]
        plan = run["rtx4090"]
        if plan["fits"]:
            ckpt = ", checkpointing" if plan["gradient_checkpointing"] else ""
            cell = f"fits: micro batch {plan['micro_batch_size']}{ckpt}, {format_bytes(plan['predicted_peak_bytes'])}"
        else:
            cell = "does not fit: " + (plan["error"] or "").split(" against ")[0].split(": ", 1)[-1]
        rows.append([label, cell, format_bytes(run["batch1_checkpointing_peak_bytes"])])
    timed = (("qlora-nf4", "the QLoRA plan"), ("lora-bf16", "LoRA in bf16"), ("full", "full fine-tuning"))
    seconds = ", ".join(f"{data['runs'][name]['rtx4090_seconds']:.0f} s for {what}" for name, what in timed)
    where = data["machine"]
    if "torch" in data:
        where = f"{data.get('cpu_count', 2)}-core CPU, torch {data['torch']}, {data['date']}"
    return [
        *_table(["Llama-3-8B, seq 2048, bf16-mixed", "RTX 4090 plan", "peak at micro batch 1, checkpointing"], rows),
        "",
        f"Wall time of the whole command (`python benchmarks/cli_qlora_8b.py`, `benchmarks/results/cli_qlora_8b.json`; "
        f"{where}), imports and building the model on `meta` included: {seconds}.",
    ]


DOCS_CLI = ROOT / "docs" / "cli.md"
CLI_BLOCKS: dict[str, Callable[[Path], list[str]]] = {"finetune-8b": cli_finetune}
README_BLOCKS: dict[str, Callable[[Path], list[str]]] = {
    "status": status,
    "published-status": published_status,
    "performance": performance,
}


def targets() -> dict[Path, dict[str, Callable[[Path], list[str]]]]:
    """Each file with the blocks it must hold (read at call time, so tests may point DOC and README elsewhere)."""
    return {DOC: BLOCKS, README: README_BLOCKS, DOCS_CLI: CLI_BLOCKS}


def render(text: str, results: Path = RESULTS, blocks: dict[str, Callable[[Path], list[str]]] | None = None) -> str:
    """``text`` with every generated block rendered anew from ``results`` (default: docs/accuracy.md's
    blocks); a block missing from ``text`` is an error, so an edit cannot silently drop one."""
    for name, build in (BLOCKS if blocks is None else blocks).items():
        pattern = re.compile(rf"(<!-- results: {name} -->\n).*?(<!-- end results: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no block '<!-- results: {name} -->' ... '<!-- end results: {name} -->'")
        body = "\n".join(build(results))
        text = pattern.sub(lambda match, body=body: f"{match.group(1)}{body}\n{match.group(2)}", text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in docs/accuracy.md and README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if a file is not what --write makes")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files (default benchmarks/results)")
    args = parser.parse_args(argv)
    if not args.write and not args.check:
        for blocks in targets().values():
            for name, build in blocks.items():
                print(f"<!-- results: {name} -->\n" + "\n".join(build(args.results)) + "\n")
        return 0
    stale = []
    for path, blocks in targets().items():
        current = path.read_text()
        try:
            fresh = render(current, args.results, blocks)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        if args.write:
            path.write_text(fresh)
            print(f"{'rewrote' if fresh != current else 'kept'} {path}")
        elif fresh != current:
            stale.append(path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path))
    if stale:
        print(
            f"the result blocks of {', '.join(stale)} differ from benchmarks/results/: run "
            "`python -m harness.accuracy.readme --write` and commit",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
