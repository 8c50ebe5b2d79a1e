"""What the command line's lean transformers import buys: a config's model built on ``meta`` in a fresh process.

    python benchmarks/model_build_imports.py [--runs N]

Each run is a fresh interpreter that builds a preset's model on the meta device as ``memfit plan --hf-config``
does (``memfit.presets.from_hf_config``), imports included, once with transformers imported as it imports itself
(``plain``) and once after ``import_models_without_generation_extras`` (``lean``: its generation code without
scikit-learn). The two alternate run by run, so that a machine whose speed drifts moves both; the medians and their
ratio go to ``benchmarks/results/model_build_imports.json``, with whether scikit-learn was imported in each.
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
_SCRIPT = """
import sys
if sys.argv[1] == "lean":
    from memfit.integrations.huggingface.internals import import_models_without_generation_extras
    import_models_without_generation_extras()
from memfit.presets import from_hf_config
from_hf_config(sys.argv[2], seq_len=1024)
print("sklearn" in sys.modules)
"""


def _once(how: str, preset: str) -> tuple[float, bool]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how, preset], capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for preset in PRESETS:
        _once("plain", preset)  # warm the file cache for both
        times: dict[str, list[float]] = {"plain": [], "lean": []}
        imported: dict[str, bool] = {}
        for _ in range(args.runs):
            for how in ("plain", "lean"):
                seconds, sklearn = _once(how, preset)
                times[how].append(seconds)
                imported[how] = sklearn
        plain, lean = statistics.median(times["plain"]), statistics.median(times["lean"])
        rows.append({"preset": preset, "plain_s": round(plain, 2), "lean_s": round(lean, 2),
                     "saved_s": round(plain - lean, 2), "lean_over_plain": round(lean / plain, 3),
                     "runs": args.runs, "sklearn_imported": imported,
                     "load_average": [round(x, 2) for x in os.getloadavg()]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    meta = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    path = RESULTS / "model_build_imports.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
