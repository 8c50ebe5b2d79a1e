"""What the trace cache buys a step that cannot be traced with a symbolic batch: a Swin asked again.

    python benchmarks/concrete_path_cache.py

Swin's backward fails with a symbolic batch (an internal assert in torch's argument parser), so memfit traces it at
concrete batches, two per estimate. Those traces are kept on disk as the symbolic path's are. A small Swin config
(written here: 4 stages of one block, embedding 32, 224-pixel images) is planned for an A10G in fresh processes:
with the cache off, with an empty cache (``first``), and again with its kept answer deleted (``from_traces``),
twice each, alternating; the ``--json`` answers are compared (but the live available-RAM figure). Results go to
``benchmarks/results/concrete_path_cache.json``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = {"model_type": "swin", "depths": [1, 1, 1, 1], "num_heads": [1, 2, 4, 8], "embed_dim": 32,
          "image_size": 224, "patch_size": 4, "window_size": 7, "drop_path_rate": 0.1, "num_labels": 10}  # fmt: skip


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, env=env,
                          check=True)  # fmt: skip
    seconds = time.perf_counter() - started
    answer = json.loads(done.stdout)
    answer.get("host", {}).pop("available_bytes", None)
    return round(seconds, 2), answer


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(CONFIG))
    argv = ["plan", "--hf-config", str(folder / "config.json"), "--gpu", "a10g", "--json"]
    cache = folder / "cache"
    on = {**os.environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": str(cache)}
    off = {**os.environ, "MEMFIT_CACHE": "off"}
    times: dict[str, list[float]] = {"cold": [], "first": [], "from_traces": []}
    answers = []
    for _ in range(2):
        seconds, answer = _run(argv, off)
        times["cold"].append(seconds)
        answers.append(answer)
        shutil.rmtree(cache, ignore_errors=True)
        seconds, answer = _run(argv, on)
        times["first"].append(seconds)
        answers.append(answer)
        shutil.rmtree(cache / "answers", ignore_errors=True)
        seconds, answer = _run(argv, on)
        times["from_traces"].append(seconds)
        answers.append(answer)
    kept = len(list((cache / "traces").glob("*.json.gz")))
    row = {"question": "memfit " + " ".join(argv[:2]) + " swin-config.json " + " ".join(argv[3:]), "config": CONFIG,
           **{f"{k}_s": v for k, v in times.items()}, "traces_kept": kept,
           "same_answer": all(a == answers[0] for a in answers),
           "load_average": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    print(json.dumps(row), flush=True)
    meta = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    path = RESULTS / "concrete_path_cache.json"
    path.write_text(json.dumps({"meta": meta, "rows": [row]}, indent=1) + "\n")
    print(f"wrote {path}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
