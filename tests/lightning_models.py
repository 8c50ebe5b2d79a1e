"""Tiny Lightning modules for the callback tests (GPT-2 config, random weights, synthetic tokens)."""

from __future__ import annotations

import lightning as L
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 500
SEQ = 32


def tokens(n: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=generator))


class TinyGPT(L.LightningModule):
    """A two-layer GPT-2 whose batch size lives on the module, as BatchSizeFinder expects."""

    def __init__(self, batch_size: int = 12, samples: int = 240, n_layer: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(
            GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, loss_type="ForCausalLM")
        )
        self.batch_size = batch_size
        self.samples = samples
        self.seen_batch_sizes: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        if not is_fake(ids):  # memfit's trace calls training_step on fake tensors at setup
            self.seen_batch_sizes.append(ids.shape[0])
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(self.samples), batch_size=self.batch_size, shuffle=True)


class NoBatchAttribute(TinyGPT):
    """Its dataloader hard-codes the batch size: memfit cannot apply a micro batch."""

    def __init__(self) -> None:
        super().__init__()
        del self.batch_size
        self.hparams.pop("batch_size")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(self.samples), batch_size=12)


class ReadsValues(TinyGPT):
    """Branches on a tensor value in training_step: the trace fails, training must not."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss > 0:  # data-dependent
            return loss
        return loss * 2


class TokenData(L.LightningDataModule):
    def __init__(self, batch_size: int = 12) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(240), batch_size=self.batch_size)


class ModuleForDataModule(TinyGPT):
    """Batch size only on the datamodule (whose dataloader Lightning prefers)."""

    def __init__(self) -> None:
        super().__init__()
        del self.batch_size
        self.hparams.pop("batch_size")


class ShardedTinyGPT(TinyGPT):
    """``TinyGPT`` for ``ModelParallelStrategy``: ``configure_model`` applies FSDP2's ``fully_shard`` to each
    block and the root over the data-parallel dimension of the strategy's device mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
