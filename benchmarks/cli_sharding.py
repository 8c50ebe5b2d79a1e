"""How long ``memfit plan`` takes to answer for several GPUs, and what it answers.

    PYTHONPATH=src python benchmarks/cli_sharding.py

Each command runs end to end in a fresh process (``python -m memfit plan ... --json``): wall time and
the CPU time of the process, the answer's key figures (per-rank micro batch, accumulation,
checkpointing, predicted peak, model states) and, for ``--gpus auto``, what each GPU count considered
said. The hand arithmetic for a model's states under FSDP (bf16-mixed AdamW: fp32 parameters 4 B,
fp32 gradients 4 B, Adam's two fp32 moments 8 B per parameter, over N ranks) is recorded beside the
answer. Results go to ``benchmarks/results/cli_sharding.json``; the machine is named in them (the
figures are for its CPU, shared or not).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

COMMANDS = {
    "llama-3-8b fsdp 8x H100": ["--hf-config", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--strategy", "fsdp",
                                "--target-batch-size", "64"],
    "llama-3-8b zero2 8x H100": ["--hf-config", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--strategy", "zero2",
                                 "--target-batch-size", "64"],
    "llama-3-8b zero3 8x H100": ["--hf-config", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--strategy", "zero3",
                                 "--target-batch-size", "64"],
    "llama-3-70b fsdp 8x H100 seq 4096": ["--hf-config", "llama-3-70b", "--gpu", "h100", "--gpus", "8", "--strategy",
                                          "fsdp", "--seq-len", "4096"],
    "llama-3-70b auto H100 seq 4096": ["--hf-config", "llama-3-70b", "--gpu", "h100", "--gpus", "auto", "--seq-len",
                                       "4096"],
}  # fmt: skip


def run(arguments: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "plan", *arguments, "--json"], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = {"command": "memfit plan " + " ".join(arguments), "exit_code": done.returncode,
           "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
           "stderr": done.stderr.strip()[-2000:]}  # fmt: skip
    if not done.stdout.strip():
        return out
    answer = json.loads(done.stdout)
    row = answer["gpus"][0]
    keys = ("fits", "micro_batch_size", "accumulate_grad_batches", "gradient_checkpointing", "effective_batch_size",
            "predicted_peak_bytes", "budget_bytes", "error", "peak_phase", "breakdown_bytes")  # fmt: skip
    out.update({key: row.get(key) for key in keys})
    out["sharding"] = answer["sharding"]
    out["parameters"] = answer["parameters"]
    out["model_states_per_rank_bytes"] = answer["model_states_per_rank_bytes"]
    out["host_offload_per_node_bytes"] = answer["host_offload_per_node_bytes"]
    out["considered"] = answer["considered"]
    if answer["sharding"] and answer["sharding"]["strategy"] == "fsdp":
        n = answer["sharding"]["shard_group_size"]
        out["hand_fsdp_states_per_rank_bytes"] = {"parameters": 4 * answer["parameters"] // n,
                                                  "gradients": 4 * answer["parameters"] // n,
                                                  "optimizer_state": 8 * answer["parameters"] // n}  # fmt: skip
    return out


def main() -> None:
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "load_average_at_start": os.getloadavg()}, "runs": {}}  # fmt: skip
    for name, arguments in COMMANDS.items():
        results["runs"][name] = run(arguments)
        print(name, results["runs"][name]["wall_seconds"], "s wall", results["runs"][name]["cpu_seconds"], "s CPU",
              flush=True)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cli_sharding.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
