"""The plans ``memfit plan`` gives for a few cases, as a user reads them: fits or not, micro batch, checkpointing.

Run against a tree (``PYTHONPATH=<tree>/src``) under a label; the cases' answers are stored under that label in
``benchmarks/results/verdicts.json``, so two trees (before and after a change) sit side by side. ``--exact``
adds the answers of ``memfit plan --exact`` (the whole model traced, no extrapolation in depth) as the reference.

    PYTHONPATH=/tmp/before/src python benchmarks/verdicts.py --label before
    PYTHONPATH=src python benchmarks/verdicts.py --label after --exact

TinyLlama-1.1B is given as its config.json (written to a temporary directory; nothing is downloaded). The
``budget 13GiB`` case puts micro batch 1 near the budget, where an extrapolated "no" must be checked on the
whole model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import memfit
from memfit.planning.gpu_report import plan_for_gpus

RESULTS = Path(__file__).parent / "results" / "verdicts.json"
TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
# name -> (hf_config, --gpu or None, --budget or None, --seq-len)
CASES: dict[str, tuple[str, str | None, str | None, int]] = {
    "gpt2 / rtx4090": ("gpt2", "rtx4090", None, 1024),
    "tinyllama-1.1b / rtx4090 / seq 2048": ("tinyllama", "rtx4090", None, 2048),
    "tinyllama-1.1b / budget 13GiB / seq 2048": ("tinyllama", None, "13GiB", 2048),
}


def _config(name: str) -> str:
    if name != "tinyllama":
        return name
    path = Path(tempfile.gettempdir()) / "memfit-verdicts-tinyllama" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(TINYLLAMA))
    return str(path)


def _verdict(hf_config: str, gpu: str | None, budget: str | None, seq_len: int, exact: bool) -> dict[str, Any]:
    started = time.perf_counter()
    report = plan_for_gpus(hf_config=_config(hf_config), model=None, gpus=[gpu] if gpu else [], budget=budget,
                           seq_len=seq_len, exact=exact)  # fmt: skip
    (row,) = report.rows
    out: dict[str, Any] = {"fits": row.fits, "error": row.error, "seconds": round(time.perf_counter() - started, 1),
                           "depth_extrapolated_from": list(report.depth_extrapolated_from or []) or None}  # fmt: skip
    if row.plan is not None:
        plan = row.plan
        out.update(micro_batch_size=plan.micro_batch_size, accumulate_grad_batches=plan.accumulate_grad_batches,
                   gradient_checkpointing=plan.gradient_checkpointing, predicted_peak_bytes=plan.predicted_peak_bytes,
                   budget_bytes=plan.budget_bytes, reasons=list(plan.reasons))  # fmt: skip
        out["summary"] = (f"fits: micro batch {plan.micro_batch_size} x {plan.accumulate_grad_batches}, checkpointing "
                          f"{'on' if plan.gradient_checkpointing else 'off'}, predicted peak "
                          f"{plan.predicted_peak_bytes / 2**30:.2f} GiB")  # fmt: skip
    else:
        out["summary"] = f"does not fit: {row.error}"
    return out


def _commit() -> str | None:
    tree = Path(memfit.__file__).resolve().parent
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="where the answers go in the result file, e.g. before")
    parser.add_argument("--exact", action="store_true", help="also store memfit plan --exact's answers")
    args = parser.parse_args()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    answers = {"commit": _commit(), "cases": {}}
    for name, (config, gpu, budget, seq_len) in CASES.items():
        answers["cases"][name] = _verdict(config, gpu, budget, seq_len, exact=False)
        print(f"{args.label}: {name}: {answers['cases'][name]['summary']}")
    data[args.label] = answers
    if args.exact:
        exact = {"commit": answers["commit"], "cases": {}}
        for name, (config, gpu, budget, seq_len) in CASES.items():
            if config != "gpt2":  # below a billion parameters: never extrapolated, the plan above is exact
                exact["cases"][name] = _verdict(config, gpu, budget, seq_len, exact=True)
                print(f"exact: {name}: {exact['cases'][name]['summary']}")
        data["exact"] = exact
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
