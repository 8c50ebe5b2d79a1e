"""How long the common questions take, first and again, as multiples of one concrete GPT-2 trace timed in the same run.

    python benchmarks/answer_speed.py [--only NAME ...]

Every figure is the wall time of a fresh process (imports included), on this machine, in one run:
* ``unit_s``: one concrete trace of GPT-2 124M's training step (batch 8, seq 1024, AdamW, two steps), after one
  warm-up trace in the same process: the yardstick every other figure is divided by.
* per question (``memfit plan ...`` as a user types it): ``cold_s`` with the trace cache off (what every answer
  cost before it); ``first_s`` with an empty cache (the same work, plus writing the traces); ``again_s`` the same
  question again, answered from the kept answer (``memfit.cli.answers``); ``traces_s`` the same question with its
  kept answer deleted, from the kept traces; ``neighbour_s`` another question on the same model from the cache
  (a target batch, or
  another GPU of the same kind: a trace reads the GPU's compute capability and multiprocessor count, so a card that
  differs in those is traced for). ``same_answer``: whether the ``--json`` answers agree, first, with an empty
  cache and again, and the neighbour's from the cache with its own traced afresh (fields that describe this
  machine's state, such as its free RAM, and timings are left out of the comparison).
* per callback: the planning a run waits for at its start (Lightning: ``MemoryPlanner.setup``; Hugging Face:
  ``attach(trainer, ...)``), around one step of a 4-layer GPT-2 on CPU, with the cache off and started again from
  the cache. The Lightning module is defined in the script, outside any installed package, so it is never cached.
The machine's load average is recorded with each figure: on a shared 2-core machine seconds vary with it.
Results go to ``benchmarks/results/answer_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

_QLORA = ["--lora-r", "16", "--quantize", "nf4", "--optimizer", "paged_adamw_8bit"]
QUESTIONS: dict[str, dict[str, Any]] = {
    "gpt2 on a T4": {
        "argv": ["plan", "--hf-config", "gpt2", "--gpu", "t4", "--seq-len", "1024"],
        "neighbour": ["plan", "--hf-config", "gpt2", "--gpu", "t4", "--seq-len", "1024", "--target-batch-size", "64"],
        "goal_s": 2.0,
    },
    "llama-3-8b on an H100": {
        "argv": ["plan", "--hf-config", "llama-3-8b", "--gpu", "h100", "--seq-len", "2048"],
        "neighbour": ["plan", "--hf-config", "llama-3-8b", "--gpu", "h200", "--seq-len", "2048"],
        "goal_s": 3.0,
    },
    "QLoRA llama-3-8b on an RTX 4090": {
        "argv": ["plan", "--hf-config", "llama-3-8b", "--gpu", "rtx4090", *_QLORA],
        "neighbour": ["plan", "--hf-config", "llama-3-8b", "--gpu", "rtx4090", *_QLORA, "--target-batch-size", "32"],
        "goal_s": 5.0,
    },
    "llama-3-70b on H100s, --gpus auto": {
        "argv": ["plan", "--hf-config", "llama-3-70b", "--gpu", "h100", "--gpus", "auto", "--seq-len", "4096"],
        "neighbour": ["plan", "--hf-config", "llama-3-70b", "--gpu", "h200", "--gpus", "auto", "--seq-len", "4096"],
        "goal_s": 6.0,
    },
}
MACHINE_STATE = {"available_bytes", "trace_seconds", "seconds", "load_average"}


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit", *argv, "--json"], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False)  # fmt: skip
    return round(time.perf_counter() - started, 2), done


def _answer(text: str) -> Any:
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in MACHINE_STATE}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    try:
        return clean(json.loads(text))
    except json.JSONDecodeError:
        return None


def question(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        off = {**os.environ, "MEMFIT_CACHE": "off"}
        on = {**os.environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": folder}
        cold_s, cold = _run(spec["argv"], off)
        first_s, first = _run(spec["argv"], on)
        again_s, again = _run(spec["argv"], on)
        for kept in Path(folder, "answers").glob("*.json.gz"):
            kept.unlink()
        traces_s, from_traces = _run(spec["argv"], on)
        neighbour_s, neighbour = _run(spec["neighbour"], on)
        fresh_neighbour = _run(spec["neighbour"], off)[1]
    answers = [_answer(done.stdout) for done in (cold, first, again, from_traces)]
    return {
        "question": name, "command": "memfit " + " ".join(spec["argv"]), "goal_s": spec["goal_s"],
        "exit_status": cold.returncode, "cold_s": cold_s, "first_s": first_s, "again_s": again_s,
        "traces_s": traces_s,
        "neighbour": "memfit " + " ".join(spec["neighbour"]), "neighbour_s": neighbour_s,
        "same_answer": answers[0] is not None and all(a == answers[0] for a in answers)
        and _answer(neighbour.stdout) == _answer(fresh_neighbour.stdout),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


_UNIT_SCRIPT = """
import json, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
import memfit
from memfit.tracing.tracer import trace_steps
from memfit.prediction.estimator import _prepare, _Step
from memfit.tracing.config import Target, TrainingLoop
with torch.device("meta"):
    model = GPT2LMHeadModel(GPT2Config())
