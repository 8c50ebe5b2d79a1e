"""Run by test_lightning_ddp.py: a 2-process CPU DDP fit where only rank 1 runs out of memory.

Usage: python ddp_oom_fit.py OUT_DIR LIMIT   (LIMIT: samples above which rank 1 fails, or "none")
Each rank writes what it ran and its final parameters.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from fault_models import Regression, flat_parameters
from memfit.lightning import MemoryPlanner


def main() -> None:
    out, limit = Path(sys.argv[1]), None if sys.argv[2] == "none" else int(sys.argv[2])
    module = Regression(batch_size=12, limit=limit, from_batch=1, rank=1)
    callback = MemoryPlanner(mode="observe")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[callback],
        logger=CSVLogger(out / "logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    recovery = callback.recovery
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "seen": sorted(module.seen),
        "chunk_size": recovery.chunk_size if recovery else None,
        "recoveries": len(recovery.recoveries) if recovery else 0,
        "warnings": [str(w.message) for w in caught if "memfit" in str(w.message)],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    torch.save(flat_parameters(module), out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
