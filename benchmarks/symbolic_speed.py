"""What one symbolic trace costs, and what a whole plan costs with it, against a concrete trace.

    python benchmarks/symbolic_speed.py [case ...]

Per case, in a fresh process (cases: gpt2-124m, bert-base, resnet50, llama-3-8b):
* ``concrete_trace_s``: one concrete trace of two training steps (``trace_steps``), after one warm-up trace
  of the same step (so one-time kernel and import costs are not counted);
* ``symbolic_trace_s``: one trace of the same step with the batch symbolic (``trace_symbolic``), after one
  warm-up symbolic trace, and
  ``symbolic_with_length_trace_s`` with the sequence length symbolic too (``None``: the sample has none), which a
  plan takes only when asked about another length;
* ``plan_s``: a whole plan from nothing (the traces kept between calls cleared): a ``PlanningSession`` over
  ``memfit.estimate`` (what the Lightning and Hugging Face callbacks run) for an 80 GiB H100, target
  ``"max"``, checkpointing allowed; ``plan_concrete_s`` the same with ``MEMFIT_TRACE=concrete`` (two traces
  per estimate and a confirming trace per batch the plan looks at);
* ``ratio`` = ``plan_s / concrete_trace_s``, the issue's goal being at most 1.3.
Llama-3-8B is planned as ``memfit plan --hf-config llama-3-8b --gpu h100 --seq-len 2048`` plans it
(the whole model's log built from symbolic traces at 3 and 4 blocks; with ``MEMFIT_TRACE=concrete``,
searched on concrete traces at 2 and 4 blocks extrapolated in depth and confirmed on the whole model; the
concrete path first, so that it, not the symbolic one, pays the first call's costs); its trace columns
are the 4-block model's. Import times (``import memfit.cli.main``, ``import transformers``) are measured in fresh
processes. The machine's load average is recorded: this 2-core machine is shared, so seconds vary with it.
Results go to ``benchmarks/results/symbolic_speed.json``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
H100 = 80 * 1024**3
CASES = ("gpt2-124m", "bert-base", "resnet50", "llama-3-8b")


class Bottleneck(nn.Module):
    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.short = (
            nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or inp != out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


def resnet50() -> nn.Module:
    """ResNet-50's layout (bottlenecks 3-4-6-3, 25.6 M parameters), 1000 classes."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    inp = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inp, width, stride if i == 0 else 1))
            inp = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, 1000)]
    return nn.Sequential(*layers)


def build(case: str) -> tuple[nn.Module, Any, Any, Any]:
    """``(model, sample, loss_fn, forward_fn)`` at batch 8."""
    if case == "gpt2-124m":
        from transformers import GPT2Config, GPT2LMHeadModel

        ids = torch.zeros(8, 1024, dtype=torch.long)
        return GPT2LMHeadModel(GPT2Config()), {"input_ids": ids, "labels": ids}, None, None
    if case == "bert-base":
        from transformers import BertConfig, BertForSequenceClassification

        ids = torch.zeros(8, 512, dtype=torch.long)
        sample = {"input_ids": ids, "labels": torch.zeros(8, dtype=torch.long)}
        return BertForSequenceClassification(BertConfig()), sample, None, None
    if case == "resnet50":
        sample = (torch.zeros(8, 3, 224, 224), torch.zeros(8, dtype=torch.long))
        return (
            resnet50(), sample,
            lambda out, b: nn.functional.cross_entropy(out, b[1]), lambda model, b: model(b[0]),
        )  # fmt: skip
    raise ValueError(case)


def trace_times(model: nn.Module, sample: Any, loss_fn: Any, forward_fn: Any, batch: int) -> dict[str, float]:
    from memfit.prediction.estimator import _prepare, _Step
    from memfit.tracing.config import Target, TrainingLoop
    from memfit.tracing.symbolic import trace_symbolic
    from memfit.tracing.tracer import trace_steps

    step = _Step("adamw", None, "fp32", False, None, loss_fn, forward_fn, False)
    settings, (_, _, sample_batch) = _prepare(model, sample, None, step, TrainingLoop(), Target("cuda"))
    trace_steps(model, sample, sample_batch, batch, settings)  # warm-up
    started = time.perf_counter()
    trace_steps(model, sample, sample_batch, batch, settings)
    concrete = time.perf_counter() - started
    trace_symbolic(model, sample, sample_batch, settings, hint=batch)  # warm-up: sympy's first costs
    started = time.perf_counter()
    trace_symbolic(model, sample, sample_batch, settings, hint=batch)
    symbolic = time.perf_counter() - started
    started = time.perf_counter()
    with_length = trace_symbolic(model, sample, sample_batch, settings, hint=batch, symbolic_sequence=True)
    both = time.perf_counter() - started
    return {"concrete_trace_s": round(concrete, 2), "symbolic_trace_s": round(symbolic, 2),
            "symbolic_with_length_trace_s": round(both, 2) if with_length.seq is not None else None}  # fmt: skip


