"""Run by test_lightning_ddp.py: a 2-process CPU fit with MemoryPlanner; each rank reports what it ran.

Usage: python ddp_fit.py OUT_DIR BUDGET_RANK0 BUDGET_RANK1 [STRATEGY]

STRATEGY: ``ddp`` (default); ``fsdp2``: ``ModelParallelStrategy`` with two data-parallel ranks and
``fully_shard`` in ``configure_model``; ``tp``: ``ModelParallelStrategy`` with its single-node default,
two tensor-parallel ranks.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_models import ShardedTinyGPT, TinyGPT
from memfit.lightning import MemoryPlanner


def strategy_for(name: str) -> object:
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "tp":
        return ModelParallelStrategy()
    return name


def main() -> None:
    out = Path(sys.argv[1])
    budgets = [int(sys.argv[2]), int(sys.argv[3])]
    name = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    module = ShardedTinyGPT(batch_size=12) if name in ("fsdp2", "tp") else TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budgets[rank], margin=0.05)  # this rank "sees" its own free memory
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(name),
        max_steps=4,
        log_every_n_steps=2,
        callbacks=[callback],
        logger=CSVLogger(out / "logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    report = {
        "rank": trainer.global_rank,
        "batch_size": module.batch_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "seen_batch_sizes": sorted(set(module.seen_batch_sizes)),
        "plan": callback.plan.to_dict() if callback.plan else None,
        "estimate": callback.estimate.to_dict() if callback.estimate else None,  # rank 0 traces
        "trainable_bytes": sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad),
        "warnings": [str(w.message) for w in caught if "memfit" in str(w.message)],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
