"""Run by test_lightning_ddp.py: a 2-process CPU DDP fit with MemoryPlanner; each rank reports what it ran.

Usage: python ddp_fit.py OUT_DIR BUDGET_RANK0 BUDGET_RANK1
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_models import TinyGPT
from memfit.lightning import MemoryPlanner


def main() -> None:
    out = Path(sys.argv[1])
    budgets = [int(sys.argv[2]), int(sys.argv[3])]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budgets[rank], margin=0.05)  # this rank "sees" its own free memory
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        log_every_n_steps=2,
        callbacks=[callback],
        logger=CSVLogger(out / "logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    report = {
        "rank": trainer.global_rank,
        "batch_size": module.batch_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "seen_batch_sizes": sorted(set(module.seen_batch_sizes)),
        "plan": callback.plan.to_dict() if callback.plan else None,
        "estimate": callback.estimate.to_dict() if callback.estimate else None,  # rank 0 traces
        "trainable_bytes": sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
