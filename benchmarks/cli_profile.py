"""Where the time of the common ``memfit plan`` questions goes: each one profiled in a fresh process.

    python benchmarks/cli_profile.py           # writes benchmarks/results/cli_profile.json

Each question runs under ``cProfile`` in its own interpreter (imports included, as a user's prompt pays them),
three times: with the caches off (``cold``), answered again from its kept traces alone (``from_traces``: the kept
answer deleted), and from its kept answer (``kept_answer``). What each part costs is the cumulative time of its
outermost calls (``MARKERS``): imports, the traces on fake tensors, the symbolic-shape arithmetic inside them
(sympy), the allocator replays, the tables, building the model, the kept answer. The wall time is measured around
the whole process, profiler included. One run per state, so the shares are what to read; the seconds move with
the machine's load, recorded beside them. ``cli_profile-2026-11-26.json`` is the profile before the caches;
``cli_profile-2026-12-02-after.json`` the one after the command line's lean transformers import, taken with a
test run on the other core (load average 3: read its shares, not its seconds).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = {
    "gpt2 on a T4, seq 1024": ["plan", "--hf-config", "gpt2", "--gpu", "t4", "--seq-len", "1024"],
    "llama-3-8b on an H100, seq 2048": ["plan", "--hf-config", "llama-3-8b", "--gpu", "h100", "--seq-len", "2048"],
    "QLoRA llama-3-8b on an RTX 4090": ["plan", "--hf-config", "llama-3-8b", "--gpu", "rtx4090", "--lora-r", "16",
                                        "--quantize", "nf4", "--optimizer", "paged_adamw_8bit"],
    "llama-3-70b, --gpus auto, seq 4096": ["plan", "--hf-config", "llama-3-70b", "--gpu", "h100", "--gpus", "auto",
                                           "--seq-len", "4096"],
}  # fmt: skip

# Where the time goes, by the cumulative time of the outermost call of each marker (a marker inside another
# counts inside it too: a trace's symbolic arithmetic is part of the trace; the shares below are read that way).
MARKERS = {
    "imports": ("_find_and_load",),
    "traces (fake tensors)": ("trace_steps", "trace_symbolic"),
    "symbolic shapes (sympy), inside the traces": ("sympy/",),
    "allocator replays": ("memfit/simulation/replay.py",),
    "tables (rich)": ("rich/console.py:",),
    "building the model (transformers)": ("memfit/presets.py:",),
    "kept answer: key and replay": ("(question_key)", "(_replay)"),
}
STATES = ("cold", "from_traces", "kept_answer")

RUNNER = """
import cProfile, json, pstats, sys
from memfit.cli.main import main
profile = cProfile.Profile()
profile.enable()
code = main(sys.argv[2:])
profile.disable()
stats = pstats.Stats(profile)
rows = [[f"{path}:{line}({name})", tottime, cumtime, [f"{p}:{n}" for (p, _, n) in callers]]
        for (path, line, name), (_, _, tottime, cumtime, callers) in stats.stats.items()]
json.dump({"code": code, "rows": rows}, open(sys.argv[1], "w"))
"""


def marked(rows: list, keys: tuple[str, ...]) -> float:
    """Cumulative seconds of the outermost calls of the functions ``keys`` name: a marked function called from
    another marked one (or itself) is counted once, in its caller."""
    chosen = [row for row in rows if any(key in row[0] for key in keys)]
    names = {row[0].rsplit("(", 1)[0].rsplit(":", 1)[0] + ":" + row[0].rsplit("(", 1)[1][:-1] for row in chosen}
    return sum(row[2] for row in chosen if not any(caller in names for caller in row[3]))


def profile(argv: list[str], env: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", RUNNER, str(out), *argv], capture_output=True, text=True,
                              check=False, env=env)  # fmt: skip
        wall = time.perf_counter() - start
        if not out.exists():
            raise SystemExit(f"memfit {' '.join(argv)} failed: {done.stderr[-2000:]}")
        data = json.loads(out.read_text())
    rows = data["rows"]
    top = sorted(rows, key=lambda row: -row[1])[:12]
    return {
        "argv": argv,
        "exit_status": data["code"],
        "wall_seconds": round(wall, 2),
        "profiled_seconds": round(sum(row[1] for row in rows), 2),
        "marked_seconds": {name: round(marked(rows, keys), 2) for name, keys in MARKERS.items()},
        "top_functions_own_seconds": [[row[0], round(row[1], 3)] for row in top],
    }


def profile_states(argv: list[str]) -> dict[str, dict]:
    """The question profiled cold, from its kept traces, and from its kept answer (a fresh cache folder)."""
    with tempfile.TemporaryDirectory() as folder:
        off = {**os.environ, "MEMFIT_CACHE": "off"}
        on = {**os.environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": folder}
        rows = {"cold": profile(argv, off)}
        subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, env=on, check=False)
        rows["kept_answer"] = profile(argv, on)
        for kept in Path(folder, "answers").glob("*.json.gz"):
            kept.unlink()
        rows["from_traces"] = profile(argv, on)
    return {state: rows[state] for state in STATES}


def main(argv: list[str] | None = None) -> None:
    """Profile the questions (``--only NAME``, repeatable: those alone), writing the result file after each, so
    the ones done are kept; a rerun keeps the file's other questions."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(QUESTIONS), help="profile this question alone")
    names = parser.parse_args(argv).only or list(QUESTIONS)
    out = Path(__file__).parent / "results" / "cli_profile.json"
    results = json.loads(out.read_text())["questions"] if out.exists() else {}
    for name in names:
        results[name] = profile_states(QUESTIONS[name])
        for state, row in results[name].items():
            parts = ", ".join(f"{b} {s:.1f} s" for b, s in row["marked_seconds"].items())
            print(f"{name}, {state}: {row['wall_seconds']:.1f} s wall; {parts}", flush=True)
        meta = {
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "note": "wall time under cProfile, which slows this code severalfold: the shares are what to read",
        }
        out.write_text(json.dumps({**meta, "questions": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
