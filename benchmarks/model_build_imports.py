"""What the command line's lean transformers import buys: a config's model built on ``meta`` in a fresh process.

    python benchmarks/model_build_imports.py [--runs N]

Each run is a fresh interpreter that builds a preset's model on the meta device as ``memfit plan --hf-config``
does (``memfit.presets.from_hf_config``), imports included, once with transformers imported as it imports itself
(``plain``), once with only the optional libraries deferred (``deferred``: ``defer_optional_libraries``, assisted
generation without scikit-learn and the losses without scipy, the first half of ``lean_model_imports``), and once inside
``lean_model_imports`` (``lean``: also without ``@auto_docstring``'s generated docstrings), as the command line
builds. The three alternate run by run, so that a machine whose speed drifts moves all; the medians and their
ratios go to ``benchmarks/results/model_build_imports.json``, with whether scikit-learn and scipy were imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PRESETS = ("gpt2", "llama-3-8b", "llama-3-70b")
HOW = ("plain", "deferred", "lean")
_SCRIPT = """
import contextlib, importlib, sys
from memfit.integrations.huggingface import internals
block = contextlib.nullcontext()
if sys.argv[1] == "deferred":
    internals.defer_optional_libraries(importlib.import_module("transformers.utils"))
elif sys.argv[1] == "lean":
    block = internals.lean_model_imports()
with block:
    from memfit.presets import from_hf_config
    from_hf_config(sys.argv[2], seq_len=1024)
print("sklearn" in sys.modules, "scipy" in sys.modules)
"""


def _once(how: str, preset: str) -> tuple[float, dict[str, bool]]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how, preset], capture_output=True, text=True, check=True)
    sklearn, scipy = (word == "True" for word in done.stdout.split())
    return time.perf_counter() - started, {"sklearn": sklearn, "scipy": scipy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for preset in PRESETS:
        _once("plain", preset)  # warm the file cache for both
        times: dict[str, list[float]] = {how: [] for how in HOW}
        imported: dict[str, dict[str, bool]] = {}
        for _ in range(args.runs):
            for how in HOW:
                seconds, imported[how] = _once(how, preset)
                times[how].append(seconds)
        medians = {how: statistics.median(times[how]) for how in HOW}
        plain = medians["plain"]
        rows.append({"preset": preset, **{f"{how}_s": round(medians[how], 2) for how in HOW},
                     "saved_s": round(plain - medians["lean"], 2),
                     **{f"{how}_over_plain": round(medians[how] / plain, 3) for how in HOW[1:]},
                     "runs": args.runs, "imported": imported,
                     "load_average": [round(x, 2) for x in os.getloadavg()]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    meta = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    path = RESULTS / "model_build_imports.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
