"""Build the user's optimizer again over fake parameters, so its state is traced too."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch.optim import Optimizer

from memfit.errors import InvalidInputError

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "OptimizerInfo",
    "OptimizerSpec",
    "build_optimizer",
    "optimizer_info",
    "optimizer_name",
]

OptimizerSpec = Optimizer | str | Callable[..., Optimizer] | None


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer known by name: how the trace builds it and what state it keeps per parameter element.

    The formula tier and the host-RAM offload line read ``state_bytes``; the trace builds
    ``torch.optim.<torch_class>`` with ``defaults``. ``states`` are tensors the size of the parameter
    kept in the state dtype (fp32 unless the weights are pure fp16/bf16); ``fixed_bytes`` are bytes
    per element whatever the precision (8-bit states, or a stand-in for factored ones).
    """

    name: str
    aliases: tuple[str, ...] = ()
    torch_class: str | None = None  # None: nothing to build ("none"), or see ``untraceable``
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    states: int = 0
    fixed_bytes: int = 0
    approximate: bool = False  # ``state_bytes`` is a stand-in, not what torch allocates (adafactor)
    untraceable: str | None = None  # why a fake-tensor trace cannot run it

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    def state_bytes(self, state_dtype_bytes: int) -> int:
        """Optimizer state per trainable parameter element, with states of ``state_dtype_bytes`` each."""
        return self.states * state_dtype_bytes + self.fixed_bytes


OPTIMIZERS: Mapping[str, OptimizerInfo] = MappingProxyType({
    info.name: info
    for info in (
        OptimizerInfo("none"),
        OptimizerInfo("sgd", torch_class="SGD", defaults={"lr": 1e-3}),
        OptimizerInfo("sgd-momentum", ("momentum", "sgdm"), "SGD", {"lr": 1e-3, "momentum": 0.9}, states=1),
        OptimizerInfo("adam", torch_class="Adam", states=2),
        OptimizerInfo("adamw", torch_class="AdamW", states=2),
        # Factored second moment, O(rows + cols) per matrix, plus the update: 4 B per element is the
        # figure Hugging Face's "anatomy of model memory" guide uses.
        OptimizerInfo(
            "adafactor",
            torch_class="Adafactor",
            fixed_bytes=4,
            approximate=True,
            untraceable="torch.optim.Adafactor reads tensor values in its step (its step size follows the "
            "parameters' norm), which a fake-tensor trace does not have; use "
            "memfit.estimate_from_counts(..., optimizer='adafactor') for it",
        ),
        OptimizerInfo("adagrad", torch_class="Adagrad", states=1),
        OptimizerInfo("rmsprop", torch_class="RMSprop", states=1),
        OptimizerInfo(
            "adam-8bit",
            ("adamw-8bit", "adam8bit", "adamw8bit", "bnb-adam8bit", "bnb-adamw8bit"),
            fixed_bytes=2,  # two 1-byte states
            untraceable="optimizer 'adam-8bit' runs bitsandbytes CUDA kernels that a fake-tensor trace cannot run; "
            "use memfit.estimate_from_counts(..., optimizer='adam-8bit') for it",
        ),
    )
})  # fmt: skip
"""Every optimizer known by name: the one table the formula tier, the trace, the CLI and the host line read."""

_BY_ALIAS: dict[str, OptimizerInfo] = {key: info for info in OPTIMIZERS.values() for key in (info.name, *info.aliases)}

OPTIMIZER_NAMES = tuple(name for name, info in OPTIMIZERS.items() if info.untraceable is None)
"""Names a trace can build (``estimate(optimizer=...)``, ``memfit plan --optimizer``)."""


def optimizer_info(name: str | None) -> OptimizerInfo:
    """The registry entry for ``name`` or one of its aliases (case-insensitive; ``None`` means ``"none"``)."""
    if name is None:
        return OPTIMIZERS["none"]
    if not isinstance(name, str):
        raise InvalidInputError(f"optimizer must be a name such as 'adamw' or None, got {name!r}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    try:
        return _BY_ALIAS[key]
    except KeyError:
        aliases = ", ".join(sorted(set(_BY_ALIAS) - set(OPTIMIZERS)))
        raise InvalidInputError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)} (or an alias: {aliases}), got {name!r}"
        ) from None


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
    if spec is None:
        return None
    if isinstance(spec, str):
        optimizer = _from_name(spec, trainable, kwargs)
        if optimizer is None:
            return None
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


def _from_name(name: str, trainable: list[torch.Tensor], kwargs: dict[str, Any]) -> Optimizer | None:
    try:
        info = optimizer_info(name)
    except InvalidInputError:
        raise InvalidInputError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}") from None
    if info.name == "none":
        return None
    if info.untraceable is not None:
        raise InvalidInputError(info.untraceable)
    cls = getattr(torch.optim, info.torch_class, None) if info.torch_class else None
    if cls is None:
        raise InvalidInputError(f"optimizer {name!r} needs torch.optim.{info.torch_class}, which this torch lacks")
    return cls(trainable, **{**info.defaults, **kwargs})


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
