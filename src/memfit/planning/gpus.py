"""Where a plan is for: a GPU name, ``"cuda"``/``"cpu"``, or the run's own device, with the capacity to plan against.

The cards themselves (``GPU``, ``gpu_by_name``, ``known_gpus``) come from the device backends
(``memfit.devices``) and are re-exported here, where users import them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.devices import GPU, backend_for, find_backend, gpu_by_name, known_gpus, registered_backends
from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.tracing.config import Target

__all__ = ["GPU", "PlanningTarget", "budget_gpu", "check_target", "gpu_by_name", "known_gpus", "planning_target"]


def target_devices() -> tuple[str, ...]:
    """The device types a plan can be for: every registered backend's (``"cuda"``, ``"cpu"``)."""
    return tuple(backend.device_type for backend in registered_backends())


def _target_values() -> str:
    return f"{', '.join(repr(name) for name in target_devices())}, a GPU name such as 'h100', or None"


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
        raise InvalidInputError(f"`target` must be {_target_values()}, got {target!r}")
    if target.strip().lower() in target_devices():
        return target.strip().lower()
    try:
        gpu = gpu_by_name(target)
    except InvalidInputError as error:
        raise InvalidInputError(f"`target` must be {_target_values()}, got {target!r}: {error}") from None
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
        target: the device semantics and runtime the step is traced with.
        gpu: the catalog GPU named by ``target=`` or ``budget=``, if any.
        budget_bytes: the capacity given (the budget, else the named GPU's memory); ``None``: measure it.
        device_type: the device planned for, where its backend traces as another (``None``: ``target.device``).
    """

    target: Target
    gpu: GPU | None
    budget_bytes: int | None
    device_type: str | None = None

    @property
    def device(self) -> str:
        """The kind of device planned for (its backend's ``device_type``)."""
        return self.device_type or self.target.device

    @property
    def include_context(self) -> bool:
        """A plan against a given capacity counts the device's context (CUDA's); a measured one has it outside."""
        backend = find_backend(self.device)
        return backend is not None and backend.has_context and self.budget_bytes is not None

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
        if self.device == run_device.type:
            return None
        card = f"the {self.gpu.name}" if self.gpu is not None else self.device.upper()
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
        gpu, device = named, named.device_type if named is not None else run_device.type
    elif target in target_devices():
        gpu, device = (named if named is not None and named.device_type == target else None), target
    else:
        gpu = gpu_by_name(target)
        device = gpu.device_type
    if device not in target_devices():
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
    backend = backend_for(device)
    runtime = backend.runtime_for(gpu) if gpu is not None else None
    traced = Target(backend.trace_device, runtime=runtime)
    return PlanningTarget(traced, gpu, budget_bytes, None if backend.trace_device == device else device)
