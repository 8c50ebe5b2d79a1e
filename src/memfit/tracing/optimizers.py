"""Build the user's optimizer again over fake parameters, so its state is traced too."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from memfit.errors import InvalidInputError

__all__ = ["OPTIMIZER_NAMES", "OptimizerSpec", "build_optimizer", "optimizer_name"]

OptimizerSpec = Optimizer | str | Callable[..., Optimizer] | None

# name -> (class, default kwargs). Names follow the formula tier and common usage.
_BY_NAME: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 1e-3}),
    "sgd-momentum": ("SGD", {"lr": 1e-3, "momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "adafactor": ("Adafactor", {}),
    "adagrad": ("Adagrad", {}),
    "rmsprop": ("RMSprop", {}),
}
OPTIMIZER_NAMES = ("none", *sorted(_BY_NAME))


def optimizer_name(spec: OptimizerSpec) -> str:
    """A readable name for reports: ``AdamW``, ``sgd-momentum``, ``none``."""
    if spec is None:
        return "none"
    if isinstance(spec, str):
        return spec.lower()
    if isinstance(spec, Optimizer):
        return type(spec).__name__
    return getattr(spec, "__name__", None) or getattr(getattr(spec, "func", None), "__name__", type(spec).__name__)


def build_optimizer(
    spec: OptimizerSpec,
    params: Mapping[int, torch.Tensor],
    trainable: Iterable[torch.Tensor],
    *,
    kwargs: Mapping[str, Any] | None = None,
    prefer_foreach: bool = False,
) -> Optimizer | None:
    """Return an optimizer of the user's kind over the fake tensors.

    ``params`` maps ``id(real parameter)`` to its fake twin (to rebuild an existing instance's
    groups); ``trainable`` are the fake parameters that get gradients. ``prefer_foreach`` sets
    ``foreach=True`` where the user left it unset, as torch does by default for CUDA tensors
    (its automatic choice does not recognise fake tensors).
    """
    trainable = list(trainable)
    kwargs = dict(kwargs or {})
    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return None
    if isinstance(spec, str):
        optimizer = _from_name(spec, trainable, kwargs)
    elif isinstance(spec, Optimizer):
        optimizer = _rebuild(spec, params)
    elif callable(spec):
        try:
            optimizer = spec(trainable, **kwargs)
        except Exception as exc:
            raise InvalidInputError(
                f"calling optimizer={optimizer_name(spec)!r} with the model's parameters failed: "
                f"{type(exc).__name__}: {exc}; pass an optimizer class, a name such as 'adamw' or an instance"
            ) from exc
        if not isinstance(optimizer, Optimizer):
            raise InvalidInputError(
                f"optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
    else:
        raise InvalidInputError(
            f"optimizer must be a torch.optim.Optimizer, an optimizer class or factory, a name "
            f"({', '.join(OPTIMIZER_NAMES)}) or None; got {spec!r}"
        )
    if prefer_foreach:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    return optimizer


def _from_name(name: str, trainable: list[torch.Tensor], kwargs: dict[str, Any]) -> Optimizer:
    key = name.lower().replace("_", "-")
    if key in ("adam-8bit", "adamw-8bit", "adam8bit"):
        raise InvalidInputError(
            "optimizer 'adam-8bit' runs bitsandbytes CUDA kernels that a fake-tensor trace cannot run; "
            "use memfit.estimate_from_counts(..., optimizer='adam-8bit') for it"
        )
    if key not in _BY_NAME:
        raise InvalidInputError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    class_name, defaults = _BY_NAME[key]
    cls = getattr(torch.optim, class_name, None)
    if cls is None:
        raise InvalidInputError(f"optimizer {name!r} needs torch.optim.{class_name}, which this torch lacks")
    return cls(trainable, **{**defaults, **kwargs})


def _rebuild(original: Optimizer, params: Mapping[int, torch.Tensor]) -> Optimizer:
    groups = []
    for group in original.param_groups:
        fakes = [params[id(p)] for p in group["params"] if id(p) in params]
        if fakes:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fakes})
    if not groups:
        raise InvalidInputError(
            f"the {type(original).__name__} passed as optimizer holds none of the model's parameters; "
            "build it from model.parameters() or pass its class instead"
        )
    accepted = inspect.signature(type(original).__init__).parameters
    init_kwargs = {k: v for k, v in original.defaults.items() if k in accepted}
    try:
        return type(original)(groups, **init_kwargs)
    except Exception as exc:
        raise InvalidInputError(
            f"could not rebuild {type(original).__name__} for tracing ({type(exc).__name__}: {exc}); "
            "pass its class and keyword arguments instead: optimizer=MyOptimizer, optimizer_kwargs={...}"
        ) from exc
