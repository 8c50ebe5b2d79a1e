"""One zoo row on a real CUDA GPU: measured peaks, the allocator's full history, and memfit's prediction there.

    python benchmarks/gpu_snapshot.py "bert bf16-mixed sgd-momentum ckpt b16" 16 OUT_DIR

Runs three real training steps of the row (as ``harness.accuracy.run`` measures it) with the allocator's history
recorded, then writes ``OUT_DIR/snapshot-<row>-b<batch>.json.gz``: the snapshot as data (segments, blocks and the
event trace with eight Python frames per event; no pickle), the measured peaks, ``num_alloc_retries``, the
device and versions, and memfit's prediction of the same row made on this machine afterwards. The GPU-truth
fixtures (``benchmarks/results/gpu-truth/``) hold these files; ``benchmarks/limit_replay.py`` replays them.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from harness.accuracy import reference
from harness.accuracy.run import _loss, _to, autocast_for, optimizer_spec, predict, real_model
from harness.accuracy.zoo import configs

FRAMES_KEPT = 8


def _frame(frame: dict[str, Any]) -> list[Any]:
    filename = frame["filename"]
    for marker in ("site-packages/", "dist-packages/", "/src/", "/harness/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return [frame["name"], filename, frame["line"]]


def as_data(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` reduced to JSON: what the allocator held and every event it saw."""
    segments = [
        {
            "address": s["address"], "total_size": s["total_size"], "allocated_size": s["allocated_size"],
            "segment_type": s["segment_type"],
            "blocks": [{"address": b.get("address"), "size": b["size"], "requested_size": b.get("requested_size"),
                        "state": b["state"]} for b in s["blocks"]],
        }
        for s in snapshot["segments"]
    ]  # fmt: skip
    trace = [
        {"action": e["action"], "addr": e["addr"], "size": e["size"], "stream": e.get("stream", 0),
         "frames": [_frame(f) for f in e.get("frames", [])[:FRAMES_KEPT]]}
        for e in (snapshot["device_traces"][0] if snapshot["device_traces"] else [])
    ]  # fmt: skip
    return {"allocator_settings": snapshot.get("allocator_settings", {}), "segments": segments, "trace": trace}


def main(name: str, batch: int, out_dir: Path) -> dict[str, Any]:
    config = next(c for c in configs("gpu") if c.name == name)
    # SNAPSHOT_FRAMES=0 records the events without Python frames (recording frames has crashed a checkpointed
    # backward in torch 2.11's recorder)
    context = "all" if os.environ.get("SNAPSHOT_FRAMES", "1") != "0" else None
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=context, stacks="python")
    model = real_model(config, "gpu", "cuda")
    cls, kwargs = optimizer_spec(config.optimizer)
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    data = _to(config.family.batch("gpu")(batch), torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    reference.run_steps(model, optimizer, data, functools.partial(_loss, config), steps=3,
                        autocast=autocast_for(config, "cuda"))  # fmt: skip
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    stats = torch.cuda.memory_stats()
    snapshot = as_data(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = {
        "config": name, "batch_size": batch, "steps": 3, "step_seconds": round(seconds / 3, 4),
        "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": stats.get("num_alloc_retries"), "num_ooms": stats.get("num_ooms"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "transformers": _version("transformers"),
        "multiprocessors": torch.cuda.get_device_properties(0).multi_processor_count,
    }  # fmt: skip
    del model, optimizer, data
    torch.cuda.empty_cache()
    try:
        estimate, predict_seconds = predict(config, batch, "gpu", "cuda")
        measured |= {
            "gpu_predicted_peak_allocated_bytes": estimate.peak_allocated_bytes,
            "gpu_predicted_peak_reserved_bytes": estimate.peak_reserved_bytes,
            "predict_seconds": round(predict_seconds, 2),
        }
    except Exception as error:  # the measurement stands without the prediction
        measured["prediction_error"] = f"{type(error).__name__}: {error}"[:300]
    path = out_dir / f"snapshot-{name.replace(' ', '-')}-at{batch}.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"row": measured, **snapshot}, file)
    return measured


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))), flush=True)
