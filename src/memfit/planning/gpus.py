"""GPUs by name: memory and the facts that change an estimate, so a budget can be "h100".

Memory is the total the driver reports (``nvidia-smi``'s "Total", in MiB), not the marketing
figure: an "80 GB" H100 shows 81,559 MiB. Figures are from published specifications and common
driver readings; the callbacks measure the real device when they run on it. Apple M-series entries
are approximations: their memory is unified with the CPU, macOS lets the GPU use about three
quarters of it, and the MPS allocator is not CUDA's, so memfit's allocator simulation does not
apply to them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import Target
from memfit.units import GiB, MiB

__all__ = ["GPU", "PlanningTarget", "budget_gpu", "check_target", "gpu_by_name", "known_gpus", "planning_target"]

_BF16 = (Precision.BF16_MIXED, Precision.BF16_TRUE)


@dataclass(frozen=True)
class GPU:
    """A GPU model and what memfit needs to know about it."""

    name: str
    memory_bytes: int
    vendor: str
    architecture: str
    compute_capability: tuple[int, int] | None
    bf16: bool
    fp8: bool
    approximate: bool = False
    aliases: tuple[str, ...] = ()
    # what CUDA kernels size their launch grids by (reductions' staging buffers grow with it): from the vendor's
    # specifications; None where the catalog has no figure (an H100's is then assumed)
    multiprocessors: int | None = None
    max_threads_per_multiprocessor: int | None = None

    @property
    def cublas_workspace_bytes(self) -> int:
        """cuBLAS workspace per handle on this architecture (32 MiB on Hopper and newer, else 8 MiB + 128 KiB)."""
        from memfit.simulation.runtime import cublas_workspace_bytes

        return cublas_workspace_bytes(self.compute_capability or (9, 0))

    @property
    def runtime(self) -> CudaRuntime:
        """The runtime facts an estimate for this card takes (an H100-class card's where the catalog has none)."""
        default = CudaRuntime()
        return CudaRuntime(
            compute_capability=self.compute_capability or default.compute_capability,
            multiprocessors=self.multiprocessors or default.multiprocessors,
            max_threads_per_multiprocessor=self.max_threads_per_multiprocessor
            or default.max_threads_per_multiprocessor,
        )

    def precision_for(self, requested: Precision | str | None, *, inference: bool = False) -> Precision:
        """The precision to plan this card in.

        ``None`` asks for the card's usual one: bf16 where it has it, else fp16 (T4, V100), mixed for
        training and half-precision weights (``*-true``) for inference. A bf16 precision asked of a card
        without bf16 raises ``InvalidInputError``: torch only emulates it there (slowly), and without
        its fused attention kernels the memory is not the one memfit models.
        """
        if requested is None:
            if inference:
                return Precision.BF16_TRUE if self.bf16 else Precision.FP16_TRUE
            return Precision.BF16_MIXED if self.bf16 else Precision.FP16_MIXED
        precision = Precision.parse(requested)
        if precision in _BF16 and not self.bf16:
            fp16 = Precision.FP16_MIXED if precision.is_mixed else Precision.FP16_TRUE
            raise InvalidInputError(
                f"{self.name} ({self.architecture}) has no bf16, so {precision.value} would run emulated, slowly "
                f"and with other kernels than memfit models; plan it with precision {fp16.value} instead"
            )
        return precision


_CATALOG: tuple[GPU, ...] = (
    GPU("T4", 15360 * MiB, "NVIDIA", "Turing", (7, 5), bf16=False, fp8=False, aliases=("T4-16GB", "Tesla T4"),
        multiprocessors=40, max_threads_per_multiprocessor=1024),
    GPU("V100-16GB", 16160 * MiB, "NVIDIA", "Volta", (7, 0), bf16=False, fp8=False, aliases=("V100-SXM2-16GB",),
        multiprocessors=80, max_threads_per_multiprocessor=2048),
    GPU("V100-32GB", 32510 * MiB, "NVIDIA", "Volta", (7, 0), bf16=False, fp8=False, aliases=("V100-SXM2-32GB",),
        multiprocessors=80, max_threads_per_multiprocessor=2048),
    GPU("A10G", 23028 * MiB, "NVIDIA", "Ampere", (8, 6), bf16=True, fp8=False, aliases=("A10G-24GB",),
        multiprocessors=80, max_threads_per_multiprocessor=1536),
    GPU("L4", 23034 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("L4-24GB",),
        multiprocessors=58, max_threads_per_multiprocessor=1536),
    GPU("RTX3090", 24576 * MiB, "NVIDIA", "Ampere", (8, 6), bf16=True, fp8=False, aliases=("GeForce RTX 3090",),
        multiprocessors=82, max_threads_per_multiprocessor=1536),
    GPU("RTX4090", 24564 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("GeForce RTX 4090",),
        multiprocessors=128, max_threads_per_multiprocessor=1536),
    GPU("RTX5090", 32607 * MiB, "NVIDIA", "Blackwell", (12, 0), bf16=True, fp8=True, aliases=("GeForce RTX 5090",),
        multiprocessors=170, max_threads_per_multiprocessor=1536),
    GPU("A100-40GB", 40960 * MiB, "NVIDIA", "Ampere", (8, 0), bf16=True, fp8=False, aliases=("A100-SXM4-40GB",),
        multiprocessors=108, max_threads_per_multiprocessor=2048),
    GPU("A100-80GB", 81920 * MiB, "NVIDIA", "Ampere", (8, 0), bf16=True, fp8=False, aliases=("A100-SXM4-80GB",),
        multiprocessors=108, max_threads_per_multiprocessor=2048),
    GPU("L40S", 46068 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("L40S-48GB",),
        multiprocessors=142, max_threads_per_multiprocessor=1536),
    GPU("H100", 81559 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True,
        aliases=("H100-80GB", "H100 SXM", "H100-80GB-HBM3"), multiprocessors=132, max_threads_per_multiprocessor=2048),
    GPU("H100-PCIe", 81559 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True, aliases=("H100 PCIe",),
        multiprocessors=114, max_threads_per_multiprocessor=2048),
    GPU("H200", 143771 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True, aliases=("H200-141GB",),
        multiprocessors=132, max_threads_per_multiprocessor=2048),
    GPU("B200", 183359 * MiB, "NVIDIA", "Blackwell", (10, 0), bf16=True, fp8=True, aliases=("B200-192GB",),
        multiprocessors=148, max_threads_per_multiprocessor=2048),
    GPU("MI300X", 196592 * MiB, "AMD", "CDNA3", None, bf16=True, fp8=True, aliases=("MI300X-192GB", "Instinct MI300X")),
    GPU("M3-Max-128GB", 96 * GiB, "Apple", "M3", None, bf16=True, fp8=False, approximate=True, aliases=("M3 Max",)),
    GPU("M2-Ultra-192GB", 144 * GiB, "Apple", "M2", None, bf16=True, fp8=False, approximate=True,
        aliases=("M2 Ultra",)),
)  # fmt: skip


def _key(name: str) -> str:
    text = name.upper()
    for noise in ("NVIDIA", "GEFORCE", "TESLA", "INSTINCT", "APPLE", "AMD"):
        text = text.replace(noise, "")
    return re.sub(r"[^A-Z0-9]", "", text)


_BY_KEY: dict[str, GPU] = {}
for _gpu in _CATALOG:
    for _name in (_gpu.name, *_gpu.aliases):
        _BY_KEY[_key(_name)] = _gpu


def known_gpus() -> tuple[GPU, ...]:
    return _CATALOG


def gpu_by_name(name: str) -> GPU:
    """Look a GPU up forgivingly: ``"h100"``, ``"H100-80GB"``, ``"NVIDIA A100 80GB"``, ``"rtx 4090"``.

    A name that fits several entries (``"a100"``: 40 or 80 GB) or none raises ``InvalidInputError``
    listing the candidates.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidInputError(f"a GPU name must be a non-empty string, got {name!r}")
    key = _key(name)
    if key in _BY_KEY:
        return _BY_KEY[key]
    prefixed = sorted({gpu.name for k, gpu in _BY_KEY.items() if k.startswith(key)})
    if len(prefixed) == 1:
        return next(gpu for gpu in _CATALOG if gpu.name == prefixed[0])
    if len(prefixed) > 1:
        raise InvalidInputError(f"GPU {name!r} is ambiguous: {', '.join(prefixed)}; name the memory size too")
    close = difflib.get_close_matches(key, list(_BY_KEY), n=4, cutoff=0.5)
    names = sorted({_BY_KEY[k].name for k in close})
    hint = f"did you mean {', '.join(names)}? " if names else ""
    raise InvalidInputError(
        f"unknown GPU {name!r}; {hint}`memfit gpus` lists the known ones; for a card memfit does not know, plan for "
        "its memory as a budget (--budget 20GiB on the command line, budget='20GiB' in Python)"
    )


TARGET_DEVICES = ("cuda", "cpu")
_TARGET_VALUES = "'cuda', 'cpu', a GPU name such as 'h100', or None"


def budget_gpu(budget: int | str | None) -> GPU | None:
    """The GPU a budget names (``"h100"``), or ``None`` for bytes and sizes (``"20GiB"``)."""
    if isinstance(budget, str) and budget.strip()[:1].isalpha():
        return gpu_by_name(budget)
    return None


def check_target(target: Any, budget: int | str | None = None) -> str | None:
    """Validate an integration's ``target=``: ``"cuda"``, ``"cpu"``, a GPU name, or ``None`` (the run's device).

    Returns it as given (``"cuda"``/``"cpu"`` lower-cased); raises ``InvalidInputError`` naming the argument
    and the allowed values, or when ``target`` and ``budget`` name two different GPUs.
    """
    if target is None:
        return None
    if not isinstance(target, str) or not target.strip():
        raise InvalidInputError(f"`target` must be {_TARGET_VALUES}, got {target!r}")
    if target.strip().lower() in TARGET_DEVICES:
        return target.strip().lower()
    try:
        gpu = gpu_by_name(target)
    except InvalidInputError as error:
        raise InvalidInputError(f"`target` must be {_TARGET_VALUES}, got {target!r}: {error}") from None
    named = budget_gpu(budget)
    if named is not None and named != gpu:
        raise InvalidInputError(
            f"`budget` names the {named.name} and `target` the {gpu.name}, got budget={budget!r}, target={target!r}: "
            "name one GPU, or give the budget in bytes ('20GiB')"
        )
    return target


@dataclass(frozen=True)
class PlanningTarget:
    """The device a plan is made for, which need not be the one this process runs on.

    Attributes:
        target: the device semantics and CUDA runtime the step is traced with.
        gpu: the catalog GPU named by ``target=`` or ``budget=``, if any.
        budget_bytes: the capacity given (the budget, else the named GPU's memory); ``None``: measure it.
    """

    target: Target
    gpu: GPU | None
    budget_bytes: int | None

    @property
    def include_context(self) -> bool:
        """A CUDA plan against a given capacity counts the CUDA context; a measured one has it outside already."""
        return self.target.device == "cuda" and self.budget_bytes is not None

    def capacity_bytes(self, run_device: torch.device) -> int:
        """``budget_bytes``, else the free memory of the run's device now (``0`` when it cannot be told)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        from memfit.planning.capacity import free_device_bytes

        return free_device_bytes(run_device)

    def check_precision(self, precision: Precision | str) -> None:
        """Refuse a precision the named card cannot run as memfit models it (bf16 on a card without it), as
        ``memfit plan`` does."""
        if self.gpu is not None:
            self.gpu.precision_for(precision)

    def note(self, run_device: torch.device) -> str | None:
        """A sentence for the estimate when the plan is for another device than the one the run uses."""
        if self.target.device == run_device.type:
            return None
        card = f"the {self.gpu.name}" if self.gpu is not None else self.target.device.upper()
        return f"planned for {card} ({self.target.device} semantics); this process runs on {run_device.type}"


def planning_target(target: str | None, budget: int | str | None, run_device: torch.device) -> PlanningTarget:
    """Where to plan for, from an integration's ``target=`` and ``budget=`` and the device the run uses.

    A GPU name (in ``target`` or, with no ``target``, in ``budget``) plans with CUDA semantics and that
    card's runtime, against its memory unless a budget is given, whatever this machine has: a GPU-name
    budget on a CPU box plans for that GPU, not for the CPU. ``"cuda"`` or ``"cpu"`` plan for that device;
    ``None`` for the run's. A device other than the run's needs a budget (or a GPU name), as the run's
    free memory says nothing of it.
    """
    from memfit.planning.capacity import parse_budget

    target = check_target(target, budget)
    budget_bytes, named = parse_budget(budget), budget_gpu(budget)
    if target is None:
        gpu, device = named, "cuda" if named is not None else run_device.type
    elif target in TARGET_DEVICES:
        gpu, device = (named if target == "cuda" else None), target
    else:
        gpu, device = gpu_by_name(target), "cuda"
    if device not in TARGET_DEVICES:
        raise InvalidInputError(
            f"memfit plans CUDA and CPU runs; this one runs on {device}. Pass target='cuda' or a GPU name with a "
            "budget to plan for a GPU"
        )
    if budget_bytes is None and gpu is not None:
        budget_bytes = gpu.memory_bytes
    if budget_bytes is None and device != run_device.type:
        raise InvalidInputError(
            f"target={target!r} plans for {device} but the run uses {run_device.type}, whose free memory says "
            f"nothing of it; pass budget= (bytes, '20GiB' or a GPU name) or name the GPU in target"
        )
    runtime = gpu.runtime if gpu is not None and device == "cuda" else None
    return PlanningTarget(Target(device, runtime=runtime), gpu if device == "cuda" else None, budget_bytes)