ids = torch.zeros(8, 1024, dtype=torch.long)
sample = {"input_ids": ids, "labels": ids}
step = _Step("adamw", None, "fp32", False, None, None, None, False)
settings, (_, _, sample_batch) = _prepare(model, sample, None, step, TrainingLoop(), Target("cuda"))
trace_steps(model, sample, sample_batch, 8, settings)  # warm-up
started = time.perf_counter()
trace_steps(model, sample, sample_batch, 8, settings)
print(json.dumps({"unit_s": round(time.perf_counter() - started, 3)}))
"""

_CALLBACK_SCRIPT = """
import json, sys, time, torch
framework = sys.argv[1]
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128, bos_token_id=0, eos_token_id=0)
rows = [{"input_ids": torch.randint(0, 1024, (128,)), "labels": torch.randint(0, 1024, (128,))} for _ in range(64)]
seconds = []
if framework == "lightning":
    import lightning as L
    from memfit.lightning import MemoryPlanner
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(config)
        def training_step(self, batch, index):
            return self.model(**batch).loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())
        def train_dataloader(self):
            return torch.utils.data.DataLoader(rows, batch_size=8)
    setup = MemoryPlanner.setup
    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        setup(self, *args, **kwargs)
        seconds.append(time.perf_counter() - started)
    MemoryPlanner.setup = timed
    L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[MemoryPlanner(budget="2GiB", target="cuda")]).fit(Module())
else:
    import tempfile
    from transformers import Trainer, TrainingArguments
    from memfit.huggingface import attach
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(GPT2LMHeadModel(config), args, train_dataset=rows)
    started = time.perf_counter()
    attach(trainer, budget="2GiB", target="cuda")
    seconds.append(time.perf_counter() - started)
    trainer.train()
print(json.dumps({"setup_s": round(sum(seconds), 3)}))
"""


def _python(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or dict(os.environ), check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])


def callback(framework: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        off = {**os.environ, "MEMFIT_CACHE": "off"}
        on = {**os.environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": folder}
        cold = _python(_CALLBACK_SCRIPT, framework, env=off)
        _python(_CALLBACK_SCRIPT, framework, env=on)
        again = _python(_CALLBACK_SCRIPT, framework, env=on)
    if "error" in cold or "error" in again:
        return {"framework": framework, "error": [cold.get("error"), again.get("error")]}
    return {
        "framework": framework, "setup_cold_s": cold["setup_s"], "setup_again_s": again["setup_s"],
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="questions whose name contains this (repeatable)")
    parser.add_argument("--no-callbacks", action="store_true", help="skip the callbacks' setup cost")
    args = parser.parse_args()
    unit = _python(_UNIT_SCRIPT)
    print(f"one concrete GPT-2 trace: {unit}", flush=True)
    rows = []
    for name, spec in QUESTIONS.items():
        if args.only and not any(part in name for part in args.only):
            continue
        rows.append(question(name, spec))
        print(json.dumps(rows[-1]), flush=True)
    callbacks = [] if args.no_callbacks else [callback("lightning"), callback("huggingface")]
    for row in callbacks:
        print(json.dumps(row), flush=True)
    unit_s = unit.get("unit_s")
    if unit_s:
        for row in rows:
            for key in ("cold_s", "first_s", "again_s", "traces_s", "neighbour_s"):
                row[key.replace("_s", "_units")] = round(row[key] / unit_s, 2)
        for row in callbacks:
            for key in ("setup_cold_s", "setup_again_s"):
                if key in row:
                    row[key.replace("_s", "_units")] = round(row[key] / unit_s, 2)
    import torch

    meta = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "unit": unit}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "answer_speed.json"
    path.write_text(json.dumps({"meta": meta, "questions": rows, "callbacks": callbacks}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
