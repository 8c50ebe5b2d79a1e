"""What cuDNN's recurrent kernels allocate, over a grid of shapes, on a real CUDA GPU.

    python benchmarks/gpu_cudnn_rnn.py OUT.json.gz [--grid base|workspace]

cuDNN sizes its RNN workspace and reserve space itself (``cudnnGetRNNTempSpaceSizes``), in a closed library, so
the only way to know how they scale is to ask it at many shapes. For each shape (mode LSTM/GRU/RNN, precision,
input and hidden width, sequence length, batch, layers, direction, batch-first) this runs one forward and one
backward of a fresh ``nn.LSTM``/``nn.GRU``/``nn.RNN`` under the allocator's history and writes every allocation
and free of each phase, in order, with its byte size: ``[[action, size], ...]``. Written as it goes, so a run cut
short keeps the shapes it finished. ``tests/test_cudnn_rnn.py`` holds memfit's traced requests to these.

``--grid workspace`` measures where the base grid left the workspace unexplained: GRU and tanh RNNs varied one
field at a time from their own base, LSTMs outside the region the workspace formula is exact on (two directions,
narrow states, short and long sequences, inputs wider than the state), and dropout between layers.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

BASE = {"mode": "LSTM", "precision": "fp32", "input": 1024, "hidden": 1024, "steps": 128, "batch": 8, "layers": 2,
        "bidirectional": False, "batch_first": True, "dropout": 0.0}  # fmt: skip
VARIATIONS = {
    "mode": ["GRU", "RNN_TANH"],
    "precision": ["16-mixed", "bf16-mixed"],
    "input": [300, 512, 2048],
    "hidden": [256, 512, 768, 1000, 2048],
    "steps": [1, 16, 64, 257, 512],
    "batch": [1, 3, 32, 64],
    "layers": [1, 3, 4],
    "bidirectional": [True],
    "batch_first": [False],
}
RANDOM_SHAPES = 80


def shapes() -> list[dict[str, Any]]:
    """The base shape, each field varied alone, then random combinations (seeded: the same list everywhere)."""
    out = [dict(BASE)]
    for field, values in VARIATIONS.items():
        out += [{**BASE, field: value} for value in values]
    rng = random.Random(0)
    for _ in range(RANDOM_SHAPES):
        out.append({
            "mode": rng.choice(["LSTM", "GRU", "RNN_TANH"]),
            "precision": rng.choice(["fp32", "16-mixed", "bf16-mixed"]),
            "input": rng.choice([64, 300, 512, 1024]), "hidden": rng.choice([128, 256, 512, 640, 1024]),
            "steps": rng.choice([7, 32, 100, 128, 200]), "batch": rng.choice([1, 2, 5, 16, 24]),
            "layers": rng.choice([1, 2, 3]), "bidirectional": rng.random() < 0.3, "batch_first": rng.random() < 0.7,
        })  # fmt: skip
    return out


WORKSPACE_VARIATIONS = {
    "input": [64, 300, 2048],
    "hidden": [128, 256, 512, 1000, 2048],
    "steps": [1, 8, 16, 64, 256],
    "batch": [1, 4, 32],
    "layers": [1, 3],
    "bidirectional": [True],
    "precision": ["16-mixed", "bf16-mixed"],
}
LSTM_OUTSIDE = [
    {"bidirectional": True, "hidden": 512}, {"bidirectional": True, "layers": 1}, {"hidden": 256}, {"hidden": 640},
    {"steps": 8}, {"steps": 16}, {"steps": 256}, {"steps": 1024}, {"input": 2048, "hidden": 1024},
    {"input": 4096, "hidden": 2048}, {"batch": 128}, {"hidden": 512, "precision": "bf16-mixed"},
    {"hidden": 1536, "steps": 64}, {"hidden": 1024, "layers": 4, "batch_first": False},
]  # fmt: skip


def workspace_shapes() -> list[dict[str, Any]]:
    """GRU and tanh-RNN grids from their own base, LSTMs outside the exact region, and dropout between layers."""
    out: list[dict[str, Any]] = []
    for mode in ("GRU", "RNN_TANH"):
        base = {**BASE, "mode": mode}
        out.append(base)
        for field, values in WORKSPACE_VARIATIONS.items():
            out += [{**base, field: value} for value in values]
    out += [{**BASE, **change} for change in LSTM_OUTSIDE]
    for mode in ("LSTM", "GRU", "RNN_TANH"):
        out += [{**BASE, "mode": mode, "dropout": 0.1}, {**BASE, "mode": mode, "dropout": 0.5, "layers": 3}]
    return out


def module_for(shape: dict[str, Any]) -> nn.Module:
    kinds = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN}
    return kinds[shape["mode"]](shape["input"], shape["hidden"], num_layers=shape["layers"],
                                bidirectional=shape["bidirectional"], batch_first=shape["batch_first"],
                                dropout=shape.get("dropout", 0.0))  # fmt: skip


def events() -> list[list[Any]]:
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    return [[e["action"], e["size"]] for e in trace if e["action"] in ("alloc", "free_requested", "segment_alloc")]


def measure(shape: dict[str, Any]) -> dict[str, Any]:
    """One forward and one backward, each phase's allocator events recorded apart."""
    rnn = module_for(shape).cuda()
    n, t = shape["batch"], shape["steps"]
    size = (n, t, shape["input"]) if shape["batch_first"] else (t, n, shape["input"])
    x = torch.randn(size, device="cuda", requires_grad=True)
    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(shape["precision"])
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, context=None, stacks="python")
    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
        out = rnn(x)[0]
    torch.cuda.synchronize()
    forward = events()
    torch.cuda.memory._record_memory_history(enabled=None)
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, context=None, stacks="python")
    out.backward(grad)
    torch.cuda.synchronize()
    backward = events()
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"shape": shape, "forward": forward, "backward": backward}


def main(path: Path, grid_name: str = "base") -> None:
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
            "multiprocessors": torch.cuda.get_device_properties(0).multi_processor_count,
            "grid": grid_name}  # fmt: skip
    results: list[dict[str, Any]] = []
    grid = workspace_shapes() if grid_name == "workspace" else shapes()
    for index, shape in enumerate(grid):
        try:
            results.append(measure(shape))
        except Exception as error:  # one shape's failure is recorded, the grid goes on
            results.append({"shape": shape, "error": f"{type(error).__name__}: {error}"[:300]})
        torch.cuda.empty_cache()
        if index % 10 == 0 or index == len(grid) - 1:
            with gzip.open(path, "wt") as file:
                json.dump({"meta": meta, "results": results}, file)
    print(json.dumps({"shapes": len(results), "errors": sum("error" in r for r in results), **meta}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[3] if sys.argv[2:3] == ["--grid"] else "base")
