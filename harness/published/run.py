"""Predict every published measurement from its configuration and write the comparison.

    python -m harness.published.run                  # every row; writes benchmarks/results/published.json
    python -m harness.published.run --only bert      # rows whose id contains "bert"
    python -m harness.published.run --layers 2 --output /tmp/p.json   # the machinery on shortened models

A row whose model code is not installed (litgpt, which must live in its own environment: it pins an
older huggingface-hub than the dev extras) is not predicted; when the output file already holds that
row from a run where it was installed, that row is kept as it was and says where it was produced. So
the committed file is made by running once in each environment, in either order.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from harness.published.rows import QUANTITIES, SECTIONS, Row, all_rows

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "benchmarks" / "results" / "published.json"
REQUIRED_FIELDS = ("id", "section", "source", "configuration", "quantity", "published", "unit", "software")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def available(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def environment(row: Row) -> str:
    """The software memfit traced this row with."""
    version = _version(row.requires) or "(a source checkout)"
    return f"torch {torch.__version__}, {row.requires} {version}, memfit traced on {platform.machine()}"


def error_pct(predicted: int | None, published: int) -> float | None:
    return None if predicted is None else round(100.0 * (predicted - published) / published, 3)


def predict_row(row: Row, layers: int | None = None) -> dict[str, Any]:
    """One row of the result file: the published figure, memfit's prediction of it and the error."""
    started = time.perf_counter()
    prediction = row.predict(layers)
    seconds = round(time.perf_counter() - started, 1)
    notes = list(prediction.notes)
    comparable = layers is None
    if not comparable:
        notes.append(f"model shortened to {layers} layers: a check of the machinery, not comparable to the figure")
    return {
        "id": row.id,
        "section": row.section,
        "source": row.source,
        "configuration": row.configuration,
        "quantity": row.quantity,
        "quantity_description": QUANTITIES[row.quantity],
        "published": row.published,
        "unit": row.unit,
        "published_bytes": row.published_bytes,
        "software": row.software,
        "predicted_bytes": prediction.predicted_bytes,
        "error_pct": error_pct(prediction.predicted_bytes, row.published_bytes) if comparable else None,
        "traced_with": environment(row),
        "seconds": seconds,
        **({"layers": layers} if layers else {}),
        **prediction.details,
        "notes": notes,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest absolute error, per section and over all rows that have an error."""

    def stats(group: list[dict[str, Any]]) -> dict[str, Any]:
        errors = [abs(row["error_pct"]) for row in group if row.get("error_pct") is not None]
        return {
            "n": len(errors),
            "not_predicted": sum(1 for row in group if row.get("predicted_bytes") is None),
            "median_abs_error_pct": round(statistics.median(errors), 3) if errors else None,
            "max_abs_error_pct": round(max(errors), 3) if errors else None,
        }

    return {
        "all": stats(rows),
        **{section: stats([row for row in rows if row["section"] == section]) for section in SECTIONS},
    }


def run(only: list[str], layers: int | None, output: Path | None) -> dict[str, Any]:
    previous: dict[str, dict[str, Any]] = {}
    if output is not None and output.exists():
        previous = {row["id"]: row for row in json.loads(output.read_text())["rows"]}
    rows = []
    for row in all_rows():
        if only and not any(part in row.id for part in only):
            if row.id in previous:
                rows.append(previous[row.id])
            continue
        if not available(row.requires):
            if row.id in previous:
                kept = previous[row.id]["traced_with"]
                print(f"{row.id}: {row.requires} is not installed here; kept the row traced with {kept}")
                rows.append(previous[row.id])
            else:
                print(f"{row.id}: skipped, {row.requires} is not installed here (see harness/published/README.md)")
            continue
        result = predict_row(row, layers)
        error = "-" if result["error_pct"] is None else f"{result['error_pct']:+.2f} %"
        predicted = result["predicted_bytes"]
        digits = 0 if row.unit == "MB" else 2
        shown = "not predicted" if predicted is None else f"{predicted / row.unit_bytes:.{digits}f} {row.unit}"
        print(f"{row.id}: published {row.published} {row.unit}, memfit {shown}, error {error} ({result['seconds']} s)")
        rows.append(result)
    data = {
        "meta": {
            "date": date.today().isoformat(),
            "quantities": QUANTITIES,
            "sections": SECTIONS,
            "command": "python -m harness.published.run",
        },
        "summary": summary(rows),
        "rows": rows,
    }
    if output is not None:
        output.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {output}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="rows whose id contains this (repeatable)")
    parser.add_argument("--layers", type=int, default=None, help="shorten every model to this many layers (a check)")
    parser.add_argument("--output", type=Path, default=None, help=f"result file (default {OUTPUT}; none with --layers)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be a positive integer, got {args.layers}")
    output = args.output if args.output is not None else (None if args.layers else OUTPUT)
    run(args.only, args.layers, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
