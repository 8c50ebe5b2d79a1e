"""A real CUDA out-of-memory error, survived: Lightning + MemoryPlanner(mode="observe") on a batch too big.

    python benchmarks/oom_recovery_demo.py [--steps 20] [--out benchmarks/results/oom_recovery]

The configured micro batch is chosen from memfit's own estimate so that its predicted peak is
about 1.6 x the GPU's free memory: the first step runs out of memory for real. Observe mode leaves
the configuration alone, so only the out-of-memory recovery acts. Writes the warnings, the
recoveries, the steps and the measured peaks to OUT/log.json and the CSV metrics to OUT/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import memfit
from memfit.lightning import MemoryPlanner

SEQ, VOCAB = 1024, 50257


class GPT(L.LightningModule):
    def __init__(self, batch_size: int, samples: int) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, vocab_size=VOCAB))  # GPT-2 124M, random
        self.batch_size, self.samples, self.seen = batch_size, samples, 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.seen += ids.shape[0]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, VOCAB, (self.samples, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/oom_recovery"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: on CPU nothing runs out of memory")
    free, total = torch.cuda.mem_get_info()
    probe = GPT(batch_size=4, samples=4)
    curve = memfit.trace(probe, (torch.zeros(4, SEQ, dtype=torch.long),), batch_size=4,
                               target=memfit.Target("cuda"),
                               forward_fn=lambda m, b: m.model(input_ids=b[0], labels=b[0]))  # fmt: skip
    naive = next(b for b in range(4, 4096, 4) if curve.at(b).reserved_bytes > 1.6 * free)
    module = GPT(batch_size=naive, samples=naive * args.steps)
    callback = MemoryPlanner(mode="observe", log_every_n_steps=1)
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="32-true", max_steps=args.steps,
                        callbacks=[callback], logger=CSVLogger(args.out), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    recovery = callback.recovery
    log = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "free_bytes_before": free,
        "total_bytes": total,
        "configured_micro_batch": naive,
        "predicted_reserved_at_configured": curve.at(naive).reserved_bytes,
        "optimizer_steps": trainer.global_step,
        "samples_seen": module.seen,
        "samples_expected": naive * args.steps,
        "chunk_size_after": recovery.chunk_size if recovery else None,
        "recoveries": [vars(r) for r in recovery.recoveries] if recovery else [],
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "warnings": [str(w.message) for w in caught if "memfit" in str(w.message)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "warnings"}, indent=2, default=str))


if __name__ == "__main__":
    main()