def session_plan(model: nn.Module, sample: Any, loss_fn: Any, forward_fn: Any, mode: str) -> dict[str, Any]:
    import memfit
    from memfit.planning.session import PlanningSession, PlanRequest
    from memfit.prediction.exact import clear_sessions
    from memfit.tracing.config import TrainingLoop

    os.environ["MEMFIT_TRACE"] = mode
    clear_sessions()

    def trace_at(micro: int, checkpointing: bool, accumulation: int) -> memfit.StepCurve:
        return memfit.trace(model, sample, batch_size=micro, gradient_checkpointing=checkpointing,
                            loop=TrainingLoop(accumulation_steps=accumulation), loss_fn=loss_fn,
                            forward_fn=forward_fn)  # fmt: skip

    started = time.perf_counter()
    session = PlanningSession(trace_at, batch_size=8)
    decision = session.decide(PlanRequest(capacity_bytes=H100, target_batch_size="max"))
    return {"seconds": round(time.perf_counter() - started, 2), "micro_batch": decision.plan.micro_batch_size,
            "checkpointing": decision.plan.gradient_checkpointing, "estimates_asked": len(session.traced),
            "predicted_reserved_bytes": decision.traced.estimate.peak_reserved_bytes}  # fmt: skip


def llama(mode: str) -> dict[str, Any]:
    from memfit.planning.gpu_report import plan_for_gpus
    from memfit.prediction.exact import clear_sessions

    os.environ["MEMFIT_TRACE"] = mode
    clear_sessions()
    started = time.perf_counter()
    report = plan_for_gpus(hf_config="llama-3-8b", model=None, gpus=["h100"], budget=None, seq_len=2048)
    row = report.rows[0]
    return {"seconds": round(time.perf_counter() - started, 2), "micro_batch": row.plan.micro_batch_size if row.plan
            else None, "checkpointing": row.plan.gradient_checkpointing if row.plan else None,
            "error": row.error}  # fmt: skip


def run_case(case: str) -> dict[str, Any]:
    if case == "llama-3-8b":
        from memfit.presets import from_hf_config

        spec = from_hf_config("llama-3-8b", seq_len=2048, layers=4)
        ids = spec.sample(1)
        times = trace_times(spec.model, ids, None, None, 2)
        old, plan = llama("concrete"), llama("symbolic")  # the concrete path first: it pays the first-call costs
    else:
        model, sample, loss_fn, forward_fn = build(case)
        times = trace_times(model, sample, loss_fn, forward_fn, 8)
        plan = session_plan(model, sample, loss_fn, forward_fn, "symbolic")
        old = session_plan(model, sample, loss_fn, forward_fn, "concrete")
    return {
        "case": case, **times, "plan_s": plan["seconds"], "plan_concrete_s": old["seconds"],
        "ratio": round(plan["seconds"] / times["concrete_trace_s"], 2),
        "ratio_concrete_path": round(old["seconds"] / times["concrete_trace_s"], 2),
        "plan": plan, "plan_concrete": old, "load_average": os.getloadavg(),
    }  # fmt: skip


def import_seconds(statement: str) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    return round(float(out.stdout.strip().splitlines()[-1]), 2)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(run_case(sys.argv[2])))
        return
    cases = sys.argv[1:] or list(CASES)
    rows = []
    for case in cases:
        out = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            rows.append({"case": case, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    previous = RESULTS / "symbolic_speed.json"
    if sys.argv[1:] and previous.exists():  # a subset of cases re-run: keep the others' rows
        kept = [row for row in json.loads(previous.read_text())["cases"] if row["case"] not in cases]
        rows = sorted([*kept, *rows], key=lambda row: CASES.index(row["case"]))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared (load average recorded per case)",
        "torch": torch.__version__,
        "imports": {
            "memfit.cli.main_s": import_seconds("import memfit.cli.main"),
            "transformers_s": import_seconds("import transformers, transformers.modeling_utils"),
            "load_average": os.getloadavg(),
        },
        "cases": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "symbolic_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["imports"]))


if __name__ == "__main__":
    main()
