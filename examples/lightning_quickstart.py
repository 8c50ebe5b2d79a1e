"""Train a small GPT-2 with Lightning and MemoryPlanner on CPU, on synthetic data.

    python examples/lightning_quickstart.py [--budget 40MiB] [--steps 30] [--accelerator cpu]

MemoryPlanner traces the LightningModule at setup, picks the largest micro batch that fits the
budget and the gradient accumulation that keeps the configured effective batch (32), applies them,
then logs predicted and measured memory to the CSV logger every few steps (on a CPU the measure is
the process's resident memory, logged as such and not compared with the prediction). The budget is small on
purpose so the plan has something to do on a CPU; on a GPU, drop --budget to plan for the free
memory of the device.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from memfit.lightning import MemoryPlanner


class TinyGPT(L.LightningModule):
    def __init__(self, batch_size: int = 32, seq_len: int = 128, vocab: int = 2048, layers: int = 4, width: int = 128):
        super().__init__()
        self.save_hyperparameters()
        # the end-of-text token (GPT-2's 50256) is the last id of this small vocabulary
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq_len,
                            bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # fmt: skip
        self.model = GPT2LMHeadModel(config)  # random weights: nothing is downloaded
        self.batch_size = batch_size  # MemoryPlanner sets this to the planned micro batch

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.hparams.vocab, (4096, self.hparams.seq_len), generator=generator)
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="40MiB", help="memory budget per device (default: 40MiB)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default="lightning_logs_memfit", help="where the CSV logs go")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = TinyGPT()
    planner = MemoryPlanner(budget=args.budget or None, log_every_n_steps=5)
    logger = CSVLogger(args.out, name="quickstart")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        callbacks=[planner],
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module)

    plan = planner.plan
    print(f"\nplan: {plan.summary() if plan else 'none (see the warnings above)'}")
    print(f"trained {trainer.global_step} optimizer steps with micro batch {module.batch_size} and "
          f"accumulate_grad_batches={trainer.accumulate_grad_batches}")  # fmt: skip
    # The callback printed its final line above: on a GPU the reserved peak against the prediction
    # (drift); on a CPU the process's resident memory, which also holds the interpreter and the
    # libraries, so it is not compared with the prediction.
    print(f"all memfit metrics: {Path(logger.log_dir) / 'metrics.csv'}")


if __name__ == "__main__":
    main()
