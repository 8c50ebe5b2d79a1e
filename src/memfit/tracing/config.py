"""The training loop a step runs in and the device it runs on: the two settings objects ``estimate`` takes.

They are checked when built, so a bad value fails where it was written, and they leave room for
what later settings add (sharding beside ``ddp``, quantization) without lengthening ``estimate``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from memfit.errors import InvalidInputError
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.sharding import ShardingConfig
from memfit.tracing.tracer import ZERO_GRAD_ORDERS, ZeroGrad

__all__ = ["Target", "TrainingLoop"]


@dataclass(frozen=True)
class TrainingLoop:
    """How the loop around the step runs it.

    Attributes:
        zero_grad: where the loop frees gradients: ``"after_step"`` (after ``optimizer.step()``, as the
            Hugging Face Trainer does) or ``"before_backward"`` (Lightning's automatic optimization, whose
            ``training_step`` runs with the last step's gradients still alive), or ``"in_place"``
            (``zero_grad(set_to_none=False)``, torch's default before 2.0: gradients zeroed, never freed).
        accumulation_steps: gradient accumulation; above 1, later micro batches of a window run forward
            and backward with the window's gradients alive.
        extra_batches: batches the loop keeps on the device besides the step's own (memfit's
            out-of-memory recovery keeps an accumulation window's earlier batches to replay them; a
            loader reading ahead on the device); the only loop setting a forward-only pass takes.
        ddp: the step runs under ``DistributedDataParallel``: ``True`` for its defaults, or a
            ``memfit.DDPConfig``; adds its gradient buckets. Stored as a ``DDPConfig`` or ``None``.
        sharding: the step runs sharded across ranks (FSDP, ZeRO): a ``memfit.ShardingConfig``; the
            estimate is then one rank's.
    """

    zero_grad: ZeroGrad = "after_step"
    accumulation_steps: int = 1
    extra_batches: int = 0
    ddp: DDPConfig | None = None
    sharding: ShardingConfig | None = None

    def __post_init__(self) -> None:
        if self.zero_grad not in ZERO_GRAD_ORDERS:
            raise InvalidInputError(f"zero_grad must be one of {', '.join(ZERO_GRAD_ORDERS)}, got {self.zero_grad!r}")
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidInputError(f"accumulation_steps must be a positive integer, got {steps!r}")
        extra = self.extra_batches
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
            raise InvalidInputError(f"extra_batches must be a non-negative integer, got {extra!r}")
        ddp: Any = self.ddp
        if ddp is True:
            object.__setattr__(self, "ddp", DDPConfig())
        elif ddp is False:
            object.__setattr__(self, "ddp", None)
        elif ddp is not None and not isinstance(ddp, DDPConfig):
            raise InvalidInputError(f"ddp must be True, False, None or a memfit.DDPConfig, got {ddp!r}")
        if self.sharding is not None and not isinstance(self.sharding, ShardingConfig):
            raise InvalidInputError(f"sharding must be None or a memfit.ShardingConfig, got {self.sharding!r}")

    def for_inference(self) -> TrainingLoop:
        """A forward-only pass has no gradients: of the loop only the batches it holds apply."""
        return TrainingLoop(extra_batches=self.extra_batches)

    def dropped_for_inference(self) -> str | None:
        """What ``for_inference`` leaves out of this loop, in words for the estimate's notes (``None``: nothing)."""
        dropped = [f"{name}={getattr(self, name)!r}" for name in ("zero_grad", "accumulation_steps", "ddp", "sharding")
                   if getattr(self, name) != getattr(_DEFAULT_LOOP, name)]  # fmt: skip
        if not dropped:
            return None
        return f"a forward pass has no gradients: the loop's {', '.join(dropped)} did not apply (extra_batches does)"


_DEFAULT_LOOP = TrainingLoop()


@dataclass(frozen=True)
class Target:
    """The device whose memory is predicted.

    Attributes:
        device: ``"cuda"`` (default) or ``"cpu"`` (a ``torch.device`` is accepted and kept as its
            string). A CPU-only torch traces CUDA targets on fake CPU tensors with CUDA kernels' memory
            substituted (see ``memfit.tracing.cuda_semantics``).
        runtime: CUDA context size and compute capability of the GPU (default: measured on the visible
            GPU, else an H100-class card).
    """

    device: str = "cuda"
    runtime: CudaRuntime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", str(self.torch_device))
        if self.runtime is not None and not isinstance(self.runtime, CudaRuntime):
            raise InvalidInputError(f"runtime must be a memfit.CudaRuntime, got {self.runtime!r}")

    @property
    def torch_device(self) -> torch.device:
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(f"device must be 'cuda' or 'cpu', got {self.device!r}") from exc
        if device.type not in ("cuda", "cpu"):
            raise InvalidInputError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        return device

    def with_runtime(self, runtime: CudaRuntime | None) -> Target:
        return replace(self, runtime=runtime)
