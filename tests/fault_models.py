"""Models that run out of memory on purpose: a real ``torch.OutOfMemoryError`` from inside forward
(or backward) once the micro batch is above a threshold, from a chosen optimizer step on."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, Dataset, TensorDataset

FEATURES = 8


def regression_data(samples: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(samples))


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)")


class MemoryCeiling(nn.Module):
    """Passes its input through; once armed, a batch above ``limit`` samples runs out of memory."""

    def __init__(self, limit: int | None, where: str = "forward") -> None:
        super().__init__()
        self.limit, self.where, self.armed, self.raised = limit, where, False, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed or self.limit is None or is_fake(x) or x.shape[0] <= self.limit:
            return x
        self.raised += 1
        if self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in forward)")
        return _RaiseInBackward.apply(x)


def regression_net(limit: int | None, where: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), MemoryCeiling(limit, where), nn.Tanh(), nn.Linear(32, 1))


def ceiling(net: nn.Module) -> MemoryCeiling:
    return next(m for m in net.modules() if isinstance(m, MemoryCeiling))


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


class FailingSGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th step runs out of memory after forward and backward are done (0: never)."""

    def __init__(self, params: object, lr: float, fail_at: int = 2) -> None:
        super().__init__(params, lr=lr)
        self.fail_at, self.steps = fail_at, 0

    def step(self, closure: object = None) -> object:
        loss = None
        if closure is not None:  # Lightning runs forward and backward inside the step
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        if self.steps == self.fail_at:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected in the optimizer step)"
            )
        super().step()
        return loss


class Regression(L.LightningModule):
    """A small MLP, mean-squared error, plain SGD: chunked and whole batches give the same gradients."""

    def __init__(
        self,
        batch_size: int = 12,
        limit: int | None = None,
        where: str = "forward",
        from_batch: int = 0,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = regression_net(limit, where)
        self.from_batch, self.rank = from_batch, rank
        self.seen: list[int] = []

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        on_this_rank = self.rank is None or self.rank == self.global_rank
        ceiling(self.net).armed = on_this_rank and batch_idx >= self.from_batch

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if not is_fake(x):
            self.seen.extend(ids.tolist())  # after the forward: a failed forward sees nothing
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=self.batch_size, shuffle=False)


class DictRegression(nn.Module):
    """The same MLP for the Hugging Face Trainer: keyword inputs, ``{"loss": ...}`` out."""

    def __init__(self, limit: int | None = None, where: str = "forward") -> None:
        super().__init__()
        self.net = regression_net(limit, where)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.net(x), labels)
        if not is_fake(x):
            self.seen.extend(ids.tolist())
        return {"loss": loss}


class DictData(Dataset):
    def __init__(self, samples: int = 96) -> None:
        self.data = regression_data(samples)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y, ids = self.data[index]
        return {"x": x, "labels": y, "ids": ids}
